import Logging
import Synchronization
import Testing

@testable import MetricsHTTP

#if canImport(Glibc)
    import Glibc
#endif

/// A response as read off the socket.
struct RawResponse {
    var status: Int
    var headers: [String: String]
    var body: [UInt8]
    var bodyText: String { String(decoding: body, as: UTF8.self) }
}

enum RawClientError: Error, CustomStringConvertible {
    case system(String, Int32)
    case noResponse([UInt8])
    var description: String {
        switch self {
        case .system(let call, let code): return "\(call): \(String(cString: strerror(code)))"
        case .noResponse(let bytes):
            return "no HTTP response in \(bytes.count) bytes: \(String(decoding: bytes, as: UTF8.self))"
        }
    }
}

/// Opens a TCP connection to `host`:`port` (IPv4 or IPv6 literal) with a 5 s receive timeout.
func connectTo(_ host: String, _ port: Int) throws -> Int32 {
    let isIPv6 = host.contains(":")
    let fd = socket(isIPv6 ? AF_INET6 : AF_INET, Int32(SOCK_STREAM.rawValue), 0)
    guard fd >= 0 else { throw RawClientError.system("socket", errno) }
    var timeout = timeval(tv_sec: 5, tv_usec: 0)
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
    var rc: Int32
    if isIPv6 {
        var address = sockaddr_in6()
        address.sin6_family = sa_family_t(AF_INET6)
        address.sin6_port = UInt16(port).bigEndian
        _ = inet_pton(AF_INET6, host, &address.sin6_addr)
        rc = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in6>.size))
            }
        }
    } else {
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = UInt16(port).bigEndian
        _ = inet_pton(AF_INET, host, &address.sin_addr)
        rc = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) {
                connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size))
            }
        }
    }
    guard rc == 0 else {
        let code = errno
        close(fd)
        throw RawClientError.system("connect", code)
    }
    return fd
}

/// Sends `request` as is, closes the sending side, and reads until the server closes the connection (or 5 s pass
/// without data).
func exchange(_ request: [UInt8], host: String = "127.0.0.1", port: Int) throws -> [UInt8] {
    let fd = try connectTo(host, port)
    defer { close(fd) }
    var sent = 0
    while sent < request.count {
        let n = request[sent...].withUnsafeBytes { send(fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
        // The server may close early on a request it refuses; what it answered is still readable.
        if n <= 0 { break }
        sent += n
    }
    // Nothing more is coming: a server still waiting for the rest of a request sees the end instead of a stall.
    shutdown(fd, Int32(SHUT_WR))
    var received: [UInt8] = []
    var buffer = [UInt8](repeating: 0, count: 4096)
    while true {
        let n = buffer.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, 0) }
        if n <= 0 { break }
        received += buffer[0..<n]
    }
    return received
}

/// Parses an HTTP/1.x response.
func parse(_ bytes: [UInt8]) throws -> RawResponse {
    let separator: [UInt8] = Array("\r\n\r\n".utf8)
    guard let end = (0..<max(0, bytes.count - 3)).first(where: { Array(bytes[$0..<$0 + 4]) == separator }) else {
        throw RawClientError.noResponse(bytes)
    }
    let head = String(decoding: bytes[..<end], as: UTF8.self).components(separatedBy: "\r\n")
    let statusParts = head[0].split(separator: " ")
    guard statusParts.count >= 2, let status = Int(statusParts[1]) else { throw RawClientError.noResponse(bytes) }
    var headers: [String: String] = [:]
    for line in head.dropFirst() {
        guard let colon = line.firstIndex(of: ":") else { continue }
        headers[line[..<colon].lowercased()] = String(line[line.index(after: colon)...]).trimmingCharacters(in: " ")
    }
    return RawResponse(status: status, headers: headers, body: Array(bytes[(end + 4)...]))
}

func get(_ path: String, method: String = "GET", host: String = "127.0.0.1", port: Int) throws -> RawResponse {
    try parse(exchange(Array("\(method) \(path) HTTP/1.0\r\n\r\n".utf8), host: host, port: port))
}

