// Notification streams in a daemon that runs for months: zero-length notifications, subscriptions BlueZ ends while
// the link stays up (and re-subscribing), and waits and connects that are cancelled. Faults come from bluez-sim.
import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

@testable import BlueZ

/// The error a notification stream ended with (nil when it ended normally).
func streamEnd(_ iterator: inout BlueZNotifications.AsyncIterator) async -> BlueZError? {
    do {
        while try await iterator.next() != nil {}
        return nil
    } catch let error as BlueZError {
        return error
    } catch {
        Issue.record("expected a BlueZError, got \(error)")
        return nil
    }
}

@Suite struct NotificationLifetimeTests {
    @Test func zeroLengthNotificationIsAnEmptyValueNotTheEnd() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let hr = try p.characteristic("2A37")
        let values = try await p.notifications(for: hr)
        try await eventually(10, "NotifyAcquired") { p.refreshed(hr)?.notifyAcquireAvailable == true }
        for v: [UInt8] in [[], [0x00, 0x48], [], []] {
            try await t.simulator("PushNotification", [.string(strap), .string("2A37"), .bytes(v)])
        }
        let got = try await within(5, "four notifications, two of them empty") {
            var out: [[UInt8]] = []
            for try await v in values {
                out.append(v)
                if out.count == 4 { break }
            }
            return out
        }
        #expect(got == [[], [0x00, 0x48], [], []])
        #expect(p.isConnected)
        await p.disconnect()
    }

    /// With a consumer, every value of a burst reaches it in order (straight from the reader thread); the stream
    /// carries none and only ends. Under such load the reader delivers in rounds, each announced to observers.
    @Test func consumerGetsEveryValueInOrderAndRoundsUnderLoadAreObserved() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let hr = try p.characteristic("2A37")
        struct Rounds {
            var begun = 0
            var ended = 0
            var open = false
            var nested = false
        }
        let rounds = Mutex(Rounds())
        let token = BlueZNotificationRounds.observe(
            .init(
                begin: {
                    rounds.withLock {
                        if $0.open { $0.nested = true }
                        $0.open = true
                        $0.begun += 1
                    }
                },
                end: {
                    rounds.withLock {
                        $0.open = false
                        $0.ended += 1
                    }
                }))
        defer { BlueZNotificationRounds.stopObserving(token) }
        let got = Mutex<[UInt32]>([])
        let values = try await p.notifications(
            for: hr, mapError: { $0 },
            consumer: { v in
                guard v.count == 4 else { return }
                let n = UInt32(v[0]) | UInt32(v[1]) << 8 | UInt32(v[2]) << 16 | UInt32(v[3]) << 24
                got.withLock { $0.append(n) }
            })
        try await eventually(10, "NotifyAcquired") { p.refreshed(hr)?.notifyAcquireAvailable == true }
        _ = try await t.simulator("Burst", [.string(strap), .string("2A37"), .uint32(200)])
        try await eventually(20, "200 values at the consumer") { got.withLock { $0.count } == 200 }
        let sequence = got.withLock { $0 }
        #expect(zip(sequence, sequence.dropFirst()).allSatisfy { $1 == $0 &+ 1 })
        // Load: notifications every 0.5 ms wake the reader again within 2 ms, so it delivers in rounds.
        _ = try await t.simulator("SetNotificationRate", [.string(strap), .string("2A37"), .double(2000)])
        try await eventually(10, "a round under load") { rounds.withLock { $0.begun } > 0 }
        _ = try await t.simulator("SetNotificationRate", [.string(strap), .string("2A37"), .double(0)])
        #expect(!rounds.withLock { $0.nested })
        // The stream held no values: stopped, it ends at once, empty.
        await p.stopNotifications(for: hr)
        let rest = try await within(5, "the stream's end") {
            var count = 0
            for try await _ in values { count += 1 }
            return count
        }
        #expect(rest == 0)
        await p.disconnect()
    }

    @Test func closedNotifySocketEndsTheStreamWithAReasonAndResubscribes() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let hr = try p.characteristic("2A37")
        let values = try await p.notifications(for: hr)
        try await t.simulator("PushNotification", [.string(strap), .string("2A37"), .bytes([1])])
        let (first, ended) = try await within(5, "a notification, then the end of the stream") {
            var iterator = values.makeAsyncIterator()
            let first = try await iterator.next()
            // bluetoothd closes the AcquireNotify socket while the device stays connected.
            try await t.simulator("EndNotify", [.string(strap), .string("2A37")])
            return (first, await streamEnd(&iterator))
        }
        #expect(first == [1])
        guard case .notificationsEnded(let device, let characteristic, let reason)? = ended else {
            Issue.record("expected notificationsEnded, got \(String(describing: ended))")
            return
        }
        #expect(device.address == strap)
        #expect(characteristic == "2A37")
        #expect(reason.contains("closed the notification socket"))
        #expect(ended?.description.hasSuffix("subscribe again") == true)
        #expect(p.isConnected)
        // The consumer subscribes again and gets notifications.
        try await eventually(10, "NotifyAcquired false") { p.refreshed(hr)?.notifyAcquireAvailable == true }
        let again = try await p.notifications(for: hr)
        try await t.simulator("PushNotification", [.string(strap), .string("2A37"), .bytes([2])])
        let next = try await within(5, "a notification after re-subscribing") {
            var it = again.makeAsyncIterator()
            return try await it.next()
        }
        #expect(next == [2])
        await p.disconnect()
    }

    @Test func endedStartNotifySessionEndsTheStreamAndResubscribes() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let battery = try p.characteristic("2A19")
        let values = try await p.notifications(for: battery, preferAcquire: false)
        try await eventually(10, "Notifying") { p.refreshed(battery)?.notifying == true }
        try await t.simulator("EndNotify", [.string(strap), .string("2A19")])
        let ended = try await within(5, "the stream to end") { () async -> BlueZError? in
            var it = values.makeAsyncIterator()
            return await streamEnd(&it)
        }
        guard case .notificationsEnded(_, "2A19", let reason)? = ended else {
            Issue.record("expected notificationsEnded, got \(String(describing: ended))")
            return
        }
        #expect(reason.contains("Notifying"))
        let again = try await p.notifications(for: battery, preferAcquire: false)
        try await eventually(10, "Notifying again") { p.refreshed(battery)?.notifying == true }
        try await t.simulator("PushNotification", [.string(strap), .string("2A19"), .bytes([0x42])])
        let next = try await within(5, "a notification after re-subscribing") {
            var it = again.makeAsyncIterator()
            return try await it.next()
        }
        #expect(next == [0x42])
        await p.disconnect()
    }

    @Test func serviceChangedEndsTheStreamAndResubscribes() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let battery = try p.characteristic("2A19")
        let values = try await p.notifications(for: battery, preferAcquire: false)
        try await eventually(10, "Notifying") { p.refreshed(battery)?.notifying == true }
        try await t.simulator("ServiceChanged", [.string(strap)])
        let ended = try await within(5, "the stream to end") { () async -> BlueZError? in
            var it = values.makeAsyncIterator()
            return await streamEnd(&it)
        }
        guard case .notificationsEnded(_, "2A19", let reason)? = ended else {
            Issue.record("expected notificationsEnded, got \(String(describing: ended))")
            return
        }
        #expect(reason.contains("Service Changed"))
        #expect(p.isConnected)
        try await eventually(5, "the services back") { p.refreshed(battery) != nil }
        let again = try await p.notifications(for: try p.characteristic("2A19"), preferAcquire: false)
        try await eventually(10, "Notifying again") { p.refreshed(battery)?.notifying == true }
        try await t.simulator("PushNotification", [.string(strap), .string("2A19"), .bytes([0x43])])
        let next = try await within(5, "a notification after re-subscribing") {
            var it = again.makeAsyncIterator()
            return try await it.next()
        }
        #expect(next == [0x43])
        await p.disconnect()
    }

    @Test func cancelledConnectIsCancelledNotAFailure() async throws {
        let t = try await SimClient()
        let device = try await t.discover(strap)
        try await t.fault(strap, "connect-no-reply")
        let attempt = Task { () async -> BlueZError? in
            do {
                _ = try await t.client.connect(device, options: BlueZConnectOptions(timeout: .seconds(20)))
                return nil
            } catch let error as BlueZError {
                return error
            } catch {
                return nil
            }
        }
        try await eventually(10, "Connect() to be pending") { try await t.counter("connect_calls") == 1 }
        attempt.cancel()
        let error = try await within(5, "the cancelled connect to return") { await attempt.value }
        guard case .cancelled(let operation)? = error else {
            Issue.record("expected cancelled, got \(String(describing: error))")
            return
        }
        #expect(operation.hasSuffix("connect"))
        // The pending Connect() was cancelled on BlueZ's side too: the next one is not answered InProgress.
        let p = try await t.client.connect(device, options: BlueZConnectOptions(timeout: .seconds(3)))
        #expect(p.isConnected)
        await p.disconnect()
    }

    @Test func cancelledDisconnectionWaitReturnsAndDropsItsWaiter() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let waiter = Task { () async -> BlueZError? in
            do {
                _ = try await p.disconnectionReason()
                return nil
            } catch let error as BlueZError {
                return error
            } catch {
                return nil
            }
        }
        try await eventually(5, "the waiter to be registered") { p.disconnectionWaiterCount == 1 }
        waiter.cancel()
        let error = try await within(5, "the cancelled wait to return") { await waiter.value }
        guard case .cancelled? = error else {
            Issue.record("expected cancelled, got \(String(describing: error))")
            return
        }
        #expect(p.disconnectionWaiterCount == 0)
        #expect(p.isConnected)
        await p.disconnect()
    }

    /// A consumer that only waits for the end (the bridge) is told of it by callback: no task waits on the stream.
    @Test func endedCallbackTellsWhySubscriptionsEndAndNotAFailedStart() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let hr = try p.characteristic("2A37")
        let battery = try p.characteristic("2A19")
        let got = Mutex<[[UInt8]]>([])
        let ends = Mutex<[String]>([])
        let held = try await p.notifications(
            for: hr, mapError: { $0 }, consumer: { v in got.withLock { $0.append(v) } },
            ended: { e in ends.withLock { $0.append(e.map { "\($0)" } ?? "finished") } })
        try await t.simulator("PushNotification", [.string(strap), .string("2A37"), .bytes([7])])
        try await eventually(5, "the value at the consumer") { got.withLock { $0 } == [[7]] }
        #expect(ends.withLock { $0 }.isEmpty)
        // bluetoothd closes the AcquireNotify socket while the link stays up: told once, with the reason.
        try await t.simulator("EndNotify", [.string(strap), .string("2A37")])
        try await eventually(5, "the end told") { ends.withLock { $0.count } == 1 }
        #expect(ends.withLock { $0 }.first?.contains("closed the notification socket") == true, "\(ends.withLock { $0 })")
        withExtendedLifetime(held) {}
        // A stream dropped without being iterated stops its subscription: the battery's StartNotify session goes
        // (Notifying false in BlueZ), and its own `ended` says it finished.
        let batteryEnds = Mutex<[String]>([])
        var batteryValues: BlueZNotifications? = try await p.notifications(
            for: battery, preferAcquire: false, mapError: { $0 }, consumer: { _ in },
            ended: { e in batteryEnds.withLock { $0.append(e.map { "\($0)" } ?? "finished") } })
        try await eventually(5, "Notifying true") { p.refreshed(battery)?.notifying == true }
        #expect(batteryValues != nil)
        batteryValues = nil
        try await eventually(5, "the dropped stream's subscription stopped") {
            p.refreshed(battery)?.notifying == false
        }
        // Told when StopNotify has answered, which may come after the mirror saw Notifying false.
        try await eventually(5, "the dropped stream's end told") { !batteryEnds.withLock { $0 }.isEmpty }
        #expect(batteryEnds.withLock { $0 } == ["finished"])
        await p.disconnect()
    }

    /// `onDisconnection` handlers run once when the link ends (at once when it has), and a removed one never.
    @Test func disconnectionHandlersRunOnceAndRemovedOnesNever() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let told = Mutex<[String]>([])
        let first = p.onDisconnection { r in told.withLock { $0.append("first \(r.kind)") } }
        let removed = p.onDisconnection { _ in told.withLock { $0.append("removed") } }
        #expect(first != nil && removed != nil)
        #expect(p.disconnectionWaiterCount == 2)
        p.removeDisconnectionHandler(removed!)
        #expect(p.disconnectionWaiterCount == 1)
        try await t.simulator("Disconnect", [.string(strap), .string("remote")])
        _ = await p.waitForDisconnection()
        #expect(told.withLock { $0 } == ["first remote"])
        #expect(p.disconnectionWaiterCount == 0)
        // Registered after the end: called at once, on this thread, with the same reason.
        let late = p.onDisconnection { r in told.withLock { $0.append("late \(r.kind)") } }
        #expect(late == nil)
        #expect(told.withLock { $0 } == ["first remote", "late remote"])
    }
}
