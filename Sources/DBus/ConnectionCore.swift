// The I/O core of a connection: the I/O thread owns the libdbus connection. It polls the watches libdbus hands
// out plus a wake-up socket, runs libdbus timeouts, dispatches, and sends everything other threads queued. Every
// libdbus call on the connection happens on that thread (after the handshake in init), so no libdbus lock is
// ever contended and a message queued from any thread goes out as soon as the thread wakes. One thread
// (`IOLoop`) serves every connection of the process: a bridge with a connection per peripheral would otherwise
// have a thread per peripheral. Under a stream of signals the loop pauses a few milliseconds before it reads again
// (`IOLoop.gatherMilliseconds`), so that one wake-up and one dispatch round take several signals.
internal import CDBus
internal import CLinux
import Dispatch
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Work queued for the I/O thread.
enum IOWork {
    case send(CMessage)
    case call(CMessage, timeoutMilliseconds: Int32, PendingCall)
    case cancel(PendingCall)
    case perform(@Sendable () -> Void)
    case stop
}

/// Something (an object server) that holds outgoing messages back until the next message goes out or the
/// thread idles, and that handles incoming method calls.
protocol ConnectionClient: AnyObject, Sendable {
    /// Messages that must go out before any other message (pending PropertiesChanged...). Called under the
    /// connection's queue lock: it may take its own lock but never call back into the connection.
    func takePendingMessages() -> [CMessage]
    /// Handles a method call on the I/O thread; false when the call is not for this client.
    func handleMethodCall(_ message: CMessage, decoded: DBusMessage) -> Bool
    /// Handles a method call for a path no client claimed (the first client answers); returns true if handled.
    func handleUnclaimedMethodCall(_ message: CMessage, decoded: DBusMessage) -> Bool
}

/// An in-flight method call: an exactly-once promise that works whichever side (reply, timeout, cancellation,
/// disconnect) arrives first.
final class PendingCall: @unchecked Sendable {
    typealias Outcome = Result<CMessage, DBusError>
    private enum State {
        case initial
        case waiting(CheckedContinuation<Outcome, Never>)
        case completed(Outcome)
        case delivered
    }
    private let state = Mutex<State>(.initial)
    /// Runs on the I/O thread when the reply arrives, in message order (used by name owner tracking).
    let onIOThread: (@Sendable (Outcome) -> Void)?
    /// The libdbus pending call; touched only on the I/O thread.
    var handle: OpaquePointer?

    init(onIOThread: (@Sendable (Outcome) -> Void)? = nil) { self.onIOThread = onIOThread }

    /// Completes the call; later completions are ignored.
    func complete(_ outcome: Outcome) {
        let continuation: CheckedContinuation<Outcome, Never>? = state.withLock { state in
            switch state {
            case .initial:
                state = .completed(outcome)
                return nil
            case .waiting(let continuation):
                state = .delivered
                return continuation
            case .completed, .delivered:
                return nil
            }
        }
        continuation?.resume(returning: outcome)
    }

    var isCompleted: Bool {
        state.withLock {
            if case .initial = $0 { return false } else if case .waiting = $0 { return false }
            return true
        }
    }

    /// Waits for the outcome; cancellation completes the call with ``DBusError/cancelled`` and cancels it in libdbus.
    func wait(core: ConnectionCore) async -> Outcome {
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Outcome, Never>) in
                let ready: Outcome? = state.withLock { state in
                    switch state {
                    case .initial:
                        state = .waiting(continuation)
                        return nil
                    case .completed(let outcome):
                        state = .delivered
                        return outcome
                    case .waiting, .delivered:
                        return .failure(DBusError(name: DBusError.failed, message: "call awaited twice"))
                    }
                }
                if let ready { continuation.resume(returning: ready) }
            }
        } onCancel: {
            self.complete(.failure(DBusError(name: DBusError.cancelled, message: "the awaiting task was cancelled")))
            core.enqueueInternal(.cancel(self))
        }
    }
}

/// A registered signal consumer. A class: the filter walks the list for every signal, and a reference costs one
/// retain where the fields would cost one each.
final class SignalSubscription: @unchecked Sendable {
    // @unchecked: the C strings below are written once, in init, and freed in deinit.
    let rule: DBusMatchRule
    let deliver: @Sendable (DBusMessage) -> Void
    let finish: @Sendable () -> Void
    /// Set for a subscription that reads signals in place: it gets them instead of `deliver`, with no decoding.
    let deliverView: (@Sendable (DBusSignalView) -> Void)?
    /// The rule's `matchesOnHeaderOnly`.
    let headerOnly: Bool
    /// The header fields `matchesHeader` compares, as C strings made once (the rule's Strings would be copied out
    /// and bridged for every signal); nil where the rule does not constrain the field.
    private let type: Int32?
    private let sender: UnsafeMutablePointer<CChar>?
    private let interface: UnsafeMutablePointer<CChar>?
    private let member: UnsafeMutablePointer<CChar>?
    private let path: UnsafeMutablePointer<CChar>?
    private let destination: UnsafeMutablePointer<CChar>?

    init(
        rule: DBusMatchRule, deliver: @escaping @Sendable (DBusMessage) -> Void,
        finish: @escaping @Sendable () -> Void, deliverView: (@Sendable (DBusSignalView) -> Void)? = nil
    ) {
        self.rule = rule
        self.deliver = deliver
        self.finish = finish
        self.deliverView = deliverView
        headerOnly = rule.matchesOnHeaderOnly
        type = rule.type.map(Self.typeCode)
        // A well-known sender name is not what the header carries (that is the owner's unique name): only a unique
        // name or the bus itself is compared here; the bus applies the rest of the rule.
        sender = rule.sender.flatMap { $0.hasPrefix(":") || $0 == "org.freedesktop.DBus" ? strdup($0) : nil }
        interface = rule.interface.flatMap { strdup($0) }
        member = rule.member.flatMap { strdup($0) }
        path = rule.path.flatMap { strdup($0.rawValue) }
        destination = rule.destination.flatMap { strdup($0) }
    }

    deinit {
        for field in [sender, interface, member, path, destination] { free(field) }
    }

    private static func typeCode(_ type: DBusMessage.MessageType) -> Int32 {
        switch type {
        case .methodCall: DBUS_MESSAGE_TYPE_METHOD_CALL
        case .methodReturn: DBUS_MESSAGE_TYPE_METHOD_RETURN
        case .error: DBUS_MESSAGE_TYPE_ERROR
        case .signal: DBUS_MESSAGE_TYPE_SIGNAL
        }
    }

    /// The part of `rule.matches(_:)` that the message's header decides (all of it when `headerOnly`), compared in
    /// place against the C strings made once.
    func matchesHeader(_ message: OpaquePointer) -> Bool {
        func equal(_ expected: UnsafeMutablePointer<CChar>?, _ actual: UnsafePointer<CChar>?) -> Bool {
            guard let expected else { return true }
            guard let actual else { return false }
            return strcmp(actual, expected) == 0
        }
        if let type, type != dbus_message_get_type(message) { return false }
        guard equal(sender, dbus_message_get_sender(message)), equal(interface, dbus_message_get_interface(message)),
            equal(member, dbus_message_get_member(message)), equal(path, dbus_message_get_path(message))
        else { return false }
        if let destination, let target = dbus_message_get_destination(message), strcmp(target, destination) != 0 {
            return false
        }
        return true
    }
}