extension String {
    fileprivate func trimmingCharacters(in set: Character) -> String {
        String(drop { $0 == set }.reversed().drop { $0 == set }.reversed())
    }
    fileprivate func components(separatedBy separator: String) -> [String] {
        var parts: [String] = []
        var rest = Substring(self)
        while let range = rest.firstRange(of: separator) {
            parts.append(String(rest[..<range.lowerBound]))
            rest = rest[range.upperBound...]
        }
        parts.append(String(rest))
        return parts
    }
}

let metricsBody = Array("# HELP up Up.\n# TYPE up gauge\nup 1\n".utf8)

/// Counts handler calls and answers /metrics with `metricsBody`, anything else with 404.
final class SampleHandler: Sendable {
    let calls = Mutex<[String]>([])
    var handler: MetricsHTTPHandler {
        { path in
            self.calls.withLock { $0.append(path) }
            if path == "/metrics" { return (200, PrometheusText.contentType, metricsBody) }
            return (404, "text/plain; charset=utf-8", Array("not found\n".utf8))
        }
    }
}

func startedServer(_ listen: String = "127.0.0.1:0", _ sample: SampleHandler = SampleHandler()) throws
    -> (MetricsHTTPServer, Int)
{
    let server = try MetricsHTTPServer(listen: listen, logger: nil)
    try server.start(handler: sample.handler)
    let port = try #require(server.port)
    #expect(port > 0)
    return (server, port)
}

/// A real server on a loopback port, talked to over raw sockets.
@Suite struct MetricsHTTPServerTests {
    @Test func servesMetricsAnd404() throws {
        let sample = SampleHandler()
        let (server, port) = try startedServer("127.0.0.1:0", sample)
        let metrics = try get("/metrics", port: port)
        #expect(metrics.status == 200)
        #expect(metrics.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8")
        #expect(metrics.body == metricsBody)
        #expect(try get("/metrics?x=1", port: port).status == 200)
        let missing = try get("/other", port: port)
        #expect(missing.status == 404 && missing.bodyText == "not found\n")
        let head = try get("/metrics", method: "HEAD", port: port)
        #expect(head.status == 200 && head.body.isEmpty)
        #expect(sample.calls.withLock { $0 } == ["/metrics", "/metrics", "/other", "/metrics"])
        server.stop()
        #expect(server.port == nil)
    }

    @Test func otherMethodsGet405WithoutReachingTheHandler() throws {
        let sample = SampleHandler()
        let (server, port) = try startedServer("127.0.0.1:0", sample)
        defer { server.stop() }
        for method in ["POST", "PUT", "DELETE", "BREW"] {
            let response = try get("/metrics", method: method, port: port)
            #expect(response.status == 405, "\(method)")
            #expect(response.headers["allow"] == "GET, HEAD")
        }
        let post = try parse(
            exchange(
                Array("POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\nhello".utf8),
                port: port))
        #expect(post.status == 405)
        #expect(sample.calls.withLock { $0 }.isEmpty)
    }

    @Test func servesIPv6Loopback() throws {
        let (server, port) = try startedServer("[::1]:0")
        defer { server.stop() }
        #expect(try get("/metrics", host: "::1", port: port).body == metricsBody)
        // Bound to exactly [::1]: IPv4 loopback is not served.
        #expect(throws: RawClientError.self) { try connectTo("127.0.0.1", port) }
    }

    @Test func allAddressesServesBothFamilies() throws {
        let (server, port) = try startedServer(":0")
        defer { server.stop() }
        #expect(try get("/metrics", host: "127.0.0.1", port: port).status == 200)
        #expect(try get("/metrics", host: "::1", port: port).status == 200)
    }

