// A connected peripheral: calls on the client's D-Bus connection, StartNotify sessions on a connection of their own
// (so BlueZ's per-sender notify sessions die with the peripheral), connect with the retries real BlueZ needs, GATT
// reads/writes/notifications, and disconnects told apart by cause.
import DBus
import Synchronization

/// Why a connection ended.
public struct BlueZDisconnectReason: Sendable, Hashable, CustomStringConvertible {
    /// The cause, coarse.
    public enum Kind: String, Sendable, Hashable {
        /// Terminated by this host (us or another local client).
        case local
        /// Terminated by the peripheral.
        case remote
        /// Supervision timeout (out of range, powered off).
        case timeout
        /// Authentication failure.
        case authentication
        /// The host suspended.
        case suspend
        /// BlueZ did not say.
        case unknown
        /// bluetoothd left the bus.
        case bluetoothdStopped
        /// The device left BlueZ's tree.
        case deviceRemoved
        /// The adapter the device was connected through was removed (unplugged, reset).
        case adapterRemoved
        /// The connection to the system bus was lost (dbus-daemon stopped or restarted).
        case busLost
    }

    /// The cause.
    public var kind: Kind
    /// BlueZ's reason name (`org.bluez.Reason.Remote`), when the `Disconnected` signal came.
    public var bluezReason: String?
    /// BlueZ's text, or ours.
    public var message: String
    /// True when this client asked for the disconnect (`BlueZPeripheral.disconnect()`).
    public var requested: Bool

    /// True when the link was lost rather than closed on purpose: callers should reconnect only then.
    public var isLinkLoss: Bool { !requested }

    /// A reason.
    public init(kind: Kind, bluezReason: String? = nil, message: String, requested: Bool = false) {
        self.kind = kind
        self.bluezReason = bluezReason
        self.message = message
        self.requested = requested
    }

    init(signalReason: String?, message: String?, requested: Bool) {
        let kind: Kind
        switch signalReason {
        case "org.bluez.Reason.Local": kind = .local
        case "org.bluez.Reason.Remote": kind = .remote
        case "org.bluez.Reason.Timeout": kind = .timeout
        case "org.bluez.Reason.Authentication": kind = .authentication
        case "org.bluez.Reason.Suspend": kind = .suspend
        default: kind = requested ? .local : .unknown
        }
        self.init(
            kind: kind, bluezReason: signalReason,
            message: message ?? (requested ? "disconnect requested" : "connection lost"), requested: requested)
    }

    /// The text people read in logs and error output.
    public var description: String {
        var text = "\(kind.rawValue): \(message)"
        if requested { text += " (requested)" }
        return text
    }
}

/// How to write a characteristic.
public enum BlueZWriteType: String, Sendable, Hashable {
    /// Write request: the peer acknowledges; its ATT errors come back.
    case request
    /// Write command (without response).
    case command
}

/// Connect options.
public struct BlueZConnectOptions: Sendable, Hashable {
    /// Overall limit for connect plus service resolution.
    public var timeout: Duration
    /// How many times to retry `le-connection-abort-by-local` (and a drop during service discovery).
    public var abortRetries: Int

    /// Options with a timeout and a retry budget.
    public init(timeout: Duration = .seconds(20), abortRetries: Int = 2) {
        self.timeout = timeout
        self.abortRetries = abortRetries
    }
}

func shortUUID(_ uuid: String) -> String {
    if uuid.hasPrefix("0000"), uuid.hasSuffix("-0000-1000-8000-00805f9b34fb"), uuid.count == 36 {
        return String(uuid.dropFirst(4).prefix(4)).uppercased()
    }
    return uuid
}

/// A peripheral connected through BlueZ. Obtain one from `BlueZClient.connect`.
///
/// Its calls (Connect, reads, writes, AcquireNotify) go over the client's D-Bus connection and end when the
/// peripheral does. `StartNotify` sessions are made on a D-Bus connection of the peripheral's own, opened with the
/// first of them and closed when the BLE connection ends (for any reason): bluetoothd keeps a StartNotify session
/// per sender across disconnects and registers it again on the next connect (src/gatt-client.c), unless its
/// sender leaves the bus. A new `connect` gives a new peripheral. A peripheral that never uses StartNotify costs
/// the bus no connection (a libdbus connection is about 8 KB of heap, and one more client of dbus-daemon).
public final class BlueZPeripheral: Sendable {
    /// The client it belongs to.
    public let client: BlueZClient
    /// The device's object path.
    public let devicePath: String
    /// The adapter's object path.
    public let adapterPath: String
    /// Name and address, for messages.
    public let label: BlueZDeviceLabel
    /// The client's connection, which carries this peripheral's calls.
    private var connection: DBusConnection { client.connection }

