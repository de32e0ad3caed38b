// Publishing our own objects to bluetoothd (a GATT application, an advertisement): one loop that registers them
// with a manager on the selected adapter and follows bluetoothd across restarts, bus loss and adapter changes.
import DBus
import Synchronization

/// Why a registration with bluetoothd ended.
public enum BlueZRegistrationEndReason: Sendable, Hashable, CustomStringConvertible {
    /// `run()` was cancelled; the objects were unregistered and removed.
    case cancelled
    /// bluetoothd left the bus (it forgets every registration); it is registered again when bluetoothd is back.
    case bluetoothdStopped
    /// The connection to the system bus was lost; it is registered again once the bus and bluetoothd are back.
    case busLost
    /// The adapter it was registered on went away; it is registered again when a matching adapter appears.
    case adapterRemoved(adapter: String)
    /// bluetoothd called `Release` (an advertisement it stopped: timeout, adapter reset); it is registered again.
    case released

    /// The text people read in logs.
    public var description: String {
        switch self {
        case .cancelled: return "cancelled"
        case .bluetoothdStopped: return "bluetoothd left the bus"
        case .busLost: return "the system bus connection was lost"
        case .adapterRemoved(let adapter): return "adapter \(adapter) was removed"
        case .released: return "bluetoothd released it"
        }
    }
}

/// A registration attempt that bluetoothd (or the bus) refused; it is retried after `retryIn`.
public struct BlueZRegistrationFailure: Sendable, Hashable, CustomStringConvertible {
    /// The adapter name (`hci0`).
    public var adapter: String
    /// The method that failed (`RegisterApplication`, `RegisterAdvertisement`).
    public var operation: String
    /// The D-Bus error bluetoothd answered with.
    public var failure: BlueZDBusFailure
    /// How long until the next attempt (100 ms doubling to 5 s).
    public var retryIn: Duration

    /// The text people read in logs.
    public var description: String {
        "adapter \(adapter): \(operation) failed: \(failure); retrying in \(retryIn.seconds) s"
    }
}

/// Wakes one waiting task; a poke with nobody waiting is kept for the next wait.
final class Waker: Sendable {
    private struct State {
        var pending = false
        var shot: OneShot<Bool>?
    }
    private let state = Mutex(State())

    func poke() {
        let shot = state.withLock { s -> OneShot<Bool>? in
            guard let shot = s.shot else {
                s.pending = true
                return nil
            }
            s.shot = nil
            return shot
        }
        shot?.complete(true)
    }

    /// Returns after a poke, after `timeout` (nil: no timeout), or when the task is cancelled.
    func wait(timeout: Duration?) async {
        let shot = state.withLock { s -> OneShot<Bool>? in
            if s.pending {
                s.pending = false
                return nil
            }
            let shot = OneShot<Bool>()
            s.shot = shot
            return shot
        }
        guard let shot else { return }
        let timer = timeout.map { delay in
            Task {
                await nap(delay)
                shot.complete(false)
            }
        }
        _ = await shot.value()
        timer?.cancel()
        state.withLock { s in if s.shot === shot { s.shot = nil } }
    }
}

/// The registration loop shared by ``BlueZGATTApplication`` and ``BlueZAdvertisement``.
///
/// It owns a D-Bus connection of its own (the objects must be exported by the connection that calls the manager,
/// since bluetoothd talks back to the caller's unique name), re-opened after the bus is lost.
final class LocalRegistrationDriver: Sendable {
    struct Hooks: Sendable {
        /// `org.bluez.GattManager1`, `org.bluez.LEAdvertisingManager1`.
        var managerInterface: String
        var registerMethod: String
        var unregisterMethod: String
        /// The path registered (the application root, the advertisement).
        var objectPath: DBusObjectPath
        /// "GATT application /io/blebridge/app1".
        var label: String
        /// Exports the objects on a fresh connection and returns the server holding them.
        var export: @Sendable (DBusConnection) -> DBusObjectServer
        var registered: @Sendable (BlueZAdapter) -> Void
        var unregistered: @Sendable (BlueZRegistrationEndReason) -> Void
        var failed: @Sendable (BlueZRegistrationFailure) -> Void
        /// Every change to the client's mirror (on the D-Bus I/O thread, see `BlueZClient.subscribe`).
        var treeEvent: @Sendable (BlueZTreeEvent, BlueZObjectTree) -> Void
    }

    struct Registered: Sendable {
        var adapter: BlueZAdapter
        var owner: String
        var connection: DBusConnection
    }

    struct State: Sendable {
        var connection: DBusConnection?
        var server: DBusObjectServer?
        var registered: Registered?
        var released = false
        var running = false
        /// A registration call whose answer was not awaited (the task was cancelled): bluetoothd may have taken it.
        var inFlight: Registered?
    }

    let client: BlueZClient
    let selector: BlueZAdapterSelector
    let hooks: Hooks
    let state = Mutex(State())
    let waker = Waker()

    init(client: BlueZClient, selector: BlueZAdapterSelector, hooks: Hooks) {
        self.client = client
        self.selector = selector
        self.hooks = hooks
    }

    /// The server exporting the objects on the current connection, if any.
    var server: DBusObjectServer? { state.withLock { $0.server } }

    /// The adapter it is registered on now.
    var registeredAdapter: BlueZAdapter? { state.withLock { $0.registered?.adapter } }

    /// bluetoothd released the object: it counts as unregistered and is registered again.
    func released() {
        let was = state.withLock { s -> Bool in
            guard s.registered != nil else { return false }
            s.released = true
            return true
        }
        if was { waker.poke() }
    }

