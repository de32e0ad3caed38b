// A bounded event buffer for a consumer that may fall behind: at most `capacity` events wait; when it is full the
// new events are dropped and counted, and once the consumer has taken what was queued it gets a resynchronisation
// (the current state as events) instead of what was dropped, so no state change is missed for good. Used by
// discoveries, whose dropped `lost` events would otherwise leave a consumer believing a device is still there.
import Synchronization

final class ResyncingBuffer<Element: Sendable>: Sendable {
    private struct State {
        var items: [Element] = []
        var head = 0
        var overflowed = false
        var dropped = 0
        var finished = false
        var waiter: CheckedContinuation<Element?, Never>?
        var waiterID = 0
        var cancelledID = -1
        var peak = 0
    }

    let capacity: Int
    private let state = Mutex(State())
    /// The current state as events, computed when the consumer has caught up after an overflow.
    private let resync: @Sendable () -> [Element]
    /// Runs on each queued event in the order the consumer takes it; nil skips the event (already known, or
    /// superseded). Not used for a direct consumer (see `emit`).
    private let normalize: @Sendable (Element) -> Element?
    /// Called (outside the lock) at the first dropped event of each overflow, with the total dropped so far.
    private let onOverflow: @Sendable (Int) -> Void
    /// When set, each event is handed to it at once, on the producing thread, one at a time and in the order the
    /// events were made (`emit`): nothing queues, so nothing overflows and nothing needs normalising; `next()` then
    /// only waits for the end.
    private let direct: (@Sendable (Element) -> Void)?
    private let delivering = Mutex(false)

    init(
        capacity: Int, resync: @escaping @Sendable () -> [Element],
        normalize: @escaping @Sendable (Element) -> Element? = { $0 },
        onOverflow: @escaping @Sendable (Int) -> Void = { _ in },
        direct: (@Sendable (Element) -> Void)? = nil
    ) {
        self.direct = direct
        self.capacity = max(1, capacity)
        self.resync = resync
        self.normalize = normalize
        self.onOverflow = onOverflow
    }

    /// Events dropped because the buffer was full.
    var droppedCount: Int { state.withLock { $0.dropped } }
    /// The most events that ever waited at once (never above `capacity`).
    var peakCount: Int { state.withLock { $0.peak } }

    private enum Action {
        case none
        case resume(CheckedContinuation<Element?, Never>)
        case overflow(Int)
    }

    /// Makes an event and hands it on as one step. With a direct consumer, `make` runs under the lock each delivery
    /// takes, so events made on different threads reach the consumer in the order they were made: what the
    /// consumer was told is then exactly what the producer's state says it was told (a `lost` made on one thread
    /// cannot overtake the `appeared` made before it on another), which is what `normalize` restores for a
    /// queue, and it is skipped (a lock and a lookup less per advertisement). `make` must not emit, and must not
    /// take a lock that is held around an `emit` (the delivery lock comes first). Queued, the event is pushed.
    func emit(_ make: () -> Element?) {
        if let direct {
            // The flag is the finished state of the direct path, taken under the same lock as each delivery, so
            // no event reaches the consumer after finish() returned. `make` runs also after the end: its changes
            // to the producer's state are kept.
            delivering.withLock { finished in
                guard let e = make(), !finished else { return }
                direct(e)
            }
            return
        }
        if let e = make() { push(e) }
    }

    /// `emit` for several events, in order.
    func emit(all make: () -> [Element]) {
        if let direct {
            delivering.withLock { finished in
                let events = make()
                guard !finished else { return }
                for e in events { direct(e) }
            }
            return
        }
        for e in make() { push(e) }
    }

    /// Queues `element` (or hands it to the waiting consumer). A direct consumer gets it at once, not normalised:
    /// a producer with a direct consumer makes its events with `emit`.
    func push(_ element: Element) {
        if direct != nil {
            emit { element }
            return
        }
        let action = state.withLock { s -> Action in
            if s.finished { return .none }
            if let w = s.waiter {
                s.waiter = nil
                return .resume(w)
            }
            if s.items.count - s.head < capacity {
                s.items.append(element)
                s.peak = max(s.peak, s.items.count - s.head)
                return .none
            }
            s.dropped += 1
            let first = !s.overflowed
            s.overflowed = true
            return first ? .overflow(s.dropped) : .none
        }
        switch action {
        case .none: return
        case .resume(let w):
            // The consumer waits only when nothing is queued, so this event is next in its order.
            w.resume(returning: element)
        case .overflow(let n): onOverflow(n)
        }
    }

    /// Ends the sequence once the queued events are taken.
    func finish() {
        if direct != nil { delivering.withLock { $0 = true } }
        let w = state.withLock { s -> CheckedContinuation<Element?, Never>? in
            s.finished = true
            defer { s.waiter = nil }
            return s.waiter
        }
        w?.resume(returning: nil)
    }

    /// The next event (normalised), or nil at the end (or when the consuming task is cancelled).
    func next() async -> Element? {
        while true {
            guard let raw = await take() else { return nil }
            if let e = normalize(raw) { return e }
        }
    }

    private enum Step {
        case item(Element)
        case end
        case wait
    }

    private func step(_ s: inout State) -> Step {
        if s.head == s.items.count, s.overflowed {
            // Caught up after an overflow: the current state replaces what was dropped.
            s.overflowed = false
            s.items.removeAll(keepingCapacity: true)
            s.head = 0
            s.items.append(contentsOf: resync())
        }
        if s.head < s.items.count {
            let e = s.items[s.head]
            s.head += 1
            if s.head == s.items.count {
                s.items.removeAll(keepingCapacity: true)
                s.head = 0
            } else if s.head >= 1024, s.head * 2 >= s.items.count {
                s.items.removeFirst(s.head)
                s.head = 0
            }
            return .item(e)
        }
        return s.finished ? .end : .wait
    }

    private func take() async -> Element? {
        switch state.withLock({ step(&$0) }) {
        case .item(let e): return e
        case .end: return nil
        case .wait: break
        }
        if Task.isCancelled { return nil }
        let id = state.withLock { s -> Int in
            s.waiterID += 1
            return s.waiterID
        }
        return await withTaskCancellationHandler {
            await withCheckedContinuation { (c: CheckedContinuation<Element?, Never>) in
                let now = state.withLock { s -> Step? in
                    if s.cancelledID == id { return .end }
                    let st = step(&s)
                    if case .wait = st {
                        s.waiter = c
                        return nil
                    }
                    return st
                }
                switch now {
                case .item(let e)?: c.resume(returning: e)
                case .end?: c.resume(returning: nil)
                case .wait?, nil: break
                }
            }
        } onCancel: {
            let w = state.withLock { s -> CheckedContinuation<Element?, Never>? in
                s.cancelledID = id
                guard s.waiterID == id else { return nil }
                defer { s.waiter = nil }
                return s.waiter
            }
            w?.resume(returning: nil)
        }
    }
}
