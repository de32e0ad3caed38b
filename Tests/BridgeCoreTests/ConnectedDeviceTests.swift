// Connected devices: a session starts on the first advertisement, subscribes, streams, and reconnects (or not)
// according to why the link ended; connection slots per adapter.
@testable import BridgeCore
import GATT
import Synchronization
import Testing

/// A heart-rate strap: 2A37 (notify), 2A38 (read), battery 2A19 (read, notify), and a vendor characteristic that
/// notifies but has no parser.
struct Strap {
    static let heartRate = BluetoothUUID(UInt16(0x2A37))
    static let bodySensorLocation = BluetoothUUID(UInt16(0x2A38))
    static let battery = BluetoothUUID(UInt16(0x2A19))
    static let heartRateService = BluetoothUUID(UInt16(0x180D))
    static let batteryService = BluetoothUUID(UInt16(0x180F))

    static func characteristics() throws -> [BLECharacteristic] {
        let vendorService = try uuid("6e400001-b5a3-f393-e0a9-e50e24dcca9e")
        let vendor = try uuid("6e400003-b5a3-f393-e0a9-e50e24dcca9e")
        return [
            characteristic(heartRate, service: heartRateService, ["notify"]),
            characteristic(bodySensorLocation, service: heartRateService, ["read"]),
            characteristic(battery, service: batteryService, ["read", "notify"]),
            characteristic(vendor, service: vendorService, ["notify"]),
        ]
    }

    static func add(_ central: FakeCentral, _ address: BLEAddress) throws {
        central.addDevice(address, try characteristics(), values: [bodySensorLocation: [0x01], battery: [0x64]])
    }
}

@Suite struct ConnectedDeviceTests {
    static let strapAddress = "C0:FF:EE:00:00:01"

    /// Advertises the strap and waits until its session streams (both subscriptions made, availability online).
    func connect(_ h: BridgeHarness, _ strap: BLEAddress, connection: Int = 1) async throws -> FakeLink {
        h.central.advertise(strap, name: "Polar H10", rssi: -55, services: [Strap.heartRateService])
        try await eventually("connection \(connection)") { h.central.links(to: strap).count >= connection }
        let link = try #require(h.central.links(to: strap).last)
        try await h.mqtt.waitForMessage(
            on: "blebridge/chest_strap/availability", skip: 2 * (connection - 1),
            where: { $0.text == #"{"state":"online"}"# })
        return link
    }

    @Test func aDeviceAnEarlierRunLeftConnectedIsTakenOverWithoutAnAdvertisement() async throws {
        // bluetoothd keeps a link when the process that made it dies: the device does not advertise again.
        let strap = try address(Self.strapAddress)
        try await withBridge(
            docsConfig,
            setup: {
                try Strap.add($0, strap)
                $0.leaveConnected(strap, services: [Strap.heartRateService])
            }
        ) { h in
            try await eventually("connected") { !h.central.links(to: strap).isEmpty }
            #expect(h.central.attempts == [FakeCentral.Attempt(address: strap, adapter: "hci0")])
            let link = try #require(h.central.links(to: strap).last)
            // A notification before the subscription would be dropped (as by bluetoothd): wait for it.
            try await eventually("subscribed") { link.subscriptions.contains(Strap.heartRate) }
            link.notify(Strap.heartRate, [0x00, 0x48])
            let state = try await h.mqtt.waitForJSON(on: "blebridge/chest_strap") { $0["heart_rate_bpm"] != nil }
            #expect(state["heart_rate_bpm"] == .int(72))
            #expect(h.logs.entries.contains { $0.message.contains("by an earlier run") })
            #expect(h.central.disconnected.isEmpty)
        }
    }

    @Test func firstAdvertisementStartsAStreamingSession() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(docsConfig, setup: { try Strap.add($0, strap) }) { h in
            #expect(h.central.attempts.isEmpty)
            let link = try await connect(h, strap)
            #expect(h.central.attempts == [FakeCentral.Attempt(address: strap, adapter: "hci0")])
            // Every notifying characteristic with a parser, and nothing else.
            #expect(Set(link.subscriptions) == [Strap.heartRate, Strap.battery])

            link.notify(Strap.heartRate, [0x00, 0x48])
            let state = try await h.mqtt.waitForJSON(on: "blebridge/chest_strap") { $0["heart_rate_bpm"] != nil }
            #expect(state["heart_rate_bpm"] == .int(72))
            #expect(state["rssi"] == .int(-55))
            link.notify(Strap.battery, [0x57])
            let next = try await h.mqtt.waitForJSON(on: "blebridge/chest_strap") { $0["battery_pct"] != nil }
            #expect(next["battery_pct"] == .int(87))
            #expect(next["heart_rate_bpm"] == .int(72))
            #expect(h.bridge.counters.notifications == 2)

            let event = try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") {
                $0["type"] == .string("connected")
            }
            #expect(event["data"]?["id"] == .string("chest_strap"))
            #expect(event["data"]?["address"] == .string(Self.strapAddress))
            #expect(event["data"]?["adapter"] == .string("hci0"))
        }
    }

