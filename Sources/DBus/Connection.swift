// The public connection: opening private bus connections, calls, signals, names.
internal import CDBus
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Which bus to connect to.
public enum DBusBus: Sendable {
    /// The system bus (`DBUS_SYSTEM_BUS_ADDRESS` when set).
    case system
    /// The session bus (`DBUS_SESSION_BUS_ADDRESS`).
    case session
    /// A bus at an explicit address such as `unix:path=/run/dbus/system_bus_socket`.
    case address(String)
}

/// Flags for `RequestName`.
public struct DBusRequestNameFlags: OptionSet, Sendable, Hashable {
    /// The flag bits as sent to `RequestName`.
    public let rawValue: UInt32
    /// Flags from their bits.
    public init(rawValue: UInt32) { self.rawValue = rawValue }
    /// Let another connection take the name over.
    public static let allowReplacement = DBusRequestNameFlags(rawValue: 1)
    /// Take the name from its current owner if it allows replacement.
    public static let replaceExisting = DBusRequestNameFlags(rawValue: 2)
    /// Fail instead of waiting in the queue.
    public static let doNotQueue = DBusRequestNameFlags(rawValue: 4)
}

/// The answer to `RequestName`.
public enum DBusRequestNameReply: UInt32, Sendable, Hashable {
    /// This connection now owns the name.
    case primaryOwner = 1
    /// Someone else owns it; this connection waits in the queue.
    case inQueue = 2
    /// Someone else owns it and `doNotQueue` was given.
    case exists = 3
    /// This connection already owned it.
    case alreadyOwner = 4
}

private let threadsInitialised: Bool = {
    dbus_threads_init_default() != 0
}()

/// A private connection to a message bus with its own I/O thread.
///
/// Every libdbus call runs on that thread; messages sent from any thread are queued and written as soon as it
/// wakes. Losing the bus never exits the process: it is reported through ``isConnected`` and
/// ``waitUntilDisconnected()``. ``close()`` (also run by `deinit`) stops and joins the thread.
public final class DBusConnection: Sendable {
    let core: ConnectionCore
    /// This connection's unique name on the bus (`:1.42`).
    public let uniqueName: String
    /// True when unix fds can be sent on this connection (negotiated during authentication).
    public let canPassUnixFDs: Bool

    /// Opens a *private* connection, registers with the bus (`Hello`), negotiates unix-fd passing and starts
    /// the I/O thread. Blocks while connecting.
    /// - Throws: ``DBusError`` when the bus cannot be reached or refuses the connection.
    public init(_ bus: DBusBus) throws(DBusError) {
        guard threadsInitialised else {
            throw DBusError(name: DBusError.noMemory, message: "dbus_threads_init_default failed")
        }
        var error = CDBus.DBusError.make()
        let pointer: OpaquePointer
        // The environment is read on every connect (libdbus's own bus lookup caches it for the process).
        let address: String?
        switch bus {
        case .system:
            address =
                DBusConnection.environment("DBUS_SYSTEM_BUS_ADDRESS") ?? "unix:path=/var/run/dbus/system_bus_socket"
        case .session:
            address = DBusConnection.environment("DBUS_SESSION_BUS_ADDRESS")
        case .address(let explicit):
            address = explicit
        }
        if let address {
            guard !address.isEmpty, !address.utf8.contains(0) else {
                throw DBusError(name: DBusError.invalidArgs, message: "invalid D-Bus address \"\(address)\"")
            }
            guard let opened = dbus_connection_open_private(address, &error) else {
                throw DBusError.consume(&error, context: "connecting to \(address)")
            }
            pointer = opened
            dbus_connection_set_exit_on_disconnect(pointer, 0)
            do throws(DBusError) {
                try Self.register(pointer, address: address)
            } catch {
                dbus_connection_close(pointer)
                dbus_connection_unref(pointer)
                throw error
            }
        } else {
            // No DBUS_SESSION_BUS_ADDRESS: let libdbus find the session bus (XDG_RUNTIME_DIR, autolaunch).
            guard let opened = dbus_bus_get_private(DBUS_BUS_SESSION, &error) else {
                throw DBusError.consume(&error, context: "connecting to the session bus")
            }
            pointer = opened
            dbus_connection_set_exit_on_disconnect(pointer, 0)
        }
        // Generous limits so bursts of signals are buffered rather than throttled.
        dbus_connection_set_max_received_size(pointer, 1 << 30)
        dbus_connection_set_max_message_size(pointer, 128 << 20)
        dbus_connection_set_max_received_unix_fds(pointer, 1 << 16)
        // Descriptors in one message: libdbus allocates room for that many in every connection before its first
        // read (4 KB at 1,024, and the BlueZ client has a connection per connected device). The system bus
        // forwards at most 16 per message (dbus-daemon's default max_message_unix_fds); bluetoothd sends one.
        dbus_connection_set_max_message_unix_fds(pointer, 16)
        uniqueName = dbus_bus_get_unique_name(pointer).map { String(cString: $0) } ?? ""
        canPassUnixFDs = dbus_connection_can_send_type(pointer, TypeCode.unixFD) != 0
        let core: ConnectionCore
        do {
            core = try ConnectionCore(connection: pointer)
            try core.start()
        } catch {
            dbus_connection_close(pointer)
            dbus_connection_unref(pointer)
            throw error
        }
        self.core = core
    }

