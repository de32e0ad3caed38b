// One thread that reads every AcquireNotify socket: an epoll(7) loop that calls each socket's handler when it is
// readable. A dispatch read source per socket costs two thread wake-ups per notification (libdispatch's manager
// thread sees the event, then a worker runs the handler); here the reading thread is the one the kernel wakes, and
// a wake-up costs the same with 100 sockets registered as with one (poll(2) scanned them all every time).
internal import CLinux
import DBus
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Reads notification sockets on a thread of its own.
///
/// `add` registers a socket and the handler to run (on the reader thread) each time it is readable; `remove`
/// unregisters it and closes it, on the reader thread between two handler runs, so a handler never sees its
/// socket closed under it. Handlers run one at a time and must not block.
final class NotifySocketReader: Sendable {
    /// The reader every notification session uses; its thread starts with the first socket.
    static let shared = NotifySocketReader()

    private struct State {
        var handlers: [Int32: @Sendable () -> Void] = [:]
        var closing: [Int32] = []
        var epoll: Int32 = -1
        var wakeRead: Int32 = -1
        var wakeWrite: Int32 = -1
        var started = false
    }
    private let state = Mutex(State())

    /// Who hears of the rounds under load (`BlueZNotificationRounds`).
    let observers = RoundObservers()

    private init() {}

    /// Registers `fd` (non-blocking) and its handler. Returns false when the reader cannot take it (no thread,
    /// epoll instance or wake-up socket to be had); the caller then reads the socket another way.
    func add(_ fd: Int32, handler: @escaping @Sendable () -> Void) -> Bool {
        state.withLock { s -> Bool in
            guard Self.startIfNeeded(&s, self) else { return false }
            s.handlers[fd] = handler
            // Under the lock, so that a remove of the same descriptor cannot run in between.
            guard Self.watch(s.epoll, fd) else {
                s.handlers[fd] = nil
                return false
            }
            return true
        }
    }

    /// Stops calling `fd`'s handler and closes `fd` (on the reader thread). Idempotent per registration.
    func remove(_ fd: Int32) {
        let wake = state.withLock { s -> Int32? in
            guard s.handlers.removeValue(forKey: fd) != nil else { return nil }
            s.closing.append(fd)
            return s.wakeWrite
        }
        if let wake { clinux_poke_wake_socket(wake) }
    }

    /// Adds `fd` to the epoll set, readable events.
    private static func watch(_ epoll: Int32, _ fd: Int32) -> Bool {
        var event = epoll_event()
        event.events = EPOLLIN.rawValue
        event.data.fd = fd
        return epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event) == 0
    }

    /// Creates the epoll instance, the wake-up socket pair and the thread, once.
    private static func startIfNeeded(_ s: inout State, _ reader: NotifySocketReader) -> Bool {
        if s.started { return true }
        let epoll = epoll_create1(Int32(EPOLL_CLOEXEC))
        guard epoll >= 0 else { return false }
        var fds: [Int32] = [-1, -1]
        let type = Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | Int32(SOCK_NONBLOCK.rawValue)
        guard socketpair(AF_UNIX, type, 0, &fds) == 0 else {
            close(epoll)
            return false
        }
        guard watch(epoll, fds[0]) else {
            close(epoll)
            close(fds[0])
            close(fds[1])
            return false
        }
        var attributes = pthread_attr_t()
        pthread_attr_init(&attributes)
        pthread_attr_setdetachstate(&attributes, Int32(PTHREAD_CREATE_DETACHED))
        defer { pthread_attr_destroy(&attributes) }
        var thread = pthread_t()
        let context = Unmanaged.passRetained(reader).toOpaque()
        let rc = pthread_create(
            &thread, &attributes,
            { raw in
                guard let raw else { return nil }
                Unmanaged<NotifySocketReader>.fromOpaque(raw).takeRetainedValue().run()
                return nil
            }, context)
        guard rc == 0 else {
            Unmanaged<NotifySocketReader>.fromOpaque(context).release()
            close(epoll)
            close(fds[0])
            close(fds[1])
            return false
        }
        s.epoll = epoll
        s.wakeRead = fds[0]
        s.wakeWrite = fds[1]
        s.started = true
        return true
    }

    /// The reader thread: waits for readable sockets, runs their handlers, closes removed sockets. Runs for the
    /// life of the process (the shared reader is never freed).
    private func run() {
        clinux_name_thread("bluez-notify")
        let (epoll, wakeRead) = state.withLock { ($0.epoll, $0.wakeRead) }
        var events = [epoll_event](repeating: epoll_event(), count: 64)
        var lastWake = UInt64(clinux_monotonic_ns())
        while true {
            // Removed sockets leave the set and are closed here, between handler runs.
            let closing = state.withLock { s -> [Int32] in
                defer { s.closing = [] }
                return s.closing
            }
            for fd in closing {
                _ = epoll_ctl(epoll, EPOLL_CTL_DEL, fd, nil)
                close(fd)
            }
            let n = events.withUnsafeMutableBufferPointer {
                epoll_wait(epoll, $0.baseAddress, Int32($0.count), -1)
            }
            if n < 0 {
                if errno == EINTR { continue }
                // Not expected with a valid epoll instance; do not spin.
                usleep(10_000)
                continue
            }
            let wake = UInt64(clinux_monotonic_ns())
            // Under load (woken again within two gathering intervals) the round is a gathering one: observers hear of it
            // around it.
            let busy = wake &- lastWake < 2 * Self.gatherNanoseconds
            let round = {
                for index in 0..<Int(n) {
                    let fd = events[index].data.fd
                    if fd == wakeRead {
                        clinux_drain_wake_socket(wakeRead)
                        continue
                    }
                    // A descriptor removed in this round is no longer looked up (its handler is gone).
                    if let handler = self.state.withLock({ $0.handlers[fd] }) { handler() }
                }
            }
            if busy { observers.around(round) } else { round() }
            // Under load, gather for the rest of the interval before the next round, so that one wake-up serves
            // every notification of that interval instead of one each (at 5,000/s, 10 per round). It adds at most
            // the interval (2.5 ms) to a notification's way; at low rates nothing waits. Measured with
            // bench/bridge.sh on 2026-12-04: 1 ms rounds cost 30 µs per notification at 100 × 50 Hz, 2 ms rounds
            // 20-25 µs with a p99 of 3 ms, 3 ms rounds 21 µs with a p99 of 4 ms (too near the 5 ms target). On
            // 2026-12-06, with the MQTT loop's 8 ms acknowledgement gathering, four runs alternating with 2 ms rounds
            // (and 4 ms) in one hour: 0.236-0.266 of the simulator's CPU per notification against 0.261-0.301, the
            // p99 3.1-3.4 ms against 2.7-2.8 ms.
            if busy {
                let spent = UInt64(clinux_monotonic_ns()) &- wake
                if spent < Self.gatherNanoseconds {
                    clinux_sleep_ns(CUnsignedLongLong(Self.gatherNanoseconds &- spent))
                }
            }
            lastWake = wake
        }
    }

    /// How long a round under load gathers notifications (see `run`).
    static let gatherNanoseconds: UInt64 = 2_500_000
}