    @Test func lostLinkGoesOfflineAndReconnects() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(docsConfig, setup: { try Strap.add($0, strap) }) { h in
            let link = try await connect(h, strap)
            link.drop(requested: false, reason: "org.bluez.Reason.Timeout")
            let offline = try await h.mqtt.waitForMessage(on: "blebridge/chest_strap/availability", skip: 1)
            #expect(offline.text == #"{"state":"offline"}"#)
            let event = try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") {
                $0["type"] == .string("disconnected")
            }
            #expect(event["data"]?["id"] == .string("chest_strap"))
            #expect(event["data"]?["reason"]?.string?.contains("org.bluez.Reason.Timeout") == true)

            // A short pause (not a backoff) lets BlueZ tear the link down, then it reconnects.
            try await eventually("the reconnect pause, got \(h.clock.pendingDelays)") {
                h.clock.hasSleeper(in: .milliseconds(100)...(.milliseconds(300)))
            }
            #expect(h.central.attempts.count == 1)
            h.clock.advance(by: .milliseconds(300))
            let second = try await connect(h, strap, connection: 2)
            #expect(h.central.attempts.count == 2)
            #expect(Set(second.subscriptions) == [Strap.heartRate, Strap.battery])
            second.notify(Strap.heartRate, [0x00, 0x50])
            try await h.mqtt.waitForJSON(on: "blebridge/chest_strap") { $0["heart_rate_bpm"] == .int(80) }
        }
    }

    @Test func requestedDisconnectionDoesNotReconnect() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(docsConfig, setup: { try Strap.add($0, strap) }) { h in
            let link = try await connect(h, strap)
            link.drop(requested: true, reason: "disconnected by the bridge")
            try await h.mqtt.waitForMessage(on: "blebridge/chest_strap/availability", skip: 1) {
                $0.text == #"{"state":"offline"}"#
            }
            try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") {
                $0["type"] == .string("disconnected") && $0["data"]?["reason"] == .string("requested")
            }
            for step in 1...5 {
                h.clock.advance(by: .seconds(10))
                try await eventually("the ticker ran at \(step * 10) s") {
                    h.clock.hasSleeper(after: .seconds(10 * step))
                }
            }
            #expect(h.central.attempts.count == 1)
            // bridge/devices must not keep showing a session that ended as streaming.
            let devices = try await h.request("devices")
            let entry = devices["data"]?["devices"]?.items?.first { $0["id"] == .string("chest_strap") }
            #expect(entry?["availability"] == .string("offline"))
            #expect(entry?["state"] != .string("streaming"), "\(entry?.text ?? "no entry")")
        }
    }

    /// The strap's next `count` subscriptions to 2A37 fail with an ATT error (a CCC write that failed).
    func withStrapFailingHeartRateSubscriptions(_ count: Int, _ body: (BridgeHarness) async throws -> Void)
        async throws
    {
        let strap = try address(Self.strapAddress)
        let failure = BLEError(
            .failed, name: "org.bluez.Error.Failed", message: "Operation failed with ATT error: 0x0e")
        try await withBridge(
            docsConfig,
            setup: { c in
                try Strap.add(c, strap)
                c.failSubscriptions(to: strap, Strap.heartRate, with: Array(repeating: failure, count: count))
            }, body)
    }

    /// A subscription that fails once (bluetoothd just restarted, the CCC write failed) is tried again 0.5 s later
    /// on the same connection; the device then streams it.
    @Test func aSubscriptionThatFailsOnceIsTriedAgain() async throws {
        let strap = try address(Self.strapAddress)
        try await withStrapFailingHeartRateSubscriptions(1) { h in
            h.central.advertise(strap, services: [Strap.heartRateService])
            try await eventually("the retry's delay, got \(h.clock.pendingDelays)") {
                h.clock.hasSleeper(in: .milliseconds(500)...(.milliseconds(500)))
            }
            let link = try #require(h.central.links(to: strap).first)
            #expect(!link.subscriptions.contains(Strap.heartRate))
            h.clock.advance(by: .milliseconds(500))
            try await h.mqtt.waitForMessage(
                on: "blebridge/chest_strap/availability", where: { $0.text == #"{"state":"online"}"# })
            #expect(Set(link.subscriptions) == [Strap.heartRate, Strap.battery])
            link.notify(Strap.heartRate, [0x00, 0x48])
            let state = try await h.mqtt.waitForJSON(on: "blebridge/chest_strap") { $0["heart_rate_bpm"] != nil }
            #expect(state["heart_rate_bpm"] == .int(72))
            #expect(h.central.attempts.count == 1)
            #expect(link.state.withLock { $0.disconnectCalls } == 0)
        }
    }

    /// A subscription that still fails after three tries (0, 0.5 and 1.5 s) ends the connection instead of leaving
    /// the device online without it: the bridge disconnects, backs off and connects again.
    @Test func aSubscriptionThatKeepsFailingEndsTheConnectionAndIsRetried() async throws {
        let strap = try address(Self.strapAddress)
        try await withStrapFailingHeartRateSubscriptions(3) { h in
            let start = h.clock.now
            h.central.advertise(strap, services: [Strap.heartRateService])
            try await eventually("the first connection") { !h.central.links(to: strap).isEmpty }
            let first = try #require(h.central.links(to: strap).first)
            // Time moves on in small steps (other timers sleep too) until the bridge gives up on the connection.
            try await eventually("our own disconnect after three tries") {
                if first.state.withLock({ $0.disconnectCalls }) == 1 { return true }
                h.clock.advance(by: .milliseconds(100))
                return false
            }
            #expect(h.clock.now - start >= .milliseconds(1500), "the tries were 0.5 s and 1 s apart")
            #expect(h.logs.entries.filter { $0.message.hasSuffix("0x0e; trying again") }.count == 2)
            #expect(
                h.logs.entries.contains {
                    $0.message.contains("cannot subscribe to 2A37") && $0.message.contains("3 attempts; reconnecting")
                })
            // Never online on the connection that could not subscribe.
            #expect(
                h.mqtt.messages(on: "blebridge/chest_strap/availability").allSatisfy { !$0.text.contains("online") })
            // Backoff (ReconnectPolicy: 1 s ± 20 % after a first failure), then a second connection that subscribes.
            try await eventually("the reconnect") {
                if h.central.links(to: strap).count == 2 { return true }
                h.clock.advance(by: .milliseconds(100))
                return false
            }
            try await h.mqtt.waitForMessage(
                on: "blebridge/chest_strap/availability", where: { $0.text == #"{"state":"online"}"# })
            let second = try #require(h.central.links(to: strap).last)
            #expect(Set(second.subscriptions) == [Strap.heartRate, Strap.battery])
        }
    }

    /// A refusal (not permitted) is not retried: reported once, and the other characteristics stream.
    @Test func aRefusedSubscriptionIsReportedAndTheOthersStream() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(
            docsConfig,
            setup: { c in
                try Strap.add(c, strap)
                c.failSubscriptions(
                    to: strap, Strap.battery,
                    with: [BLEError(.notPermitted, name: "org.bluez.Error.NotPermitted", message: "Not paired")])
            }
        ) { h in
            let link = try await connect(h, strap)
            #expect(link.subscriptions == [Strap.heartRate])
            #expect(h.logs.entries.contains { $0.message.contains("cannot subscribe to 2A19: Not paired") })
            #expect(h.central.attempts.count == 1)
            link.notify(Strap.heartRate, [0x00, 0x48])
            let state = try await h.mqtt.waitForJSON(on: "blebridge/chest_strap") { $0["heart_rate_bpm"] != nil }
            #expect(state["heart_rate_bpm"] == .int(72))
        }
    }

    @Test func abortedConnectIsRetriedSoon() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(
            docsConfig,
            setup: { c in
                try Strap.add(c, strap)
                c.failConnects(
                    to: strap,
                    with: [
                        BLEError(
                            .connectionAborted, name: "org.bluez.Error.Failed", message: "le-connection-abort-by-local")
                    ])
            }
        ) { h in
            h.central.advertise(strap, services: [Strap.heartRateService])
            try await eventually("the first attempt") { h.central.attempts.count == 1 }
            // ReconnectPolicy: at most 0.5 s ± 20 % after le-connection-abort-by-local.
            try await eventually("a backoff of 0.4...0.6 s, got \(h.clock.pendingDelays)") {
                h.clock.hasSleeper(in: .milliseconds(400)...(.milliseconds(600)))
            }
            #expect(h.central.attempts.count == 1)
            h.clock.advance(by: .milliseconds(600))
            try await eventually("the retry") { h.central.links(to: strap).count == 1 }
            #expect(h.central.attempts.count == 2)
            #expect(h.bridge.counters.reconnects["org.bluez.Error.Failed"] == 1)
        }
    }

    @Test func notFoundIsRetriedAfterALongerBackoff() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(
            docsConfig,
            setup: { c in
                try Strap.add(c, strap)
                c.failConnects(to: strap, with: [BLEError(.notFound, message: "C0:FF:EE:00:00:01 not found")])
            }
        ) { h in
            h.central.advertise(strap, services: [Strap.heartRateService])
            try await eventually("the first attempt") { h.central.attempts.count == 1 }
            // ReconnectPolicy: 5 × the initial delay (1 s) ± 20 %.
            try await eventually("a backoff of 4...6 s, got \(h.clock.pendingDelays)") {
                h.clock.hasSleeper(in: .seconds(4)...(.seconds(6)))
            }
            h.clock.advance(by: .seconds(3))
            try await eventually("the ticker ran at 3 s") { h.clock.hasSleeper(after: .seconds(3)) }
            #expect(h.central.attempts.count == 1)
            h.clock.advance(by: .seconds(3))
            try await eventually("the retry") { h.central.links(to: strap).count == 1 }
            #expect(h.central.attempts.count == 2)
        }
    }

    @Test func advertisingDuringBackoffRetriesAtOnce() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(
            docsConfig,
            setup: { c in
                try Strap.add(c, strap)
                c.failConnects(to: strap, with: [BLEError(.notFound, message: "C0:FF:EE:00:00:01 not found")])
            }
        ) { h in
            h.central.advertise(strap, services: [Strap.heartRateService])
            try await eventually("backing off") { h.clock.hasSleeper(in: .seconds(4)...(.seconds(6))) }
            let before = h.clock.now
            h.central.advertise(strap, services: [Strap.heartRateService])
            try await eventually("the retry") { h.central.links(to: strap).count == 1 }
            #expect(h.central.attempts.count == 2)
            #expect(h.clock.now == before)
        }
    }

    @Test func endedSubscriptionReconnects() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(docsConfig, setup: { try Strap.add($0, strap) }) { h in
            let link = try await connect(h, strap)
            link.failNotifications(Strap.battery, BLEError(.failed, message: "notify session ended"))
            // A subscription that ends makes the session reconnect.
            try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") {
                $0["type"] == .string("disconnected")
                    && $0["data"]?["reason"]?.string?.contains("subscription to 2A19 ended") == true
            }
            #expect(link.disconnectCalls >= 1)
            try await eventually("the reconnect pause") {
                h.clock.hasSleeper(in: .milliseconds(100)...(.milliseconds(300)))
            }
            h.clock.advance(by: .milliseconds(300))
            _ = try await connect(h, strap, connection: 2)
        }
    }

    /// The real bluetoothd closes a notify socket before it signals the disconnection (seen on the real-BlueZ rig):
    /// that is a link loss, reported and counted as one, not a subscription that ended.
    @Test func aSubscriptionEndedByTheLinkGoingIsALinkLoss() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(docsConfig, setup: { try Strap.add($0, strap) }) { h in
            let link = try await connect(h, strap)
            link.failNotifications(
                Strap.battery, BLEError(.disconnected, message: "disconnected (unknown: connection lost)"))
            try await eventually("the subscription's wait for the link") {
                h.clock.hasSleeper(in: .seconds(5)...(.seconds(5)))
            }
            link.drop(requested: false, reason: "org.bluez.Reason.Remote")
            try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") {
                $0["type"] == .string("disconnected")
                    && $0["data"]?["reason"]?.string?.contains("link lost (org.bluez.Reason.Remote)") == true
            }
            #expect(h.bridge.counters.reconnects["link-lost"] == 1)
            #expect(h.bridge.counters.reconnects["silent-or-ended"] == nil)
            try await eventually("the reconnect pause") {
                h.clock.hasSleeper(in: .milliseconds(100)...(.milliseconds(300)))
            }
            h.clock.advance(by: .milliseconds(300))
            _ = try await connect(h, strap, connection: 2)
        }
    }

    /// ... and a link that never says it went still ends the session, after a grace period.
    @Test func aSubscriptionEndedByADisconnectionTheLinkNeverReports() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(docsConfig, setup: { try Strap.add($0, strap) }) { h in
            let link = try await connect(h, strap)
            link.failNotifications(Strap.battery, BLEError(.disconnected, message: "disconnected"))
            try await eventually("the subscription's wait for the link") {
                h.clock.hasSleeper(in: .seconds(5)...(.seconds(5)))
            }
            h.clock.advance(by: .seconds(5))
            try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") {
                $0["type"] == .string("disconnected")
                    && $0["data"]?["reason"]?.string?.contains("subscription to 2A19 ended") == true
            }
            #expect(link.disconnectCalls >= 1)
        }
    }

    @Test func shutdownDisconnectsAndDoesNotReconnect() async throws {
        let strap = try address(Self.strapAddress)
        try await withBridge(docsConfig, setup: { try Strap.add($0, strap) }) { h in
            let link = try await connect(h, strap)
            #expect(await h.stop())
            #expect(link.disconnectCalls >= 1)
            #expect(h.central.attempts.count == 1)
            #expect(h.mqtt.messages(on: "blebridge/chest_strap/availability").last?.text == #"{"state":"offline"}"#)
        }
    }
}

