// The public connection: opening private bus connections, calls, signals, names.
import CDBus
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
    public let rawValue: UInt32
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
    case primaryOwner = 1
    case inQueue = 2
    case exists = 3
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
        switch bus {
        case .system, .session:
            let type = bus.isSystem ? DBUS_BUS_SYSTEM : DBUS_BUS_SESSION
            guard let opened = dbus_bus_get_private(type, &error) else {
                throw DBusError.consume(&error, context: "connecting to the \(bus.isSystem ? "system" : "session") bus")
            }
            pointer = opened
            dbus_connection_set_exit_on_disconnect(pointer, 0)
        case .address(let address):
            guard !address.isEmpty, !address.utf8.contains(0) else {
                throw DBusError(name: DBusError.invalidArgs, message: "invalid D-Bus address \"\(address)\"")
            }
            guard let opened = dbus_connection_open_private(address, &error) else {
                throw DBusError.consume(&error, context: "connecting to \(address)")
            }
            pointer = opened
            dbus_connection_set_exit_on_disconnect(pointer, 0)
            guard dbus_bus_register(pointer, &error) != 0 else {
                let failure = DBusError.consume(&error, context: "registering on the bus at \(address)")
                dbus_connection_close(pointer)
                dbus_connection_unref(pointer)
                throw failure
            }
        }
        // Generous limits so bursts of signals are buffered rather than throttled.
        dbus_connection_set_max_received_size(pointer, 1 << 30)
        dbus_connection_set_max_message_size(pointer, 128 << 20)
        dbus_connection_set_max_received_unix_fds(pointer, 1 << 16)
        dbus_connection_set_max_message_unix_fds(pointer, 1 << 10)
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
        let message = DBusMessage.methodCall(
            destination: destination, path: path, interface: interface, method: method, body: arguments)
        let built = try Marshal.build(message)
        try checkFDs(message.body)
        let reply = try await core.call(built, timeout: timeout).get()
        return try ConnectionCore.replyBody(reply)
    }

    /// Sends a method call message and returns the whole reply message.
    /// - Throws: the error reply as ``DBusError`` (and the failures listed for the other `call`).
    public func call(_ message: DBusMessage, timeout: Duration = .seconds(25)) async throws(DBusError)
        -> DBusMessage
    {
        guard message.type == .methodCall else {
            throw DBusError(name: DBusError.invalidArgs, message: "only method calls can be awaited")
        }
        var message = message
        message.noReplyExpected = false
        let built = try Marshal.build(message)
        try checkFDs(message.body)
        let reply = try await core.call(built, timeout: timeout).get()
        let decoded = try Marshal.decode(reply.pointer)
        if let error = decoded.error { throw error }
        return decoded
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
    public func signals(matching rule: DBusMatchRule) async throws(DBusError) -> DBusSignalStream {
        let (stream, continuation) = AsyncStream<DBusMessage>.makeStream(bufferingPolicy: .unbounded)
        let subscription = SignalSubscription(
            rule: rule, deliver: { continuation.yield($0) }, finish: { continuation.finish() })
        guard let id = core.addSubscription(subscription) else {
            throw DBusError(name: DBusError.disconnected, message: "the D-Bus connection is closed")
        }
        let core = self.core
        continuation.onTermination = { _ in core.removeSubscription(id, removeMatch: true) }
        do {
            _ = try await core.callBus("AddMatch", [.string(rule.rule)])
        } catch {
            core.removeSubscription(id, removeMatch: false)
            continuation.finish()
            throw error
        }
        return DBusSignalStream(stream: stream)
    }

    /// The current owner of `name` (nil when none), then each change, from `NameOwnerChanged`.
    public func nameOwnerChanges(_ name: String) async throws(DBusError) -> DBusNameOwnerStream {
        try Names.busName(name)
        let (stream, continuation) = AsyncStream<String?>.makeStream(bufferingPolicy: .unbounded)
        // Changes seen before the GetNameOwner reply are already reflected in it and are dropped.
        let live = Mutex(false)
        let rule = DBusMatchRule(
            sender: "org.freedesktop.DBus", interface: "org.freedesktop.DBus", member: "NameOwnerChanged",
            path: "/org/freedesktop/DBus", arguments: [0: name])
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
            core.removeSubscription(id, removeMatch: false)
            continuation.finish()
            throw error
        }
        return DBusNameOwnerStream(stream: stream)
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
        } catch where error.name == DBusError.nameHasNoOwner {
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

extension DBusBus {
    fileprivate var isSystem: Bool { if case .system = self { return true } else { return false } }
}

extension DBusValue {
    var containsFileDescriptor: Bool {
        switch self {
        case .unixFD: return true
        case .array(let sig, let elements): return sig.rawValue.contains("h") && elements.contains { $0.containsFileDescriptor }
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
    public typealias Element = DBusMessage
    let stream: AsyncStream<DBusMessage>

    /// The iterator.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncStream<DBusMessage>.Iterator
        public mutating func next() async -> DBusMessage? { await base.next() }
    }

    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(base: stream.makeAsyncIterator()) }
}

/// The owner of a name (nil when none) and then each change. Ends when the connection closes or is lost.
public struct DBusNameOwnerStream: AsyncSequence, Sendable {
    public typealias Element = String?
    let stream: AsyncStream<String?>

    /// The iterator.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncStream<String?>.Iterator
        public mutating func next() async -> String?? { await base.next() }
    }

    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(base: stream.makeAsyncIterator()) }
}
