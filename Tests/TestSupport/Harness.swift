// Test harness: starts the real parts (a private dbus-daemon, a mosquitto broker, our executables) and stops them
// by PID. Tests use full Foundation; the daemon's own targets do not.
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// Errors raised while setting up a test fixture.
public struct HarnessError: Error, CustomStringConvertible {
    public let description: String
    public init(_ description: String) { self.description = description }
}

/// Paths inside the package checkout.
public enum Fixtures {
    /// The package root (the folder holding Package.swift).
    public static let packageRoot: URL = {
        URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
            .deletingLastPathComponent()
    }()

    /// A file under `Tests/Fixtures/`.
    public static func url(_ name: String) -> URL {
        packageRoot.appendingPathComponent("Tests/Fixtures").appendingPathComponent(name)
    }

    /// A file under `config/`.
    public static func config(_ name: String) -> URL {
        packageRoot.appendingPathComponent("config").appendingPathComponent(name)
    }

    /// The folder holding the built products of the running test bundle (`.build/debug`), where the
    /// `blebridge` and `bluez-sim` executables are, once built.
    public static let productsDirectory: URL = {
        if let override = ProcessInfo.processInfo.environment["BLEBRIDGE_BIN_DIR"] {
            return URL(fileURLWithPath: override)
        }
        // The test bundle lives in .build/<triple>/debug/blebridgePackageTests.xctest
        let exe = URL(fileURLWithPath: CommandLine.arguments[0]).resolvingSymlinksInPath()
        var dir = exe.deletingLastPathComponent()
        for _ in 0..<3 {
            if FileManager.default.fileExists(atPath: dir.appendingPathComponent("bluez-sim").path)
                || FileManager.default.fileExists(atPath: dir.appendingPathComponent("blebridge").path)
            {
                return dir
            }
            dir = dir.deletingLastPathComponent()
        }
        return packageRoot.appendingPathComponent(".build/debug")
    }()

    /// The path of one of the package's executables.
    public static func executable(_ name: String) -> URL {
        productsDirectory.appendingPathComponent(name)
    }
}

/// A fresh temporary directory, removed when the value is deinitialised.
public final class TemporaryDirectory: @unchecked Sendable {
    public let url: URL
    public init(prefix: String = "blebridge-test") throws {
        let base = URL(fileURLWithPath: NSTemporaryDirectory())
        url = base.appendingPathComponent("\(prefix)-\(UUID().uuidString.prefix(8))")
        try FileManager.default.createDirectory(at: url, withIntermediateDirectories: true)
    }
    deinit { try? FileManager.default.removeItem(at: url) }
}

/// Asks the kernel for a free TCP port on 127.0.0.1.
public func freeLoopbackPort() throws -> UInt16 {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
    guard fd >= 0 else { throw HarnessError("socket() failed: errno \(errno)") }
    defer { close(fd) }
    var addr = sockaddr_in()
    addr.sin_family = sa_family_t(AF_INET)
    addr.sin_port = 0
    addr.sin_addr.s_addr = inet_addr("127.0.0.1")
    var len = socklen_t(MemoryLayout<sockaddr_in>.size)
    let bound = withUnsafePointer(to: &addr) {
        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, len) }
    }
    guard bound == 0 else { throw HarnessError("bind() failed: errno \(errno)") }
    let named = withUnsafeMutablePointer(to: &addr) {
        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &len) }
    }
    guard named == 0 else { throw HarnessError("getsockname() failed: errno \(errno)") }
    return UInt16(bigEndian: addr.sin_port)
}

/// A child process that is killed (SIGTERM, then SIGKILL) when stopped or deinitialised.
///
/// Its stdout and stderr go to files in a private temp dir (no pipes and no dispatch sources, so a chatty child
/// can never block on a full pipe and nothing watches an fd after it is closed).
public final class ChildProcess: @unchecked Sendable {
    public let process: Process
    public let name: String
    private let outputDirectory: TemporaryDirectory
    private let stdoutURL: URL
    private let stderrURL: URL
    private let stdoutHandle: FileHandle
    private let stderrHandle: FileHandle