@Suite struct ConnectsInProgressTests {
    static let addresses = (1...5).map { "C0:FF:EE:00:01:0\($0)" }
    static let fiveStraps =
        "mqtt: {url: mqtt://127.0.0.1:1883}\ndevices:\n"
        + addresses.enumerated().map { i, a in
            "  - {name: strap_\(i), match: {address: \"\(a)\"}, mode: connected}\n"
        }.joined()

    /// Five devices appear at once: two connects are in progress on the adapter at a time (the controller makes one
    /// LE connection at a time anyway), the others wait their turn, and all five stream in the end.
    @Test func anAdapterHasAtMostTwoConnectsInProgress() async throws {
        let straps = try Self.addresses.map { try address($0) }
        try await withBridge(
            Self.fiveStraps,
            setup: { c in
                for s in straps { try Strap.add(c, s) }
                c.holdConnects(true)
            }
        ) { h in
            for s in straps { h.central.advertise(s) }
            var connected = 0
            while connected < straps.count {
                let batch = min(2, straps.count - connected)
                try await eventually("\(batch) connects held, \(connected) done") { h.central.heldConnectCount == batch }
                h.central.releaseConnects()
                connected += batch
                try await eventually("\(connected) links") { h.central.state.withLock { $0.links.count } == connected }
            }
            for i in straps.indices {
                try await h.mqtt.waitForMessage(on: "blebridge/strap_\(i)/availability") { $0.text.contains("online") }
            }
            #expect(h.central.mostConnectsInProgress == 2)
        }
    }
}

