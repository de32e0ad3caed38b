// Adapters and bluetoothd coming and going under running sessions.
import BridgeCore
import GATT
import Testing

@Suite struct AdapterEventTests {
    @Test func sessionWaitsForAnAdapterAndConnectsWhenOneAppears() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(strapConfig(""), adapters: [], setup: { try Strap.add($0, strap) }) { h in
            h.central.advertise(strap)
            // No adapter: the class of error is adapter-unavailable (5 s ± 20 %), and connect is not called.
            try await eventually("backing off, got \(h.clock.pendingDelays)") {
                h.clock.hasSleeper(in: .seconds(4)...(.seconds(6)))
            }
            #expect(h.central.attempts.isEmpty)
            let scans = h.central.scans.count
            let hci0 = BLEAdapterInfo(name: "hci0", address: "00:1A:7D:DA:71:00", powered: true)
            h.central.state.withLock { $0.adapters = [hci0] }
            h.central.send(.adapterAdded(hci0))
            try await eventually("connected once the adapter is there") { h.central.links(to: strap).count == 1 }
            #expect(h.central.attempts == [FakeCentral.Attempt(address: strap, adapter: "hci0")])
            try await eventually("scanning again") { h.central.scans.count > scans }
            try await h.mqtt.waitForJSON(on: "blebridge/bridge/info") {
                $0["adapters"]?.items?.first?["name"] == .string("hci0")
            }
        }
    }

    /// After bluetoothd restarts, the real daemon exports the adapter before AutoEnable powers it (seen on the
    /// real-BlueZ rig): that is an unavailable adapter, not a lack of connection slots.
    @Test func anUnpoweredAdapterIsNotReportedAsOutOfSlots() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(
            strapConfig(""),
            setup: { c in
                try Strap.add(c, strap)
                c.state.withLock { $0.adapters = [BLEAdapterInfo(name: "hci0", address: "00:1A:7D:DA:71:00", powered: false)] }
            }
        ) { h in
            h.central.advertise(strap)
            try await eventually("backing off as for a missing adapter, got \(h.clock.pendingDelays)") {
                h.clock.hasSleeper(in: .seconds(4)...(.seconds(6)))
            }
            #expect(h.central.attempts.isEmpty)
            let warnings = h.logs.entries.filter { $0.message.contains("retrying") }.map(\.message)
            #expect(warnings.contains { $0.contains("no adapter is powered (hci0 off)") }, "\(warnings)")
            #expect(!warnings.contains { $0.contains("connection slot") }, "\(warnings)")
            let hci0 = BLEAdapterInfo(name: "hci0", address: "00:1A:7D:DA:71:00", powered: true)
            h.central.state.withLock { $0.adapters = [hci0] }
            h.central.send(.adapterAdded(hci0))
            try await eventually("connected once the adapter is powered") { h.central.links(to: strap).count == 1 }
        }
    }

    @Test func bluetoothdRestartReconnectsTheDevices() async throws {
        let strap = try address(ConnectedDeviceTests.strapAddress)
        try await withBridge(strapConfig(""), setup: { try Strap.add($0, strap) }) { h in
            let link = try await connectStrap(h)
            // bluetoothd leaves the bus: the link goes with it.
            h.central.send(.bluetoothdStopped)
            try await eventually("bluetoothd's exit handled") {
                h.logs.entries.contains { $0.message.contains("bluetoothd left the bus") }
            }
            link.drop(requested: false, reason: "org.bluez.Reason.Local")
            try await h.mqtt.waitForMessage(on: "blebridge/chest_strap/availability", skip: 1) {
                $0.text.contains("offline")
            }
            try await eventually("the reconnect pause") {
                h.clock.hasSleeper(in: .milliseconds(100)...(.milliseconds(300)))
            }
            h.clock.advance(by: .milliseconds(300))
            // No adapters now: a longer backoff, no connect call.
            try await eventually("backing off, got \(h.clock.pendingDelays)") {
                h.clock.hasSleeper(in: .seconds(4)...(.seconds(6)))
            }
            #expect(h.central.attempts.count == 1)

            h.central.send(.bluetoothdStarted)
            try await eventually("reconnected when bluetoothd is back") { h.central.links(to: strap).count == 2 }
            try await h.mqtt.waitForMessage(on: "blebridge/chest_strap/availability", skip: 2) {
                $0.text.contains("online")
            }
        }
    }
}