    struct State: Sendable {
        var connected = false
        var disconnection: BlueZDisconnectReason?
        var lastSignal: (reason: String, message: String)?
        var disconnectRequested = false
        var sawConnected: Bool?
        var subscription: UInt64?
        var sessions: [String: NotifySession] = [:]
        /// The client's value route of each session (`BlueZClient.routeValues`), by characteristic path.
        var valueRoutes: [String: UInt64] = [:]
        /// `onDisconnection` handlers (also the tasks waiting for the disconnection), by id.
        var handlers: [UInt64: @Sendable (BlueZDisconnectReason) -> Void] = [:]
        var nextHandler: UInt64 = 0
        var negotiatedMTU: Int?
        /// This peripheral called Device1.Connect (so a cancelled connect takes the link down again).
        var connectIssued = false
        /// The connection of this peripheral's StartNotify sessions (`sessionConnection()`), once asked for.
        var sessionConnection: OpeningConnection?
    }
    /// A connection being opened (or open, or refused).
    typealias OpeningConnection = Task<Result<DBusConnection, BlueZError>, Never>
    let state = Mutex(State())

    init(client: BlueZClient, device: BlueZDevice) {
        self.client = client
        self.devicePath = device.path
        self.adapterPath = device.adapterPath
        self.label = device.label
    }

    deinit {
        let (subscription, live, routes, sessions) = state.withLock {
            ($0.subscription, $0.connected && $0.disconnection == nil, $0.valueRoutes, $0.sessionConnection)
        }
        if let subscription { client.unsubscribe(subscription) }
        for (path, id) in routes { client.unrouteValues(of: path, id: id) }
        if live {
            // Dropped while connected, without disconnect(): the link must not outlive its owner. Nobody is left to
            // wait for the answer, so the Disconnect goes out without one.
            var message = DBusMessage.methodCall(
                destination: BlueZName.service, path: DBusObjectPath(stringLiteral: devicePath),
                interface: BlueZName.device, method: "Disconnect")
            message.noReplyExpected = true
            try? connection.send(message)
        }
        Self.close(sessions)
    }

    /// Closes the StartNotify sessions' connection once it is open (off the calling thread: closing joins).
    private static func close(_ sessions: OpeningConnection?) {
        guard let sessions else { return }
        Task { if case .success(let connection) = await sessions.value { await connection.closeAndWait() } }
    }

    /// The connection this peripheral's StartNotify sessions are made on (and stopped on), opened on first use.
    /// - Throws: `.disconnected` once the peripheral's connection ended; `.busUnavailable` when the bus refuses
    ///   another connection.
    func sessionConnection() async throws(BlueZError) -> DBusConnection {
        let bus = client.bus
        let pending = state.withLock { s -> OpeningConnection? in
            guard s.disconnection == nil else { return nil }
            if let opening = s.sessionConnection { return opening }
            let opening = OpeningConnection { () -> Result<DBusConnection, BlueZError> in
                do throws(BlueZError) {
                    return .success(try await BlueZClient.openConnectionOffPool(bus))
                } catch {
                    return .failure(error)
                }
            }
            s.sessionConnection = opening
            return opening
        }
        let connection = try await pending?.value.get()
        // Nil or not, the peripheral's connection may have ended meanwhile (then `finish` closes this one).
        if let connection, disconnection == nil { return connection }
        let ended = disconnection ?? BlueZDisconnectReason(kind: .unknown, message: "ended")
        throw .disconnected(device: label, reason: ended)
    }

    /// Calls `method` of BlueZ's object at `objectPath` on `connection` (the client's when nil) until this
    /// peripheral's connection ends: then, or when the calling task is cancelled, the call is abandoned with
    /// `DBusError.cancelled`, as a connection of the peripheral's own ended its calls by closing.
    private func call(
        _ objectPath: String, _ interface: String, _ method: String, arguments: [DBusValue] = [],
        timeout: Duration, on connection: DBusConnection? = nil
    ) async throws(DBusError) -> [DBusValue] {
        let (connection, path) = (connection ?? self.connection, DBusObjectPath(stringLiteral: objectPath))
        let running = Task { () -> Result<[DBusValue], DBusError> in
            do throws(DBusError) {
                return .success(
                    try await connection.call(
                        destination: BlueZName.service, path: path, interface: interface, method: method,
                        arguments: arguments, timeout: timeout))
            } catch {
                return .failure(error)
            }
        }
        let id = onDisconnection { _ in running.cancel() }
        let result = await withTaskCancellationHandler { await running.value } onCancel: { running.cancel() }
        if let id { removeDisconnectionHandler(id) }
        return try result.get()
    }

    private var path: DBusObjectPath { DBusObjectPath(stringLiteral: devicePath) }

    /// The device as the mirror has it now (nil once it left BlueZ's tree).
    public var device: BlueZDevice? { client.tree.device(at: devicePath) }

    /// True until the connection ends.
    public var isConnected: Bool { state.withLock { $0.connected && $0.disconnection == nil } }

    /// Why the connection ended, once it has.
    public var disconnection: BlueZDisconnectReason? { state.withLock { $0.disconnection } }

    /// Waits until the connection ends and returns why.
    ///
    /// Cancellable: when the waiting task is cancelled it returns at once with a reason of kind `.unknown` whose
    /// message says the wait was cancelled (check `isConnected`); use `disconnectionReason()` to get a thrown
    /// `BlueZError.cancelled` instead.
    public func waitForDisconnection() async -> BlueZDisconnectReason {
        if let reason = await disconnectionUnlessCancelled() { return reason }
        return disconnection
            ?? BlueZDisconnectReason(kind: .unknown, message: "the wait for the disconnection was cancelled")
    }

