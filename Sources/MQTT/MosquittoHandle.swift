// The one owner of a `struct mosquitto *`, and the loop thread that drives it.
internal import CMosquitto

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
