// Simulator fixture: a private dbus-daemon plus a running `bluez-sim` loaded with a scenario. Used by the simulator's
// own tests and by the BlueZ client tests.
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// A private bus with `bluez-sim` serving `org.bluez` on it.
///
/// ```swift
/// let sim = try SimulatorFixture(scenario: """
///     peripherals:
///       - address: "C0:FF:EE:00:00:01"
///         name: Strap
///     """)
/// defer { sim.stop() }
/// // point a client at sim.address (or sim.environment), then:
/// try sim.control("PushNotification", ["string:C0:FF:EE:00:00:01", "string:2A37", "array:byte:0,72"])
/// ```
public final class SimulatorFixture: @unchecked Sendable {
    /// The private bus the simulator serves on.
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

    /// Starts a private bus and `bluez-sim` with `scenario` (YAML or JSON text); returns once `org.bluez` is owned
    /// and answers `Peer.Ping`.
    /// - Parameter arguments: extra command-line arguments for `bluez-sim`.
    public convenience init(scenario: String, arguments: [String] = []) throws {
        let scratch = try TemporaryDirectory(prefix: "blebridge-sim")
        let file = scratch.url.appendingPathComponent("scenario.yaml")
        try scenario.write(to: file, atomically: true, encoding: .utf8)
        try self.init(scenarioFile: file, scratch: scratch, arguments: arguments)
    }

    /// Starts a private bus and `bluez-sim` with a scenario file (for example `Fixtures.config("demo-scenario.yaml")`).
    public convenience init(scenarioFile: URL, arguments: [String] = []) throws {
        try self.init(
            scenarioFile: scenarioFile, scratch: TemporaryDirectory(prefix: "blebridge-sim"),
            arguments: arguments)
    }

    private init(scenarioFile: URL, scratch: TemporaryDirectory, arguments: [String]) throws {
        self.scratch = scratch
        self.scenarioFile = scenarioFile
        bus = try PrivateBus()
        process = try ChildProcess(
            name: "bluez-sim", executable: Fixtures.executable("bluez-sim"),
            arguments: ["--scenario", scenarioFile.path] + arguments, environment: bus.environment)
        try process.waitForOutput(timeout: 20) { $0.contains("bluez-sim: ready") }
        try waitForBlueZ()
    }

    /// Waits until `org.bluez` answers `org.freedesktop.DBus.Peer.Ping` (for example after `RestartDaemon`).
    public func waitForBlueZ(timeout: TimeInterval = 10) throws {
        let deadline = Date().addingTimeInterval(timeout)
        var last = ""
        while Date() < deadline {
            let result = try dbusSend(["--dest=org.bluez", "/", "org.freedesktop.DBus.Peer.Ping"])
            if result.status == 0 { return }
            last = result.stderr
            Thread.sleep(forTimeInterval: 0.05)
        }
        throw HarnessError("org.bluez did not answer Ping within \(timeout)s: \(last); sim stderr: \(process.stderr)")
    }

    /// Calls a method of the simulator's control interface (`io.blebridge.Simulator1` at `/org/bluez/sim`) with
    /// `dbus-send` typed arguments (`"string:AA:BB:CC:DD:EE:FF"`, `"double:5"`, `"array:byte:1,2"`) and returns the
    /// printed reply. Throws when the call fails, with the D-Bus error text.
    @discardableResult
    public func control(_ method: String, _ args: [String] = []) throws -> String {
        let result = try dbusSend(
            ["--dest=org.bluez", "--print-reply", "/org/bluez/sim", "io.blebridge.Simulator1.\(method)"] + args)
        guard result.status == 0 else {
            throw HarnessError(
                "Simulator1.\(method) failed: \(result.stderr.trimmingCharacters(in: .whitespacesAndNewlines))")
        }
        return result.stdout
    }

    /// Runs `dbus-send --system` against this bus with `args` (anything: hostile calls included).
    public func dbusSend(_ args: [String], timeout: TimeInterval = 20) throws -> (
        status: Int32, stdout: String, stderr: String
    ) {
        guard let tool = which("dbus-send") else {
            throw HarnessError("dbus-send not found; run scripts/install-deps.sh")
        }
        return try runCommand(
            tool, ["--system", "--reply-timeout=\(Int(timeout * 1000))"] + args,
            environment: environment, timeout: timeout + 5)
    }

    /// Stops `bluez-sim` (SIGTERM) and then the bus. Safe to call twice.
    public func stop() {
        process.stop()
        bus.daemon.stop()
    }

    deinit { stop() }
}
