// The client: one D-Bus connection that mirrors bluetoothd's object tree and follows bluetoothd across restarts.
// Discovery sessions and peripherals (one D-Bus connection each) route their events through this mirror.
import DBus
import Synchronization

/// Something that happened to bluetoothd or an adapter.
public enum BlueZClientEvent: Sendable, Hashable {
    /// bluetoothd appeared on the bus and the mirror was (re)built.
    case bluetoothdStarted
    /// bluetoothd left the bus; every device counts as disconnected.
    case bluetoothdStopped
    /// The connection to the system bus itself was lost (dbus-daemon stopped or restarted): every device counts as
    /// disconnected and every discovery ended. The client reconnects with backoff for as long as it runs.
    case busLost(reason: String)
    /// The bus connection is back after `busLost`; `bluetoothdStarted` follows once bluetoothd is there.
    case busRestored
    /// An adapter appeared.
    case adapterAdded(BlueZAdapter)
    /// An adapter disappeared.
    case adapterRemoved(BlueZAdapter)
    /// An adapter's `Powered` or `Discovering` changed.
    case adapterChanged(BlueZAdapter)
}

/// A central-role client of bluetoothd.
///
/// Create it, call `start()`, use it, call `close()`. All methods are safe to call from any task.
/// The mirror is built with the match rule added *before* `GetManagedObjects`, and rebuilt whenever the owner of
/// `org.bluez` changes (a bluetoothd restart).
public final class BlueZClient: Sendable {
    /// The bus this client uses; peripherals and discovery sessions open their own connections on it.
    public let bus: BlueZBus
    /// The logger given at creation.
    public let logger: BlueZLogger
    /// The client's current bus connection (replaced when the bus comes back after being lost).
    var connection: DBusConnection { core.withLock { $0.connection } }

    struct Core: Sendable {
        var tree = BlueZObjectTree()
        var owner: String?
        /// True once we know whether bluetoothd is there (and loaded the mirror if it is).
        var settled = false
        /// True once the current owner's tree is loaded.
        var loaded = false
        /// The subscribers in the order they subscribed (`handlers` is the same list, kept for each signal).
        var subscribers: [(id: UInt64, handler: @Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void)] = [] {
            didSet { handlers = subscribers.map(\.handler) }
        }
        private(set) var handlers: [@Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void] = []
        /// The advertisement subscribers (`subscribeAdvertisements`), in the order they subscribed.
        var advertisementSubscribers: [(id: UInt64, handler: @Sendable (BlueZDevice) -> Void)] = [] {
            didSet { advertisementHandlers = advertisementSubscribers.map(\.handler) }
        }
        private(set) var advertisementHandlers: [@Sendable (BlueZDevice) -> Void] = []
        /// Where the notifications of a characteristic subscribed with StartNotify go (`routeValues`), by its path.
        var valueRoutes: [String: [(id: UInt64, handler: @Sendable ([UInt8]) -> Void)]] = [:]
        var nextID: UInt64 = 0
        var pump: Task<Void, Never>?
        var closed = false
        var connection: DBusConnection
        /// True between losing the bus connection and opening a new one.
        var busLost = false
        /// The bus refused our GetManagedObjects (its policy denies us org.bluez); nil once it succeeded.
        var accessDenied: BlueZDBusFailure?
    }
    let core: Mutex<Core>
    /// `refreshMissingObjects`' reads of bluetoothd's whole tree, one at a time for any number of callers.
    private let refreshes = SingleFlight<Set<String>?>()

    /// Opens the client's D-Bus connection. Nothing runs until `start()`.
    /// - Throws: `BlueZError.busUnavailable` when the bus cannot be reached.
    public init(bus: BlueZBus = .system, logger: BlueZLogger = .disabled) throws(BlueZError) {
        self.bus = bus
        self.logger = logger
        core = Mutex(Core(connection: try Self.openConnection(bus)))
    }

    static func openConnection(_ bus: BlueZBus) throws(BlueZError) -> DBusConnection {
        do {
            switch bus {
            case .system: return try DBusConnection(.system)
            case .address(let a): return try DBusConnection(.address(a))
            }
        } catch {
            throw .busUnavailable(BlueZDBusFailure(error))
        }
    }

