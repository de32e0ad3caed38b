// Multi-gateway mode, passive devices, on fakes: two bridges hear the same BTHome thermometer; each reading is
// published once, with the best gateway's RSSI, and the device is offline only when neither hears it.
import GATT
import Logging
import Testing

@testable import BridgeCore

/// Two gateways ("a", "b") hearing the same passive thermometer.
struct TwoPassiveGateways {
    let broker = FakeBroker()
    let clock = TestClock()
    let a: BridgeHarness
    let b: BridgeHarness
    let thermometer: BLEAddress

    static func config(_ id: String) -> String {
        """
        mqtt: {url: mqtt://127.0.0.1:1883}
        homeassistant: {enabled: false}
        availability: {passive_timeout: 3, passive_intervals: 3}
        gateway: {id: \(id)}
        devices:
          - {name: balcony, match: {address: "A4:C1:38:12:34:56"}, mode: passive}
        """
    }

    init() throws {
        thermometer = try address("A4:C1:38:12:34:56")
        a = try startGateway("a", config: Self.config("a"), broker: broker, clock: clock)
        b = try startGateway("b", config: Self.config("b"), broker: broker, clock: clock)
    }

    /// BTHome v2: packet id `id`, battery 93 %, temperature 25.00 + id/100 °C, humidity 50.55 %.
    static func packet(_ id: UInt8) -> [UInt8] {
        let t = UInt16(2500) + UInt16(id)
        return [0x40, 0x00, id, 0x01, 0x5D, 0x02, UInt8(t & 0xFF), UInt8(t >> 8), 0x03, 0xBF, 0x13]
    }

    /// One second: packet `id` heard by `a` (at `rssiA`) and then by `b` (at `rssiB`), nil for not heard.
    func second(_ id: UInt8, _ rssiA: Int?, _ rssiB: Int?) async throws {
        let data = [PassiveDeviceTests.bthomeUUID: Self.packet(id)]
        if let rssiA { a.central.advertise(thermometer, rssi: rssiA, serviceData: data) }
        try await Task.sleep(for: .milliseconds(30))
        if let rssiB { b.central.advertise(thermometer, rssi: rssiB, serviceData: data) }
        try await Task.sleep(for: .milliseconds(30))
        clock.advance(by: .seconds(1))
        try await Task.sleep(for: .milliseconds(30))
    }

    /// Every state published for the thermometer, by either gateway, in order: (gateway, packet id, rssi).
    func states() throws -> [(String, Int64, Int64?)] {
        var out: [(String, Int64, Int64?)] = []
        for (g, h) in [("a", a), ("b", b)] {
            for m in h.mqtt.messages(on: "blebridge/balcony") {
                let v = try JSONReader.parse(m.payload)
                if case .int(let id)? = v["packet_id"] {
                    var rssi: Int64?
                    if case .int(let r)? = v["rssi"] { rssi = r }
                    out.append((g, id, rssi))
                }
            }
        }
        return out
    }

    func stop() async {
        _ = await a.stop()
        _ = await b.stop()
    }
}

@Suite struct PassiveGatewayTests {
    /// Every gateway publishes a passive device's Home Assistant discovery naming itself (via_device, and its
    /// bridge state among the availability topics); the broker keeps the last. When that gateway goes offline, the
    /// others publish it again naming themselves, so that the entities do not stay unavailable while they still
    /// publish the device's readings.
    @Test func aPassiveDevicesDiscoveryNamesALiveGatewayAfterOneLeaves() async throws {
        let broker = FakeBroker()
        let clock = TestClock()
        let config = { (id: String) in
            """
            mqtt: {url: mqtt://127.0.0.1:1883}
            gateway: {id: \(id)}
            devices:
              - {name: balcony, match: {address: "A4:C1:38:12:34:56"}, mode: passive}
            """
        }
        let gateways = [
            "a": try startGateway("a", config: config("a"), broker: broker, clock: clock),
            "b": try startGateway("b", config: config("b"), broker: broker, clock: clock),
        ]
        let topic = "homeassistant/device/blebridge_balcony/config"
        /// The gateway the retained discovery names (via_device `blebridge_bridge_<id>`), and its availability topics.
        func named() -> (gateway: String?, availability: [String]) {
            guard let m = broker.retainedMessages.last(where: { $0.topic == topic }),
                let v = try? JSONReader.parse(Array(m.text.utf8)), let via = v["dev"]?["via_device"]?.string
            else { return (nil, []) }
            return (
                String(via.dropFirst("blebridge_bridge_".count)),
                v["availability"]?.items?.compactMap { $0["topic"]?.string } ?? []
            )
        }
        // Both have published theirs (and nothing else changes it until one leaves): the broker keeps the last.
        try await eventually("both gateways' discovery published") {
            gateways.values.allSatisfy { !$0.mqtt.messages(on: topic).isEmpty } && named().gateway != nil
        }
        let retained = named()
        let first = try #require(retained.gateway)
        let other = first == "a" ? "b" : "a"
        #expect(retained.availability.contains("blebridge/bridge/\(first)/state"))
        _ = await gateways[first]?.stop()
        try await eventually("\(other) names itself again") { named().gateway == other }
        #expect(named().availability.contains("blebridge/bridge/\(other)/state"))
        #expect(!named().availability.contains("blebridge/bridge/\(first)/state"))
        _ = await gateways[other]?.stop()
    }

