// The BLE subcommands of the built `blebridge` binary against bluez-sim running the demo scenario.
import Foundation
import TestSupport
import Testing

private let polar = "A0:9E:1A:4F:2C:11"
private let enviro = "D4:3A:2C:7E:10:05"
private let bthome = "A4:C1:38:8F:80:A5"
private let ruuvi = "CB:B8:33:4C:88:4F"
private let echo = "F1:E2:D3:C4:B5:A6"
private let nusRX = "6e400002-b5a3-f393-e0a9-e50e24dcca9e"

/// Runs `blebridge ARGS` against `sim`'s bus.
private func blebridge(_ sim: SimulatorFixture, _ arguments: [String], timeout: TimeInterval = 30) async throws -> (
    status: Int32, stdout: String, stderr: String
) {
    try await runCommand(Fixtures.executable("blebridge"), arguments, environment: sim.environment, timeout: timeout)
}

/// A simulator running the demo scenario (or `scenario`).
private func demo(_ scenario: String? = nil) async throws -> SimulatorFixture {
    if let scenario { return try await SimulatorFixture.start(scenario: scenario) }
    return try await SimulatorFixture.start(scenarioFile: Fixtures.config("demo-scenario.yaml"))
}

private func json(_ text: String) throws -> Any {
    try JSONSerialization.jsonObject(with: Data(text.utf8))
}

@Suite struct BLEScanCommandTests {
    @Test func scanTextListsEveryDemoDevice() async throws {
        let sim = try await demo()
        defer { sim.stopInBackground() }
        let r = try await blebridge(sim, ["scan", "--duration", "1.5"])
        #expect(r.status == 0, "stderr: \(r.stderr)")
        for address in [polar, "00:09:1F:84:6C:21", enviro, bthome, ruuvi, echo] {
            #expect(r.stdout.contains(address), "missing \(address) in\n\(r.stdout)")
        }
        let polarLine = r.stdout.split(separator: "\n").first { $0.hasPrefix(polar) } ?? ""
        #expect(polarLine.contains("Polar H10 4F2C11"))
        #expect(polarLine.contains("RSSI -"))
        #expect(polarLine.contains("TX 0 dBm"))
        #expect(polarLine.hasSuffix("(public)"))
        #expect(r.stdout.contains("  services: 180D, 180F"))
        #expect(r.stdout.contains("  service data FCD2: 4000"))
        #expect(r.stdout.contains("  manufacturer 0x0499: 05"))
        // Advertisements decoded where a parser exists.
        #expect(r.stdout.contains("  bthome_v2 (service data FCD2): {\"packet_id\":"))
        #expect(r.stdout.contains("  ruuvi_rawv2 (manufacturer 0x0499): {\"temperature_c\":24.3"))
    }

    @Test func scanJSONAndServiceFilter() async throws {
        let sim = try await demo()
        defer { sim.stopInBackground() }
        let r = try await blebridge(sim, ["scan", "--duration", "1.2", "--json"])
        #expect(r.status == 0, "stderr: \(r.stderr)")
        let devices = try #require(try json(r.stdout) as? [[String: Any]])
        #expect(devices.count == 6)
        let p = try #require(devices.first { $0["address"] as? String == polar })
        #expect(p["name"] as? String == "Polar H10 4F2C11")
        #expect(p["address_type"] as? String == "public")
        #expect(p["services"] as? [String] == ["180D", "180F"])
        #expect(p["tx_power"] as? Int == 0)
        let rssi = try #require(p["rssi"] as? Int)
        #expect((-61)...(-55) ~= rssi)
        let e = try #require(devices.first { $0["address"] as? String == enviro })
        #expect(e["address_type"] as? String == "random")
        let ru = try #require(devices.first { $0["address"] as? String == ruuvi })
        let mfr = try #require(ru["manufacturer_data"] as? [String: String])
        #expect(mfr["0x0499"]?.hasPrefix("05") == true)
        let bt = try #require(devices.first { $0["address"] as? String == bthome })
        let sd = try #require(bt["service_data"] as? [String: String])
        #expect(sd["FCD2"]?.hasPrefix("4000") == true)
        let decoded = try #require(bt["decoded"] as? [[String: Any]])
        #expect(decoded.first?["parser"] as? String == "bthome_v2")
        #expect(decoded.first?["source"] as? String == "service data FCD2")
        let reading = try #require(decoded.first?["reading"] as? [String: Any])
        #expect(reading["battery_pct"] as? Int == 93)
        let temperature = try #require(reading["temperature_c"] as? Double)
        #expect((25.0...25.2).contains(temperature))
        let ruuviDecoded = try #require(ru["decoded"] as? [[String: Any]])
        #expect(ruuviDecoded.first?["parser"] as? String == "ruuvi_rawv2")
        #expect((p["decoded"] as? [Any])?.isEmpty == true)

        let filtered = try await blebridge(sim, ["scan", "--duration", "1", "--json", "--service", "181a"])
        #expect(filtered.status == 0, "stderr: \(filtered.stderr)")
        let only = try #require(try json(filtered.stdout) as? [[String: Any]])
        #expect(only.map { $0["address"] as? String } == [enviro])
    }
}

