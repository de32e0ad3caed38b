// Simulator fixture: a private dbus-daemon plus a running `bluez-sim` loaded with a scenario. Used by the simulator's
// own tests, the BlueZ client tests and the CLI tests. Built on Harness.swift's PrivateBus and ChildProcess.
import Foundation

/// A private bus with `bluez-sim` serving `org.bluez` on it.
///
/// ```swift
/// let sim = try await SimulatorFixture.start(scenario: """
///     peripherals:
///       - address: "C0:FF:EE:00:00:01"
///         name: Strap
///     """)                                   // or `try SimulatorFixture(scenario:)` from synchronous code
/// defer { sim.stopInBackground() }
/// // point a client at sim.address (or sim.environment), then:
/// try await sim.control("PushNotification", ["string:C0:FF:EE:00:00:01", "string:2A37", "array:byte:0,72"])
/// ```
public final class SimulatorFixture: @unchecked Sendable {
    /// The private bus the simulator serves on (`address`, `environment`).
    public let bus: PrivateBus
    /// The `bluez-sim` child process.
    public let process: ChildProcess
    /// The scenario file the simulator was started with.
    public let scenarioFile: URL
    private let scratch: TemporaryDirectory

    /// The bus address, e.g. `unix:path=/tmp/.../bus`.
    public var address: String { bus.address }

    /// Environment that points libdbus, bleak and bluetoothctl at this bus (DBUS_SYSTEM_BUS_ADDRESS).
    public var environment: [String: String] { bus.environment }

    /// Launches `bluez-sim` on `bus` without waiting for it.
    private init(bus: PrivateBus, scenarioFile: URL, scratch: TemporaryDirectory, arguments: [String]) throws {
        self.bus = bus
        self.scenarioFile = scenarioFile
        self.scratch = scratch
        process = try ChildProcess(
            executable: Fixtures.executable("bluez-sim"), arguments: ["--scenario", scenarioFile.path] + arguments,
            environment: bus.environment, currentDirectory: scratch.url)
    }

    private static func write(_ scenario: String) throws -> (URL, TemporaryDirectory) {
        let scratch = try TemporaryDirectory(prefix: "blebridge-sim")
        let file = scratch.url.appendingPathComponent("scenario.yaml")
        try scenario.write(to: file, atomically: true, encoding: .utf8)
        return (file, scratch)
    }

    private static let ready = "bluez-sim: ready"

    /// Starts a private bus and `bluez-sim` with `scenario` (YAML or JSON text); returns once `org.bluez` is owned
    /// and answers `Peer.Ping`. Sleeps the calling thread: from async tests use `start(scenario:arguments:)`.
    /// - Parameter arguments: extra command-line arguments for `bluez-sim`.
    public convenience init(scenario: String, arguments: [String] = []) throws {
        let (file, scratch) = try Self.write(scenario)
        try self.init(bus: PrivateBus(), scenarioFile: file, scratch: scratch, arguments: arguments)
        try process.waitForOutput(timeout: 20) { $0.contains(Self.ready) }
        try waitForBlueZ()
    }

    /// Starts a private bus and `bluez-sim` with a scenario file (for example `Fixtures.config("demo-scenario.yaml")`).
    /// Sleeps the calling thread: from async tests use `start(scenarioFile:arguments:)`.
    public convenience init(scenarioFile: URL, arguments: [String] = []) throws {
        try self.init(
            bus: PrivateBus(), scenarioFile: scenarioFile, scratch: TemporaryDirectory(prefix: "blebridge-sim"),
            arguments: arguments)
        try process.waitForOutput(timeout: 20) { $0.contains(Self.ready) }
        try waitForBlueZ()
    }

    /// The async form of `init(scenario:arguments:)`: it suspends instead of sleeping a cooperative thread.
    public static func start(scenario: String, arguments: [String] = []) async throws -> SimulatorFixture {
        let (file, scratch) = try write(scenario)
        return try await start(scenarioFile: file, scratch: scratch, arguments: arguments)
    }

    /// The async form of `init(scenarioFile:arguments:)`.
    public static func start(scenarioFile: URL, arguments: [String] = []) async throws -> SimulatorFixture {
        try await start(
            scenarioFile: scenarioFile, scratch: TemporaryDirectory(prefix: "blebridge-sim"), arguments: arguments)
    }

    private static func start(
        scenarioFile: URL, scratch: TemporaryDirectory, arguments: [String]
    ) async throws -> SimulatorFixture {
        let sim = try SimulatorFixture(
            bus: try await PrivateBus.start(), scenarioFile: scenarioFile, scratch: scratch, arguments: arguments)
        try await sim.process.waitForOutput(timeout: 20) { $0.contains(ready) }
        try await sim.waitForBlueZ()
        return sim
    }

