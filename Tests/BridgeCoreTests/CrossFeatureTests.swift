// Behaviour that crosses features: a switch's state after `/set`, on-demand devices in Home Assistant, and a poll
// device after `device/disconnect` + `device/connect`.
import BridgeCore
import GATT
import Testing

@Suite struct CrossFeatureTests {
    static let heaterConfig = """
        mqtt: {url: mqtt://127.0.0.1:1883}
        parsers:
          - name: acme_heater
            uuid: 6e400030-b5a3-f393-e0a9-e50e24dcca9e
            fields:
              - {name: heater_on, type: "bool:bit0", offset: 0}
        devices:
          - name: radiator
            match: {address: "D0:12:34:56:78:9A"}
            mode: connected
            writable: [heater_on]
        """

    /// Home Assistant's switch sends `ON`/`OFF` to `/set/heater_on` and reads the state with
    /// `{{ 'ON' if value_json.heater_on else 'OFF' }}`: the state must carry the boolean that was written, not the
    /// command's text (the string "OFF" is truthy, so the switch would flip back on).
    @Test func switchStateIsTheBooleanWritten() async throws {
        let heater = try uuid("6e400030-b5a3-f393-e0a9-e50e24dcca9e")
        try await withBridge(
            Self.heaterConfig,
            setup: { c in
                c.addDevice(
                    try address(Radiator.addressText),
                    [
                        characteristic(
                            heater, service: try uuid("6e400001-b5a3-f393-e0a9-e50e24dcca9e"), ["read", "write"])
                    ],
                    values: [heater: [0x00]])
            }
        ) { h in
            let discovery = try await h.mqtt.waitForJSON(on: "homeassistant/device/blebridge_radiator/config")
            let component = try #require(discovery["cmps"]?["blebridge_radiator_heater_on"])
            #expect(component["p"] == .string("switch"))
            #expect(component["payload_off"] == .string("OFF"))

            let link = try await Radiator.connect(h)
            let on = try await h.command("blebridge/radiator/set/heater_on", "ON")
            #expect(on["status"] == .string("ok"), "\(on.text)")
            let off = try await h.command("blebridge/radiator/set/heater_on", "OFF")
            #expect(off["status"] == .string("ok"), "\(off.text)")
            #expect(link.writes.map(\.value) == [[0x01], [0x00]])
            let state = try await h.mqtt.waitForJSON(on: "blebridge/radiator", skip: 1)
            #expect(state["heater_on"] == .bool(false), "state after OFF: \(state.text)")
        }
    }

    /// An on-demand device is listed in Home Assistant with `availability_mode: all` over the bridge's state and its
    /// own availability topic; if that topic is never published, its entities stay unavailable for ever.
    @Test func onDemandDeviceBecomesAvailable() async throws {
        let yaml = docsConfig.replacing("mode: connected\n    writable", with: "mode: on-demand\n    writable")
        try await withBridge(yaml, setup: Radiator.add) { h in
            #expect(h.config.devices.last?.mode == .onDemand)
            h.central.advertise(try address(Radiator.addressText))
            let answer = try await h.command("blebridge/radiator/set", #"{"setpoint_c": 21.5}"#)
            #expect(answer["status"] == .string("ok"), "\(answer.text)")
            let discovery = try await h.mqtt.waitForJSON(on: "homeassistant/device/blebridge_radiator/config")
            let topics = try #require(discovery["availability"]?.items).compactMap { $0["topic"]?.string }
            #expect(discovery["availability_mode"] == .string("all"))
            for topic in topics {
                #expect(
                    h.mqtt.messages(on: topic).last?.text == #"{"state":"online"}"#,
                    "\(topic) is never online, so Home Assistant shows the radiator unavailable")
            }
        }
    }