    deinit { core.shutdown() }

    /// Says `Hello` to the bus and records the unique name it assigns, as `dbus_bus_register` does, but without
    /// holding libdbus's process-wide bus lock while waiting: libdbus 1.14 keeps that lock across the blocking
    /// `Hello`, so one bus slow to answer would stall every other connection being opened in the process.
    private static func register(_ pointer: OpaquePointer, address: String) throws(DBusError) {
        let context = "registering on the bus at \(address)"
        guard
            let hello = dbus_message_new_method_call(
                "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus", "Hello")
        else {
            throw DBusError(name: DBusError.noMemory, message: "\(context): out of memory")
        }
        defer { dbus_message_unref(hello) }
        var error = CDBus.DBusError.make()
        guard let reply = dbus_connection_send_with_reply_and_block(pointer, hello, 25_000, &error) else {
            throw DBusError.consume(&error, context: context)
        }
        defer { dbus_message_unref(reply) }
        let body = try Marshal.decodeBody(reply)
        guard let name = body.first?.string, name.hasPrefix(":") else {
            throw DBusError(name: DBusError.failed, message: "\(context): the bus answered Hello with \(body)")
        }
        guard dbus_bus_set_unique_name(pointer, name) != 0 else {
            throw DBusError(name: DBusError.noMemory, message: "\(context): out of memory")
        }
    }

    /// Opens a connection like `init(_:)`, doing the blocking work (connect, authenticate, `Hello`) on a thread of
    /// its own, so that an async caller never holds one of the cooperative pool's few threads while the bus is
    /// slow to answer.
    /// - Throws: ``DBusError`` when the bus cannot be reached or refuses the connection.
    public static func open(_ bus: DBusBus) async throws(DBusError) -> DBusConnection {
        let result: Result<DBusConnection, DBusError> = await onOwnThread {
            do throws(DBusError) { return .success(try DBusConnection(bus)) } catch { return .failure(error) }
        }
        return try result.get()
    }

    /// Closes the connection like ``close()``, but joins the I/O thread from a thread of its own and suspends
    /// until it has exited, instead of blocking the calling thread.
    public func closeAndWait() async {
        let core = self.core
        await onOwnThread { core.shutdown() }
    }

    /// True until the bus goes away or ``close()`` is called.
    public var isConnected: Bool { core.shared.withLock { $0.connected && !$0.stopping } }

