// `/set` and `/get` through a declarative parser, and the `bridge/request/<op>` API.
import BridgeCore
import GATT
import Testing

/// The radiator of the docs' config: one acme_setpoint characteristic (read, write), 21.00 °C now.
struct Radiator {
    static let addressText = "D0:12:34:56:78:9A"

    static func setpoint() throws -> BluetoothUUID { try uuid("6e400020-b5a3-f393-e0a9-e50e24dcca9e") }

    /// The radiator alone, polled every 60 s for its battery level.
    static let pollConfig = """
        mqtt: {url: mqtt://127.0.0.1:1883}
        devices:
          - name: radiator
            match: {address: "D0:12:34:56:78:9A"}
            mode: poll
            poll: [battery_level]
            poll_interval: 60
        """

    static func add(_ central: FakeCentral) throws {
        let service = try uuid("6e400001-b5a3-f393-e0a9-e50e24dcca9e")
        let battery = BluetoothUUID(UInt16(0x2A19))
        central.addDevice(
            try address(addressText),
            [
                characteristic(try setpoint(), service: service, ["read", "write"]),
                characteristic(battery, service: BluetoothUUID(UInt16(0x180F)), ["read"]),
            ],
            values: [try setpoint(): [0x34, 0x08], battery: [0x50]])
    }

    /// Advertises the radiator and waits until its session is up.
    static func connect(_ h: BridgeHarness) async throws -> FakeLink {
        let a = try address(addressText)
        h.central.advertise(a, rssi: -70)
        try await h.mqtt.waitForMessage(on: "blebridge/radiator/availability") { $0.text.contains("online") }
        return try #require(h.central.links(to: a).first)
    }
}

@Suite struct SetGetTests {
    @Test func setEncodesWritesAndAnswers() async throws {
        try await withBridge(docsConfig, setup: Radiator.add) { h in
            let link = try await Radiator.connect(h)
            let answer = try await h.command("blebridge/radiator/set", #"{"setpoint_c": 21.5, "transaction": "t-1"}"#)
            #expect(answer["status"] == .string("ok"), "\(answer.text)")
            #expect(answer["transaction"] == .string("t-1"))
            #expect(answer["data"]?["setpoint_c"] == .double(21.5))
            #expect(
                link.writes == [FakeLink.Write(uuid: try Radiator.setpoint(), value: [0x66, 0x08], withResponse: true)])
            // The new value is part of the state.
            try await h.mqtt.waitForJSON(on: "blebridge/radiator") { $0["setpoint_c"] == .double(21.5) }
            #expect(h.mqtt.messages(on: "blebridge/radiator/set/result").allSatisfy { !$0.retain })
        }
    }

    @Test func setOneValueFromItsOwnTopic() async throws {
        try await withBridge(docsConfig, setup: Radiator.add) { h in
            let link = try await Radiator.connect(h)
            let answer = try await h.command("blebridge/radiator/set/setpoint_c", "19")
            #expect(answer["status"] == .string("ok"), "\(answer.text)")
            #expect(link.writes.map(\.value) == [[0x6C, 0x07]])
        }
    }

