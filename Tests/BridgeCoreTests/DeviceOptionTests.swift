// Per-device and per-adapter options of connected devices: `subscribe`, `poll` after connecting,
// `bluetooth.adapters`, and `device/remove`.
import BridgeCore
import GATT
import Testing

@Suite struct DeviceOptionTests {
    @Test func subscribeListLimitsTheSubscriptions() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(strapConfig(", subscribe: [heart_rate_measurement]"), setup: { try Strap.add($0, strap) })
        {
            h in
            let link = try await connectStrap(h)
            #expect(link.subscriptions == [Strap.heartRate])
        }
    }

    @Test func pollListIsReadOnceAfterConnecting() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(strapConfig(", poll: [battery_level]"), setup: { try Strap.add($0, strap) }) { h in
            let link = try await connectStrap(h)
            #expect(link.reads == [Strap.battery])
            let state = try await h.mqtt.waitForJSON(on: "blebridge/chest_strap")
            #expect(state["battery_pct"] == .int(100))
        }
    }

    @Test func adaptersByNameRestrictWhereDevicesConnect() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        let yaml = """
            mqtt: {url: mqtt://127.0.0.1:1883}
            bluetooth: {adapters: [hci1]}
            devices:
              - {name: chest_strap, match: {address: "\(ConnectedDeviceTests.strapAddress)"}, mode: connected}
            """
        try await withBridge(yaml, adapters: ["hci0", "hci1"], setup: { try Strap.add($0, strap) }) { h in
            #expect(h.central.scans.first?.adapters == ["hci1"])
            h.central.advertise(strap, adapter: "hci0", rssi: -40)
            h.central.advertise(strap, adapter: "hci1", rssi: -80)
            try await eventually("connected") { h.central.links(to: strap).count == 1 }
            #expect(h.central.attempts.map(\.adapter) == ["hci1"])
        }
    }

    /// `bluetooth.adapters` accepts adapter addresses; BlueZ reports them upper-case, a config may write them
    /// lower-case (the loader accepts both), and both must select the same adapter.
    @Test func adaptersByLowerCaseAddressSelectTheAdapter() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        let yaml = """
            mqtt: {url: mqtt://127.0.0.1:1883}
            bluetooth: {adapters: ["00:1a:7d:da:71:00"]}
            devices:
              - {name: chest_strap, match: {address: "\(ConnectedDeviceTests.strapAddress)"}, mode: connected}
            """
        try await withBridge(yaml, setup: { try Strap.add($0, strap) }) { h in
            #expect(h.central.adapters().first?.address == "00:1A:7D:DA:71:00")
            h.central.advertise(strap, adapter: "hci0", rssi: -40)
            try await eventually("connected or backing off") {
                h.central.links(to: strap).count == 1 || h.clock.hasSleeper(in: .seconds(8)...(.seconds(12)))
            }
            #expect(h.central.links(to: strap).count == 1, "not connected; pending sleeps \(h.clock.pendingDelays)")
            let log = h.logs.entries.first { $0.message.contains("retrying") }?.message
            #expect(log == nil, "\(log ?? "")")
        }
    }

    @Test func removeRequestForgetsThePassiveDevice() async throws {
        try await withBridge(docsConfig) { h in
            let balcony = try address("A4:C1:38:12:34:56")
            let payload = [PassiveDeviceTests.bthomeUUID: try hexBytes(PassiveDeviceTests.bthome)]
            h.central.advertise(balcony, serviceData: payload)
            try await h.mqtt.waitForMessage(on: "blebridge/balcony")
            let answer = try await h.request("device/remove", #"{"id": "balcony"}"#)
            #expect(answer["status"] == .string("ok"), "\(answer.text)")
            #expect(h.central.state.withLock { $0.removed } == [balcony])
            #expect(h.mqtt.messages(on: "blebridge/balcony/availability").last?.text == #"{"state":"offline"}"#)
            try await h.mqtt.waitForJSON(on: "blebridge/bridge/event") { $0["type"] == .string("removed") }
            // The same payload again is news after a removal.
            h.central.advertise(balcony, serviceData: payload)
            try await h.mqtt.waitForMessage(on: "blebridge/balcony", skip: 1)
            try await h.mqtt.waitForMessage(on: "blebridge/balcony/availability", skip: 2) {
                $0.text.contains("online")
            }
        }
    }

    @Test func requestsNameTheDeviceByAddressToo() async throws {
        try await withBridge(docsConfig) { h in
            let unknown = try await h.request("device/remove", #"{"address": "11:22:33:44:55:66"}"#)
            #expect(unknown["status"] == .string("error"))
            let bad = try await h.request("device/connect", #"{"address": "nope"}"#)
            #expect(bad["error"]?.string?.contains("not a Bluetooth address") == true)
            let passive = try await h.request("device/connect", #"{"address": "a4:c1:38:12:34:56"}"#)
            #expect(passive["error"]?.string?.contains("passive") == true, "\(passive.text)")
            let none = try await h.request("device/connect", "{}")
            #expect(none["status"] == .string("error"))
        }
    }
}