final class OrderLog: Sendable {
    private let entries = Mutex<[String]>([])
    func withLock<R>(_ body: (inout [String]) -> R) -> R { entries.withLock { body(&$0) } }
}

@Suite struct AsyncPermitsTests {
    /// A cancelled wait leaves the queue (its permit goes to the next waiter), and permits go in arrival order.
    @Test func waitsAreFIFOAndACancelledWaitLeavesTheQueue() async throws {
        let permits = AsyncPermits(1)
        #expect(await permits.acquire())
        let order = OrderLog()
        let first = Task {
            let ok = await permits.acquire()
            order.withLock { $0.append("first \(ok)") }
        }
        try await eventually("first waits") { permits.waiting == 1 }
        let cancelled = Task { await permits.acquire() }
        try await eventually("second waits") { permits.waiting == 2 }
        let third = Task {
            let ok = await permits.acquire()
            order.withLock { $0.append("third \(ok)") }
        }
        try await eventually("third waits") { permits.waiting == 3 }
        cancelled.cancel()
        #expect(await cancelled.value == false)
        #expect(permits.waiting == 2)
        permits.release()
        await first.value
        #expect(order.withLock { $0 } == ["first true"])
        permits.release()
        await third.value
        #expect(order.withLock { $0 } == ["first true", "third true"])
        // A task cancelled before it asks gets no permit.
        let late = Task {
            withUnsafeCurrentTask { $0?.cancel() }
            return await permits.acquire()
        }
        #expect(await late.value == false)
    }
}

