// Exporting objects: method dispatch, org.freedesktop.DBus.Properties, Introspectable and ObjectManager, with
// PropertiesChanged coalesced per object and interface like BlueZ's gdbus does.
internal import CDBus
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// One incoming method call. Handlers run on the connection's I/O thread, one at a time, in arrival order.
public struct DBusMethodCall: Sendable {
    /// The whole message.
    public var message: DBusMessage
    /// The unique name of the caller.
    public var sender: String
    /// The object path called.
    public var path: DBusObjectPath
    /// The interface (resolved from the object when the caller gave none).
    public var interface: String
    /// The method name.
    public var member: String
    /// The arguments.
    public var arguments: [DBusValue]
    /// Completes the call later (return ``DBusMethodOutcome/deferred`` from the handler).
    public var reply: DBusPendingReply
}

/// Completes a method call exactly once (later calls are ignored). If it is dropped without completing, the
/// caller gets `org.freedesktop.DBus.Error.NoReply`. Safe to use from any thread.
public final class DBusPendingReply: Sendable {
    private let core: ConnectionCore
    private let request: CMessage
    private let done = Atomic<Bool>(false)

    init(core: ConnectionCore, request: CMessage) {
        self.core = core
        self.request = request
    }

    private func claim() -> Bool {
        !done.exchange(true, ordering: .acquiringAndReleasing)
    }

    /// True once the call was answered.
    public var isCompleted: Bool { done.load(ordering: .acquiring) }

    /// Sends the method return with `values`. Values that cannot be marshalled turn into an error reply.
    public func succeed(_ values: [DBusValue] = []) {
        guard claim() else { return }
        do {
            try Marshal.validateBody(values)
        } catch {
            send(error: DBusError(name: DBusError.failed, message: "invalid reply: \(error.message)"))
            return
        }
        guard dbus_message_get_no_reply(request.pointer) == 0 else { return }
        guard let pointer = dbus_message_new_method_return(request.pointer) else { return }
        let reply = CMessage(adopting: pointer)
        do {
            try Marshal.appendValidated(values, to: pointer)
        } catch {
            return
        }
        try? core.enqueue(.send(reply))
    }

    /// Sends an error reply.
    public func fail(_ error: DBusError) {
        guard claim() else { return }
        send(error: error)
    }

    private func send(error: DBusError) {
        guard dbus_message_get_no_reply(request.pointer) == 0 else { return }
        var name = error.name
        if (try? Names.errorName(name)) == nil { name = DBusError.failed }
        var text = error.message
        if text.utf8.contains(0) { text = String(text.unicodeScalars.filter { $0 != "\0" }) }
        guard let pointer = dbus_message_new_error(request.pointer, name, text) else { return }
        try? core.enqueue(.send(CMessage(adopting: pointer)))
    }

    deinit {
        if claim() {
            send(error: DBusError(name: DBusError.noReply, message: "the method handler did not reply"))
        }
    }
}

/// What a method handler returns.
public enum DBusMethodOutcome: Sendable {
    /// Reply now with these values.
    case reply([DBusValue])
    /// Reply now with an error.
    case error(DBusError)
    /// The handler keeps ``DBusMethodCall/reply`` and completes it later.
    case deferred
}

/// A method handler; runs on the connection's I/O thread. It must not block waiting for a reply on the same
/// connection (that reply is read by the very thread it blocks): return ``DBusMethodOutcome/deferred`` and
/// complete ``DBusMethodCall/reply`` from a task instead.
public typealias DBusMethodHandler = @Sendable (DBusMethodCall) -> DBusMethodOutcome

/// A method of an exported interface.
public struct DBusMethodSpec: Sendable {
    /// The method name.
    public let name: String
    /// The input signature; calls with another signature get UnknownMethod.
    public let inSignature: DBusSignature
    /// The output signature (for introspection).
    public let outSignature: DBusSignature
    /// Names of the input arguments (for introspection).
    public let argumentNames: [String]
    /// Names of the results (for introspection).
    public let resultNames: [String]
    /// True when calls with any signature reach the handler (which then checks the arguments itself and answers
    /// with its own error name, as BlueZ's `org.bluez.Error.InvalidArguments`); `inSignature` is then only what
    /// introspection shows.
    public let acceptsAnySignature: Bool
    let handler: DBusMethodHandler

    /// Declares a method.
    /// - Parameter acceptingAnySignature: hand calls of every signature to `handler` instead of answering
    ///   UnknownMethod to those whose signature is not `inSignature`.
    public init(
        _ name: String, in inSignature: DBusSignature = "", out outSignature: DBusSignature = "",
        argumentNames: [String] = [], resultNames: [String] = [], acceptingAnySignature: Bool = false,
        handler: @escaping DBusMethodHandler
    ) {
        self.name = name
        self.inSignature = inSignature
        self.outSignature = outSignature
        self.argumentNames = argumentNames
        self.resultNames = resultNames
        self.acceptsAnySignature = acceptingAnySignature
        self.handler = handler
    }
}