    /// Opens a connection on a thread of its own: the handshake (`Hello`) blocks, and the cooperative pool has
    /// few threads to spare.
    static func openConnectionOffPool(_ bus: BlueZBus) async throws(BlueZError) -> DBusConnection {
        do {
            switch bus {
            case .system: return try await DBusConnection.open(.system)
            case .address(let a): return try await DBusConnection.open(.address(a))
            }
        } catch {
            throw .busUnavailable(BlueZDBusFailure(error))
        }
    }

    /// Creates a client like `init(bus:logger:)`, opening its D-Bus connection on a thread of its own instead of
    /// blocking the calling task's thread while the bus answers.
    /// - Throws: `BlueZError.busUnavailable` when the bus cannot be reached.
    public static func open(bus: BlueZBus = .system, logger: BlueZLogger = .disabled) async throws(BlueZError)
        -> BlueZClient
    {
        BlueZClient(bus: bus, logger: logger, connection: try await openConnectionOffPool(bus))
    }

    private init(bus: BlueZBus, logger: BlueZLogger, connection: DBusConnection) {
        self.bus = bus
        self.logger = logger
        core = Mutex(Core(connection: connection))
    }

    deinit {
        let (pump, connection) = core.withLock { ($0.pump, $0.connection) }
        pump?.cancel()
        connection.close()
    }

    /// Starts following bluetoothd and returns once the mirror is loaded, or once it is known that bluetoothd is
    /// not on the bus (then adapters are `.absent` until it appears).
    /// - Throws: `BlueZError.timeout` when the bus does not answer within `timeout`.
    public func start(timeout: Duration = .seconds(10)) async throws(BlueZError) {
        let shot = OneShot<Bool>()
        let id = subscribe { _, _ in if self.core.withLock({ $0.settled }) { shot.complete(true) } }
        defer { unsubscribe(id) }
        let started: Bool = core.withLock { core in
            if core.pump != nil { return false }
            let box = WeakClient(self)
            core.pump = Task { await BlueZClientPump.run(box, settled: shot) }
            return true
        }
        if !started, core.withLock({ $0.settled }) { return }
        let timer = Task {
            try? await Task.sleep(for: timeout)
            shot.complete(false)
        }
        defer { timer.cancel() }
        let value = await shot.value()
        if value != true, let denied = core.withLock({ $0.accessDenied }) {
            throw .notPermitted(
                device: nil,
                operation: "read BlueZ's object tree: the system bus's D-Bus policy does not let this user call "
                    + "org.bluez (BlueZ's policy, /etc/dbus-1/system.d/bluetooth.conf, allows root and the "
                    + "'bluetooth' group: add the user to that group, e.g. 'usermod -aG bluetooth USER', or set "
                    + "SupplementaryGroups=bluetooth in its systemd unit)",
                failure: denied)
        }
        switch value {
        case true?: return
        case false?: throw .timeout(device: nil, operation: "loading BlueZ's object tree", seconds: timeout.seconds)
        case nil: throw .cancelled(operation: "loading BlueZ's object tree")
        }
    }

    /// Stops following bluetoothd and closes the connection. Idempotent.
    public func close() {
        let (pump, connection) = core.withLock { core -> (Task<Void, Never>?, DBusConnection) in
            core.closed = true
            defer { core.pump = nil }
            return (core.pump, core.connection)
        }
        pump?.cancel()
        connection.close()
    }

    /// True while bluetoothd owns `org.bluez` and the mirror is loaded.
    public var isBluetoothdRunning: Bool { core.withLock { $0.owner != nil && $0.loaded } }

    /// False from losing the system bus connection (`BlueZClientEvent.busLost`) until a new one is open.
    public var isBusConnected: Bool { core.withLock { !$0.busLost && !$0.closed } }

    // MARK: the pump (see BlueZClientPump)

    /// bluetoothd (`owner`) owns org.bluez now; its tree is loaded by the follower.
    fileprivate func ownerAppeared(_ owner: String) {
        logger.info("bluetoothd is on the bus as \(owner)")
        core.withLock {
            $0.owner = owner
            $0.loaded = false
        }
    }

