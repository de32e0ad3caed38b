// Test harness: starts the real parts (a private dbus-daemon, a mosquitto broker, our executables) and stops them
// by PID. Tests use full Foundation; the daemon's own targets do not.
import DBus
import Foundation
import Synchronization

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

/// Calls `body` with a `sockaddr` for 127.0.0.1:`port` (port 0: any) and its length; `body` may change it (for
/// `getsockname`). Returns what `body` returns and the port the address holds afterwards.
public func withLoopbackAddress<R>(
    port: UInt16, _ body: (UnsafeMutablePointer<sockaddr>, socklen_t) -> R
) -> (result: R, port: UInt16) {
    var address = sockaddr_in()
    address.sin_family = sa_family_t(AF_INET)
    address.sin_port = port.bigEndian
    address.sin_addr.s_addr = inet_addr("127.0.0.1")
    let result = withUnsafeMutablePointer(to: &address) {
        $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { body($0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
    }
    return (result, UInt16(bigEndian: address.sin_port))
}

/// Asks the kernel for a free TCP port on 127.0.0.1.
public func freeLoopbackPort() throws -> UInt16 {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
    guard fd >= 0 else { throw HarnessError("socket() failed: errno \(errno)") }
    defer { close(fd) }
    let bound = withLoopbackAddress(port: 0) { address, length in bind(fd, address, length) }.result
    guard bound == 0 else { throw HarnessError("bind() failed: errno \(errno)") }
    let named = withLoopbackAddress(port: 0) { address, length in
        var length = length
        return getsockname(fd, address, &length)
    }
    guard named.result == 0 else { throw HarnessError("getsockname() failed: errno \(errno)") }
    return named.port
}

/// True when something accepts TCP connections on 127.0.0.1:`port`.
public func canConnect(port: UInt16) -> Bool {
    let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
    guard fd >= 0 else { return false }
    defer { close(fd) }
    return withLoopbackAddress(port: port) { address, length in connect(fd, address, length) }.result == 0
}

/// Sets an environment variable of the test process without racing concurrent `getenv` calls.
///
/// glibc's `setenv` reallocates the `environ` array when it adds a variable, and a `getenv` running on another
/// thread at that moment (libdbus, Foundation, `Process`) reads freed memory: the test process crashed that way.
/// Here a new array is built and swapped in with one pointer store; the old array and strings are leaked on purpose
/// (glibc leaks replaced strings too), so a reader holding them stays valid.
public func setEnvironmentVariable(_ name: String, _ value: String) throws {
    // `environ` itself through its symbol: Swift imports the C global as read-only.
    typealias Environment = UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>
    guard let symbol = dlsym(nil, "environ") else { throw HarnessError("no `environ` symbol: \(name) not set") }
    let slot = symbol.assumingMemoryBound(to: Environment?.self)
    environmentLock.withLock { _ in
        var entries: [UnsafeMutablePointer<CChar>?] = []
        var index = 0
        while let current = slot.pointee, let entry = current[index] {
            if !String(cString: entry).hasPrefix(name + "=") { entries.append(entry) }
            index += 1
        }
        entries.append(strdup("\(name)=\(value)"))
        entries.append(nil)
        let array = Environment.allocate(capacity: entries.count)
        array.initialize(from: entries, count: entries.count)
        slot.pointee = array
    }
}

private let environmentLock = Mutex(())

// MARK: - Waiting

/// Calls `condition` every `interval` seconds until it returns true (then returns true) or `timeout` seconds pass
/// (then returns false). Sleeps the calling thread: from async code use `waitUntil(timeout:every:_:)`.
@discardableResult
public func waitUntilBlocking(
    timeout: TimeInterval, every interval: TimeInterval = 0.01, _ condition: () throws -> Bool
) rethrows -> Bool {
    let deadline = Date().addingTimeInterval(timeout)
    while true {
        if try condition() { return true }
        if Date() >= deadline { return false }
        Thread.sleep(forTimeInterval: interval)
    }
}

/// The async form of `waitUntilBlocking(timeout:every:_:)`: it suspends with `Task.sleep` between checks, so it never
/// holds one of the few cooperative threads that the other tests share.
@discardableResult
public func waitUntil(
    timeout: TimeInterval, every interval: TimeInterval = 0.01, _ condition: () async throws -> Bool
) async throws -> Bool {
    let deadline = Date().addingTimeInterval(timeout)
    while true {
        if try await condition() { return true }
        if Date() >= deadline { return false }
        try await Task.sleep(for: .milliseconds(Int(interval * 1000)))
    }
}

/// What a wait throws when it gives up.
public struct TimeoutError: Error, CustomStringConvertible {
    public let description: String
    public init(_ description: String) { self.description = description }
}

/// Runs `body`, failing with a `TimeoutError` naming `what` after `seconds` (`body` is then cancelled).
public func within<T: Sendable>(
    _ seconds: Double, _ what: String, _ body: @escaping @Sendable () async throws -> T
) async throws -> T {
    try await withThrowingTaskGroup(of: T?.self) { group in
        group.addTask { try await body() }
        group.addTask {
            try await Task.sleep(for: .seconds(seconds))
            return nil
        }
        defer { group.cancelAll() }
        guard let first = try await group.next(), let value = first else {
            throw TimeoutError("timed out after \(seconds) s: \(what)")
        }
        return value
    }
}

/// Waits until `condition` holds, checking every 10 ms; throws a `TimeoutError` naming `what` after `seconds`.
public func eventually(_ seconds: Double = 5, _ what: String, _ condition: () async throws -> Bool) async throws {
    guard try await waitUntil(timeout: seconds, condition) else {
        throw TimeoutError("timed out after \(seconds) s waiting for \(what)")
    }
}

/// Runs the blocking `body` on a fresh thread and returns its result, so that it does not stall the cooperative
/// pool (Swift Testing runs async tests on very few threads).
public func offPool<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
    try await withCheckedThrowingContinuation { continuation in
        Thread.detachNewThread { continuation.resume(with: Result { try body() }) }
    }
}

/// Runs the CPU-bound `body` on a fresh thread at the lowest scheduling priority (nice 19) and returns its result.
///
/// Swift Testing runs every test on a cooperative pool of as many threads as cores (two here): a long synchronous
/// loop there starves the other tests' continuations (a 300 ms D-Bus timeout was seen to take 39 s). On its own
/// low-priority thread the loop soaks up idle CPU only, and the pool stays free. Record issues after it returns
/// (`#expect` belongs to the test's task, not to this thread).
public func cpuBound<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
    try await withCheckedThrowingContinuation { continuation in
        Thread.detachNewThread {
            // On Linux the nice value belongs to the thread, and `who` 0 is the calling thread.
            _ = setpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0, 19)
            continuation.resume(with: Result { try body() })
        }
    }
}

