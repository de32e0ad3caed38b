// The peripheral role on fakes: the `peripheral:` section's checks, MQTT values encoded into served
// characteristics, central writes decoded onto sink topics, events, `bridge/info`, and the BTHome broadcast.
import BridgeCore
import GATT
import GATTCrypto
import Logging
import Synchronization
import Testing

/// A peripheral host that records what the core serves and lets the test play a central.
final class FakePeripheralHost: BLEPeripheralHost {
    struct State {
        var services: [LocalServiceSpec] = []
        var history: [String: [[UInt8]]] = [:]
        var serverRunning = false
        var serverRuns = 0
        var onWrite: (@Sendable (LocalWrite) async -> LocalWriteError?)?
        var events: (@Sendable (LocalPeripheralEvent) -> Void)?
        var advertisers: [FakeAdvertiser] = []
    }
    let state = Mutex(State())

    final class FakeServer: LocalGATTServer {
        let host: FakePeripheralHost
        init(host: FakePeripheralHost) { self.host = host }
        func run() async {
            host.state.withLock {
                $0.serverRunning = true
                $0.serverRuns += 1
            }
            host.emit(.registered(adapter: "hci0"))
            await withTaskCancellationHandler {
                let s = AsyncStream<Void> { _ in }
                for await _ in s {}
            } onCancel: {
            }
            host.state.withLock { $0.serverRunning = false }
        }
        func setValue(_ value: [UInt8], characteristic: String) {
            host.state.withLock { $0.history[characteristic, default: []].append(value) }
        }
    }

    final class FakeAdvertiser: LocalAdvertiser {
        let specs: Mutex<[LocalAdvertisementSpec]>
        let running = Mutex(false)
        init(_ spec: LocalAdvertisementSpec) { specs = Mutex([spec]) }
        func run() async {
            running.withLock { $0 = true }
            await withTaskCancellationHandler {
                let s = AsyncStream<Void> { _ in }
                for await _ in s {}
            } onCancel: {
            }
            running.withLock { $0 = false }
        }
        func update(_ spec: LocalAdvertisementSpec) { specs.withLock { $0.append(spec) } }
        var current: LocalAdvertisementSpec? { specs.withLock { $0.last } }
    }

    func makeServer(
        services: [LocalServiceSpec], adapter: String?,
        onWrite: @escaping @Sendable (LocalWrite) async -> LocalWriteError?,
        events: @escaping @Sendable (LocalPeripheralEvent) -> Void
    ) -> any LocalGATTServer {
        state.withLock {
            $0.services = services
            $0.onWrite = onWrite
            $0.events = events
        }
        return FakeServer(host: self)
    }

    func makeAdvertiser(
        _ spec: LocalAdvertisementSpec, adapter: String?, events: @escaping @Sendable (LocalPeripheralEvent) -> Void
    ) -> any LocalAdvertiser {
        let a = FakeAdvertiser(spec)
        state.withLock { $0.advertisers.append(a) }
        return a
    }

    func adapterAddress(_ adapter: String?) async -> String? { "00:1A:7D:DA:71:10" }

    // Test side
    func emit(_ e: LocalPeripheralEvent) { state.withLock { $0.events }?(e) }
    func write(_ id: String, _ bytes: [UInt8], withResponse: Bool = true) async -> LocalWriteError? {
        guard let w = state.withLock({ $0.onWrite }) else { return .notPermitted("no server") }
        return await w(
            LocalWrite(
                characteristic: id, value: bytes, withResponse: withResponse, central: BLEAddress("11:22:33:44:55:66")))
    }
    func history(_ id: String) -> [[UInt8]] { state.withLock { $0.history[id] ?? [] } }
    var services: [LocalServiceSpec] { state.withLock { $0.services } }
    var broadcasters: [FakeAdvertiser] { state.withLock { $0.advertisers.filter { $0.current?.connectable == false } } }
    var connectable: [FakeAdvertiser] { state.withLock { $0.advertisers.filter { $0.current?.connectable == true } } }
}