@Suite struct BLEConnectCommandTests {
    @Test func exploreTextShowsTreeAndDecodedValues() async throws {
        let sim = try await demo()
        defer { sim.stopInBackground() }
        let r = try await blebridge(sim, ["explore", polar])
        #expect(r.status == 0, "stderr: \(r.stderr)")
        let out = r.stdout
        #expect(out.hasPrefix("device Polar H10 4F2C11 (\(polar)), MTU 247"))
        #expect(out.contains("service 180D (primary)"))
        #expect(out.contains("  characteristic 2A37 heart_rate_measurement [notify]\n    descriptor 2902: 0000"))
        #expect(
            out.contains(
                "  characteristic 2A38 body_sensor_location [read]\n    value: 01 -> {\"body_sensor_location\":1,"))
        #expect(out.contains("  characteristic 2A19 battery_level [read, notify]"))
        #expect(out.contains("value: 5a -> {\"battery_pct\":90}"))
        #expect(out.contains("descriptor 2904: 0400ad27010000"))
        let nameHex = Data("Polar H10 4F2C11".utf8).map { String(format: "%02x", $0) }.joined()
        #expect(
            out.contains(
                "  characteristic 2A00 device_name [read]\n    value: \(nameHex) -> {\"device_name\":\"Polar H10 4F2C11\"}"
            ))
        // A vendor characteristic without a parser: properties only, nothing decoded.
        let nus = try await blebridge(sim, ["explore", echo])
        #expect(nus.status == 0, "stderr: \(nus.stderr)")
        #expect(nus.stdout.contains("  characteristic \(nusRX) [write-without-response, write]\n"))
        #expect(
            nus.stdout.contains(
                "  characteristic 6e400003-b5a3-f393-e0a9-e50e24dcca9e [notify]\n    descriptor 2902: 0000"))
    }

    @Test func exploreJSON() async throws {
        let sim = try await demo()
        defer { sim.stopInBackground() }
        let r = try await blebridge(sim, ["explore", enviro, "--json"])
        #expect(r.status == 0, "stderr: \(r.stderr)")
        let root = try #require(try json(r.stdout) as? [String: Any])
        #expect(root["address"] as? String == enviro)
        #expect(root["name"] as? String == "EnviroSense ES-1")
        #expect(root["mtu"] as? Int == 247)
        let services = try #require(root["services"] as? [[String: Any]])
        #expect(services.map { $0["uuid"] as? String } == ["1800", "180A", "181A", "180F"])
        let env = try #require(services.first { $0["uuid"] as? String == "181A" })
        let chars = try #require(env["characteristics"] as? [[String: Any]])
        let temp = try #require(chars.first { $0["uuid"] as? String == "2A6E" })
        #expect(temp["parser"] as? String == "temperature")
        #expect(temp["properties"] as? [String] == ["read", "notify"])
        #expect(temp["value"] as? String == "6608")
        let decoded = try #require(temp["decoded"] as? [String: Any])
        #expect(decoded["temperature_c"] as? Double == 21.5)
    }

    @Test func readByUUIDAndByName() async throws {
        let sim = try await demo()
        defer { sim.stopInBackground() }
        let byName = try await blebridge(sim, ["read", polar, "battery_level"])
        #expect(byName.status == 0, "stderr: \(byName.stderr)")
        #expect(byName.stdout == "{\"battery_pct\":90}\n")
        let raw = try await blebridge(sim, ["read", polar, "0x2a00", "--hex"])
        #expect(raw.stdout == Data("Polar H10 4F2C11".utf8).map { String(format: "%02x", $0) }.joined() + "\n")
        let unknownName = try await blebridge(sim, ["read", polar, "not_a_characteristic"])
        #expect(unknownName.status == 64)
        #expect(unknownName.stderr.contains("'not_a_characteristic' is neither a UUID nor a characteristic name"))
    }

    @Test func writeWithAndWithoutResponse() async throws {
        let sim = try await demo()
        defer { sim.stopInBackground() }
        let request = try await blebridge(sim, ["write", echo, nusRX, "68656c6c6f"])
        #expect(request.status == 0, "stderr: \(request.stderr)")
        #expect(request.stdout == "wrote 5 byte(s) to \(nusRX) (request)\n")
        let command = try await blebridge(sim, ["write", echo, nusRX, "21", "--without-response"])
        #expect(command.status == 0, "stderr: \(command.stderr)")
        #expect(command.stdout == "wrote 1 byte(s) to \(nusRX) (command)\n")
        let writes = try await sim.control("GetWrites", ["string:\(echo)"])
        #expect(writes.contains("\"request\""))
        #expect(writes.contains("\"command\""))
    }

    @Test func notifyPrintsDecodedValues() async throws {
        let sim = try await demo()
        defer { sim.stopInBackground() }
        let r = try await blebridge(sim, ["notify", polar, "2A37", "--count", "2"])
        #expect(r.status == 0, "stderr: \(r.stderr)")
        let lines = r.stdout.split(separator: "\n")
        #expect(lines.count == 2)
        for line in lines {
            let object = try #require(try json(String(line)) as? [String: Any])
            #expect(object["heart_rate_bpm"] is Int)
        }
    }

    @Test func notifyStopsAndDisconnectsOnInterrupt() async throws {
        let sim = try await demo()
        defer { sim.stopInBackground() }
        let environment = sim.environment
        let child = try ChildProcess(
            executable: Fixtures.executable("blebridge"), arguments: ["notify", enviro, "temperature"],
            environment: environment)
        try await child.waitForOutput(timeout: 10) { $0.contains("temperature_c") }
        child.signal(SIGINT)
        let status = try await child.waitForExit(timeout: 10)
        #expect(status == 0, "stderr: \(child.stderr)")
        // The tool disconnected before exiting: the simulator has no connected device left.
        let counters = try await sim.control("GetCounters")
        let connected = counters.range(of: #"devices_connected"\s+variant\s+int64 (\d+)"#, options: .regularExpression)
            .map { String(counters[$0]).split(separator: " ").last.map(String.init) ?? "" }
        #expect(connected == "0", "counters: \(counters)")
    }
}

