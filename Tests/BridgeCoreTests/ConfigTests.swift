// BridgeConfig.load: the docs' first config loads, and each mistake is reported at its path.
import BridgeCore
import GATT
import Testing

@Suite struct ConfigTests {
    /// Loads `yaml` expecting it to fail; returns every problem.
    func problems(_ yaml: String) -> [ConfigError] {
        do {
            _ = try BridgeConfig.load(text: yaml)
            Issue.record("expected the configuration to be rejected")
            return []
        } catch {
            return error.errors
        }
    }

    /// One device entry under a minimal valid configuration.
    func withDevice(_ device: String) -> String {
        """
        mqtt: {url: mqtt://127.0.0.1:1883}
        devices:
        \(device)
        """
    }

    @Test func docsConfigLoads() throws {
        let c = try BridgeConfig.load(text: docsConfig)
        #expect(c.mqtt.url == "mqtt://127.0.0.1:1883")
        #expect(c.mqtt.baseTopic == "blebridge")
        #expect(c.allowRawGATT)
        #expect(c.devices.map(\.id) == ["chest_strap", "balcony", "radiator"])
        #expect(c.devices.map(\.mode) == [.connected, .passive, .connected])
        #expect(c.devices[0].match.service == BluetoothUUID(UInt16(0x180D)))
        #expect(c.devices[1].match.address == BLEAddress("A4:C1:38:12:34:56"))
        #expect(c.parserSpecs.map(\.name) == ["acme_setpoint"])
        let setpoint = try uuid("6e400020-b5a3-f393-e0a9-e50e24dcca9e")
        #expect(c.registry.parser(for: setpoint)?.name == "acme_setpoint")
        let writable = try #require(c.devices[2].writable.first)
        #expect(writable.name == "setpoint_c")
        #expect(writable.characteristic == setpoint)
        #expect(writable.parserName == "acme_setpoint")
        #expect(writable.platform == "number")
        // One device matches by service, so the scan cannot be narrowed to it.
        #expect(c.scanServiceUUIDs.isEmpty)
    }