/// Loads `yaml`, runs a bridge with a peripheral host over fakes, runs `body`, and stops it.
func withPeripheralBridge(
    _ yaml: String, retained: [(topic: String, text: String)] = [],
    _ body: (BridgeHarness, FakePeripheralHost) async throws -> Void
) async throws {
    Bridge.cipher = OpenSSLAESCCM()
    let config = try BridgeConfig.load(text: yaml)
    let central = FakeCentral(adapters: ["hci0"])
    let mqtt = FakeMQTT()
    for m in retained { mqtt.retain(m.topic, m.text) }
    let clock = TestClock()
    let logs = MemoryLogHandler()
    let host = FakePeripheralHost()
    let bridge = Bridge(
        config: config, central: central, mqtt: mqtt, clock: clock, logger: Logger(handler: logs, level: .debug),
        gatewayName: "testgw", peripheralHost: host)
    let run = Task { await bridge.run() }
    let h = BridgeHarness(
        config: config, central: central, mqtt: mqtt, clock: clock, logs: logs, bridge: bridge, run: run)
    do {
        try await eventually("the bridge and its GATT server are up") {
            !mqtt.messages(on: "blebridge/bridge/state").isEmpty
                && (config.peripheral?.services.isEmpty == true || host.state.withLock { $0.serverRunning })
                && Set(config.peripheral?.sourceTopics ?? []).isSubset(of: Set(mqtt.filters.withLock { $0 }))
        }
        try await body(h, host)
    } catch {
        _ = await h.stop()
        throw error
    }
    let stopped = await h.stop()
    #expect(stopped, "run() did not return after cancellation")
    #expect(host.state.withLock { !$0.serverRunning }, "the GATT server still runs after shutdown")
}

let peripheralYAML = """
    mqtt: {url: "mqtt://127.0.0.1:1883"}
    peripheral:
      name: bb-test
      services:
        - preset: environmental_sensing
          temperature: {topic: home/living, field: temperature_c}
          humidity: {topic: home/living, field: humidity}
        - preset: battery
          level: home/ups/battery
        - preset: device_information
          manufacturer: ACME
        - uuid: "6e400001-b5a3-f393-e0a9-e50e24dcca9e"
          name: lamp
          characteristics:
            - uuid: battery_level
              flags: [read, write, notify]
              source: {topic: home/lamp, field: level}
              sink: home/lamp/set
            - uuid: "6e400003-b5a3-f393-e0a9-e50e24dcca9e"
              flags: [write-without-response]
              sink: home/lamp/raw
              description: Raw command
    """

@Suite struct PeripheralConfigTests {
    @Test func presetsExpandIntoTheStandardServices() throws {
        let c = try BridgeConfig.load(text: peripheralYAML)
        let p = try #require(c.peripheral)
        #expect(p.name == "bb-test")
        #expect(p.services.map(\.uuid.description) == ["181A", "180F", "180A", "6e400001-b5a3-f393-e0a9-e50e24dcca9e"])
        let ess = p.services[0].characteristics
        #expect(ess.map(\.uuid.description) == ["2A6E", "2A6F"])
        #expect(ess.map(\.parserName) == ["temperature", "humidity"])
        #expect(ess[0].flags == ["read", "notify"])
        #expect(ess[1].source == PeripheralSource(topic: "home/living", field: "humidity"))
        let info = p.services[2].characteristics
        #expect(info.map(\.uuid.description) == ["2A29", "2A24", "2A26"])
        #expect(info[0].initialValue == Array("ACME".utf8))
        #expect(info[2].initialValue == Array(BridgeVersion.current.utf8))
        let lamp = p.services[3].characteristics
        #expect(lamp[0].uuid.description == "2A19" && lamp[0].parserName == "battery_level")
        #expect(lamp[1].parserName == nil && lamp[1].userDescription == "Raw command")
        #expect(p.sourceTopics == ["home/living", "home/ups/battery", "home/lamp"])
    }