/// A property of an exported interface.
public struct DBusPropertySpec: Sendable {
    /// Who may read and write the property over the bus.
    public enum Access: Sendable {
        /// Readable only (Set answers PropertyReadOnly).
        case read
        /// Writable only.
        case write
        /// Readable and writable.
        case readWrite

        var readable: Bool { self != .write }
        var writable: Bool { self != .read }
        var xml: String {
            switch self {
            case .read: return "read"
            case .write: return "write"
            case .readWrite: return "readwrite"
            }
        }
    }
    /// The property name.
    public let name: String
    /// The property type.
    public let signature: DBusSignature
    /// Access over the bus.
    public let access: Access

    /// Declares a property.
    public init(_ name: String, _ signature: DBusSignature, access: Access = .read) {
        self.name = name
        self.signature = signature
        self.access = access
    }
}

/// A signal of an exported interface (for introspection).
public struct DBusSignalSpec: Sendable {
    /// The signal name.
    public let name: String
    /// The argument signature.
    public let signature: DBusSignature
    /// The argument names.
    public let argumentNames: [String]

    /// Declares a signal.
    public init(_ name: String, _ signature: DBusSignature = "", argumentNames: [String] = []) {
        self.name = name
        self.signature = signature
        self.argumentNames = argumentNames
    }
}

/// An interface: its methods, property declarations and signals. `setHandler` validates and applies
/// Properties.Set (return nil to accept: the server then stores the value and emits PropertiesChanged).
public struct DBusInterfaceSpec: Sendable {
    /// The interface name.
    public let name: String
    /// The methods.
    public let methods: [DBusMethodSpec]
    /// The declared properties.
    public let properties: [DBusPropertySpec]
    /// The signals.
    public let signals: [DBusSignalSpec]
    let setHandler: (@Sendable (_ property: String, _ value: DBusValue, _ sender: String) -> DBusError?)?

    /// Declares an interface. `setHandler` runs on the I/O thread for each valid `Properties.Set`.
    public init(
        _ name: String, methods: [DBusMethodSpec] = [], properties: [DBusPropertySpec] = [],
        signals: [DBusSignalSpec] = [],
        setHandler: (@Sendable (_ property: String, _ value: DBusValue, _ sender: String) -> DBusError?)? = nil
    ) {
        self.name = name
        self.methods = methods
        self.properties = properties
        self.signals = signals
        self.setHandler = setHandler
    }

    func property(_ name: String) -> DBusPropertySpec? { properties.first { $0.name == name } }
}

/// Which error names the exported org.freedesktop.DBus.Properties answers with. The texts are BlueZ's in both
/// styles ("No such interface 'X'", "No such property 'X'", "Property 'X' is not writable").
public enum DBusPropertyErrorStyle: Sendable, Hashable {
    /// The specification's names: UnknownInterface, UnknownProperty, PropertyReadOnly, InvalidArgs for a wrong
    /// type, AccessDenied for reading a write-only property.
    case standard
    /// Exactly what BlueZ's gdbus sends: InvalidArgs for an unknown interface and for Get of an unknown or absent
    /// property, UnknownProperty for Set of an unknown or absent property, PropertyReadOnly, InvalidSignature
    /// ("Invalid signature for 'X'") for a wrong type.
    case bluez
}

/// Exports objects on a connection with org.freedesktop.DBus.Properties (Get/GetAll/Set with the standard
/// errors), Introspectable, and an ObjectManager at `objectManagerPath` (GetManagedObjects, InterfacesAdded,
/// InterfacesRemoved; every object also lists Introspectable and Properties with empty dicts, as BlueZ does).
/// Unknown object -> UnknownObject; unknown method or wrong signature -> UnknownMethod with libdbus's text
/// ("Method \"Connect\" with signature \"\" on interface \"org.bluez.Device1\" doesn't exist\n").
///
/// The objects stay exported while this server is alive; all methods are safe from any thread.
public final class DBusObjectServer: Sendable {
    /// The connection the objects are exported on.
    public let connection: DBusConnection
    /// Where the ObjectManager interface lives.
    public let objectManagerPath: DBusObjectPath
    let state: ServerState

    /// Starts exporting (no objects yet) on `connection`.
    /// - Parameter propertyErrors: the error names of Properties.Get/GetAll/Set (``DBusPropertyErrorStyle``).
    public init(
        connection: DBusConnection, objectManagerPath: DBusObjectPath = "/",
        propertyErrors: DBusPropertyErrorStyle = .standard
    ) {
        self.connection = connection
        self.objectManagerPath = objectManagerPath
        state = ServerState(core: connection.core, managerPath: objectManagerPath, errorStyle: propertyErrors)
        connection.core.addClient(state)
    }

    deinit { connection.core.removeClient(state) }

