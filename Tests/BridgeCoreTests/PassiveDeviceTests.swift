// A passive device: BTHome advertisements become state messages; availability follows the advertisements.
import BridgeCore
import GATT
import Testing

@Suite struct PassiveDeviceTests {
    static let bthomeUUID = BluetoothUUID(UInt16(0xFCD2))
    /// BTHome v2, unencrypted: packet id 1, battery 93 %, temperature 25.06 °C, humidity 50.55 %.
    static let bthome = "40 00 01 01 5D 02 CA 09 03 BF 13"
    /// The same with packet id 2 and 25.07 °C.
    static let bthomeNext = "40 00 02 01 5D 02 CB 09 03 BF 13"

    @Test func advertisementBecomesStateAndAvailability() async throws {
        try await withBridge(docsConfig) { h in
            let balcony = try address("A4:C1:38:12:34:56")
            h.central.advertise(balcony, rssi: -61, serviceData: [Self.bthomeUUID: try hexBytes(Self.bthome)])
            let state = try await h.mqtt.waitForJSON(on: "blebridge/balcony")
            #expect(state["temperature_c"]?.isNumber(near: 25.06) == true, "\(state.text)")
            #expect(state["humidity_pct"]?.isNumber(near: 50.55) == true)
            #expect(state["battery_pct"] == .int(93))
            #expect(state["rssi"] == .int(-61))
            #expect(state["last_seen"] == .string("2026-12-01T00:00:00.000Z"))
            // rssi and last_seen come after the decoded fields.
            #expect(Array(state.keys?.suffix(2) ?? []) == ["rssi", "last_seen"])

            let availability = try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability")
            #expect(availability.text == #"{"state":"online"}"#)
            #expect(availability.retain)
            #expect(h.mqtt.messages(on: "blebridge/balcony").allSatisfy { !$0.retain })
        }
    }

    @Test func identicalPayloadsAreNotRepublished() async throws {
        try await withBridge(docsConfig) { h in
            let balcony = try address("A4:C1:38:12:34:56")
            let payload = try hexBytes(Self.bthome)
            h.central.advertise(balcony, rssi: -61, serviceData: [Self.bthomeUUID: payload])
            try await h.mqtt.waitForMessage(on: "blebridge/balcony")
            h.clock.advance(by: .milliseconds(900))
            h.central.advertise(balcony, rssi: -62, serviceData: [Self.bthomeUUID: payload])
            h.central.advertise(balcony, rssi: -61, serviceData: [Self.bthomeUUID: payload])
            try await eventually("three advertisements handled") { h.bridge.counters.advertisements == 3 }
            #expect(h.mqtt.messages(on: "blebridge/balcony").count == 1)
            #expect(h.mqtt.messages(on: "blebridge/balcony/availability").count == 1)

            // New data is published again.
            h.central.advertise(balcony, rssi: -61, serviceData: [Self.bthomeUUID: try hexBytes(Self.bthomeNext)])
            let next = try await h.mqtt.waitForJSON(on: "blebridge/balcony", skip: 1)
            #expect(next["temperature_c"]?.isNumber(near: 25.07) == true)
            #expect(next["packet_id"] == .int(2))
        }
    }

    @Test func goesOfflineAfterThePassiveTimeout() async throws {
        try await withBridge(docsConfig) { h in
            let balcony = try address("A4:C1:38:12:34:56")
            h.central.advertise(balcony, serviceData: [Self.bthomeUUID: try hexBytes(Self.bthome)])
            try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability") { $0.text.contains("online") }

            // 30 s of silence: still online (the default passive_timeout is 60 s).
            h.clock.advance(by: .seconds(30))
            try await eventually("the ticker ran at 30 s") { h.clock.hasSleeper(after: .seconds(30)) }
            #expect(h.mqtt.messages(on: "blebridge/balcony/availability").count == 1)

            h.clock.advance(by: .seconds(31))
            let offline = try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability", skip: 1)
            #expect(offline.text == #"{"state":"offline"}"#)
            #expect(offline.retain)

            // The next advertisement brings it back.
            h.central.advertise(balcony, serviceData: [Self.bthomeUUID: try hexBytes(Self.bthomeNext)])
            let back = try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability", skip: 2)
            #expect(back.text == #"{"state":"online"}"#)
        }
    }

    @Test func deviceAvailabilityTimeoutOverridesTheDefault() async throws {
        let yaml = """
            mqtt: {url: mqtt://127.0.0.1:1883}
            devices:
              - {name: balcony, match: {address: "A4:C1:38:12:34:56"}, availability_timeout: 5}
            """
        try await withBridge(yaml) { h in
            let balcony = try address("A4:C1:38:12:34:56")
            h.central.advertise(balcony, serviceData: [Self.bthomeUUID: try hexBytes(Self.bthome)])
            try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability") { $0.text.contains("online") }
            h.clock.advance(by: .seconds(4))
            try await eventually("the ticker ran at 4 s") { h.clock.hasSleeper(after: .seconds(4)) }
            #expect(h.mqtt.messages(on: "blebridge/balcony/availability").count == 1)
            h.clock.advance(by: .seconds(2))
            try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability", skip: 1) {
                $0.text == #"{"state":"offline"}"#
            }
        }
    }

    @Test func undecodablePayloadIsReportedNotPublished() async throws {
        try await withBridge(docsConfig) { h in
            let balcony = try address("A4:C1:38:12:34:56")
            // BTHome with an object id that announces more bytes than there are.
            h.central.advertise(balcony, serviceData: [Self.bthomeUUID: [0x40, 0x02, 0xCA]])
            try await eventually("a decode error counted") { h.bridge.counters.decodeErrors == 1 }
            #expect(h.mqtt.messages(on: "blebridge/balcony").isEmpty)
            let log = try await h.mqtt.waitForJSON(on: "blebridge/bridge/logging")
            #expect(log["level"] == .string("warning"))
            #expect(log["device"] == .string("balcony"))
        }
    }

    @Test func advertisersThatMatchNothingAreIgnored() async throws {
        try await withBridge(docsConfig) { h in
            let stranger = try address("11:22:33:44:55:66")
            h.central.advertise(stranger, serviceData: [Self.bthomeUUID: try hexBytes(Self.bthome)])
            try await eventually("the advertisement handled") { h.bridge.counters.advertisements == 1 }
            #expect(!h.mqtt.messages.contains { $0.topic.contains("112233445566") })
            #expect(h.central.attempts.isEmpty)
        }
    }
}
