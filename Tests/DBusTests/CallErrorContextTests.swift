// A call cut short on this side (connection closed) names the call in its error, so that the log line says which
// call failed; error replies from the peer keep their own message.
import DBus
import Testing

@Suite struct CallErrorContextTests {
    @Test func callOnClosedConnectionNamesTheCall() async throws {
        let fixture = try await BusFixture()
        let connection = try fixture.connect()
        connection.close()
        do {
            _ = try await connection.call(
                destination: "org.example.Peer", path: "/org/example/thing", interface: "org.example.Iface",
                method: "DoIt")
            Issue.record("expected an error")
        } catch {
            #expect(error.name == DBusError.disconnected)
            #expect(error.message.hasPrefix("org.example.Iface.DoIt on /org/example/thing (org.example.Peer): "))
        }
    }

    @Test func peerErrorRepliesKeepTheirMessage() async throws {
        let fixture = try await BusFixture()
        let connection = try fixture.connect()
        defer { connection.close() }
        do {
            _ = try await connection.call(
                destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                method: "GetNameOwner", arguments: [.string("org.example.Nobody")])
            Issue.record("expected an error")
        } catch {
            #expect(error.name == DBusError.nameHasNoOwner)
            #expect(!error.message.contains("GetNameOwner on"))
        }
    }
}
