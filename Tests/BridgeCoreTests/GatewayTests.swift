// Multi-gateway mode on fakes: two bridges, each with its own BLE central, sharing one broker (FakeBroker) and one
// clock; the claims, the hand-overs and the topics.
import BridgeCore
import GATT
import Logging
import Testing

/// The gateway that the retained claim of `device` names.
func owner(of device: String, on broker: FakeBroker) throws -> String? {
    guard let text = broker.retainedMessages.first(where: { $0.topic == "blebridge/bridge/claims/\(device)" })?.text
    else { return nil }
    return try JSONReader.parse(Array(text.utf8))["owner"]?.string
}

/// How many of the links `h` made to `device` are up.
func liveLinks(_ h: BridgeHarness, _ device: BLEAddress) -> Int {
    h.central.links(to: device).filter { $0.state.withLock { $0.ended == nil } }.count
}

/// Two gateways ("a", "b") serving the same configured strap.
struct TwoGateways {
    let broker = FakeBroker()
    let clock = TestClock()
    let a: BridgeHarness
    let b: BridgeHarness
    let strap: BLEAddress

    static func config(_ id: String, _ extra: String = "") -> String {
        """
        mqtt: {url: mqtt://127.0.0.1:1883}
        homeassistant: {enabled: false}
        gateway: {id: \(id), handover_after: 5\(extra)}
        devices:
          - {name: chest_strap, match: {address: "\(ConnectedDeviceTests.strapAddress)"}, mode: connected}
        """
    }

    init(extra: String = "") throws {
        strap = try address(ConnectedDeviceTests.strapAddress)
        let strap = strap
        a = try startGateway(
            "a", config: Self.config("a", extra), broker: broker, clock: clock, setup: { try Strap.add($0, strap) })
        b = try startGateway(
            "b", config: Self.config("b", extra), broker: broker, clock: clock, setup: { try Strap.add($0, strap) })
    }

    /// Both gateways hear the strap: `a` at `rssiA`, `b` at `rssiB`.
    func advertise(_ rssiA: Int, _ rssiB: Int) {
        a.central.advertise(strap, rssi: rssiA, services: [Strap.heartRateService])
        b.central.advertise(strap, rssi: rssiB, services: [Strap.heartRateService])
    }

    /// Lets `seconds` of test time pass, one second at a time, advertising as given every second.
    func run(_ seconds: Int, _ rssiA: Int?, _ rssiB: Int?) async throws {
        for _ in 0..<seconds {
            if let rssiA { a.central.advertise(strap, rssi: rssiA, services: [Strap.heartRateService]) }
            if let rssiB { b.central.advertise(strap, rssi: rssiB, services: [Strap.heartRateService]) }
            try await Task.sleep(for: .milliseconds(20))
            clock.advance(by: .seconds(1))
            try await Task.sleep(for: .milliseconds(20))
        }
    }

    func links(_ h: BridgeHarness) -> Int { liveLinks(h, strap) }

    func claimOwner() throws -> String? { try owner(of: "chest_strap", on: broker) }

    func stop() async {
        _ = await a.stop()
        _ = await b.stop()
    }
}

