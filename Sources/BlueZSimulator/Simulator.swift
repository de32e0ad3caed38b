// BlueZSimulator: a bluetoothd look-alike on D-Bus. It owns `org.bluez`, exports the adapter, device and GATT
// objects of a scenario, and behaves like BlueZ 5.66+ as described in docs/BLUEZ.md §1 (signal order, error names
// and texts, per-sender sessions). All state lives on one serial queue; D-Bus handlers hop onto it and reply later.
import DBus
import Dispatch
import Synchronization
import YAML

/// Errors of the simulator as a process (startup, bus).
public struct SimulatorError: Error, Sendable, CustomStringConvertible {
    /// What went wrong, for the operator.
    public var description: String
    /// Creates an error with its message.
    public init(_ description: String) { self.description = description }
}

/// The simulator. Create it with a scenario, `start()` it, then await `waitUntilBusLost()`.
///
/// Threading: like bluetoothd's main loop, all simulation state lives on one thread: the D-Bus connection's dispatch
/// thread. Method handlers run there already; timers and socket events (on `queue`) hop onto it with `onLoop`, so
/// everything done in one turn is coalesced into the same PropertiesChanged, exactly like BlueZ's idle flush. That
/// confinement is what makes the `@unchecked Sendable` conformances of the state classes sound. `loop` (behind a
/// Mutex) is the only state read from other threads.
public final class BlueZSimulator: @unchecked Sendable {
    /// The scenario the simulator starts from (and returns to after RestartDaemon).
    public let scenario: Scenario
    let bus: DBusBus
    /// Timers and socket sources fire here, then hop onto the loop.
    let queue = DispatchQueue(label: "bluez-sim.timers")

    /// The current connection and its servers, and the restart epoch; stale work (from before a restart) is dropped.
    struct Loop {
        var connection: DBusConnection?
        var server: DBusObjectServer?
        var controlServer: DBusObjectServer?
        var epoch = 0
        var restarting = false
    }
    let loop = Mutex(Loop())

    var connection: DBusConnection? { loop.withLock { $0.connection } }
    var server: DBusObjectServer? { loop.withLock { $0.server } }
    var controlServer: DBusObjectServer? { loop.withLock { $0.controlServer } }
    /// Bumped on restart so stale timers do nothing.
    var epoch: Int { loop.withLock { $0.epoch } }

    var adapters: [SimAdapter] = []
    var devices: [SimDevice] = []
    var monitors: [SimMonitor] = []
    /// Registered monitor applications (owner, root), with or without monitors yet.
    var monitorApps: [(owner: String, root: DBusObjectPath)] = []
    /// Adapters taken away with RemoveAdapter; one added back with the same address takes their peripherals.
    var removedAdapters: [SimAdapterSpec] = []
    var counters: [String: Int] = [:]
    /// GATT applications (GattManager1) and their registrations still reading the app's objects.
    var localApps: [SimLocalApp] = []
    var pendingApps: [(owner: String, path: DBusObjectPath, adapterID: String)] = []
    /// Remote centrals connected to local adapters (control interface).
    var centrals: [SimCentral] = []
    /// LE advertisements (LEAdvertisingManager1), in registration order, and registrations still reading theirs.
    var advertisements: [SimLocalAdvertisement] = []
    var pendingAds: [(owner: String, path: DBusObjectPath, adapterID: String)] = []
    /// What the app answered to the last failed Write Command (the central never sees it).
    var lastCommandError: String?
    private let lost = Mutex<[CheckedContinuation<Void, Never>]?>([])
    private let stopRequested = Mutex(false)
    private let logVerbose: Bool

    /// - Parameters:
    ///   - scenario: the world to simulate.
    ///   - bus: where to serve `org.bluez` (usually `.system`, which honours DBUS_SYSTEM_BUS_ADDRESS).
    ///   - verbose: log each method call to stderr.
    public init(scenario: Scenario, bus: DBusBus = .system, verbose: Bool = false) {
        self.scenario = scenario
        self.bus = bus
        logVerbose = verbose
    }

    /// Connects, exports the objects and owns `org.bluez`.
    /// - Throws: `SimulatorError` when the bus cannot be reached or the name is taken.
    public func start() async throws(SimulatorError) {
        try await start(exportDelay: 0)
    }