    /// Nobody owns org.bluez.
    fileprivate func ownerAbsent(settled: OneShot<Bool>) {
        logger.info("bluetoothd (org.bluez) is not on the bus")
        let handlers = core.withLock { core -> [@Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void] in
            core.settled = true
            return core.handlers
        }
        settled.complete(true)
        let tree = self.tree
        for h in handlers { h(.reloaded, tree) }
    }

    /// A GetManagedObjects reply from the current owner: the mirror is rebuilt from it.
    fileprivate func load(_ reply: [DBusValue], settled: OneShot<Bool>) {
        let handlers = core.withLock { core -> [@Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void] in
            core.tree.load(managedObjects: reply.first ?? .array("a{oa{sa{sv}}}", []))
            core.settled = true
            core.loaded = true
            return core.handlers
        }
        let tree = self.tree
        logger.debug("loaded BlueZ's object tree: \(tree.adapters.count) adapter(s), \(tree.devices.count) device(s)")
        settled.complete(true)
        for h in handlers { h(.reloaded, tree) }
    }

    /// bluetoothd left the bus (`busLost` false) or the bus connection died (true): the mirror is cleared and every
    /// subscriber told.
    fileprivate func daemonLost(busLost: Bool) {
        let (previous, handlers, hadOwner) = core.withLock { core in
            let previous = core.tree
            let hadOwner = core.owner != nil
            core.tree.clear()
            core.owner = nil
            core.loaded = false
            if busLost { core.busLost = true }
            return (previous, core.handlers, hadOwner)
        }
        if busLost {
            logger.error(
                "lost the connection to the D-Bus system bus; every device counts as disconnected; reconnecting")
        } else if hadOwner {
            logger.warning("bluetoothd left the bus; every device counts as disconnected")
        } else {
            return
        }
        let empty = BlueZObjectTree()
        for h in handlers { h(.daemonLost(previous: previous, busLost: busLost), empty) }
    }

    /// A new bus connection replaces the lost one.
    fileprivate func busRestored(_ connection: DBusConnection) {
        let (old, handlers) = core.withLock { core in
            let old = core.connection
            core.connection = connection
            core.busLost = false
            return (old, core.handlers)
        }
        Task { await old.closeAndWait() }
        logger.info("reconnected to the D-Bus system bus as \(connection.uniqueName)")
        let tree = self.tree
        for h in handlers { h(.busRestored, tree) }
    }

    fileprivate var isClosed: Bool { core.withLock { $0.closed } }

    /// A signal read in place: discovery's advertisement updates are applied as they are read; anything else is
    /// decoded and applied as a message.
    /// An advertisement goes to the advertisement subscribers only, with the device as it is now and no copy of the
    /// tree: it is the signal discovery sends all the time, and nothing else needs it.
    /// A notification of a characteristic subscribed with StartNotify goes to its route only (`routeValues`), as
    /// read from the message: not decoded into a dictionary and handed to every subscriber, which with a hundred
    /// connected devices made each value cost a hundred handler calls.
    fileprivate func dispatch(_ signal: DBusSignalView) {
        enum Fast {
            case advertisement(BlueZDevice, [@Sendable (BlueZDevice) -> Void])
            case value([UInt8], [(id: UInt64, handler: @Sendable ([UInt8]) -> Void)])
        }
        let result = core.withLock { core -> Fast? in
            guard signal.isSignal(interface: BlueZName.properties, member: "PropertiesChanged") else { return nil }
            if let device = core.tree.applyAdvertisement(signal) {
                return .advertisement(device, core.advertisementHandlers)
            }
            guard !core.valueRoutes.isEmpty, let (path, value) = BlueZObjectTree.readValueSignal(signal),
                let routes = core.valueRoutes[path], core.tree.setValue(value, at: path)
            else { return nil }
            return .value(value, routes)
        }
        switch result {
        case .advertisement(let device, let handlers)?:
            for h in handlers { h(device) }
        case .value(let value, let routes)?:
            BlueZSignalRounds.carriedMore.store(true, ordering: .relaxed)
            for r in routes { r.handler(value) }
        case nil:
            BlueZSignalRounds.carriedMore.store(true, ordering: .relaxed)
            if let message = try? signal.decode() { dispatch(message) }
        }
    }

