// Small concurrency helpers: a one-shot promise that whichever side arrives first completes, and deadlines.
import Synchronization

/// A value delivered exactly once; later `complete` calls are ignored. Any number of tasks may await `value()`,
/// before or after the value arrives (a second waiter used to be left suspended forever).
///
/// A wait is cancellable: when the waiting task is cancelled, `value()` returns nil at once and its waiter is
/// dropped, so nothing stays suspended (a task group around it can finish, a timer racing it can win).
final class OneShot<T: Sendable>: Sendable {
    private struct State {
        var value: T?
        var waiters: [UInt64: CheckedContinuation<T?, Never>] = [:]
        var nextID: UInt64 = 0
    }
    private let state = Mutex<State>(State())

    init() {}

    /// Delivers `value` if nothing was delivered yet. Returns true when this call won.
    @discardableResult
    func complete(_ value: T) -> Bool {
        let waiters: [CheckedContinuation<T?, Never>]? = state.withLock { state in
            guard state.value == nil else { return nil }
            state.value = value
            defer { state.waiters = [:] }
            return Array(state.waiters.values)
        }
        guard let waiters else { return false }
        for waiter in waiters { waiter.resume(returning: value) }
        return true
    }

    var isCompleted: Bool { state.withLock { $0.value != nil } }

    /// The number of tasks suspended in `value()` (for tests: a cancelled wait must not linger).
    var waiterCount: Int { state.withLock { $0.waiters.count } }

    /// Waits for the value (returns at once when it is already there); nil when the waiting task is cancelled.
    func value() async -> T? {
        let id = state.withLock { state -> UInt64 in
            state.nextID += 1
            return state.nextID
        }
        return await withTaskCancellationHandler {
            await withCheckedContinuation { (c: CheckedContinuation<T?, Never>) in
                // Under the lock, so that a cancellation handler running at the same time either sees this waiter
                // or has already set the flag read here.
                let ready: (T?, Bool) = state.withLock { state in
                    if let v = state.value { return (v, true) }
                    if Task.isCancelled { return (nil, true) }
                    state.waiters[id] = c
                    return (nil, false)
                }
                if ready.1 { c.resume(returning: ready.0) }
            }
        } onCancel: {
            let waiter = state.withLock { $0.waiters.removeValue(forKey: id) }
            waiter?.resume(returning: nil)
        }
    }
}

/// A point in time on the continuous clock, for operations that share one overall timeout.
struct Deadline: Sendable {
    let instant: ContinuousClock.Instant
    let total: Duration

    init(_ timeout: Duration) {
        instant = .now + timeout
        total = timeout
    }

    var remaining: Duration { max(.zero, instant - .now) }
    var expired: Bool { ContinuousClock.Instant.now >= instant }
}

/// Sleeps, returning early (without throwing) when the task is cancelled.
func nap(_ duration: Duration) async {
    try? await Task.sleep(for: duration)
}

/// One run of an expensive read at a time, shared by everyone who asks while it is under way or queued.
///
/// A caller needs a result read after it asked: it joins the run that is queued (which starts after the current one
/// ends), or queues one when a run is under way, or starts one when nothing is. So however many tasks ask at once,
/// at most one run is under way and one queued, and every caller still gets a result at least as fresh as its
/// question. (A hundred devices resolving their services together used to read bluetoothd's whole tree a hundred
/// times over, all at once.) A cancelled caller stops waiting at once (nil); the run goes on for the others.
final class SingleFlight<Value: Sendable>: Sendable {
    private struct Box: Sendable { let value: Value }
    private typealias Read = @Sendable () async -> Value
    private struct State {
        var running = false
        var queued: (shot: OneShot<Box>, read: Read)?
    }
    private let state = Mutex<State>(State())

    init() {}

    /// How many runs are under way or queued (0, 1 or 2; for tests).
    var pending: Int { state.withLock { ($0.running ? 1 : 0) + ($0.queued == nil ? 0 : 1) } }

    /// The result of a run of `read` (this one, or an equivalent one another caller passed) that started after
    /// this call; nil when the calling task is cancelled.
    func value(_ read: @escaping @Sendable () async -> Value) async -> Value? {
        let (shot, start) = state.withLock { s -> (OneShot<Box>, Bool) in
            if let queued = s.queued { return (queued.shot, false) }
            let shot = OneShot<Box>()
            if s.running {
                s.queued = (shot, read)
                return (shot, false)
            }
            s.running = true
            return (shot, true)
        }
        if start {
            // Unstructured: the run must not end with the cancellation of the caller that happened to start it. It
            // holds this value (not its owner, which `read` must not hold strongly) until no run is queued.
            Task { await self.runs(shot, read) }
        }
        return await shot.value()?.value
    }

    /// Runs `read` for `shot`, then each run queued meanwhile, until none is.
    private func runs(_ first: OneShot<Box>, _ firstRead: Read) async {
        var (shot, read) = (first, firstRead)
        while true {
            shot.complete(Box(value: await read()))
            guard
                let next = state.withLock({ s -> (shot: OneShot<Box>, read: Read)? in
                    defer { s.queued = nil }
                    s.running = s.queued != nil
                    return s.queued
                })
            else { return }
            (shot, read) = next
        }
    }
}