    /// Starts `executable` with `arguments`; its stdout and stderr are captured.
    public init(
        name: String? = nil, executable: URL, arguments: [String], environment: [String: String]? = nil,
        currentDirectory: URL? = nil
    ) throws {
        self.name = name ?? executable.lastPathComponent
        outputDirectory = try TemporaryDirectory(prefix: "blebridge-child")
        stdoutURL = outputDirectory.url.appendingPathComponent("stdout")
        stderrURL = outputDirectory.url.appendingPathComponent("stderr")
        FileManager.default.createFile(atPath: stdoutURL.path, contents: nil)
        FileManager.default.createFile(atPath: stderrURL.path, contents: nil)
        stdoutHandle = try FileHandle(forWritingTo: stdoutURL)
        stderrHandle = try FileHandle(forWritingTo: stderrURL)
        process = Process()
        process.executableURL = executable
        process.arguments = arguments
        if let environment {
            process.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 }
        }
        if let currentDirectory { process.currentDirectoryURL = currentDirectory }
        process.standardOutput = stdoutHandle
        process.standardError = stderrHandle
        process.standardInput = FileHandle.nullDevice
        // The child inherits the calling thread's signal mask, and the test runner's threads block SIGTERM:
        // clear the mask around the spawn so the child can be stopped gracefully.
        var empty = sigset_t()
        var old = sigset_t()
        sigemptyset(&empty)
        pthread_sigmask(SIG_SETMASK, &empty, &old)
        defer { pthread_sigmask(SIG_SETMASK, &old, nil) }
        try process.run()
    }

    /// Everything the process wrote to stdout so far.
    public var stdout: String { (try? String(contentsOf: stdoutURL, encoding: .utf8)) ?? "" }
    /// Everything the process wrote to stderr so far.
    public var stderr: String { (try? String(contentsOf: stderrURL, encoding: .utf8)) ?? "" }

    public var pid: Int32 { process.processIdentifier }
    public var isRunning: Bool { process.isRunning }

    /// Waits until `condition(stdout)` holds, or throws after `timeout` seconds.
    @discardableResult
    public func waitForOutput(
        timeout: TimeInterval = 10, _ condition: (String) -> Bool
    ) throws -> String {
        let deadline = Date().addingTimeInterval(timeout)
        while Date() < deadline {
            let out = stdout
            if condition(out) { return out }
            if !process.isRunning {
                let out = stdout
                if condition(out) { return out }
                throw HarnessError("\(name) exited (status \(process.terminationStatus)); stderr: \(stderr)")
            }
            Thread.sleep(forTimeInterval: 0.01)
        }
        throw HarnessError("\(name): timed out after \(timeout)s; stdout: \(stdout); stderr: \(stderr)")
    }

    /// Waits for the process to exit by itself and returns its status.
    @discardableResult
    public func waitForExit(timeout: TimeInterval = 30) throws -> Int32 {
        let deadline = Date().addingTimeInterval(timeout)
        while process.isRunning {
            if Date() > deadline {
                stop()
                throw HarnessError("\(name) did not exit within \(timeout)s; stderr: \(stderr)")
            }
            Thread.sleep(forTimeInterval: 0.005)
        }
        process.waitUntilExit()
        return process.terminationStatus
    }

    /// Sends a signal to the process.
    public func signal(_ sig: Int32) {
        if process.isRunning { kill(process.processIdentifier, sig) }
    }

    /// Stops the process: SIGTERM, then SIGKILL after `grace` seconds.
    public func stop(grace: TimeInterval = 3) {
        guard process.isRunning else { return }
        kill(process.processIdentifier, SIGTERM)
        let deadline = Date().addingTimeInterval(grace)
        while process.isRunning && Date() < deadline { Thread.sleep(forTimeInterval: 0.005) }
        if process.isRunning { kill(process.processIdentifier, SIGKILL) }
        process.waitUntilExit()
    }

    deinit {
        stop(grace: 1)
        try? stdoutHandle.close()
        try? stderrHandle.close()
    }
}

/// Runs a command to completion and returns (status, stdout, stderr).
public func runCommand(
    _ executable: URL, _ arguments: [String], environment: [String: String]? = nil, timeout: TimeInterval = 60
) throws -> (status: Int32, stdout: String, stderr: String) {
    let child = try ChildProcess(executable: executable, arguments: arguments, environment: environment)
    let status = try child.waitForExit(timeout: timeout)
    return (status, child.stdout, child.stderr)
}

/// Finds a program on PATH (or in the usual sbin folders).
public func which(_ program: String) -> URL? {
    let path = ProcessInfo.processInfo.environment["PATH"] ?? "/usr/bin:/bin"
    let dirs = path.split(separator: ":").map { String($0) } + ["/usr/sbin", "/sbin", "/usr/local/sbin"]
    for dir in dirs {
        let candidate = URL(fileURLWithPath: dir).appendingPathComponent(program)
        if FileManager.default.isExecutableFile(atPath: candidate.path) { return candidate }
    }
    return nil
}

/// A private `dbus-daemon` with an allow-all policy and its socket in a temp dir.
public final class PrivateBus: @unchecked Sendable {
    public let directory: TemporaryDirectory
    public let daemon: ChildProcess
    /// The bus address, e.g. `unix:path=/tmp/.../bus`.
    public let address: String