// MARK: - Child processes

/// Starts `process` with an empty signal mask.
///
/// A child inherits the spawning thread's signal mask, and the test runner's threads block SIGTERM: without this,
/// children ignore SIGTERM and every graceful stop waits out its grace period. Every spawn in the harness goes
/// through here.
public func runWithClearedSignalMask(_ process: Process) throws {
    var empty = sigset_t()
    var old = sigset_t()
    sigemptyset(&empty)
    pthread_sigmask(SIG_SETMASK, &empty, &old)
    defer { pthread_sigmask(SIG_SETMASK, &old, nil) }
    try process.run()
}

/// Every child the harness started and has not seen exit. They are killed when the test process exits: fixtures are not
/// always deinitialised before the runner exits (and a background stop may not have run yet), and a daemon must
/// never outlive the run.
private enum LiveChildren {
    static let processes = Mutex<[ObjectIdentifier: Process]>([:])
    private static let killAtExit: Void = { atexit { LiveChildren.killAll() } }()

    static func add(_ process: Process) {
        _ = killAtExit
        processes.withLock { $0[ObjectIdentifier(process)] = process }
    }

    static func remove(_ process: Process) {
        _ = processes.withLock { $0.removeValue(forKey: ObjectIdentifier(process)) }
    }

    static func killAll() {
        processes.withLock { live in
            for process in live.values where process.isRunning { kill(process.processIdentifier, SIGKILL) }
        }
    }
}