final class ConnectionCore: @unchecked Sendable {
    struct Shared {
        var queue: [IOWork] = []
        var connected = true
        var stopping = false
        var threadExited = false
        var idleFlushRequested = false
        /// The I/O thread is (about to be) blocked in poll and needs the pipe to wake up.
        var sleeping = false
        /// Someone already wrote to the pipe since the thread went to sleep.
        var wakePending = false
        var joinClaimed = false
        var ioThread: pthread_t?
        var clients: [ObjectIdentifier: any ConnectionClient] = [:]
        var clientOrder: [ObjectIdentifier] = []
        var subscriptions: [UInt64: SignalSubscription] = [:] {
            didSet { subscriptionList = Array(subscriptions.values) }
        }
        /// `subscriptions.values`, kept for the filter (which would otherwise copy them for every signal).
        private(set) var subscriptionList: [SignalSubscription] = []
        var disconnectWaiters: [UInt64: CheckedContinuation<Void, Never>] = [:]
        var nextID: UInt64 = 1
        var pendingCalls: [ObjectIdentifier: PendingCall] = [:]
    }

    struct Watch {
        var pointer: OpaquePointer
        var fd: Int32
        var flags: UInt32
        var enabled: Bool
    }

    struct Timeout {
        var pointer: OpaquePointer
        var interval: Int64
        var enabled: Bool
        var deadline: Int64
    }

    let connection: OpaquePointer
    /// Read and write ends of the self-pipe that wakes the I/O thread.
    let wakeFD: Int32
    let wakeWriteFD: Int32
    let shared = Mutex(Shared())

    // I/O-thread-only state.
    private var watches: [Watch] = []
    private var timeouts: [Timeout] = []
    private var deferredUnrefs: [OpaquePointer] = []
    /// Signalled once the I/O thread has closed and released the connection.
    private let exited = DispatchSemaphore(value: 0)

    init(connection: OpaquePointer) throws(DBusError) {
        self.connection = connection
        var fds: [Int32] = [-1, -1]
        // Close-on-exec from the start (a child spawned by another thread in between must not inherit it). A socket
        // pair rather than pipe(2): Glibc's module map does not export pipe2.
        let type = Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | Int32(SOCK_NONBLOCK.rawValue)
        guard socketpair(AF_UNIX, type, 0, &fds) == 0 else {
            throw DBusError(
                name: DBusError.failed,
                message: "cannot create the D-Bus I/O thread's wake-up pipe: \(String(cString: strerror(errno)))")
        }
        wakeFD = fds[0]
        wakeWriteFD = fds[1]
    }

    deinit {
        Glibc.close(wakeFD)
        Glibc.close(wakeWriteFD)
    }

    // MARK: thread lifecycle

    func start() throws(DBusError) {
        let tid = try IOLoop.shared.add(self)
        shared.withLock { $0.ioThread = tid }
    }

    var isOnIOThread: Bool {
        guard let tid = shared.withLock({ $0.ioThread }) else { return false }
        return pthread_equal(tid, pthread_self()) != 0
    }

    /// Stops the connection's I/O, closes the connection and waits until that is done (unless called on the I/O
    /// thread itself, which cannot wait for itself).
    func shutdown() {
        let (mustJoin, tid): (Bool, pthread_t?) = shared.withLock { s in
            if !s.stopping {
                s.stopping = true
                s.queue.append(.stop)
                ConnectionCore.wakeIfSleeping(&s, self)
            }
            if s.joinClaimed { return (false, nil) }
            s.joinClaimed = true
            return (true, s.ioThread)
        }
        guard mustJoin, let tid else { return }
        if pthread_equal(tid, pthread_self()) != 0 { return }
        exited.wait()
    }

    private func wake() { clinux_poke_wake_socket(wakeWriteFD) }

    /// Writes to the wake pipe only when the I/O thread sleeps and nobody woke it yet (one syscall per sleep,
    /// not per message).
    static func wakeIfSleeping(_ s: inout Shared, _ core: ConnectionCore) {
        guard s.sleeping, !s.wakePending else { return }
        s.wakePending = true
        core.wake()
    }

    /// For libdbus's wakeup and dispatch-status callbacks.
    func wakeFromLibdbus() {
        shared.withLock { ConnectionCore.wakeIfSleeping(&$0, self) }
    }

    // MARK: queueing (any thread)

    /// Queues work; messages first take out whatever clients hold back, so that it goes out before them.
    func enqueue(_ work: IOWork) throws(DBusError) {
        let ok = shared.withLock { s -> Bool in
            if s.stopping { return false }
            if case .perform = work {} else if !s.connected { return false }
            if case .perform = work {
            } else {
                for id in s.clientOrder {
                    if let client = s.clients[id] {
                        for message in client.takePendingMessages() { s.queue.append(.send(message)) }
                    }
                }
            }
            s.queue.append(work)
            ConnectionCore.wakeIfSleeping(&s, self)
            return true
        }
        guard ok else { throw DBusError(name: DBusError.disconnected, message: "the D-Bus connection is closed") }
    }

    /// Queues work without flushing clients and without failing (cancellations).
    func enqueueInternal(_ work: IOWork) {
        shared.withLock { s in
            if s.threadExited { return }
            s.queue.append(work)
            ConnectionCore.wakeIfSleeping(&s, self)
        }
    }

    /// Asks the I/O thread to flush clients' held-back messages when it next idles.
    func requestIdleFlush() {
        shared.withLock { s in
            if s.idleFlushRequested || s.stopping { return }
            s.idleFlushRequested = true
            ConnectionCore.wakeIfSleeping(&s, self)
        }
    }

    func addClient(_ client: any ConnectionClient) {
        shared.withLock { s in
            let id = ObjectIdentifier(client)
            if s.clients[id] == nil { s.clientOrder.append(id) }
            s.clients[id] = client
        }
    }

    func removeClient(_ client: any ConnectionClient) {
        shared.withLock { s in
            let id = ObjectIdentifier(client)
            s.clients[id] = nil
            s.clientOrder.removeAll { $0 == id }
        }
    }

    // MARK: calls

    static func milliseconds(_ duration: Duration) -> Int32 {
        let (seconds, attoseconds) = duration.components
        let ms = Double(seconds) * 1000 + Double(attoseconds) / 1e15
        if ms >= Double(Int32.max) { return Int32.max }
        return Int32(max(1, ms.rounded(.up)))
    }

    /// Sends a method call and waits for the reply (or an error reply, timeout, cancellation or disconnect).
    func call(_ message: CMessage, timeout: Duration, onIOThread: (@Sendable (PendingCall.Outcome) -> Void)? = nil)
        async -> PendingCall.Outcome
    {
        let pending = PendingCall(onIOThread: onIOThread)
        do {
            try enqueue(.call(message, timeoutMilliseconds: ConnectionCore.milliseconds(timeout), pending))
        } catch {
            return .failure(error)
        }
        return await pending.wait(core: self)
    }

    /// Sends a method call to the bus driver and returns the reply body.
    func callBus(_ method: String, _ arguments: [DBusValue], timeout: Duration = .seconds(25)) async throws(DBusError)
        -> [DBusValue]
    {
        let message = DBusMessage.methodCall(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            method: method, body: arguments)
        let reply = try await call(Marshal.build(message), timeout: timeout).get()
        return try ConnectionCore.replyBody(reply)
    }