    /// Waits until the connection ends and returns why.
    /// - Throws: `BlueZError.cancelled` when the waiting task is cancelled first (the connection may still be up).
    public func disconnectionReason() async throws(BlueZError) -> BlueZDisconnectReason {
        if let reason = await disconnectionUnlessCancelled() { return reason }
        throw .cancelled(operation: "device \(label): waiting for the disconnection")
    }

    /// The reason once the connection ends; nil when the waiting task is cancelled (its waiter is dropped).
    func disconnectionUnlessCancelled() async -> BlueZDisconnectReason? {
        let shot = OneShot<BlueZDisconnectReason>()
        let id = onDisconnection { reason in _ = shot.complete(reason) }
        let reason = await shot.value()
        if reason == nil, let id { removeDisconnectionHandler(id) }
        return reason
    }

    /// The number of `onDisconnection` handlers not called or removed yet, waiting tasks included (tests check
    /// that cancelled waits do not linger).
    var disconnectionWaiterCount: Int { state.withLock { $0.handlers.count } }

    /// Calls `handler` once when the connection ends, with why, on the thread that saw it end; at once, on this
    /// thread, when it already has (then the result is nil). Unlike `waitForDisconnection()`, no task waits
    /// meanwhile. The id returned removes the handler (`removeDisconnectionHandler(_:)`).
    public func onDisconnection(_ handler: @escaping @Sendable (BlueZDisconnectReason) -> Void) -> UInt64? {
        let (id, already) = state.withLock { s -> (UInt64?, BlueZDisconnectReason?) in
            if let d = s.disconnection { return (nil, d) }
            s.nextHandler += 1
            s.handlers[s.nextHandler] = handler
            return (s.nextHandler, nil)
        }
        if let already { handler(already) }
        return id
    }

    /// Removes a handler `onDisconnection(_:)` registered (nothing when it was called already).
    public func removeDisconnectionHandler(_ id: UInt64) {
        _ = state.withLock { $0.handlers.removeValue(forKey: id) }
    }

    /// The ATT MTU: from AcquireNotify when one was done, else the largest characteristic `MTU` property.
    public var mtu: Int? {
        if let m = state.withLock({ $0.negotiatedMTU }) { return m }
        let tree = client.tree
        let all = tree.services(ofDevice: devicePath).flatMap { tree.characteristics(ofService: $0.path) }
        return all.compactMap { $0.mtu.map(Int.init) }.max()
    }

    // MARK: connection lifecycle

    func startTracking() {
        let id = client.subscribe { [weak self] event, tree in self?.handle(event, tree) }
        state.withLock { $0.subscription = id }
    }

    private func handle(_ event: BlueZTreeEvent, _ tree: BlueZObjectTree) {
        switch event {
        case .deviceDisconnected(let p, let reason, let message) where p == devicePath:
            state.withLock { $0.lastSignal = (reason, message) }
        case .propertiesChanged(let p, BlueZName.device, let changed, _) where p == devicePath:
            guard let connected = changed["Connected"]?.bool else { return }
            let established = state.withLock { s -> Bool in
                s.sawConnected = connected
                return s.connected
            }
            if !connected, established {
                let (signal, requested) = state.withLock { ($0.lastSignal, $0.disconnectRequested) }
                finish(
                    BlueZDisconnectReason(
                        signalReason: signal?.reason, message: signal?.message, requested: requested))
            }
        case .propertiesChanged(let p, BlueZName.characteristic, let changed, _):
            guard let session = state.withLock({ $0.sessions[p] }) else { return }
            if let value = changed["Value"]?.bytes { session.deliver(value) }
            if let notifying = changed["Notifying"]?.bool, disconnection == nil,
                tree.device(at: devicePath)?.connected == true
            {
                session.notifyingChanged(notifying)
            }
        case .interfacesRemoved(let p, let names, _) where names.contains(BlueZName.characteristic):
            guard let session = state.withLock({ $0.sessions[p] }) else { return }
            session.endUnlessDisconnecting(
                "the characteristic left BlueZ's object tree (Service Changed)", grace: .milliseconds(500))
        case .interfacesRemoved(let p, let names, _) where p == devicePath && names.contains(BlueZName.device):
            deviceRemoved()
        case .interfacesRemoved(let p, let names, _) where p == adapterPath && names.contains(BlueZName.adapter):
            finish(adapterGone)
        case .daemonLost(_, let busLost):
            if busLost {
                finish(BlueZDisconnectReason(kind: .busLost, message: "the connection to the system bus was lost"))
            } else {
                finish(BlueZDisconnectReason(kind: .bluetoothdStopped, message: "bluetoothd left the bus"))
            }
        default:
            return
        }
    }

    private var adapterGone: BlueZDisconnectReason {
        let name = adapterPath.split(separator: "/").last.map(String.init) ?? adapterPath
        return BlueZDisconnectReason(kind: .adapterRemoved, message: "adapter \(name) removed")
    }

    /// The device left the tree. When its adapter is going away, bluetoothd removes the devices first and the
    /// adapter right after: give the adapter's removal a moment to arrive, so the reason names the real cause.
    private func deviceRemoved() {
        let client = self.client
        let adapterPath = self.adapterPath
        Task { [weak self] in
            let adapterGone = await client.wait(timeout: .milliseconds(250)) { _, tree in
                tree.adapter(at: adapterPath) == nil ? true : nil
            }
            guard let self else { return }
            if adapterGone == true {
                self.finish(self.adapterGone)
            } else {
                self.finish(BlueZDisconnectReason(kind: .deviceRemoved, message: "the device left BlueZ's object tree"))
            }
        }
    }