    @Test func badCommandsAnswerAnErrorAndWriteNothing() async throws {
        try await withBridge(docsConfig, setup: Radiator.add) { h in
            let link = try await Radiator.connect(h)

            let badJSON = try await h.command("blebridge/radiator/set", #"{"setpoint_c": }"#)
            #expect(badJSON["status"] == .string("error"))
            #expect(badJSON["error"]?.string?.contains("invalid JSON at offset 15") == true, "\(badJSON.text)")

            let notObject = try await h.command("blebridge/radiator/set", "[21.5]")
            #expect(notObject["status"] == .string("error"))

            let unknown = try await h.command("blebridge/boiler/set", #"{"setpoint_c": 21.5, "transaction": 9}"#)
            #expect(unknown["status"] == .string("error"))
            #expect(unknown["error"] == .string("unknown device 'boiler'"))
            #expect(unknown["transaction"] == .int(9))

            let notWritable = try await h.command("blebridge/radiator/set", #"{"target_c": 20}"#)
            #expect(notWritable["status"] == .string("error"))
            #expect(notWritable["error"]?.string?.contains("'target_c' is not writable on radiator") == true)
            #expect(notWritable["error"]?.string?.contains("setpoint_c") == true)

            let nothing = try await h.command("blebridge/radiator/set", #"{"transaction": 1}"#)
            #expect(nothing["status"] == .string("error"))

            let passive = try await h.command("blebridge/balcony/set", #"{"temperature_c": 20}"#)
            #expect(passive["status"] == .string("error"))

            #expect(link.writes.isEmpty)
        }
    }

    @Test func outOfRangeValuesAreRefused() async throws {
        let yaml = docsConfig.replacing(
            "writable: [setpoint_c]", with: "writable: [{name: setpoint_c, min: 5, max: 30}]")
        try await withBridge(yaml, setup: Radiator.add) { h in
            let link = try await Radiator.connect(h)
            let high = try await h.command("blebridge/radiator/set", #"{"setpoint_c": 35}"#)
            #expect(high["status"] == .string("error"))
            #expect(high["error"]?.string?.contains("above the maximum") == true, "\(high.text)")
            let low = try await h.command("blebridge/radiator/set", #"{"setpoint_c": 4.5}"#)
            #expect(low["status"] == .string("error"))
            #expect(low["error"]?.string?.contains("below the minimum") == true)
            let text = try await h.command("blebridge/radiator/set/setpoint_c", "warm")
            #expect(text["status"] == .string("error"))
            #expect(link.writes.isEmpty)

            let ok = try await h.command("blebridge/radiator/set", #"{"setpoint_c": 30}"#)
            #expect(ok["status"] == .string("ok"))
            #expect(link.writes.map(\.value) == [[0xB8, 0x0B]])
        }
    }

    @Test func failedWriteAnswersTheBlueZError() async throws {
        try await withBridge(docsConfig, setup: Radiator.add) { h in
            let link = try await Radiator.connect(h)
            let setpoint = try Radiator.setpoint()
            link.state.withLock {
                $0.writeErrors[setpoint] = BLEError(
                    .notPermitted, name: "org.bluez.Error.NotPermitted", message: "Write not permitted")
            }
            let answer = try await h.command("blebridge/radiator/set", #"{"setpoint_c": 21.5}"#)
            #expect(answer["status"] == .string("error"))
            #expect(answer["error"]?.string?.contains("org.bluez.Error.NotPermitted") == true, "\(answer.text)")
        }
    }

    @Test func getReadsAndAnswersTheValue() async throws {
        try await withBridge(docsConfig, setup: Radiator.add) { h in
            let link = try await Radiator.connect(h)
            let answer = try await h.command("blebridge/radiator/get", #"{"setpoint_c": "", "transaction": "g"}"#)
            #expect(answer["status"] == .string("ok"), "\(answer.text)")
            #expect(answer["data"]?["setpoint_c"]?.isNumber(near: 21.0) == true)
            #expect(answer["transaction"] == .string("g"))
            #expect(link.reads.contains(try Radiator.setpoint()))
            try await h.mqtt.waitForJSON(on: "blebridge/radiator") { $0["setpoint_c"]?.isNumber(near: 21.0) == true }

            let one = try await h.command("blebridge/radiator/get/battery_pct", "")
            #expect(one["data"]?["battery_pct"] == .int(80), "\(one.text)")

            let unknown = try await h.command("blebridge/radiator/get", #"{"humidity_pct": ""}"#)
            #expect(unknown["status"] == .string("error"))
        }
    }

    @Test func setConnectsADeviceThatIsNotConnected() async throws {
        try await withBridge(docsConfig, setup: Radiator.add) { h in
            // The radiator has not advertised: the command connects for the write and disconnects again.
            let answer = try await h.command("blebridge/radiator/set", #"{"setpoint_c": 22}"#)
            #expect(answer["status"] == .string("ok"), "\(answer.text)")
            let link = try #require(h.central.links(to: try address(Radiator.addressText)).first)
            #expect(link.writes.map(\.value) == [[0x98, 0x08]])
            #expect(link.disconnectCalls == 1)
        }
    }
}

@Suite struct RequestTests {
    @Test func devicesListsTheConfiguredDevices() async throws {
        try await withBridge(docsConfig) { h in
            let answer = try await h.request("devices", #"{"transaction": 42}"#)
            #expect(answer["status"] == .string("ok"))
            #expect(answer["transaction"] == .int(42))
            let devices = try #require(answer["data"]?["devices"]?.items)
            #expect(devices.map { $0["id"] } == [.string("chest_strap"), .string("balcony"), .string("radiator")])
            #expect(devices.map { $0["mode"] } == [.string("connected"), .string("passive"), .string("connected")])
            #expect(devices[1]["address"] == .string("A4:C1:38:12:34:56"))
            #expect(devices[0]["address"] == .null)
            #expect(devices[2]["writable"]?.items?.first?["parser"] == .string("acme_setpoint"))
        }
    }

    @Test func healthCheckReportsTheParts() async throws {
        try await withBridge(docsConfig) { h in
            let answer = try await h.request("health_check")
            #expect(answer["status"] == .string("ok"))
            let data = answer["data"]
            #expect(data?["healthy"] == .bool(true), "\(answer.text)")
            #expect(data?["mqtt"]?["connected"] == .bool(true))
            #expect(data?["bluetoothd"] == .bool(true))
            #expect(data?["adapters"]?.items?.first?["name"] == .string("hci0"))
            #expect(data?["adapters"]?.items?.first?["free_slots"] == .int(5))

            // bluetoothd leaves: unhealthy; back: healthy and scanning again.
            let scans = h.central.scans.count
            h.central.send(.bluetoothdStopped)
            let down = try await pollHealth(h) { $0["healthy"] == .bool(false) }
            #expect(down["bluetoothd"] == .bool(false))
            h.central.send(.bluetoothdStarted)
            try await eventually("scanning again") { h.central.scans.count > scans }
            let up = try await pollHealth(h) { $0["healthy"] == .bool(true) }
            #expect(up["adapters"]?.items?.count == 1)

            // The broker goes away and comes back.
            h.mqtt.setState(.disconnected(reason: "connection refused"))
            _ = try await pollHealth(h) { $0["mqtt"]?["connected"] == .bool(false) }
        }
    }

    /// Asks for health until `condition` holds on its data (state changes are applied asynchronously).
    func pollHealth(_ h: BridgeHarness, _ condition: (JSONValue) -> Bool) async throws -> JSONValue {
        let limit = ContinuousClock.now + .seconds(5)
        while true {
            let answer = try await h.request("health_check")
            if let data = answer["data"], condition(data) { return data }
            if ContinuousClock.now > limit { throw TimeoutError(description: "health never matched: \(answer.text)") }
            try await Task.sleep(for: .milliseconds(2))
        }
    }

    @Test func unknownOperationIsAnError() async throws {
        try await withBridge(docsConfig) { h in
            let answer = try await h.request("frobnicate", #"{"transaction": "x"}"#)
            #expect(answer["status"] == .string("error"))
            #expect(answer["error"]?.string?.contains("unknown request 'frobnicate'") == true)
            #expect(answer["transaction"] == .string("x"))

            let bad = try await h.request("devices", "{nope")
            #expect(bad["status"] == .string("error"))
            #expect(bad["error"]?.string?.contains("invalid JSON") == true)
        }
    }

    @Test func rawReadIsRefusedWithoutAllowRawGATT() async throws {
        let yaml = docsConfig.replacing("allow_raw_gatt: true\n", with: "")
        try await withBridge(yaml, setup: Radiator.add) { h in
            let answer = try await h.request(
                "device/read", #"{"id": "radiator", "characteristic": "6e400020-b5a3-f393-e0a9-e50e24dcca9e"}"#)
            #expect(answer["status"] == .string("error"))
            #expect(answer["error"]?.string?.contains("allow_raw_gatt") == true, "\(answer.text)")
            let write = try await h.request(
                "device/write", #"{"id": "radiator", "characteristic": "2A19", "value": "00"}"#)
            #expect(write["status"] == .string("error"))
            #expect(h.central.attempts.isEmpty)
        }
    }

    @Test func rawReadWithAllowRawGATT() async throws {
        try await withBridge(docsConfig, setup: Radiator.add) { h in
            _ = try await Radiator.connect(h)
            let answer = try await h.request(
                "device/read", #"{"id": "radiator", "characteristic": "6e400020-b5a3-f393-e0a9-e50e24dcca9e"}"#)
            #expect(answer["status"] == .string("ok"), "\(answer.text)")
            #expect(answer["data"]?["value"] == .string("3408"))
            #expect(answer["data"]?["decoded"]?["setpoint_c"]?.isNumber(near: 21.0) == true)
        }
    }

    @Test func answersOnTheMQTT5ResponseTopicWithCorrelationData() async throws {
        try await withBridge(docsConfig) { h in
            h.mqtt.inject(
                "blebridge/bridge/request/info", "", responseTopic: "clients/ui/replies", correlationData: [1, 2, 3])
            let reply = try await h.mqtt.waitForMessage(on: "clients/ui/replies")
            #expect(reply.correlationData == [1, 2, 3])
            let json = try JSONReader.parse(reply.payload)
            #expect(json["status"] == .string("ok"))
            #expect(json["data"]?["gateway"] == .string("testgw"))
            #expect(h.mqtt.messages(on: "blebridge/bridge/response/info").isEmpty)
        }
    }

    @Test func disconnectRequestStopsTheSessionUntilConnect() async throws {
        try await withBridge(docsConfig, setup: Radiator.add) { h in
            let link = try await Radiator.connect(h)
            let answer = try await h.request("device/disconnect", #"{"id": "radiator"}"#)
            #expect(answer["status"] == .string("ok"), "\(answer.text)")
            #expect(link.disconnectCalls >= 1)
            // Advertisements do not bring it back.
            h.central.advertise(try address(Radiator.addressText))
            try await eventually("the advertisement handled") { h.bridge.counters.advertisements == 2 }
            h.clock.advance(by: .seconds(2))
            try await eventually("the ticker ran") { h.clock.hasSleeper(after: .seconds(2)) }
            #expect(h.central.attempts.count == 1)
            let refused = try await h.command("blebridge/radiator/set", #"{"setpoint_c": 20}"#)
            #expect(refused["status"] == .string("error"))

            let connect = try await h.request("device/connect", #"{"id": "radiator"}"#)
            #expect(connect["status"] == .string("ok"))
            try await eventually("reconnected") { h.central.links(to: try address(Radiator.addressText)).count == 2 }
        }
    }
}
