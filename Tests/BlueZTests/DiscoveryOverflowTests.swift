// A discovery whose consumer falls behind: its events are bounded, the overflow is counted and logged, and the
// consumer then gets the current devices from the tree, including `lost` for a device removed while its own `lost`
// event was dropped.
import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

@testable import BlueZ

@Suite struct ResyncingBufferTests {
    @Test func aFullBufferDropsCountsAndThenResynchronises() async throws {
        let snapshot = Mutex([100, 101])
        let overflows = Mutex<[Int]>([])
        let buffer = ResyncingBuffer<Int>(
            capacity: 3, resync: { snapshot.withLock { $0 } }, onOverflow: { n in overflows.withLock { $0.append(n) } })
        for i in 0..<10 { buffer.push(i) }
        #expect(buffer.droppedCount == 7)
        #expect(buffer.peakCount == 3)
        #expect(overflows.withLock { $0 } == [1], "one log line per overflow, not one per dropped event")
        var got: [Int] = []
        for _ in 0..<5 { if let v = await buffer.next() { got.append(v) } }
        // What was queued, then the current state in place of what was dropped.
        #expect(got == [0, 1, 2, 100, 101])
        // Caught up: new events flow again, handed straight to a waiting consumer.
        let waiter = Task { await buffer.next() }
        while !Task.isCancelled {
            buffer.push(7)
            break
        }
        #expect(await waiter.value == 7)
        buffer.push(8)
        buffer.finish()
        #expect(await buffer.next() == 8)
        #expect(await buffer.next() == nil)
    }

    @Test func aCancelledWaitReturnsNilAndDropsItsWaiter() async throws {
        let buffer = ResyncingBuffer<Int>(capacity: 4, resync: { [] })
        let waiter = Task { await buffer.next() }
        waiter.cancel()
        #expect(await waiter.value == nil)
        buffer.push(1)
        #expect(await buffer.next() == 1, "the event went to the queue, not to the cancelled waiter")
    }

    @Test func normaliseSkipsWhatTheConsumerNeedNotSee() async throws {
        let buffer = ResyncingBuffer<Int>(capacity: 8, resync: { [] }, normalize: { $0 % 2 == 0 ? $0 : nil })
        for i in 0..<5 { buffer.push(i) }
        buffer.finish()
        var got: [Int] = []
        while let v = await buffer.next() { got.append(v) }
        #expect(got == [0, 2, 4])
    }
}

@Suite struct ResyncingBufferDirectTests {
    @Test func aDirectConsumerGetsEachEventAtOnceAsMadeAndNothingAfterFinish() async throws {
        let got = Mutex<[Int]>([])
        // The normalisation is the queue's: a direct consumer gets what the producer made.
        let buffer = ResyncingBuffer<Int>(
            capacity: 1, resync: { [] }, normalize: { _ in nil }, direct: { v in got.withLock { $0.append(v) } })
        for i in 0..<10 { buffer.emit { i % 2 == 0 ? i : nil } }
        // Far beyond the capacity of 1, and nothing dropped: no queue is involved.
        #expect(got.withLock { $0 } == [0, 2, 4, 6, 8])
        #expect(buffer.droppedCount == 0)
        buffer.finish()
        let made = Mutex(false)
        buffer.emit {
            made.withLock { $0 = true }
            return 10
        }
        buffer.push(11)
        #expect(made.withLock { $0 }, "what the producer does while making the event is still done after the end")
        #expect(got.withLock { $0 } == [0, 2, 4, 6, 8], "nothing reaches the consumer after finish()")
        #expect(await buffer.next() == nil, "the sequence only ends")
    }

    /// Four threads make numbered events from one counter: the consumer gets them in the order they were made
    /// (with a push after making, a thread that took a number could be overtaken by one that took the next).
    @Test func eventsMadeOnSeveralThreadsReachTheConsumerInTheOrderTheyWereMade() async throws {
        let got = Mutex<[Int]>([])
        let counter = Mutex(0)
        let buffer = ResyncingBuffer<Int>(capacity: 1, resync: { [] }, direct: { v in got.withLock { $0.append(v) } })
        let threads = (0..<4).map { _ in
            Thread {
                for _ in 0..<2_000 {
                    buffer.emit {
                        counter.withLock { n in
                            n += 1
                            return n
                        }
                    }
                }
            }
        }
        for t in threads { t.start() }
        try await eventually(20, "8,000 events") { got.withLock { $0.count } == 8_000 }
        #expect(got.withLock { $0 } == Array(1...8_000))
    }