    /// The body of a reply, or the error it carries.
    static func replyBody(_ reply: CMessage) throws(DBusError) -> [DBusValue] {
        if reply.type == DBUS_MESSAGE_TYPE_ERROR {
            throw errorFromReply(reply)
        }
        return try Marshal.decodeBody(reply.pointer)
    }

    static func errorFromReply(_ reply: CMessage) -> DBusError {
        let name = dbus_message_get_error_name(reply.pointer).map { String(cString: $0) } ?? DBusError.failed
        let body = (try? Marshal.decodeBody(reply.pointer)) ?? []
        return DBusError(name: name, message: body.first?.string ?? "")
    }

    // MARK: subscriptions

    func addSubscription(_ subscription: SignalSubscription) -> UInt64? {
        shared.withLock { s -> UInt64? in
            guard s.connected, !s.stopping else { return nil }
            let id = s.nextID
            s.nextID += 1
            s.subscriptions[id] = subscription
            return id
        }
    }

    /// Removes a subscription and tells the bus (RemoveMatch, no reply wanted).
    func removeSubscription(_ id: UInt64, removeMatch: Bool) {
        let removed = shared.withLock { $0.subscriptions.removeValue(forKey: id) }
        guard let removed, removeMatch else { return }
        var message = DBusMessage.methodCall(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            method: "RemoveMatch", body: [.string(removed.rule.rule)])
        message.noReplyExpected = true
        if let built = try? Marshal.build(message) { try? enqueue(.send(built)) }
    }