    /// Marks the connection ended (once), ends every notification stream and closes our D-Bus connection.
    func finish(_ reason: BlueZDisconnectReason) {
        let result = state.withLock {
            s -> (Bool, [NotifySession], [@Sendable (BlueZDisconnectReason) -> Void], UInt64?, OpeningConnection?) in
            guard s.disconnection == nil else { return (false, [], [], nil, nil) }
            var reason = reason
            if s.disconnectRequested { reason.requested = true }
            s.disconnection = reason
            let sessions = Array(s.sessions.values)
            s.sessions = [:]
            for (path, id) in s.valueRoutes { client.unrouteValues(of: path, id: id) }
            s.valueRoutes = [:]
            let handlers = s.handlers.sorted { $0.key < $1.key }.map(\.value)
            s.handlers = [:]
            defer {
                s.subscription = nil
                s.sessionConnection = nil
            }
            return (s.connected, sessions, handlers, s.subscription, s.sessionConnection)
        }
        let (wasConnected, sessions, handlers, subscription, sessionConnection) = result
        guard let final = disconnection else { return }
        if let subscription { client.unsubscribe(subscription) }
        for session in sessions { session.end(.disconnected(device: label, reason: final)) }
        for h in handlers { h(final) }
        if wasConnected {
            if final.requested {
                client.logger.info("device \(label): disconnected (\(final))", ["ble.address": label.address])
            } else {
                client.logger.warning("device \(label): connection lost (\(final))", ["ble.address": label.address])
            }
        }
        // BlueZ drops the StartNotify sessions of a sender that leaves the bus.
        Self.close(sessionConnection)
    }

    /// Connects, retrying and waiting as BLUEZ.md describes, until services are resolved.
    func establish(_ options: BlueZConnectOptions) async throws(BlueZError) {
        let deadline = Deadline(options.timeout)
        var retries = 0
        let log = client.logger.with(["ble.address": label.address])
        while true {
            if Task.isCancelled { throw await cancelled(log) }
            guard let device = client.tree.device(at: devicePath) else {
                throw .deviceNotFound(device: label, failure: nil)
            }
            let removalsBefore = client.tree.serviceRemovals[devicePath] ?? 0
            if !(device.connected && device.servicesResolved) {
                var linkUp = false
                state.withLock {
                    $0.sawConnected = nil
                    $0.connectIssued = true
                }
                log.debug("device \(label): Connect()")
                do {
                    _ = try await call(
                        devicePath, BlueZName.device, "Connect", timeout: max(deadline.remaining, .milliseconds(1)))
                } catch {
                    if Task.isCancelled { throw await cancelled(log) }
                    // The device left BlueZ's tree while Connect() was pending (a broadcaster dropped when scanning
                    // stopped, an expired device): `finish` ended the call. Whatever the failure, a device that is
                    // gone is "not found".
                    if client.tree.device(at: devicePath) == nil {
                        throw .deviceNotFound(device: label, failure: .init(error))
                    }
                    if error.name == DBusError.cancelled {
                        if let ended = disconnection {
                            throw .connectionFailed(device: label, reason: ended.message, failure: nil)
                        }
                        throw await cancelled(log)
                    }
                    switch error.name {
                    case DBusError.unknownObject, DBusError.unknownMethod, "org.bluez.Error.DoesNotExist":
                        throw .deviceNotFound(device: label, failure: .init(error))
                    case "org.bluez.Error.Failed"
                    where error.message == "le-connection-abort-by-local"
                        && retries < options.abortRetries:
                        retries += 1
                        log.info(
                            "device \(label): connect failed: \(BlueZDBusFailure(error)); retrying (attempt \(retries + 1))"
                        )
                        // BlueZ may have had the link up: wait for Connected=false before retrying (bleak #1255).
                        await waitForConnectedFalse(deadline)
                        continue
                    case "org.bluez.Error.InProgress":
                        if deadline.expired { break }
                        log.debug("device \(label): Connect() in progress elsewhere; retrying")
                        // Another client's connect may resolve services meanwhile: then the loop takes it as is.
                        let path = devicePath
                        _ = await client.wait(timeout: .milliseconds(100)) { _, tree -> Bool? in
                            guard let d = tree.device(at: path) else { return true }
                            return d.connected && d.servicesResolved ? true : nil
                        }
                        continue
                    case DBusError.noReply, DBusError.timedOut:
                        await cancelConnect(log)
                        throw .timeout(device: label, operation: "connect", seconds: deadline.total.seconds)
                    case "org.bluez.Error.NotReady":
                        throw .adapterUnavailable(
                            adapter: adapterPath.split(separator: "/").last.map(String.init) ?? adapterPath,
                            reason: "powered off (\(error.message))")
                    case "org.bluez.Error.AlreadyConnected",
                        "org.bluez.Error.Failed" where error.message == "le-connection-already-connected":
                        // The link is up already (another client, or a connection the controller kept): what is
                        // left is the same wait for ServicesResolved, which may well be true by now.
                        log.debug("device \(label): Connect(): \(BlueZDBusFailure(error)); waiting for services")
                        linkUp = true
                    default:
                        break
                    }
                    if !linkUp {
                        if deadline.expired {
                            await cancelConnect(log)
                            throw .timeout(device: label, operation: "connect", seconds: deadline.total.seconds)
                        }
                        throw .connectionFailed(device: label, reason: error.message, failure: .init(error))
                    }
                }
            }
            // Connect() returns before service discovery on LE: wait for ServicesResolved, or a drop.
            enum Outcome: Sendable { case resolved, dropped, removed }
            let path = devicePath
            var outcome = await client.wait(timeout: deadline.remaining) { event, tree -> Outcome? in
                guard let d = tree.device(at: path) else { return .removed }
                if case .propertiesChanged(let p, BlueZName.device, let changed, _) = event, p == path,
                    changed["Connected"]?.bool == false
                {
                    return .dropped
                }
                if d.connected && d.servicesResolved { return .resolved }
                return nil
            }
            if outcome == .dropped {
                // This Connected=false may be a late one from an earlier aborted attempt: then this attempt's
                // Connected=true and ServicesResolved follow at once.
                let cameBack = await client.wait(timeout: min(deadline.remaining, .milliseconds(500))) {
                    _, tree -> Bool? in
                    guard let d = tree.device(at: path) else { return false }
                    return d.connected && d.servicesResolved ? true : nil
                }
                if cameBack == true { outcome = .resolved }
            }
            if Task.isCancelled { throw await cancelled(log) }
            switch outcome {
            case .resolved:
                // Services removed during this connect are being exported again: wait for them even when some
                // are back already.
                let reexported = (client.tree.serviceRemovals[devicePath] ?? 0) != removalsBefore
                await settleServices(deadline, reexported: reexported)
                if Task.isCancelled { throw await cancelled(log) }
                state.withLock { $0.connected = true }
                if let d = client.tree.device(at: devicePath), !d.connected {
                    // Dropped between the wait and now.
                    finish(BlueZDisconnectReason(signalReason: nil, message: "connection lost", requested: false))
                }
                log.info("device \(label): connected")
                return
            case .removed:
                throw .deviceNotFound(device: label, failure: nil)
            case .dropped:
                if retries < options.abortRetries, !deadline.expired {
                    retries += 1
                    log.info("device \(label): dropped during service discovery; retrying (attempt \(retries + 1))")
                    continue
                }
                let signal = state.withLock { $0.lastSignal }
                throw .connectionFailed(
                    device: label, reason: "disconnected during service discovery (\(signal?.message ?? "unknown"))",
                    failure: nil)
            case nil:
                await cancelConnect(log)
                throw .timeout(
                    device: label, operation: "connect (waiting for services)", seconds: deadline.total.seconds)
            }
        }
    }

