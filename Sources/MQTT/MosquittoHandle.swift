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
/// called from any thread while our own loop thread runs; the library serialises them with its own mutexes and,
/// under TLS, wakes the loop through its socket pair (`wakeUpRead`, polled by `ClientCore.loopOnce`).
final class MosquittoHandle: @unchecked Sendable {
    let raw: OpaquePointer

    /// libmosquitto's wake-up socket (the write end of its socket pair) when its writes are dropped, else -1.
    let silencedWakeUp: Int32
    /// The read end of libmosquitto's wake-up socket pair when its writes are kept (TLS: the loop polls it), else -1.
    let wakeUpRead: Int32

    /// - Parameter silenceWakeUps: drop libmosquitto's wake-up writes (a byte to its socket pair for every packet
    ///   it queues, for a select(2) loop): true on plain TCP, where our loop never reads that pair.
    init(clientID: String?, cleanSession: Bool, silenceWakeUps: Bool = false) throws(MQTTError) {
        Mosquitto.initialise()
        if silenceWakeUps { _ = mosquitto_io_silence_socketpair(1) } else { _ = mosquitto_io_capture_socketpair(1) }
        let made = mosquitto_new(clientID, cleanSession, nil)
        let silenced = mosquitto_io_silence_socketpair(0)
        let captured = mosquitto_io_capture_socketpair(0)
        silencedWakeUp = silenceWakeUps ? silenced : -1
        wakeUpRead = silenceWakeUps ? -1 : captured
        guard let raw = made else {
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

/// The read and write buffers of the client's plain-TCP broker socket (CMosquittoIO). libmosquitto reads each
/// packet in three or more read(2) calls (command byte, length, body) and writes each packet with a write(2) of its
/// own; with the socket attached, one recv(2) takes everything the broker sent (a wake-up's PUBACKs under load), and
/// between `hold()` and `release()` the packets written leave together in one write(2). The loop thread attaches
/// the socket for each connection, detaches it at the end, and is the only reader; any thread may hold, release and
/// write. close(2) of the socket detaches it and drops what was held.
final class MosquittoSocketBuffers: @unchecked Sendable {
    /// Nil over TLS (libmosquitto's own loop reads and writes there) or when out of memory.
    private let raw: OpaquePointer?
    /// The descriptor attached last (the loop thread's only).
    private var attached: Int32 = -1

    init(enabled: Bool) { raw = enabled ? mosquitto_io_buffer_new() : nil }

    deinit {
        detach()
        mosquitto_io_buffer_free(raw)
    }

    /// Serves `socket` through these buffers, emptied first. Without buffers, or for a descriptor beyond the table,
    /// reads and writes go to the system as they would without them.
    func attach(_ socket: Int32) {
        detach()
        guard let raw, mosquitto_io_attach(socket, raw) == 0 else { return }
        attached = socket
    }

    /// Sends what is held (as far as the socket takes it) and stops serving the attached socket (nothing when
    /// close(2) already did, or the number serves another client now).
    func detach() {
        guard let raw, attached >= 0 else { return }
        mosquitto_io_detach(attached, raw)
        attached = -1
    }

    /// True when reads or writes of `socket` are served through some client's buffers.
    static func isAttached(_ socket: Int32) -> Bool { mosquitto_io_is_attached(socket) != 0 }

    /// Bytes received from the broker and not yet read by libmosquitto: the socket may poll as empty while they wait.
    var hasBufferedBytes: Bool { raw.map { mosquitto_io_buffered($0) > 0 } ?? false }

    /// Keeps what is written to the socket from now on (up to 16 KiB) until `release()`.
    func hold() {
        guard let raw else { return }
        mosquitto_io_hold(raw)
    }

    /// Sends what was held; what the socket did not take waits for `flush()`.
    func release() {
        guard let raw else { return }
        _ = mosquitto_io_release(raw)
    }

    /// Sends what is held now and goes on holding (what is written next is held again): for writes that must
    /// not wait for the holder's release. A failed socket is libmosquitto's to find on its next read or write.
    func sendHeld() {
        guard let raw else { return }
        _ = mosquitto_io_send_kept(raw)
    }

    /// True when written bytes wait for the socket to take them, or for the end of a hold.
    var hasPendingWrites: Bool { raw.map { mosquitto_io_pending($0) > 0 } ?? false }

    /// True when written bytes wait for the socket to take them (not for the end of a hold): `flush()` would send.
    var hasWaitingWrites: Bool { raw.map { mosquitto_io_waiting($0) > 0 } ?? false }

    /// Sends what waits (nothing during a hold). Returns false when the socket failed (the connection is broken;
    /// libmosquitto finds out on its next read or write).
    func flush() -> Bool {
        guard let raw else { return true }
        return mosquitto_io_flush(raw) != -1
    }

    /// recv(2) calls that filled the read buffer and reads it served; writes kept and write(2) calls that sent them.
    var counts: (fills: UInt64, reads: UInt64, keptWrites: UInt64, flushes: UInt64) {
        guard let raw else { return (0, 0, 0, 0) }
        return (
            UInt64(mosquitto_io_fills(raw)), UInt64(mosquitto_io_reads(raw)), UInt64(mosquitto_io_kept_writes(raw)),
            UInt64(mosquitto_io_flushes(raw))
        )
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