    /// Returns when the connection is lost or closed (the bus died, or ``close()``). Returns early if the task
    /// is cancelled.
    public func waitUntilDisconnected() async { await core.waitUntilDisconnected() }

    /// Closes the connection, ends every stream, fails calls still waiting with ``DBusError/disconnected`` and
    /// joins the I/O thread (unless called on it). Idempotent; also run by `deinit`.
    public func close() { core.shutdown() }

    // MARK: client side

    /// Calls a method and returns the reply's arguments.
    /// - Throws: the error reply as ``DBusError``; ``DBusError/noReply`` on timeout; ``DBusError/disconnected``;
    ///   ``DBusError/cancelled`` when the task is cancelled; marshalling errors before anything is sent.
    public func call(
        destination: String, path: DBusObjectPath, interface: String, method: String, arguments: [DBusValue] = [],
        timeout: Duration = .seconds(25)
    ) async throws(DBusError) -> [DBusValue] {
        let reply = try await methodReply(destination, path, interface, method, arguments, timeout)
        return try Marshal.decodeBody(reply.pointer)
    }

    /// Calls a method and reads the reply's arguments in place with `read`, in the calling task: for a large reply
    /// of which the caller keeps a little (bluetoothd's whole tree from GetManagedObjects), nothing is built for
    /// what `read` skips. The reader is valid only while `read` runs.
    /// - Throws: as ``call(destination:path:interface:method:arguments:timeout:)``, and what `read` throws.
    public func call<T>(
        destination: String, path: DBusObjectPath, interface: String, method: String, arguments: [DBusValue] = [],
        timeout: Duration = .seconds(25), reading read: (inout DBusArgumentReader) throws(DBusError) -> T
    ) async throws(DBusError) -> T {
        let reply = try await methodReply(destination, path, interface, method, arguments, timeout)
        return try withExtendedLifetime(reply) { () throws(DBusError) -> T in
            var reader = DBusArgumentReader(message: reply.pointer)
            return try read(&reader)
        }
    }

    /// Sends a method call and returns its reply; an error reply is thrown.
    private func methodReply(
        _ destination: String, _ path: DBusObjectPath, _ interface: String, _ method: String,
        _ arguments: [DBusValue], _ timeout: Duration
    ) async throws(DBusError) -> CMessage {
        let message = DBusMessage.methodCall(
            destination: destination, path: path, interface: interface, method: method, body: arguments)
        let built = try Marshal.build(message)
        try checkFDs(message.body)
        let reply = try await Self.awaitReply(core, built, timeout: timeout, to: message)
        if reply.type == DBUS_MESSAGE_TYPE_ERROR { throw ConnectionCore.errorFromReply(reply) }
        return reply
    }

    /// Sends a method call message and returns the whole reply message.
    /// - Throws: the error reply as ``DBusError`` (and the failures listed for the other `call`).
    public func call(_ message: DBusMessage, timeout: Duration = .seconds(25)) async throws(DBusError)
        -> DBusMessage
    {
        let (built, message) = try buildCall(message)
        let reply = try await Self.awaitReply(core, built, timeout: timeout, to: message)
        let decoded = try Marshal.decode(reply.pointer)
        if let error = decoded.error { throw error }
        return decoded
    }

