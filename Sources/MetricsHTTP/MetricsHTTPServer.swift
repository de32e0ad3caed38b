// A tiny HTTP server for a metrics scrape endpoint, over libmicrohttpd. This file is the only code that touches the
// C library; nothing of it appears in a public signature.
internal import CMicroHTTPD
import Logging
import Synchronization

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// What a request handler answers: an HTTP status, a `Content-Type` and the body bytes.
public typealias MetricsHTTPResponse = (status: Int, contentType: String, body: [UInt8])

/// Answers one GET or HEAD request for `path` (the URL path without its query string, e.g. `/metrics`).
///
/// Called synchronously on the server's own thread, one request at a time; it must not block for long (a scrape
/// waits for it) and must not call ``MetricsHTTPServer/stop()``.
public typealias MetricsHTTPHandler = @Sendable (_ path: String) -> MetricsHTTPResponse

/// Why a metrics server could not be set up or started.
public enum MetricsHTTPError: Error, Equatable, CustomStringConvertible {
    /// The listen value is not `<IPv4>:<port>`, `[<IPv6>]:<port>` or `:<port>`.
    case invalidListenAddress(String, reason: String)
    /// The socket could not be bound or listened on; `reason` is the system's message (`strerror`) with a hint.
    case cannotListen(address: String, reason: String)
    /// ``MetricsHTTPServer/start(handler:)`` was called while the server was already running.
    case alreadyRunning(address: String)
    /// libmicrohttpd could not be loaded (it is loaded when the first server starts); `reason` is dlerror(3)'s.
    case libraryUnavailable(library: String, reason: String)

    /// The text people read: what failed, for which address, and what to do.
    public var description: String {
        switch self {
        case .invalidListenAddress(let value, let reason):
            return "metrics listen address \"\(value)\" is not valid: \(reason)"
        case .cannotListen(let address, let reason):
            return "metrics endpoint \(address): cannot listen: \(reason)"
        case .alreadyRunning(let address):
            return "metrics endpoint \(address) is already running; stop it before starting it again"
        case .libraryUnavailable(let library, let reason):
            return "metrics endpoint: cannot load \(library) (\(reason)); install libmicrohttpd12"
                + " or remove metrics.listen"
        }
    }
}

/// Serves HTTP GET requests on one address with libmicrohttpd's single internal polling thread.
///
/// Only GET and HEAD are answered through the handler; other methods get 405 without reaching it. Malformed
/// requests, oversized headers and slow clients are dealt with by libmicrohttpd (400, 431, a 10 s timeout, at most
/// 32 connections), so nothing a client sends can crash the process.
///
/// Lifetime: ``start(handler:)`` binds and starts the thread; ``stop()`` (also run by `deinit`) closes the socket and
/// returns once the thread has finished, after which the handler is never called again. Keep the server referenced
/// outside the handler and do not capture it in the handler: the server thread cannot stop itself.
public final class MetricsHTTPServer: Sendable {
    /// The listen value as given, e.g. `127.0.0.1:9464`.
    public let listen: String
    /// Where libmicrohttpd is loaded from when the server starts.
    private let library: String
    private let address: MetricsListenAddress
    private let logger: Logger
    private let state = Mutex<Running?>(nil)

    /// A server for `listen`: `127.0.0.1:9464` (one IPv4 address), `[::1]:9464` (one IPv6 address) or `:9464`
    /// (every address). Port 0 lets the kernel pick one (see ``port``). Nothing is bound until ``start(handler:)``.
    ///
    /// - Throws: ``MetricsHTTPError/invalidListenAddress(_:reason:)`` naming the value, for anything else (host
    ///   names included: the bind is exactly what was written, no resolver involved).
    public convenience init(listen: String, logger: Logger?) throws(MetricsHTTPError) {
        try self.init(listen: listen, logger: logger, library: MicroHTTPD.soname)
    }

    /// As ``init(listen:logger:)``, with libmicrohttpd loaded from `library` (a soname or path) when starting.
    init(listen: String, logger: Logger?, library: String) throws(MetricsHTTPError) {
        self.listen = listen
        self.library = library
        self.address = try MetricsListenAddress(parsing: listen)
        self.logger = (logger ?? .disabled).labelled(component: "metrics")
    }

