// An exactly-once completion: the C side completes it from libmosquitto's thread, Swift awaits it, and whichever
// comes first the result is delivered once. A result that arrives before anyone awaits is kept; an awaiter that is
// cancelled gets `.cancelled` at once and the completion stays pending for other awaiters. Every wait honours
// cancellation; the only other way out is the bounded wait of a shutdown.
import Dispatch
import Synchronization

final class Completion<Value: Sendable>: Sendable {
    private typealias Waiter = CheckedContinuation<Result<Value, MQTTError>, Never>

    private enum State {
        case pending(waiters: [UInt64: Waiter], nextID: UInt64)
        case done(Result<Value, MQTTError>)
    }

    private let state = Mutex<State>(.pending(waiters: [:], nextID: 0))

    init() {}

    /// Completes with `result` unless already completed; returns true if this call completed it.
    @discardableResult
    func complete(_ result: Result<Value, MQTTError>) -> Bool {
        let waiters: [Waiter]? = state.withLock { state in
            guard case .pending(let waiters, _) = state else { return nil }
            state = .done(result)
            return Array(waiters.values)
        }
        guard let waiters else { return false }
        for waiter in waiters { waiter.resume(returning: result) }
        return true
    }

    /// The result, if there is one yet.
    var result: Result<Value, MQTTError>? {
        state.withLock { state in
            if case .done(let result) = state { return result }
            return nil
        }
    }

    /// Waits for the result. Cancelling the waiting task ends this wait at once with `.cancelled` (its waiter is
    /// dropped; the completion stays pending for other waiters).
    func wait(operation: @autoclosure () -> String) async -> Result<Value, MQTTError> {
        let id = nextWaiterID()
        let cancelled = MQTTError(.cancelled, operation: operation(), detail: "the waiting task was cancelled")
        return await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: Waiter) in
                if let immediate = register(id, continuation, unlessCancelled: cancelled) {
                    continuation.resume(returning: immediate)
                }
            }
        } onCancel: {
            removeWaiter(id)?.resume(returning: .failure(cancelled))
        }
    }

    /// Waits for the result. Cancelling the waiting task ends this wait with `.cancelled`.
    func value(operation: @autoclosure () -> String) async throws(MQTTError) -> Value {
        try await wait(operation: operation()).get()
    }

    /// Waits for the result for at most `timeout`, cancelled or not; after that the waiter is dropped and the wait
    /// ends with `.cancelled`. For shutdown, where the task was cancelled on purpose and the other side gets a
    /// bounded chance to finish.
    func wait(atMost timeout: Duration, operation: @autoclosure () -> String) async -> Result<Value, MQTTError> {
        let id = nextWaiterID()
        let gaveUp = MQTTError(.cancelled, operation: operation(), detail: "gave up waiting after \(timeout)")
        let milliseconds = Int(
            clamping: timeout.components.seconds * 1000 + timeout.components.attoseconds / 1_000_000_000_000_000)
        return await withCheckedContinuation { (continuation: Waiter) in
            if let immediate = register(id, continuation, unlessCancelled: nil) {
                continuation.resume(returning: immediate)
                return
            }
            DispatchQueue.global().asyncAfter(deadline: .now() + .milliseconds(milliseconds)) { [self] in
                removeWaiter(id)?.resume(returning: .failure(gaveUp))
            }
        }
    }

    private func nextWaiterID() -> UInt64 {
        state.withLock { state in
            guard case .pending(let waiters, let nextID) = state else { return 0 }
            state = .pending(waiters: waiters, nextID: nextID + 1)
            return nextID
        }
    }

    /// Adds `continuation` as waiter `id`; returns the result instead when there is one, or `cancelled` when it is
    /// given and the task was cancelled before the waiter could be added (the cancellation handler found nothing).
    private func register(_ id: UInt64, _ continuation: Waiter, unlessCancelled cancelled: MQTTError?)
        -> Result<Value, MQTTError>?
    {
        state.withLock { state in
            switch state {
            case .done(let result):
                return result
            case .pending(var waiters, let nextID):
                if let cancelled, Task.isCancelled { return .failure(cancelled) }
                waiters[id] = continuation
                state = .pending(waiters: waiters, nextID: nextID)
                return nil
            }
        }
    }

    private func removeWaiter(_ id: UInt64) -> Waiter? {
        state.withLock { state in
            guard case .pending(var waiters, let nextID) = state, let waiter = waiters.removeValue(forKey: id)
            else { return nil }
            state = .pending(waiters: waiters, nextID: nextID)
            return waiter
        }
    }
}