    private func waitForConnectedFalse(_ deadline: Deadline) async {
        let path = devicePath
        // bluetoothd may answer Connect() before or after it signals the link's Connected changes (and a peer
        // that held the connection elsewhere may differ): they are not ordered. So first learn whether the link came
        // up at all (a short wait), and only then wait, longer, for it to go down; otherwise a late Connected=false
        // would end the next attempt.
        let cameUp = await client.wait(timeout: min(deadline.remaining, .milliseconds(300))) {
            [weak self] event, _ -> Bool? in
            if case .propertiesChanged(let p, BlueZName.device, let changed, _) = event, p == path,
                let connected = changed["Connected"]?.bool
            {
                return connected
            }
            if event == nil, let self { return self.state.withLock { $0.sawConnected } }
            return nil
        }
        guard cameUp == true else { return }
        _ = await client.wait(timeout: min(deadline.remaining, .seconds(3))) { [weak self] event, _ -> Bool? in
            if case .propertiesChanged(let p, BlueZName.device, let changed, _) = event, p == path,
                changed["Connected"]?.bool == false
            {
                return true
            }
            if event == nil, let self, self.state.withLock({ $0.sawConnected == false }) { return true }
            return nil
        }
    }

    /// bluez#1489: `ServicesResolved` can come before the service objects. When the mirror has none, ask
    /// GetManagedObjects, then wait for the exports to settle.
    private func settleServices(_ deadline: Deadline, reexported: Bool) async {
        let empty = client.tree.services(ofDevice: devicePath).isEmpty
        let prefix = devicePath + "/"
        if !empty && !reexported {
            // Some services are in the mirror, but its signals can lag the bus on a loaded machine: one read of
            // bluetoothd's own view says whether it exports more than the mirror shows (then settle as below).
            let mirrored = Set(client.tree.objectPaths.filter { $0.hasPrefix(prefix) })
            guard let exported = await client.refreshMissingObjects()?.filter({ $0.hasPrefix(prefix) }),
                !exported.isSubset(of: mirrored)
            else { return }
            client.logger.debug("device \(label): ServicesResolved with part of the services in the tree; re-reading")
        } else if empty {
            client.logger.debug("device \(label): ServicesResolved but no services in the tree yet; re-reading it")
        } else {
            client.logger.debug("device \(label): services were removed during the connect; waiting for them all")
        }
        // Until bluetoothd's own view of the device's GATT objects is the same in two reads 150 ms apart (the
        // export has ended) and the mirror has them all: signals alone can lag far behind the bus on a loaded
        // machine, and a quiet period cannot tell a finished export from a slow one.
        // At most 3 s, and at least 1 s even when the connect's deadline is nearly spent (a loaded machine made the
        // connect itself slow): a tree known to be incomplete is worse than a connect that ends a little late.
        let end = ContinuousClock.now + max(min(deadline.remaining, .seconds(3)), .seconds(1))
        var previous: Set<String>?
        while ContinuousClock.now < end, !Task.isCancelled {
            let exported = await client.refreshMissingObjects().map { $0.filter { $0.hasPrefix(prefix) } }
            if let exported, !exported.isEmpty, exported == previous { break }
            previous = exported
            try? await Task.sleep(for: .milliseconds(150))
        }
    }