    deinit { stop() }

    /// The port the server listens on while running (the kernel's pick when the listen value had port 0); nil when
    /// stopped.
    public var port: Int? { state.withLock { $0?.port } }

    /// Binds to the address and starts answering requests with `handler`.
    ///
    /// - Throws: ``MetricsHTTPError/cannotListen(address:reason:)`` with the system's reason when the address is in
    ///   use, not local, or not permitted; ``MetricsHTTPError/alreadyRunning(address:)`` if already started.
    public func start(handler: @escaping MetricsHTTPHandler) throws(MetricsHTTPError) {
        let started = try state.withLock { (running: inout Running?) throws(MetricsHTTPError) -> Int in
            guard running == nil else { throw .alreadyRunning(address: listen) }
            let mhd = try MicroHTTPD.loaded(library).get()
            let context = Unmanaged.passRetained(ServerContext(handler: handler, logger: logger, mhd: mhd))
            let dualStack = address.host == .any && Self.ipv6Available()
            let (daemon, code) = address.withSocketAddress(dualStack: dualStack) { socketAddress, isIPv6 in
                // poll(2), not epoll: level-triggered, so a client that sends a request fragment and then closes
                // is noticed at once (with epoll's edge trigger libmicrohttpd waits for the idle timeout), and no
                // FD_SETSIZE limit as with select(2).
                var flags = MHD_USE_INTERNAL_POLLING_THREAD.rawValue | MHD_USE_POLL.rawValue
                flags |= MHD_USE_ERROR_LOG.rawValue
                if isIPv6 { flags |= dualStack ? MHD_USE_DUAL_STACK.rawValue : MHD_USE_IPv6.rawValue }
                errno = 0
                let daemon = withUnsafePointer(to: mhd.api) { api in
                    blebridge_mhd_start(
                        api, flags, socketAddress, metricsAccessHandler, context.toOpaque(), metricsLogHandler,
                        context.toOpaque(), Limits.connections, Limits.timeoutSeconds, Limits.memoryBytes)
                }
                return (daemon, errno)
            }
            let messages = context.takeUnretainedValue().finishStarting()
            guard let daemon else {
                context.release()
                throw .cannotListen(address: listen, reason: Self.reason(code: code, messages: messages))
            }
            let port = Int(withUnsafePointer(to: mhd.api) { blebridge_mhd_bound_port($0, daemon) })
            running = Running(daemon: daemon, context: context, port: port, mhd: mhd)
            return port
        }
        logger.info("serving HTTP on \(listen) (port \(started))")
    }

    /// Stops serving: closes the listening socket and waits for the server thread to finish. Does nothing when not
    /// running. Must not be called from the handler.
    public func stop() {
        let stopped = state.withLock { running -> Running? in
            defer { running = nil }
            return running
        }
        guard let stopped else { return }
        stopped.mhd.stopDaemon(stopped.daemon)
        // The thread has finished, so no callback holds the context any more.
        stopped.context.release()
        logger.debug("stopped serving HTTP on \(listen)")
    }

    /// A handler that serves `render()`'s exposition at `path` with ``PrometheusText/contentType`` and 404 for every
    /// other path. `render` runs on the server thread for each scrape.
    public static func prometheusHandler(
        path: String = "/metrics", render: @escaping @Sendable () -> PrometheusText
    ) -> MetricsHTTPHandler {
        { requested in
            guard requested == path else {
                return (404, "text/plain; charset=utf-8", Array("not found; metrics are at \(path)\n".utf8))
            }
            return (200, PrometheusText.contentType, render().bytes)
        }
    }

    private enum Limits {
        /// Scrapers are few; this bounds what a flood of connections can take.
        static let connections: UInt32 = 32
        /// Closes connections that sit idle (slow or stuck clients) after this long.
        static let timeoutSeconds: UInt32 = 10
        /// Per-connection buffer for the request line and headers; larger headers get 431 from libmicrohttpd.
        static let memoryBytes = 32 * 1024
    }

    /// Whether this machine can open IPv6 sockets, so `:port` can listen on both families.
    private static func ipv6Available() -> Bool {
        let fd = socket(AF_INET6, Int32(SOCK_STREAM.rawValue), 0)
        guard fd >= 0 else { return false }
        close(fd)
        return true
    }