    @Test func emitAllDeliversTheEventsOfOneStepTogetherAndQueuesThemWithoutAConsumer() async throws {
        let got = Mutex<[Int]>([])
        let direct = ResyncingBuffer<Int>(capacity: 1, resync: { [] }, direct: { v in got.withLock { $0.append(v) } })
        direct.emit(all: { [3, 1, 2] })
        #expect(got.withLock { $0 } == [3, 1, 2])
        let queued = ResyncingBuffer<Int>(capacity: 8, resync: { [] }, normalize: { $0 == 1 ? nil : $0 })
        queued.emit(all: { [3, 1, 2] })
        queued.emit { 4 }
        queued.finish()
        var taken: [Int] = []
        while let v = await queued.next() { taken.append(v) }
        #expect(taken == [3, 2, 4], "queued events are normalised as they are taken")
    }
}

@Suite struct DiscoveryConsumerTests {
    @Test func aConsumerGetsTheEventsOnTheIOThreadAsTheyHappen() async throws {
        let scenario = fastBeaconScenario
        let t = try await SimClient(scenario)
        struct Seen {
            var story: [String: [String]] = [:]
            var threads: [String: [String: Int]] = [:]
            var count = 0
        }
        let seen = Mutex(Seen())
        let discovery = try await t.client.startDiscovery(
            on: try await t.adapter,
            filter: BlueZDiscoveryFilter(duplicateData: true, watchdogInterval: nil, eventCapacity: 4)
        ) { event in
            let word: String
            switch event {
            case .appeared: word = "appeared"
            case .updated: word = "updated"
            case .lost: word = "lost"
            }
            let thread = currentThreadName()
            seen.withLock { s in
                s.story[event.device.address, default: []].append(word)
                s.threads[word, default: [:]][thread, default: 0] += 1
                s.count += 1
            }
        }
        // Well beyond the event capacity of 4 with nobody reading `events`: nothing is queued, nothing dropped.
        try await eventually(10, "many advertisements") { seen.withLock { $0.count } > 100 }
        let gone = fastBeacons[1]
        _ = try await t.simulator("RemovePeripheral", [.string(gone)])
        try await eventually(10, "the removed device reported lost") {
            seen.withLock { $0.story[gone]?.last } == "lost"
        }
        #expect(discovery.droppedEvents == 0)
        let s = seen.withLock { $0 }
        for address in fastBeacons {
            let story = s.story[address] ?? []
            #expect(story.first == "appeared", "\(address) began with \(story.first ?? "-")")
            #expect(story.filter { $0 == "appeared" }.count == 1, "\(address) appeared more than once")
        }
        // Advertisements and the removal come from bluetoothd's signals, handled on the D-Bus I/O thread; only
        // the start, which reports each device already in the tree once, runs on the starting task's thread.
        let updated = s.threads["updated"] ?? [:]
        #expect((updated["dbus-io"] ?? 0) > 90)
        #expect(updated.filter { $0.key != "dbus-io" }.values.reduce(0, +) <= fastBeacons.count)
        #expect(s.threads["lost"] == ["dbus-io": 1])
        // stop() ends the (empty) sequence (that nothing reaches the consumer after it is ResyncingBuffer's
        // finish(), tested above).
        await discovery.stop()
        try await within(10, "the end of the events") { for await _ in discovery.events {} }
    }
}

let fastBeacons = ["C0:FF:EE:00:01:01", "C0:FF:EE:00:01:02", "C0:FF:EE:00:01:03"]

/// Three beacons advertising every 20 ms with a jittering RSSI (so that every advertisement is a change).
let fastBeaconScenario =
    """
    settings: {temporary_timeout: 30}
    adapters: [{id: hci0, address: "00:1A:7D:DA:71:10"}]
    peripherals:
    """
    + fastBeacons.map {
        "\n  - {address: \"\($0)\", connectable: false, rssi: -60, rssi_jitter: 8, "
            + "advertising_interval: 0.02, service_uuids: [FEAA]}"
    }.joined()