    private func cancelConnect(_ log: BlueZLogger) async {
        log.debug("device \(label): cancelling the pending connect (Disconnect)")
        state.withLock { $0.disconnectRequested = true }
        // In a task of its own: when the connect was cancelled, a call from the cancelled task would be cancelled
        // before it went out, and BlueZ would keep the Connect() pending (answering InProgress to the next one).
        let (connection, path) = (self.connection, self.path)
        await Task {
            _ = try? await connection.call(
                destination: BlueZName.service, path: path, interface: BlueZName.device, method: "Disconnect",
                timeout: .seconds(5))
        }.value
    }

    /// The connect was cancelled by its caller: cancel it on BlueZ too and say so (not a connection failure).
    private func cancelled(_ log: BlueZLogger) async -> BlueZError {
        // Only a link this attempt asked for is taken down (not one another client holds).
        if state.withLock({ $0.connectIssued }) { await cancelConnect(log) }
        return .cancelled(operation: "device \(label): connect")
    }

    /// Disconnects on purpose: stops notifications (StopNotify, closing acquired sockets), calls
    /// `Device1.Disconnect`, and waits for `Connected=false`. The reason reported has `requested == true`.
    public func disconnect(timeout: Duration = .seconds(10)) async {
        let (sessions, already) = state.withLock { s -> ([NotifySession], Bool) in
            s.disconnectRequested = true
            return (Array(s.sessions.values), s.disconnection != nil)
        }
        if already { return }
        for session in sessions { await session.stop() }
        _ = try? await connection.call(
            destination: BlueZName.service, path: path, interface: BlueZName.device, method: "Disconnect",
            timeout: timeout)
        let path = devicePath
        _ = await client.wait(timeout: .seconds(3)) { _, tree in
            (tree.device(at: path)?.connected ?? false) ? nil : true
        }
        let signal = state.withLock { $0.lastSignal }
        finish(BlueZDisconnectReason(signalReason: signal?.reason, message: signal?.message, requested: true))
    }

    // MARK: GATT discovery

    /// The device's services (optionally only those with `uuid`, any form), in handle order.
    public func services(uuid: String? = nil) -> [BlueZService] {
        let wanted = uuid.flatMap(bluezUUIDString)
        return client.tree.services(ofDevice: devicePath).filter { wanted == nil || $0.uuid == wanted }
    }

    /// Characteristics of `service` (all services when nil), optionally only those with `uuid`.
    public func characteristics(of service: BlueZService? = nil, uuid: String? = nil) -> [BlueZCharacteristic] {
        let tree = client.tree
        let wanted = uuid.flatMap(bluezUUIDString)
        let services = service.map { [$0] } ?? tree.services(ofDevice: devicePath)
        return services.flatMap { tree.characteristics(ofService: $0.path) }.filter {
            wanted == nil || $0.uuid == wanted
        }
    }

    /// The first characteristic with `uuid` (any form).
    /// - Throws: `BlueZError.attributeNotFound`, or `.invalidArgument` for a malformed UUID.
    public func characteristic(_ uuid: String) throws(BlueZError) -> BlueZCharacteristic {
        guard let full = bluezUUIDString(uuid) else { throw .invalidArgument("'\(uuid)' is not a UUID") }
        guard let c = characteristics(uuid: full).first else {
            throw .attributeNotFound(device: label, attribute: "characteristic \(shortUUID(full))")
        }
        return c
    }

    /// Descriptors of a characteristic.
    public func descriptors(of characteristic: BlueZCharacteristic) -> [BlueZDescriptor] {
        client.tree.descriptors(ofCharacteristic: characteristic.path)
    }

    /// The characteristic as the mirror has it now (flags, MTU, cached value).
    public func refreshed(_ characteristic: BlueZCharacteristic) -> BlueZCharacteristic? {
        client.tree.characteristic(at: characteristic.path)
    }

    // MARK: GATT I/O