@Suite struct BLEErrorTests {
    @Test func missingAdapterUnknownDeviceAndNotPermitted() async throws {
        let sim = try await demo()
        defer { sim.stopInBackground() }
        let adapter = try await blebridge(sim, ["read", polar, "2A19", "--adapter", "hci9"])
        #expect(adapter.status == 69)
        #expect(adapter.stderr == "blebridge read: adapter hci9: no such adapter (present: hci0)\n")
        let device = try await blebridge(sim, ["explore", "11:22:33:44:55:66", "--scan-timeout", "0.5"])
        #expect(device.status == 69)
        #expect(device.stderr.contains("device 11:22:33:44:55:66: not found on hci0"))
        let denied = try await blebridge(sim, ["write", polar, "2A38", "02"])
        #expect(denied.status == 77)
        #expect(
            denied.stderr
                == "blebridge write: device Polar H10 4F2C11 (\(polar)): write 2A38 failed: not permitted: org.bluez.Error.NotPermitted Write not permitted\n"
        )
        let broadcaster = try await blebridge(sim, ["explore", ruuvi])
        #expect(broadcaster.status == 69)
        #expect(broadcaster.stderr.contains("device Ruuvi 884F (\(ruuvi)): BlueZ dropped it when scanning stopped"))
        let badAddress = try await blebridge(sim, ["read", "nonsense", "2A19"])
        #expect(badAddress.status == 64)
    }

    @Test func adapterPoweredOff() async throws {
        let scenario = """
            adapters:
              - id: hci0
                powered: false
            peripherals: []
            """
        let sim = try await demo(scenario)
        defer { sim.stopInBackground() }
        let r = try await blebridge(sim, ["scan", "--duration", "0.2"])
        #expect(r.status == 69)
        #expect(r.stderr.contains("adapter hci0: powered off"))
    }

    @Test func bluetoothdNotRunning() async throws {
        let bus = try await PrivateBus.start()
        let r = try await runCommand(
            Fixtures.executable("blebridge"), ["scan", "--duration", "0.2"], environment: bus.environment)
        await bus.stop()
        #expect(r.status == 69)
        #expect(r.stderr.contains("bluetoothd (org.bluez) is not running"))
    }
}
