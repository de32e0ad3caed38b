// Home Assistant device discovery, the bridge's birth on (re)connect, and shutdown.
import BridgeCore
import GATT
import Logging
import Testing

@Suite struct HomeAssistantDiscoveryTests {
    static let balconyTopic = "homeassistant/device/blebridge_balcony/config"
    static let bridgeTopic = "homeassistant/device/blebridge_bridge_testgw/config"

    func advertiseBalcony(_ h: BridgeHarness) throws {
        h.central.advertise(
            try address("A4:C1:38:12:34:56"), rssi: -61,
            serviceData: [PassiveDeviceTests.bthomeUUID: try hexBytes(PassiveDeviceTests.bthome)])
    }

    @Test func passiveDevicePayload() async throws {
        try await withBridge(docsConfig) { h in
            try advertiseBalcony(h)
            let message = try await h.mqtt.waitForMessage(on: Self.balconyTopic) {
                $0.text.contains("blebridge_balcony_temperature_c")
            }
            #expect(message.retain)
            let payload = try JSONReader.parse(message.payload)
            let bridge = try await h.mqtt.waitForJSON(on: Self.bridgeTopic)
            let bridgeID = try #require(bridge["dev"]?["ids"]?.items?.first)

            #expect(payload["dev"]?["ids"] == .array([.string("blebridge_balcony")]))
            #expect(payload["dev"]?["via_device"] == bridgeID)
            #expect(payload["dev"]?["name"] == .string("balcony"))
            #expect(payload["dev"]?["cns"] == .array([.array([.string("bluetooth"), .string("a4:c1:38:12:34:56")])]))
            #expect(payload["o"]?["name"] == .string("blebridge"))
            #expect(payload["state_topic"] == .string("blebridge/balcony"))
            #expect(payload["availability_mode"] == .string("all"))
            let availability = try #require(payload["availability"]?.items)
            #expect(
                availability.map { $0["topic"] } == [
                    .string("blebridge/bridge/state"), .string("blebridge/balcony/availability"),
                ])
            #expect(availability.allSatisfy { $0["value_template"] == .string("{{ value_json.state }}") })

            let components = try #require(payload["cmps"])
            let temperature = try #require(components["blebridge_balcony_temperature_c"])
            #expect(temperature["p"] == .string("sensor"))
            #expect(temperature["unique_id"] == .string("blebridge_balcony_temperature_c"))
            #expect(temperature["device_class"] == .string("temperature"))
            #expect(temperature["unit_of_measurement"] == .string("°C"))
            #expect(temperature["state_class"] == .string("measurement"))
            #expect(
                temperature["value_template"]
                    == .string(
                        "{{ value_json.temperature_c if value_json.temperature_c is defined"
                            + " and value_json.temperature_c is not none else None }}"))
            #expect(components["blebridge_balcony_humidity_pct"]?["device_class"] == .string("humidity"))
            #expect(components["blebridge_balcony_battery_pct"]?["device_class"] == .string("battery"))
            #expect(components["blebridge_balcony_rssi"]?["device_class"] == .string("signal_strength"))
            // The packet counter is about the radio: diagnostic; a measurement is not.
            #expect(components["blebridge_balcony_packet_id"]?["entity_category"] == .string("diagnostic"))
            #expect(temperature["entity_category"] == nil)