    @Test func valuesInTheConfigAreEncodedAtLoad() throws {
        let c = try BridgeConfig.load(
            text: """
                mqtt: {url: "mqtt://127.0.0.1:1883"}
                peripheral:
                  services:
                    - uuid: 181A
                      characteristics:
                        - {uuid: 2A6E, value: {temperature_c: 20}}
                        - {uuid: 2A6F, value: 45.5}
                        - {uuid: "6e400003-b5a3-f393-e0a9-e50e24dcca9e", value: "0a1b"}
                        - {uuid: "6e400004-b5a3-f393-e0a9-e50e24dcca9e", value: 1234}
                """)
        let chars = try #require(c.peripheral).services[0].characteristics
        #expect(chars[0].initialValue == [0xD0, 0x07])
        #expect(chars[1].initialValue == [0xC6, 0x11])
        #expect(chars[2].initialValue == [0x0A, 0x1B])
        #expect(chars[3].initialValue == [0x12, 0x34], "raw hex that YAML reads as a number")
    }

    func errors(_ peripheral: String) -> [String] {
        do {
            _ = try BridgeConfig.load(text: "mqtt: {url: \"mqtt://127.0.0.1:1883\"}\nperipheral:\n" + peripheral)
            return []
        } catch {
            return error.errors.map(\.description)
        }
    }

    @Test func badPeripheralSectionsNameThePathAndTheReason() {
        #expect(
            errors("  services: [{preset: thermostat}]")
                == [
                    "peripheral.services[0].preset: \"thermostat\" is not one of battery, device_information, "
                        + "environmental_sensing, bridge_status"
                ])
        #expect(
            errors("  services: [{uuid: 181A, characteristics: [{uuid: 2A6E, flags: [red]}]}]")
                == [
                    "peripheral.services[0].characteristics[0].flags[0]: \"red\" is not a GATT characteristic flag "
                        + "(did you mean 'read'?)"
                ])
        #expect(
            errors("  services: [{uuid: 181A, characteristics: [{uuid: 2A6E, flags: [read, write]}]}]")
                == [
                    "peripheral.services[0].characteristics[0]: a writable characteristic needs a 'sink' topic for "
                        + "what centrals write"
                ])
        #expect(
            errors("  services: [{uuid: 181A, characteristics: [{uuid: 2A6E, source: \"home/+/t\"}]}]")
                == [
                    "peripheral.services[0].characteristics[0].source: \"home/+/t\" is not a topic to subscribe to (no wildcards)"
                ])
        #expect(
            errors("  services: [{uuid: 181A, characteristics: [{uuid: 2A6E, value: {temperature_c: 900}}]}]").first?
                .hasPrefix("peripheral.services[0].characteristics[0].value: temperature: cannot encode") == true)
        #expect(
            errors("  services: [{uuid: 181A, characteristics: [{uuid: nonsense}]}]")
                == [
                    "peripheral.services[0].characteristics[0].uuid: \"nonsense\" is neither a characteristic UUID nor a parser name"
                ])
        #expect(errors("  {}") == ["peripheral: give 'services', 'broadcast' or both"])
        #expect(
            errors("  broadcast: {bind_key: abcd, values: [{field: temperature_c, source: t}]}")
                == ["peripheral.broadcast.bind_key: a BTHome bind key is 32 hex digits (16 octets)"])
        #expect(
            errors("  broadcast: {values: [{field: colour, source: t}]}").first
                == "peripheral.broadcast.values[0].field: \"colour\" is not a BTHome v2 field this bridge can encode")
        #expect(errors("  services: [{preset: battery, levle: t}]").first?.contains("did you mean 'level'?") == true)
    }

    @Test func aBroadcastThatDoesNotFitIsRejectedAtLoad() throws {
        let fits = try BridgeConfig.load(
            text: """
                mqtt: {url: "mqtt://127.0.0.1:1883"}
                peripheral:
                  broadcast:
                    name: attic
                    values:
                      - {field: temperature_c, source: t}
                      - {field: humidity_pct, source: h}
                      - {field: battery_pct, source: b}
                """)
        // flags 3 + service data (2 + 2 UUID + info 1 + packet id 2 + 3 + 3 + 2) + name (2 + 5)
        #expect(fits.peripheral?.broadcast?.payloadLength == 3 + 15 + 7)
        let e = errors(
            """
              broadcast:
                name: a-rather-long-name
                bind_key: 231d39c1d7cc1ab1aee224cd096db932
                values:
                  - {field: temperature_c, source: t}
                  - {field: humidity_pct, source: h}
                  - {field: pressure_pa, source: p}
            """)
        #expect(e.count == 1)
        #expect(e.first?.hasPrefix("peripheral.broadcast: the broadcast needs 46 octets of advertising data") == true)
    }
}