    /// Sends a method call and also hands its reply to `inOrder` on the connection's I/O thread, before any
    /// message that arrived after the reply is dispatched (an error reply is not handed over). A consumer of
    /// signals taken with ``signals(matching:ended:handler:)`` can load a snapshot from the reply there and apply
    /// exactly the signals that are newer than it. Returns the same reply.
    /// - Throws: as ``call(_:timeout:)``.
    public func call(
        _ message: DBusMessage, timeout: Duration = .seconds(25),
        inOrder: @escaping @Sendable (DBusMessage) -> Void
    ) async throws(DBusError) -> DBusMessage {
        let (built, message) = try buildCall(message)
        // Decoded once, on the I/O thread; the awaiting task takes the same value.
        let decoded = Mutex<Result<DBusMessage, DBusError>?>(nil)
        _ = try await Self.awaitReply(core, built, timeout: timeout, to: message) { outcome in
            guard case .success(let reply) = outcome else { return }
            do throws(DBusError) {
                let message = try Marshal.decode(reply.pointer)
                decoded.withLock { $0 = .success(message) }
                if message.error == nil { inOrder(message) }
            } catch {
                decoded.withLock { $0 = .failure(error) }
            }
        }
        guard let result = decoded.withLock({ $0 }) else {
            throw DBusError(name: DBusError.failed, message: "the reply was not decoded")
        }
        let reply = try result.get()
        if let error = reply.error { throw error }
        return reply
    }

    /// A method call ready to send (a reply wanted), and the message as sent.
    private func buildCall(_ message: DBusMessage) throws(DBusError) -> (CMessage, DBusMessage) {
        guard message.type == .methodCall else {
            throw DBusError(name: DBusError.invalidArgs, message: "only method calls can be awaited")
        }
        var message = message
        message.noReplyExpected = false
        let built = try Marshal.build(message)
        try checkFDs(message.body)
        return (built, message)
    }

    /// Awaits the reply to `message` (handed to `onIOThread` first, on the I/O thread, when given). A failure of
    /// this side (connection closed or lost, cancelled, out of memory) names the call, so that a log line says
    /// which call it cut short; error replies from the peer pass unchanged.
    private static func awaitReply(
        _ core: ConnectionCore, _ built: CMessage, timeout: Duration, to message: DBusMessage,
        onIOThread: (@Sendable (PendingCall.Outcome) -> Void)? = nil
    ) async throws(DBusError) -> CMessage {
        switch await core.call(built, timeout: timeout, onIOThread: onIOThread) {
        case .success(let reply):
            return reply
        case .failure(let error):
            let call = "\(message.interface ?? "").\(message.member ?? "") on \(message.path?.rawValue ?? "/")"
            let peer = message.destination.map { " (\($0))" } ?? ""
            throw DBusError(name: error.name, message: "\(call)\(peer): \(error.message)")
        }
    }

    /// Sends a message without waiting for a reply (signals, calls flagged `noReplyExpected`, replies).
    /// - Throws: marshalling errors, or ``DBusError/disconnected``.
    public func send(_ message: DBusMessage) throws(DBusError) {
        let built = try Marshal.build(message)
        try checkFDs(message.body)
        try core.enqueue(.send(built))
    }

    /// Emits a signal.
    public func emitSignal(path: DBusObjectPath, interface: String, name: String, arguments: [DBusValue] = [])
        throws(DBusError)
    {
        try send(.signal(path: path, interface: interface, name: name, body: arguments))
    }

    private func checkFDs(_ body: [DBusValue]) throws(DBusError) {
        guard !canPassUnixFDs, body.contains(where: { $0.containsFileDescriptor }) else { return }
        throw DBusError(name: DBusError.notSupported, message: "this connection cannot pass unix fds")
    }

    /// Adds the match rule on the bus (awaiting the reply) and returns the matching signals. The rule is removed
    /// (`RemoveMatch`) when the stream's consumer stops iterating or drops it; the stream ends when the
    /// connection closes.
    ///
    /// With a well-known `sender` (such as `org.bluez`) the connection also follows that name's owner, so that
    /// signals the bus delivered for another rule of this connection are not routed to this stream.
    ///
    /// At most `capacity` signals wait for a consumer that falls behind; further ones are dropped and counted
    /// (`DBusSignalStream.droppedCount`), so a stalled consumer cannot grow memory without limit. A consumer that
    /// mirrors state should resynchronise when the count moves, or take the signals on the I/O thread with
    /// ``signals(matching:ended:handler:)``, where nothing queues.
    public func signals(matching rule: DBusMatchRule, capacity: Int = 65536) async throws(DBusError)
        -> DBusSignalStream
    {
        let (stream, continuation) = AsyncStream<DBusMessage>.makeStream(
            bufferingPolicy: .bufferingOldest(max(1, capacity)))
        let drops = SignalDropCounter()
        let subscription = try await signals(
            matching: rule, ended: { continuation.finish() },
            handler: { message in
                if case .dropped = continuation.yield(message) { drops.count.add(1, ordering: .relaxed) }
            })
        continuation.onTermination = { _ in subscription.cancel() }
        return DBusSignalStream(
            stream: stream, lifetime: SubscriptionLifetime { continuation.finish() }, drops: drops)
    }