    /// Claims the loop; false when it already runs.
    func claim() -> Bool {
        state.withLock { s in
            if s.running { return false }
            s.running = true
            return true
        }
    }

    /// Registers, follows and re-registers until cancelled; then unregisters and removes the objects.
    func run() async {
        let waker = self.waker
        let hooks = self.hooks
        let id = client.subscribe { event, tree in
            hooks.treeEvent(event, tree)
            switch event {
            case .reloaded, .daemonLost, .busRestored: waker.poke()
            default: if event.touchesAdapters { waker.poke() }
            }
        }
        defer { client.unsubscribe(id) }
        var backoff = Backoff()
        var retryAt: ContinuousClock.Instant?
        let logger = client.logger
        while !Task.isCancelled {
            let owner = client.core.withLock { $0.loaded && !$0.busLost ? $0.owner : nil }
            let adapter = owner == nil ? nil : client.tree.adapters.first(where: selector.matches)
            if let reason = endReason(owner: owner, adapter: adapter) {
                logger.info("\(hooks.label): no longer registered: \(reason)")
                hooks.unregistered(reason)
                if reason == .released { retryAt = .now + backoff.take() }
                continue
            }
            let registered = state.withLock { $0.registered != nil }
            if !registered, let owner, let adapter, retryAt.map({ ContinuousClock.now >= $0 }) ?? true {
                retryAt = nil
                guard let connection = await currentConnection() else {
                    retryAt = .now + backoff.take()
                    continue
                }
                if Task.isCancelled { break }
                do {
                    _ = try await connection.call(
                        destination: BlueZName.service, path: DBusObjectPath(stringLiteral: adapter.path),
                        interface: hooks.managerInterface, method: hooks.registerMethod,
                        arguments: [.objectPath(hooks.objectPath), .stringVariantDictionary([])],
                        timeout: .seconds(10))
                    state.withLock {
                        $0.registered = Registered(adapter: adapter, owner: owner, connection: connection)
                    }
                    backoff.reset()
                    logger.info("\(hooks.label): registered on adapter \(adapter.name)")
                    hooks.registered(adapter)
                } catch {
                    if Task.isCancelled || error.name == DBusError.cancelled {
                        state.withLock {
                            $0.inFlight = Registered(adapter: adapter, owner: owner, connection: connection)
                        }
                        break
                    }
                    let delay = backoff.take()
                    retryAt = .now + delay
                    let failure = BlueZRegistrationFailure(
                        adapter: adapter.name, operation: hooks.registerMethod, failure: BlueZDBusFailure(error),
                        retryIn: delay)
                    logger.warning("\(hooks.label): \(failure)")
                    hooks.failed(failure)
                }
                continue
            }
            let timeout: Duration? =
                !registered && owner != nil && adapter != nil ? retryAt.map { max(.zero, $0 - .now) } : nil
            await waker.wait(timeout: timeout)
        }
        await shutDown()
    }

    /// Why the current registration no longer holds (and forgets it), or nil.
    private func endReason(owner: String?, adapter: BlueZAdapter?) -> BlueZRegistrationEndReason? {
        state.withLock { s -> BlueZRegistrationEndReason? in
            guard let registered = s.registered else {
                s.released = false
                return nil
            }
            let reason: BlueZRegistrationEndReason?
            if s.released {
                reason = .released
            } else if !registered.connection.isConnected || !client.isBusConnected {
                reason = .busLost
            } else if owner != registered.owner {
                reason = .bluetoothdStopped
            } else if adapter?.path != registered.adapter.path {
                reason = .adapterRemoved(adapter: registered.adapter.name)
            } else {
                reason = nil
            }
            if reason != nil {
                s.registered = nil
                s.released = false
            }
            return reason
        }
    }

    /// The live connection with the objects exported on it, opening a new one when needed.
    private func currentConnection() async -> DBusConnection? {
        if let connection = state.withLock({ $0.connection }), connection.isConnected { return connection }
        let fresh: DBusConnection
        do {
            fresh = try await BlueZClient.openConnectionOffPool(client.bus)
        } catch {
            client.logger.debug("\(hooks.label): cannot open a bus connection: \(error)")
            return nil
        }
        let server = hooks.export(fresh)
        let old = state.withLock { s -> DBusConnection? in
            let old = s.connection
            s.connection = fresh
            s.server = server
            return old
        }
        old?.close()
        return fresh
    }

    private func shutDown() async {
        let (registered, connection, server, inFlight) = state.withLock { s in
            defer {
                s.inFlight = nil
                s.registered = nil
                s.server = nil
                s.connection = nil
                s.running = false
            }
            return (s.registered, s.connection, s.server, s.inFlight)
        }
        let target = registered ?? inFlight
        let hooks = self.hooks
        // A task of its own: this one is cancelled, and a cancelled task's calls end at once.
        await Task {
            if let target, target.connection.isConnected {
                do {
                    _ = try await target.connection.call(
                        destination: BlueZName.service, path: DBusObjectPath(stringLiteral: target.adapter.path),
                        interface: hooks.managerInterface, method: hooks.unregisterMethod,
                        arguments: [.objectPath(hooks.objectPath)], timeout: .seconds(5))
                } catch {
                    self.client.logger.debug("\(hooks.label): \(hooks.unregisterMethod) failed: \(error)")
                }
            }
            if let server {
                for path in server.objectPaths.reversed() { server.removeObject(at: path) }
                server.flush()
            }
            await connection?.closeAndWait()
        }.value
        if registered != nil {
            client.logger.info("\(hooks.label): unregistered")
            hooks.unregistered(.cancelled)
        }
    }
}
