// Rounds of dispatch on the D-Bus I/O thread (DBusDispatchRounds): what libdbus read in one go is handled between
// an observer's begin and end, on that thread; a burst of signals takes fewer rounds than signals, and so does a
// steady stream (the loop lets a stream's signals gather for a few milliseconds between reads).
import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

#if canImport(Glibc)
    import Glibc
#endif

@Suite struct DispatchRoundTests {
    /// What an observer saw: the threads inside a round now, rounds begun and ended, and per handled signal
    /// whether its thread was inside a round (and which round).
    private final class Rounds: Sendable {
        struct State {
            var inside: [UInt: Int] = [:]  // thread -> its current round number
            var begun = 0
            var ended = 0
            var handledInside = 0
            var handledOutside = 0
            var roundsWithSignals = Set<Int>()
        }
        let state = Mutex(State())

        func begin() {
            state.withLock { s in
                s.begun += 1
                s.inside[UInt(pthread_self())] = s.begun
            }
        }

        func end() {
            state.withLock { s in
                s.ended += 1
                s.inside.removeValue(forKey: UInt(pthread_self()))
            }
        }

        func handled() {
            state.withLock { s in
                if let round = s.inside[UInt(pthread_self())] {
                    s.handledInside += 1
                    s.roundsWithSignals.insert(round)
                } else {
                    s.handledOutside += 1
                }
            }
        }
    }

    /// An observer that keeps a round's work (the bridge holding its MQTT writes) asks to hear `end` again by a time;
    /// with no message of its own arriving, the loop runs an empty round then, on its own thread. A round before that
    /// time (other tests' traffic, in a parallel run) clears the request, and the observer asks again from its `end`,
    /// as the bridge's batcher does.
    @Test func anEmptyRoundComesWhenAskedForWithoutTraffic() async throws {
        let fixture = try await BusFixture()
        _ = try fixture.connect()  // the loop runs
        let ends = Mutex<[(at: ContinuousClock.Instant, thread: String)]>([])
        let due = ContinuousClock.now + .milliseconds(300)
        let token = DBusDispatchRounds.observe(
            .init(
                begin: {},
                end: {
                    let left = due - ContinuousClock.now
                    if left > .zero {
                        let (seconds, attoseconds) = left.components
                        DBusDispatchRounds.requestEmptyRound(
                            afterMilliseconds: Int(seconds) * 1000 + Int(attoseconds / 1_000_000_000_000_000) + 1)
                    }
                    var name = [CChar](repeating: 0, count: 32)
                    let fd = open("/proc/thread-self/comm", O_RDONLY)
                    if fd >= 0 {
                        _ = read(fd, &name, 31)
                        close(fd)
                    }
                    let thread = String(decoding: name.prefix { $0 != 0 && $0 != 10 }.map { UInt8($0) }, as: UTF8.self)
                    ends.withLock { $0.append((ContinuousClock.now, thread)) }
                }))
        defer { DBusDispatchRounds.stopObserving(token) }
        let asked = due - .milliseconds(300)
        DBusDispatchRounds.requestEmptyRound(afterMilliseconds: 300)
        try await eventually(5, "an empty round after the time asked for") {
            ends.withLock { $0.contains { $0.at - asked >= .milliseconds(290) } }
        }
        let first = ends.withLock { $0.first { $0.at - asked >= .milliseconds(290) } }
        #expect(first.map { $0.at - asked < .milliseconds(1_500) } == true, "late: \(String(describing: first))")
        #expect(first?.thread == "dbus-io")
    }

    /// A stream of signals a millisecond or two apart, each of which would otherwise wake the loop on its own: the
    /// loop lets them gather (IOLoop.gatherNanoseconds) and handles several per round, every one of them in order.
    @Test func aSteadyStreamIsGatheredIntoFewerRounds() async throws {
        let fixture = try await BusFixture()
        let server = try fixture.connect()
        let listener = try fixture.connect()
        let rounds = Rounds()
        let count = 300
        let order = Mutex<[String]>([])
        let subscription = try await listener.signals(
            matching: DBusMatchRule(sender: server.uniqueName, interface: "org.example.Stream"),
            handler: { message in
                rounds.handled()
                order.withLock { $0.append(message.member ?? "") }
            })
        defer { subscription.cancel() }
        let token = DBusDispatchRounds.observe(.init(begin: { rounds.begin() }, end: { rounds.end() }))
        defer { DBusDispatchRounds.stopObserving(token) }
        for index in 0..<count {
            try server.emitSignal(path: "/s", interface: "org.example.Stream", name: "S\(index)")
            try await Task.sleep(for: .milliseconds(1))
        }
        try await eventually(10, "every signal handled") { order.withLock { $0.count } == count }
        #expect(order.withLock { $0 } == (0..<count).map { "S\($0)" })
        let seen = rounds.state.withLock { $0 }
        #expect(seen.handledInside == count)
        // One signal per round is what a loop that reads each signal as it comes does here (300 rounds for 300
        // signals); gathering makes it about 4 a round. Two thirds leaves room for other tests' traffic in a parallel
        // run (a connection awaiting a reply is not made to wait).
        #expect(
            seen.roundsWithSignals.count * 3 <= count * 2,
            "\(seen.roundsWithSignals.count) rounds for \(count) signals a millisecond or two apart")
    }

    @Test func aBurstOfSignalsIsHandledInsideFewerRounds() async throws {
        let fixture = try await BusFixture()
        let server = try fixture.connect()
        let listener = try fixture.connect()
        let rounds = Rounds()
        let token = DBusDispatchRounds.observe(.init(begin: { rounds.begin() }, end: { rounds.end() }))
        let count = 500
        let received = Atomic<Int>(0)
        let subscription = try await listener.signals(
            matching: DBusMatchRule(sender: server.uniqueName, interface: "org.example.Burst"),
            handler: { _ in
                rounds.handled()
                received.add(1, ordering: .relaxed)
            })
        for index in 0..<count {
            try server.emitSignal(path: "/b", interface: "org.example.Burst", name: "S\(index % 10)")
        }
        try await eventually(10, "every signal handled") { received.load(ordering: .relaxed) == count }
        DBusDispatchRounds.stopObserving(token)
        subscription.cancel()
        let seen = rounds.state.withLock { $0 }
        #expect(seen.handledOutside == 0, "every signal was handled inside a round")
        #expect(seen.handledInside == count)
        #expect(seen.roundsWithSignals.count < count, "\(seen.roundsWithSignals.count) rounds for \(count) signals")
        #expect(seen.begun >= seen.ended && seen.begun - seen.ended <= 1)
        // Removed: no more rounds are observed.
        let begunAfter = rounds.state.withLock { $0.begun }
        try server.emitSignal(path: "/b", interface: "org.example.Burst", name: "Late")
        let marker = try await listener.signals(matching: DBusMatchRule(interface: "org.example.Marker"))
        try server.emitSignal(path: "/b", interface: "org.example.Marker", name: "End")
        #expect(await members(until: marker) == [])
        #expect(rounds.state.withLock { $0.begun } == begunAfter)
    }
}
