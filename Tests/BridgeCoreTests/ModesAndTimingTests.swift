// Per-device options and timing: throttle, debounce, the silent-subscription watchdog, poll mode, attribute
// output, several devices behind one match entry, auto devices, scans and the payload limit.
import BridgeCore
import GATT
import Testing

/// A device entry for the strap at `ConnectedDeviceTests.strapAddress` with extra options.
func strapConfig(_ options: String) -> String {
    """
    mqtt: {url: mqtt://127.0.0.1:1883}
    devices:
      - {name: chest_strap, match: {address: "\(ConnectedDeviceTests.strapAddress)"}, mode: connected\(options)}
    """
}

/// Advertises the strap and waits for its session to stream.
func connectStrap(_ h: BridgeHarness) async throws -> FakeLink {
    let strap = try address(ConnectedDeviceTests.strapAddress)
    h.central.advertise(strap)
    try await h.mqtt.waitForMessage(on: "blebridge/chest_strap/availability") { $0.text.contains("online") }
    return try #require(h.central.links(to: strap).last)
}

@Suite struct TimingTests {
    @Test func throttlePublishesAtMostOncePerPeriodWithTheLatestValue() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(strapConfig(", throttle: 5"), setup: { try Strap.add($0, strap) }) { h in
            let link = try await connectStrap(h)
            link.notify(Strap.heartRate, [0x00, 60])
            try await h.mqtt.waitForJSON(on: "blebridge/chest_strap") { $0["heart_rate_bpm"] == .int(60) }
            h.clock.advance(by: .seconds(1))
            link.notify(Strap.heartRate, [0x00, 61])
            link.notify(Strap.heartRate, [0x00, 62])
            try await eventually("three notifications") { h.bridge.counters.notifications == 3 }
            try await eventually("a flush scheduled at 5 s") { h.clock.hasSleeper(at: .seconds(5)) }
            #expect(h.mqtt.messages(on: "blebridge/chest_strap").count == 1)
            h.clock.advance(by: .seconds(4))
            let second = try await h.mqtt.waitForJSON(on: "blebridge/chest_strap", skip: 1)
            #expect(second["heart_rate_bpm"] == .int(62))
            try await eventually("the ticker ran at 5 s") { h.clock.hasSleeper(after: .seconds(5)) }
            #expect(h.mqtt.messages(on: "blebridge/chest_strap").count == 2)
        }
    }

    @Test func debouncePublishesOnceDataStops() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(strapConfig(", debounce: 2"), setup: { try Strap.add($0, strap) }) { h in
            let link = try await connectStrap(h)
            link.notify(Strap.heartRate, [0x00, 60])
            try await eventually("a flush at 2 s") { h.clock.hasSleeper(at: .seconds(2)) }
            h.clock.advance(by: .seconds(1))
            link.notify(Strap.heartRate, [0x00, 61])
            try await eventually("two notifications") { h.bridge.counters.notifications == 2 }
            // The flush wakes at 2 s, finds the deadline moved to 3 s, and sleeps again.
            h.clock.advance(by: .seconds(1))
            try await eventually("the flush moved to 3 s") { h.clock.hasSleeper(at: .seconds(3)) }
            #expect(h.mqtt.messages(on: "blebridge/chest_strap").isEmpty)
            h.clock.advance(by: .seconds(1))
            let state = try await h.mqtt.waitForJSON(on: "blebridge/chest_strap")
            #expect(state["heart_rate_bpm"] == .int(61))
        }
    }

    @Test func silentSubscriptionTriggersAReconnect() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(strapConfig(""), setup: { try Strap.add($0, strap) }) { h in
            let link = try await connectStrap(h)
            for i in 0..<3 {
                link.notify(Strap.heartRate, [0x00, UInt8(60 + i)])
                try await eventually("notification \(i + 1)") { h.bridge.counters.notifications == i + 1 }
                h.clock.advance(by: .seconds(1))
            }
            // Usually every second; nothing for 8 s is not yet silence (at least 10 s)...
            h.clock.advance(by: .seconds(7))
            try await eventually("the watchdog ran at 10 s") {
                h.clock.state.withLock { s in s.sleepers.filter { $0.deadline > .seconds(10) }.count >= 2 }
            }
            #expect(!h.mqtt.messages(on: "blebridge/bridge/event").contains { $0.text.contains("silent") })
            // ...11 s is.
            h.clock.advance(by: .seconds(3))
            try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") {
                $0["type"] == .string("disconnected") && $0["data"]?["reason"]?.string?.contains("silent") == true
            }
            try await eventually("the stalled link is dropped") { link.disconnectCalls >= 1 }
            #expect(h.bridge.counters.reconnects["silent-or-ended"] == 1)
        }
    }
}