    fileprivate func dispatch(_ message: DBusMessage) {
        let result = core.withLock {
            core -> (BlueZTreeEvent, BlueZObjectTree, [@Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void])? in
            guard let event = core.tree.apply(message) else { return nil }
            return (event, core.tree, core.handlers)
        }
        guard let (event, tree, handlers) = result else { return }
        for h in handlers { h(event, tree) }
    }

    // MARK: subscriptions and waits

    /// Registers a handler called after each change to the mirror, in signal order: signals on the D-Bus I/O
    /// thread, the other changes (load, bluetoothd lost, bus restored) in order with them. It must not block.
    func subscribe(_ handler: @escaping @Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void) -> UInt64 {
        core.withLock { core in
            core.nextID += 1
            core.subscribers.append((core.nextID, handler))
            return core.nextID
        }
    }

    /// Registers a handler called with the device after each advertisement (a PropertiesChanged of Device1 that only
    /// touched RSSI, TxPower, ManufacturerData or ServiceData), on the D-Bus I/O thread in signal order with the
    /// `subscribe` handlers, which do not get these. It must not block. `unsubscribe` removes it.
    func subscribeAdvertisements(_ handler: @escaping @Sendable (BlueZDevice) -> Void) -> UInt64 {
        core.withLock { core in
            core.nextID += 1
            core.advertisementSubscribers.append((core.nextID, handler))
            return core.nextID
        }
    }

    /// Sends the notifications of the characteristic at `path` (a `PropertiesChanged` that changed its `Value` alone)
    /// to `handler` instead of to the `subscribe` handlers, on the D-Bus I/O thread in signal order. Any other change
    /// of the characteristic (`Notifying`, a `Value` with other properties) still goes to every subscriber. It must
    /// not block. `unrouteValues` removes it.
    func routeValues(of path: String, to handler: @escaping @Sendable ([UInt8]) -> Void) -> UInt64 {
        core.withLock { core in
            core.nextID += 1
            core.valueRoutes[path, default: []].append((core.nextID, handler))
            return core.nextID
        }
    }

    func unrouteValues(of path: String, id: UInt64) {
        core.withLock { core in
            core.valueRoutes[path]?.removeAll { $0.id == id }
            if core.valueRoutes[path]?.isEmpty == true { core.valueRoutes[path] = nil }
        }
    }

    func unsubscribe(_ id: UInt64) {
        core.withLock { core in
            if core.subscribers.contains(where: { $0.id == id }) {
                core.subscribers.removeAll { $0.id == id }
            } else {
                core.advertisementSubscribers.removeAll { $0.id == id }
            }
        }
    }

    /// The current mirror.
    var tree: BlueZObjectTree { core.withLock { $0.tree } }

    /// Waits until `check` returns a value (it is tried now and after every change), or `timeout` passes (nil).
    func wait<T: Sendable>(
        timeout: Duration, _ check: @escaping @Sendable (BlueZTreeEvent?, BlueZObjectTree) -> T?
    ) async -> T? {
        let shot = OneShot<T?>()
        let id = subscribe { event, tree in
            if !shot.isCompleted, let value = check(event, tree) { shot.complete(value) }
        }
        defer { unsubscribe(id) }
        if let value = check(nil, tree) { shot.complete(value) }
        let timer = Task {
            try? await Task.sleep(for: timeout)
            shot.complete(nil)
        }
        defer { timer.cancel() }
        // OneShot.value() returns nil when this task is cancelled.
        return await shot.value() ?? nil
    }

    /// Adds objects bluetoothd exports but the mirror lacks (bluez#1489: `ServicesResolved` before the objects).
    /// Returns the paths bluetoothd exports (nil when it did not answer). Callers at the same time share the reads
    /// (`SingleFlight`): each gets a tree read after it asked, but at most one read is under way and one queued.
    @discardableResult
    func refreshMissingObjects() async -> Set<String>? {
        await refreshes.value { [weak self] in await self?.readMissingObjects() } ?? nil
    }

