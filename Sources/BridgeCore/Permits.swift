// A counting semaphore for async code: at most `limit` holders at a time, the others wait in arrival order. A
// waiting task that is cancelled leaves the queue at once (its wait returns false).
import Synchronization

final class AsyncPermits: Sendable {
    private struct Waiter {
        let id: UInt64
        let continuation: CheckedContinuation<Bool, Never>
    }
    private struct State {
        var available: Int
        var waiters: [Waiter] = []
        var nextID: UInt64 = 0
    }
    private let state: Mutex<State>

    init(_ limit: Int) {
        state = Mutex(State(available: max(1, limit)))
    }

    /// Takes a permit, waiting for one; false (and no permit) when the task is cancelled first.
    func acquire() async -> Bool {
        let id = state.withLock { s -> UInt64 in
            s.nextID += 1
            return s.nextID
        }
        return await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Bool, Never>) in
                let granted = state.withLock { s -> Bool? in
                    if Task.isCancelled { return false }
                    if s.available > 0 && s.waiters.isEmpty {
                        s.available -= 1
                        return true
                    }
                    s.waiters.append(Waiter(id: id, continuation: continuation))
                    return nil
                }
                if let granted { continuation.resume(returning: granted) }
            }
        } onCancel: {
            let gone = state.withLock { s -> Waiter? in
                guard let at = s.waiters.firstIndex(where: { $0.id == id }) else { return nil }
                return s.waiters.remove(at: at)
            }
            gone?.continuation.resume(returning: false)
        }
    }

    /// Gives a permit back: to the first waiter, if any.
    func release() {
        let next = state.withLock { s -> Waiter? in
            if s.waiters.isEmpty {
                s.available += 1
                return nil
            }
            return s.waiters.removeFirst()
        }
        next?.continuation.resume(returning: true)
    }

    /// Tasks waiting for a permit now.
    var waiting: Int { state.withLock { $0.waiters.count } }
}
