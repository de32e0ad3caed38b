// The one owner of a `struct mosquitto *`, and the loop thread that drives it.
internal import CMosquitto
internal import CMosquittoIO

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// Owns one libmosquitto client handle and destroys it in `deinit`.
///
/// libmosquitto is used in its threaded mode (`mosquitto_threaded_set`): publish, subscribe and disconnect may be
/// called from any thread while our own loop thread runs `mosquitto_loop`; the library serialises them with its
/// own mutexes and wakes the loop through its socket pair.
final class MosquittoHandle: @unchecked Sendable {
    let raw: OpaquePointer

    init(clientID: String?, cleanSession: Bool) throws(MQTTError) {
        Mosquitto.initialise()
        guard let raw = mosquitto_new(clientID, cleanSession, nil) else {
            let code = errno
            throw MQTTError(
                .library(MOSQ_ERR_ERRNO.rawValue), operation: "create MQTT client",
                detail: String(cString: strerror(code)))
        }
        self.raw = raw
        mosquitto_threaded_set(raw, true)
    }

    deinit { mosquitto_destroy(raw) }
}

/// A read buffer for the client's plain-TCP broker socket (CMosquittoIO): libmosquitto reads each packet in three
/// or more read(2) calls (command byte, length, body); with the socket attached, one recv(2) takes everything the
/// broker sent (a wake-up's PUBACKs under load) and libmosquitto's reads are served from memory. Attached by the loop
/// thread for each connection and only used by it (and by tests); close(2) of the socket detaches it.
final class MosquittoReadBuffer: @unchecked Sendable {
    /// Allocated at the first attach (a client over TLS never has one).
    private var raw: OpaquePointer?
    /// The descriptor attached last (the loop thread's only).
    private var attached: Int32 = -1

    init() {}

    deinit {
        detach()
        mosquitto_io_buffer_free(raw)
    }

    /// Serves reads of `socket` from this buffer, emptied first. Without a buffer (out of memory) or for a
    /// descriptor beyond the table, reads go to the system as they would without it.
    func attach(_ socket: Int32) {
        detach()
        if raw == nil { raw = mosquitto_io_buffer_new() }
        guard let raw, mosquitto_io_attach(socket, raw) == 0 else { return }
        attached = socket
    }

    /// Stops serving the attached socket (nothing when close(2) already did, or it serves another client now).
    func detach() {
        guard let raw, attached >= 0 else { return }
        mosquitto_io_detach(attached, raw)
        attached = -1
    }

    /// Bytes received from the broker and not yet read by libmosquitto: the socket may poll as empty while they wait.
    var hasBufferedBytes: Bool { raw.map { mosquitto_io_buffered($0) > 0 } ?? false }

    /// True when reads of `socket` are served from some buffer.
    static func isAttached(_ socket: Int32) -> Bool { mosquitto_io_is_attached(socket) != 0 }

    /// recv(2) calls that filled the buffer, and reads it served, so far.
    var counts: (fills: UInt64, reads: UInt64) {
        guard let raw else { return (0, 0) }
        return (UInt64(mosquitto_io_fills(raw)), UInt64(mosquitto_io_reads(raw)))
    }
}

/// Runs `body` on a new detached POSIX thread (libmosquitto's blocking calls never touch the Swift pool).
func startThread(_ body: @escaping @Sendable () -> Void) throws(MQTTError) {
    final class Box {
        let body: @Sendable () -> Void

        init(_ body: @escaping @Sendable () -> Void) {
            self.body = body
        }
    }
    let box = Unmanaged.passRetained(Box(body)).toOpaque()
    var thread = pthread_t()
    let rc = pthread_create(
        &thread, nil,
        { raw in
            guard let raw else { return nil }
            let box = Unmanaged<Box>.fromOpaque(raw).takeRetainedValue()
            box.body()
            return nil
        }, box)
    guard rc == 0 else {
        Unmanaged<Box>.fromOpaque(box).release()
        throw MQTTError(
            .library(MOSQ_ERR_ERRNO.rawValue), operation: "start MQTT loop thread",
            detail: String(cString: strerror(rc)))
    }
    pthread_detach(thread)
}
