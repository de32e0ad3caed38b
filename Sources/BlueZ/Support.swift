// Small concurrency helpers: a one-shot promise that whichever side arrives first completes, and deadlines.
import Synchronization

/// A value delivered exactly once; later `complete` calls are ignored. Any number of tasks may await `value()`,
/// before or after the value arrives (a second waiter used to be left suspended forever).
final class OneShot<T: Sendable>: Sendable {
    private enum State {
        case pending([CheckedContinuation<T, Never>])
        case completed(T)
    }
    private let state = Mutex<State>(.pending([]))

    init() {}

    /// Delivers `value` if nothing was delivered yet. Returns true when this call won.
    @discardableResult
    func complete(_ value: T) -> Bool {
        let waiters: [CheckedContinuation<T, Never>]? = state.withLock { state in
            guard case .pending(let waiters) = state else { return nil }
            state = .completed(value)
            return waiters
        }
        guard let waiters else { return false }
        for waiter in waiters { waiter.resume(returning: value) }
        return true
    }

    var isCompleted: Bool {
        state.withLock {
            if case .completed = $0 { return true }
            return false
        }
    }

    /// Waits for the value (returns at once when it is already there).
    func value() async -> T {
        await withCheckedContinuation { (c: CheckedContinuation<T, Never>) in
            let ready: T? = state.withLock { state in
                switch state {
                case .completed(let v):
                    return v
                case .pending(var waiters):
                    waiters.append(c)
                    state = .pending(waiters)
                    return nil
                }
            }
            if let ready { c.resume(returning: ready) }
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