@Suite struct ModeTests {
    @Test func pollModeConnectsReadsAndDisconnectsEveryInterval() async throws {
        try await withBridge(Radiator.pollConfig, setup: Radiator.add) { h in
            let radiator = try address(Radiator.addressText)
            let state = try await h.mqtt.waitForJSON(on: "blebridge/radiator")
            #expect(state["battery_pct"] == .int(80))
            try await h.mqtt.waitForMessage(on: "blebridge/radiator/availability") { $0.text.contains("online") }
            let first = try #require(h.central.links(to: radiator).first)
            #expect(first.reads == [BluetoothUUID(UInt16(0x2A19))])
            try await eventually("disconnected after the poll") { first.disconnectCalls == 1 }
            // The next poll in 60 s, besides the health report's (the same deadline: either alone would do here).
            try await eventually("waiting for the next poll, got \(h.clock.pendingDelays)") {
                h.clock.pendingDelays.filter { $0 == .seconds(60) }.count == 2
            }
            #expect(h.central.attempts.count == 1)
            h.clock.advance(by: .seconds(60))
            try await eventually("the second poll") { h.central.links(to: radiator).count == 2 }
            try await eventually("its read") { h.central.links(to: radiator).last?.reads.count == 1 }
        }
    }

    /// A polled device's Device Information Service is read after its first poll, once: the next polls read only
    /// the poll list.
    @Test func pollModeReadsTheDeviceInformationOnce() async throws {
        let model = BluetoothUUID(UInt16(0x2A24))
        let battery = BluetoothUUID(UInt16(0x2A19))
        try await withBridge(
            Radiator.pollConfig,
            setup: {
                $0.addDevice(
                    try address(Radiator.addressText),
                    [
                        characteristic(battery, service: BluetoothUUID(UInt16(0x180F)), ["read"]),
                        characteristic(model, service: BluetoothUUID(UInt16(0x180A)), ["read"]),
                    ],
                    values: [battery: [0x50], model: Array("TRV-2".utf8)])
            }
        ) { h in
            let radiator = try address(Radiator.addressText)
            let discovery = try await h.mqtt.waitForJSON(on: "homeassistant/device/blebridge_radiator/config") {
                $0["dev"]?["mdl"] != nil
            }
            #expect(discovery["dev"]?["mdl"] == .string("TRV-2"))
            let first = try #require(h.central.links(to: radiator).first)
            #expect(first.reads == [battery, model])
            // Once the poll is over (disconnected) it waits 60 s for the next one, as the health report does.
            try await eventually("disconnected after the poll") { first.disconnectCalls == 1 }
            try await eventually("waiting for the next poll and health report, got \(h.clock.pendingDelays)") {
                h.clock.pendingDelays.filter { $0 == .seconds(60) }.count == 2
            }
            h.clock.advance(by: .seconds(60))
            try await eventually("the second poll, delays \(h.clock.pendingDelays)") {
                h.central.links(to: radiator).count == 2
            }
            let second = try #require(h.central.links(to: radiator).last)
            try await eventually("disconnected after the second poll") { second.disconnectCalls == 1 }
            #expect(second.reads == [battery])
        }
    }

    @Test func attributeOutputPublishesPlainValues() async throws {
        let yaml = """
            mqtt: {url: mqtt://127.0.0.1:1883}
            devices:
              - {name: balcony, match: {address: "A4:C1:38:12:34:56"}, output: attribute}
            """
        try await withBridge(yaml) { h in
            h.central.advertise(
                try address("A4:C1:38:12:34:56"),
                serviceData: [PassiveDeviceTests.bthomeUUID: try hexBytes(PassiveDeviceTests.bthome)])
            let temperature = try await h.mqtt.waitForMessage(on: "blebridge/balcony/temperature_c")
            #expect(temperature.text == "25.06")
            #expect(try await h.mqtt.waitForMessage(on: "blebridge/balcony/battery_pct").text == "93")
            #expect(h.mqtt.messages(on: "blebridge/balcony").isEmpty)
        }
    }

    /// Home Assistant must be pointed at topics the bridge publishes: with `output: attribute` there is no JSON
    /// state topic, yet discovery sends every entity to `blebridge/<id>` with a `value_json` template.
    @Test func attributeOutputDiscoveryPointsAtPublishedTopics() async throws {
        let yaml = """
            mqtt: {url: mqtt://127.0.0.1:1883}
            devices:
              - {name: balcony, match: {address: "A4:C1:38:12:34:56"}, output: attribute}
            """
        try await withBridge(yaml) { h in
            h.central.advertise(
                try address("A4:C1:38:12:34:56"),
                serviceData: [PassiveDeviceTests.bthomeUUID: try hexBytes(PassiveDeviceTests.bthome)])
            try await h.mqtt.waitForMessage(on: "blebridge/balcony/temperature_c")
            let discovery = try await h.mqtt.waitForJSON(on: "homeassistant/device/blebridge_balcony/config") {
                $0["cmps"]?["blebridge_balcony_temperature_c"] != nil
            }
            let component = try #require(discovery["cmps"]?["blebridge_balcony_temperature_c"])
            let topic = try #require((component["state_topic"] ?? discovery["state_topic"])?.string)
            #expect(!h.mqtt.messages(on: topic).isEmpty, "temperature entity reads \(topic), which is never published")
        }
    }

