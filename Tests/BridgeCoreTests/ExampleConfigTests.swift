// The configurations users copy: the short config that opens config/README.md, config/blebridge.example.yaml and
// config/demo.yaml load as they stand and mean what their comments say; the README names every key the loader
// accepts, and its check-config error example is what the loader reports.
import BridgeCore
import Foundation
import GATT
import Testing

/// The repository's root, found from this file (`Tests/BridgeCoreTests/ExampleConfigTests.swift`).
private let repositoryRoot = URL(fileURLWithPath: #filePath).deletingLastPathComponent()
    .deletingLastPathComponent().deletingLastPathComponent()

private func repositoryText(_ path: String) throws -> String {
    try String(contentsOf: repositoryRoot.appendingPathComponent(path), encoding: .utf8)
}

/// The fenced ```yaml blocks of a Markdown text, in order.
private func yamlBlocks(_ markdown: String) -> [String] {
    var blocks: [String] = []
    var current: [Substring]?
    for line in markdown.split(separator: "\n", omittingEmptySubsequences: false) {
        if current == nil {
            if line.trimmingCharacters(in: .whitespaces) == "```yaml" { current = [] }
        } else if line.trimmingCharacters(in: .whitespaces) == "```" {
            blocks.append((current ?? []).joined(separator: "\n") + "\n")
            current = nil
        } else {
            current?.append(line)
        }
    }
    return blocks
}

/// The configuration in `text`, or a failed expectation listing every problem.
private func load(_ text: String, _ name: String) throws -> BridgeConfig {
    do {
        return try BridgeConfig.load(text: text)
    } catch {
        Issue.record("\(name) does not load:\n\(error.description)")
        throw error
    }
}

private func device(_ config: BridgeConfig, _ id: String) throws -> DeviceConfig {
    try #require(config.devices.first { $0.id == id }, "no device '\(id)' in \(config.devices.map(\.id))")
}

@Suite struct ExampleConfigTests {
    @Test func shortConfigOpeningTheReadmeLoads() throws {
        let readme = try repositoryText("config/README.md")
        let first = try #require(yamlBlocks(readme).first, "config/README.md has no ```yaml block")
        let c = try load(first, "the first yaml block of config/README.md")

        #expect(c.mqtt.url == "mqtt://127.0.0.1:1883")
        #expect(c.mqtt.baseTopic == "blebridge")
        #expect(c.mqtt.qos == 1)
        #expect(c.allowRawGATT)
        #expect(c.homeAssistant.enabled)
        #expect(c.bluetooth.connectionSlots == 5)
        #expect(c.parserSpecs.map(\.name) == ["acme_setpoint"])
        #expect(c.devices.map(\.id) == ["chest_strap", "balcony", "radiator"])
        #expect(c.devices.map(\.mode) == [.connected, .passive, .connected])
        // One device matches by address, so the bridge scans for every advertiser.
        #expect(c.scanServiceUUIDs.isEmpty)

        let strap = try device(c, "chest_strap")
        #expect(strap.match.service == BluetoothUUID(UInt16(0x180D)))
        #expect(strap.subscribe.isEmpty)

        let radiator = try device(c, "radiator")
        let setpoint = try #require(radiator.writable.first)
        #expect(radiator.writable.count == 1)
        #expect(setpoint.name == "setpoint_c")
        #expect(setpoint.parserName == "acme_setpoint")
        #expect(setpoint.characteristic == BluetoothUUID("6e400020-b5a3-f393-e0a9-e50e24dcca9e"))
        #expect(setpoint.platform == "number")
    }

    @Test func exampleConfigLoadsWithEverySection() throws {
        let c = try load(try repositoryText("config/blebridge.example.yaml"), "config/blebridge.example.yaml")

        #expect(c.mqtt.url == "mqtt://127.0.0.1:1883")
        #expect(c.mqtt.clientID == "blebridge-livingroom")
        #expect(c.mqtt.protocolVersion == "5")
        #expect(c.mqtt.keepAlive == .seconds(60))
        #expect(c.mqtt.reconnectMaximumDelay == .seconds(60))
        #expect(c.mqtt.username == nil)
        #expect(c.homeAssistant.statusTopic == "homeassistant/status")
        #expect(c.bluetooth.adapters == ["hci0"])
        #expect(c.bluetooth.connectTimeout == .seconds(20))
        #expect(c.bluetooth.reconnectMaximumDelay == .seconds(300))
        #expect(c.availability.passiveMinimumTimeout == .seconds(60))
        #expect(c.availability.passiveIntervals == 10)
        #expect(c.logging.mqttLevel == "warning")
        #expect(!c.allowRawGATT)
        #expect(c.parserSpecs.map(\.name) == ["acme_thermostat", "acme_valve", "acme_relay"])
        #expect(c.registry.parser(named: "acme_valve") != nil)
        #expect(
            c.devices.map(\.id) == [
                "chest_strap", "radiator_valve", "plant_sensor", "garage_light", "balcony", "ruuvi",
            ])
        #expect(c.devices.map(\.mode) == [.connected, .connected, .poll, .onDemand, .passive, .passive])

        let strap = try device(c, "chest_strap")
        #expect(strap.subscribe == [BluetoothUUID(UInt16(0x2A37))])
        #expect(strap.poll == [BluetoothUUID(UInt16(0x2A19)), BluetoothUUID(UInt16(0x2A38))])
        #expect(strap.throttle == .seconds(1))
        #expect(strap.qos == 0)

        let radiator = try device(c, "radiator_valve")
        #expect(radiator.retain == true)
        #expect(radiator.qos == -1)  // -1: mqtt.qos
        #expect(radiator.writable.map(\.name) == ["setpoint_c", "boost", "display_raw"])
        #expect(radiator.writable.map(\.platform) == ["number", "switch", "text"])
        #expect(radiator.writable.map(\.parserName) == ["acme_thermostat", "acme_thermostat", nil])
        #expect(radiator.writable[0].minimum == 5)
        #expect(radiator.writable[0].maximum == 30)
        #expect(radiator.writable[0].step == 0.5)
        #expect(radiator.writable[2].characteristic == BluetoothUUID("6e400022-b5a3-f393-e0a9-e50e24dcca9e"))
        #expect(radiator.writable[2].withResponse == false)

        let plant = try device(c, "plant_sensor")
        #expect(plant.friendlyName == "Plant Sensor")
        #expect(plant.pollInterval == .seconds(600))
        #expect(plant.output == .attributeAndJSON)
        #expect(plant.poll.count == 3)

        let light = try device(c, "garage_light")
        #expect(light.match.namePattern == "ACME Relay*")
        #expect(light.writable.map(\.platform) == ["switch"])

        let balcony = try device(c, "balcony")
        #expect(balcony.bindKey?.count == 16)
        #expect(balcony.debounce == .seconds(2))
        #expect(balcony.availabilityTimeout == .seconds(900))

        let ruuvi = try device(c, "ruuvi")
        #expect(ruuvi.match.manufacturer == 0x0499)
        #expect(ruuvi.output == .attribute)

        #expect(c.autoDevices.enabled)
        #expect(c.autoDevices.allow.count == 2)
        #expect(c.autoDevices.minimumRSSI == -90)
        #expect(c.scanServiceUUIDs.isEmpty)
    }

    @Test func demoConfigLoads() throws {
        let c = try load(try repositoryText("config/demo.yaml"), "config/demo.yaml")
        #expect(c.devices.map(\.id) == ["chest_strap", "ear_thermometer", "enviro", "balcony", "ruuvi", "echo"])
        #expect(c.allowRawGATT)
        #expect(try device(c, "chest_strap").poll == [BluetoothUUID(UInt16(0x2A19))])
        #expect(try device(c, "enviro").throttle == .milliseconds(500))
        let echo = try device(c, "echo").writable
        #expect(echo.map(\.name) == ["message"])
        #expect(echo.map(\.parserName) == ["nus_rx"])
        // A utf8 field is written as text.
        #expect(echo.map(\.platform) == ["text"])
        let p = try #require(c.peripheral)
        #expect(p.services.map(\.name) == ["environmental_sensing", "notes"])
        #expect(p.services[1].characteristics.first?.parserName == "nus_rx")
        #expect(p.services[1].characteristics.first?.sink == "demo/from_central")
    }

    /// Every key the loader accepts, section by section, read from its own "unknown key" errors.
    @Test func readmeNamesEveryKeyTheLoaderAccepts() throws {
        let readme = try repositoryText("config/README.md")
        let url = "url: mqtt://127.0.0.1:1883"
        let address = "match: {address: \"A4:C1:38:12:34:56\"}"
        let parser = "name: p, uuid: \"6e400099-b5a3-f393-e0a9-e50e24dcca9e\""
        let writable = "mode: connected, writable: [{name: w, characteristic: \"2A19\", zz_probe: 1}]"
        let probes: [(section: String, yaml: String)] = [
            ("", "mqtt: {\(url)}\nzz_probe: 1"),
            ("mqtt", "mqtt: {\(url), zz_probe: 1}"),
            ("mqtt.tls", "mqtt: {\(url), tls: {zz_probe: 1}}"),
            ("mqtt.reconnect", "mqtt: {\(url), reconnect: {zz_probe: 1}}"),
            ("homeassistant", "mqtt: {\(url)}\nhomeassistant: {zz_probe: 1}"),
            ("bluetooth", "mqtt: {\(url)}\nbluetooth: {zz_probe: 1}"),
            ("bluetooth.reconnect", "mqtt: {\(url)}\nbluetooth: {reconnect: {zz_probe: 1}}"),
            ("availability", "mqtt: {\(url)}\navailability: {zz_probe: 1}"),
            ("logging", "mqtt: {\(url)}\nlogging: {zz_probe: 1}"),
            ("auto_devices", "mqtt: {\(url)}\nauto_devices: {zz_probe: 1}"),
            ("parsers[0]", "mqtt: {\(url)}\nparsers: [{\(parser), zz_probe: 1, fields: [{name: x, type: u8}]}]"),
            (
                "parsers[0].fields[0]",
                "mqtt: {\(url)}\nparsers: [{\(parser), fields: [{name: x, type: u8, zz_probe: 1}]}]"
            ),
            ("devices[0]", "mqtt: {\(url)}\ndevices: [{\(address), zz_probe: 1}]"),
            ("devices[0].match", "mqtt: {\(url)}\ndevices: [{match: {address: \"A4:C1:38:12:34:56\", zz_probe: 1}}]"),
            ("devices[0].writable[0]", "mqtt: {\(url)}\ndevices: [{\(address), \(writable)}]"),
            ("peripheral", "mqtt: {\(url)}\nperipheral: {zz_probe: 1}"),
            ("gateway", "mqtt: {\(url)}\ngateway: {id: attic, zz_probe: 1}"),
            ("peripheral.services[0]", "mqtt: {\(url)}\nperipheral: {services: [{uuid: 180F, zz_probe: 1}]}"),
            (
                "peripheral.services[0].characteristics[0]",
                "mqtt: {\(url)}\nperipheral: {services: [{uuid: 180F, characteristics: [{uuid: 2A19, zz_probe: 1}]}]}"
            ),
            (
                "peripheral.services[0].characteristics[0].source",
                "mqtt: {\(url)}\nperipheral: {services: [{uuid: 180F, characteristics: [{uuid: 2A19, source: {topic: t, zz_probe: 1}}]}]}"
            ),
            (
                "peripheral.services[0]",
                "mqtt: {\(url)}\nperipheral: {services: [{preset: battery, level: t, zz_probe: 1}]}"
            ),
            (
                "peripheral.services[0]",
                "mqtt: {\(url)}\nperipheral: {services: [{preset: environmental_sensing, zz_probe: 1}]}"
            ),
            (
                "peripheral.services[0]",
                "mqtt: {\(url)}\nperipheral: {services: [{preset: device_information, zz_probe: 1}]}"
            ),
            ("peripheral.broadcast", "mqtt: {\(url)}\nperipheral: {broadcast: {zz_probe: 1}}"),
            (
                "peripheral.broadcast.values[0]",
                "mqtt: {\(url)}\nperipheral: {broadcast: {values: [{field: temperature_c, source: t, zz_probe: 1}]}}"
            ),
        ]
        var checked = 0
        for probe in probes {
            let path = probe.section.isEmpty ? "zz_probe" : "\(probe.section).zz_probe"
            var allowed: [String] = []
            do {
                _ = try BridgeConfig.load(text: probe.yaml)
                Issue.record("\(path) was accepted")
            } catch {
                let reason = try #require(
                    error.errors.first { $0.path == path }?.reason, "no error at \(path): \(error.description)")
                let marker = "allowed here: "
                let list = try #require(reason.range(of: marker), "unexpected reason at \(path): \(reason)")
                allowed = reason[list.upperBound...].split(separator: ", ").map(String.init)
            }
            #expect(!allowed.isEmpty, "no allowed keys read for \(path)")
            for key in allowed {
                let mentioned = readme.contains("`\(key)`")
                #expect(mentioned, "config/README.md does not mention `\(key)` (\(probe.section))")
                checked += 1
            }
        }
        #expect(checked > 60)
    }

    /// The broken configuration under "check-config" in the README fails with exactly the lines shown there.
    @Test func readmePeripheralExampleLoadsAndItsBroadcastErrorIsTheLoaders() throws {
        let readme = try repositoryText("config/README.md")
        let block = try #require(yamlBlocks(readme).first { $0.hasPrefix("peripheral:") }, "no peripheral example")
        let c = try load("mqtt: {url: \"mqtt://127.0.0.1:1883\"}\n" + block, "the peripheral example")
        let p = try #require(c.peripheral)
        #expect(
            p.services.map(\.name) == [
                "environmental_sensing", "battery", "device_information", "bridge_status", "lamp",
            ])
        #expect(p.broadcast?.values.map(\.field) == ["temperature_c", "humidity_pct"])
        do {
            _ = try BridgeConfig.load(
                text: """
                    mqtt: {url: "mqtt://127.0.0.1:1883"}
                    peripheral:
                      broadcast:
                        name: a-rather-long-name
                        bind_key: 231d39c1d7cc1ab1aee224cd096db932
                        values:
                          - {field: temperature_c, source: t}
                          - {field: humidity_pct, source: h}
                          - {field: pressure_pa, source: p}
                    """)
            Issue.record("a broadcast of 46 octets was accepted")
        } catch {
            let line = try #require(error.errors.first?.description)
            #expect(readme.contains("\n" + line + "\n"), "config/README.md does not show: \(line)")
        }
    }

    @Test func readmeErrorExampleIsWhatTheLoaderSays() throws {
        let readme = try repositoryText("config/README.md")
        let broken = try #require(
            yamlBlocks(readme).first { $0.hasPrefix("# broken.yaml") }, "no ```yaml block starting '# broken.yaml'")
        var errors: [ConfigError] = []
        do {
            _ = try BridgeConfig.load(text: broken)
        } catch {
            errors = error.errors
        }
        #expect(errors.count >= 3)
        for e in errors {
            let shown = readme.contains("broken.yaml: \(e.description)\n")
            #expect(shown, "config/README.md does not show: \(e)")
        }
        let summary = "blebridge check-config: \(errors.count) problems"
        let summaryShown = readme.contains(summary + "\n")
        #expect(summaryShown, "config/README.md does not show: \(summary)")
    }
}