    @Test func aReadingWithACounterIsADuplicateOnlyWithTheSameFields() {
        let p = PassiveReadings(window: 2, delay: 0.3)
        var r = GATTReading()
        r.append("packet_id", .int(7))
        r.append("temperature_c", .double(21.5))
        #expect(!p.isDuplicate("t", r, wall: 100))
        p.noteState("t", Array(#"{"packet_id":7,"temperature_c":21.5,"rssi":-80,"last_seen":"x"}"#.utf8), wall: 100)
        #expect(p.isDuplicate("t", r, wall: 110), "the counter keeps it a duplicate past the content window")
        #expect(!p.isDuplicate("t", r, wall: 200), "a counter wraps: not for ever")
        var other = GATTReading()
        other.append("packet_id", .int(7))
        other.append("temperature_c", .double(21.6))
        #expect(!p.isDuplicate("t", other, wall: 101), "the same counter with other values is another reading")
        // Without a counter: the same fields within the window only; 50 published is the 50.0 decoded.
        var plain = GATTReading()
        plain.append("humidity_pct", .double(50))
        p.noteState("t", Array(#"{"humidity_pct":50}"#.utf8), wall: 100)
        #expect(p.isDuplicate("t", plain, wall: 101.5))
        #expect(!p.isDuplicate("t", plain, wall: 103))
        #expect(!p.isDuplicate("u", plain, wall: 101), "per device")
    }

    @Test func eachReadingIsPublishedOnceWithTheBestGatewaysRSSI() async throws {
        let g = try TwoPassiveGateways()
        do {
            try await eventually("both online") {
                g.broker.retainedMessages.contains { $0.topic == "blebridge/bridge/a/state" }
                    && g.broker.retainedMessages.contains { $0.topic == "blebridge/bridge/b/state" }
            }
            // Until the sightings have gone round, both may publish.
            for id in UInt8(1)...3 { try await g.second(id, -50, -80) }
            try await eventually("b knows a hears it better") {
                g.b.bridge.coordination?.passiveRank("balcony", wall: g.clock.wallClock) == 1
                    && g.a.bridge.coordination?.passiveRank("balcony", wall: g.clock.wallClock) == 0
            }
            let before = try g.states().count
            for id in UInt8(4)...10 { try await g.second(id, -50, -80) }
            // a misses packet 11: b publishes it, after its delay.
            try await g.second(11, nil, -80)
            try await g.second(12, -50, -80)
            try await eventually("packet 12 published") { try g.states().contains { $0.1 == 12 } }
            let after = try g.states().filter { $0.1 >= 4 }
            let ids = after.map(\.1).sorted()
            #expect(ids == Array(4...12), "each reading once: \(after)")
            #expect(after.filter { $0.1 != 11 }.allSatisfy { $0.0 == "a" && $0.2 == -50 }, "a hears best: \(after)")
            #expect(after.first { $0.1 == 11 }.map { $0.0 == "b" && $0.2 == -80 } == true, "\(after)")
            #expect(try g.states().count - before == 9)
            let last = try JSONReader.parse(g.a.mqtt.messages(on: "blebridge/balcony").last!.payload)
            #expect(last["rssi_by_gateway"]?["a"]?.number == -50)
            #expect(last["rssi_by_gateway"]?["b"]?.number == -80)
        } catch {
            await g.stop()
            throw error
        }
        await g.stop()
    }

    @Test func offlineOnlyWhenNoGatewayHearsIt() async throws {
        let g = try TwoPassiveGateways()
        do {
            try await eventually("both online") {
                g.broker.retainedMessages.contains { $0.topic == "blebridge/bridge/a/state" }
                    && g.broker.retainedMessages.contains { $0.topic == "blebridge/bridge/b/state" }
            }
            for id in UInt8(1)...12 { try await g.second(id, -50, -80) }
            try await eventually("online") {
                g.broker.retainedMessages.contains {
                    $0.topic == "blebridge/balcony/availability" && $0.text.contains("online")
                }
            }
            // a stops hearing it; b still does, for longer than the passive timeout (3 s) and a sightings round.
            for id in UInt8(13)...40 { try await g.second(id, nil, -80) }
            let offline = { (h: BridgeHarness) in
                h.mqtt.messages(on: "blebridge/balcony/availability").filter { $0.text.contains("offline") }.count
            }
            #expect(offline(g.a) == 0 && offline(g.b) == 0, "online while b hears it")
            // Nobody hears it: offline.
            for _ in 0..<30 {
                try await Task.sleep(for: .milliseconds(20))
                g.clock.advance(by: .seconds(1))
            }
            try await eventually("offline") {
                g.broker.retainedMessages.contains {
                    $0.topic == "blebridge/balcony/availability" && $0.text.contains("offline")
                }
            }
        } catch {
            await g.stop()
            throw error
        }
        await g.stop()
    }
}