    func waitUntilDisconnected() async {
        let id: UInt64? = shared.withLock { s in
            guard s.connected else { return nil }
            let id = s.nextID
            s.nextID += 1
            return id
        }
        guard let id else { return }
        await withTaskCancellationHandler {
            await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
                let resumeNow = shared.withLock { s -> Bool in
                    guard s.connected else { return true }
                    s.disconnectWaiters[id] = continuation
                    return false
                }
                if resumeNow { continuation.resume() }
            }
        } onCancel: {
            let continuation = self.shared.withLock { $0.disconnectWaiters.removeValue(forKey: id) }
            continuation?.resume()
        }
    }

    // MARK: the I/O thread

    /// Hands libdbus the callbacks that route its watches, timeouts and messages here; on the I/O thread.
    fileprivate func setUp() {
        let context = Unmanaged.passUnretained(self).toOpaque()
        dbus_connection_set_watch_functions(
            connection,
            { watch, data in
                guard let watch, let data else { return 0 }
                Unmanaged<ConnectionCore>.fromOpaque(data).takeUnretainedValue().addWatch(watch)
                return 1
            },
            { watch, data in
                guard let watch, let data else { return }
                Unmanaged<ConnectionCore>.fromOpaque(data).takeUnretainedValue().removeWatch(watch)
            },
            { watch, data in
                guard let watch, let data else { return }
                Unmanaged<ConnectionCore>.fromOpaque(data).takeUnretainedValue().toggleWatch(watch)
            }, context, nil)
        dbus_connection_set_timeout_functions(
            connection,
            { timeout, data in
                guard let timeout, let data else { return 0 }
                Unmanaged<ConnectionCore>.fromOpaque(data).takeUnretainedValue().addTimeout(timeout)
                return 1
            },
            { timeout, data in
                guard let timeout, let data else { return }
                Unmanaged<ConnectionCore>.fromOpaque(data).takeUnretainedValue().removeTimeout(timeout)
            },
            { timeout, data in
                guard let timeout, let data else { return }
                Unmanaged<ConnectionCore>.fromOpaque(data).takeUnretainedValue().toggleTimeout(timeout)
            }, context, nil)
        dbus_connection_set_wakeup_main_function(
            connection,
            { data in
                guard let data else { return }
                Unmanaged<ConnectionCore>.fromOpaque(data).takeUnretainedValue().wakeFromLibdbus()
            }, context, nil)
        dbus_connection_set_dispatch_status_function(
            connection,
            { _, status, data in
                guard let data, status == DBUS_DISPATCH_DATA_REMAINS else { return }
                Unmanaged<ConnectionCore>.fromOpaque(data).takeUnretainedValue().wakeFromLibdbus()
            }, context, nil)
        _ = dbus_connection_add_filter(
            connection,
            { _, message, data in
                guard let message, let data else { return DBUS_HANDLER_RESULT_NOT_YET_HANDLED }
                return Unmanaged<ConnectionCore>.fromOpaque(data).takeUnretainedValue().filter(message)
            }, context, nil)
    }

    /// What one round of a connection's I/O work left.
    enum StepResult {
        /// The connection was asked to stop: `finishShutdown()` is next.
        case stopped
        /// More work was queued meanwhile: go round again before sleeping.
        case busy
        /// Nothing to do until a descriptor, a timeout or the wake-up socket says so.
        case idle
    }

    /// Runs queued work, dispatches what arrived and flushes held-back messages; on the I/O thread.
    fileprivate func step() -> StepResult {
        if drainQueue() { return .stopped }
        // What libdbus read in one go (several signals under load) is dispatched as one round: observers hear of it
        // around it (the bridge sends the round's MQTT publishes with one write).
        if DBusDispatchRounds.observers.isObserved
            && dbus_connection_get_dispatch_status(connection) == DBUS_DISPATCH_DATA_REMAINS
        {
            // This round's `end` is the one an earlier request asked for: it is cleared, and asked for again there
            // if still needed (so a stream of rounds costs no extra wake-up).
            DBusDispatchRounds.emptyRoundDue.store(0, ordering: .relaxed)
            DBusDispatchRounds.observers.around { dispatchAll() }
        } else {
            dispatchAll()
        }
        if flushClientsIfIdle() { return .busy }
        return .idle
    }

    /// Marks the connection asleep unless work is queued; false when it must not sleep.
    fileprivate func prepareSleep() -> Bool {
        shared.withLock { s -> Bool in
            guard s.queue.isEmpty, !s.idleFlushRequested else { return false }
            s.sleeping = true
            return true
        }
    }

    /// The connection is awake again (its queue is looked at next).
    fileprivate func wokeUp() {
        shared.withLock { s in
            s.sleeping = false
            s.wakePending = false
        }
    }

    /// Done closing: whoever waits in `shutdown()` may go on.
    fileprivate func markExited() { exited.signal() }

    /// Runs queued work; returns true when asked to stop.
    private func drainQueue() -> Bool {
        var stopRequested = false
        for _ in 0..<8 {
            let batch = shared.withLock { s -> [IOWork] in
                // Nothing queued (most rounds): nothing allocated (removeAll(keepingCapacity:) makes a new buffer
                // while `batch` holds the old one).
                if s.queue.isEmpty { return [] }
                let batch = s.queue
                s.queue.removeAll(keepingCapacity: true)
                return batch
            }
            if batch.isEmpty { return stopRequested }
            for work in batch {
                switch work {
                case .send(let message):
                    if dbus_connection_send(connection, message.pointer, nil) == 0 {
                        // Out of memory or the connection is gone; nothing can be reported to a send().
                    }
                case .call(let message, let timeout, let pending):
                    startCall(message, timeout: timeout, pending)
                case .cancel(let pending):
                    if let handle = pending.handle {
                        pending.handle = nil
                        dbus_pending_call_cancel(handle)
                        dbus_pending_call_unref(handle)
                    }
                    shared.withLock { _ = $0.pendingCalls.removeValue(forKey: ObjectIdentifier(pending)) }
                case .perform(let body):
                    body()
                case .stop:
                    stopRequested = true
                }
            }
            releaseDeferred()
        }
        return stopRequested
    }

    private func releaseDeferred() {
        guard !deferredUnrefs.isEmpty else { return }
        let handles = deferredUnrefs
        deferredUnrefs.removeAll()
        for handle in handles { dbus_pending_call_unref(handle) }
    }

    private func startCall(_ message: CMessage, timeout: Int32, _ pending: PendingCall) {
        if pending.isCompleted { return }
        var handle: OpaquePointer? = nil
        guard dbus_connection_send_with_reply(connection, message.pointer, &handle, timeout) != 0 else {
            pending.complete(.failure(DBusError(name: DBusError.noMemory, message: "sending a method call failed")))
            return
        }
        guard let handle else {
            pending.complete(
                .failure(DBusError(name: DBusError.disconnected, message: "the D-Bus connection is closed")))
            return
        }
        pending.handle = handle
        shared.withLock { $0.pendingCalls[ObjectIdentifier(pending)] = pending }
        let context = Unmanaged.passRetained(CallContext(pending: pending, core: self)).toOpaque()
        let ok = dbus_pending_call_set_notify(
            handle,
            { handle, data in
                guard let handle, let data else { return }
                let context = Unmanaged<CallContext>.fromOpaque(data).takeUnretainedValue()
                let outcome: PendingCall.Outcome
                if let reply = dbus_pending_call_steal_reply(handle) {
                    outcome = .success(CMessage(adopting: reply))
                } else {
                    outcome = .failure(DBusError(name: DBusError.noReply, message: "no reply"))
                }
                context.core.callFinished(context.pending, outcome)
            }, context,
            { data in
                guard let data else { return }
                Unmanaged<CallContext>.fromOpaque(data).release()
            })
        if ok == 0 {
            Unmanaged<CallContext>.fromOpaque(context).release()
            dbus_pending_call_cancel(handle)
            dbus_pending_call_unref(handle)
            pending.handle = nil
            pending.complete(
                .failure(DBusError(name: DBusError.noMemory, message: "dbus_pending_call_set_notify failed")))
        }
    }

    /// A reply (or libdbus's timeout error) arrived; runs inside dispatch on the I/O thread.
    fileprivate func callFinished(_ pending: PendingCall, _ outcome: PendingCall.Outcome) {
        shared.withLock { _ = $0.pendingCalls.removeValue(forKey: ObjectIdentifier(pending)) }
        if let handle = pending.handle {
            // libdbus may still use the pending call while notifying; drop our reference afterwards.
            pending.handle = nil
            deferredUnrefs.append(handle)
        }
        pending.onIOThread?(outcome)
        pending.complete(outcome)
    }

    private func dispatchAll() {
        while dbus_connection_dispatch(connection) == DBUS_DISPATCH_DATA_REMAINS {}
        releaseDeferred()
    }

    /// Sends held-back client messages when the thread is about to idle; true if anything was queued.
    private func flushClientsIfIdle() -> Bool {
        shared.withLock { s -> Bool in
            s.idleFlushRequested = false
            guard s.connected, !s.stopping else { return false }
            var any = false
            for id in s.clientOrder {
                if let client = s.clients[id] {
                    for message in client.takePendingMessages() {
                        s.queue.append(.send(message))
                        any = true
                    }
                }
            }
            return any
        }
    }

    /// Signals dispatched since the loop last asked (`takeGathering`); I/O thread only.
    private var signalled = 0

    /// For the loop's gathering of signals under load (`IOLoop.gatherMilliseconds`): nil when no signal was dispatched
    /// since the last call, otherwise whether this connection may wait for more before its next read: no reply is
    /// awaited (a caller's reply does not wait) and its socket has no backlog (one that reading cannot keep up with
    /// is read at once). I/O thread.
    fileprivate func takeGathering() -> (signals: Int, mayWait: Bool)? {
        guard signalled > 0 else { return nil }
        defer { signalled = 0 }
        if shared.withLock({ !$0.pendingCalls.isEmpty }) { return (signalled, false) }
        var fd: Int32 = -1
        guard dbus_connection_get_socket(connection, &fd) != 0, fd >= 0 else { return (signalled, false) }
        let waiting = clinux_readable_bytes(fd)
        return (signalled, waiting >= 0 && waiting <= IOLoop.gatherBacklog)
    }

    fileprivate static func now() -> Int64 {
        var ts = timespec()
        clock_gettime(CLOCK_MONOTONIC, &ts)
        return Int64(ts.tv_sec) * 1000 + Int64(ts.tv_nsec) / 1_000_000
    }

    // MARK: the loop's epoll set (I/O thread)

    /// The loop's epoll set, and this connection's place in the loop (`IOLoop.token`); -1 when not (or no longer)
    /// registered.
    private var epoll: Int32 = -1
    fileprivate var slot = 0
    /// The descriptors this connection has in the epoll set, with the events registered for each: its wake-up
    /// socket, and the union of its enabled watches on each watched descriptor (libdbus watches one socket twice,
    /// for reading and for writing; epoll takes a descriptor once).
    private var registered: [(fd: Int32, events: UInt32)] = []
    /// Watched descriptors that epoll refused: reported to their watches as an error by `reportUnpollable`.
    private var unpollable: [Int32] = []

    /// Joins the loop's epoll set under `slot` (its wake-up socket at once, watches as libdbus adds them).
    fileprivate func attach(epoll: Int32, slot: Int) {
        self.epoll = epoll
        self.slot = slot
        register(wakeFD, events: UInt32(EPOLLIN.rawValue))
    }

    /// Leaves the epoll set (before the connection closes its socket): nothing of it is reported from now on.
    fileprivate func detach() {
        guard epoll >= 0 else { return }
        for entry in registered { _ = epoll_ctl(epoll, EPOLL_CTL_DEL, entry.fd, nil) }
        registered.removeAll()
        epoll = -1
    }

    /// Sets the events registered for `fd` (0: out of the set).
    private func register(_ fd: Int32, events: UInt32) {
        guard epoll >= 0, fd >= 0 else { return }
        let index = registered.firstIndex { $0.fd == fd }
        if let index, registered[index].events == events { return }
        if events == 0 {
            if let index {
                _ = epoll_ctl(epoll, EPOLL_CTL_DEL, fd, nil)
                registered.remove(at: index)
            }
            return
        }
        var event = epoll_event()
        event.events = events
        event.data.u64 = IOLoop.token(slot: slot, fd: fd)
        var rc = epoll_ctl(epoll, index == nil ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, fd, &event)
        // The kernel's view differs from ours: the descriptor was closed and its number reused (dropped from the set
        // without a word), or it is still there under an earlier registration.
        if rc < 0, errno == EEXIST {
            rc = epoll_ctl(epoll, EPOLL_CTL_MOD, fd, &event)
        } else if rc < 0, errno == ENOENT {
            rc = epoll_ctl(epoll, EPOLL_CTL_ADD, fd, &event)
        }
        if rc == 0 {
            if let index { registered[index].events = events } else { registered.append((fd, events)) }
        } else {
            if let index { registered.remove(at: index) }
            if fd != wakeFD, !unpollable.contains(fd) { unpollable.append(fd) }
        }
    }

    /// Registers what the enabled watches on `fd` wait for.
    private func syncWatches(_ fd: Int32) {
        var events: UInt32 = 0
        for watch in watches where watch.fd == fd && watch.enabled {
            if watch.flags & DBUS_WATCH_READABLE.rawValue != 0 { events |= UInt32(EPOLLIN.rawValue) }
            if watch.flags & DBUS_WATCH_WRITABLE.rawValue != 0 { events |= UInt32(EPOLLOUT.rawValue) }
        }
        register(fd, events: events)
    }

    /// Handles what epoll reported for one of this connection's descriptors.
    fileprivate func handleReady(fd: Int32, events: UInt32) {
        if fd == wakeFD {
            clinux_drain_wake_socket(wakeFD)
            return
        }
        handleWatches(fd: fd, events: events)
    }

    private func handleWatches(fd: Int32, events: UInt32) {
        // Handling one watch may remove or disable the other (libdbus frees a removed watch): each is looked up
        // again before it is handled. `snapshot` shares the list's storage (copied only if a handler changes it).
        let snapshot = watches
        for candidate in snapshot where candidate.fd == fd && candidate.enabled {
            let pointer = candidate.pointer
            guard let watch = watches.first(where: { $0.pointer == pointer && $0.enabled }) else { continue }
            var flags: UInt32 = 0
            if events & UInt32(EPOLLIN.rawValue) != 0, watch.flags & DBUS_WATCH_READABLE.rawValue != 0 {
                flags |= DBUS_WATCH_READABLE.rawValue
            }
            if events & UInt32(EPOLLOUT.rawValue) != 0, watch.flags & DBUS_WATCH_WRITABLE.rawValue != 0 {
                flags |= DBUS_WATCH_WRITABLE.rawValue
            }
            if events & UInt32(EPOLLERR.rawValue) != 0 { flags |= DBUS_WATCH_ERROR.rawValue }
            if events & UInt32(EPOLLHUP.rawValue) != 0 { flags |= DBUS_WATCH_HANGUP.rawValue }
            guard flags != 0 else { continue }
            _ = dbus_watch_handle(pointer, flags)
        }
    }

    /// Tells the watches of descriptors epoll refused that their descriptor failed (libdbus then drops the
    /// connection: a socket that cannot be waited for cannot be used); outside libdbus's callbacks.
    fileprivate func reportUnpollable() {
        guard !unpollable.isEmpty else { return }
        let fds = unpollable
        unpollable.removeAll()
        for fd in fds {
            handleWatches(fd: fd, events: UInt32(EPOLLERR.rawValue) | UInt32(EPOLLHUP.rawValue))
        }
    }

    /// When the next enabled libdbus timeout is due (`Int64.max`: none).
    fileprivate var nextDeadline: Int64 {
        var next = Int64.max
        for timeout in timeouts where timeout.enabled && timeout.deadline < next { next = timeout.deadline }
        return next
    }

    /// Runs the timeouts due at `now`.
    fileprivate func runDueTimeouts(now: Int64) {
        guard timeouts.contains(where: { $0.enabled && $0.deadline <= now }) else { return }
        let due = timeouts.filter { $0.enabled && $0.deadline <= now }.map(\.pointer)
        for pointer in due {
            guard let index = timeouts.firstIndex(where: { $0.pointer == pointer }), timeouts[index].enabled else {
                continue
            }
            timeouts[index].deadline = now + timeouts[index].interval
            _ = dbus_timeout_handle(pointer)
        }
    }

    /// I/O-thread-only: the connection is in the loop's run list (its round, `step`, runs every time round). It
    /// leaves it when it goes to sleep (`prepareSleep`) and comes back when epoll reports one of its descriptors or
    /// one of its timeouts is due: work queued meanwhile wakes it through its wake-up socket. With a connection per
    /// peripheral, a loop that looked at every connection at every wake-up spent most of its CPU on the idle ones.
    fileprivate var inRun = false

    /// While stopping: until when the loop goes on polling this connection so that what is still queued gets
    /// written (never hanging on a stuck bus, and never holding up the other connections meanwhile).
    fileprivate var flushDeadline: Int64?

    /// True once nothing more can or needs to be written before closing.
    fileprivate var isFlushed: Bool {
        dbus_connection_get_is_connected(connection) == 0 || dbus_connection_has_messages_to_send(connection) == 0
    }

    /// Closes the connection (after the loop flushed what it could, see `flushDeadline`) and fails what is left.
    fileprivate func finishShutdown() {
        dbus_connection_close(connection)
        dispatchAll()
        markDisconnected()
        let calls = shared.withLock { s in
            let calls = Array(s.pendingCalls.values)
            s.pendingCalls.removeAll()
            return calls
        }
        for call in calls {
            if let handle = call.handle {
                call.handle = nil
                dbus_pending_call_cancel(handle)
                dbus_pending_call_unref(handle)
            }
        }
        releaseDeferred()
        let leftover = shared.withLock { s -> [IOWork] in
            s.threadExited = true
            let q = s.queue
            s.queue = []
            return q
        }
        for work in leftover {
            if case .call(_, _, let pending) = work {
                pending.complete(
                    .failure(DBusError(name: DBusError.disconnected, message: "the D-Bus connection was closed")))
            }
        }
        dbus_connection_unref(connection)
    }

    /// Marks the connection lost: wakes waiters, ends streams, fails calls that are still waiting.
    private func markDisconnected() {
        let (waiters, subscriptions, calls) = shared.withLock { s in
            s.connected = false
            let waiters = Array(s.disconnectWaiters.values)
            s.disconnectWaiters.removeAll()
            let subscriptions = Array(s.subscriptions.values)
            s.subscriptions.removeAll()
            // Calls stay in the table so their libdbus handles are released at shutdown.
            return (waiters, subscriptions, Array(s.pendingCalls.values))
        }
        for call in calls {
            call.complete(.failure(DBusError(name: DBusError.disconnected, message: "the D-Bus connection was lost")))
        }
        for subscription in subscriptions { subscription.finish() }
        for waiter in waiters { waiter.resume() }
    }

    // MARK: libdbus callbacks (I/O thread)

    private func addWatch(_ watch: OpaquePointer) {
        let fd = dbus_watch_get_unix_fd(watch)
        watches.append(
            Watch(pointer: watch, fd: fd, flags: dbus_watch_get_flags(watch), enabled: dbus_watch_get_enabled(watch) != 0))
        syncWatches(fd)
    }

    private func removeWatch(_ watch: OpaquePointer) {
        guard let index = watches.firstIndex(where: { $0.pointer == watch }) else { return }
        let fd = watches[index].fd
        watches.remove(at: index)
        syncWatches(fd)
    }

    private func toggleWatch(_ watch: OpaquePointer) {
        if let index = watches.firstIndex(where: { $0.pointer == watch }) {
            watches[index].enabled = dbus_watch_get_enabled(watch) != 0
            watches[index].flags = dbus_watch_get_flags(watch)
            syncWatches(watches[index].fd)
        }
    }

    private func addTimeout(_ timeout: OpaquePointer) {
        let interval = Int64(dbus_timeout_get_interval(timeout))
        timeouts.append(
            Timeout(
                pointer: timeout, interval: interval, enabled: dbus_timeout_get_enabled(timeout) != 0,
                deadline: ConnectionCore.now() + interval))
    }

    private func removeTimeout(_ timeout: OpaquePointer) {
        timeouts.removeAll { $0.pointer == timeout }
    }

    private func toggleTimeout(_ timeout: OpaquePointer) {
        if let index = timeouts.firstIndex(where: { $0.pointer == timeout }) {
            let interval = Int64(dbus_timeout_get_interval(timeout))
            timeouts[index].interval = interval
            timeouts[index].enabled = dbus_timeout_get_enabled(timeout) != 0
            timeouts[index].deadline = ConnectionCore.now() + interval
        }
    }

    private func filter(_ pointer: OpaquePointer) -> DBusHandlerResult {
        let type = dbus_message_get_type(pointer)
        if type == DBUS_MESSAGE_TYPE_SIGNAL {
            signalled &+= 1
            if dbus_message_is_signal(pointer, "org.freedesktop.DBus.Local", "Disconnected") != 0 {
                markDisconnected()
                return DBUS_HANDLER_RESULT_HANDLED
            }
            let subscriptions = shared.withLock { $0.subscriptionList }
            // Decoded once, and only when a subscription whose header fields match needs the value (or its rule
            // needs the arguments): a signal only in-place readers want is never decoded.
            var decoded: DBusMessage?? = nil
            for subscription in subscriptions {
                guard subscription.matchesHeader(pointer) else { continue }
                if let view = subscription.deliverView, subscription.headerOnly {
                    view(DBusSignalView(pointer))
                    continue
                }
                if decoded == nil { decoded = .some(try? Marshal.decode(pointer)) }
                guard let message = decoded ?? nil, subscription.rule.matches(message) else { continue }
                if let view = subscription.deliverView {
                    view(DBusSignalView(pointer))
                } else {
                    subscription.deliver(message)
                }
            }
            return DBUS_HANDLER_RESULT_HANDLED
        }
        if type == DBUS_MESSAGE_TYPE_METHOD_CALL {
            let clients = shared.withLock { s in s.clientOrder.compactMap { s.clients[$0] } }
            guard !clients.isEmpty else { return DBUS_HANDLER_RESULT_NOT_YET_HANDLED }
            let message = CMessage(retaining: pointer)
            guard let decoded = try? Marshal.decode(pointer) else { return DBUS_HANDLER_RESULT_NOT_YET_HANDLED }
            for client in clients where client.handleMethodCall(message, decoded: decoded) {
                return DBUS_HANDLER_RESULT_HANDLED
            }
            if clients[0].handleUnclaimedMethodCall(message, decoded: decoded) { return DBUS_HANDLER_RESULT_HANDLED }
            return DBUS_HANDLER_RESULT_NOT_YET_HANDLED
        }
        return DBUS_HANDLER_RESULT_NOT_YET_HANDLED
    }
}