    /// Adds the match rule on the bus (awaiting the reply) and calls `handler` with each matching signal on the
    /// connection's I/O thread, in arrival order, before the next message is dispatched: no queue and no thread
    /// hop between the socket and the consumer. `handler` must return quickly and must not wait for anything this
    /// connection delivers (it runs on the thread that would deliver it). `ended` runs once when the connection
    /// closes or is lost.
    ///
    /// A well-known `sender` is followed as with the stream form. The rule is removed when the returned
    /// subscription is cancelled or released.
    public func signals(
        matching rule: DBusMatchRule, ended: @escaping @Sendable () -> Void = {},
        handler: @escaping @Sendable (DBusMessage) -> Void
    ) async throws(DBusError) -> DBusSignalSubscription {
        let tracker = try Self.tracker(for: rule)
        let subscription = SignalSubscription(
            rule: rule,
            deliver: { [tracker] message in
                if let tracker, !tracker.accepts(message.sender) { return }
                handler(message)
            }, finish: ended)
        return try await subscribe(subscription, tracker: tracker)
    }

    /// `signals(matching:ended:handler:)` for a handler that reads each signal in place (`DBusSignalView`): nothing
    /// is decoded for it, so a hot signal costs what the handler reads. The view is valid only during the call.
    public func signals(
        matching rule: DBusMatchRule, ended: @escaping @Sendable () -> Void = {},
        reader: @escaping @Sendable (DBusSignalView) -> Void
    ) async throws(DBusError) -> DBusSignalSubscription {
        let tracker = try Self.tracker(for: rule)
        let subscription = SignalSubscription(
            rule: rule, deliver: { _ in }, finish: ended,
            deliverView: { [tracker] view in
                if let tracker, !tracker.accepts(view.sender) { return }
                reader(view)
            })
        return try await subscribe(subscription, tracker: tracker)
    }

    /// The owner tracker a rule with a well-known sender needs (nil for a unique or the bus's name).
    private static func tracker(for rule: DBusMatchRule) throws(DBusError) -> OwnerTracker? {
        guard let sender = rule.sender, !sender.hasPrefix(":"), sender != "org.freedesktop.DBus" else { return nil }
        try Names.busName(sender)
        return OwnerTracker()
    }

    private func subscribe(_ subscription: SignalSubscription, tracker: OwnerTracker?) async throws(DBusError)
        -> DBusSignalSubscription
    {
        let rule = subscription.rule
        let ended = subscription.finish
        guard let id = core.addSubscription(subscription) else {
            throw DBusError(name: DBusError.disconnected, message: "the D-Bus connection is closed")
        }
        let token = DBusSignalSubscription(core: core, id: id, tracker: tracker)
        do throws(DBusError) {
            _ = try await core.callBus("AddMatch", [.string(rule.rule)])
            if let tracker, let sender = rule.sender { try await follow(owner: sender, into: tracker) }
        } catch {
            token.cancel()
            ended()
            throw error
        }
        return token
    }