    /// `start()`, optionally owning `org.bluez` `exportDelay` seconds before exporting any object (bluetoothd owns
    /// its name before its ObjectManager answers; meanwhile GetManagedObjects fails with UnknownMethod).
    func start(exportDelay: Double) async throws(SimulatorError) {
        let connection: DBusConnection
        do { connection = try DBusConnection(bus) } catch {
            throw SimulatorError("cannot connect to the bus: \(error)")
        }
        if exportDelay > 0 {
            do {
                _ = try await connection.requestName("org.bluez", flags: [.doNotQueue])
            } catch {
                connection.close()
                throw SimulatorError("cannot own org.bluez: \(error)")
            }
            try? await Task.sleep(for: .seconds(exportDelay))
        }
        // bluetoothd's gdbus answers Properties errors with its own names (InvalidArgs for an unknown property).
        let server = DBusObjectServer(connection: connection, objectManagerPath: "/", propertyErrors: .bluez)
        let controlServer = DBusObjectServer(connection: connection, objectManagerPath: "/org/bluez/sim")
        let epoch = loop.withLock { l -> Int in
            l.connection = connection
            l.server = server
            l.controlServer = controlServer
            l.restarting = false
            l.epoch += 1
            return l.epoch
        }
        await withCheckedContinuation { (done: CheckedContinuation<Void, Never>) in
            server.perform {
                self.resetState()
                // AutoEnable: the adapter is on the bus before it is powered (settings.auto_enable_delay).
                let late = self.scenario.autoEnableDelay > 0 ? self.adapters.filter(\.powered) : []
                for a in late { a.powered = false }
                self.exportRoot()
                if !late.isEmpty { self.after(self.scenario.autoEnableDelay) { self.autoEnable(late) } }
                done.resume()
            }
        }
        do {
            let ownerStream = try await connection.signals(
                matching: DBusMatchRule(
                    type: .signal, sender: "org.freedesktop.DBus", interface: "org.freedesktop.DBus",
                    member: "NameOwnerChanged"))
            Task { [weak self] in
                for await message in ownerStream {
                    guard let self else { return }
                    if message.body.count == 3, let name = message.body[0].string, let new = message.body[2].string,
                        name.hasPrefix(":"), new.isEmpty
                    {
                        self.onLoop(epoch: epoch) { self.clientLeft(name) }
                    }
                }
            }
            let reply = try await connection.requestName("org.bluez", flags: [.doNotQueue])
            guard reply == .primaryOwner || reply == .alreadyOwner else {
                connection.close()
                throw SimulatorError("org.bluez is already owned on this bus (is bluetoothd running?)")
            }
        } catch let error as DBusError {
            connection.close()
            throw SimulatorError("cannot own org.bluez: \(error)")
        } catch let error as SimulatorError {
            throw error
        } catch {
            throw SimulatorError("cannot own org.bluez: \(error)")
        }
        Task { [weak self] in
            await connection.waitUntilDisconnected()
            guard let self else { return }
            let intentional = self.loop.withLock { $0.restarting || $0.connection !== connection }
            if !intentional { self.markLost() }
        }
    }

    /// Returns when the bus connection is lost (not when a simulated restart closes it) or `stop()` was called.
    /// - Returns: true when the bus was lost, false after `stop()`.
    @discardableResult
    public func waitUntilBusLost() async -> Bool {
        await withCheckedContinuation { (c: CheckedContinuation<Void, Never>) in
            let resumeNow = lost.withLock { waiters -> Bool in
                guard waiters != nil else { return true }
                waiters!.append(c)
                return false
            }
            if resumeNow { c.resume() }
        }
        return !stopRequested.withLock { $0 }
    }

    func markLost() {
        let waiters = lost.withLock { w -> [CheckedContinuation<Void, Never>] in
            let all = w ?? []
            w = nil
            return all
        }
        for w in waiters { w.resume() }
    }

    /// Closes the connection (org.bluez and every object vanish) and wakes `waitUntilBusLost()`. Callable from any
    /// thread; the process is expected to exit afterwards.
    public func stop() {
        stopRequested.withLock { $0 = true }
        detachConnection()?.close()
        markLost()
    }

    /// Forgets the bus connection and its object servers (a new epoch: timers of the old one do nothing) and returns
    /// the connection for the caller to close, outside the lock.
    func detachConnection() -> DBusConnection? {
        loop.withLock { l -> DBusConnection? in
            l.epoch += 1
            l.restarting = true
            let c = l.connection
            l.connection = nil
            l.server = nil
            l.controlServer = nil
            return c
        }
    }