    public init() throws {
        guard let dbusDaemon = which("dbus-daemon") else {
            throw HarnessError("dbus-daemon not found; run scripts/install-deps.sh")
        }
        directory = try TemporaryDirectory(prefix: "blebridge-bus")
        let socketPath = directory.url.appendingPathComponent("bus").path
        let config = """
            <!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
             "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
            <busconfig>
              <type>system</type>
              <listen>unix:path=\(socketPath)</listen>
              <auth>EXTERNAL</auth>
              <policy context="default">
                <allow user="*"/>
                <allow own="*"/>
                <allow send_type="method_call"/>
                <allow send_type="signal"/>
                <allow send_type="method_return"/>
                <allow send_type="error"/>
                <allow receive_type="method_call"/>
                <allow receive_type="signal"/>
                <allow receive_type="method_return"/>
                <allow receive_type="error"/>
                <allow send_destination="*" eavesdrop="true"/>
                <allow eavesdrop="true"/>
              </policy>
              <limit name="max_incoming_bytes">1000000000</limit>
              <limit name="max_outgoing_bytes">1000000000</limit>
              <limit name="max_message_size">134217728</limit>
              <limit name="max_replies_per_connection">50000</limit>
              <limit name="max_connections_per_user">10000</limit>
              <limit name="max_match_rules_per_connection">50000</limit>
            </busconfig>
            """
        let configURL = directory.url.appendingPathComponent("bus.conf")
        try config.write(to: configURL, atomically: true, encoding: .utf8)
        daemon = try ChildProcess(
            name: "dbus-daemon", executable: dbusDaemon,
            arguments: ["--config-file=\(configURL.path)", "--nofork", "--nopidfile", "--print-address=1"])
        let printed = try daemon.waitForOutput(timeout: 10) { $0.contains("\n") }
        address = printed.split(separator: "\n").first.map { String($0) } ?? "unix:path=\(socketPath)"
    }

    /// Environment that points libdbus, bleak and bluetoothctl at this bus.
    public var environment: [String: String] {
        ["DBUS_SYSTEM_BUS_ADDRESS": address, "DBUS_SESSION_BUS_ADDRESS": address]
    }

    deinit { daemon.stop() }
}

/// A `mosquitto` broker on a free loopback port with its own config.
public final class MosquittoBroker: @unchecked Sendable {
    public let directory: TemporaryDirectory
    public private(set) var process: ChildProcess
    public let port: UInt16
    public let configURL: URL

    /// Starts a broker. `extraConfig` lines are appended to the generated config (listeners, TLS, auth...).
    /// When `extraConfig` declares its own listener, pass `defaultListener: false`.
    public init(extraConfig: String = "", defaultListener: Bool = true, port: UInt16? = nil) throws {
        guard let mosquitto = which("mosquitto") else {
            throw HarnessError("mosquitto not found; run scripts/install-deps.sh")
        }
        directory = try TemporaryDirectory(prefix: "blebridge-mqtt")
        self.port = try port ?? freeLoopbackPort()
        var config = "persistence false\nlog_dest stderr\nlog_type error\nlog_type warning\n"
        if defaultListener {
            config += "listener \(self.port) 127.0.0.1\nallow_anonymous true\n"
        }
        config += extraConfig
        configURL = directory.url.appendingPathComponent("mosquitto.conf")
        try config.write(to: configURL, atomically: true, encoding: .utf8)
        process = try MosquittoBroker.launch(mosquitto, configURL)
        try MosquittoBroker.waitUntilListening(port: self.port, process: process)
    }

    private static func launch(_ executable: URL, _ config: URL) throws -> ChildProcess {
        try ChildProcess(name: "mosquitto", executable: executable, arguments: ["-c", config.path])
    }

    private static func waitUntilListening(port: UInt16, process: ChildProcess) throws {
        let deadline = Date().addingTimeInterval(10)
        while Date() < deadline {
            if !process.isRunning { throw HarnessError("mosquitto exited: \(process.stderr)") }
            if canConnect(port: port) { return }
            Thread.sleep(forTimeInterval: 0.02)
        }
        throw HarnessError("mosquitto did not listen on \(port): \(process.stderr)")
    }

    /// Stops the broker (by PID).
    public func stop() { process.stop() }

    /// Starts the broker again on the same port and config.
    public func restart() throws {
        process.stop()
        guard let mosquitto = which("mosquitto") else { throw HarnessError("mosquitto not found") }
        process = try MosquittoBroker.launch(mosquitto, configURL)
        try MosquittoBroker.waitUntilListening(port: port, process: process)
    }

    deinit { process.stop() }
}

/// True when something accepts TCP connections on 127.0.0.1:`port`.
public func canConnect(port: UInt16) -> Bool {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
    guard fd >= 0 else { return false }
    defer { close(fd) }
    var addr = sockaddr_in()
    addr.sin_family = sa_family_t(AF_INET)
    addr.sin_port = port.bigEndian
    addr.sin_addr.s_addr = inet_addr("127.0.0.1")
    let result = withUnsafePointer(to: &addr) {
        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
            connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size))
        }
    }
    return result == 0
}