/// A child process that is stopped (SIGTERM, then SIGKILL) when stopped or deinitialised.
///
/// Its stdout and stderr go to files in a private temp dir (no pipes, no `readabilityHandler` and no dispatch
/// sources: a chatty child can never block on a full pipe, and nothing watches an fd after it is closed; see
/// swift-corelibs-libdispatch#949). Every wait comes in a blocking form (for synchronous code and plain threads)
/// and an `async` form that suspends instead of sleeping the thread.
public final class ChildProcess: @unchecked Sendable {
    /// The underlying process.
    public let process: Process
    /// A name for messages (the executable's name unless given).
    public let name: String
    private let outputDirectory: TemporaryDirectory
    private let stdoutURL: URL
    private let stderrURL: URL

    /// Starts `executable` with `arguments`; its stdout and stderr are captured. `environment` is merged over the
    /// test runner's own.
    public init(
        name: String? = nil, executable: URL, arguments: [String], environment: [String: String]? = nil,
        currentDirectory: URL? = nil
    ) throws {
        self.name = name ?? executable.lastPathComponent
        outputDirectory = try TemporaryDirectory(prefix: "blebridge-child")
        stdoutURL = outputDirectory.url.appendingPathComponent("stdout")
        stderrURL = outputDirectory.url.appendingPathComponent("stderr")
        for url in [stdoutURL, stderrURL] {
            guard FileManager.default.createFile(atPath: url.path, contents: nil) else {
                throw HarnessError("\(self.name): cannot create \(url.path)")
            }
        }
        // The child gets its own copies of these descriptors: ours are closed once it runs.
        let stdoutHandle = try FileHandle(forWritingTo: stdoutURL)
        let stderrHandle = try FileHandle(forWritingTo: stderrURL)
        defer {
            try? stdoutHandle.close()
            try? stderrHandle.close()
        }
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
        try runWithClearedSignalMask(process)
        LiveChildren.add(process)
    }

    /// Everything the process wrote to stdout so far.
    public var stdout: String { Self.read(stdoutURL) }
    /// Everything the process wrote to stderr so far.
    public var stderr: String { Self.read(stderrURL) }

    private static func read(_ url: URL) -> String {
        // Lenient decoding: a multi-byte character cut in half at the end must not hide the rest.
        (try? Data(contentsOf: url)).map { String(decoding: $0, as: UTF8.self) } ?? ""
    }

    /// The process id.
    public var pid: Int32 { process.processIdentifier }
    /// Whether the process still runs.
    public var isRunning: Bool { process.isRunning }

    /// Waits until `condition(stdout)` holds and returns that output; throws if the process exits first or after
    /// `timeout` seconds. Sleeps the calling thread.
    @discardableResult
    public func waitForOutput(timeout: TimeInterval = 10, _ condition: (String) -> Bool) throws -> String {
        var output: String?
        try waitUntilBlocking(timeout: timeout) {
            output = try outputCheck(condition)
            return output != nil
        }
        guard let output else { throw outputTimeout(timeout) }
        return output
    }

    /// The async form of `waitForOutput(timeout:_:)`.
    @discardableResult
    public func waitForOutput(timeout: TimeInterval = 10, _ condition: (String) -> Bool) async throws -> String {
        var output: String?
        try await waitUntil(timeout: timeout) {
            output = try outputCheck(condition)
            return output != nil
        }
        guard let output else { throw outputTimeout(timeout) }
        return output
    }

    private func outputCheck(_ condition: (String) -> Bool) throws -> String? {
        let running = process.isRunning
        let out = stdout
        if condition(out) { return out }
        guard running else {
            throw HarnessError("\(name) exited (status \(process.terminationStatus)); stderr: \(stderr)")
        }
        return nil
    }