    /// Runs a GATT call, poll-retrying `InProgress` every 10 ms until `timeout`, and maps errors. `session`: on the
    /// StartNotify sessions' connection (`sessionConnection()`) instead of the client's.
    func gattCall(
        _ objectPath: String, interface: String, method: String, arguments: [DBusValue], operation: String,
        timeout: Duration, session: Bool = false
    ) async throws(BlueZError) -> [DBusValue] {
        if let d = disconnection { throw .disconnected(device: label, reason: d) }
        let deadline = Deadline(timeout)
        let connection = session ? try await sessionConnection() : nil
        while true {
            do {
                return try await call(
                    objectPath, interface, method, arguments: arguments,
                    timeout: max(deadline.remaining, .milliseconds(1)), on: connection)
            } catch {
                if error.name == "org.bluez.Error.InProgress", !deadline.expired {
                    await nap(.milliseconds(10))
                    continue
                }
                if error.name == DBusError.noReply || error.name == DBusError.timedOut {
                    throw .timeout(device: label, operation: operation, seconds: timeout.seconds)
                }
                if error.name == DBusError.disconnected || error.name == DBusError.cancelled, !Task.isCancelled,
                    let d = disconnection
                {
                    throw .disconnected(device: label, reason: d)
                }
                throw mapDBusError(error, device: label, operation: operation)
            }
        }
    }

    /// Reads a characteristic (`ReadValue`).
    public func read(_ characteristic: BlueZCharacteristic, timeout: Duration = .seconds(10))
        async throws(BlueZError) -> [UInt8]
    {
        let reply = try await gattCall(
            characteristic.path, interface: BlueZName.characteristic, method: "ReadValue",
            arguments: [.stringVariantDictionary([])], operation: "read \(shortUUID(characteristic.uuid))",
            timeout: timeout)
        return reply.first?.bytes ?? []
    }

    /// Reads a descriptor (`ReadValue`).
    public func read(_ descriptor: BlueZDescriptor, timeout: Duration = .seconds(10)) async throws(BlueZError)
        -> [UInt8]
    {
        let reply = try await gattCall(
            descriptor.path, interface: BlueZName.descriptor, method: "ReadValue",
            arguments: [.stringVariantDictionary([])], operation: "read descriptor \(shortUUID(descriptor.uuid))",
            timeout: timeout)
        return reply.first?.bytes ?? []
    }

    /// Writes a characteristic (`WriteValue` with `type` "request" or "command").
    /// - Throws: `.notSupported` (e.g. a command on a characteristic without write-without-response),
    ///   `.notPermitted`, `.notConnected`, `.timeout`.
    public func write(
        _ characteristic: BlueZCharacteristic, _ value: [UInt8], type: BlueZWriteType = .request,
        timeout: Duration = .seconds(10)
    ) async throws(BlueZError) {
        _ = try await gattCall(
            characteristic.path, interface: BlueZName.characteristic, method: "WriteValue",
            arguments: [.bytes(value), .stringVariantDictionary([("type", .string(type.rawValue))])],
            operation: "write \(shortUUID(characteristic.uuid))", timeout: timeout)
    }

    /// Writes a descriptor.
    public func write(_ descriptor: BlueZDescriptor, _ value: [UInt8], timeout: Duration = .seconds(10))
        async throws(BlueZError)
    {
        _ = try await gattCall(
            descriptor.path, interface: BlueZName.descriptor, method: "WriteValue",
            arguments: [.bytes(value), .stringVariantDictionary([])],
            operation: "write descriptor \(shortUUID(descriptor.uuid))", timeout: timeout)
    }

    // MARK: notifications

    /// Subscribes to a characteristic's notifications or indications.
    ///
    /// Uses `AcquireNotify` (one datagram per notification, read off a socket by a dispatch source) when the
    /// characteristic exposes `NotifyAcquired` and `preferAcquire` is set, else `StartNotify` with values from
    /// `PropertiesChanged(Value)`. The stream ends with `BlueZError.disconnected` when the connection ends, and
    /// stops the subscription when the consumer stops iterating.
    public func notifications(for characteristic: BlueZCharacteristic, preferAcquire: Bool = true)
        async throws(BlueZError) -> BlueZNotifications
    {
        try await notifications(for: characteristic, preferAcquire: preferAcquire, mapError: { $0 })
    }