            // Every component has a platform and a unique id, which is its key.
            guard case .object(let entries) = components else { return }
            for (key, value) in entries {
                #expect(value["p"]?.string?.isEmpty == false, "\(key)")
                #expect(value["unique_id"] == .string(key), "\(key)")
            }
        }
    }

    @Test func connectedDeviceComponentsComeFromItsCharacteristics() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(docsConfig, setup: { try Strap.add($0, strap) }) { h in
            h.central.advertise(strap, services: [Strap.heartRateService])
            let payload = try await h.mqtt.waitForJSON(on: "homeassistant/device/blebridge_chest_strap/config") {
                $0["cmps"]?["blebridge_chest_strap_heart_rate_bpm"] != nil
            }
            let components = try #require(payload["cmps"])
            let heartRate = components["blebridge_chest_strap_heart_rate_bpm"]
            #expect(heartRate?["p"] == .string("sensor"))
            #expect(heartRate?["unit_of_measurement"] == .string("bpm"))
            #expect(heartRate?["state_class"] == .string("measurement"))
            #expect(components["blebridge_chest_strap_sensor_contact"]?["p"] == .string("binary_sensor"))
            #expect(components["blebridge_chest_strap_battery_pct"]?["device_class"] == .string("battery"))
            // A list of intervals is no sensor.
            #expect(components["blebridge_chest_strap_rr_intervals_s"] == nil)
        }
    }

    /// A thermometer declares `temperature_c` and `temperature_f` (2A1C sends one of them): two entities named
    /// "Temperature" would become `sensor.x_temperature` and `sensor.x_temperature_2` in Home Assistant, so each
    /// says its unit; and the one never sent reads as unknown, without a template warning per message.
    @Test func fieldsWithTheSameNameSayTheirUnitAndAbsentFieldsAreUnknown() async throws {
        let thermometer = try address("00:09:1F:84:6C:21")
        let yaml = """
            mqtt: {url: "mqtt://127.0.0.1:1883"}
            devices:
              - name: ear
                match: {address: "00:09:1F:84:6C:21"}
                mode: connected
            """
        let measurement = BluetoothUUID(UInt16(0x2A1C))
        let service = BluetoothUUID(UInt16(0x1809))
        try await withBridge(
            yaml, setup: { $0.addDevice(thermometer, [characteristic(measurement, service: service, ["indicate"])]) }
        ) { h in
            h.central.advertise(thermometer, rssi: -70, services: [service])
            let payload = try await h.mqtt.waitForJSON(on: "homeassistant/device/blebridge_ear/config") {
                $0["cmps"]?["blebridge_ear_temperature_f"] != nil
            }
            let components = try #require(payload["cmps"])
            #expect(components["blebridge_ear_temperature_c"]?["name"] == .string("Temperature (°C)"))
            #expect(components["blebridge_ear_temperature_f"]?["name"] == .string("Temperature (°F)"))
            #expect(
                components["blebridge_ear_temperature_f"]?["value_template"]
                    == .string(
                        "{{ value_json.temperature_f if value_json.temperature_f is defined"
                            + " and value_json.temperature_f is not none else None }}"))
            guard case .object(let entries) = components else { return }
            let names = entries.compactMap { $0.1["name"]?.string }
            #expect(Set(names).count == names.count, "\(names.sorted())")
        }
    }

    /// A device with the Device Information Service: its manufacturer, model number and firmware revision are read
    /// once, after it streams, and its Home Assistant device and `bridge/devices` show them; a reconnection does not
    /// read them again.
    @Test func deviceInformationServiceFillsTheHomeAssistantDevice() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        let dis = BluetoothUUID(UInt16(0x180A))
        let manufacturer = BluetoothUUID(UInt16(0x2A29))
        let model = BluetoothUUID(UInt16(0x2A24))
        let firmware = BluetoothUUID(UInt16(0x2A26))
        try await withBridge(
            docsConfig,
            setup: {
                $0.addDevice(
                    strap,
                    try Strap.characteristics() + [
                        characteristic(manufacturer, service: dis, ["read"]),
                        characteristic(model, service: dis, ["read"]),
                        characteristic(firmware, service: dis, ["read"]),
                    ],
                    values: [
                        Strap.bodySensorLocation: [0x01], Strap.battery: [0x64],
                        manufacturer: Array("Polar Electro Oy".utf8), model: Array(" H10 ".utf8),
                        firmware: Array("3.1.1".utf8) + [0, 0],
                    ])
            }
        ) { h in
            h.central.advertise(strap, name: "Polar H10 4F2C11", rssi: -55, services: [Strap.heartRateService])
            let payload = try await h.mqtt.waitForJSON(on: "homeassistant/device/blebridge_chest_strap/config") {
                $0["dev"]?["sw"] != nil
            }
            #expect(payload["dev"]?["mf"] == .string("Polar Electro Oy"))
            #expect(payload["dev"]?["mdl"] == .string("H10"))
            #expect(payload["dev"]?["sw"] == .string("3.1.1"))
            #expect(payload["dev"]?["hw"] == nil)
            let devices = try await h.mqtt.waitForJSON(on: "blebridge/bridge/devices") {
                $0.items?.first { $0["id"] == .string("chest_strap") }?["device_information"] != nil
            }
            let info = devices.items?.first { $0["id"] == .string("chest_strap") }?["device_information"]
            #expect(info?["manufacturer"] == .string("Polar Electro Oy"))
            #expect(info?["hardware"] == .null)

            let link = try #require(h.central.links(to: strap).last)
            #expect(link.reads.filter { $0 == manufacturer }.count == 1)
            link.drop(requested: false, reason: "org.bluez.Reason.Timeout")
            try await eventually("the reconnect pause") {
                h.clock.hasSleeper(in: .milliseconds(100)...(.milliseconds(300)))
            }
            h.clock.advance(by: .milliseconds(300))
            try await eventually("reconnected") { h.central.links(to: strap).count == 2 }
            let second = try #require(h.central.links(to: strap).last)
            try await h.mqtt.waitForMessage(
                on: "blebridge/chest_strap/availability", skip: 2, where: { $0.text == #"{"state":"online"}"# })
            h.mqtt.inject("blebridge/bridge/request/info", "")
            try await h.mqtt.waitForMessage(on: "blebridge/bridge/response/info")
            #expect(!second.reads.contains(manufacturer))
        }
    }

    @Test func writableValueIsANumberEntity() async throws {
        try await withBridge(docsConfig) { h in
            let payload = try await h.mqtt.waitForJSON(on: "homeassistant/device/blebridge_radiator/config")
            let setpoint = try #require(payload["cmps"]?["blebridge_radiator_setpoint_c"])
            #expect(setpoint["p"] == .string("number"))
            #expect(setpoint["command_topic"] == .string("blebridge/radiator/set/setpoint_c"))
            #expect(setpoint["unique_id"] == .string("blebridge_radiator_setpoint_c"))
            // A value not read yet is an empty state, which a number entity ignores (no "None" to parse).
            #expect(
                setpoint["value_template"]
                    == .string(
                        "{{ value_json.setpoint_c if value_json.setpoint_c is defined"
                            + " and value_json.setpoint_c is not none else '' }}"))
            #expect(payload["dev"]?["cns"] == .array([.array([.string("bluetooth"), .string("d0:12:34:56:78:9a")])]))
        }
    }

    /// States are not retained by default: after Home Assistant's birth the bridge publishes every device's state
    /// again, once Home Assistant has had `state_resend_delay` (30 s) to make the entities; a second birth meanwhile
    /// starts the wait again.
    @Test func statesAreSentAgainAfterHomeAssistantsBirth() async throws {
        try await withBridge(docsConfig) { h in
            try advertiseBalcony(h)
            try await h.mqtt.waitForMessage(on: "blebridge/balcony")
            let states = h.mqtt.messages(on: "blebridge/balcony").count
            let birth = h.clock.now
            h.mqtt.inject("homeassistant/status", "online")
            try await eventually("the resend waits") { h.clock.hasSleeper(at: birth + .seconds(30)) }
            h.clock.advance(by: .seconds(20))
            h.mqtt.inject("homeassistant/status", "online")
            try await eventually("the wait starts again") { h.clock.hasSleeper(at: birth + .seconds(50)) }
            h.clock.advance(by: .seconds(15))  // 35 s after the first birth: the first wait was cancelled
            h.mqtt.inject("blebridge/bridge/request/info", "")
            try await h.mqtt.waitForMessage(on: "blebridge/bridge/response/info")
            #expect(h.mqtt.messages(on: "blebridge/balcony").count == states)
            h.clock.advance(by: .seconds(15))
            let again = try await h.mqtt.waitForMessage(on: "blebridge/balcony", skip: states)
            #expect(try JSONReader.parse(again.payload)["temperature_c"] != nil)
            h.mqtt.inject("blebridge/bridge/request/info", "")
            try await h.mqtt.waitForMessage(on: "blebridge/bridge/response/info", skip: 1)
            #expect(h.mqtt.messages(on: "blebridge/balcony").count == states + 1)
        }
    }

    @Test func republishedWhenHomeAssistantComesOnline() async throws {
        try await withBridge(docsConfig) { h in
            #expect(h.mqtt.filters.withLock { $0 }.contains("homeassistant/status"))
            try advertiseBalcony(h)
            try await h.mqtt.waitForMessage(on: Self.balconyTopic) { $0.text.contains("temperature_c") }
            let balcony = h.mqtt.messages(on: Self.balconyTopic).count
            let bridge = h.mqtt.messages(on: Self.bridgeTopic).count

            h.mqtt.inject("homeassistant/status", "offline")
            h.mqtt.inject("homeassistant/status", "online")
            let again = try await h.mqtt.waitForMessage(on: Self.balconyTopic, skip: balcony)
            #expect(again.text.contains("blebridge_balcony_temperature_c"))
            #expect(again.retain)
            try await h.mqtt.waitForMessage(on: Self.bridgeTopic, skip: bridge)
            // Once for "online", nothing for "offline".
            h.mqtt.inject("blebridge/bridge/request/info", "")
            try await h.mqtt.waitForMessage(on: "blebridge/bridge/response/info")
            #expect(h.mqtt.messages(on: Self.balconyTopic).count == balcony + 1)
            #expect(h.mqtt.messages(on: Self.bridgeTopic).count == bridge + 1)
        }
    }

    @Test func disabledDiscoveryPublishesNothing() async throws {
        let yaml = docsConfig.replacing("allow_raw_gatt: true\n", with: "allow_raw_gatt: true\nhomeassistant: false\n")
        try await withBridge(yaml) { h in
            try advertiseBalcony(h)
            try await h.mqtt.waitForMessage(on: "blebridge/balcony")
            #expect(!h.mqtt.messages.contains { $0.topic.hasPrefix("homeassistant/") })
            #expect(!h.mqtt.filters.withLock { $0 }.contains("homeassistant/status"))
        }
    }
}