/// Rounds of notification delivery under load: the notify reader thread, woken again within 5 ms of its last
/// wake-up, delivers every value that is ready in one round and then gathers for the rest of 2.5 ms. An
/// observer hears `begin` before and `end` after each such round, on that thread, so that what the consumers do
/// per value can be batched per round (the bridge holds its MQTT writes: one write for the round's publishes
/// instead of one each). Both must be quick and must not block.
public enum BlueZNotificationRounds {
    /// Called around each round under load (the D-Bus layer's round observer: one shape for both kinds of round).
    public typealias Observer = DBusDispatchRounds.Observer

    /// Registers an observer; the returned token removes it.
    public static func observe(_ observer: Observer) -> Int { NotifySocketReader.shared.observers.add(observer) }

    /// Removes an observer registered with `observe`.
    public static func stopObserving(_ token: Int) { NotifySocketReader.shared.observers.remove(token) }
}

/// Rounds of signal dispatch on the D-Bus I/O thread (`DBusDispatchRounds`): bluetoothd's signals that libdbus read in
/// one go (advertisements under load) are handled in one round, and an observer hears `begin` before and `end` after
/// it, on that thread, as with `BlueZNotificationRounds`.
public enum BlueZSignalRounds {
    /// Registers an observer; the returned token removes it.
    public static func observe(_ observer: BlueZNotificationRounds.Observer) -> Int {
        DBusDispatchRounds.observe(observer)
    }

    /// Removes the observer `observe` returned `token` for.
    public static func stopObserving(_ token: Int) { DBusDispatchRounds.stopObserving(token) }

    /// Asks that the observers hear `end` again within about `milliseconds`, at the next round or in an empty one
    /// (`DBusDispatchRounds.requestEmptyRound`): for an observer that keeps a round's work for a while to batch it
    /// with the next rounds.
    public static func requestEmptyRound(afterMilliseconds milliseconds: Int) {
        DBusDispatchRounds.requestEmptyRound(afterMilliseconds: milliseconds)
    }

    /// Set on the I/O thread when a signal that is not an advertisement was handled (a characteristic's value over
    /// StartNotify, any other change of the mirror: a connection, services, an adapter).
    static let carriedMore = Atomic<Bool>(false)

    /// Whether the rounds since the last call handled anything but advertisements (and clears it): an observer
    /// that holds a round's work to batch advertisements sends it at once when so. On the I/O thread, from `end`.
    public static func takeCarriedMoreThanAdvertisements() -> Bool {
        carriedMore.exchange(false, ordering: .relaxed)
    }

    /// Asks that the D-Bus loop's next pause under load last up to `milliseconds` (at most 64) instead of 16
    /// (`DBusDispatchRounds.requestLongerGathering`): from `end`, after a round of advertisements only.
    public static func requestLongerGathering(milliseconds: Int) {
        DBusDispatchRounds.requestLongerGathering(milliseconds: milliseconds)
    }
}