@Suite struct PeripheralServiceTests {
    @Test func mqttValuesAreEncodedIntoTheServedCharacteristics() async throws {
        try await withPeripheralBridge(peripheralYAML) { h, host in
            #expect(host.services.count == 4)
            h.mqtt.inject("home/living", #"{"temperature_c": 21.5, "humidity": 40}"#)
            h.mqtt.inject("home/ups/battery", "87")
            try await eventually("values set") { host.history("s0c0").count == 1 && host.history("s1c0").count == 1 }
            #expect(host.history("s0c0") == [[0x66, 0x08]])
            #expect(host.history("s0c1") == [[0xA0, 0x0F]])
            #expect(host.history("s1c0") == [[87]])
            // A value that cannot be encoded is dropped with a message; the others keep flowing.
            h.mqtt.inject("home/living", #"{"temperature_c": "hot", "humidity": 41}"#)
            try await eventually("humidity set again") { host.history("s0c1").count == 2 }
            #expect(host.history("s0c0").count == 1)
            #expect(h.bridge.peripheral?.value(of: "s0c0") == [0x66, 0x08])
            #expect(h.logs.entries.contains { $0.message.contains("peripheral.services[0].temperature (2A6E)") })
            h.mqtt.inject("home/living", #"{"humidity": 42}"#)
            try await eventually("humidity set a third time") { host.history("s0c1").count == 3 }
            #expect(h.logs.entries.filter { $0.message.contains("has no field 'temperature_c'") }.count == 1)
        }
    }

    /// A source value retained on the broker before the bridge starts is served at once (the real-BlueZ rig's
    /// central read an empty Battery Level: the retained message came with the subscribe, before anyone listened).
    @Test func retainedSourceValuesFromBeforeTheStartAreServed() async throws {
        try await withPeripheralBridge(peripheralYAML, retained: [("home/ups/battery", "64")]) { h, host in
            try await eventually("the retained value set") { host.history("s1c0") == [[64]] }
            #expect(h.mqtt.lostRetained.withLock { $0 } == 0)
        }
    }

    @Test func rawHexThatLooksLikeANumberIsStillHex() async throws {
        let yaml = """
            mqtt: {url: "mqtt://127.0.0.1:1883"}
            peripheral:
              services:
                - uuid: "6e400001-b5a3-f393-e0a9-e50e24dcca9e"
                  characteristics:
                    - {uuid: "6e400003-b5a3-f393-e0a9-e50e24dcca9e", source: raw/value}
            """
        try await withPeripheralBridge(yaml) { h, host in
            for text in ["12345678", "0e000000", "00", "0a1b", "zz"] { h.mqtt.inject("raw/value", text) }
            try await eventually("four values") { host.history("s0c0").count == 4 }
            #expect(host.history("s0c0") == [[0x12, 0x34, 0x56, 0x78], [0x0E, 0, 0, 0], [0], [0x0A, 0x1B]])
            #expect(h.bridge.peripheral?.counters.encodeErrors == 1)
        }
    }

    @Test func aHundredUpdatesArriveInOrder() async throws {
        try await withPeripheralBridge(peripheralYAML) { h, host in
            for i in 0..<100 { h.mqtt.inject("home/ups/battery", "\(i)") }
            try await eventually("100 values") { host.history("s1c0").count == 100 }
            #expect(host.history("s1c0") == (0..<100).map { [UInt8($0)] })
        }
    }

    @Test func centralWritesAreDecodedOntoTheSinkAndBadOnesRefused() async throws {
        try await withPeripheralBridge(peripheralYAML) { h, host in
            #expect(await host.write("s3c0", [55]) == nil)
            let m = try await h.mqtt.waitForJSON(on: "home/lamp/set")
            #expect(m == .object([("battery_pct", .int(55))]))
            #expect(h.bridge.peripheral?.value(of: "s3c0") == [55])
            // Wrong length, out of range: the ATT error, nothing published.
            if case .invalidLength? = await host.write("s3c0", [1, 2]) {} else { Issue.record("no invalid length") }
            if case .valueNotAllowed? = await host.write("s3c0", [150]) {} else { Issue.record("no value error") }
            #expect(h.mqtt.messages(on: "home/lamp/set").count == 1)
            #expect(h.bridge.peripheral?.counters.writeErrors == 2)
            // No parser: raw hex.
            #expect(await host.write("s3c1", [0xDE, 0xAD], withResponse: false) == nil)
            let raw = try await h.mqtt.waitForJSON(on: "home/lamp/raw")
            #expect(raw == .object([("raw", .string("dead"))]))
            // Not writable.
            if case .notPermitted? = await host.write("s0c0", [1, 2]) {} else { Issue.record("read-only written") }
        }
    }

    @Test func centralsAreReportedOnBridgeEventAndInfo() async throws {
        try await withPeripheralBridge(peripheralYAML) { h, host in
            let central = try address("11:22:33:44:55:66")
            host.emit(.centralConnected(central))
            host.emit(.subscribed(characteristic: "s0c0", central: central))
            let sub = try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") {
                $0["type"]?.string == "central_subscribed"
            }
            #expect(sub["data"]?["characteristic"]?.string == "2A6E")
            #expect(sub["data"]?["service"]?.string == "181A")
            let info = try await h.mqtt.waitForJSON(on: "blebridge/bridge/info") {
                $0["peripheral"]?["centrals"] == .array([.string("11:22:33:44:55:66")])
                    && $0["peripheral"]?["services"]?[0]?["characteristics"]?[0]?["notifying"] == .bool(true)
            }
            let services = info["peripheral"]?["services"]
            #expect(services?[0]?["uuid"]?.string == "181A")
            #expect(services?[0]?["characteristics"]?[0]?["notifying"] == .bool(true))
            #expect(info["peripheral"]?["registered"] == .bool(true))
            let health = try await h.request("health_check")
            #expect(health["data"]?["peripheral"]?["centrals"] == .int(1))
            #expect(health["data"]?["peripheral"]?["notifying"] == .int(1))
            #expect(health["data"]?["peripheral"]?["registered"] == .bool(true))
            host.emit(.centralDisconnected(central))
            _ = try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") {
                $0["type"]?.string == "central_disconnected"
            }
            #expect(
                h.mqtt.messages(on: "blebridge/bridge/event").filter { $0.text.contains("central_connected") }.count
                    == 1)
        }
    }

