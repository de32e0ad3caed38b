// Process-level helpers for the bluez-sim executable: reading the scenario file and spawning a private dbus-daemon
// with posix_spawn (no Foundation).
import DBus
import Dispatch
import Signals

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// Reads a whole file as UTF-8.
/// - Throws: `SimulatorError` naming the file and the errno text.
public func readTextFile(_ path: String) throws(SimulatorError) -> String {
    let fd = open(path, O_RDONLY | O_CLOEXEC)
    guard fd >= 0 else { throw SimulatorError("cannot open \(path): \(String(cString: strerror(errno)))") }
    defer { close(fd) }
    var bytes: [UInt8] = []
    var buffer = [UInt8](repeating: 0, count: 65536)
    while true {
        let n = buffer.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
        if n < 0 {
            if errno == EINTR { continue }
            throw SimulatorError("cannot read \(path): \(String(cString: strerror(errno)))")
        }
        if n == 0 { break }
        bytes += buffer[0..<n]
        if bytes.count > 16 << 20 { throw SimulatorError("\(path) is larger than 16 MiB") }
    }
    return String(decoding: bytes, as: UTF8.self)
}

/// Writes a line to stdout at once (no buffering).
public func writeLine(_ text: String) {
    let line = text + "\n"
    var rest = Array(line.utf8)[...]
    while !rest.isEmpty {
        let n = rest.withUnsafeBytes { write(1, $0.baseAddress, $0.count) }
        if n <= 0 { if errno == EINTR { continue } else { return } }
        rest = rest.dropFirst(n)
    }
}

/// Writes a line to stderr.
public func writeErrorLine(_ text: String) { printError(text) }

/// A private `dbus-daemon` (allow-all policy, socket in a fresh temp dir) that lives as long as this value.
public final class SpawnedBus: @unchecked Sendable {
    /// The bus address (`unix:path=...`).
    public let address: String
    /// The daemon's PID.
    public let pid: pid_t
    private let directory: String
    private var stopped = false

    /// Starts the daemon and reads the address it prints.
    /// - Throws: `SimulatorError` when dbus-daemon is missing or does not come up.
    public init() throws(SimulatorError) {
        var template = Array("/tmp/bluez-sim-XXXXXX".utf8CString)
        guard let dir = template.withUnsafeMutableBufferPointer({ mkdtemp($0.baseAddress!) }) else {
            throw SimulatorError("mkdtemp failed: \(String(cString: strerror(errno)))")
        }
        let directoryPath = String(cString: dir)
        directory = directoryPath
        // Until the daemon is up, a failure removes what was created (stop() cleans up after that).
        var started = false
        defer { if !started { Self.removeFiles(in: directoryPath) } }
        let socket = directory + "/bus"
        let config = DBusPrivateBusConfiguration.allowAll(socketPath: socket)
        let configPath = directory + "/bus.conf"
        let cfd = open(configPath, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
        guard cfd >= 0 else { throw SimulatorError("cannot write \(configPath)") }
        _ = Array(config.utf8).withUnsafeBytes { write(cfd, $0.baseAddress, $0.count) }
        close(cfd)

        let candidates: [String] = ["/usr/bin/dbus-daemon", "/bin/dbus-daemon", "/usr/local/bin/dbus-daemon"]
        let daemonPath = candidates.first { path in access(path, X_OK) == 0 }
        guard let daemonPath else { throw SimulatorError("dbus-daemon not found (install the dbus-daemon package)") }
        var pipeFDs: [Int32] = [-1, -1]
        // Close-on-exec: a child spawned by another thread must not hold the write end, or the read below would
        // wait for it instead of seeing EOF when dbus-daemon dies. posix_spawn's dup2 onto stdout clears the flag.
        // (A socket pair: Glibc's module map does not export pipe2.)
        let type = Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue)
        guard socketpair(AF_UNIX, type, 0, &pipeFDs) == 0 else {
            throw SimulatorError("cannot create a pipe for dbus-daemon's address: \(String(cString: strerror(errno)))")
        }
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_adddup2(&actions, pipeFDs[1], 1)
        posix_spawn_file_actions_addclose(&actions, pipeFDs[0])
        let args = [daemonPath, "--config-file=\(configPath)", "--nofork", "--nopidfile", "--print-address=1"]
        var cArgs: [UnsafeMutablePointer<CChar>?] = args.map { strdup($0) } + [nil]
        defer { for p in cArgs { free(p) } }
        // The daemon starts with default signal dispositions and nothing blocked, whatever this process ignores or
        // blocks (bluez-sim ignores SIGTERM/SIGINT to receive them through dispatch sources): so SIGTERM stops it.
        var attributes = posix_spawnattr_t()
        posix_spawnattr_init(&attributes)
        defer { posix_spawnattr_destroy(&attributes) }
        var noSignals = sigset_t()
        sigemptyset(&noSignals)
        var defaulted = sigset_t()
        sigemptyset(&defaulted)
        for sig in [SIGTERM, SIGINT, SIGHUP, SIGPIPE] { sigaddset(&defaulted, sig) }
        posix_spawnattr_setsigmask(&attributes, &noSignals)
        posix_spawnattr_setsigdefault(&attributes, &defaulted)
        posix_spawnattr_setflags(&attributes, Int16(POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF))
        var child: pid_t = 0
        let rc = posix_spawn(&child, daemonPath, &actions, &attributes, &cArgs, environ)
        close(pipeFDs[1])
        guard rc == 0 else {
            close(pipeFDs[0])
            throw SimulatorError("cannot start dbus-daemon: \(String(cString: strerror(rc)))")
        }
        pid = child
        var line: [UInt8] = []
        var byte: UInt8 = 0
        while read(pipeFDs[0], &byte, 1) == 1, byte != 10 { line.append(byte) }
        close(pipeFDs[0])  // dbus-daemon does not write to stdout again
        guard !line.isEmpty else {
            var status: Int32 = 0
            waitpid(child, &status, 0)
            throw SimulatorError("dbus-daemon exited before printing its address")
        }
        address = String(decoding: line, as: UTF8.self)
        started = true
    }

    private static func removeFiles(in directory: String) {
        unlink(directory + "/bus")
        unlink(directory + "/bus.conf")
        rmdir(directory)
    }

    /// Stops the daemon (SIGTERM, then SIGKILL after 2 s) and removes its directory. Idempotent.
    public func stop() {
        guard !stopped else { return }
        stopped = true
        kill(pid, SIGTERM)
        var status: Int32 = 0
        var reaped = false
        for _ in 0..<200 {
            if waitpid(pid, &status, WNOHANG) == pid {
                reaped = true
                break
            }
            usleep(10_000)
        }
        if !reaped {
            kill(pid, SIGKILL)
            waitpid(pid, &status, 0)
        }
        Self.removeFiles(in: directory)
    }

    deinit { stop() }
}

/// Runs `body` (on the signal thread) when SIGTERM or SIGINT arrives. Keep the returned tokens for as long as the
/// handler should stay installed.
public func onTerminationSignals(_ body: @escaping @Sendable () -> Void) -> [ProcessSignals.Token] {
    signal(SIGPIPE, SIG_IGN)
    return [SIGTERM, SIGINT].map { sig in ProcessSignals.on(sig) { _ in body() } }
}