@Suite struct LifecycleTests {
    /// `bridge/state` online tells a client the bridge hears it: it is published after the command topics are
    /// subscribed, not when the broker connection comes up (a `/set` sent on seeing it was lost otherwise).
    @Test func birthWaitsForTheCommandSubscriptions() async throws {
        let config = try BridgeConfig.load(text: docsConfig)
        let central = FakeCentral(adapters: ["hci0"])
        let mqtt = FakeMQTT()
        mqtt.holdSubscribes()
        let logs = MemoryLogHandler()
        let bridge = Bridge(
            config: config, central: central, mqtt: mqtt, clock: TestClock(),
            logger: Logger(handler: logs, level: .debug), gatewayName: "testgw")
        let run = Task { await bridge.run() }
        defer { run.cancel() }
        // The first subscribe waits for its acknowledgement, and the bridge has handled the connection (it asks for
        // the next state).
        try await eventually("a subscribe held") { !mqtt.filters.withLock { $0 }.isEmpty }
        try await eventually("connected") { mqtt.statesAsked.withLock { $0 } == 2 }
        #expect(mqtt.messages(on: "blebridge/bridge/state").isEmpty)
        // The connection breaks and comes back meanwhile: still nothing said.
        mqtt.setState(.disconnected(reason: "test"))
        mqtt.setState(.connected)
        try await eventually("connected again") { mqtt.statesAsked.withLock { $0 } == 4 }
        #expect(mqtt.messages(on: "blebridge/bridge/state").isEmpty)
        // Every subscribe is sent without waiting for the others' acknowledgements: one round trip before the birth.
        try await eventually("every subscribe sent at once") {
            let sent = mqtt.filters.withLock { $0.count }
            return sent >= BridgeTopics(base: "blebridge").subscriptions.count
                && mqtt.heldSubscribes.withLock { $0.waiting.count } == sent
        }
        mqtt.releaseSubscribes()
        let online = try await mqtt.waitForJSON(on: "blebridge/bridge/state")
        #expect(online["state"] == .string("online"))
        let journal = mqtt.journal.withLock { $0 }
        let birth = try #require(journal.firstIndex(of: "publish blebridge/bridge/state"))
        let subscribed = journal.indices.filter { journal[$0].hasPrefix("subscribed ") }
        #expect(subscribed.count >= BridgeTopics(base: "blebridge").subscriptions.count)
        #expect(subscribed.allSatisfy { $0 < birth }, "\(journal)")
        // Once: the connection's birth waited, it is not said twice.
        try await mqtt.waitForMessage(on: "blebridge/bridge/devices")
        #expect(mqtt.messages(on: "blebridge/bridge/state").count == 1)
        run.cancel()
        _ = await run.value
    }