/// The userdata of a libdbus pending-call notification.
final class CallContext {
    let pending: PendingCall
    unowned let core: ConnectionCore
    init(pending: PendingCall, core: ConnectionCore) {
        self.pending = pending
        self.core = core
    }
}

/// The one I/O thread of the process: it runs every connection's queued work, dispatch and flushes, then sleeps
/// in one epoll wait over all their descriptors. Connections join with `add` and leave when they stop. Each round
/// costs what the connections that have something to do cost: a connection that went to sleep is not looked at
/// again until epoll reports one of its descriptors (its wake-up socket when work is queued for it) or one of its
/// timeouts is due.
final class IOLoop: Sendable {
    /// The loop every connection uses; its thread starts with the first connection.
    static let shared = IOLoop()

    private struct State {
        var adding: [ConnectionCore] = []
        var thread: pthread_t?
        var wakeRead: Int32 = -1
        var wakeWrite: Int32 = -1
        var epoll: Int32 = -1
    }
    private let state = Mutex(State())

    private init() {}

    /// What an epoll event carries: the connection's slot in the loop and the descriptor.
    static func token(slot: Int, fd: Int32) -> UInt64 { UInt64(slot) << 32 | UInt64(UInt32(bitPattern: fd)) }
    /// The loop's own wake-up socket.
    private static let loopToken = UInt64.max