    /// Keeps `tracker` up to date with the owner of `name` (NameOwnerChanged, then GetNameOwner).
    private func follow(owner name: String, into tracker: OwnerTracker) async throws(DBusError) {
        let rule = DBusMatchRule.nameOwnerChanged(name)
        let subscription = SignalSubscription(
            rule: rule,
            deliver: { message in
                guard message.body.count == 3, let owner = message.body[2].string else { return }
                tracker.set(owner.isEmpty ? nil : owner)
            }, finish: {})
        guard let id = core.addSubscription(subscription) else {
            throw DBusError(name: DBusError.disconnected, message: "the D-Bus connection is closed")
        }
        tracker.subscriptionID.withLock { $0 = id }
        _ = try await core.callBus("AddMatch", [.string(rule.rule)])
        let message = DBusMessage.methodCall(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            method: "GetNameOwner", body: [.string(name)])
        let outcome = await core.call(try Marshal.build(message), timeout: .seconds(25)) { outcome in
            // On the I/O thread, in order with the signals.
            guard case .success(let reply) = outcome else { return }
            if reply.type == DBUS_MESSAGE_TYPE_ERROR {
                if ConnectionCore.errorFromReply(reply).name == DBusError.nameHasNoOwner { tracker.set(nil) }
            } else {
                tracker.set((try? Marshal.decodeBody(reply.pointer))?.first?.string)
            }
        }
        _ = try outcome.get()
    }

    /// The current owner of `name` (nil when none), then each change, from `NameOwnerChanged`.
    public func nameOwnerChanges(_ name: String) async throws(DBusError) -> DBusNameOwnerStream {
        try Names.busName(name)
        let (stream, continuation) = AsyncStream<String?>.makeStream(bufferingPolicy: .unbounded)
        // Changes seen before the GetNameOwner reply are already reflected in it and are dropped.
        let live = Mutex(false)
        let rule = DBusMatchRule.nameOwnerChanged(name)
        let subscription = SignalSubscription(
            rule: rule,
            deliver: { message in
                guard live.withLock({ $0 }), message.body.count == 3, let owner = message.body[2].string else { return }
                continuation.yield(owner.isEmpty ? nil : owner)
            }, finish: { continuation.finish() })
        guard let id = core.addSubscription(subscription) else {
            throw DBusError(name: DBusError.disconnected, message: "the D-Bus connection is closed")
        }
        let core = self.core
        continuation.onTermination = { _ in core.removeSubscription(id, removeMatch: true) }
        do throws(DBusError) {
            _ = try await core.callBus("AddMatch", [.string(rule.rule)])
            let message = DBusMessage.methodCall(
                destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                method: "GetNameOwner", body: [.string(name)])
            let outcome = await core.call(try Marshal.build(message), timeout: .seconds(25)) { outcome in
                // On the I/O thread, in order with the signals.
                switch outcome {
                case .success(let reply):
                    if reply.type == DBUS_MESSAGE_TYPE_ERROR {
                        let error = ConnectionCore.errorFromReply(reply)
                        guard error.name == DBusError.nameHasNoOwner else { return }
                        continuation.yield(nil)
                    } else {
                        let owner = (try? Marshal.decodeBody(reply.pointer))?.first?.string
                        continuation.yield(owner)
                    }
                    live.withLock { $0 = true }
                case .failure:
                    return
                }
            }
            let reply = try outcome.get()
            if reply.type == DBUS_MESSAGE_TYPE_ERROR {
                let error = ConnectionCore.errorFromReply(reply)
                if error.name != DBusError.nameHasNoOwner { throw error }
            }
        } catch {
            // Ending the stream removes the subscription and (if AddMatch got through) the rule on the bus.
            continuation.finish()
            throw error
        }
        return DBusNameOwnerStream(stream: stream, lifetime: SubscriptionLifetime { continuation.finish() })
    }

    /// Calls `org.freedesktop.DBus.Peer.Ping` on `destination`.
    public func ping(_ destination: String, timeout: Duration = .seconds(5)) async throws(DBusError) {
        _ = try await call(
            destination: destination, path: "/", interface: "org.freedesktop.DBus.Peer", method: "Ping",
            timeout: timeout)
    }