    private static func reason(code: Int32, messages: [String]) -> String {
        guard code != 0 else {
            return messages.last ?? "libmicrohttpd could not start its daemon (no reason given)"
        }
        let system = String(cString: strerror(code))
        switch code {
        case EADDRINUSE:
            return "\(system) (another program already listens on this port; pick another listen address)"
        case EADDRNOTAVAIL:
            return "\(system) (this address is not one of this machine's)"
        case EACCES:
            return "\(system) (ports below 1024 need privileges)"
        default:
            return system
        }
    }
}

/// A started libmicrohttpd daemon and the context its callbacks use; owned by the server's mutex.
private struct Running: @unchecked Sendable {
    var daemon: OpaquePointer
    var context: Unmanaged<ServerContext>
    var port: Int
    var mhd: MicroHTTPD
}

/// libmicrohttpd's functions, looked up with dlopen(3) when the first server starts (CMicroHTTPD/shim.h says why).
/// Immutable once loaded; the library is never unloaded.
struct MicroHTTPD: @unchecked Sendable {
    /// The library the Debian package libmicrohttpd12 installs.
    static let soname = "libmicrohttpd.so.12"

    let api: blebridge_mhd_api
    let stopDaemon: @convention(c) (OpaquePointer?) -> Void
    let createResponse: @convention(c) (Int, UnsafeMutableRawPointer?, MHD_ResponseMemoryMode) -> OpaquePointer?
    let addHeader: @convention(c) (OpaquePointer?, UnsafePointer<CChar>?, UnsafePointer<CChar>?) -> MHD_Result
    let queueResponse: @convention(c) (OpaquePointer?, UInt32, OpaquePointer?) -> MHD_Result
    let destroyResponse: @convention(c) (OpaquePointer?) -> Void

    /// The process's copy of the default library, loaded on first use.
    private static let shared = load(soname)

    /// The library at `name`: the shared copy for the default soname, a fresh load otherwise.
    static func loaded(_ name: String) -> Result<MicroHTTPD, MetricsHTTPError> {
        name == soname ? shared : load(name)
    }

    private static func load(_ name: String) -> Result<MicroHTTPD, MetricsHTTPError> {
        var api = blebridge_mhd_api()
        if let failure = blebridge_mhd_load(name, &api) {
            return .failure(.libraryUnavailable(library: name, reason: String(cString: failure)))
        }
        guard let stop = api.stop_daemon, let create = api.create_response_from_buffer,
            let add = api.add_response_header, let queue = api.queue_response, let destroy = api.destroy_response,
            api.start_daemon != nil, api.get_daemon_info != nil
        else {
            return .failure(.libraryUnavailable(library: name, reason: "a function is missing"))
        }
        return .success(
            MicroHTTPD(
                api: api, stopDaemon: stop, createResponse: create, addHeader: add, queueResponse: queue,
                destroyResponse: destroy))
    }
}

/// What the C callbacks need, reached through libmicrohttpd's userdata pointer.
private final class ServerContext: Sendable {
    let handler: MetricsHTTPHandler
    let logger: Logger
    let mhd: MicroHTTPD
    /// libmicrohttpd's messages while the daemon starts (they explain a failure); nil once started.
    private let startMessages = Mutex<[String]?>([])

    init(handler: @escaping MetricsHTTPHandler, logger: Logger, mhd: MicroHTTPD) {
        self.handler = handler
        self.logger = logger
        self.mhd = mhd
    }

    /// Stops collecting start messages and returns them.
    func finishStarting() -> [String] {
        startMessages.withLock { messages in
            defer { messages = nil }
            return messages ?? []
        }
    }

    func libraryMessage(_ message: String) {
        let collected = startMessages.withLock { messages -> Bool in
            guard messages != nil else { return false }
            messages?.append(message)
            return true
        }
        // At run time these are mostly about misbehaving clients (bad requests, dropped connections).
        if !collected { logger.debug("libmicrohttpd: \(message)") }
    }

    /// Whether requests with `method` go to the handler (the others get 405).
    static func isAnswered(method: String) -> Bool { method == "GET" || method == "HEAD" }

