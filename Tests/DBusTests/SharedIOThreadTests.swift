// Every connection of the process shares one I/O thread (IOLoop): one connection's trouble must not hold up the
// others.
import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

@Suite(.serialized) struct SharedIOThreadTests {
    @Test(.timeLimit(.minutes(1))) func closingAConnectionToAStuckBusDoesNotStallTheOthers() async throws {
        // A stalled loop lets at most one call complete once the close has started (the next one returns only when
        // the close ends, and is not counted); a healthy loop answers several. On a loaded machine (the full suite
        // runs its suites in parallel on two cores) a healthy loop answered only one in about one run in four, so
        // the close is tried up to three times: a stalled loop fails every try, a slow machine rarely fails three.
        var counts: [Int] = []
        for _ in 0..<3 {
            counts.append(try await callsOverlappingAStuckClose())
            if counts.last! >= 2 { break }
        }
        #expect(counts.last! >= 2, "calls that overlapped the close, per try: \(counts)")
    }

    /// Closes a connection whose bus is stopped (SIGSTOP) with more queued than its socket takes, so that the close
    /// waits (about a second) for the bus, and counts the calls another connection completes in the meantime.
    private func callsOverlappingAStuckClose() async throws -> Int {
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
        #expect(!doomed.isConnected)
        await live.closeAndWait()
        return callsWhileClosing
    }

    /// The loop only looks at connections epoll reports: every one of many sleeping connections must still be woken
    /// by what arrives on its socket (a signal) and by what is queued for it from another thread (a call), also while
    /// another connection keeps the loop busy, and connections that close make room for new ones whose descriptors
    /// may reuse the closed ones' numbers.
    @Test(.timeLimit(.minutes(1))) func manySleepingConnectionsAreEachWokenByTheirOwnWork() async throws {
        let fixture = try await BusFixture()
        let emitter = try fixture.connect()
        var listeners: [DBusConnection] = []
        for _ in 0..<24 { listeners.append(try fixture.connect()) }
        // Half of them go; as many come, on descriptor numbers the closed ones freed.
        for listener in listeners[0..<12] { await listener.closeAndWait() }
        listeners.removeFirst(12)
        for _ in 0..<12 { listeners.append(try fixture.connect()) }
        var iterators: [DBusSignalStream.AsyncIterator] = []
        for listener in listeners {
            let stream = try await listener.signals(matching: DBusMatchRule(interface: "org.example.Wake"))
            iterators.append(stream.makeAsyncIterator())
        }
        // One connection kept busy meanwhile: a stream of messages queued from another thread.
        let busy = try fixture.connect()
        let stop = Atomic<Bool>(false)
        let chatter = Task.detached {
            while !stop.load(ordering: .relaxed) {
                try? busy.emitSignal(path: "/busy", interface: "org.example.Busy", name: "Chatter")
                await Task.yield()
            }
        }
        for round in 0..<3 {
            try emitter.emitSignal(
                path: "/w", interface: "org.example.Wake", name: "Round", arguments: [.uint32(UInt32(round))])
            for index in iterators.indices {
                let signal = await iterators[index].next()
                #expect(signal?.body == [.uint32(UInt32(round))])
            }
            // Queued from this task's thread for each (sleeping) connection: a call that must go out and be answered.
            try await withThrowingTaskGroup(of: Void.self) { group in
                for listener in listeners {
                    group.addTask {
                        _ = try await listener.call(
                            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus",
                            interface: "org.freedesktop.DBus", method: "GetId")
                    }
                }
                try await group.waitForAll()
            }
        }
        stop.store(true, ordering: .relaxed)
        await chatter.value
        for connection in listeners + [busy, emitter] { await connection.closeAndWait() }
    }

    /// A connection with nothing left to write closes at once: the loop does not wait for its next wake-up (up to a
    /// second with nothing else going on) to finish it.
    @Test(.timeLimit(.minutes(1))) func closingIdleConnectionsDoesNotWaitForTheLoop() async throws {
        let fixture = try await BusFixture()
        var connections: [DBusConnection] = []
        for _ in 0..<8 { connections.append(try fixture.connect()) }
        let start = ContinuousClock.now
        for connection in connections { await connection.closeAndWait() }
        let elapsed = ContinuousClock.now - start
        // Eight closes one after the other: well under a second together, where a close that waited for the loop's
        // next wake-up took up to a second each.
        #expect(elapsed < .seconds(3), "8 closes took \(elapsed)")
        #expect(connections.allSatisfy { !$0.isConnected })
    }
}