    /// One GetManagedObjects for `refreshMissingObjects`.
    private func readMissingObjects() async -> Set<String>? {
        guard let owner = core.withLock({ $0.owner }) else { return nil }
        // Read in place: of bluetoothd's whole tree (hundreds of KB with a hundred connected devices, read after
        // every connect) only the objects the mirror lacks are decoded; the whole reply as values and a second
        // tree built from it were the bridge's peak of heap.
        let known = tree
        guard
            let (exported, candidates) = try? await connection.call(
                destination: owner, path: "/", interface: BlueZName.objectManager, method: "GetManagedObjects",
                reading: { reader throws(DBusError) in try BlueZObjectTree.readMissing(&reader, from: known) })
        else { return nil }
        let (added, handlers) = core.withLock { core in
            var added: [(String, [String: [String: DBusValue]])] = []
            for (path, interfaces) in candidates where !core.tree.hasObject(path) {
                added.append((path, interfaces))
            }
            for (path, interfaces) in added {
                let body: [DBusValue] = [
                    .objectPath(DBusObjectPath(stringLiteral: path)),
                    .dictionary(
                        key: "s", value: "a{sv}",
                        interfaces.map { name, props in
                            DBusDictEntry(
                                key: .string(name),
                                value: .stringVariantDictionary(props.map { ($0.key, $0.value) }))
                        }),
                ]
                var message = DBusMessage.signal(
                    path: "/", interface: BlueZName.objectManager, name: "InterfacesAdded", body: body)
                message.sender = core.owner
                _ = core.tree.apply(message)
            }
            return (added, core.handlers)
        }
        guard !added.isEmpty else { return exported }
        logger.debug("GetManagedObjects found \(added.count) object(s) the signals had not announced yet")
        let tree = self.tree
        for (path, interfaces) in added {
            for h in handlers { h(.interfacesAdded(path: path, interfaces: interfaces), tree) }
        }
        return exported
    }

    // MARK: adapters

    /// Every adapter, in path order.
    public var adapters: [BlueZAdapter] { tree.adapters }

    /// The state of the adapter `selector` picks.
    public func adapterState(_ selector: BlueZAdapterSelector = .any) -> BlueZAdapterState {
        tree.adapterState(selector)
    }

    /// The state of the selected adapter now, then each time it changes (appears, disappears, powers on or off).
    /// The stream ends when the consuming task is cancelled.
    public func adapterStates(_ selector: BlueZAdapterSelector = .any) -> AsyncStream<BlueZAdapterState> {
        let (stream, continuation) = AsyncStream<BlueZAdapterState>.makeStream(bufferingPolicy: .bufferingNewest(16))
        let last = Mutex<BlueZAdapterState?>(nil)
        let emit: @Sendable (BlueZObjectTree) -> Void = { tree in
            let state = tree.adapterState(selector)
            let changed = last.withLock { last -> Bool in
                if last == state { return false }
                last = state
                return true
            }
            if changed { continuation.yield(state) }
        }
        let id = subscribe { event, tree in if event.touchesAdapters { emit(tree) } }
        emit(tree)
        continuation.onTermination = { [weak self] _ in self?.unsubscribe(id) }
        return stream
    }