    @Test func badAddressNamesItsPath() {
        let errors = problems(withDevice(#"  - {name: a, match: {address: "A4:C1:38:12:34"}}"#))
        #expect(errors.map(\.path) == ["devices[0].match.address"])
        #expect(errors.first?.reason.contains("A4:C1:38:12:34") == true)
    }

    @Test func unknownKeySuggestsTheNearestOne() {
        let errors = problems(withDevice(#"  - {name: a, match: {address: "A4:C1:38:12:34:56"}, mdoe: passive}"#))
        #expect(errors.map(\.path) == ["devices[0].mdoe"])
        #expect(errors.first?.reason.contains("did you mean 'mode'") == true)

        let top = problems("mqtt: {url: mqtt://127.0.0.1:1883}\nhomeasistant: {enabled: false}\n")
        #expect(top.map(\.path) == ["homeasistant"])
        #expect(top.first?.reason.contains("did you mean 'homeassistant'") == true)
    }

    @Test func unknownModeNamesItsPath() {
        let errors = problems(withDevice(#"  - {name: a, match: {address: "A4:C1:38:12:34:56"}, mode: streaming}"#))
        #expect(errors.map(\.path) == ["devices[0].mode"])
        #expect(errors.first?.reason.contains("on-demand") == true)
    }

    @Test func writableOnAPassiveDeviceIsRejected() {
        let yaml = """
            mqtt: {url: mqtt://127.0.0.1:1883}
            parsers:
              - name: acme_setpoint
                uuid: 6e400020-b5a3-f393-e0a9-e50e24dcca9e
                fields:
                  - {name: setpoint_c, type: s16le, offset: 0, scale: 0.01}
            devices:
              - {name: a, match: {address: "A4:C1:38:12:34:56"}, mode: passive, writable: [setpoint_c]}
            """
        let errors = problems(yaml)
        #expect(errors.map(\.path) == ["devices[0].writable"])
        #expect(errors.first?.reason.contains("passive") == true)
    }

    @Test func writableFieldNoParserDeclaresIsRejected() {
        let errors = problems(
            withDevice(#"  - {name: a, match: {address: "A4:C1:38:12:34:56"}, mode: connected, writable: [target_c]}"#))
        #expect(errors.map(\.path) == ["devices[0].writable[0]"])
        #expect(errors.first?.reason.contains("no parser declares a field 'target_c'") == true)
    }

    @Test func duplicateDeviceNamesAreRejected() {
        let errors = problems(
            withDevice(
                """
                  - {name: "Chest Strap", match: {address: "A4:C1:38:12:34:56"}}
                  - {name: chest_strap, match: {address: "A4:C1:38:12:34:57"}}
                """))
        #expect(errors.map(\.path) == ["devices[1]"])
        #expect(errors.first?.reason.contains("devices[0]") == true)
    }

    @Test func badServiceUUIDNamesItsPath() {
        let errors = problems(withDevice(#"  - {name: a, match: {service: "18G0"}}"#))
        #expect(errors.map(\.path) == ["devices[0].match.service"])
        #expect(errors.first?.reason.contains("18G0") == true)
    }

    /// A declared parser with a bad UUID: the error's path should be the key at fault, not its grandparent with the
    /// real path repeated inside the reason (`parsers: parsers[0].uuid: ...`).
    @Test func badParserUUIDNamesItsPath() {
        let yaml = """
            mqtt: {url: mqtt://127.0.0.1:1883}
            parsers:
              - name: acme_setpoint
                uuid: 6e400020-nope
                fields:
                  - {name: setpoint_c, type: s16le, offset: 0, scale: 0.01}
            """
        let errors = problems(yaml)
        #expect(errors.count == 1)
        #expect(errors.first?.path == "parsers[0].uuid")
        #expect(errors.first?.description.hasPrefix("parsers[0].uuid: ") == true)
        #expect(errors.first?.description.contains("parsers: parsers[0]") == false)
    }

    @Test func missingBrokerURLIsReported() {
        let errors = problems("mqtt: {client_id: gateway}\n")
        #expect(errors.count == 1)
        #expect(errors.first?.path == "mqtt")
        #expect(errors.first?.description.contains("missing 'url'") == true)

        let noSection = problems("devices: []\n")
        #expect(noSection.contains { $0.reason.contains("missing 'mqtt' section") })
    }

    /// A base topic with an empty level (`a//b`), a wildcard or a leading/trailing slash is refused at its path.
    @Test func unusableBaseTopicsAreRejected() throws {
        for bad in ["home//ble", "home/+", "/home", "home/", "#"] {
            let errors = problems("mqtt: {url: mqtt://127.0.0.1:1883, base_topic: \"\(bad)\"}\n")
            #expect(errors.map(\.path) == ["mqtt.base_topic"], "\(bad): \(errors)")
        }
        for good in ["home/ble", "a/b/c", "b"] {
            let c = try BridgeConfig.load(text: "mqtt: {url: mqtt://127.0.0.1:1883, base_topic: \"\(good)\"}\n")
            #expect(c.mqtt.baseTopic == good)
        }
    }

    @Test func badBrokerURLNamesItsPath() {
        let errors = problems("mqtt: {url: http://127.0.0.1:1883}\n")
        #expect(errors.map(\.path) == ["mqtt.url"])
    }

    /// One mistake elsewhere must not make valid declarations look wrong: here a bad broker URL also made the
    /// declared parser vanish, so the writable field it declares was reported as undeclared.
    @Test func anUnrelatedErrorDoesNotCascadeIntoTheParsers() {
        let yaml = docsConfig.replacing("url: mqtt://127.0.0.1:1883", with: "url: http://broker")
        let errors = problems(yaml)
        #expect(errors.map(\.path) == ["mqtt.url"], "\(errors)")
    }

    @Test func everyProblemIsReportedInOneRun() {
        let errors = problems(
            withDevice(
                """
                  - {name: a, match: {address: "nope"}}
                  - {name: b, match: {address: "A4:C1:38:12:34:56"}, mode: sometimes}
                """))
        #expect(errors.map(\.path) == ["devices[0].match.address", "devices[1].mode"])
    }

    @Test func jsonConfigIsAccepted() throws {
        let json = """
            {"mqtt": {"url": "mqtts://broker.example:8883", "base_topic": "ble"},
             "devices": [{"name": "Balcony", "match": {"address": "a4:c1:38:12:34:56"}, "mode": "passive"}]}
            """
        let c = try BridgeConfig.load(text: json)
        #expect(c.mqtt.url == "mqtts://broker.example:8883")
        #expect(c.mqtt.baseTopic == "ble")
        #expect(c.devices.map(\.id) == ["balcony"])
        #expect(c.devices.first?.friendlyName == "Balcony")
        #expect(c.devices.first?.match.address?.text == "A4:C1:38:12:34:56")
    }

    @Test func deviceWithoutNameUsesItsCompactAddress() throws {
        let c = try BridgeConfig.load(text: withDevice(#"  - {match: {address: "A4:C1:38:12:34:56"}}"#))
        #expect(c.devices.map(\.id) == ["a4c138123456"])
    }

    @Test func sanitizeDeviceIDStripsTopicCharacters() {
        let id = sanitizeDeviceID("Living Room/+#$ Sensor")
        #expect(id == "living_room_____sensor")
        for bad in ["/", "+", "#", "$", " "] { #expect(!id.contains(bad)) }
        #expect(sanitizeDeviceID("$SYS") == "sys")
        #expect(sanitizeDeviceID("kitchen-thermo_2") == "kitchen-thermo_2")
        #expect(sanitizeDeviceID(String(repeating: "a", count: 100)).count == 64)
        #expect(sanitizeDeviceID("\u{0}tab\there").allSatisfy { $0.isLetter || $0 == "_" })
    }
}