    /// Subscribes like `notifications(for:preferAcquire:)`; the stream ends with `mapError(error)` instead of the
    /// `BlueZError` itself, so that a consumer expecting errors of its own can take `BlueZNotifications.stream`
    /// as it is, without relaying every value through a task that converts the error at the end.
    /// - Throws: what `notifications(for:preferAcquire:)` throws (unmapped).
    ///
    /// With `consumer`, every value is handed to it on the thread that read it (one thread reads every
    /// AcquireNotify socket; under StartNotify the D-Bus I/O thread), in order, instead of being queued in the stream:
    /// no thread hop per notification. The consumer must not block. The returned stream then carries no values and
    /// only ends (as above).
    ///
    /// `ended`, when given, is called once when the stream ends, with what it ends with (nil: it finished), on the
    /// thread that ended it: a consumer that only waits for the end needs no task of its own for it. Dropping the
    /// returned stream without iterating it stops the subscription, as cancelling an iteration does.
    public func notifications(
        for characteristic: BlueZCharacteristic, preferAcquire: Bool = true,
        mapError: @escaping @Sendable (BlueZError) -> any Error,
        consumer: (@Sendable ([UInt8]) -> Void)? = nil,
        ended: (@Sendable ((any Error)?) -> Void)? = nil
    ) async throws(BlueZError) -> BlueZNotifications {
        let op = "notify \(shortUUID(characteristic.uuid))"
        if let d = disconnection { throw .disconnected(device: label, reason: d) }
        let current = client.tree.characteristic(at: characteristic.path) ?? characteristic
        guard current.canNotify else {
            throw .notSupported(
                device: label, operation: op,
                failure: BlueZDBusFailure(
                    name: "blebridge", message: "the characteristic has no notify or indicate flag"))
        }
        if let existing = state.withLock({ $0.sessions[characteristic.path] }) { await existing.stop() }
        let session = NotifySession(
            peripheral: self, characteristic: current, mapError: mapError, consumer: consumer, ended: ended)
        if preferAcquire, current.notifyAcquireAvailable {
            do {
                let reply = try await call(
                    current.path, BlueZName.characteristic, "AcquireNotify",
                    arguments: [.stringVariantDictionary([])], timeout: .seconds(10))
                if case .unixFD(let descriptor)? = reply.first {
                    let fd = descriptor.take()
                    if let mtu = reply.dropFirst().first?.uint16 {
                        state.withLock { $0.negotiatedMTU = Int(mtu) }
                    }
                    session.startSocket(fd: fd)
                    register(session)
                    client.logger.debug("device \(label): \(op) via AcquireNotify")
                    return session.takeStream()
                }
                client.logger.debug("device \(label): AcquireNotify returned no fd; falling back to StartNotify")
            } catch {
                // InProgress: a StartNotify session exists (ours or another client's); NotPermitted: already
                // acquired elsewhere. StartNotify still works in both cases.
                client.logger.debug(
                    "device \(label): AcquireNotify failed (\(BlueZDBusFailure(error))); using StartNotify")
            }
        }
        // Deliver from now on: a notification can be processed before StartNotify's reply resumes us.
        session.markStarted()
        register(session)
        do {
            _ = try await gattCall(
                current.path, interface: BlueZName.characteristic, method: "StartNotify", arguments: [],
                operation: op, timeout: .seconds(10), session: true)
        } catch {
            unregister(session)
            session.end(nil, tell: false)
            throw error
        }
        client.logger.debug("device \(label): \(op) via StartNotify")
        return session.takeStream()
    }

    /// Makes `session` the characteristic's, with the client's value route to it (its StartNotify values then come
    /// straight from the D-Bus I/O thread, not through `handle`). The route holds the session; `unregister` and
    /// `finish` (and deinit) remove it.
    private func register(_ session: NotifySession) {
        let path = session.characteristic.path
        let client = self.client
        let ended = state.withLock { s -> BlueZDisconnectReason? in
            if let d = s.disconnection { return d }
            s.sessions[path] = session
            if let old = s.valueRoutes.removeValue(forKey: path) { client.unrouteValues(of: path, id: old) }
            s.valueRoutes[path] = client.routeValues(of: path) { value in session.deliver(value) }
            return nil
        }
        if let ended { session.end(.disconnected(device: label, reason: ended)) }
    }

    func unregister(_ session: NotifySession) {
        let path = session.characteristic.path
        state.withLock { s in
            guard s.sessions[path] === session else { return }
            s.sessions[path] = nil
            if let id = s.valueRoutes.removeValue(forKey: path) { client.unrouteValues(of: path, id: id) }
        }
    }

    /// Stops notifications on a characteristic (StopNotify, or closing the acquired socket).
    public func stopNotifications(for characteristic: BlueZCharacteristic) async {
        if let session = state.withLock({ $0.sessions[characteristic.path] }) { await session.stop() }
    }
}

extension BlueZClient {
    /// Connects to `device` and waits until its services are resolved.
    ///
    /// Retries `le-connection-abort-by-local` after `Connected=false`, poll-retries `InProgress`, cancels the
    /// pending connect (`Disconnect`) on timeout, and re-reads the tree when `ServicesResolved` came before the
    /// service objects (bluez#1489). The peripheral's calls use this client's D-Bus connection (StartNotify
    /// sessions one of their own).
    /// - Throws: `.deviceNotFound` (not in BlueZ's tree: expired from its cache), `.connectionFailed(reason:)`,
    ///   `.timeout`, `.adapterUnavailable`.
    public func connect(_ device: BlueZDevice, options: BlueZConnectOptions = BlueZConnectOptions())
        async throws(BlueZError) -> BlueZPeripheral
    {
        let peripheral = BlueZPeripheral(client: self, device: device)
        peripheral.startTracking()
        do {
            try await peripheral.establish(options)
        } catch {
            peripheral.state.withLock { $0.disconnectRequested = true }
            peripheral.finish(BlueZDisconnectReason(kind: .local, message: "connect failed", requested: true))
            throw error
        }
        return peripheral
    }

    /// Connects to the device with `address` on `adapter` (any adapter when nil).
    /// - Throws: `.deviceNotFound` when BlueZ does not know the address (scan first), and what `connect(_:)`
    ///   throws.
    public func connect(
        address: String, on adapter: BlueZAdapter? = nil, options: BlueZConnectOptions = BlueZConnectOptions()
    ) async throws(BlueZError) -> BlueZPeripheral {
        guard let device = device(address: address, on: adapter) else {
            throw .deviceNotFound(device: BlueZDeviceLabel(address: address.uppercased()), failure: nil)
        }
        return try await connect(device, options: options)
    }
}