@Suite struct ConnectionSlotTests {
    static let a = "C0:FF:EE:00:00:0A"
    static let b = "C0:FF:EE:00:00:0B"

    static let twoStraps = """
        mqtt: {url: mqtt://127.0.0.1:1883}
        bluetooth: {connection_slots: 1}
        devices:
          - {name: strap_a, match: {address: "C0:FF:EE:00:00:0A"}, mode: connected}
          - {name: strap_b, match: {address: "C0:FF:EE:00:00:0B"}, mode: connected}
        """

    @Test func secondDeviceWaitsForTheSlot() async throws {
        let a = try address(Self.a)
        let b = try address(Self.b)
        try await withBridge(
            Self.twoStraps,
            setup: { c in
                try Strap.add(c, a)
                try Strap.add(c, b)
            }
        ) { h in
            h.central.advertise(a)
            try await h.mqtt.waitForMessage(on: "blebridge/strap_a/availability") { $0.text.contains("online") }
            let health = try await h.request("health_check")
            let adapter = health["data"]?["adapters"]?.items?.first
            #expect(adapter?["connections"] == .int(1))
            #expect(adapter?["free_slots"] == .int(0))

            h.central.advertise(b)
            // No slot: b backs off (10 s ± 20 % for no-slots) without calling connect.
            try await eventually("b backs off, got \(h.clock.pendingDelays)") {
                h.clock.hasSleeper(in: .seconds(8)...(.seconds(12)))
            }
            #expect(h.central.attempts(to: b).isEmpty)
            #expect(h.central.connectCount(adapter: "hci0") == 1)
            let devices = try await h.request("devices")
            let entryB = devices["data"]?["devices"]?.items?.first { $0["id"] == .string("strap_b") }
            #expect(entryB?["state"] == .string("backing_off"))
            #expect(entryB?["last_error"]?.string?.contains("connection_slots: 1") == true)

            // a leaves on purpose; its slot is free again and b, woken by the release, takes it at once.
            try #require(h.central.links(to: a).first).drop(requested: true, reason: "disconnected by the bridge")
            try await eventually("b connects") { h.central.links(to: b).count == 1 }
            #expect(h.clock.now < .seconds(8), "before b's backoff ran out")
            #expect(h.central.attempts(to: b) == [FakeCentral.Attempt(address: b, adapter: "hci0")])
        }
    }