    /// Answers one request: GET and HEAD through the handler, anything else 405.
    func answer(_ connection: OpaquePointer, method: String, path: String) -> MHD_Result {
        guard Self.isAnswered(method: method) else {
            logger.debug("\(method) \(path): 405")
            return send(
                connection, status: 405, contentType: "text/plain; charset=utf-8",
                body: Array("method not allowed; use GET\n".utf8), allow: "GET, HEAD")
        }
        var (status, contentType, body) = handler(path)
        if !(100...599).contains(status) {
            logger.warning("handler answered \(path) with HTTP status \(status), which does not exist; sending 500")
            (status, contentType, body) = (500, "text/plain; charset=utf-8", Array("internal error\n".utf8))
        }
        logger.trace("\(method) \(path): \(status), \(body.count) bytes")
        return send(connection, status: status, contentType: contentType, body: body, allow: nil)
    }

    private func send(_ connection: OpaquePointer, status: Int, contentType: String, body: [UInt8], allow: String?)
        -> MHD_Result
    {
        let created = body.withUnsafeBytes { raw in
            mhd.createResponse(
                raw.count, UnsafeMutableRawPointer(mutating: raw.baseAddress), .RESPMEM_MUST_COPY)
        }
        // Without a response libmicrohttpd closes the connection, which is all that is left to do.
        guard let response = created else { return MHD_Result.NO }
        defer { mhd.destroyResponse(response) }
        if mhd.addHeader(response, "Content-Type", contentType) == MHD_Result.NO {
            logger.warning("Content-Type \"\(contentType)\" was refused by libmicrohttpd; sent without it")
        }
        if let allow { _ = mhd.addHeader(response, "Allow", allow) }
        return mhd.queueResponse(connection, UInt32(status), response)
    }
}

/// Per-request markers libmicrohttpd keeps for us in its `req_cls` slot (any non-nil pointer would do).
private enum RequestMarker {
    /// Headers seen; answer once the request (and any body) has been read, so the connection can be kept alive.
    static var reading: UnsafeMutableRawPointer? { UnsafeMutableRawPointer(bitPattern: 1) }
    /// Answered; anything else the client sends for this request is discarded.
    static var answered: UnsafeMutableRawPointer? { UnsafeMutableRawPointer(bitPattern: 2) }
}

/// libmicrohttpd's request callback: called once when the headers are in, then for each piece of a body, then once
/// more with no data when the request is complete.
private let metricsAccessHandler: MHD_AccessHandlerCallback = {
    userdata, connection, url, method, _, _, uploadSize, requestState in
    guard let userdata, let connection, let requestState else { return MHD_Result.NO }
    let context = Unmanaged<ServerContext>.fromOpaque(userdata).takeUnretainedValue()
    // String(cString:) repairs invalid UTF-8, so odd bytes in the path reach the handler as U+FFFD.
    let path = url.map { String(cString: $0) } ?? ""
    let verb = method.map { String(cString: $0) } ?? ""
    switch requestState.pointee {
    case nil:
        if ServerContext.isAnswered(method: verb) {
            requestState.pointee = RequestMarker.reading
            return MHD_Result.YES
        }
        // Refused methods are answered at once; libmicrohttpd then closes the connection instead of reading a body.
        requestState.pointee = RequestMarker.answered
        return context.answer(connection, method: verb, path: path)
    case RequestMarker.reading where (uploadSize?.pointee ?? 0) == 0:
        requestState.pointee = RequestMarker.answered
        return context.answer(connection, method: verb, path: path)
    default:
        uploadSize?.pointee = 0
        return MHD_Result.YES
    }
}

/// libmicrohttpd's logger: formats the message and hands it to the context.
private let metricsLogHandler: MHD_LogCallback = { userdata, format, arguments in
    guard let userdata, let format, let arguments else { return }
    var buffer = [CChar](repeating: 0, count: 512)
    let written = buffer.withUnsafeMutableBufferPointer { vsnprintf($0.baseAddress, $0.count, format, arguments) }
    guard written >= 0 else { return }
    var message = String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
    while message.last == "\n" || message.last == "\r" { message.removeLast() }
    Unmanaged<ServerContext>.fromOpaque(userdata).takeUnretainedValue().libraryMessage(message)
}