    /// The unique name owning `name`, or nil when nobody owns it.
    public func nameOwner(_ name: String) async throws(DBusError) -> String? {
        try Names.busName(name)
        do {
            return try await core.callBus("GetNameOwner", [.string(name)]).first?.string
        } catch  where error.name == DBusError.nameHasNoOwner {
            return nil
        }
    }

    // MARK: server side

    /// Asks the bus for a well-known name.
    public func requestName(_ name: String, flags: DBusRequestNameFlags = [.doNotQueue]) async throws(DBusError)
        -> DBusRequestNameReply
    {
        try Names.busName(name)
        let body = try await core.callBus("RequestName", [.string(name), .uint32(flags.rawValue)])
        guard let code = body.first?.uint32, let reply = DBusRequestNameReply(rawValue: code) else {
            throw DBusError(name: DBusError.failed, message: "unexpected RequestName reply \(body)")
        }
        return reply
    }

    /// Gives a well-known name back to the bus.
    public func releaseName(_ name: String) async throws(DBusError) {
        try Names.busName(name)
        _ = try await core.callBus("ReleaseName", [.string(name)])
    }

    /// Runs `body` on the connection's I/O thread, in order with method handlers and queued messages.
    public func perform(_ body: @escaping @Sendable () -> Void) {
        try? core.enqueue(.perform(body))
    }
}

extension DBusConnection {
    fileprivate static func environment(_ name: String) -> String? {
        guard let value = getenv(name) else { return nil }
        let text = String(cString: value)
        return text.isEmpty ? nil : text
    }
}

extension DBusValue {
    var containsFileDescriptor: Bool {
        switch self {
        case .unixFD: return true
        case .array(let sig, let elements):
            return sig.rawValue.contains("h") && elements.contains { $0.containsFileDescriptor }
        case .dictionary(_, _, let entries):
            return entries.contains { $0.key.containsFileDescriptor || $0.value.containsFileDescriptor }
        case .structure(let fields): return fields.contains { $0.containsFileDescriptor }
        case .variant(let inner): return inner.containsFileDescriptor
        default: return false
        }
    }
}

/// The signals matching a rule, in arrival order, with no loss (unbounded buffer). Ends when the connection
/// closes or is lost. Dropping the iterator or cancelling the consuming task removes the match rule.
public struct DBusSignalStream: AsyncSequence, Sendable {
    /// Each matching signal.
    public typealias Element = DBusMessage
    let stream: AsyncStream<DBusMessage>
    let lifetime: SubscriptionLifetime
    let drops: SignalDropCounter

    /// Signals dropped because `capacity` of them were already waiting.
    public var droppedCount: Int { drops.count.load(ordering: .relaxed) }

    /// The iterator.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncStream<DBusMessage>.Iterator
        let lifetime: SubscriptionLifetime
        /// The next signal, or nil once the stream ended.
        public mutating func next() async -> DBusMessage? { await base.next() }
    }

    /// Starts iterating (each iterator keeps the subscription alive).
    public func makeAsyncIterator() -> AsyncIterator {
        AsyncIterator(base: stream.makeAsyncIterator(), lifetime: lifetime)
    }
}

/// A signal subscription taken with ``DBusConnection/signals(matching:ended:handler:)``: the handler is called
/// until this is cancelled or released.
public final class DBusSignalSubscription: Sendable {
    private let core: ConnectionCore
    private let id: UInt64
    private let tracker: OwnerTracker?
    private let cancelled = Atomic<Bool>(false)

    init(core: ConnectionCore, id: UInt64, tracker: OwnerTracker?) {
        self.core = core
        self.id = id
        self.tracker = tracker
    }

