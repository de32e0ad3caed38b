// Small concurrency helpers: a one-shot promise that whichever side arrives first completes, and deadlines.
import Synchronization

/// A value delivered exactly once; later `complete` calls are ignored. `value()` may be awaited by one task.
final class OneShot<T: Sendable>: Sendable {
    private enum State {
        case initial
        case waiting(CheckedContinuation<T, Never>)
        case completed(T)
        case consumed
    }
    private let state = Mutex<State>(.initial)

    init() {}

    /// Delivers `value` if nothing was delivered yet. Returns true when this call won.
    @discardableResult
    func complete(_ value: T) -> Bool {
        let (won, continuation): (Bool, CheckedContinuation<T, Never>?) = state.withLock { state in
            switch state {
            case .initial:
                state = .completed(value)
                return (true, nil)
            case .waiting(let c):
                state = .consumed
                return (true, c)
            case .completed, .consumed:
                return (false, nil)
            }
        }
        continuation?.resume(returning: value)
        return won
    }

    var isCompleted: Bool {
        state.withLock {
            switch $0 {
            case .initial, .waiting: return false
            case .completed, .consumed: return true
            }
        }
    }

    /// Waits for the value.
    func value() async -> T {
        await withCheckedContinuation { (c: CheckedContinuation<T, Never>) in
            let ready: T? = state.withLock { state in
                switch state {
                case .completed(let v):
                    state = .consumed
                    return v
                case .initial:
                    state = .waiting(c)
                    return nil
                case .waiting, .consumed:
                    // A second waiter is a programming error inside this module; never reached by outside input.
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