    /// Adds interfaces (with initial property values, *not* wrapped in variants) to an object, creating it if
    /// needed. InterfacesAdded is deferred to idle like BlueZ: properties set in the same turn land in it.
    public func addInterfaces(at path: DBusObjectPath, _ interfaces: [(DBusInterfaceSpec, [String: DBusValue])]) {
        guard DBusObjectPath.isValid(path.rawValue) else {
            warn("addInterfaces: invalid object path \"\(path.rawValue)\"")
            return
        }
        state.addInterfaces(at: path, interfaces)
        connection.core.requestIdleFlush()
    }

    /// Removes interfaces from an object (InterfacesRemoved after pending changes); the object goes when it has
    /// none left.
    public func removeInterfaces(at path: DBusObjectPath, _ names: [String]) {
        let present = state.interfaceNames(at: path).filter { names.contains($0) }
        guard !present.isEmpty else { return }
        let removingAll = present.count == state.interfaceNames(at: path).count
        let announced = removingAll ? ServerState.standardInterfacesRemovedOrder + present : present
        sendInterfacesRemoved(path, announced)
        state.removeInterfaces(at: path, present)
    }

    /// Removes an object and all its interfaces.
    public func removeObject(at path: DBusObjectPath) {
        let present = state.interfaceNames(at: path)
        guard state.hasObject(path) else { return }
        sendInterfacesRemoved(path, ServerState.standardInterfacesRemovedOrder + present)
        state.removeInterfaces(at: path, present)
    }

    private func sendInterfacesRemoved(_ path: DBusObjectPath, _ names: [String]) {
        guard path.isDescendant(ofOrEqualTo: objectManagerPath), path != objectManagerPath else { return }
        try? connection.send(
            .signal(
                path: objectManagerPath, interface: "org.freedesktop.DBus.ObjectManager", name: "InterfacesRemoved",
                body: [.objectPath(path), .stringArray(names)]))
    }

    /// True when an object with at least one interface is exported at `path`.
    public func hasObject(at path: DBusObjectPath) -> Bool { state.hasObject(path) }

    /// The stored value of a property (not wrapped in a variant).
    public func property(at path: DBusObjectPath, interface: String, _ name: String) -> DBusValue? {
        state.property(at: path, interface: interface, name)
    }

    /// Stores a value and queues PropertiesChanged, coalesced per object+interface and flushed before any other
    /// outgoing message or when the dispatch thread idles. `flush: true` sends it at once as its own signal
    /// (used for characteristic Value: one signal per notification even when unchanged).
    public func setProperty(
        at path: DBusObjectPath, interface: String, _ name: String, _ value: DBusValue, flush: Bool = false
    ) {
        if let problem = state.check(path: path, interface: interface, name: name, value: value) {
            warn("setProperty: \(problem)")
            return
        }
        if flush {
            state.store(at: path, interface: interface, name, value, queue: false)
            let signal = DBusMessage.signal(
                path: path, interface: "org.freedesktop.DBus.Properties", name: "PropertiesChanged",
                body: [
                    .string(interface), .stringVariantDictionary([(name, value)]), .stringArray([]),
                ])
            guard let built = try? Marshal.build(signal) else { return }
            try? connection.core.enqueue(.send(built))
        } else {
            if state.store(at: path, interface: interface, name, value, queue: true) {
                connection.core.requestIdleFlush()
            }
        }
    }

    /// Stores a value without any PropertiesChanged: `Get` and `GetAll` return it, nobody is told. For simulating a
    /// daemon that changes a property without signalling it.
    public func storePropertySilently(at path: DBusObjectPath, interface: String, _ name: String, _ value: DBusValue) {
        if let problem = state.check(path: path, interface: interface, name: name, value: value) {
            warn("storePropertySilently: \(problem)")
            return
        }
        state.store(at: path, interface: interface, name, value, queue: false)
    }

    /// Removes a value and queues it in the `invalidated` list.
    public func invalidateProperty(at path: DBusObjectPath, interface: String, _ name: String) {
        if state.invalidate(at: path, interface: interface, name) { connection.core.requestIdleFlush() }
    }

    /// Emits a signal from `path` after flushing pending property changes.
    public func emitSignal(path: DBusObjectPath, interface: String, name: String, arguments: [DBusValue] = []) {
        do {
            try connection.emitSignal(path: path, interface: interface, name: name, arguments: arguments)
        } catch {
            warn("emitSignal \(interface).\(name) on \(path): \(error)")
        }
    }

    /// Sends every pending PropertiesChanged/InterfacesAdded now.
    public func flush() { connection.core.flushClientsNow() }

    /// Runs `body` on the dispatch thread (serialised with method handlers).
    public func perform(_ body: @escaping @Sendable () -> Void) { connection.perform(body) }

    /// Every exported object path (sorted).
    public var objectPaths: [DBusObjectPath] { state.objectPaths() }

    private func warn(_ text: String) {
        let line = "DBusObjectServer: \(text)\n"
        _ = line.withCString { Glibc.write(2, $0, strlen($0)) }
    }
}