    private func outputTimeout(_ timeout: TimeInterval) -> HarnessError {
        HarnessError("\(name): timed out after \(timeout)s; stdout: \(stdout); stderr: \(stderr)")
    }

    /// Waits for the process to exit by itself and returns its status; after `timeout` seconds stops it and
    /// throws. Sleeps the calling thread.
    @discardableResult
    public func waitForExit(timeout: TimeInterval = 30) throws -> Int32 {
        guard waitUntilBlocking(timeout: timeout, every: 0.005, { !process.isRunning }) else {
            stop()
            throw HarnessError("\(name) did not exit within \(timeout)s; stderr: \(stderr)")
        }
        return exitStatus()
    }

    /// The async form of `waitForExit(timeout:)`.
    @discardableResult
    public func waitForExit(timeout: TimeInterval = 30) async throws -> Int32 {
        guard try await waitUntil(timeout: timeout, every: 0.005, { !process.isRunning }) else {
            await stop()
            throw HarnessError("\(name) did not exit within \(timeout)s; stderr: \(stderr)")
        }
        return exitStatus()
    }

    private func exitStatus() -> Int32 {
        process.waitUntilExit()  // returns at once: the process is known to have exited
        LiveChildren.remove(process)
        return process.terminationStatus
    }

    /// Sends a signal to the process.
    public func signal(_ sig: Int32) {
        if process.isRunning { Glibc.kill(process.processIdentifier, sig) }
    }

    /// Stops the process: SIGTERM, then SIGKILL after `grace` seconds. Safe to call twice. Sleeps the calling
    /// thread.
    public func stop(grace: TimeInterval = 3) {
        Self.terminate(process, grace: grace)
    }

    /// The async form of `stop(grace:)`.
    public func stop(grace: TimeInterval = 3) async {
        guard process.isRunning else { return LiveChildren.remove(process) }
        Glibc.kill(process.processIdentifier, SIGTERM)
        let process = self.process
        if (try? await waitUntil(timeout: grace, every: 0.005, { !process.isRunning })) != true {
            Self.kill(process)
        }
        LiveChildren.remove(process)
    }

    /// Sends SIGTERM now and finishes `stop()` (SIGKILL after the grace period, reaping) on a background thread.
    public func stopInBackground() {
        signal(SIGTERM)
        Thread.detachNewThread { [self] in stop() }
    }

    /// Kills the process at once (SIGKILL) and reaps it. Safe to call twice.
    public func kill() { Self.kill(process) }

    private static func terminate(_ process: Process, grace: TimeInterval) {
        guard process.isRunning else { return LiveChildren.remove(process) }
        Glibc.kill(process.processIdentifier, SIGTERM)
        if !waitUntilBlocking(timeout: grace, every: 0.005, { !process.isRunning }) { kill(process) }
        LiveChildren.remove(process)
    }

    private static func kill(_ process: Process) {
        if process.isRunning { Glibc.kill(process.processIdentifier, SIGKILL) }
        // SIGKILL cannot be ignored: this ends within milliseconds.
        while process.isRunning { usleep(1000) }
        LiveChildren.remove(process)
    }

    /// Never blocks: a child still running gets SIGTERM now and is reaped on a background thread.
    deinit {
        guard process.isRunning else { return LiveChildren.remove(process) }
        Glibc.kill(process.processIdentifier, SIGTERM)
        let leftovers = Leftovers(process: process, directory: outputDirectory)
        Thread.detachNewThread { ChildProcess.terminate(leftovers.process, grace: 1) }
    }

    /// What a deinitialised `ChildProcess` hands to the thread that reaps it (the directory lives until then).
    private struct Leftovers: @unchecked Sendable {
        let process: Process
        let directory: TemporaryDirectory
    }
}

/// Runs a command to completion and returns (status, stdout, stderr); stops it and throws after `timeout`
/// seconds. Sleeps the calling thread.
public func runCommand(
    _ executable: URL, _ arguments: [String], environment: [String: String]? = nil, timeout: TimeInterval = 60
) throws -> (status: Int32, stdout: String, stderr: String) {
    let child = try ChildProcess(executable: executable, arguments: arguments, environment: environment)
    let status = try child.waitForExit(timeout: timeout)
    return (status, child.stdout, child.stderr)
}

