// Pure pieces of the core: the reconnect policy, addresses, matching, ISO-8601 text, and the example configs.
import BridgeCore
import FoundationEssentials
import GATT
import Testing

@Suite struct ReconnectPolicyTests {
    let policy = ReconnectPolicy(initial: .seconds(1), maximum: .seconds(300))

    @Test func baseDelayDependsOnTheErrorClass() {
        #expect(policy.delay(attempt: 1, kind: .connectionAborted, jitter: 0.5) == .milliseconds(500))
        #expect(policy.delay(attempt: 1, kind: nil, jitter: 0.5) == .seconds(1))
        #expect(policy.delay(attempt: 1, kind: .connectFailed, jitter: 0.5) == .seconds(1))
        #expect(policy.delay(attempt: 1, kind: .notFound, jitter: 0.5) == .seconds(5))
        #expect(policy.delay(attempt: 1, kind: .adapterUnavailable, jitter: 0.5) == .seconds(5))
        #expect(policy.delay(attempt: 1, kind: .noSlots, jitter: 0.5) == .seconds(10))
    }

    @Test func growsExponentiallyWithJitter() {
        #expect(policy.delay(attempt: 2, kind: nil, jitter: 0.5) == .seconds(2))
        #expect(policy.delay(attempt: 4, kind: nil, jitter: 0.5) == .seconds(8))
        #expect(policy.delay(attempt: 1, kind: nil, jitter: 0) == .milliseconds(800))
        #expect(policy.delay(attempt: 1, kind: nil, jitter: 1) == .milliseconds(1200))
        // Out-of-range jitter and attempts are clamped, not trusted.
        #expect(policy.delay(attempt: 1, kind: nil, jitter: 7) == .milliseconds(1200))
        #expect(policy.delay(attempt: -3, kind: nil, jitter: 0.5) == .seconds(1))
        #expect(policy.delay(attempt: Int.max, kind: nil, jitter: 0.5) == .seconds(300))
    }

    /// `bluetooth.reconnect.max_delay` is "the longest reconnect delay": jitter may spread delays below it, but not
    /// above it.
    @Test func neverExceedsTheMaximum() {
        var longest = Duration.zero
        for attempt in [10, 20, 30] {
            for jitter in [0.0, 0.5, 0.99, 1.0] {
                longest = max(longest, policy.delay(attempt: attempt, kind: .noSlots, jitter: jitter))
            }
        }
        #expect(longest <= .seconds(300), "the longest delay is \(longest) with a maximum of 300 s")
    }
}

@Suite struct ValueTests {
    @Test func parsesAddresses() {
        #expect(BLEAddress("a4:c1:38:12:34:56")?.text == "A4:C1:38:12:34:56")
        #expect(BLEAddress("a4:c1:38:12:34:56") == BLEAddress("A4:C1:38:12:34:56"))
        #expect(BLEAddress("A4:C1:38:12:34:56")?.compact == "a4c138123456")
        for bad in [
            "", "A4:C1:38:12:34", "A4-C1-38-12-34-56", "A4:C1:38:12:34:5G", "A4:C1:38:12:34:567", "A4:C1:38:12:34:56:",
        ] {
            #expect(BLEAddress(bad) == nil, "\(bad)")
        }
    }

    @Test func globMatchesNames() {
        #expect(globMatch("ATC_*", "atc_1234"))
        #expect(globMatch("LYWSD03MMC", "lywsd03mmc"))
        #expect(globMatch("Polar H10 ????????", "Polar H10 12345678"))
        #expect(!globMatch("Polar H10 ????????", "Polar H10 1234"))
        #expect(globMatch("*", ""))
        #expect(!globMatch("a*b", "acbd"))
        #expect(globMatch(String(repeating: "*", count: 40) + "x", String(repeating: "a", count: 200) + "x"))
    }

    @Test func matchesAdvertisements() throws {
        let hr = BluetoothUUID(UInt16(0x180D))
        let adv = BLEAdvertisement(
            address: try address("C0:FF:EE:00:00:01"), adapter: "hci0", name: "Polar H10 1", serviceUUIDs: [hr],
            manufacturerData: [0x006B: [1]])
        #expect(DeviceMatch(service: hr).matches(adv))
        #expect(DeviceMatch(service: hr, namePattern: "polar*").matches(adv))
        #expect(!DeviceMatch(service: hr, namePattern: "wahoo*").matches(adv))
        #expect(DeviceMatch(manufacturer: 0x006B).matches(adv))
        #expect(!DeviceMatch(address: BLEAddress("C0:FF:EE:00:00:02")).matches(adv))
        // A service known only from its service data matches too (BTHome advertises FCD2 that way).
        let bthome = BLEAdvertisement(
            address: try address("A4:C1:38:12:34:56"), adapter: "hci0",
            serviceData: [BluetoothUUID(UInt16(0xFCD2)): [0x40]])
        #expect(DeviceMatch(service: BluetoothUUID(UInt16(0xFCD2))).matches(bthome))
    }

    @Test func scanServicesNarrowOnlyWhenEveryDeviceMatchesByService() throws {
        let byService = try BridgeConfig.load(
            text: """
                mqtt: {url: mqtt://127.0.0.1:1883}
                bluetooth: {scan_services: ["181A"]}
                devices:
                  - {name: a, match: {service: "180D"}, mode: connected}
                  - {name: b, match: {service: "1809"}, mode: connected}
                """)
        #expect(byService.scanServiceUUIDs == ["181A", "180D", "1809"].compactMap(BluetoothUUID.init))
        let mixed = try BridgeConfig.load(text: docsConfig)
        #expect(mixed.scanServiceUUIDs.isEmpty)
    }

    @Test func formatsISO8601() {
        #expect(iso8601(0) == "1970-01-01T00:00:00.000Z")
        #expect(iso8601(1_796_083_200.25) == "2026-12-01T00:00:00.250Z")
        #expect(iso8601(951_825_600) == "2000-02-29T12:00:00.000Z")
        #expect(iso8601(1_709_164_800.5) == "2024-02-29T00:00:00.500Z")
        #expect(iso8601(-0.5) == "1969-12-31T23:59:59.500Z")
        #expect(iso8601(.nan) == "1970-01-01T00:00:00.000Z")
        #expect(iso8601(.infinity) == "1970-01-01T00:00:00.000Z")
    }

    @Test func demoConfigLoads() throws {
        let file = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
            .deletingLastPathComponent().appendingPathComponent("config/demo.yaml")
        let text = String(decoding: try Data(contentsOf: file), as: UTF8.self)
        let config = try BridgeConfig.load(text: text)
        #expect(!config.devices.isEmpty)
        #expect(config.devices.contains { $0.mode == .passive })
        #expect(config.devices.contains { $0.mode == .connected })
    }
}