    @Test func aRegistrationThatKeepsFailingIsLoggedOncePerReason() async throws {
        try await withPeripheralBridge(peripheralYAML) { h, host in
            for delay in [1, 2, 4, 5, 5] {
                host.emit(
                    .registrationFailed(
                        "adapter hci0: RegisterApplication failed: org.bluez.Error.Failed; retrying in \(delay) s"))
            }
            host.emit(
                .registrationFailed(
                    "adapter hci0: RegisterApplication failed: org.bluez.Error.NotPermitted; retrying in 5 s"))
            try await eventually("the failures logged") {
                h.logs.entries.filter { $0.message.contains("registration failed") }.count == 6
            }
            let warnings = h.logs.entries.filter { $0.level == .warning && $0.message.contains("registration failed") }
            #expect(warnings.count == 2, "\(warnings.map(\.message))")
        }
    }

    @Test func theConnectableAdvertisementCarriesTheNameAndServices() async throws {
        try await withPeripheralBridge(peripheralYAML) { h, host in
            try await eventually("advertising") { host.connectable.first?.running.withLock { $0 } == true }
            let spec = try #require(host.connectable.first?.current)
            #expect(spec.localName == "bb-test")
            // 31 - flags 3 - name 9 = 19: three 16-bit UUIDs (8); a 128-bit one (18) does not fit any more.
            #expect(spec.serviceUUIDs.map(\.description) == ["181A", "180F", "180A"])
        }
    }

