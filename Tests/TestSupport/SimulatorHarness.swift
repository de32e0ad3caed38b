// Simulator fixture: a private dbus-daemon plus a running `bluez-sim` loaded with a scenario. Used by the simulator's
// own tests and by the BlueZ client tests. Like DBusHarness.swift, it never uses FileHandle.readabilityHandler
// (swift-corelibs-libdispatch#949): children write to files, which are read back.
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// A private bus with `bluez-sim` serving `org.bluez` on it.
///
/// ```swift
/// let sim = try await SimulatorFixture.start(scenario: """
///     peripherals:
///       - address: "C0:FF:EE:00:00:01"
///         name: Strap
///     """)                                   // or `try SimulatorFixture(scenario:)` from synchronous code
/// defer { sim.stop() }
/// // point a client at sim.address (or sim.environment), then:
/// try sim.control("PushNotification", ["string:C0:FF:EE:00:00:01", "string:2A37", "array:byte:0,72"])
/// ```
public final class SimulatorFixture: @unchecked Sendable {
    /// The private bus the simulator serves on (`address`, `environment`).
    public let bus: PrivateDBusDaemon
    /// The `bluez-sim` child process.
    public let process: SimulatorProcess
    /// The scenario file the simulator was started with.
    public let scenarioFile: URL
    private let scratch: TemporaryDirectory

    /// The bus address, e.g. `unix:path=/tmp/.../bus`.
    public var address: String { bus.address }

    /// Environment that points libdbus, bleak and bluetoothctl at this bus (DBUS_SYSTEM_BUS_ADDRESS).
    public var environment: [String: String] { bus.environment }

    /// Starts a private bus and `bluez-sim` with `scenario` (YAML or JSON text); returns once `org.bluez` is owned
    /// and answers `Peer.Ping`. Blocks the calling thread: from async tests use `start(scenario:arguments:)`.
    /// - Parameter arguments: extra command-line arguments for `bluez-sim`.
    public convenience init(scenario: String, arguments: [String] = []) throws {
        let scratch = try TemporaryDirectory(prefix: "blebridge-sim")
        let file = scratch.url.appendingPathComponent("scenario.yaml")
        try scenario.write(to: file, atomically: true, encoding: .utf8)
        try self.init(scenarioFile: file, scratch: scratch, arguments: arguments)
    }

    /// The same as `init(scenario:arguments:)`, for async tests: start-up blocks (process launch, polling), so it
    /// runs on a plain thread instead of holding one of the few cooperative threads other tests need.
    public static func start(scenario: String, arguments: [String] = []) async throws -> SimulatorFixture {
        try await withCheckedThrowingContinuation { continuation in
            Thread.detachNewThread {
                continuation.resume(with: Result { try SimulatorFixture(scenario: scenario, arguments: arguments) })
            }
        }
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
        bus = try PrivateDBusDaemon()
        process = try SimulatorProcess(
            executable: Fixtures.executable("bluez-sim"), arguments: ["--scenario", scenarioFile.path] + arguments,
            environment: bus.environment, directory: scratch.url)
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
    /// printed reply. Throws when the call fails, with the D-Bus error text. Blocks the calling thread.
    @discardableResult
    public func control(_ method: String, _ args: [String] = []) throws -> String {
        let result = try dbusSend(
            ["--dest=org.bluez", "--print-reply", "/org/bluez/sim", "io.blebridge.Simulator1.\(method)"] + args)
        guard result.status == 0 else {
            let text = result.stderr.trimmingCharacters(in: .whitespacesAndNewlines)
            throw HarnessError("Simulator1.\(method) failed: \(text)")
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
        let child = try SimulatorProcess(
            executable: tool, arguments: ["--system", "--reply-timeout=\(Int(timeout * 1000))"] + args,
            environment: environment, directory: scratch.url)
        let status = try child.waitForExit(timeout: timeout + 5)
        return (status, child.stdout, child.stderr)
    }

    /// Stops `bluez-sim` (SIGTERM) and then the bus. Safe to call twice.
    public func stop() {
        process.stop()
        bus.killDaemon()
    }

    deinit { stop() }
}

/// A child process whose stdout and stderr go to files (no readabilityHandler); SIGTERM then SIGKILL on stop.
public final class SimulatorProcess: @unchecked Sendable {
    /// The underlying process.
    public let process: Process
    private let outURL: URL
    private let errURL: URL

    /// Starts `executable`; output lands in fresh files under `directory`.
    public init(executable: URL, arguments: [String], environment: [String: String], directory: URL) throws {
        let id = UUID().uuidString.prefix(8)
        outURL = directory.appendingPathComponent("\(executable.lastPathComponent)-\(id).out")
        errURL = directory.appendingPathComponent("\(executable.lastPathComponent)-\(id).err")
        FileManager.default.createFile(atPath: outURL.path, contents: nil)
        FileManager.default.createFile(atPath: errURL.path, contents: nil)
        let out = try FileHandle(forWritingTo: outURL)
        let err = try FileHandle(forWritingTo: errURL)
        defer {
            try? out.close()
            try? err.close()
        }
        process = Process()
        process.executableURL = executable
        process.arguments = arguments
        process.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 }
        process.standardInput = FileHandle.nullDevice
        process.standardOutput = out
        process.standardError = err
        try process.run()
    }

    /// Everything written to stdout so far.
    public var stdout: String { (try? String(contentsOf: outURL, encoding: .utf8)) ?? "" }
    /// Everything written to stderr so far.
    public var stderr: String { (try? String(contentsOf: errURL, encoding: .utf8)) ?? "" }
    /// The process id.
    public var pid: Int32 { process.processIdentifier }
    /// Whether it still runs.
    public var isRunning: Bool { process.isRunning }

    /// Waits until `condition(stdout)` holds; throws if the process exits first or after `timeout` seconds.
    public func waitForOutput(timeout: TimeInterval, _ condition: (String) -> Bool) throws {
        let deadline = Date().addingTimeInterval(timeout)
        while Date() < deadline {
            if condition(stdout) { return }
            if !process.isRunning {
                if condition(stdout) { return }
                throw HarnessError(
                    "\(process.executableURL?.lastPathComponent ?? "child") exited "
                        + "(status \(process.terminationStatus)); stderr: \(stderr)")
            }
            Thread.sleep(forTimeInterval: 0.01)
        }
        throw HarnessError("timed out after \(timeout)s; stdout: \(stdout); stderr: \(stderr)")
    }

    /// Waits for the process to exit by itself (SIGKILL after `timeout`) and returns its status.
    @discardableResult
    public func waitForExit(timeout: TimeInterval) throws -> Int32 {
        let deadline = Date().addingTimeInterval(timeout)
        while process.isRunning {
            if Date() > deadline {
                kill(process.processIdentifier, SIGKILL)
                process.waitUntilExit()
                throw HarnessError("\(process.executableURL?.lastPathComponent ?? "child") did not exit in \(timeout)s")
            }
            Thread.sleep(forTimeInterval: 0.005)
        }
        process.waitUntilExit()
        return process.terminationStatus
    }

    /// SIGTERM, then SIGKILL after `grace` seconds. Safe to call twice.
    public func stop(grace: TimeInterval = 3) {
        guard process.isRunning else { return }
        kill(process.processIdentifier, SIGTERM)
        let deadline = Date().addingTimeInterval(grace)
        while process.isRunning && Date() < deadline { Thread.sleep(forTimeInterval: 0.01) }
        if process.isRunning { kill(process.processIdentifier, SIGKILL) }
        process.waitUntilExit()
    }

    deinit { stop(grace: 1) }
}