    /// Client-level events (bluetoothd and adapters coming and going). Ends when the consumer is cancelled.
    public func events() -> AsyncStream<BlueZClientEvent> {
        let (stream, continuation) = AsyncStream<BlueZClientEvent>.makeStream(bufferingPolicy: .bufferingNewest(64))
        let known = Mutex<[String: BlueZAdapter]>(Dictionary(uniqueKeysWithValues: adapters.map { ($0.path, $0) }))
        let id = subscribe { event, tree in
            // Most signals are about devices (every advertisement is a PropertiesChanged): nothing to compare.
            guard event.touchesAdapters else { return }
            var out: [BlueZClientEvent] = []
            if case .daemonLost(_, let busLost) = event {
                out.append(busLost ? .busLost(reason: "the connection to the system bus was lost") : .bluetoothdStopped)
            }
            if case .busRestored = event { out.append(.busRestored) }
            let now = Dictionary(uniqueKeysWithValues: tree.adapters.map { ($0.path, $0) })
            known.withLock { known in
                for (path, adapter) in known where now[path] == nil { out.append(.adapterRemoved(adapter)) }
                for (path, adapter) in now.sorted(by: { $0.key < $1.key }) {
                    if let old = known[path] {
                        if old != adapter { out.append(.adapterChanged(adapter)) }
                    } else {
                        out.append(.adapterAdded(adapter))
                    }
                }
                known = now
            }
            // Started comes last, once the adapters it brought are reported.
            if case .reloaded = event, !tree.adapters.isEmpty { out.append(.bluetoothdStarted) }
            for e in out { continuation.yield(e) }
        }
        continuation.onTermination = { [weak self] _ in self?.unsubscribe(id) }
        return stream
    }

    /// Waits until the selected adapter exists and is powered.
    /// - Throws: `BlueZError.adapterUnavailable` naming why (absent, powered off) when `timeout` passes first.
    public func waitForAdapter(_ selector: BlueZAdapterSelector = .any, timeout: Duration = .zero)
        async throws(BlueZError) -> BlueZAdapter
    {
        if let adapter = await wait(
            timeout: timeout,
            { _, tree -> BlueZAdapter? in
                if case .on(let a) = tree.adapterState(selector) { return a }
                return nil
            })
        {
            return adapter
        }
        if Task.isCancelled { throw .cancelled(operation: "waiting for adapter \(selector)") }
        throw unavailable(selector)
    }

    func unavailable(_ selector: BlueZAdapterSelector) -> BlueZError {
        let name = selector == .any ? "(default)" : selector.description
        if !isBluetoothdRunning {
            return .adapterUnavailable(
                adapter: name, reason: "bluetoothd (org.bluez) is not running; start bluetooth.service")
        }
        switch adapterState(selector) {
        case .absent:
            let present = adapters.map(\.name).joined(separator: ", ")
            return .adapterUnavailable(
                adapter: name,
                reason: present.isEmpty ? "no Bluetooth adapter found" : "no such adapter (present: \(present))")
        case .off(let a):
            return .adapterUnavailable(adapter: a.name, reason: "powered off (try 'bluetoothctl power on')")
        case .on(let a):
            return .adapterUnavailable(adapter: a.name, reason: "not ready")
        }
    }

    /// Powers an adapter on or off (`Powered`).
    public func setPowered(_ powered: Bool, adapter: BlueZAdapter) async throws(BlueZError) {
        do {
            _ = try await connection.call(
                destination: BlueZName.service, path: DBusObjectPath(stringLiteral: adapter.path),
                interface: BlueZName.properties, method: "Set",
                arguments: [.string(BlueZName.adapter), .string("Powered"), .variant(.boolean(powered))])
        } catch {
            let operation = "power \(powered ? "on" : "off") \(adapter.name)"
            if error.name == DBusError.cancelled { throw .cancelled(operation: operation) }
            throw .failed(device: nil, operation: operation, failure: .init(error))
        }
    }

    // MARK: devices

    /// Every device BlueZ knows on `adapter` (all adapters when nil), in path order.
    public func devices(on adapter: BlueZAdapter? = nil) -> [BlueZDevice] {
        tree.devices.filter { adapter == nil || $0.adapterPath == adapter?.path }
    }

    /// The device with `address` on `adapter`, if BlueZ knows it.
    public func device(address: String, on adapter: BlueZAdapter? = nil) -> BlueZDevice? {
        tree.device(address: address, adapterPath: adapter?.path)
    }

    /// The device at `path`, if it is still in the mirror.
    public func device(atPath path: String) -> BlueZDevice? { tree.device(at: path) }