    @Test func birthOnConnectAndAgainAfterABrokerOutage() async throws {
        try await withBridge(docsConfig) { h in
            let state = try #require(h.mqtt.messages(on: "blebridge/bridge/state").first)
            #expect(state.text == #"{"state":"online"}"#)
            #expect(state.retain)
            let info = try await h.mqtt.waitForMessage(on: "blebridge/bridge/info")
            #expect(info.retain)
            let infoJSON = try JSONReader.parse(info.payload)
            #expect(infoJSON["gateway"] == .string("testgw"))
            #expect(infoJSON["version"]?.string?.isEmpty == false)
            try await h.mqtt.waitForMessage(on: "blebridge/bridge/devices") { $0.retain }
            #expect(
                Set(h.mqtt.filters.withLock { $0 }).isSuperset(of: [
                    "blebridge/+/set", "blebridge/+/set/+", "blebridge/+/get", "blebridge/+/get/+",
                    "blebridge/bridge/request/#",
                ]))

            h.central.advertise(
                try address("A4:C1:38:12:34:56"),
                serviceData: [PassiveDeviceTests.bthomeUUID: try hexBytes(PassiveDeviceTests.bthome)])
            try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability")

            // The broker published our will meanwhile: birth and availability again.
            h.mqtt.setState(.disconnected(reason: "keepalive timeout"))
            h.mqtt.setState(.connecting)
            h.mqtt.setState(.connected)
            let again = try await h.mqtt.waitForMessage(on: "blebridge/bridge/state", skip: 1)
            #expect(again.text == #"{"state":"online"}"#)
            let availability = try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability", skip: 1)
            #expect(availability.text == #"{"state":"online"}"#)
            #expect(availability.retain)
        }
    }

    @Test func shutdownPublishesOfflineAndReturns() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(docsConfig, setup: { try Strap.add($0, strap) }) { h in
            h.central.advertise(
                try address("A4:C1:38:12:34:56"),
                serviceData: [PassiveDeviceTests.bthomeUUID: try hexBytes(PassiveDeviceTests.bthome)])
            h.central.advertise(strap, services: [Strap.heartRateService])
            try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability") { $0.text.contains("online") }
            try await h.mqtt.waitForMessage(on: "blebridge/chest_strap/availability") { $0.text.contains("online") }
            let link = try #require(h.central.links(to: strap).first)

            let started = ContinuousClock.now
            #expect(await h.stop(within: 15), "run() returns after cancellation")
            // Under the 5 s cap a device that does not answer would use up: nothing held the shutdown up.
            #expect(ContinuousClock.now - started < .seconds(4.5), "no device holds up the shutdown")

            let all = h.mqtt.messages
            let lastState = try #require(all.lastIndex { $0.topic == "blebridge/bridge/state" })
            #expect(all[lastState].text == #"{"state":"offline"}"#)
            #expect(all[lastState].retain)
            for topic in ["blebridge/balcony/availability", "blebridge/chest_strap/availability"] {
                let last = try #require(all.lastIndex { $0.topic == topic })
                #expect(all[last].text == #"{"state":"offline"}"#, "\(topic)")
                #expect(all[last].retain)
                #expect(last < lastState, "\(topic) goes offline before the bridge does")
            }
            // A device that never came online has nothing to retract.
            #expect(h.mqtt.messages(on: "blebridge/radiator/availability").isEmpty)
            #expect(link.disconnectCalls >= 1)
            #expect(h.central.stopScans >= 1)
            #expect(h.central.attempts.count == 1)
        }
    }

    @Test func shutdownDuringBackoffReturnsAtOnce() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(
            docsConfig,
            setup: { c in
                try Strap.add(c, strap)
                c.failConnects(to: strap, with: [BLEError(.notFound, message: "not found")])
            }
        ) { h in
            h.central.advertise(strap, services: [Strap.heartRateService])
            try await eventually("backing off") { h.clock.hasSleeper(in: .seconds(4)...(.seconds(6))) }
            let started = ContinuousClock.now
            #expect(await h.stop(within: 15))
            #expect(ContinuousClock.now - started < .seconds(4.5))
            #expect(h.central.attempts.count == 1)
            #expect(h.mqtt.messages(on: "blebridge/bridge/state").last?.text == #"{"state":"offline"}"#)
        }
    }
}
