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
    let connection: DBusConnection

    struct Core: Sendable {
        var tree = BlueZObjectTree()
        var owner: String?
        /// True once we know whether bluetoothd is there (and loaded the mirror if it is).
        var settled = false
        /// True once the current owner's tree is loaded.
        var loaded = false
        var subscribers: [UInt64: @Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void] = [:]
        var nextID: UInt64 = 0
        var pump: Task<Void, Never>?
        var closed = false
    }
    let core = Mutex(Core())

    /// Opens the client's D-Bus connection. Nothing runs until `start()`.
    /// - Throws: `BlueZError.busUnavailable` when the bus cannot be reached.
    public init(bus: BlueZBus = .system, logger: BlueZLogger = .disabled) throws(BlueZError) {
        self.bus = bus
        self.logger = logger
        connection = try Self.openConnection(bus)
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

    deinit {
        core.withLock { $0.pump }?.cancel()
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
            core.pump = Task { [weak self] in await self?.runPump(settled: shot) }
            return true
        }
        if !started, core.withLock({ $0.settled }) { return }
        let timer = Task {
            try? await Task.sleep(for: timeout)
            shot.complete(false)
        }
        defer { timer.cancel() }
        switch await shot.value() {
        case true?: return
        case false?: throw .timeout(device: nil, operation: "loading BlueZ's object tree", seconds: timeout.seconds)
        case nil: throw .cancelled(operation: "loading BlueZ's object tree")
        }
    }

    /// Stops following bluetoothd and closes the connection. Idempotent.
    public func close() {
        let pump = core.withLock { core -> Task<Void, Never>? in
            core.closed = true
            defer { core.pump = nil }
            return core.pump
        }
        pump?.cancel()
        connection.close()
    }

    /// True while bluetoothd owns `org.bluez` and the mirror is loaded.
    public var isBluetoothdRunning: Bool { core.withLock { $0.owner != nil && $0.loaded } }

    // MARK: the pump

    private func runPump(settled: OneShot<Bool>) async {
        let owners: DBusNameOwnerStream
        do {
            owners = try await connection.nameOwnerChanges(BlueZName.service)
        } catch {
            logger.error("cannot watch org.bluez on the bus: \(error)")
            settled.complete(false)
            return
        }
        var follower: Task<Void, Never>?
        for await owner in owners {
            if Task.isCancelled { break }
            follower?.cancel()
            await follower?.value
            follower = nil
            let previousOwner = core.withLock { $0.owner }
            if previousOwner != nil {
                daemonLost()
            }
            if let owner {
                logger.info("bluetoothd is on the bus as \(owner)")
                core.withLock {
                    $0.owner = owner
                    $0.loaded = false
                }
                follower = Task { [weak self] in await self?.follow(owner: owner, settled: settled) }
            } else {
                logger.info("bluetoothd (org.bluez) is not on the bus")
                let handlers = core.withLock { core -> [@Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void] in
                    core.settled = true
                    return Array(core.subscribers.values)
                }
                settled.complete(true)
                let tree = self.tree
                for h in handlers { h(.reloaded, tree) }
            }
        }
        follower?.cancel()
        await follower?.value
    }

    private func daemonLost() {
        logger.warning("bluetoothd left the bus; every device counts as disconnected")
        let (previous, handlers) = core.withLock { core in
            let previous = core.tree
            core.tree.clear()
            core.owner = nil
            core.loaded = false
            return (previous, Array(core.subscribers.values))
        }
        let empty = BlueZObjectTree()
        for h in handlers { h(.daemonLost(previous: previous), empty) }
    }

    /// Subscribes to every signal bluetoothd (`owner`) sends, then loads the tree, then applies signals in order.
    private func follow(owner: String, settled: OneShot<Bool>) async {
        let stream: DBusSignalStream
        do {
            stream = try await connection.signals(matching: DBusMatchRule(type: .signal, sender: owner))
        } catch {
            logger.error("cannot add a match rule for bluetoothd's signals: \(error)")
            return
        }
        var loaded = false
        for attempt in 0..<20 where !Task.isCancelled {
            do {
                let reply = try await connection.call(
                    destination: owner, path: "/", interface: BlueZName.objectManager, method: "GetManagedObjects",
                    timeout: .seconds(10))
                let handlers = core.withLock { core -> [@Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void] in
                    core.tree.load(managedObjects: reply.first ?? .array("a{oa{sa{sv}}}", []))
                    core.settled = true
                    core.loaded = true
                    return Array(core.subscribers.values)
                }
                loaded = true
                logger.debug(
                    "loaded BlueZ's object tree: \(tree.adapters.count) adapter(s), \(tree.devices.count) device(s)")
                settled.complete(true)
                let tree = self.tree
                for h in handlers { h(.reloaded, tree) }
                break
            } catch {
                // bluetoothd may own the name before it exports its ObjectManager.
                logger.debug("GetManagedObjects failed (attempt \(attempt + 1)): \(error)")
                await nap(.milliseconds(100))
            }
        }
        guard loaded else { return }
        for await message in stream {
            if Task.isCancelled { break }
            dispatch(message)
        }
    }

    private func dispatch(_ message: DBusMessage) {
        let result = core.withLock {
            core -> (BlueZTreeEvent, BlueZObjectTree, [@Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void])? in
            guard let event = core.tree.apply(message) else { return nil }
            return (event, core.tree, Array(core.subscribers.values))
        }
        guard let (event, tree, handlers) = result else { return }
        for h in handlers { h(event, tree) }
    }

    // MARK: subscriptions and waits

    /// Registers a handler called (on the pump task, in signal order) after each change to the mirror.
    func subscribe(_ handler: @escaping @Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void) -> UInt64 {
        core.withLock { core in
            core.nextID += 1
            core.subscribers[core.nextID] = handler
            return core.nextID
        }
    }

    func unsubscribe(_ id: UInt64) {
        _ = core.withLock { $0.subscribers.removeValue(forKey: id) }
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
    func refreshMissingObjects() async {
        guard let owner = core.withLock({ $0.owner }) else { return }
        guard
            let reply = try? await connection.call(
                destination: owner, path: "/", interface: BlueZName.objectManager, method: "GetManagedObjects")
        else { return }
        var fresh = BlueZObjectTree()
        fresh.load(managedObjects: reply.first ?? .array("a{oa{sa{sv}}}", []))
        let (added, handlers) = core.withLock { core in
            var added: [(String, [String: [String: DBusValue]])] = []
            for (path, interfaces) in fresh.objects where core.tree.objects[path] == nil {
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
            return (added, Array(core.subscribers.values))
        }
        guard !added.isEmpty else { return }
        logger.debug("GetManagedObjects found \(added.count) object(s) the signals had not announced yet")
        let tree = self.tree
        for (path, interfaces) in added {
            for h in handlers { h(.interfacesAdded(path: path, interfaces: interfaces), tree) }
        }
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
        let id = subscribe { _, tree in emit(tree) }
        emit(tree)
        continuation.onTermination = { [weak self] _ in self?.unsubscribe(id) }
        return stream
    }

    /// Client-level events (bluetoothd and adapters coming and going). Ends when the consumer is cancelled.
    public func events() -> AsyncStream<BlueZClientEvent> {
        let (stream, continuation) = AsyncStream<BlueZClientEvent>.makeStream(bufferingPolicy: .bufferingNewest(64))
        let known = Mutex<[String: BlueZAdapter]>(Dictionary(uniqueKeysWithValues: adapters.map { ($0.path, $0) }))
        let id = subscribe { event, tree in
            var out: [BlueZClientEvent] = []
            if case .daemonLost = event { out.append(.bluetoothdStopped) }
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
            throw .failed(
                device: nil, operation: "power \(powered ? "on" : "off") \(adapter.name)", failure: .init(error))
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
            throw .failed(device: device.label, operation: "remove", failure: .init(error))
        }
    }
}