    /// Disconnects a device this client holds no `BlueZPeripheral` for (`Device1.Disconnect`): a link an earlier
    /// process made, which bluetoothd keeps when its client goes away.
    public func disconnect(_ device: BlueZDevice) async throws(BlueZError) {
        do {
            _ = try await connection.call(
                destination: BlueZName.service, path: DBusObjectPath(stringLiteral: device.path),
                interface: BlueZName.device, method: "Disconnect")
        } catch {
            if error.name == "org.bluez.Error.DoesNotExist" || error.name == DBusError.unknownObject {
                throw .deviceNotFound(device: device.label, failure: .init(error))
            }
            if error.name == DBusError.cancelled { throw .cancelled(operation: "device \(device.label): disconnect") }
            throw .failed(device: device.label, operation: "disconnect", failure: .init(error))
        }
    }

    /// Removes a device from BlueZ (`Adapter1.RemoveDevice`); it disconnects first if connected.
    public func removeDevice(_ device: BlueZDevice) async throws(BlueZError) {
        do {
            _ = try await connection.call(
                destination: BlueZName.service, path: DBusObjectPath(stringLiteral: device.adapterPath),
                interface: BlueZName.adapter, method: "RemoveDevice",
                arguments: [.objectPath(DBusObjectPath(stringLiteral: device.path))])
        } catch {
            if error.name == "org.bluez.Error.DoesNotExist" || error.name == DBusError.unknownObject {
                throw .deviceNotFound(device: device.label, failure: .init(error))
            }
            if error.name == DBusError.cancelled { throw .cancelled(operation: "device \(device.label): remove") }
            throw .failed(device: device.label, operation: "remove", failure: .init(error))
        }
    }
}

/// The client, held weakly: the pump's tasks take a strong reference only between waits, so a client that is
/// dropped without `close()` is freed and its deinit stops the pump.
final class WeakClient: Sendable {
    weak let value: BlueZClient?
    init(_ value: BlueZClient) { self.value = value }
}

/// Delays between retries: 100 ms doubling to 5 s, for as long as the client runs.
struct Backoff: Sendable {
    private(set) var next: Duration = .milliseconds(100)
    mutating func take() -> Duration {
        defer { next = min(next * 2, .seconds(5)) }
        return next
    }
    mutating func reset() { next = .milliseconds(100) }
}

/// The client's pump: watches the owner of org.bluez on the current bus connection, follows each owner (match
/// rule, then GetManagedObjects, then signals in order), and when the bus connection dies reports it and opens a
/// new one with backoff. Every retry goes on until the client is closed or dropped.
enum BlueZClientPump {
    static func run(_ box: WeakClient, settled: OneShot<Bool>) async {
        var backoff = Backoff()
        while !Task.isCancelled {
            guard let connection = box.value?.connection else { return }
            if connection.isConnected {
                if await watchOwner(box, connection, settled: settled) { backoff.reset() }
                if Task.isCancelled { return }
            }
            guard let client = box.value, !client.isClosed else { return }
            if connection.isConnected {
                // The watch could not start on a live connection (AddMatch or GetNameOwner failed): try again.
                await nap(backoff.take())
                continue
            }
            client.daemonLost(busLost: true)
            let bus = client.bus
            _ = consume client
            while !Task.isCancelled {
                await nap(backoff.take())
                if Task.isCancelled { return }
                do {
                    let fresh = try await BlueZClient.openConnectionOffPool(bus)
                    guard let client = box.value, !client.isClosed, !Task.isCancelled else {
                        await fresh.closeAndWait()
                        return
                    }
                    client.busRestored(fresh)
                    backoff.reset()
                    break
                } catch {
                    box.value?.logger.debug("the system bus is still unreachable: \(error)")
                }
            }
        }
    }

    /// Follows the owner of org.bluez until `connection` ends. Returns false when the watch could not start.
    private static func watchOwner(_ box: WeakClient, _ connection: DBusConnection, settled: OneShot<Bool>) async
        -> Bool
    {
        let owners: DBusNameOwnerStream
        do {
            owners = try await connection.nameOwnerChanges(BlueZName.service)
        } catch {
            box.value?.logger.warning("cannot watch org.bluez on the bus: \(error); retrying")
            return false
        }
        var follower: Task<Void, Never>?
        for await owner in owners {
            if Task.isCancelled { break }
            follower?.cancel()
            await follower?.value
            follower = nil
            guard let client = box.value else { break }
            client.daemonLost(busLost: false)
            if let owner {
                client.ownerAppeared(owner)
                follower = Task { await follow(box, connection, owner: owner, settled: settled) }
            } else {
                client.ownerAbsent(settled: settled)
            }
        }
        follower?.cancel()
        await follower?.value
        return true
    }

