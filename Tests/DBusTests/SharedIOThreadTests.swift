// Every connection of the process shares one I/O thread (IOLoop): one connection's trouble must not hold up the
// others.
import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

@Suite struct SharedIOThreadTests {
    @Test(.timeLimit(.minutes(1))) func closingAConnectionToAStuckBusDoesNotStallTheOthers() async throws {
        let stuck = try await BusFixture()
        let healthy = try await BusFixture()
        let doomed = try stuck.connect()
        let live = try healthy.connect()
        stuck.bus.daemon.signal(SIGSTOP)
        defer { stuck.bus.daemon.signal(SIGCONT) }
        // More than the socket takes, so that libdbus still holds some of it when the close begins: the close then
        // waits (up to about a second) for the bus to take the rest.
        let big = DBusMessage.signal(
            path: "/t", interface: "org.example.T", name: "Big", body: [.string(String(repeating: "x", count: 1 << 20))]
        )
        for _ in 0..<4 { try doomed.send(big) }
        let closed = Atomic<Bool>(false)
        let started = Atomic<Bool>(false)
        let closing = Task.detached {
            started.store(true, ordering: .sequentiallyConsistent)
            await doomed.closeAndWait()
            closed.store(true, ordering: .sequentiallyConsistent)
        }
        // Counted from the moment the close starts (a loaded machine may start the task late).
        while !started.load(ordering: .sequentiallyConsistent) { await Task.yield() }
        var callsWhileClosing = 0
        while !closed.load(ordering: .sequentiallyConsistent) {
            // A stalled loop holds a call for the whole close (about a second). No bound on one call's time: a
            // loaded machine makes honest calls that slow too; the proof is how many calls fit into the close.
            _ = try await live.call(
                destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                method: "ListNames")
            if !closed.load(ordering: .sequentiallyConsistent) { callsWhileClosing += 1 }
        }
        await closing.value
        // A stalled loop lets at most one call complete once the close has started (the next one returns only
        // when the close ends, and is not counted); a healthy loop answers several. On a loaded machine (the CI
        // runs the suites in parallel) two is what a healthy loop reliably manages.
        #expect(callsWhileClosing >= 2, "only \(callsWhileClosing) calls overlapped the close")
        #expect(!doomed.isConnected)
        await live.closeAndWait()
    }
}