    @Test func secondDeviceMatchingOneEntryGetsItsOwnID() async throws {
        let first = try address("C0:FF:EE:00:00:01")
        let second = try address("C0:FF:EE:00:00:02")
        try await withBridge(
            docsConfig,
            setup: { c in
                try Strap.add(c, first)
                try Strap.add(c, second)
            }
        ) { h in
            h.central.advertise(first, services: [Strap.heartRateService])
            try await h.mqtt.waitForMessage(on: "blebridge/chest_strap/availability") { $0.text.contains("online") }
            h.central.advertise(second, services: [Strap.heartRateService])
            try await h.mqtt.waitForMessage(on: "blebridge/chest_strap_c0ffee000002/availability") {
                $0.text.contains("online")
            }
            try #require(h.central.links(to: second).first).notify(Strap.heartRate, [0x00, 90])
            try await h.mqtt.waitForJSON(on: "blebridge/chest_strap_c0ffee000002") { $0["heart_rate_bpm"] == .int(90) }
            #expect(h.mqtt.messages(on: "blebridge/chest_strap").isEmpty)
            let devices = try await h.request("devices")
            #expect(
                devices["data"]?["devices"]?.items?.compactMap { $0["id"]?.string }.contains("chest_strap_c0ffee000002")
                    == true)
        }
    }

    @Test func autoDevicesPublishDecodableAdvertisers() async throws {
        let yaml = """
            mqtt: {url: mqtt://127.0.0.1:1883}
            auto_devices: {enabled: true, deny: ["11:22:33:44:55:77"]}
            """
        try await withBridge(yaml) { h in
            let bthome = [PassiveDeviceTests.bthomeUUID: try hexBytes(PassiveDeviceTests.bthome)]
            h.central.advertise(try address("11:22:33:44:55:77"), serviceData: bthome)
            h.central.advertise(try address("11:22:33:44:55:88"), serviceData: [BluetoothUUID(UInt16(0xFEEE)): [1, 2]])
            h.central.advertise(try address("11:22:33:44:55:66"), serviceData: bthome)
            let state = try await h.mqtt.waitForJSON(on: "blebridge/112233445566")
            #expect(state["temperature_c"]?.isNumber(near: 25.06) == true)
            #expect(
                !h.mqtt.messages.contains { $0.topic.contains("112233445577") || $0.topic.contains("112233445588") })
            #expect(h.central.scans.first?.serviceUUIDs == [])
        }
    }
}

@Suite struct ScanAndLimitTests {
    @Test func scanRequestReportsWhatWasHeard() async throws {
        try await withBridge(docsConfig) { h in
            h.mqtt.inject("blebridge/bridge/request/scan", #"{"duration": 2, "transaction": "s"}"#)
            try await eventually("the scan waits 2 s") { h.clock.hasSleeper(at: .seconds(2)) }
            let stranger = try address("11:22:33:44:55:66")
            h.central.advertise(
                stranger, name: "ATC_1234", rssi: -70,
                serviceData: [PassiveDeviceTests.bthomeUUID: try hexBytes(PassiveDeviceTests.bthome)])
            h.central.advertise(try address("A4:C1:38:12:34:56"), rssi: -50)
            try await eventually("both heard") { h.bridge.counters.advertisements == 2 }
            h.clock.advance(by: .seconds(2))
            let answer = try await h.mqtt.waitForJSON(on: "blebridge/bridge/response/scan")
            #expect(answer["status"] == .string("ok"))
            #expect(answer["transaction"] == .string("s"))
            let found = try #require(answer["data"]?["devices"]?.items)
            #expect(found.map { $0["address"] } == [.string("11:22:33:44:55:66"), .string("A4:C1:38:12:34:56")])
            #expect(found[0]["name"] == .string("ATC_1234"))
            #expect(found[0]["device"] == .null)
            #expect(found[0]["decoded"]?.keys?.isEmpty == false, "\(found[0].text)")
            #expect(found[1]["device"] == .string("balcony"))
        }
    }

    @Test func payloadOverMaxPayloadIsRefused() async throws {
        let yaml = docsConfig.replacing(
            "url: mqtt://127.0.0.1:1883", with: "url: mqtt://127.0.0.1:1883\n  max_payload: 64")
        try await withBridge(yaml, setup: Radiator.add) { h in
            let padding = String(repeating: " ", count: 80)
            let answer = try await h.command("blebridge/radiator/set", #"{"setpoint_c": 21.5}"# + padding)
            #expect(answer["status"] == .string("error"))
            #expect(answer["error"]?.string?.contains("max_payload") == true, "\(answer.text)")
            #expect(h.central.attempts.isEmpty)
        }
    }
}