    /// Subscribes to every signal bluetoothd (`owner`) sends, then loads the tree, then applies signals in order,
    /// all on the connection's I/O thread: the GetManagedObjects reply is loaded there in order with the signals,
    /// the signals that came before it (older than the snapshot) are skipped and every later one is applied as it
    /// is dispatched, so nothing queues between the bus and the mirror. The match rule and GetManagedObjects are
    /// retried with backoff until the owner changes (this task is then cancelled) or the connection ends.
    private static func follow(_ box: WeakClient, _ connection: DBusConnection, owner: String, settled: OneShot<Bool>)
        async
    {
        var backoff = Backoff()
        let feed = MirrorFeed()
        var subscribed: DBusSignalSubscription?
        while subscribed == nil, !Task.isCancelled, connection.isConnected {
            do {
                subscribed = try await connection.signals(
                    matching: DBusMatchRule(type: .signal, sender: owner), ended: { feed.end() },
                    // The box held strongly (it is the pump's, and holds the client weakly): one weak load per
                    // signal, not two, and no side-table retain and release of the box.
                    reader: { signal in feed.receive { box.value?.dispatch(signal) } })
            } catch {
                box.value?.logger.warning("cannot add a match rule for bluetoothd's signals: \(error); retrying")
                await nap(backoff.take())
            }
        }
        guard let subscription = subscribed else { return }
        defer {
            // After close() no handler runs (one running now finishes first): the next owner's follower, or
            // daemonLost, cannot interleave with a late signal of this one.
            feed.close()
            subscription.cancel()
        }
        backoff.reset()
        var attempt = 0
        let call = DBusMessage.methodCall(
            destination: owner, path: "/", interface: BlueZName.objectManager, method: "GetManagedObjects", body: [])
        while !Task.isCancelled, connection.isConnected {
            attempt += 1
            do {
                _ = try await connection.call(call, timeout: .seconds(10)) { reply in
                    feed.load {
                        guard let client = box.value else { return }
                        client.core.withLock { $0.accessDenied = nil }
                        client.load(reply.body, settled: settled)
                    }
                }
                break
            } catch {
                if error.name == DBusError.accessDenied, let client = box.value {
                    // Not a daemon still starting: the bus's policy refuses us. start() says so (and how to fix it)
                    // at once; retrying goes on in case the policy is changed while we run.
                    let first = client.core.withLock { core -> Bool in
                        let first = core.accessDenied == nil
                        core.accessDenied = BlueZDBusFailure(error)
                        return first
                    }
                    if first { client.logger.error("org.bluez refused GetManagedObjects: \(error)") }
                    settled.complete(false)
                }
                // bluetoothd may own the name before it exports its ObjectManager.
                box.value?.logger.debug("GetManagedObjects failed (attempt \(attempt)): \(error)")
                await nap(backoff.take())
            }
        }
        // Signals are applied on the I/O thread from here on; wait for the owner to change or the bus to go.
        _ = await feed.ended.value()
    }
}

/// Orders the mirror's input on the I/O thread: signals are skipped until the snapshot is loaded (they are older
/// than it), then applied one at a time; after `close()` nothing is applied.
final class MirrorFeed: Sendable {
    private struct State {
        var loaded = false
        var closed = false
    }
    private let state = Mutex(State())
    /// Completed when the connection ended.
    let ended = OneShot<Bool>()

    func receive(_ apply: () -> Void) {
        state.withLock { s in
            guard s.loaded, !s.closed else { return }
            apply()
        }
    }

    func load(_ body: () -> Void) {
        state.withLock { s in
            guard !s.closed else { return }
            body()
            s.loaded = true
        }
    }

    func close() { state.withLock { $0.closed = true } }

    func end() { ended.complete(true) }
}