    /// `device/disconnect` then `device/connect` on a poll device: polling should resume.
    @Test func pollDeviceResumesPollingAfterConnectRequest() async throws {
        try await withBridge(Radiator.pollConfig, setup: Radiator.add) { h in
            let radiator = try address(Radiator.addressText)
            try await eventually("the first poll") { h.central.links(to: radiator).first?.disconnectCalls == 1 }
            let disconnect = try await h.request("device/disconnect", #"{"id": "radiator"}"#)
            #expect(disconnect["status"] == .string("ok"))
            let connect = try await h.request("device/connect", #"{"id": "radiator"}"#)
            #expect(connect["status"] == .string("ok"), "\(connect.text)")
            // The poll loop starts again at once: a second connect without waiting for an interval.
            try await eventually("polled again after device/connect") { h.central.attempts.count == 2 }
            let afterConnect = h.central.attempts.count
            for step in 1...3 {
                h.clock.advance(by: .seconds(60))
                try await eventually("the ticker ran at \(step) min") { h.clock.hasSleeper(after: .seconds(60 * step)) }
            }
            // A poll every 60 s: three more by now.
            try await eventually("polling resumed, \(h.central.attempts.count) connects", within: 10) {
                h.central.attempts.count > afterConnect
            }
        }
    }
}

@Suite struct CommandOrderTests {
    /// Two `/set`s for one device (a Home Assistant slider dragged from 20 to 21): the device must end at the last
    /// value sent. Commands run as concurrent tasks, so against a slow peripheral both writes are in flight at once
    /// and whichever the peripheral finishes last wins.
    @Test func setsToOneDeviceAreWrittenInArrivalOrder() async throws {
        try await withBridge(docsConfig, setup: Radiator.add) { h in
            let link = try await Radiator.connect(h)
            link.state.withLock { $0.holdWrites = true }
            h.mqtt.inject("blebridge/radiator/set", #"{"setpoint_c": 20, "transaction": 1}"#)
            h.mqtt.inject("blebridge/radiator/set", #"{"setpoint_c": 21, "transaction": 2}"#)
            try await eventually("the first write reaches the peripheral") { !link.heldWrites.isEmpty }
            // A second write in flight before the first finished shows the commands are not serialised; a short
            // real-time bound is enough to see it (it happens within microseconds when it happens at all).
            let overlapped =
                (try? await eventually("a second write in flight", within: 0.3) { link.heldWrites.count == 2 }) != nil
            #expect(!overlapped, "two writes to one characteristic in flight at once: \(link.heldWrites)")
            if overlapped {
                // The peripheral finishes the write of 21 first, then the one of 20.
                link.releaseWrite(at: link.heldWrites.firstIndex(of: [0x34, 0x08]) ?? 0)
                link.releaseWrite(at: 0)
            } else {
                link.releaseWrite(at: 0)
                try await eventually("the second write") { !link.heldWrites.isEmpty }
                link.releaseWrite(at: 0)
            }
            try await eventually("both answered") { h.mqtt.messages(on: "blebridge/radiator/set/result").count == 2 }
            #expect(link.writes.last?.value == [0x34, 0x08], "the radiator ends at \(link.writes.map(\.value))")
        }
    }
}

@Suite struct SlotHandOverTests {
    /// With `connection_slots: 1`, a device waiting for the slot backs off 10 s, 20 s, 40 s... (no-slots class) and
    /// is not told when the slot frees: it should get the slot soon after it is released, not at its next backoff.
    @Test func freedSlotGoesToTheWaitingDevice() async throws {
        let a = try address(ConnectionSlotTests.a)
        let b = try address(ConnectionSlotTests.b)
        try await withBridge(
            ConnectionSlotTests.twoStraps,
            setup: { c in
                try Strap.add(c, a)
                try Strap.add(c, b)
            }
        ) { h in
            h.central.advertise(a)
            try await h.mqtt.waitForMessage(on: "blebridge/strap_a/availability") { $0.text.contains("online") }
            h.central.advertise(b)
            try await eventually("b backs off") { h.clock.hasSleeper(in: .seconds(8)...(.seconds(12))) }
            try #require(h.central.links(to: a).first).drop(requested: true, reason: "disconnected by the bridge")
            // No clock advance is needed: releasing the slot wakes b at once (its backoff is 8 s or more away).
            try await eventually("b connects", within: 10) { h.central.links(to: b).count == 1 }
            #expect(h.clock.now < .seconds(8), "b connected before its backoff ran out")
        }
    }

    /// Asks health_check until hci0 reports `count` connections.
    func pollConnections(_ h: BridgeHarness, _ count: Int) async throws -> Int {
        let limit = ContinuousClock.now + .seconds(5)
        while true {
            let answer = try await h.request("health_check")
            let used = answer["data"]?["adapters"]?.items?.first?["connections"]
            if used == .int(Int64(count)) { return count }
            if ContinuousClock.now > limit {
                throw TimeoutError(description: "connections never \(count): \(answer.text)")
            }
            try await Task.sleep(for: .milliseconds(2))
        }
    }
}