extension ConnectionCore {
    /// Moves every client's held-back messages into the queue now.
    func flushClientsNow() {
        shared.withLock { s in
            guard s.connected, !s.stopping else { return }
            for id in s.clientOrder {
                if let client = s.clients[id] {
                    for message in client.takePendingMessages() { s.queue.append(.send(message)) }
                }
            }
            if !s.queue.isEmpty { ConnectionCore.wakeIfSleeping(&s, self) }
        }
    }
}

/// The exported tree and the held-back signals; the connection core holds it as a client.
final class ServerState: ConnectionClient, @unchecked Sendable {
    static let standardInterfacesAddedOrder = [
        "org.freedesktop.DBus.Introspectable", "org.freedesktop.DBus.Properties",
    ]
    static let standardInterfacesRemovedOrder = [
        "org.freedesktop.DBus.Properties", "org.freedesktop.DBus.Introspectable",
    ]

    struct InterfaceEntry {
        var spec: DBusInterfaceSpec
        var values: [String: DBusValue]
    }

    struct Object {
        var interfaces: [String: InterfaceEntry] = [:]
        var order: [String] = []
    }

    struct ChangeKey: Hashable {
        var path: DBusObjectPath
        var interface: String
    }

    struct Change {
        var key: ChangeKey
        var changed: [String: DBusValue] = [:]
        var changedOrder: [String] = []
        var invalidated: [String] = []
    }

    enum Event {
        case added(DBusObjectPath, [String], newObject: Bool)
        case changed(Change)
    }

    struct State {
        var objects: [DBusObjectPath: Object] = [:]
        var events: [Event] = []
    }

    let core: ConnectionCore
    let managerPath: DBusObjectPath
    let state = Mutex(State())

    let errorStyle: DBusPropertyErrorStyle

    init(core: ConnectionCore, managerPath: DBusObjectPath, errorStyle: DBusPropertyErrorStyle) {
        self.core = core
        self.managerPath = managerPath
        self.errorStyle = errorStyle
    }

    enum PropertyFailure {
        case noInterface(String)
        case noPropertyToGet(String)
        case noPropertyToSet(String)
        case notReadable(String)
        case readOnly(String)
        case wrongType(String, expected: String, got: String)
    }

    func error(_ failure: PropertyFailure) -> DBusError {
        let bluez = errorStyle == .bluez
        switch failure {
        case .noInterface(let interface):
            return DBusError(
                name: bluez ? DBusError.invalidArgs : DBusError.unknownInterface,
                message: "No such interface '\(interface)'")
        case .noPropertyToGet(let name):
            return DBusError(
                name: bluez ? DBusError.invalidArgs : DBusError.unknownProperty, message: "No such property '\(name)'")
        case .noPropertyToSet(let name):
            return DBusError(name: DBusError.unknownProperty, message: "No such property '\(name)'")
        case .notReadable(let name):
            return DBusError(
                name: bluez ? DBusError.invalidArgs : DBusError.accessDenied,
                message: "Property '\(name)' is not readable")
        case .readOnly(let name):
            return DBusError(name: DBusError.propertyReadOnly, message: "Property '\(name)' is not writable")
        case .wrongType(let name, let expected, let got):
            if bluez {
                return DBusError(name: DBusError.invalidSignature, message: "Invalid signature for '\(name)'")
            }
            return DBusError(
                name: DBusError.invalidArgs,
                message: "Invalid type for property '\(name)': expected '\(expected)', got '\(got)'")
        }
    }

    /// BlueZ's order: Introspectable, the first interface, Properties, the other interfaces.
    static func withStandardInterfaces(_ names: [String]) -> [String] {
        guard let first = names.first else { return standardInterfacesAddedOrder }
        return ["org.freedesktop.DBus.Introspectable", first, "org.freedesktop.DBus.Properties"] + names.dropFirst()
    }

    // MARK: tree (any thread)

    func addInterfaces(at path: DBusObjectPath, _ interfaces: [(DBusInterfaceSpec, [String: DBusValue])]) {
        state.withLock { s in
            let isNew = s.objects[path] == nil
            var object = s.objects[path] ?? Object()
            var added: [String] = []
            for (spec, values) in interfaces {
                var clean: [String: DBusValue] = [:]
                for (name, value) in values where ServerState.problem(spec: spec, name: name, value: value) == nil {
                    clean[name] = value
                }
                if object.interfaces[spec.name] == nil { object.order.append(spec.name) }
                object.interfaces[spec.name] = InterfaceEntry(spec: spec, values: clean)
                added.append(spec.name)
            }
            s.objects[path] = object
            guard path != managerPath, path.isDescendant(ofOrEqualTo: managerPath) else { return }
            // Merge into a pending InterfacesAdded for the same object.
            for index in s.events.indices {
                if case .added(let p, let names, let newObject) = s.events[index], p == path {
                    s.events[index] = .added(p, names + added.filter { !names.contains($0) }, newObject: newObject)
                    return
                }
            }
            s.events.append(.added(path, added, newObject: isNew))
        }
    }