@Suite struct GatewayTests {
    @Test func theGatewayThatHearsBestServesAndTheOtherStaysAway() async throws {
        let g = try TwoGateways()
        do {
            try await eventually("both online") {
                g.broker.retainedMessages.contains { $0.topic == "blebridge/bridge/a/state" }
                    && g.broker.retainedMessages.contains { $0.topic == "blebridge/bridge/b/state" }
            }
            try await g.run(3, -50, -80)
            try await eventually("a connected") { g.links(g.a) == 1 }
            try await g.run(5, -50, -80)
            #expect(try g.claimOwner() == "a")
            #expect(g.b.central.attempts.isEmpty, "b never tries to connect")
            #expect(g.b.mqtt.messages(on: "blebridge/chest_strap/availability").isEmpty, "b says nothing about it")
            // Per-gateway bridge topics; the single-gateway ones are not used.
            #expect(g.a.mqtt.messages(on: "blebridge/bridge/state").isEmpty)
            #expect(!g.a.mqtt.messages(on: "blebridge/bridge/a/info").isEmpty)
            #expect(!g.b.mqtt.messages(on: "blebridge/bridge/b/sightings").isEmpty)
            // A command reaches both; only the owner answers it.
            g.a.mqtt.inject("blebridge/chest_strap/get", #"{"battery_pct": ""}"#)
            g.b.mqtt.inject("blebridge/chest_strap/get", #"{"battery_pct": ""}"#)
            try await g.a.mqtt.waitForMessage(on: "blebridge/chest_strap/get/result")
            try await Task.sleep(for: .milliseconds(100))
            #expect(g.b.mqtt.messages(on: "blebridge/chest_strap/get/result").isEmpty)
        } catch {
            await g.stop()
            throw error
        }
        await g.stop()
    }

    @Test func aGatewayWithoutAFreeSlotLeavesTheDeviceToAnother() async throws {
        // a has one connection slot and two straps to serve; it hears both best. The second goes to b.
        let broker = FakeBroker()
        let clock = TestClock()
        let first = try address(ConnectedDeviceTests.strapAddress)
        let second = try address("C0:FF:EE:00:00:02")
        func start(_ id: String, slots: Int) throws -> BridgeHarness {
            try startGateway(
                id,
                config: """
                    mqtt: {url: mqtt://127.0.0.1:1883}
                    homeassistant: {enabled: false}
                    bluetooth: {connection_slots: \(slots)}
                    gateway: {id: \(id)}
                    devices:
                      - {name: first, match: {address: "\(first.text)"}, mode: connected}
                      - {name: second, match: {address: "\(second.text)"}, mode: connected}
                    """,
                broker: broker, clock: clock,
                setup: {
                    try Strap.add($0, first)
                    try Strap.add($0, second)
                })
        }
        let a = try start("a", slots: 1)
        let b = try start("b", slots: 5)
        let live = liveLinks
        func claimant(_ device: String) throws -> String? { try owner(of: device, on: broker) }
        do {
            try await eventually("both online") {
                broker.retainedMessages.contains { $0.topic == "blebridge/bridge/a/state" }
                    && broker.retainedMessages.contains { $0.topic == "blebridge/bridge/b/state" }
            }
            // The first strap alone at first: a claims and connects it, using its one slot.
            for _ in 0..<4 {
                a.central.advertise(first, rssi: -50, services: [Strap.heartRateService])
                b.central.advertise(first, rssi: -80, services: [Strap.heartRateService])
                try await Task.sleep(for: .milliseconds(20))
                clock.advance(by: .seconds(1))
                try await Task.sleep(for: .milliseconds(20))
            }
            try await eventually("a serves the first") { live(a, first) == 1 }
            // Now the second: a hears it best too, but has no slot left.
            for _ in 0..<8 {
                for device in [first, second] {
                    a.central.advertise(device, rssi: -50, services: [Strap.heartRateService])
                    b.central.advertise(device, rssi: -80, services: [Strap.heartRateService])
                }
                try await Task.sleep(for: .milliseconds(20))
                clock.advance(by: .seconds(1))
                try await Task.sleep(for: .milliseconds(20))
            }
            try await eventually("b serves the second") { live(b, second) == 1 }
            #expect(try claimant("first") == "a")
            #expect(try claimant("second") == "b")
            #expect(live(a, second) == 0 && live(b, first) == 0)
            let sightings = try #require(a.mqtt.messages(on: "blebridge/bridge/a/sightings").last)
            #expect(try JSONReader.parse(sightings.payload)["second"]?["full"] == .bool(true))
        } catch {
            _ = await a.stop()
            _ = await b.stop()
            throw error
        }
        _ = await a.stop()
        _ = await b.stop()
    }

    @Test func aLinkAnEarlierRunLeftIsReleasedWhenAnotherGatewayServesTheDevice() async throws {
        let g = try TwoGateways()
        do {
            try await g.run(3, -50, -80)
            try await eventually("a connected") { g.links(g.a) == 1 }
            // b restarts (its predecessor had connected the strap too, and bluetoothd kept that link).
            _ = await g.b.stop()
            let strap = g.strap
            let b = try startGateway(
                "b", config: TwoGateways.config("b"), broker: g.broker, clock: g.clock,
                setup: {
                    try Strap.add($0, strap)
                    $0.leaveConnected(strap)
                })
            let central = b.central
            // b's session looks at the ownership again within its 5 s standby round.
            for _ in 0..<7 {
                g.a.central.advertise(g.strap, rssi: -50, services: [Strap.heartRateService])
                try await Task.sleep(for: .milliseconds(20))
                g.clock.advance(by: .seconds(1))
                try await Task.sleep(for: .milliseconds(20))
            }
            try await eventually("b lets the strap go") { central.disconnected == [g.strap] }
            #expect(central.attempts.isEmpty, "b never connects it")
            #expect(try g.claimOwner() == "a")
            #expect(b.logs.entries.contains { $0.message.contains("gateway a serves it: disconnecting") })
            _ = await b.stop()
        } catch {
            await g.stop()
            throw error
        }
        _ = await g.a.stop()
    }

    @Test func whenTheOwnersBrokerConnectionBreaksTheOtherTakesOver() async throws {
        let g = try TwoGateways()
        do {
            try await g.run(3, -50, -80)
            try await eventually("a connected") { g.links(g.a) == 1 }
            // a's connection to the broker breaks: its will says offline, and b takes the strap over.
            g.broker.cut(g.a.mqtt, will: "blebridge/bridge/a/state")
            try await g.run(4, nil, -80)
            try await eventually("b connected") { g.links(g.b) == 1 }
            #expect(try g.claimOwner() == "b")
        } catch {
            await g.stop()
            throw error
        }
        await g.stop()
    }

    @Test func handOverNeedsTheMarginForLongEnough() async throws {
        let g = try TwoGateways()
        do {
            try await g.run(3, -70, -75)
            try await eventually("a connected") { g.links(g.a) == 1 }
            // b hears it 5 dB better: within the 8 dB margin, so nothing moves, however long.
            try await g.run(15, -70, -65)
            #expect(try g.claimOwner() == "a")
            #expect(g.b.central.attempts.isEmpty)
            // 15 dB better, for more than handover_after (5 s): b takes over, a disconnects, the strap stays online.
            try await g.run(20, -70, -55)
            try await eventually("b connected") { g.links(g.b) == 1 }
            try await eventually("a disconnected") { g.links(g.a) == 0 }
            #expect(try g.claimOwner() == "b")
            let offline = g.a.mqtt.messages(on: "blebridge/chest_strap/availability").filter {
                $0.text.contains("offline")
            }
            #expect(offline.isEmpty, "a hand-over is not an outage")
            #expect(g.a.logs.entries.contains { $0.message.contains("gateway b serves it now") })
        } catch {
            await g.stop()
            throw error
        }
        await g.stop()
    }

    @Test func gatewayIDsAreSanitizedAndCheckedAndTopicsMove() throws {
        let c = try BridgeConfig.load(
            text: """
                mqtt: {url: mqtt://127.0.0.1:1883}
                gateway: {id: "Attic Floor/2", lease: 20}
                """)
        #expect(c.gateway?.id == "attic_floor_2")
        #expect(c.gateway?.ownership.lease == 20)
        #expect(c.topics.bridgeState == "blebridge/bridge/attic_floor_2/state")
        #expect(c.topics.request("devices") == "blebridge/bridge/attic_floor_2/request/devices")
        #expect(c.topics.command(for: "blebridge/bridge/attic_floor_2/request/devices") == .request(op: "devices"))
        #expect(c.topics.command(for: "blebridge/bridge/request/devices") == nil)
        let single = try BridgeConfig.load(text: "mqtt: {url: mqtt://127.0.0.1:1883}")
        #expect(single.topics.bridgeState == "blebridge/bridge/state")
        for bad in [#"{id: "claims"}"#, #"{id: "///"}"#, "{lease: 10}"] {
            #expect(throws: ConfigErrors.self) {
                try BridgeConfig.load(text: "mqtt: {url: mqtt://127.0.0.1:1883}\ngateway: \(bad)")
            }
        }
    }
}