    @Test func broadcastIsBTHomeRateLimitedAndRoundTrips() async throws {
        let yaml = """
            mqtt: {url: "mqtt://127.0.0.1:1883"}
            peripheral:
              broadcast:
                name: attic
                interval: 10
                values:
                  - {field: temperature_c, source: {topic: home/attic, field: t}}
                  - {field: humidity_pct, source: {topic: home/attic, field: h}}
            """
        try await withPeripheralBridge(yaml) { h, host in
            h.mqtt.inject("home/attic", #"{"t": 21.25, "h": 50}"#)
            try await eventually("broadcasting") { host.broadcasters.first?.running.withLock { $0 } == true }
            let first = try #require(host.broadcasters.first?.current)
            #expect(first.localName == "attic")
            let data = try #require(first.serviceData[BluetoothUUID(UInt16(0xFCD2))])
            let reading = try BTHomeV2Parser().decode(
                data, from: .serviceData(BluetoothUUID(UInt16(0xFCD2))), context: AdvertisementContext())
            #expect(reading["temperature_c"] == .double(21.25))
            #expect(reading["humidity_pct"] == .double(50))
            #expect(reading["packet_id"] == .int(1))
            // A change within the interval waits for it; the latest value wins.
            h.mqtt.inject("home/attic", #"{"t": 22, "h": 51}"#)
            h.mqtt.inject("home/attic", #"{"t": 23, "h": 52}"#)
            try await eventually("the update waits for the interval") {
                h.clock.hasSleeper(at: .seconds(10)) && h.bridge.peripheral?.counters.sourceMessages == 3
            }
            #expect(host.broadcasters.first?.specs.withLock { $0.count } == 1)
            h.clock.advance(by: .seconds(10))
            try await eventually("updated after the interval") {
                host.broadcasters.first?.specs.withLock { $0.count } == 2
            }
            let second = try #require(host.broadcasters.first?.current?.serviceData[BluetoothUUID(UInt16(0xFCD2))])
            let r2 = try BTHomeV2Parser().decode(
                second, from: .serviceData(BluetoothUUID(UInt16(0xFCD2))), context: AdvertisementContext())
            #expect(r2["temperature_c"] == .double(23))
            #expect(r2["packet_id"] == .int(2))
            #expect(host.broadcasters.count == 1, "the advertisement is updated in place, not registered again")
        }
    }

    @Test func anEncryptedBroadcastDecryptsWithTheBindKey() async throws {
        let key = "231d39c1d7cc1ab1aee224cd096db932"
        let yaml = """
            mqtt: {url: "mqtt://127.0.0.1:1883"}
            peripheral:
              broadcast:
                bind_key: \(key)
                values: [{field: temperature_c, source: home/t}]
            """
        try await withPeripheralBridge(yaml) { h, host in
            h.mqtt.inject("home/t", "19.5")
            try await eventually("broadcasting") { host.broadcasters.first?.current != nil }
            let data = try #require(host.broadcasters.first?.current?.serviceData[BluetoothUUID(UInt16(0xFCD2))])
            #expect(data[0] & 0x01 == 1, "the encrypted bit is set")
            let reading = try BTHomeV2Parser().decode(
                data, from: .serviceData(BluetoothUUID(UInt16(0xFCD2))),
                context: AdvertisementContext(
                    mac: "00:1A:7D:DA:71:10", bindKey: bytesFromHex(key), cipher: OpenSSLAESCCM()))
            #expect(reading["temperature_c"] == .double(19.5))
            // A wrong key fails.
            #expect(throws: GATTParseError.self) {
                try BTHomeV2Parser().decode(
                    data, from: .serviceData(BluetoothUUID(UInt16(0xFCD2))),
                    context: AdvertisementContext(
                        mac: "00:1A:7D:DA:71:10", bindKey: [UInt8](repeating: 1, count: 16), cipher: OpenSSLAESCCM()))
            }
        }
    }

    /// `bridge/state` online from `serve` tells a client that what it publishes now is served: it comes after the
    /// source topics are subscribed, not when the broker connection comes up.
    @Test func serveSaysOnlineAfterItsSourcesAreSubscribed() async throws {
        let config = try BridgeConfig.load(text: peripheralYAML)
        let mqtt = FakeMQTT()
        mqtt.holdSubscribes()
        let host = FakePeripheralHost()
        let runner = PeripheralBridge(
            config: config, host: host, mqtt: mqtt, clock: TestClock(), logger: Logger(handler: MemoryLogHandler()))
        let run = Task { await runner.run() }
        try await eventually("a subscribe held, the connection handled") {
            !mqtt.filters.withLock { $0 }.isEmpty && mqtt.statesAsked.withLock { $0 } == 2
        }
        #expect(mqtt.messages(on: "blebridge/bridge/state").isEmpty)
        mqtt.releaseSubscribes()
        _ = try await mqtt.waitForJSON(on: "blebridge/bridge/state") { $0["state"]?.string == "online" }
        let journal = mqtt.journal.withLock { $0 }
        let birth = try #require(journal.firstIndex(of: "publish blebridge/bridge/state"))
        #expect(journal.filter { $0.hasPrefix("subscribed ") }.count == 3)
        #expect(journal.indices.filter { journal[$0].hasPrefix("subscribed ") }.allSatisfy { $0 < birth }, "\(journal)")
        // A reconnection says it again at once (the subscriptions are the transport's to restore).
        mqtt.setState(.disconnected(reason: "test"))
        mqtt.setState(.connected)
        _ = try await mqtt.waitForJSON(on: "blebridge/bridge/state", skip: 1) { $0["state"]?.string == "online" }
        run.cancel()
        await run.value
    }

    @Test func serveRunsThePeripheralAlone() async throws {
        let config = try BridgeConfig.load(text: peripheralYAML)
        let mqtt = FakeMQTT()
        mqtt.retain("home/living", #"{"temperature_c": 21.5}"#)
        let host = FakePeripheralHost()
        let runner = PeripheralBridge(
            config: config, host: host, mqtt: mqtt, clock: TestClock(), logger: Logger(handler: MemoryLogHandler()))
        let run = Task { await runner.run() }
        try await eventually("serving") {
            host.state.withLock { $0.serverRunning } && mqtt.filters.withLock { $0.count } == 3
        }
        _ = try await mqtt.waitForJSON(on: "blebridge/bridge/state") { $0["state"]?.string == "online" }
        let info = try await mqtt.waitForJSON(on: "blebridge/bridge/info") { $0["mode"]?.string == "serve" }
        #expect(info["peripheral"]?["services"]?[1]?["name"]?.string == "battery")
        // Retained before the start: served without a new message.
        try await eventually("the retained value set") { host.history("s0c0") == [[0x66, 0x08]] }
        #expect(mqtt.lostRetained.withLock { $0 } == 0)
        mqtt.inject("home/ups/battery", "64")
        try await eventually("value set") { host.history("s1c0") == [[64]] }
        run.cancel()
        await run.value
        #expect(mqtt.messages(on: "blebridge/bridge/state").last?.text == #"{"state":"offline"}"#)
        #expect(host.state.withLock { !$0.serverRunning })
    }
}