    func removeInterfaces(at path: DBusObjectPath, _ names: [String]) {
        state.withLock { s in
            guard var object = s.objects[path] else { return }
            for name in names {
                object.interfaces[name] = nil
                object.order.removeAll { $0 == name }
            }
            s.objects[path] = object.order.isEmpty ? nil : object
            // Drop held-back events for what is gone (normally already flushed by the InterfacesRemoved send).
            s.events.removeAll { event in
                switch event {
                case .added(let p, _, _): return p == path && s.objects[path] == nil
                case .changed(let change): return change.key.path == path && names.contains(change.key.interface)
                }
            }
        }
    }

    func interfaceNames(at path: DBusObjectPath) -> [String] { state.withLock { $0.objects[path]?.order ?? [] } }
    func hasObject(_ path: DBusObjectPath) -> Bool { state.withLock { $0.objects[path] != nil } }
    func objectPaths() -> [DBusObjectPath] { state.withLock { $0.objects.keys.sorted() } }

    func property(at path: DBusObjectPath, interface: String, _ name: String) -> DBusValue? {
        state.withLock { $0.objects[path]?.interfaces[interface]?.values[name] }
    }

    static func problem(spec: DBusInterfaceSpec, name: String, value: DBusValue) -> String? {
        do {
            try Marshal.validate(value)
        } catch {
            return "property \(spec.name).\(name): \(error.message)"
        }
        if let declared = spec.property(name), declared.signature.rawValue != value.signatureText {
            return
                "property \(spec.name).\(name): value type \"\(value.signatureText)\" does not match declared \"\(declared.signature.rawValue)\""
        }
        return nil
    }

    /// Why a value cannot be stored, or nil.
    func check(path: DBusObjectPath, interface: String, name: String, value: DBusValue) -> String? {
        guard let spec = state.withLock({ $0.objects[path]?.interfaces[interface]?.spec }) else {
            return "no interface \(interface) at \(path.rawValue)"
        }
        return ServerState.problem(spec: spec, name: name, value: value)
    }

    /// Stores a value; with `queue` also holds back a PropertiesChanged. Returns true when something was queued.
    @discardableResult
    func store(at path: DBusObjectPath, interface: String, _ name: String, _ value: DBusValue, queue: Bool) -> Bool {
        state.withLock { s -> Bool in
            guard s.objects[path]?.interfaces[interface] != nil else { return false }
            s.objects[path]?.interfaces[interface]?.values[name] = value
            let key = ChangeKey(path: path, interface: interface)
            if !queue {
                // The immediate signal carries the newest value; an older held-back one would be stale.
                for index in s.events.indices.reversed() {
                    if case .changed(var change) = s.events[index], change.key == key, change.changed[name] != nil {
                        change.changed[name] = value
                        s.events[index] = .changed(change)
                    }
                }
                return false
            }
            return ServerState.queueChange(&s, key) { change in
                if change.changed[name] == nil { change.changedOrder.append(name) }
                change.changed[name] = value
                change.invalidated.removeAll { $0 == name }
            }
        }
    }

    func invalidate(at path: DBusObjectPath, interface: String, _ name: String) -> Bool {
        state.withLock { s -> Bool in
            guard s.objects[path]?.interfaces[interface] != nil else { return false }
            s.objects[path]?.interfaces[interface]?.values[name] = nil
            return ServerState.queueChange(&s, ChangeKey(path: path, interface: interface)) { change in
                if change.changed.removeValue(forKey: name) != nil { change.changedOrder.removeAll { $0 == name } }
                if !change.invalidated.contains(name) { change.invalidated.append(name) }
            }
        }
    }

    /// Coalesces into the last held-back change of the same object+interface unless an InterfacesAdded was
    /// queued after it (so "services added, then ServicesResolved" keeps its order).
    private static func queueChange(_ s: inout State, _ key: ChangeKey, _ update: (inout Change) -> Void) -> Bool {
        for index in s.events.indices.reversed() {
            switch s.events[index] {
            case .added(let path, let names, _):
                // Still pending: the value goes out inside InterfacesAdded.
                if path == key.path && names.contains(key.interface) { return false }
                var change = Change(key: key)
                update(&change)
                s.events.append(.changed(change))
                return true
            case .changed(var change) where change.key == key:
                update(&change)
                s.events[index] = .changed(change)
                return true
            case .changed:
                continue
            }
        }
        var change = Change(key: key)
        update(&change)
        s.events.append(.changed(change))
        return true
    }

    // MARK: ConnectionClient