    /// Adds a connection (its libdbus callbacks are set on the I/O thread, before anything else runs for it).
    /// Returns the I/O thread.
    /// - Throws: `DBusError` when the thread, its epoll set or its wake-up socket cannot be created.
    func add(_ core: ConnectionCore) throws(DBusError) -> pthread_t {
        let result = state.withLock { s -> Result<(pthread_t, Int32), DBusError> in
            if s.thread == nil {
                if let error = Self.startThread(&s, self) { return .failure(error) }
            }
            guard let thread = s.thread else {
                return .failure(DBusError(name: DBusError.failed, message: "could not start the D-Bus I/O thread"))
            }
            s.adding.append(core)
            return .success((thread, s.wakeWrite))
        }
        switch result {
        case .failure(let error): throw error
        case .success(let (thread, wake)):
            clinux_poke_wake_socket(wake)
            return thread
        }
    }

    /// Wakes the loop from another thread, so that it looks again at when to wake next (an empty round asked for
    /// while it slept without a timeout). On the loop's own thread there is nothing to do: it looks after this round.
    func wakeUnlessOnLoop() {
        let wake = state.withLock { s -> Int32? in
            guard let thread = s.thread, pthread_equal(thread, pthread_self()) == 0 else { return nil }
            return s.wakeWrite
        }
        guard let wake, wake >= 0 else { return }
        clinux_poke_wake_socket(wake)
    }

    private static func startThread(_ s: inout State, _ loop: IOLoop) -> DBusError? {
        var fds: [Int32] = [-1, -1]
        let type = Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | Int32(SOCK_NONBLOCK.rawValue)
        guard socketpair(AF_UNIX, type, 0, &fds) == 0 else {
            return DBusError(
                name: DBusError.failed,
                message: "cannot create the D-Bus I/O thread's wake-up pipe: \(String(cString: strerror(errno)))")
        }
        let epoll = epoll_create1(Int32(EPOLL_CLOEXEC))
        var event = epoll_event()
        event.events = UInt32(EPOLLIN.rawValue)
        event.data.u64 = loopToken
        guard epoll >= 0, epoll_ctl(epoll, EPOLL_CTL_ADD, fds[0], &event) == 0 else {
            let reason = String(cString: strerror(errno))
            if epoll >= 0 { Glibc.close(epoll) }
            Glibc.close(fds[0])
            Glibc.close(fds[1])
            return DBusError(name: DBusError.failed, message: "cannot create the D-Bus I/O thread's epoll set: \(reason)")
        }
        var attributes = pthread_attr_t()
        pthread_attr_init(&attributes)
        pthread_attr_setdetachstate(&attributes, Int32(PTHREAD_CREATE_DETACHED))
        defer { pthread_attr_destroy(&attributes) }
        let context = Unmanaged.passRetained(loop).toOpaque()
        var tid = pthread_t()
        let rc = pthread_create(
            &tid, &attributes,
            { raw in
                guard let raw else { return nil }
                Unmanaged<IOLoop>.fromOpaque(raw).takeRetainedValue().run()
                return nil
            }, context)
        guard rc == 0 else {
            Unmanaged<IOLoop>.fromOpaque(context).release()
            Glibc.close(epoll)
            Glibc.close(fds[0])
            Glibc.close(fds[1])
            return DBusError(name: DBusError.failed, message: "could not start the D-Bus I/O thread: error \(rc)")
        }
        s.thread = tid
        s.wakeRead = fds[0]
        s.wakeWrite = fds[1]
        s.epoll = epoll
        return nil
    }

