import DBus
import Foundation
import TestSupport
import Testing

@Suite struct ConnectionTests {
    @Test func connectsAndCallsTheBus() async throws {
        let fixture = try await BusFixture()
        let connection = try fixture.connect()
        #expect(connection.uniqueName.hasPrefix(":"))
        #expect(connection.isConnected)
        #expect(connection.canPassUnixFDs)
        let names = try await connection.call(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            method: "ListNames")
        let list = names.first?.arrayElements?.compactMap(\.string) ?? []
        #expect(list.contains(connection.uniqueName))
        connection.close()
        #expect(!connection.isConnected)
    }

    @Test func errorRepliesBecomeDBusErrors() async throws {
        let fixture = try await BusFixture()
        let connection = try fixture.connect()
        do {
            _ = try await connection.call(
                destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                method: "GetNameOwner", arguments: [.string("org.example.Nobody")])
            Issue.record("expected an error")
        } catch {
            #expect(error.name == DBusError.nameHasNoOwner)
            #expect(!error.message.isEmpty)
        }
        do {
            _ = try await connection.call(
                destination: "org.example.Missing", path: "/", interface: "org.example.X", method: "Y")
            Issue.record("expected an error")
        } catch {
            #expect(error.name == DBusError.serviceUnknown)
        }
    }

    @Test func callTimesOut() async throws {
        let fixture = try await BusFixture()
        let server = try fixture.connect()
        let client = try fixture.connect()
        let objects = DBusObjectServer(connection: server)
        objects.addInterfaces(
            at: "/slow",
            [(DBusInterfaceSpec("org.example.Slow", methods: [DBusMethodSpec("Never") { _ in .deferred }]), [:])])
        let pending = PendingReplies()
        objects.addInterfaces(
            at: "/keep",
            [
                (
                    DBusInterfaceSpec(
                        "org.example.Keep",
                        methods: [
                            DBusMethodSpec("Hold") { call in
                                pending.add(call.reply)
                                return .deferred
                            }
                        ]), [:]
                )
            ])
        let start = ContinuousClock.now
        do {
            _ = try await client.call(
                destination: server.uniqueName, path: "/keep", interface: "org.example.Keep", method: "Hold",
                timeout: .milliseconds(300))
            Issue.record("expected a timeout")
        } catch {
            #expect(error.name == DBusError.noReply)
        }
        let elapsed = ContinuousClock.now - start
        #expect(elapsed >= .milliseconds(250))
        #expect(elapsed < .seconds(5))
    }
}

final class PendingReplies: @unchecked Sendable {
    private let lock = NSLock()
    private var replies: [DBusPendingReply] = []
    func add(_ reply: DBusPendingReply) { lock.withLock { replies.append(reply) } }
    func all() -> [DBusPendingReply] { lock.withLock { replies } }
}
