// Rounds of dispatch on the D-Bus I/O thread (DBusDispatchRounds): what libdbus read in one go is handled between
// an observer's begin and end, on that thread; a burst of signals takes fewer rounds than signals, and so does a
// steady stream (the loop lets a stream's signals gather for a few milliseconds between reads), and a call made
// meanwhile is not held up by that pause.
import CDBus
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

    /// Something a plain thread finishes and async code awaits without blocking a thread of the cooperative pool
    /// (a semaphore waited on in `DispatchQueue.global()` would hold one of its threads, and starve other tests).
    private final class Finish: Sendable {
        private let state = Mutex<(done: Bool, waiters: [CheckedContinuation<Void, Never>])>((false, []))

        func signal() {
            let waiters = state.withLock { s -> [CheckedContinuation<Void, Never>] in
                s.done = true
                defer { s.waiters = [] }
                return s.waiters
            }
            for w in waiters { w.resume() }
        }

        func wait() async {
            await withCheckedContinuation { (c: CheckedContinuation<Void, Never>) in
                let now = state.withLock { s -> Bool in
                    if s.done { return true }
                    s.waiters.append(c)
                    return false
                }
                if now { c.resume() }
            }
        }
    }

    /// A sender outside this process's D-Bus loop (as bluetoothd is): its own libdbus connection, written from a
    /// thread of its own, one signal (`member` S0, S1, ...) every `interval` until `count` were sent. A sender on
    /// the loop would end every pause itself: work queued from another thread ends the loop's pause.
    private final class RawEmitter: @unchecked Sendable {
        let sent = Atomic<Int>(0)
        private let stopped = Atomic<Bool>(false)
        private let done = Finish()

        init(address: String, interface: String, count: Int, interval: Duration) throws {
            let raw = try DispatchRoundTests.openRawConnection(address, for: "raw emitter")
            let connection = UncheckedBox(raw)
            let pause = timespec(
                tv_sec: Int(interval.components.seconds),
                tv_nsec: Int(interval.components.attoseconds / 1_000_000_000))
            Thread.detachNewThread { [self] in
                for index in 0..<count {
                    if self.stopped.load(ordering: .relaxed) { break }
                    if let message = dbus_message_new_signal("/s", interface, "S\(index)") {
                        _ = dbus_connection_send(connection.value, message, nil)
                        dbus_connection_flush(connection.value)
                        dbus_message_unref(message)
                    }
                    self.sent.add(1, ordering: .relaxed)
                    var left = pause
                    nanosleep(&left, nil)
                }
                dbus_connection_close(connection.value)
                dbus_connection_unref(connection.value)
                self.done.signal()
            }
        }

        /// Waits until every signal was sent (or `stop` was called).
        func finished() async { await done.wait() }

        /// Sends no more signals.
        func stop() { stopped.store(true, ordering: .relaxed) }
    }

    /// A private libdbus connection to `address`, registered on the bus, outside this process's D-Bus loop (for the
    /// raw emitter and receiver); closed again when registering fails.
    private static func openRawConnection(_ address: String, for role: String) throws -> OpaquePointer {
        var error = CDBus.DBusError()
        dbus_error_init(&error)
        defer { dbus_error_free(&error) }
        guard let raw = dbus_connection_open_private(address, &error) else {
            throw TestFailure("\(role): cannot connect: \(error.message.map { String(cString: $0) } ?? "?")")
        }
        guard dbus_bus_register(raw, &error) != 0 else {
            dbus_connection_close(raw)
            dbus_connection_unref(raw)
            throw TestFailure("\(role): cannot register: \(error.message.map { String(cString: $0) } ?? "?")")
        }
        return raw
    }

    private struct UncheckedBox<T>: @unchecked Sendable {
        let value: T
        init(_ value: T) { self.value = value }
    }

    private struct TestFailure: Error, CustomStringConvertible {
        let description: String
        init(_ description: String) { self.description = description }
    }

    /// A stream of signals a millisecond or two apart, each of which would otherwise wake the loop on its own: the
    /// loop lets them gather (IOLoop.gatherMilliseconds) and handles several per round, every one of them in order.
    @Test func aSteadyStreamIsGatheredIntoFewerRounds() async throws {
        let fixture = try await BusFixture()
        let listener = try fixture.connect()
        let rounds = Rounds()
        let count = 300
        let order = Mutex<[String]>([])
        let subscription = try await listener.signals(
            matching: DBusMatchRule(interface: "org.example.Stream"),
            handler: { message in
                rounds.handled()
                order.withLock { $0.append(message.member ?? "") }
            })
        defer { subscription.cancel() }
        let token = DBusDispatchRounds.observe(.init(begin: { rounds.begin() }, end: { rounds.end() }))
        defer { DBusDispatchRounds.stopObserving(token) }
        let emitter = try RawEmitter(
            address: fixture.address, interface: "org.example.Stream", count: count, interval: .milliseconds(1))
        await emitter.finished()
        try await eventually(10, "every signal handled") { order.withLock { $0.count } == count }
        #expect(order.withLock { $0 } == (0..<count).map { "S\($0)" })
        let seen = rounds.state.withLock { $0 }
        #expect(seen.handledInside == count)
        // One signal per round is what a loop that reads each signal as it comes does here (300 rounds for 300
        // signals); gathering makes it about 15 a round. Two thirds leaves room for other tests' traffic in a
        // parallel run (a connection awaiting a reply is not made to wait, and other work ends a pause).
        #expect(
            seen.roundsWithSignals.count * 3 <= count * 2,
            "\(seen.roundsWithSignals.count) rounds for \(count) signals a millisecond or two apart")
    }

    /// Runs `ended` at the end of each dispatch round that handled signals (`count`, the signals handled so far, grew
    /// since the round before); returns the token for `DBusDispatchRounds.stopObserving`.
    private static func observeRoundsWithSignals(
        count: @escaping @Sendable () -> Int, _ ended: @escaping @Sendable () -> Void
    ) -> Int {
        let seenBefore = Atomic<Int>(0)
        return DBusDispatchRounds.observe(
            .init(
                begin: {},
                end: {
                    let now = count()
                    guard now > seenBefore.exchange(now, ordering: .relaxed) else { return }
                    ended()
                }))
    }

    /// An observer can ask for a longer pause after its round (`requestLongerGathering`, the bridge after a round of
    /// advertisements): under a stream a millisecond apart, rounds then come about that far apart. Other tests'
    /// work on the shared loop may end some pauses early, so the test asks that a few rounds came 30 ms or more
    /// after the one before (with the loop's own 16 ms pauses, none but a stalled machine's).
    @Test func anObserverCanAskForALongerPause() async throws {
        let fixture = try await BusFixture()
        let listener = try fixture.connect()
        let received = Atomic<Int>(0)
        let subscription = try await listener.signals(
            matching: DBusMatchRule(interface: "org.example.Longer"),
            handler: { _ in received.add(1, ordering: .relaxed) })
        defer { subscription.cancel() }
        let rounds = Mutex<[UInt64]>([])
        let token = Self.observeRoundsWithSignals(count: { received.load(ordering: .relaxed) }) {
            rounds.withLock { $0.append(DispatchTime.now().uptimeNanoseconds) }
            DBusDispatchRounds.requestLongerGathering(milliseconds: 48)
        }
        defer { DBusDispatchRounds.stopObserving(token) }
        let count = 600
        let emitter = try RawEmitter(
            address: fixture.address, interface: "org.example.Longer", count: count, interval: .milliseconds(1))
        await emitter.finished()
        try await eventually(10, "every signal handled") { received.load(ordering: .relaxed) == count }
        let times = rounds.withLock { $0 }
        let longGaps = zip(times, times.dropFirst()).filter { $1 &- $0 >= 30_000_000 }.count
        #expect(longGaps >= 3, "\(times.count) rounds, \(longGaps) of them 30 ms or more after the one before")
    }

    /// A receiver outside this process's D-Bus loop: its own libdbus connection, read on a thread of its own; notes
    /// when (CLOCK_MONOTONIC) each signal of `interface` arrived, by member.
    private final class RawReceiver: @unchecked Sendable {
        let arrivals = Mutex<[String: UInt64]>([:])
        private let stop = Atomic<Bool>(false)
        private let done = Finish()

        init(address: String, interface: String) throws {
            let raw = try DispatchRoundTests.openRawConnection(address, for: "raw receiver")
            var error = CDBus.DBusError()
            dbus_error_init(&error)
            dbus_bus_add_match(raw, "type='signal',interface='\(interface)'", &error)
            if dbus_error_is_set(&error) != 0 {
                defer { dbus_error_free(&error) }
                throw TestFailure("raw receiver: AddMatch failed")
            }
            let connection = UncheckedBox(raw)
            Thread.detachNewThread { [self] in
                while !self.stop.load(ordering: .relaxed), dbus_connection_read_write(connection.value, 50) != 0 {
                    while let message = dbus_connection_pop_message(connection.value) {
                        if dbus_message_has_interface(message, interface) != 0,
                            let member = dbus_message_get_member(message)
                        {
                            let name = String(cString: member)
                            let at = DispatchTime.now().uptimeNanoseconds
                            self.arrivals.withLock { $0[name] = at }
                        }
                        dbus_message_unref(message)
                    }
                }
                dbus_connection_close(connection.value)
                dbus_connection_unref(connection.value)
                self.done.signal()
            }
        }

        func close() async {
            stop.store(true, ordering: .relaxed)
            await done.wait()
        }
    }

    /// While a stream of signals gathers, work another thread queues for the loop is done at once: the pause waits
    /// on the wake-up sockets, not merely sleeps. A thread sends a probe signal on the listening connection just as
    /// a round of the stream ends, that is when the loop begins a pause (16 ms); a receiver outside the loop notes
    /// when it arrives. A pause that only slept would hold every probe back for most of the pause; the fastest of
    /// 30 probes shows whether any went out at once (the fastest, not a typical one: a loaded machine delays some).
    @Test func workQueuedDuringAPauseIsDoneAtOnce() async throws {
        let fixture = try await BusFixture()
        let listener = try fixture.connect()
        let receiver = try RawReceiver(address: fixture.address, interface: "org.example.Probe")
        let received = Atomic<Int>(0)
        let subscription = try await listener.signals(
            matching: DBusMatchRule(interface: "org.example.Gather"),
            handler: { _ in received.add(1, ordering: .relaxed) })
        defer { subscription.cancel() }
        // The probe thread is let go at the end of a round with signals, once it asked for it.
        let armed = Atomic<Bool>(false)
        let roundEnded = DispatchSemaphore(value: 0)
        let token = Self.observeRoundsWithSignals(count: { received.load(ordering: .relaxed) }) {
            if armed.compareExchange(expected: true, desired: false, ordering: .relaxed).exchanged {
                roundEnded.signal()
            }
        }
        defer { DBusDispatchRounds.stopObserving(token) }
        // A stream that runs until the probes are done (60 s at most).
        let emitter = try RawEmitter(
            address: fixture.address, interface: "org.example.Gather", count: 60_000, interval: .milliseconds(1))
        try await eventually(10, "the stream arrives") { received.load(ordering: .relaxed) >= 100 }
        let probes = 30
        let sentAt = Mutex<[String: UInt64]>([:])
        let probing = Finish()
        Thread.detachNewThread {
            for index in 0..<probes {
                armed.store(true, ordering: .relaxed)
                guard roundEnded.wait(timeout: .now() + 5) == .success else { break }
                let name = "P\(index)"
                sentAt.withLock { $0[name] = DispatchTime.now().uptimeNanoseconds }
                try? listener.emitSignal(path: "/p", interface: "org.example.Probe", name: name)
                // The next probe after a later round.
                usleep(20_000)
            }
            probing.signal()
        }
        await probing.wait()
        emitter.stop()
        try await eventually(10, "every probe arrives (\(sentAt.withLock { $0.count }) sent)") {
            receiver.arrivals.withLock { $0.count } == sentAt.withLock { $0.count }
        }
        await emitter.finished()
        await receiver.close()
        let sent = sentAt.withLock { $0 }
        let arrived = receiver.arrivals.withLock { $0 }
        let delays = sent.compactMap { name, at in arrived[name].map { Double($0 &- at) / 1e6 } }.sorted()
        #expect(delays.count == probes)
        // A probe held for the pause would take 16 ms less the probe thread's own wake-up; at once, well under 1 ms.
        #expect(
            (delays.first ?? .infinity) < 5,
            "fastest probe \(delays.first ?? .infinity) ms, median \(delays.isEmpty ? 0 : delays[delays.count / 2]) ms")
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