    @Test func secondServerOnTheSamePortThrowsAClearError() throws {
        let (first, port) = try startedServer()
        defer { first.stop() }
        let second = try MetricsHTTPServer(listen: "127.0.0.1:\(port)", logger: nil)
        do {
            try second.start(handler: SampleHandler().handler)
            Issue.record("the second server started on a port already in use")
        } catch {
            guard case .cannotListen(let address, let reason) = error else {
                Issue.record("unexpected error \(error)")
                return
            }
            #expect(address == "127.0.0.1:\(port)")
            #expect(reason.contains("Address already in use"))
            #expect(error.description.contains("127.0.0.1:\(port)"))
        }
        #expect(second.port == nil)
        // The first one is unaffected.
        #expect(try get("/metrics", port: port).status == 200)
    }

    @Test func addressThatIsNotLocalThrowsWithTheSystemReason() throws {
        // 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never a local address.
        let server = try MetricsHTTPServer(listen: "192.0.2.1:0", logger: nil)
        #expect(
            throws: MetricsHTTPError.cannotListen(
                address: "192.0.2.1:0",
                reason: "Cannot assign requested address (this address is not one of this machine's)")
        ) {
            try server.start(handler: SampleHandler().handler)
        }
    }

    @Test(arguments: [
        "localhost:9464", "9464", "127.0.0.1", "[::1]9464", "::1:9464", "127.0.0.1:65536", "127.0.0.1:-1",
        "127.0.0.1:", "[::1:80", "[127.0.0.1]:80", "300.1.1.1:80", "127.0.0.1:+80", "127.0.0.1:0x50", "",
        "[fe80::1%eth0]:80",
    ])
    func rejectsListenValuesItCannotBindExactly(value: String) {
        do {
            _ = try MetricsHTTPServer(listen: value, logger: nil)
            Issue.record("\(value) was accepted")
        } catch {
            guard case .invalidListenAddress(let named, _) = error else {
                Issue.record("unexpected error \(error)")
                return
            }
            #expect(named == value)
            #expect(error.description.contains("\"\(value)\""))
        }
    }

    @Test func acceptsTheThreeForms() throws {
        for value in ["127.0.0.1:9464", "[::1]:9464", ":9464", "0.0.0.0:1", "[::]:65535"] {
            #expect(try MetricsHTTPServer(listen: value, logger: nil).listen == value)
        }
    }

    @Test func missingLibraryThrowsAtStartNamingIt() throws {
        // libmicrohttpd is loaded when a server starts, so a machine without it fails there, with what to do.
        let server = try MetricsHTTPServer(listen: "127.0.0.1:0", logger: nil, library: "libmicrohttpd-absent.so.12")
        var thrown: MetricsHTTPError?
        do { try server.start(handler: SampleHandler().handler) } catch { thrown = error }
        guard case .libraryUnavailable(let library, let reason) = thrown else {
            Issue.record("expected libraryUnavailable, got \(String(describing: thrown))")
            return
        }
        #expect(library == "libmicrohttpd-absent.so.12")
        #expect(reason.contains("libmicrohttpd-absent.so.12"))
        #expect(thrown?.description.contains("install libmicrohttpd12") == true)
        #expect(server.port == nil)
    }

    @Test func startTwiceThrowsAndStopAllowsARestart() throws {
        let (server, port) = try startedServer()
        #expect(throws: MetricsHTTPError.alreadyRunning(address: "127.0.0.1:0")) {
            try server.start(handler: SampleHandler().handler)
        }
        server.stop()
        server.stop()
        #expect(throws: RawClientError.self) { try connectTo("127.0.0.1", port) }
        try server.start(handler: SampleHandler().handler)
        defer { server.stop() }
        let again = try #require(server.port)
        #expect(try get("/metrics", port: again).status == 200)
    }

    @Test func deinitReleasesThePort() throws {
        var port = 0
        do {
            let (server, bound) = try startedServer()
            port = bound
            _ = server
        }
        let (reused, _) = try startedServer("127.0.0.1:\(port)")
        reused.stop()
    }

    @Test func prometheusHandlerServesItsPathOnly() throws {
        let server = try MetricsHTTPServer(listen: "127.0.0.1:0", logger: nil)
        let scrapes = Mutex(0)
        try server.start(
            handler: MetricsHTTPServer.prometheusHandler {
                var text = PrometheusText()
                let count = scrapes.withLock {
                    $0 += 1
                    return $0
                }
                try? text.counter(name: "scrapes_total", help: "Scrapes.", value: Double(count))
                return text
            })
        defer { server.stop() }
        let port = try #require(server.port)
        let first = try get("/metrics", port: port)
        #expect(first.status == 200 && first.headers["content-type"] == PrometheusText.contentType)
        #expect(first.bodyText == "# HELP scrapes_total Scrapes.\n# TYPE scrapes_total counter\nscrapes_total 1\n")
        #expect(try get("/metrics", port: port).bodyText.hasSuffix("scrapes_total 2\n"))
        #expect(try get("/", port: port).status == 404)
        #expect(scrapes.withLock { $0 } == 2)
    }

    @Test func handlerStatusThatDoesNotExistBecomes500() throws {
        let server = try MetricsHTTPServer(listen: "127.0.0.1:0", logger: nil)
        try server.start { _ in (999, "text/plain", []) }
        defer { server.stop() }
        let response = try get("/metrics", port: try #require(server.port))
        #expect(response.status == 500)
    }

    @Test func emptyBodyAndOddContentType() throws {
        let server = try MetricsHTTPServer(listen: "127.0.0.1:0", logger: nil)
        try server.start { _ in (204, "bad\r\nX-Injected: yes", []) }
        defer { server.stop() }
        let response = try get("/", port: try #require(server.port))
        #expect(response.status == 204 && response.body.isEmpty)
        #expect(response.headers["x-injected"] == nil)
    }

    @Test func hostileRequestsDoNotCrashIt() throws {
        let sample = SampleHandler()
        let (server, port) = try startedServer("127.0.0.1:0", sample)
        defer { server.stop() }
        var generator = SystemRandomNumberGenerator()
        let garbage = (0..<4096).map { _ in UInt8.random(in: 0...255, using: &generator) }
        let hostile: [[UInt8]] = [
            Array("GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: \(String(repeating: "a", count: 200_000))\r\n\r\n".utf8),
            Array("GET /\(String(repeating: "m", count: 100_000)) HTTP/1.0\r\n\r\n".utf8),
            Array(
                ("GET /metrics HTTP/1.1\r\nHost: x\r\n"
                    + (0..<2000).map { "H\($0): v\r\n" }.joined() + "\r\n").utf8),
            garbage,
            [0, 0, 0, 0, 13, 10, 13, 10],
            Array("GET /\u{FF}".utf8) + [0xFF, 0xFE, 0x00, 0x41] + Array(" HTTP/1.0\r\n\r\n".utf8),
            Array("GET /metrics HTTP/9.9\r\n\r\n".utf8),
            Array("GET /metrics HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n".utf8),
            Array("\r\n\r\n\r\n".utf8),
            Array("GET".utf8),
        ]
        for request in hostile {
            let answer = try exchange(request, port: port)
            if let response = try? parse(answer) {
                #expect((200...599).contains(response.status))
            }
            // Still alive and serving after each one.
            #expect(try get("/metrics", port: port).body == metricsBody)
        }
        // A client that stalls half-way through its request does not hold up others (one thread, but polled).
        let stalled = try connectTo("127.0.0.1", port)
        defer { close(stalled) }
        _ = Array("GET /metr".utf8).withUnsafeBytes { send(stalled, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
        #expect(try get("/metrics", port: port).body == metricsBody)
        // An invalid UTF-8 path reaches the handler repaired, not as a crash.
        let odd = try parse(exchange(Array("GET /a".utf8) + [0xFF] + Array(" HTTP/1.0\r\n\r\n".utf8), port: port))
        #expect(odd.status == 404)
        #expect(sample.calls.withLock { $0 }.contains("/a\u{FFFD}"))
    }
}