@Suite struct DiscoveryOverflowTests {
    @Test func aSlowConsumerIsToldOfADeviceLostWhileItsEventsWereDropped() async throws {
        let scenario = fastBeaconScenario
        let t = try await SimClient(scenario)
        let discovery = try await t.client.startDiscovery(
            on: try await t.adapter,
            filter: BlueZDiscoveryFilter(duplicateData: true, watchdogInterval: nil, eventCapacity: 8))
        // Nobody reads: the buffer fills and events are dropped (counted), memory stays bounded.
        try await eventually(10, "events dropped") { discovery.droppedEvents > 20 }
        // A device goes away while its `lost` cannot be queued.
        let gone = fastBeacons[1]
        _ = try await t.simulator("RemovePeripheral", [.string(gone)])
        try await eventually(10, "the device out of the tree") { t.client.device(address: gone) == nil }
        #expect(discovery.continuation.peakCount <= 8)
        // The consumer catches up: the queued events, then the current devices and the lost one.
        var story: [String: [String]] = [:]
        var iterator = discovery.events.makeAsyncIterator()
        let deadline = ContinuousClock.now + .seconds(20)
        while ContinuousClock.now < deadline, story[gone]?.last != "lost" {
            guard let e = await iterator.next() else { break }
            let word: String
            switch e {
            case .appeared: word = "appeared"
            case .updated: word = "updated"
            case .lost: word = "lost"
            }
            story[e.device.address, default: []].append(word)
        }
        #expect(story[gone]?.last == "lost", "the removed device was never reported lost: \(story[gone] ?? [])")
        for address in fastBeacons {
            let s = story[address] ?? []
            #expect(s.filter { $0 == "appeared" }.count <= 1, "\(address) appeared twice: \(s)")
            #expect(s.first != "updated" && s.first != "lost", "\(address) began with \(s.first ?? "-")")
        }
        await discovery.stop()
    }
}

@Suite struct NotificationOverflowTests {
    @Test func aConsumerThatFallsBehindKeepsTheNewestValuesAndTheDropsAreCounted() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        // StartNotify: every value is a signal the client takes off the bus, whether the consumer reads or not.
        let values = try await p.notifications(for: try p.characteristic("2A37"), preferAcquire: false)
        // 6000 notifications while nobody reads: 4096 wait, the oldest 1904 are dropped and counted.
        let count: UInt32 = 6000
        let sent = try await t.simulator("Burst", [.string(strap), .string("2A37"), .uint32(count)])
        #expect(sent.first?.uint32 == count)
        try await eventually(10, "values dropped") { values.droppedValues == Int(count) - 4096 }
        let received = try await within(10, "the queued values") {
            var seen: [UInt32] = []
            for try await v in values {
                guard v.count == 4 else { continue }
                seen.append(UInt32(v[0]) | UInt32(v[1]) << 8 | UInt32(v[2]) << 16 | UInt32(v[3]) << 24)
                if seen.last == count - 1 { break }
            }
            return seen
        }
        #expect(received == Array((count - 4096)..<count), "the newest 4096, in order")
        await p.disconnect()
    }
}

@Suite struct MirrorOverflowTests {
    @Test func aBurstFarBeyondAnyBufferLeavesTheMirrorWhereBluetoothdIs() async throws {
        // The mirror applies bluetoothd's signals on the D-Bus I/O thread as they are dispatched: nothing queues
        // between the bus and the mirror, so nothing can be dropped there, however fast the signals come.
        let t = try await SimClient()
        let p = try await t.connect()
        let characteristic = try p.characteristic("2A37")
        let values = try await p.notifications(for: characteristic, preferAcquire: false)
        _ = values
        let count: UInt32 = 20000
        _ = try await t.simulator("Burst", [.string(strap), .string("2A37"), .uint32(count)])
        // While the burst is still being signalled, a device goes away.
        _ = try await t.simulator("RemovePeripheral", [.string(beacon)])
        // The mirror ends where bluetoothd is: the beacon gone, the burst's last value in place.
        let last: [UInt8] = [UInt8((count - 1) & 0xFF), UInt8(((count - 1) >> 8) & 0xFF), 0, 0]
        try await eventually(20, "the mirror consistent with the simulator") {
            t.client.device(address: beacon) == nil && p.refreshed(characteristic)?.value == last
        }
        await p.disconnect()
    }
}
