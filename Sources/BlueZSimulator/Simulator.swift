// BlueZSimulator: a bluetoothd look-alike on D-Bus. It owns `org.bluez`, exports the adapter, device and GATT
// objects of a scenario, and behaves like BlueZ 5.66+ as described in docs/BLUEZ.md §1 (signal order, error names
// and texts, per-sender sessions). All state lives on one serial queue; D-Bus handlers hop onto it and reply later.
import DBus
import Dispatch
import Synchronization
import YAML

/// Errors of the simulator as a process (startup, bus).
public struct SimulatorError: Error, Sendable, CustomStringConvertible {
    public var description: String
    public init(_ description: String) { self.description = description }
}

/// The simulator. Create it with a scenario, `start()` it, then await `waitUntilBusLost()`.
///
/// Threading: every piece of state is touched only on `queue` (a serial dispatch queue). D-Bus method handlers run on
/// the connection's thread and immediately hop onto `queue`, replying through the deferred reply.
public final class BlueZSimulator: @unchecked Sendable {
    /// The scenario the simulator starts from (and returns to after RestartDaemon).
    public let scenario: Scenario
    let bus: DBusBus
    let queue = DispatchQueue(label: "bluez-sim")
    var connection: DBusConnection?
    var server: DBusObjectServer?
    var controlServer: DBusObjectServer?
    var adapters: [SimAdapter] = []
    var devices: [SimDevice] = []
    /// The scenario with runtime additions (AddPeripheral) removed on restart.
    var monitors: [SimMonitor] = []
    /// Registered monitor applications (owner, root), with or without monitors yet.
    var monitorApps: [(owner: String, root: DBusObjectPath)] = []
    var counters: [String: Int] = [:]
    /// Bumped on restart so stale timers do nothing.
    var epoch = 0
    var restarting = false
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
        let connection: DBusConnection
        do { connection = try DBusConnection(bus) } catch {
            throw SimulatorError("cannot connect to the bus: \(error)")
        }
        let server = DBusObjectServer(connection: connection, objectManagerPath: "/")
        let controlServer = DBusObjectServer(connection: connection, objectManagerPath: "/org/bluez/sim")
        queue.sync {
            self.connection = connection
            self.server = server
            self.controlServer = controlServer
            self.restarting = false
            self.resetState()
            self.exportRoot()
        }
        do {
            let ownerStream = try await connection.signals(
                matching: DBusMatchRule(
                    type: .signal, sender: "org.freedesktop.DBus", interface: "org.freedesktop.DBus",
                    member: "NameOwnerChanged"))
            let epoch = queue.sync { self.epoch }
            Task { [weak self] in
                do {
                    for await message in ownerStream {
                        guard let self else { return }
                        if message.body.count == 3, let name = message.body[0].string, let new = message.body[2].string,
                            name.hasPrefix(":"), new.isEmpty
                        {
                            self.queue.async { if self.epoch == epoch { self.clientLeft(name) } }
                        }
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
            let intentional = self.queue.sync { self.restarting || self.connection !== connection }
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

    private func markLost() {
        let waiters = lost.withLock { w -> [CheckedContinuation<Void, Never>] in
            let all = w ?? []
            w = nil
            return all
        }
        for w in waiters { w.resume() }
    }

    /// Stops timers, closes sockets and the connection.
    public func stop() {
        stopRequested.withLock { $0 = true }
        queue.sync {
            self.epoch += 1
            self.restarting = true
            self.tearDownDevices()
            self.connection?.close()
            self.connection = nil
            self.server = nil
            self.controlServer = nil
        }
        markLost()
    }

    func log(_ text: String) {
        if logVerbose { printError("bluez-sim: \(text)") }
    }

    func count(_ key: String, _ n: Int = 1) { counters[key, default: 0] += n }

    // MARK: state

    func resetState() {
        epoch += 1
        adapters = scenario.adapters.map(SimAdapter.init)
        let now = monotonicSeconds()
        devices = scenario.peripherals.compactMap { spec in
            guard let a = adapters.first(where: { $0.spec.id == spec.adapter }) else { return nil }
            return SimDevice(spec: spec, adapterPath: a.path, now: now)
        }
        monitors = []
        monitorApps = []
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

    /// Runs `body` on the queue after `seconds`, unless a restart happened meanwhile.
    func after(_ seconds: Double, _ body: @escaping @Sendable () -> Void) {
        let epoch = self.epoch
        queue.asyncAfter(deadline: simDeadline(seconds)) { [weak self] in
            guard let self, self.epoch == epoch else { return }
            body()
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

    /// Wraps a handler that runs on the simulator queue.
    func onQueue(_ body: @escaping @Sendable (BlueZSimulator, DBusMethodCall) -> Void) -> DBusMethodHandler {
        { [weak self] call in
            guard let self else { return .error(DBusError(name: DBusError.failed, message: "simulator stopped")) }
            self.queue.async {
                self.log("\(call.sender) \(call.interface).\(call.member) \(call.path)")
                body(self, call)
            }
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