    /// Runs `body` on the loop (the connection's dispatch thread), unless a restart happened since `epoch`.
    func onLoop(epoch: Int, _ body: @escaping @Sendable () -> Void) {
        let server = loop.withLock { $0.epoch == epoch ? $0.server : nil }
        server?.perform { [weak self] in
            guard let self, self.epoch == epoch else { return }
            body()
        }
    }

    func log(_ text: String) {
        if logVerbose { printError("bluez-sim: \(text)") }
    }

    func count(_ key: String, _ n: Int = 1) { counters[key, default: 0] += n }

    // MARK: state

    func resetState() {
        adapters = scenario.adapters.map(SimAdapter.init)
        let now = monotonicSeconds()
        devices = scenario.peripherals.compactMap { spec in
            guard let a = adapters.first(where: { $0.spec.id == spec.adapter }) else { return nil }
            return SimDevice(spec: spec, adapterPath: a.path, now: now)
        }
        monitors = []
        monitorApps = []
        for app in localApps { app.watch?.cancel() }
        for ad in advertisements { ad.watch?.cancel() }
        localApps = []
        pendingApps = []
        centrals = []
        advertisements = []
        pendingAds = []
        removedAdapters = []
    }

    func tearDownDevices() {
        for d in devices {
            for c in d.characteristics {
                c.timer?.cancel()
                c.timer = nil
                c.notifySocket?.close()
                c.notifySocket = nil
                c.writeSocket?.close()
                c.writeSocket = nil
            }
        }
    }

    func adapter(of device: SimDevice) -> SimAdapter? { adapters.first { $0.spec.id == device.adapterID } }

    func device(at path: DBusObjectPath) -> SimDevice? { devices.first { $0.path == path } }

    func device(address: String) -> SimDevice? {
        let a = address.uppercased()
        return devices.first { $0.spec.address == a }
    }

    /// Powers `late` on, as bluetoothd's AutoEnable does a moment after it exported them.
    func autoEnable(_ late: [SimAdapter]) {
        for a in late where adapters.contains(where: { $0 === a }) && !a.powered {
            a.powered = true
            server?.setProperty(at: a.path, interface: "org.bluez.Adapter1", "Powered", .boolean(true))
            server?.setProperty(at: a.path, interface: "org.bluez.Adapter1", "PowerState", .string("on"))
        }
        server?.flush()
    }

    /// Runs `body` on the loop after `seconds`, unless a restart happened meanwhile.
    func after(_ seconds: Double, _ body: @escaping @Sendable () -> Void) {
        let epoch = self.epoch
        queue.asyncAfter(deadline: simDeadline(seconds)) { [weak self] in
            self?.onLoop(epoch: epoch, body)
        }
    }

    // MARK: helpers for replies

    static func bluezError(_ name: String, _ message: String) -> DBusError {
        DBusError(name: "org.bluez.Error." + name, message: message)
    }
    static let invalidArguments = bluezError("InvalidArguments", "Invalid arguments in method call")
    static let notReady = bluezError("NotReady", "Resource Not Ready")
    static let doesNotExist = bluezError("DoesNotExist", "Does Not Exist")
    static let inProgress = bluezError("InProgress", "In Progress")
    static let notSupported = bluezError("NotSupported", "Operation is not supported")
    static let notConnectedFailed = bluezError("Failed", "Not connected")
    static let alreadyExists = bluezError("AlreadyExists", "Already Exists")

    /// Wraps a handler (it runs on the loop already) that replies through `call.reply`, now or later.
    func onQueue(_ body: @escaping @Sendable (BlueZSimulator, DBusMethodCall) -> Void) -> DBusMethodHandler {
        { [weak self] call in
            guard let self else { return .error(DBusError(name: DBusError.failed, message: "simulator stopped")) }
            self.log("\(call.sender) \(call.interface).\(call.member) \(call.path)")
            body(self, call)
            return .deferred
        }
    }
}

/// Writes a line to stderr.
func printError(_ text: String) {
    var line = text
    line += "\n"
    _ = line.withCString { fputsStderr($0) }
}

/// A dispatch deadline `seconds` from now (negative counts as now).
func simDeadline(_ seconds: Double) -> DispatchTime {
    .now() + .nanoseconds(Int(max(0, min(seconds, 1e6)) * 1e9))
}
