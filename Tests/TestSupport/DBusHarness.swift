// A private dbus-daemon and a command runner that avoid Foundation's `FileHandle.readabilityHandler`.
//
// TestSupport's ChildProcess (and so PrivateBus and runCommand) read child output through readabilityHandler.
// Tearing those handlers down concurrently on Linux corrupts libdispatch's epoll bookkeeping
// (swift-corelibs-libdispatch#949): the DBus suite, which starts ~40 buses in parallel, crashed about once in
// ten runs in `_dispatch_event_loop_drain`. Children here write to /dev/null or to files instead.
import Foundation

#if canImport(Glibc)
    import Glibc
#endif

/// A private dbus-daemon (allow-all policy, generous limits) on a socket in a temporary directory; killed with
/// SIGKILL at the end (it takes seconds to honour SIGTERM).
public final class PrivateDBusDaemon: @unchecked Sendable {
    /// The temporary directory holding the socket and the config.
    public let directory: TemporaryDirectory
    /// The daemon process.
    public let process: Process
    /// The bus address (`unix:path=...`).
    public let address: String

    /// Starts the daemon and waits until its socket accepts connections.
    public init() throws {
        guard let daemon = which("dbus-daemon") else { throw HarnessError("dbus-daemon not found") }
        directory = try TemporaryDirectory(prefix: "dbus-tests")
        let socket = directory.url.appendingPathComponent("bus").path
        let config = """
            <!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
             "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
            <busconfig>
              <type>system</type>
              <listen>unix:path=\(socket)</listen>
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
              <limit name="max_match_rules_per_connection">50000</limit>
            </busconfig>
            """
        let configURL = directory.url.appendingPathComponent("bus.conf")
        try config.write(to: configURL, atomically: true, encoding: .utf8)
        process = Process()
        process.executableURL = daemon
        process.arguments = ["--config-file=\(configURL.path)", "--nofork", "--nopidfile"]
        process.standardInput = FileHandle.nullDevice
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        try process.run()
        address = "unix:path=\(socket)"
        // Ready once the socket accepts connections.
        let deadline = Date().addingTimeInterval(10)
        while !PrivateDBusDaemon.accepts(socket) {
            guard process.isRunning, Date() < deadline else {
                killDaemon()
                throw HarnessError("dbus-daemon did not come up on \(socket)")
            }
            Thread.sleep(forTimeInterval: 0.005)
        }
    }

    private static func accepts(_ path: String) -> Bool {
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        guard bytes.count < MemoryLayout.size(ofValue: address.sun_path) else { return false }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            for (index, byte) in bytes.enumerated() { raw[index] = byte }
        }
        let result = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                Glibc.connect(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size))
            }
        }
        return result == 0
    }

    /// Environment that points libdbus, bleak and bluetoothctl at this bus.
    public var environment: [String: String] {
        ["DBUS_SYSTEM_BUS_ADDRESS": address, "DBUS_SESSION_BUS_ADDRESS": address]
    }

    /// Kills the daemon at once (the bus "going away"). Idempotent.
    public func killDaemon() {
        if process.isRunning { kill(process.processIdentifier, SIGKILL) }
        process.waitUntilExit()
    }

    deinit { killDaemon() }
}

/// Runs a tool to completion with its output in files (no pipes, no readabilityHandler), off the cooperative
/// pool; kills it after `timeout` seconds.
public func runTool(_ executable: URL, _ arguments: [String], timeout: TimeInterval = 20) async throws -> (
    status: Int32, stdout: String, stderr: String
) {
    try await Task.detached {
        let directory = try TemporaryDirectory(prefix: "dbus-tool")
        let outURL = directory.url.appendingPathComponent("out")
        let errURL = directory.url.appendingPathComponent("err")
        FileManager.default.createFile(atPath: outURL.path, contents: nil)
        FileManager.default.createFile(atPath: errURL.path, contents: nil)
        let out = try FileHandle(forWritingTo: outURL)
        let err = try FileHandle(forWritingTo: errURL)
        defer {
            try? out.close()
            try? err.close()
        }
        let process = Process()
        process.executableURL = executable
        process.arguments = arguments
        process.standardInput = FileHandle.nullDevice
        process.standardOutput = out
        process.standardError = err
        try process.run()
        let deadline = Date().addingTimeInterval(timeout)
        while process.isRunning {
            if Date() > deadline {
                kill(process.processIdentifier, SIGKILL)
                process.waitUntilExit()
                throw HarnessError("\(executable.lastPathComponent) did not finish within \(timeout) s")
            }
            try await Task.sleep(for: .milliseconds(5))
        }
        process.waitUntilExit()
        let stdout = (try? String(contentsOf: outURL, encoding: .utf8)) ?? ""
        let stderr = (try? String(contentsOf: errURL, encoding: .utf8)) ?? ""
        return (process.terminationStatus, stdout, stderr)
    }.value
}