    func takePendingMessages() -> [CMessage] {
        state.withLock { s -> [CMessage] in
            guard !s.events.isEmpty else { return [] }
            var messages: [CMessage] = []
            for event in s.events {
                let message: DBusMessage
                switch event {
                case .added(let path, let names, let newObject):
                    guard let object = s.objects[path] else { continue }
                    var entries: [DBusDictEntry] = []
                    for name in newObject ? ServerState.withStandardInterfaces(names) : names {
                        if let entry = object.interfaces[name] {
                            entries.append(DBusDictEntry(key: .string(name), value: ServerState.allProperties(entry)))
                        } else if ServerState.standardInterfacesAddedOrder.contains(name) {
                            entries.append(DBusDictEntry(key: .string(name), value: ServerState.emptyProperties))
                        }
                    }
                    message = .signal(
                        path: managerPath, interface: "org.freedesktop.DBus.ObjectManager", name: "InterfacesAdded",
                        body: [.objectPath(path), .dictionary(key: "s", value: "a{sv}", entries)])
                case .changed(let change):
                    guard !change.changedOrder.isEmpty || !change.invalidated.isEmpty else { continue }
                    message = .signal(
                        path: change.key.path, interface: "org.freedesktop.DBus.Properties", name: "PropertiesChanged",
                        body: [
                            .string(change.key.interface),
                            .stringVariantDictionary(
                                change.changedOrder.compactMap { name in
                                    change.changed[name].map { (name, $0) }
                                }),
                            .stringArray(change.invalidated),
                        ])
                }
                if let built = try? Marshal.build(message) { messages.append(built) }
            }
            s.events.removeAll(keepingCapacity: true)
            return messages
        }
    }

    static let emptyProperties = DBusValue.dictionary(key: "s", value: "v", [])

    static func allProperties(_ entry: InterfaceEntry) -> DBusValue {
        var names: [String] = []
        for property in entry.spec.properties where property.access.readable && entry.values[property.name] != nil {
            names.append(property.name)
        }
        let declared = Set(entry.spec.properties.map(\.name))
        names += entry.values.keys.filter { !declared.contains($0) }.sorted()
        return .stringVariantDictionary(names.compactMap { name in entry.values[name].map { (name, $0) } })
    }

    /// Is `path` an exported object, the manager, or an ancestor of an exported object?
    private func claims(_ s: State, _ path: DBusObjectPath) -> Bool {
        if s.objects[path] != nil || path == managerPath { return true }
        return s.objects.keys.contains { $0 != path && $0.isDescendant(ofOrEqualTo: path) }
    }

    func handleMethodCall(_ message: CMessage, decoded: DBusMessage) -> Bool {
        guard let path = decoded.path, let member = decoded.member else { return false }
        let snapshot = state.withLock { s -> Object?? in
            guard claims(s, path) else { return .none }
            return .some(s.objects[path])
        }
        guard case .some(let object) = snapshot else { return false }
        dispatch(message, decoded, path: path, member: member, object: object)
        return true
    }

    func handleUnclaimedMethodCall(_ message: CMessage, decoded: DBusMessage) -> Bool {
        let reply = DBusPendingReply(core: core, request: message)
        reply.fail(DBusError(name: DBusError.unknownObject, message: ServerState.unknownMethodText(decoded)))
        return true
    }

    static func unknownMethodText(_ message: DBusMessage) -> String {
        "Method \"\(message.member ?? "(null)")\" with signature \"\(message.signature.rawValue)\" on interface \"\(message.interface ?? "(null)")\" doesn't exist\n"
    }

    private func dispatch(
        _ message: CMessage, _ decoded: DBusMessage, path: DBusObjectPath, member: String, object: Object?
    ) {
        let reply = DBusPendingReply(core: core, request: message)
        let signature = decoded.signature.rawValue
        let interface = decoded.interface
        func unknownMethod() {
            reply.fail(
                DBusError(
                    name: object == nil ? DBusError.unknownObject : DBusError.unknownMethod,
                    message: ServerState.unknownMethodText(decoded)))
        }
        switch (interface, member, signature) {
        case ("org.freedesktop.DBus.Introspectable", "Introspect", ""), (nil, "Introspect", ""):
            reply.succeed([.string(introspect(path, object))])
            return
        case ("org.freedesktop.DBus.ObjectManager", "GetManagedObjects", ""),
            (nil, "GetManagedObjects", "") where path == managerPath:
            guard path == managerPath else { break }
            reply.succeed([managedObjects()])
            return
        default:
            break
        }
        if interface == "org.freedesktop.DBus.Properties"
            || (interface == nil && ["Get", "GetAll", "Set"].contains(member))
        {
            guard let object else {
                if path == managerPath {
                    propertiesOnManager(member, signature, decoded, reply, unknownMethod)
                } else {
                    unknownMethod()
                }
                return
            }
            properties(
                member: member, signature: signature, decoded: decoded, path: path, object: object,
                reply: reply, unknownMethod: unknownMethod)
            return
        }
        guard let object else {
            unknownMethod()
            return
        }
        var candidates: [InterfaceEntry] = []
        if let interface {
            if let entry = object.interfaces[interface] { candidates = [entry] }
        } else {
            candidates = object.order.compactMap { object.interfaces[$0] }
        }
        for entry in candidates {
            guard let method = entry.spec.methods.first(where: { $0.name == member }),
                method.acceptsAnySignature || method.inSignature.rawValue == signature
            else { continue }
            let call = DBusMethodCall(
                message: decoded, sender: decoded.sender ?? "", path: path, interface: entry.spec.name, member: member,
                arguments: decoded.body, reply: reply)
            switch method.handler(call) {
            case .reply(let values): reply.succeed(values)
            case .error(let error): reply.fail(error)
            case .deferred: break
            }
            return
        }
        unknownMethod()
    }

