// The `host:port` forms a metrics endpoint accepts, parsed once into a value the server binds to.
#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// Where a metrics server listens: one IPv4 address, one IPv6 address, or every address, and a port.
struct MetricsListenAddress: Sendable, Equatable {
    enum Host: Sendable, Equatable {
        /// An IPv4 address, in network byte order as `in_addr.s_addr` holds it.
        case ipv4(UInt32)
        /// An IPv6 address, its 16 bytes in network order.
        case ipv6([UInt8])
        /// Every local address (IPv6 and IPv4 where the machine has IPv6, IPv4 only otherwise).
        case any
    }

    var host: Host
    /// 0 lets the kernel pick a free port.
    var port: UInt16

    /// Parses `127.0.0.1:9464`, `[::1]:9464` or `:9464`; host names are refused so the bind is exactly what the
    /// operator wrote, with no resolver involved.
    init(parsing value: String) throws(MetricsHTTPError) {
        func invalid(_ reason: String) -> MetricsHTTPError { .invalidListenAddress(value, reason: reason) }
        let hostPart: Substring
        let portPart: Substring
        if value.hasPrefix("[") {
            guard let close = value.firstIndex(of: "]") else {
                throw invalid("an IPv6 address must be closed with ']', as in [::1]:9464")
            }
            hostPart = value[value.index(after: value.startIndex)..<close]
            let rest = value[value.index(after: close)...]
            guard rest.first == ":" else { throw invalid("expected ':<port>' after the bracketed IPv6 address") }
            portPart = rest.dropFirst()
        } else {
            guard let colon = value.lastIndex(of: ":") else {
                throw invalid("expected <host>:<port>, [<IPv6>]:<port> or :<port>, as in 127.0.0.1:9464")
            }
            hostPart = value[..<colon]
            portPart = value[value.index(after: colon)...]
            if hostPart.contains(":") {
                throw invalid("an IPv6 address must be written in brackets, as in [::1]:9464")
            }
        }

        guard !portPart.isEmpty, portPart.count <= 5, portPart.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }),
            let number = Int(portPart), number <= 65535
        else {
            throw invalid("the port '\(portPart)' is not a number from 0 to 65535")
        }
        port = UInt16(number)

        if value.hasPrefix("[") {
            var address = in6_addr()
            let ok = String(hostPart).withCString { inet_pton(AF_INET6, $0, &address) } == 1
            guard ok else { throw invalid("'\(hostPart)' is not an IPv6 address") }
            host = .ipv6(withUnsafeBytes(of: &address) { Array($0) })
        } else if hostPart.isEmpty {
            host = .any
        } else {
            var address = in_addr()
            let ok = String(hostPart).withCString { inet_pton(AF_INET, $0, &address) } == 1
            guard ok else {
                throw invalid(
                    "'\(hostPart)' is not an IPv4 address (host names are not resolved; use 127.0.0.1, [::1] or "
                        + "leave the host empty for all addresses)")
            }
            host = .ipv4(address.s_addr)
        }
    }

    /// Calls `body` with a `sockaddr` for this address and whether it is IPv6. `dualStack` picks `[::]` for `.any`
    /// (when false, `.any` becomes `0.0.0.0`).
    func withSocketAddress<R>(dualStack: Bool, _ body: (UnsafePointer<sockaddr>, _ isIPv6: Bool) -> R) -> R {
        switch host {
        case .ipv4(let raw):
            return ipv4(raw, body)
        case .any where !dualStack:
            return ipv4(0, body)
        case .ipv6(let bytes):
            return ipv6(bytes, body)
        case .any:
            return ipv6(Array(repeating: 0, count: 16), body)
        }
    }

    private func ipv4<R>(_ raw: UInt32, _ body: (UnsafePointer<sockaddr>, Bool) -> R) -> R {
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = port.bigEndian
        address.sin_addr.s_addr = raw
        return withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { body($0, false) }
        }
    }

    private func ipv6<R>(_ bytes: [UInt8], _ body: (UnsafePointer<sockaddr>, Bool) -> R) -> R {
        var address = sockaddr_in6()
        address.sin6_family = sa_family_t(AF_INET6)
        address.sin6_port = port.bigEndian
        withUnsafeMutableBytes(of: &address.sin6_addr) { target in
            for (index, byte) in bytes.prefix(target.count).enumerated() { target[index] = byte }
        }
        return withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { body($0, true) }
        }
    }
}