    private static let ping = ["--dest=org.bluez", "/", "org.freedesktop.DBus.Peer.Ping"]

    /// Waits until `org.bluez` answers `org.freedesktop.DBus.Peer.Ping` (for example after `RestartDaemon`).
    /// Sleeps the calling thread.
    public func waitForBlueZ(timeout: TimeInterval = 10) throws {
        var last = ""
        let answered = try waitUntilBlocking(timeout: timeout, every: 0.05) {
            let result = try dbusSend(Self.ping)
            last = result.stderr
            return result.status == 0
        }
        if !answered { throw blueZTimeout(timeout, last) }
    }

    /// The async form of `waitForBlueZ(timeout:)`.
    public func waitForBlueZ(timeout: TimeInterval = 10) async throws {
        var last = ""
        let answered = try await waitUntil(timeout: timeout, every: 0.05) {
            let result = try await dbusSend(Self.ping)
            last = result.stderr
            return result.status == 0
        }
        if !answered { throw blueZTimeout(timeout, last) }
    }

    private func blueZTimeout(_ timeout: TimeInterval, _ last: String) -> HarnessError {
        HarnessError("org.bluez did not answer Ping within \(timeout)s: \(last); sim stderr: \(process.stderr)")
    }

    /// Calls a method of the simulator's control interface (`io.blebridge.Simulator1` at `/org/bluez/sim`) with
    /// `dbus-send` typed arguments (`"string:AA:BB:CC:DD:EE:FF"`, `"double:5"`, `"array:byte:1,2"`) and returns the
    /// printed reply. Throws when the call fails, with the D-Bus error text. Sleeps the calling thread.
    @discardableResult
    public func control(_ method: String, _ args: [String] = []) throws -> String {
        try Self.reply(method, dbusSend(Self.controlArguments(method, args)))
    }

    /// The async form of `control(_:_:)`.
    @discardableResult
    public func control(_ method: String, _ args: [String] = []) async throws -> String {
        try Self.reply(method, await dbusSend(Self.controlArguments(method, args)))
    }

    private static func controlArguments(_ method: String, _ args: [String]) -> [String] {
        ["--dest=org.bluez", "--print-reply", "/org/bluez/sim", "io.blebridge.Simulator1.\(method)"] + args
    }

    private static func reply(
        _ method: String, _ result: (status: Int32, stdout: String, stderr: String)
    ) throws -> String {
        guard result.status == 0 else {
            let text = result.stderr.trimmingCharacters(in: .whitespacesAndNewlines)
            throw HarnessError("Simulator1.\(method) failed: \(text)")
        }
        return result.stdout
    }

    /// Runs `dbus-send --system` against this bus with `args` (anything: hostile calls included). Sleeps the
    /// calling thread.
    public func dbusSend(_ args: [String], timeout: TimeInterval = 20) throws -> (
        status: Int32, stdout: String, stderr: String
    ) {
        try runCommand(
            try Self.dbusSendTool(), Self.dbusSendArguments(args, timeout), environment: environment,
            timeout: timeout + 5)
    }

    /// The async form of `dbusSend(_:timeout:)`.
    public func dbusSend(_ args: [String], timeout: TimeInterval = 20) async throws -> (
        status: Int32, stdout: String, stderr: String
    ) {
        try await runCommand(
            try Self.dbusSendTool(), Self.dbusSendArguments(args, timeout), environment: environment,
            timeout: timeout + 5)
    }

    private static func dbusSendTool() throws -> URL {
        guard let tool = which("dbus-send") else {
            throw HarnessError("dbus-send not found; run scripts/install-deps.sh")
        }
        return tool
    }

    private static func dbusSendArguments(_ args: [String], _ timeout: TimeInterval) -> [String] {
        ["--system", "--reply-timeout=\(Int(timeout * 1000))"] + args
    }

    /// Stops `bluez-sim` (SIGTERM) and then the bus. Safe to call twice. Sleeps the calling thread.
    public func stop() {
        process.stop()
        bus.stop()
    }

    /// The async form of `stop()`.
    public func stop() async {
        await process.stop()
        await bus.stop()
    }

    /// Sends `bluez-sim` SIGTERM now and finishes `stop()` on a background thread; returns at once (for `defer` in
    /// async tests).
    public func stopInBackground() {
        process.signal(SIGTERM)
        Thread.detachNewThread { [self] in stop() }
    }
}