    @Test func devicesGoToTheBestAdapterWithAFreeSlot() async throws {
        let a = try address(Self.a)
        let b = try address(Self.b)
        try await withBridge(
            Self.twoStraps, adapters: ["hci0", "hci1"],
            setup: { c in
                try Strap.add(c, a)
                try Strap.add(c, b)
            }
        ) { h in
            // a is heard best on hci1.
            h.central.advertise(a, adapter: "hci1", rssi: -50)
            h.central.advertise(a, adapter: "hci0", rssi: -70)
            try await eventually("a connects") { h.central.links(to: a).count == 1 }
            #expect(h.central.attempts(to: a).map(\.adapter) == ["hci1"])
            try await h.mqtt.waitForMessage(on: "blebridge/strap_a/availability") { $0.text.contains("online") }

            // b is heard best on hci1 too, but hci1's only slot is taken: hci0.
            h.central.advertise(b, adapter: "hci0", rssi: -80)
            h.central.advertise(b, adapter: "hci1", rssi: -40)
            try await eventually("b connects") { h.central.links(to: b).count == 1 }
            #expect(h.central.attempts(to: b).map(\.adapter) == ["hci0"])
            #expect(h.central.connectCount(adapter: "hci0") == 1)
            #expect(h.central.connectCount(adapter: "hci1") == 1)
        }
    }

    @Test func deviceHeardOnlyByAFullAdapterWaits() async throws {
        let a = try address(Self.a)
        let b = try address(Self.b)
        try await withBridge(
            Self.twoStraps, adapters: ["hci0", "hci1"],
            setup: { c in
                try Strap.add(c, a)
                try Strap.add(c, b)
            }
        ) { h in
            h.central.advertise(a, adapter: "hci1", rssi: -50)
            try await eventually("a connects") { h.central.links(to: a).count == 1 }
            // b is heard only by hci1, which is full: it is not sent to hci0, which cannot reach it.
            h.central.advertise(b, adapter: "hci1", rssi: -45)
            try await eventually("b backs off, got \(h.clock.pendingDelays)") {
                h.clock.hasSleeper(in: .seconds(8)...(.seconds(12)))
            }
            #expect(h.central.attempts(to: b).isEmpty)
        }
    }
}