    /// How long the loop lets signals gather before it reads again, under load: one wake-up, one read and one
    /// dispatch round for the signals of that interval instead of one each. Replies do not wait (no gathering while
    /// a call is outstanding), and work queued from other threads ends the pause (it waits on the wake-up sockets),
    /// so only signals wait: at most this long, which is within a BLE connection interval (7.5 ms to 4 s; sensors
    /// mostly use 30 to 100 ms). Measured 2026-12-06 with advertisers whose events are spread in time as a radio's
    /// are (bench/adverts.sh, the BlueZ layer against the bare libdbus client): 4 ms -> 16 ms took 50 RuuviTags
    /// every 100 ms from 1.44-1.55x to 0.82-0.86x and 10 StartNotify devices at 50 Hz from 1.02-1.37x to 0.63-0.66x;
    /// with the simulator's former lockstep bursts, 50 RuuviTags 1.31-1.40x -> 1.31-1.36x (the bursts already gather).
    static let gatherMilliseconds: Int32 = 16

    /// Bytes waiting on a connection's socket above which it is read at once rather than left to gather: more than
    /// one gathering of a heavy stream (libdbus reads about 2 to 4 KiB per wake-up).
    static let gatherBacklog: Int32 = 2048

    /// When the loop counts as under load: the previous round that dispatched signals ended less than two
    /// gathering intervals before this one (a stream of more than about 30 signals a second). A lone signal after
    /// a quiet spell is read at once and dispatched without waiting. I/O thread only.
    private struct SignalLoad {
        var lastRound: UInt64 = 0
        /// The last pause's length (ms): rounds after a longer pause are that much further apart.
        var lastPause: Int32 = IOLoop.gatherMilliseconds

        /// Notes a round that dispatched signals at `now` (ns); true when the loop is under load.
        mutating func round(at now: UInt64) -> Bool {
            defer { lastRound = now }
            let interval = UInt64(max(IOLoop.gatherMilliseconds, lastPause)) * 1_000_000
            return lastRound != 0 && now &- lastRound < 2 * interval
        }
    }

    /// Before the loop sleeps: pauses up to `gatherMilliseconds` (and not past `deadline`, ms) when the round just
    /// done dispatched signals under load and every connection that dispatched them may wait (`takeGathering`).
    /// The pause waits on the wake-up sockets (`wakeFDs`: the loop's and every connection's), so work another
    /// thread queues meanwhile ends it. Returns true when it paused.
    private func gatherPause(
        _ slots: [ConnectionCore?], _ load: inout SignalLoad, wakeFDs: inout [pollfd], until deadline: Int64,
        now: Int64
    ) -> Bool {
        var signals = 0
        var mayWait = true
        for case let core? in slots {
            guard let taken = core.takeGathering() else { continue }
            signals += taken.signals
            if !taken.mayWait { mayWait = false }
        }
        // Taken whatever happens next: a request is for the pause after the round that made it.
        let requested = DBusDispatchRounds.gatheringRequest.exchange(0, ordering: .relaxed)
        guard signals > 0 else { return false }
        let underLoad = load.round(at: UInt64(clinux_monotonic_ns()))
        guard mayWait, underLoad else { return false }
        let interval = requested > 0 ? requested : Self.gatherMilliseconds
        load.lastPause = interval
        let left = deadline == .max ? Int64(interval) : max(0, deadline - now)
        let pause = Int32(min(Int64(interval), left))
        guard pause > 0 else { return false }
        // The loop's own wake-up socket is first; the connections' follow (rebuilt each time: a few entries).
        wakeFDs.removeSubrange(1...)
        for case let core? in slots { wakeFDs.append(pollfd(fd: core.wakeFD, events: Int16(POLLIN), revents: 0)) }
        let count = nfds_t(wakeFDs.count)
        _ = wakeFDs.withUnsafeMutableBufferPointer { poll($0.baseAddress, count, pause) }
        return true
    }

    /// The thread: runs for the life of the process.
    private func run() {
        clinux_name_thread("dbus-io")
        let (wakeRead, epoll) = state.withLock { ($0.wakeRead, $0.epoll) }
        // Every connection by slot (the slot is in its epoll tokens), with when its next libdbus timeout is due
        // (`Int64.max`: none). libdbus changes a connection's timeouts only from calls the loop makes for that
        // connection (its round, its descriptors, its timeouts), so this is updated after each of them.
        var slots: [ConnectionCore?] = []
        var deadlines: [Int64] = []
        var freeSlots: [Int] = []
        // The connections whose round runs every time round (awake), and those closing (see `flushDeadline`).
        var running: [ConnectionCore] = []
        var stopping: [ConnectionCore] = []
        var ready = [epoll_event](repeating: epoll_event(), count: 256)
        var roundsWithoutWait = 0
        var signalLoad = SignalLoad()
        var wakeFDs = [pollfd(fd: wakeRead, events: Int16(POLLIN), revents: 0)]
        // Puts a connection that epoll (or a timeout) reported back into the run list.
        func wake(_ core: ConnectionCore) {
            guard core.flushDeadline == nil, !core.inRun else { return }
            core.wokeUp()
            core.inRun = true
            running.append(core)
        }
        while true {
            let added = state.withLock { s -> [ConnectionCore] in
                defer { s.adding = [] }
                return s.adding
            }
            for core in added {
                let slot: Int
                if let free = freeSlots.popLast() {
                    slot = free
                    slots[slot] = core
                } else {
                    slot = slots.count
                    slots.append(core)
                    deadlines.append(.max)
                }
                core.attach(epoll: epoll, slot: slot)
                core.setUp()
                core.reportUnpollable()
                deadlines[slot] = core.nextDeadline
                core.inRun = true
                running.append(core)
            }
            var busy = false
            var index = 0
            while index < running.count {
                let core = running[index]
                switch core.step() {
                case .stopped:
                    // Looked at again right away: most connections have nothing left to write.
                    core.flushDeadline = ConnectionCore.now() + 1000
                    core.inRun = false
                    running.remove(at: index)
                    stopping.append(core)
                    deadlines[core.slot] = core.nextDeadline
                    continue
                case .busy:
                    busy = true
                case .idle:
                    break
                }
                core.reportUnpollable()
                deadlines[core.slot] = core.nextDeadline
                index += 1
            }
            // After their last round: closed as soon as written out (most have nothing left), or after about a
            // second.
            if !stopping.isEmpty {
                let now = ConnectionCore.now()
                var index = 0
                while index < stopping.count {
                    let core = stopping[index]
                    // Stopping: close once written out, or after at most about a second.
                    guard core.isFlushed || now >= (core.flushDeadline ?? 0) else {
                        index += 1
                        continue
                    }
                    stopping.remove(at: index)
                    core.detach()
                    slots[core.slot] = nil
                    deadlines[core.slot] = .max
                    freeSlots.append(core.slot)
                    core.finishShutdown()
                    core.markExited()
                }
            }
            // Connections that go to sleep leave the run list: work queued for them from now on writes to their
            // wake-up socket. One that may not sleep yet (work came in) keeps the loop from waiting, and it goes
            // round again at once; but every few rounds the loop still looks (without waiting) at what epoll has
            // for the sleeping ones, so that one busy connection cannot hold the others up.
            var asleep = !busy
            if asleep {
                running.removeAll { core in
                    guard core.prepareSleep() else { return false }
                    core.inRun = false
                    return true
                }
                asleep = running.isEmpty
            }
            if !asleep, roundsWithoutWait < 8 {
                roundsWithoutWait += 1
                continue
            }
            roundsWithoutWait = 0
            let now = ConnectionCore.now()
            var next = Int64.max
            for deadline in deadlines where deadline < next { next = deadline }
            for core in stopping { next = min(next, core.flushDeadline ?? next) }
            let emptyRoundDue = DBusDispatchRounds.emptyRoundDue.load(ordering: .relaxed)
            if emptyRoundDue > 0 { next = min(next, emptyRoundDue) }
            var woke = now
            if asleep, gatherPause(slots, &signalLoad, wakeFDs: &wakeFDs, until: next, now: now) {
                woke = ConnectionCore.now()
            }
            var timeoutMs = next == .max ? -1 : Int32(min(max(0, next - woke), Int64(Int32.max)))
            if !asleep { timeoutMs = 0 }
            let capacity = Int32(ready.count)
            let n = ready.withUnsafeMutableBufferPointer { epoll_wait(epoll, $0.baseAddress, capacity, timeoutMs) }
            if n < 0 {
                // Interrupted: round again. Failed otherwise (it cannot, with a valid set): every connection runs,
                // as if woken.
                if errno != EINTR { for case let core? in slots { wake(core) } }
                continue
            }
            for i in 0..<Int(n) {
                let token = ready[i].data.u64
                if token == Self.loopToken {
                    clinux_drain_wake_socket(wakeRead)
                    continue
                }
                let slot = Int(token >> 32)
                guard slot < slots.count, let core = slots[slot] else { continue }
                wake(core)
                core.handleReady(fd: Int32(bitPattern: UInt32(truncatingIfNeeded: token)), events: ready[i].events)
                deadlines[slot] = core.nextDeadline
            }
            let after = ConnectionCore.now()
            if next <= after {
                for slot in deadlines.indices where deadlines[slot] <= after {
                    guard let core = slots[slot] else { continue }
                    wake(core)
                    core.runDueTimeouts(now: after)
                    deadlines[slot] = core.nextDeadline
                }
            }
            if emptyRoundDue > 0, after >= emptyRoundDue {
                // Cleared first: an observer may ask for the next one from its `end`.
                _ = DBusDispatchRounds.emptyRoundDue.compareExchange(
                    expected: emptyRoundDue, desired: 0, ordering: .relaxed)
                DBusDispatchRounds.observers.around {}
            }
        }
    }
}