    private func propertiesOnManager(
        _ member: String, _ signature: String, _ decoded: DBusMessage, _ reply: DBusPendingReply,
        _ unknownMethod: () -> Void
    ) {
        switch (member, signature) {
        case ("GetAll", "s"): reply.succeed([ServerState.emptyProperties])
        case ("Get", "ss"), ("Set", "ssv"):
            reply.fail(error(.noInterface(decoded.body.first?.string ?? "")))
        default: unknownMethod()
        }
    }

    private func properties(
        member: String, signature: String, decoded: DBusMessage, path: DBusObjectPath, object: Object,
        reply: DBusPendingReply, unknownMethod: () -> Void
    ) {
        let args = decoded.body
        switch (member, signature) {
        case ("Get", "ss"):
            let interface = args[0].string ?? ""
            let name = args[1].string ?? ""
            guard let entry = object.interfaces[interface] else {
                reply.fail(error(.noInterface(interface)))
                return
            }
            guard let value = entry.values[name] else {
                reply.fail(error(.noPropertyToGet(name)))
                return
            }
            if let spec = entry.spec.property(name), !spec.access.readable {
                reply.fail(error(.notReadable(name)))
                return
            }
            reply.succeed([.variant(value)])
        case ("GetAll", "s"):
            let interface = args[0].string ?? ""
            guard let entry = object.interfaces[interface] else {
                reply.fail(error(.noInterface(interface)))
                return
            }
            reply.succeed([ServerState.allProperties(entry)])
        case ("Set", "ssv"):
            let interface = args[0].string ?? ""
            let name = args[1].string ?? ""
            guard let entry = object.interfaces[interface] else {
                reply.fail(error(.noInterface(interface)))
                return
            }
            guard let spec = entry.spec.property(name) else {
                reply.fail(error(.noPropertyToSet(name)))
                return
            }
            guard spec.access.writable else {
                reply.fail(error(.readOnly(name)))
                return
            }
            if errorStyle == .bluez && entry.values[name] == nil {
                reply.fail(error(.noPropertyToSet(name)))
                return
            }
            let value = args[2].variantValue ?? args[2]
            guard value.signatureText == spec.signature.rawValue else {
                reply.fail(error(.wrongType(name, expected: spec.signature.rawValue, got: value.signatureText)))
                return
            }
            if let handler = entry.spec.setHandler, let error = handler(name, value, decoded.sender ?? "") {
                reply.fail(error)
                return
            }
            if store(at: path, interface: interface, name, value, queue: true) { core.requestIdleFlush() }
            reply.succeed([])
        default:
            unknownMethod()
        }
    }

    private func managedObjects() -> DBusValue {
        let objects = state.withLock { s in
            s.objects.filter { $0.key != managerPath && $0.key.isDescendant(ofOrEqualTo: managerPath) }
        }
        var entries: [DBusDictEntry] = []
        for path in objects.keys.sorted() {
            guard let object = objects[path] else { continue }
            var interfaces: [DBusDictEntry] = []
            for name in ServerState.withStandardInterfaces(object.order) {
                if let entry = object.interfaces[name] {
                    interfaces.append(DBusDictEntry(key: .string(name), value: ServerState.allProperties(entry)))
                } else {
                    interfaces.append(DBusDictEntry(key: .string(name), value: ServerState.emptyProperties))
                }
            }
            entries.append(
                DBusDictEntry(key: .objectPath(path), value: .dictionary(key: "s", value: "a{sv}", interfaces)))
        }
        return .dictionary(key: "o", value: "a{sa{sv}}", entries)
    }

    // MARK: introspection

