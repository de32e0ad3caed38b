// Which D-Bus connections a peripheral opens, counted on the bus itself (dbus-daemon's ListNames): its calls and
// AcquireNotify sessions go over the client's connection, and only StartNotify sessions (which bluetoothd keeps per
// sender, across reconnects) get a connection of their own, which leaves the bus when the link ends.
import BlueZ
import DBus
import Foundation
import TestSupport
import Testing

@Suite struct PeripheralConnectionTests {
    /// The unique names on the simulator's bus (one per connection).
    private func connections(_ t: SimClient) async throws -> Set<String> {
        let reply = try await t.control.call(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            method: "ListNames")
        return Set((reply.first?.arrayElements ?? []).compactMap(\.string).filter { $0.hasPrefix(":") })
    }

    /// Waits until the bus has exactly `expected` connections (a connection closed elsewhere leaves it soon after).
    private func settle(_ t: SimClient, to expected: Set<String>, _ what: String) async throws {
        let settled = try await waitUntil(timeout: 5) { try await connections(t) == expected }
        let now = try await connections(t)
        #expect(settled, "\(what): \(now.symmetricDifference(expected).sorted()) differ")
    }

    @Test(.timeLimit(.minutes(1))) func onlyStartNotifySessionsHaveAConnectionOfTheirOwn() async throws {
        let t = try await SimClient()
        let before = try await connections(t)
        let device = try await t.discover(strap)
        // The discovery's own connection leaves the bus once it stopped.
        try await settle(t, to: before, "after the scan")

        let p = try await t.client.connect(device, options: BlueZConnectOptions(timeout: .seconds(5)))
        #expect(try await connections(t) == before, "connecting opened a connection")
        let rates = try await p.notifications(for: try p.characteristic("2A37"))
        #expect(try await p.read(try p.characteristic("2A38")) == [0x01])
        #expect(try await connections(t) == before, "AcquireNotify or a read opened a connection")
        try await t.simulator("PushNotification", [.string(strap), .string("2A37"), .bytes([0, 70])])
        var r = rates.makeAsyncIterator()
        #expect(try await r.next() == [0, 70])

        // StartNotify: one connection more, and only one for two sessions.
        let levels = try await p.notifications(for: try p.characteristic("2A19"), preferAcquire: false)
        let custom = try await p.notifications(
            for: try p.characteristic("12345678-1234-5678-1234-56789abcdef1"), preferAcquire: false)
        let during = try await connections(t)
        #expect(during.count == before.count + 1)
        #expect(during.isSuperset(of: before))
        #expect(try await t.counter("notify_sessions") >= 2)
        try await t.simulator("PushNotification", [.string(strap), .string("2A19"), .bytes([42])])
        var l = levels.makeAsyncIterator()
        #expect(try await l.next() == [42])

        // The link drops (not asked for): the sessions' connection leaves the bus, so bluetoothd forgets them.
        try await t.simulator("Disconnect", [.string(strap), .string("remote")])
        _ = await p.waitForDisconnection()
        try await settle(t, to: before, "after the disconnection")
        await #expect(throws: BlueZError.self) { _ = try await r.next() }
        var c = custom.makeAsyncIterator()
        await #expect(throws: BlueZError.self) { _ = try await c.next() }
    }

    @Test(.timeLimit(.minutes(1))) func aCallInFlightEndsWithTheLink() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let battery = try p.characteristic("2A19")
        // bluez-sim never answers this read: the link dropping must end it, not the read's 20 s timeout.
        try await t.fault(strap, "read-no-reply")
        let started = ContinuousClock.now
        let read = Task { () -> BlueZError? in
            do throws(BlueZError) {
                _ = try await p.read(battery, timeout: .seconds(20))
                return nil
            } catch {
                return error
            }
        }
        try await eventually(5, "the read to reach the simulator") { (try? await t.counter("faults_fired")) == 1 }
        try await t.simulator("Disconnect", [.string(strap), .string("remote")])
        let error = await read.value
        guard case .disconnected(_, let reason)? = error else {
            Issue.record("expected disconnected, got \(String(describing: error))")
            return
        }
        #expect(reason.requested == false)
        #expect(ContinuousClock.now - started < .seconds(10))
    }
}