/// Observers of rounds of work on one thread (D-Bus dispatch here, notification delivery in the BlueZ layer): each
/// hears `begin` before and `end` after a round, on that thread, so that what is done per message can be batched per
/// round. Adding and removing are rare; `around` is on the hot path and neither allocates nor takes more than one
/// uncontended lock (none when nobody observes).
public final class RoundObservers: Sendable {
    /// Called around each round; both must be quick and must not block.
    public struct Observer: Sendable {
        /// Called before each round.
        public let begin: @Sendable () -> Void
        /// Called after each round.
        public let end: @Sendable () -> Void

        /// An observer calling `begin` before and `end` after each round.
        public init(begin: @escaping @Sendable () -> Void, end: @escaping @Sendable () -> Void) {
            self.begin = begin
            self.end = end
        }
    }

    private struct Registry {
        var byToken: [Int: Observer] = [:]
        /// `byToken`'s observers, rebuilt when one comes or goes: a round reads it without copying.
        var list: [Observer] = []
        var nextToken = 0
    }
    private let registry = Mutex(Registry())
    private let count = Atomic<Int>(0)

    public init() {}

    /// Registers an observer; the returned token removes it.
    public func add(_ observer: Observer) -> Int {
        registry.withLock { r in
            r.nextToken += 1
            r.byToken[r.nextToken] = observer
            r.list = Array(r.byToken.values)
            count.store(r.list.count, ordering: .releasing)
            return r.nextToken
        }
    }

    /// Removes the observer `add` returned `token` for.
    public func remove(_ token: Int) {
        registry.withLock { r in
            guard r.byToken.removeValue(forKey: token) != nil else { return }
            r.list = Array(r.byToken.values)
            count.store(r.list.count, ordering: .releasing)
        }
    }

    /// True when anybody observes (one atomic load).
    public var isObserved: Bool { count.load(ordering: .acquiring) > 0 }

    /// Runs `round` between the observers' `begin` and `end` (just `round` when nobody observes).
    public func around<T>(_ round: () -> T) -> T {
        guard isObserved else { return round() }
        let observers = registry.withLock { $0.list }
        for o in observers { o.begin() }
        defer { for o in observers { o.end() } }
        return round()
    }
}

/// Rounds of dispatch on the D-Bus I/O thread: each time a connection dispatches what libdbus read in one go
/// (several signals under load), observers hear `begin` before and `end` after, on that thread, so that what the
/// handlers do per message can be batched per round. Both must be quick and must not block.
public enum DBusDispatchRounds {
    /// Called around each round.
    public typealias Observer = RoundObservers.Observer

    static let observers = RoundObservers()

    /// Registers an observer; the returned token removes it.
    public static func observe(_ observer: Observer) -> Int { observers.add(observer) }

    /// Removes the observer `observe` returned `token` for.
    public static func stopObserving(_ token: Int) { observers.remove(token) }

    /// When the loop is to run an empty round (monotonic ms; 0: not asked for).
    static let emptyRoundDue = Atomic<Int64>(0)

    /// Asks that the observers hear `end` again within about `milliseconds`: at the next round if one comes by
    /// then, otherwise in an empty round (`begin` then `end`, nothing dispatched in between). For an observer that
    /// keeps what a round did for a while (to batch it with the next rounds) and must hear again once that while is
    /// over; a round clears the request, and the observer asks again from its `end` if it still needs to. The
    /// earliest request stands.
    public static func requestEmptyRound(afterMilliseconds milliseconds: Int) {
        let due = ConnectionCore.now() + Int64(max(0, milliseconds))
        var current = emptyRoundDue.load(ordering: .relaxed)
        while current == 0 || due < current {
            let (exchanged, original) = emptyRoundDue.compareExchange(
                expected: current, desired: due, ordering: .relaxed)
            if exchanged { break }
            current = original
        }
        IOLoop.shared.wakeUnlessOnLoop()
    }

    /// The gathering the next pause asked for (ms; 0: the loop's own, `IOLoop.gatherMilliseconds`).
    static let gatheringRequest = Atomic<Int32>(0)

    /// Asks that the loop's next pause under load (see `IOLoop.gatherMilliseconds`) last up to `milliseconds` (at
    /// most 64) instead of 16: for an observer whose round carried only what may wait longer (the bridge's
    /// advertisements, whose publishes it holds for up to 50 ms anyway). From `end`, on the I/O thread; it applies
    /// to the pause that follows that round only, so a round that carries anything else gets the short one.
    public static func requestLongerGathering(milliseconds: Int) {
        gatheringRequest.store(Int32(min(max(0, milliseconds), 64)), ordering: .relaxed)
    }
}