    private func introspect(_ path: DBusObjectPath, _ object: Object?) -> String {
        let children = state.withLock { s -> [String] in
            var names = Set<String>()
            let depth = path.components.count
            for candidate in s.objects.keys where candidate != path && candidate.isDescendant(ofOrEqualTo: path) {
                let components = candidate.components
                if components.count > depth { names.insert(components[depth]) }
            }
            if managerPath != path && managerPath.isDescendant(ofOrEqualTo: path) {
                let components = managerPath.components
                if components.count > depth { names.insert(components[depth]) }
            }
            return names.sorted()
        }
        var xml = """
            <!DOCTYPE node PUBLIC "-//freedesktop//DTD D-BUS Object Introspection 1.0//EN"
            "http://www.freedesktop.org/standards/dbus/1.0/introspect.dtd">
            <node>
              <interface name="org.freedesktop.DBus.Introspectable">
                <method name="Introspect">
                  <arg name="xml" type="s" direction="out"/>
                </method>
              </interface>

            """
        if object != nil || path == managerPath {
            xml += """
                  <interface name="org.freedesktop.DBus.Properties">
                    <method name="Get">
                      <arg name="interface" type="s" direction="in"/>
                      <arg name="name" type="s" direction="in"/>
                      <arg name="value" type="v" direction="out"/>
                    </method>
                    <method name="Set">
                      <arg name="interface" type="s" direction="in"/>
                      <arg name="name" type="s" direction="in"/>
                      <arg name="value" type="v" direction="in"/>
                    </method>
                    <method name="GetAll">
                      <arg name="interface" type="s" direction="in"/>
                      <arg name="properties" type="a{sv}" direction="out"/>
                    </method>
                    <signal name="PropertiesChanged">
                      <arg name="interface" type="s"/>
                      <arg name="changed_properties" type="a{sv}"/>
                      <arg name="invalidated_properties" type="as"/>
                    </signal>
                  </interface>

                """
        }
        if path == managerPath {
            xml += """
                  <interface name="org.freedesktop.DBus.ObjectManager">
                    <method name="GetManagedObjects">
                      <arg name="objects" type="a{oa{sa{sv}}}" direction="out"/>
                    </method>
                    <signal name="InterfacesAdded">
                      <arg name="object" type="o"/>
                      <arg name="interfaces" type="a{sa{sv}}"/>
                    </signal>
                    <signal name="InterfacesRemoved">
                      <arg name="object" type="o"/>
                      <arg name="interfaces" type="as"/>
                    </signal>
                  </interface>

                """
        }
        if let object {
            for name in object.order {
                guard let spec = object.interfaces[name]?.spec else { continue }
                xml += "  <interface name=\"\(xmlEscape(spec.name))\">\n"
                for method in spec.methods {
                    xml += "    <method name=\"\(xmlEscape(method.name))\">\n"
                    for (index, type) in splitSignature(method.inSignature.rawValue).enumerated() {
                        let argName = index < method.argumentNames.count ? method.argumentNames[index] : "arg\(index)"
                        xml +=
                            "      <arg name=\"\(xmlEscape(argName))\" type=\"\(xmlEscape(type))\" direction=\"in\"/>\n"
                    }
                    for (index, type) in splitSignature(method.outSignature.rawValue).enumerated() {
                        let argName = index < method.resultNames.count ? method.resultNames[index] : "result\(index)"
                        xml +=
                            "      <arg name=\"\(xmlEscape(argName))\" type=\"\(xmlEscape(type))\" direction=\"out\"/>\n"
                    }
                    xml += "    </method>\n"
                }
                for signal in spec.signals {
                    xml += "    <signal name=\"\(xmlEscape(signal.name))\">\n"
                    for (index, type) in splitSignature(signal.signature.rawValue).enumerated() {
                        let argName = index < signal.argumentNames.count ? signal.argumentNames[index] : "arg\(index)"
                        xml += "      <arg name=\"\(xmlEscape(argName))\" type=\"\(xmlEscape(type))\"/>\n"
                    }
                    xml += "    </signal>\n"
                }
                for property in spec.properties {
                    xml +=
                        "    <property name=\"\(xmlEscape(property.name))\" type=\"\(xmlEscape(property.signature.rawValue))\" access=\"\(property.access.xml)\"/>\n"
                }
                xml += "  </interface>\n"
            }
        }
        for child in children { xml += "  <node name=\"\(xmlEscape(child))\"/>\n" }
        xml += "</node>\n"
        return xml
    }
}

/// Escapes text for an XML attribute.
func xmlEscape(_ text: String) -> String {
    var out = ""
    for character in text {
        switch character {
        case "&": out += "&amp;"
        case "<": out += "&lt;"
        case ">": out += "&gt;"
        case "\"": out += "&quot;"
        case "'": out += "&apos;"
        default: out.append(character)
        }
    }
    return out
}

/// Splits a signature into its complete types (`"sa{sv}as"` -> `["s", "a{sv}", "as"]`). Invalid input yields
/// whatever prefix parses.
func splitSignature(_ signature: String) -> [String] {
    let chars = Array(signature.utf8)
    var result: [String] = []
    var index = 0
    func end(_ start: Int) -> Int? {
        guard start < chars.count else { return nil }
        switch chars[start] {
        case UInt8(ascii: "a"): return end(start + 1)
        case UInt8(ascii: "("), UInt8(ascii: "{"):
            let close = chars[start] == UInt8(ascii: "(") ? UInt8(ascii: ")") : UInt8(ascii: "}")
            var position = start + 1
            while position < chars.count && chars[position] != close {
                guard let next = end(position) else { return nil }
                position = next
            }
            return position < chars.count ? position + 1 : nil
        default: return start + 1
        }
    }
    while index < chars.count {
        guard let next = end(index) else { break }
        result.append(String(decoding: chars[index..<next], as: UTF8.self))
        index = next
    }
    return result
}
