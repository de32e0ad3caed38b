// The sd_notify protocol, spoken directly: one datagram per message to $NOTIFY_SOCKET (see sd_notify(3); no
// libsystemd needed). READY=1, STATUS=..., WATCHDOG=1, RELOADING=1, STOPPING=1.
import BridgeCore

#if canImport(Glibc)
    import Glibc
#endif

/// Sends state changes to the service manager. Does nothing when the process was not started by one.
struct SystemdNotifier: Sendable {
    let path: String?
    /// Half of `WATCHDOG_USEC` (when the watchdog is on for this process).
    let watchdogInterval: Duration?

    init(environment: [String: String] = currentEnvironment()) {
        let socket = environment["NOTIFY_SOCKET"].flatMap { $0.isEmpty ? nil : $0 }
        path = socket
        var interval: Duration?
        if let text = environment["WATCHDOG_USEC"], let usec = Int64(text), usec > 0 {
            // WATCHDOG_PID, when set, must be us.
            if let pid = environment["WATCHDOG_PID"].flatMap({ Int32($0) }), pid != getpid() {
                interval = nil
            } else {
                interval = .microseconds(usec / 2)
            }
        }
        watchdogInterval = interval
    }

    var isActive: Bool { path != nil }

    /// Sends `text` (lines `KEY=value`). Errors are ignored: the service manager may have gone.
    func send(_ text: String) {
        guard let path else { return }
        let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { return }
        defer { close(fd) }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        var bytes = Array(path.utf8)
        // An abstract socket is written with a leading '@' and has a NUL in its first byte.
        if bytes.first == UInt8(ascii: "@") { bytes[0] = 0 }
        let capacity = MemoryLayout.size(ofValue: address.sun_path)
        guard bytes.count < capacity else { return }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            for (i, b) in bytes.enumerated() { raw[i] = b }
        }
        let length = socklen_t(MemoryLayout<sa_family_t>.size + bytes.count)
        let payload = Array(text.utf8)
        _ = withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { sa in
                payload.withUnsafeBytes { sendto(fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL), sa, length) }
            }
        }
    }
}

/// The process environment as a dictionary.
func currentEnvironment() -> [String: String] {
    var out: [String: String] = [:]
    var p = environ
    while let entry = p.pointee {
        let text = String(cString: entry)
        if let eq = text.firstIndex(of: "=") {
            out[String(text[..<eq])] = String(text[text.index(after: eq)...])
        }
        p += 1
    }
    return out
}