/// A bound on the bytes one stream holds for its reader: the producer takes an element's size before buffering it
/// (or drops the element when it does not fit), the reader gives it back when it takes the element out.
final class ByteBudget: Sendable {
    /// The most bytes the stream may hold.
    let limit: Int
    private let used = Atomic<Int>(0)

    init(limit: Int) {
        self.limit = limit
    }

    /// Takes `bytes` out of the budget if they fit; false (and nothing taken) otherwise.
    func take(_ bytes: Int) -> Bool {
        var current = used.load(ordering: .relaxed)
        while true {
            guard current + bytes <= limit else { return false }
            let (exchanged, original) = used.compareExchange(
                expected: current, desired: current + bytes, ordering: .relaxed)
            if exchanged { return true }
            current = original
        }
    }

    /// Returns `bytes` taken earlier.
    func giveBack(_ bytes: Int) {
        used.subtract(bytes, ordering: .relaxed)
    }
}

/// Fans values out to any number of `AsyncStream`s; each stream unregisters itself when its reader goes away.
final class Broadcast<Element: Sendable>: Sendable {
    private struct Subscriber {
        let continuation: AsyncStream<Element>.Continuation
        let budget: ByteBudget?
    }

    private struct State {
        var subscribers: [UInt64: Subscriber] = [:]
        var nextID: UInt64 = 0
        var finished = false
    }

    private let state = Mutex(State())
    /// Streams whose reader has gone, to be removed by the next `yield` or `makeStream`. A stream's
    /// termination handler must not take `state`: it runs while the Swift runtime holds the reading task's status
    /// lock (the task is being cancelled), and `yield` holds `state` while it resumes that same task, which needs
    /// the status lock: the two threads would wait for each other for ever. This lock is never held while anything
    /// is resumed.
    private let gone = Mutex<[UInt64]>([])

    init() {}

    /// Removes the streams whose reader has gone (called with `state` held).
    private func removeGone(_ state: inout State) {
        let ids = gone.withLock { ids in
            defer { ids.removeAll() }
            return ids
        }
        for id in ids { state.subscribers.removeValue(forKey: id) }
    }

    /// A new stream; `initial` (if any) is its first element. With a `budget`, an element is buffered only when
    /// its size (as passed to `yield`) fits, and the reader must give the size back when it takes the element.
    func makeStream(
        bufferingPolicy: AsyncStream<Element>.Continuation.BufferingPolicy, initial: Element? = nil,
        budget: ByteBudget? = nil, current: (() -> Element?)? = nil
    ) -> AsyncStream<Element> {
        let (stream, continuation) = AsyncStream<Element>.makeStream(bufferingPolicy: bufferingPolicy)
        var initial = initial
        let registered: UInt64? = state.withLock { state in
            guard !state.finished else { return nil }
            removeGone(&state)
            let id = state.nextID
            state.nextID += 1
            state.subscribers[id] = Subscriber(continuation: continuation, budget: budget)
            // `current` is read under the lock that orders every yield: a change published while the stream is
            // being made is either the first element or delivered after it, never lost.
            if let current { initial = current() }
            if let initial { continuation.yield(initial) }
            return id
        }
        if let registered {
            continuation.onTermination = { [weak self] _ in
                self?.gone.withLock { $0.append(registered) }
            }
        } else {
            if let initial { continuation.yield(initial) }
            continuation.finish()
        }
        return stream
    }

    /// Sends `element`, whose size is `bytes`, to every stream; returns how many streams dropped it because their
    /// buffer was full (in elements, or in bytes for a stream with a budget). Yielding under the lock keeps the
    /// order the same in every stream when several threads yield.
    @discardableResult
    func yield(_ element: Element, bytes: Int = 0) -> Int {
        state.withLock { state in
            removeGone(&state)
            var dropped = 0
            for subscriber in state.subscribers.values {
                if let budget = subscriber.budget, !budget.take(bytes) {
                    dropped += 1
                    continue
                }
                switch subscriber.continuation.yield(element) {
                case .enqueued:
                    break
                case .dropped:
                    dropped += 1
                    subscriber.budget?.giveBack(bytes)
                case .terminated:
                    subscriber.budget?.giveBack(bytes)
                @unknown default:
                    break
                }
            }
            return dropped
        }
    }

    /// How many streams are registered (for tests).
    var subscriberCount: Int { state.withLock { $0.subscribers.count } }

    /// Ends every stream; later streams end at once.
    func finish() {
        let continuations = state.withLock { state in
            state.finished = true
            defer { state.subscribers.removeAll() }
            return state.subscribers.values.map(\.continuation)
        }
        for continuation in continuations { continuation.finish() }
    }
}
