import DBus
import Foundation
import Synchronization
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
        // The 300 ms given, not libdbus's default of 25 s: the bound leaves room for a test run whose cooperative
        // threads are all busy for a few seconds (a full parallel run on two cores took 6 s once).
        #expect(elapsed < .seconds(20))
    }
}

final class PendingReplies: @unchecked Sendable {
    private let lock = NSLock()
    private var replies: [DBusPendingReply] = []
    func add(_ reply: DBusPendingReply) { lock.withLock { replies.append(reply) } }
    func all() -> [DBusPendingReply] { lock.withLock { replies } }
}

/// How many connections to the bus socket wait in its accept queue: the kernel lists each one in `/proc/net/unix`
/// under the socket's path, in state 02 (connecting), until the daemon accepts it. With the daemon stopped, a
/// connection there has got past `connect()` and waits in the handshake.
func connectionsWaitingToBeAccepted(_ bus: BusFixture) throws -> Int {
    let path = bus.bus.directory.url.appendingPathComponent("bus").path
    // Read to the end in chunks: /proc files report size 0, and a whole-file read can stop at the first page
    // (the table is longer than that when other tests' buses are up).
    guard let file = fopen("/proc/net/unix", "r") else { throw CocoaError(.fileReadUnknown) }
    defer { fclose(file) }
    var bytes: [UInt8] = []
    var chunk = [UInt8](repeating: 0, count: 65536)
    while true {
        let n = fread(&chunk, 1, chunk.count, file)
        if n <= 0 { break }
        bytes += chunk[0..<n]
    }
    let table = String(decoding: bytes, as: UTF8.self)
    return table.split(separator: "\n").filter { line in
        let fields = line.split(separator: " ", omittingEmptySubsequences: true)
        return fields.count >= 8 && fields[7] == path && fields[5] == "02"
    }.count
}

/// Sends SIGCONT to a stopped bus daemon: at `resumeNow()`, or after `seconds` whatever happens (so that a test
/// that fails does not leave its opens stuck for good).
final class DaemonResumption: Sendable {
    private let fixture: BusFixture
    private let resumed = Mutex(false)

    init(_ fixture: BusFixture, after seconds: Double) {
        self.fixture = fixture
        DispatchQueue.global().asyncAfter(deadline: .now() + seconds) { [weak self] in _ = self?.resumeNow() }
    }

    /// Lets the daemon go on now. Returns false when that was done already (by the fallback).
    @discardableResult
    func resumeNow() -> Bool {
        let first = resumed.withLock { was in
            defer { was = true }
            return !was
        }
        if first { fixture.bus.daemon.signal(SIGCONT) }
        return first
    }
}

@Suite struct BlockingWorkTests {
    /// With the bus daemon stopped (SIGSTOP), opening a connection blocks in the handshake. More opens than the
    /// cooperative pool has threads must not starve other async work: each blocks a thread of its own.
    @Test(.timeLimit(.minutes(1))) func openAndCloseDoNotHoldCooperativeThreads() async throws {
        let fixture = try await BusFixture()
        let address = fixture.address
        fixture.bus.daemon.signal(SIGSTOP)
        // Whatever happens, let the daemon go on after a while (then the opens complete).
        let fallback = DaemonResumption(fixture, after: 30)
        let width = ProcessInfo.processInfo.activeProcessorCount + 2
        let opens = (0..<width).map { _ in
            Task { try await DBusConnection.open(.address(address)) }
        }
        // Every open has connected and is stuck in the handshake (more of them than the pool has threads). Watched
        // from a thread of its own; the wait is generous because the opens' tasks start only when the pool has a
        // thread for them, and synchronous tests elsewhere in the run can hold both for seconds. It ends as soon
        // as they are stuck.
        let stuck = try await offPool {
            try waitUntilBlocking(timeout: 25) { try connectionsWaitingToBeAccepted(fixture) == width }
        }
        #expect(stuck, "\(width) connections in the stopped bus's accept queue")
        // Unrelated async work still runs while the opens are stuck: before the daemon is let go on.
        await Task {}.value
        #expect(fallback.resumeNow(), "the daemon was let go on before unrelated work ran")
        var connections: [DBusConnection] = []
        for open in opens { connections.append(try await open.value) }
        #expect(connections.allSatisfy { $0.isConnected })
        for c in connections { await c.closeAndWait() }
        #expect(connections.allSatisfy { !$0.isConnected })
    }

    /// libdbus's own registration holds a process-wide lock across the blocking Hello: a bus that does not answer
    /// would stall every connection opened meanwhile, to any bus.
    @Test(.timeLimit(.minutes(1))) func aStuckBusDoesNotStallConnectionsToAnother() async throws {
        let stuck = try await BusFixture()
        let healthy = try await BusFixture()
        stuck.bus.daemon.signal(SIGSTOP)
        let fallback = DaemonResumption(stuck, after: 30)
        let address = stuck.address
        let blocked = Task { try await DBusConnection.open(.address(address)) }
        // The stuck open has connected; its handshake (and registration) waits on the stopped daemon.
        let waiting = try await offPool {
            try waitUntilBlocking(timeout: 25) { try connectionsWaitingToBeAccepted(stuck) == 1 }
        }
        #expect(waiting, "the connection in the stopped bus's accept queue")
        let start = ContinuousClock.now
        let connection = try await DBusConnection.open(.address(healthy.address))
        #expect(ContinuousClock.now - start < .seconds(10), "the stuck handshake waits 30 s; this open must not")
        #expect(connection.uniqueName.hasPrefix(":"))
        await connection.closeAndWait()
        #expect(fallback.resumeNow(), "the stuck daemon was let go on before the other connection was open")
        let late = try await blocked.value
        #expect(late.isConnected)
        await late.closeAndWait()
    }
}