/// The async form of `runCommand(_:_:environment:timeout:)`.
public func runCommand(
    _ executable: URL, _ arguments: [String], environment: [String: String]? = nil, timeout: TimeInterval = 60
) async throws -> (status: Int32, stdout: String, stderr: String) {
    let child = try ChildProcess(executable: executable, arguments: arguments, environment: environment)
    let status = try await child.waitForExit(timeout: timeout)
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

// MARK: - Private bus

/// A private `dbus-daemon` with an allow-all policy, generous limits and its socket in a temp dir.
///
/// `PrivateBus()` blocks until the daemon is up; from async tests use `PrivateBus.start()`.
public final class PrivateBus: @unchecked Sendable {
    /// The temporary directory holding the socket and the config.
    public let directory: TemporaryDirectory
    /// The daemon process.
    public let daemon: ChildProcess
    /// The bus address, e.g. `unix:path=/tmp/.../bus`.
    public let address: String

    private init(directory: TemporaryDirectory, daemon: ChildProcess, printed: String) {
        self.directory = directory
        self.daemon = daemon
        address = printed.split(separator: "\n").first.map { String($0) } ?? "unix:path=\(directory.url.path)/bus"
    }

    /// Starts a daemon and returns once it has printed its address (it listens by then). Sleeps the thread.
    public convenience init() throws {
        let (directory, daemon) = try Self.launch()
        let printed = try daemon.waitForOutput(timeout: 10) { $0.contains("\n") }
        self.init(directory: directory, daemon: daemon, printed: printed)
    }

    /// The async form of `init()`.
    public static func start() async throws -> PrivateBus {
        let (directory, daemon) = try launch()
        let printed = try await daemon.waitForOutput(timeout: 10) { $0.contains("\n") }
        return PrivateBus(directory: directory, daemon: daemon, printed: printed)
    }

    private static func launch() throws -> (TemporaryDirectory, ChildProcess) {
        guard let dbusDaemon = which("dbus-daemon") else {
            throw HarnessError("dbus-daemon not found; run scripts/install-deps.sh")
        }
        let directory = try TemporaryDirectory(prefix: "blebridge-bus")
        let socketPath = directory.url.appendingPathComponent("bus").path
        let config = DBusPrivateBusConfiguration.allowAll(socketPath: socketPath)
        let configURL = directory.url.appendingPathComponent("bus.conf")
        try config.write(to: configURL, atomically: true, encoding: .utf8)
        let daemon = try ChildProcess(
            name: "dbus-daemon", executable: dbusDaemon,
            arguments: ["--config-file=\(configURL.path)", "--nofork", "--nopidfile", "--print-address=1"])
        return (directory, daemon)
    }

    /// Environment that points libdbus, bleak and bluetoothctl at this bus.
    public var environment: [String: String] {
        ["DBUS_SYSTEM_BUS_ADDRESS": address, "DBUS_SESSION_BUS_ADDRESS": address]
    }

    /// Stops the daemon (SIGTERM). Sleeps the thread until it has exited.
    public func stop() { daemon.stop() }

    /// The async form of `stop()`.
    public func stop() async { await daemon.stop() }

    /// Kills the daemon at once (SIGKILL: the bus "going away" under its clients). Safe to call twice.
    public func killDaemon() { daemon.kill() }
}

// MARK: - MQTT broker

/// A `mosquitto` broker on a free loopback port with its own config.
///
/// `MosquittoBroker(...)` blocks until the broker listens; from async tests use `MosquittoBroker.start(...)`.
public final class MosquittoBroker: @unchecked Sendable {
    /// The temporary directory holding the config.
    public let directory: TemporaryDirectory
    /// The running broker (replaced by `restart()`).
    public private(set) var process: ChildProcess
    /// The port of the default listener (or the one passed in).
    public let port: UInt16
    /// The generated config file.
    public let configURL: URL

    private init(directory: TemporaryDirectory, process: ChildProcess, port: UInt16, configURL: URL) {
        self.directory = directory
        self.process = process
        self.port = port
        self.configURL = configURL
    }

    /// Starts a broker. `extraConfig` lines are appended to the generated config (listeners, TLS, auth...).
    /// When `extraConfig` declares its own listener, pass `defaultListener: false`. Sleeps the thread.
    public convenience init(extraConfig: String = "", defaultListener: Bool = true, port: UInt16? = nil) throws {
        let (directory, port, configURL) = try Self.configure(extraConfig, defaultListener, port)
        let process = try Self.launch(configURL)
        try Self.waitUntilListening(port: port, process: process)
        self.init(directory: directory, process: process, port: port, configURL: configURL)
    }

    /// The async form of `init(extraConfig:defaultListener:port:)`.
    public static func start(
        extraConfig: String = "", defaultListener: Bool = true, port: UInt16? = nil
    ) async throws -> MosquittoBroker {
        let (directory, port, configURL) = try configure(extraConfig, defaultListener, port)
        let process = try launch(configURL)
        try await waitUntilListening(port: port, process: process)
        return MosquittoBroker(directory: directory, process: process, port: port, configURL: configURL)
    }

    private static func configure(
        _ extraConfig: String, _ defaultListener: Bool, _ port: UInt16?
    ) throws -> (TemporaryDirectory, UInt16, URL) {
        let directory = try TemporaryDirectory(prefix: "blebridge-mqtt")
        let port = try port ?? freeLoopbackPort()
        var config = "persistence false\nlog_dest stderr\nlog_type error\nlog_type warning\n"
        if defaultListener {
            config += "listener \(port) 127.0.0.1\nallow_anonymous true\n"
        }
        config += extraConfig
        let configURL = directory.url.appendingPathComponent("mosquitto.conf")
        try config.write(to: configURL, atomically: true, encoding: .utf8)
        return (directory, port, configURL)
    }

    private static func launch(_ config: URL) throws -> ChildProcess {
        guard let mosquitto = which("mosquitto") else {
            throw HarnessError("mosquitto not found; run scripts/install-deps.sh")
        }
        return try ChildProcess(name: "mosquitto", executable: mosquitto, arguments: ["-c", config.path])
    }

    private static func listening(port: UInt16, process: ChildProcess) throws -> Bool {
        if canConnect(port: port) { return true }
        if !process.isRunning { throw HarnessError("mosquitto exited: \(process.stderr)") }
        return false
    }

    private static func waitUntilListening(port: UInt16, process: ChildProcess) throws {
        guard try waitUntilBlocking(timeout: 10, every: 0.02, { try listening(port: port, process: process) }) else {
            throw HarnessError("mosquitto did not listen on \(port): \(process.stderr)")
        }
    }

    private static func waitUntilListening(port: UInt16, process: ChildProcess) async throws {
        guard try await waitUntil(timeout: 10, every: 0.02, { try listening(port: port, process: process) }) else {
            throw HarnessError("mosquitto did not listen on \(port): \(process.stderr)")
        }
    }

    /// Stops the broker (by PID). Sleeps the thread until it has exited.
    public func stop() { process.stop() }

    /// The async form of `stop()`.
    public func stop() async { await process.stop() }

    /// Starts the broker again on the same port and config. Sleeps the thread.
    public func restart() throws {
        process.stop()
        process = try Self.launch(configURL)
        try Self.waitUntilListening(port: port, process: process)
    }

    /// The async form of `restart()`.
    public func restart() async throws {
        await process.stop()
        process = try Self.launch(configURL)
        try await Self.waitUntilListening(port: port, process: process)
    }
}

/// The name of the calling thread (`/proc/thread-self/comm`), for tests that check where a callback ran.
public func currentThreadName() -> String {
    (try? String(contentsOfFile: "/proc/thread-self/comm", encoding: .utf8))?
        .trimmingCharacters(in: .whitespacesAndNewlines) ?? "?"
}