    /// Removes the handler and the match rule (and the owner tracking a well-known sender needed). Called from
    /// another thread, a handler already running on the I/O thread may still finish after this returns.
    public func cancel() {
        guard !cancelled.exchange(true, ordering: .acquiringAndReleasing) else { return }
        core.removeSubscription(id, removeMatch: true)
        if let trackerID = tracker?.subscriptionID.withLock({ $0 }) {
            core.removeSubscription(trackerID, removeMatch: true)
        }
    }

    deinit { cancel() }
}

/// Counts the signals a full stream dropped.
final class SignalDropCounter: Sendable {
    let count = Atomic<Int>(0)
}

/// The owner of a well-known name as last seen on the I/O thread; unknown until the first answer.
final class OwnerTracker: Sendable {
    private let owner = Mutex<(known: Bool, owner: String?)>((false, nil))
    let subscriptionID = Mutex<UInt64?>(nil)

    func set(_ value: String?) { owner.withLock { $0 = (true, value) } }

    /// False only when the owner is known and `sender` is not it.
    func accepts(_ sender: String?) -> Bool {
        owner.withLock { state in !state.known || (state.owner != nil && state.owner == sender) }
    }
}

/// Ends a subscription (RemoveMatch, buffer released) once neither its stream nor any iterator is left, even if
/// nobody ever iterated.
final class SubscriptionLifetime: Sendable {
    private let end: @Sendable () -> Void
    init(_ end: @escaping @Sendable () -> Void) { self.end = end }
    deinit { end() }
}

/// The owner of a name (nil when none) and then each change. Ends when the connection closes or is lost.
public struct DBusNameOwnerStream: AsyncSequence, Sendable {
    /// The owner's unique name, or nil when the name has no owner.
    public typealias Element = String?
    let stream: AsyncStream<String?>
    let lifetime: SubscriptionLifetime

    /// The iterator.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncStream<String?>.Iterator
        let lifetime: SubscriptionLifetime
        /// The next owner (`.some(nil)` = no owner), or nil once the stream ended.
        public mutating func next() async -> String?? { await base.next() }
    }

    /// Starts iterating (each iterator keeps the subscription alive).
    public func makeAsyncIterator() -> AsyncIterator {
        AsyncIterator(base: stream.makeAsyncIterator(), lifetime: lifetime)
    }
}

extension DBusMatchRule {
    /// The bus daemon's `NameOwnerChanged` signals about `name`.
    static func nameOwnerChanged(_ name: String) -> DBusMatchRule {
        DBusMatchRule(
            sender: "org.freedesktop.DBus", interface: "org.freedesktop.DBus", member: "NameOwnerChanged",
            path: "/org/freedesktop/DBus", arguments: [0: name])
    }
}

/// Work handed to a thread started by `onOwnThread`.
private final class ThreadWork: @unchecked Sendable {
    let run: () -> Void
    init(_ run: @escaping () -> Void) { self.run = run }
}

/// Runs `body` on a new detached thread and suspends until it returns: for blocking libdbus work called from async
/// code (the cooperative pool has one thread per core).
func onOwnThread<T: Sendable>(_ body: @escaping @Sendable () -> T) async -> T {
    await withCheckedContinuation { (continuation: CheckedContinuation<T, Never>) in
        let context = Unmanaged.passRetained(ThreadWork { continuation.resume(returning: body()) }).toOpaque()
        var attributes = pthread_attr_t()
        pthread_attr_init(&attributes)
        pthread_attr_setdetachstate(&attributes, Int32(PTHREAD_CREATE_DETACHED))
        defer { pthread_attr_destroy(&attributes) }
        var thread = pthread_t()
        let rc = pthread_create(
            &thread, &attributes,
            { raw in
                guard let raw else { return nil }
                Unmanaged<ThreadWork>.fromOpaque(raw).takeRetainedValue().run()
                return nil
            }, context)
        if rc != 0 {
            // No thread to be had: do the work here rather than not at all.
            Unmanaged<ThreadWork>.fromOpaque(context).takeRetainedValue().run()
        }
    }
}
