// The client's engine: the state machine behind a Mutex, the loop thread, and the C callbacks. libmosquitto's
// callbacks reach it through the userdata pointer (unretained: the loop thread holds a strong reference for as long
// as callbacks can run, and the handle is destroyed with the core).
//
// Ordering and the offline queue are ours: a publish goes to libmosquitto only while connected, with nothing queued
// ahead of it, and (for QoS 1/2) while fewer than `maxInflightMessages` await their acknowledgement. Everything else
// waits in `OutgoingQueue`, which drains in order from the loop thread when the connection comes up or the window
// opens. libmosquitto's own offline queueing is never used, so the bound and the drop policy are ours.
//
// Acknowledgements are matched to waiters by packet id (mid), which libmosquitto assigns inside its publish call and
// reuses after 65535. `handoff` makes "call libmosquitto, record the waiter under the mid it returned" one step as
// seen from the acknowledgement callbacks, so an acknowledgement always finds its waiter, and one without a waiter
// is dropped instead of being kept for a later message that reuses the id. (QoS 0 "sent" notifications arrive
// through the same callback; `ignoredAcks` tells them apart.)
internal import CLinux
internal import CMosquitto
import Dispatch
import Synchronization

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// A publish waiting in the offline queue.
struct QueuedPublish: Sendable {
    let message: MQTTOutgoingMessage
    /// Nil for a message nobody waits for (`MQTTClient.post`): one allocation less per publish.
    let completion: Completion<Void>?
}

/// A FIFO with cheap removal of the oldest QoS 0 element (slots are nil'ed, the head skips them). Every operation
/// is O(1) amortised: a full queue of QoS 1 messages (the broker acknowledging slower than the bridge publishes)
/// must not cost a scan of the whole queue per publish, or the publishing thread falls further behind.
struct OutgoingQueue {
    private var slots: [QueuedPublish?] = []
    private var head = 0
    private(set) var count = 0
    /// QoS 0 elements in the queue.
    private var qos0Count = 0
    /// No QoS 0 element sits before this slot, so the search for the oldest starts here.
    private var qos0Cursor = 0

    var isEmpty: Bool { count == 0 }

    mutating func append(_ item: QueuedPublish) {
        slots.append(item)
        count += 1
        if item.message.qos == .atMostOnce { qos0Count += 1 }
    }

    /// The oldest element.
    mutating func peek() -> QueuedPublish? {
        while head < slots.count, slots[head] == nil { head += 1 }
        return head < slots.count ? slots[head] : nil
    }

    mutating func removeFirst() -> QueuedPublish? {
        guard let item = peek() else { return nil }
        slots[head] = nil
        head += 1
        count -= 1
        if item.message.qos == .atMostOnce { qos0Count -= 1 }
        compact()
        return item
    }

    /// Removes the oldest QoS 0 element, if any.
    mutating func removeOldestQoS0() -> QueuedPublish? {
        guard qos0Count > 0 else { return nil }
        var index = max(head, qos0Cursor)
        while index < slots.count {
            if let item = slots[index], item.message.qos == .atMostOnce {
                slots[index] = nil
                count -= 1
                qos0Count -= 1
                qos0Cursor = index + 1
                return item
            }
            index += 1
        }
        qos0Cursor = index
        return nil
    }

    /// Puts `items` back at the front, in their order.
    mutating func prepend(_ items: [QueuedPublish]) {
        guard !items.isEmpty else { return }
        slots = items.map { Optional($0) } + slots[head...].filter { $0 != nil }
        head = 0
        count = slots.count
        qos0Cursor = 0
        qos0Count = slots.reduce(0) { $0 + ($1?.message.qos == .atMostOnce ? 1 : 0) }
    }

    mutating func removeAll() -> [QueuedPublish] {
        let items = slots[head...].compactMap { $0 }
        slots = []
        head = 0
        count = 0
        qos0Count = 0
        qos0Cursor = 0
        return items
    }

    private mutating func compact() {
        if head > 4096 && head * 2 > slots.count {
            slots.removeFirst(head)
            qos0Cursor = max(0, qos0Cursor - head)
            head = 0
        }
    }
}

/// What the core knows, guarded by one Mutex. Transitions return what to do; C calls happen outside the lock.
struct CoreState {
    enum Lifecycle { case idle, running, stopping, stopped }
    struct Subscription {
        var qos: MQTTQoS
        /// Confirmed by a SUBACK on the current (or resumed) session.
        var active: Bool
    }
    struct PendingAck {
        let completion: Completion<Void>?
        let topic: String
    }
    struct SubscribeRequest {
        let filter: String
        let qos: MQTTQoS
        let completion: Completion<MQTTQoS>?
    }

    var lifecycle = Lifecycle.idle
    var connection = MQTTConnectionState.idle
    var connected = false
    var draining = false
    var attempt = 0
    /// Why the broker refused or ended the connection (CONNACK or DISCONNECT reason), for the state stream.
    var refusal: MQTTError?
    var queue = OutgoingQueue()
    var inflight = 0
    var publishWaiters: [Int32: PendingAck] = [:]
    /// Mids of QoS 0 messages whose "sent" notification is still to come. It must not be taken for the PUBACK of a
    /// QoS 1/2 message still in flight under the same (reused) mid. Cleared on connect: a QoS 0 packet not written
    /// before the connection dropped is discarded and never notified.
    var ignoredAcks: Set<Int32> = []
    var subscriptions: [String: Subscription] = [:]
    var subscriptionOrder: [String] = []
    /// Filters removed while disconnected: a resumed session still has them, so they are unsubscribed on connect.
    var pendingUnsubscribes: [String] = []
    var subscribeRequests: [Int32: SubscribeRequest] = [:]
    var unsubscribeWaiters: [Int32: Completion<Void>] = [:]
    var statistics = MQTTClientStatistics()
}

final class ClientCore: Sendable {
    let configuration: MQTTConfiguration
    let handle: MosquittoHandle
    let state = Mutex(CoreState())
    let incoming = Broadcast<MQTTMessage>()
    let states = Broadcast<MQTTConnectionState>()
    /// Completed by the first connection attempt's outcome (for `MQTTClient.connect()`).
    let firstOutcome = Completion<Void>()
    /// Completed when the loop thread has finished.
    let finished = Completion<Void>()
    let stopRequested = Atomic<Bool>(false)
    /// The broker's maximum packet size from the last CONNACK (MQTT 5), 0 when it set none.
    let maximumPacketSize = Atomic<UInt32>(0)
    let received = Atomic<Int>(0)
    let receiveDropped = Atomic<Int>(0)
    let receiveOversizeDropped = Atomic<Int>(0)
    /// The last warning or error libmosquitto logged (TLS failures explain themselves only there).
    let lastLog = Mutex<String?>(nil)
    /// Held around each libmosquitto publish/subscribe/unsubscribe call together with recording its waiter, and
    /// taken by the acknowledgement callbacks before they look a waiter up (see the file comment). Never held while
    /// taking it again: libmosquitto in threaded mode never calls back from inside these calls.
    private let handoff = Mutex(())
    private let wakeup = DispatchSemaphore(value: 0)
    /// QoS 1/2 publishes in flight at most: the configured window, or the broker's Receive Maximum when that is
    /// smaller (libmosquitto would otherwise hold the rest back itself, and send them from the loop thread).
    var window: Int { min(configuredWindow, brokerReceiveMaximum.load(ordering: .relaxed)) }
    private let configuredWindow: Int
    /// The Receive Maximum of the broker's CONNACK (MQTT 5); 65,535 when it names none.
    private let brokerReceiveMaximum = Atomic<Int>(65_535)
    private let isV5: Bool
    /// Plain TCP: the loop thread polls only the broker socket (not libmosquitto's own wake-up pair, and with no
    /// descriptor of ours besides), and a thread that hands libmosquitto a packet writes it out itself
    /// (`writeOut`). libmosquitto's threaded mode would wake the loop thread for every publish instead: a context
    /// switch per message. Reads and writes of one socket may run on two threads; libmosquitto serialises its
    /// writers with its own mutex. Under TLS one SSL object must not be read and written at once, so there the loop
    /// thread does both (`loopOnce`, woken by libmosquitto's socket pair for what other threads queue).
    private let writesFromCaller: Bool
    /// The loop thread, once it runs: it never writes from inside a callback (libmosquitto holds its callback
    /// mutex there, which the write path's "sent" callback takes again).
    private let loopThread = Mutex<pthread_t?>(nil)
    /// libmosquitto's result when a write from a caller's thread found the connection broken (it closed the socket
    /// and reported the disconnection); the loop thread takes it as the reason.
    private let callerWriteFailure = Atomic<Int32>(0)
    /// Plain TCP: the broker socket's reads, served from one recv(2) per wake-up, and its writes, held together
    /// between `holdWrites(true)` and `holdWrites(false)` (see `MosquittoSocketBuffers`).
    let buffers: MosquittoSocketBuffers

    init(configuration: MQTTConfiguration) throws(MQTTError) {
        try configuration.validate()
        self.configuration = configuration
        handle = try MosquittoHandle(
            clientID: configuration.clientID, cleanSession: configuration.cleanSession,
            silenceWakeUps: !configuration.broker.usesTLS)
        configuredWindow = configuration.maxInflightMessages
        isV5 = configuration.protocolVersion == .v5
        writesFromCaller = !configuration.broker.usesTLS
        buffers = MosquittoSocketBuffers(enabled: writesFromCaller)
        mosquitto_user_data_set(handle.raw, Unmanaged.passUnretained(self).toOpaque())
        installCallbacks()
    }

    private var brokerName: String { configuration.broker.description }

    // MARK: Start and stop

    /// Applies the settings to the handle and starts the loop thread.
    func start() throws(MQTTError) {
        let canStart = state.withLock { state in
            guard state.lifecycle == .idle else { return false }
            state.lifecycle = .running
            return true
        }
        guard canStart else {
            throw MQTTError(
                .invalidConfiguration, operation: "start MQTT client for \(brokerName)",
                detail: "the client was already started (a client runs once; make a new one)")
        }
        do {
            let connectProperties = try configureHandle()
            try startThread { [self] in self.runLoop(connectProperties: connectProperties) }
        } catch {
            state.withLock { $0.lifecycle = .stopped }
            finishEverything()
            throw error
        }
    }

    /// Asks the loop thread to disconnect cleanly and end; safe to call from any thread, more than once.
    func requestStop() {
        let wasRunning = state.withLock { state -> Bool in
            switch state.lifecycle {
            case .idle:
                state.lifecycle = .stopped
                return false
            case .running:
                state.lifecycle = .stopping
                return true
            case .stopping, .stopped:
                return false
            }
        }
        stopRequested.store(true, ordering: .sequentiallyConsistent)
        // What is held leaves now, before the DISCONNECT: libmosquitto closes the socket once that is written, and a
        // close drops what is still held (the broker would also see an unclean end and publish the will).
        // `holdWrites` takes no new hold from here on.
        if writesFromCaller { buffers.release() }
        if wasRunning {
            // Wakes the backoff; a connected loop sees the stop when its poll returns (on plain TCP at the latest
            // after `ownLoopPoll`, under TLS after a second). The loop thread sends the DISCONNECT itself, once the
            // acknowledgements in flight are in: libmosquitto takes a PUBACK that arrives after mosquitto_disconnect
            // for a protocol error and drops the connection without a DISCONNECT (the broker then publishes the will).
            wakeup.signal()
        } else if state.withLock({ $0.lifecycle == .stopped }) && finished.result == nil {
            finishEverything()
        }
    }

    private var stopping: Bool { stopRequested.load(ordering: .relaxed) }

    private func configureHandle() throws(MQTTError) -> MosquittoProperties {
        let raw = handle.raw
        let config = configuration
        let operation = "configure MQTT client for \(brokerName)"
        let version = config.protocolVersion == .v5 ? MQTT_PROTOCOL_V5 : MQTT_PROTOCOL_V311
        try Mosquitto.check(mosquitto_int_option(raw, MOSQ_OPT_PROTOCOL_VERSION, version), operation)
        let window = Int32(config.maxInflightMessages)
        try Mosquitto.check(mosquitto_int_option(raw, MOSQ_OPT_SEND_MAXIMUM, window), operation)
        try Mosquitto.check(mosquitto_int_option(raw, MOSQ_OPT_RECEIVE_MAXIMUM, window), operation)
        try Mosquitto.check(mosquitto_int_option(raw, MOSQ_OPT_TCP_NODELAY, 1), operation)

        if let credentials = config.credentials {
            var password: String?
            switch credentials.password {
            case .none: password = nil
            case .literal(let text): password = text
            case .file(let path): password = try readSecret(path: path)
            }
            try Mosquitto.check(
                mosquitto_username_pw_set(raw, credentials.username, password), "\(operation): username/password")
        }

        if config.broker.usesTLS {
            let tls = config.tls ?? MQTTTLSConfiguration()
            let caDirectory = tls.caFile == nil && tls.caDirectory == nil ? "/etc/ssl/certs" : tls.caDirectory
            let rc = mosquitto_tls_set(raw, tls.caFile, caDirectory, tls.certificateFile, tls.privateKeyFile, nil)
            guard rc == Mosquitto.success else {
                let files = [tls.caFile, caDirectory, tls.certificateFile, tls.privateKeyFile].compactMap { $0 }
                throw Mosquitto.error(
                    rc, "\(operation): TLS", extra: "check that these exist and are readable: \(files)")
            }
            try Mosquitto.check(mosquitto_tls_insecure_set(raw, !tls.verifyHostname), "\(operation): TLS")
        }

        if let will = config.will {
            let willOperation = "\(operation): will on \(will.topic)"
            let rc: Int32
            if isV5 && !will.properties.isEmpty {
                let properties = try MosquittoProperties.publish(will.properties, willOperation)
                rc = will.payload.withUnsafeBytes { bytes in
                    mosquitto_will_set_v5(
                        raw, will.topic, Int32(bytes.count), bytes.baseAddress, Int32(will.qos.rawValue),
                        will.retain, properties.list)
                }
                if rc == Mosquitto.success { properties.release() }  // libmosquitto owns the list now
            } else {
                rc = will.payload.withUnsafeBytes { bytes in
                    mosquitto_will_set(
                        raw, will.topic, Int32(bytes.count), bytes.baseAddress, Int32(will.qos.rawValue), will.retain)
                }
            }
            try Mosquitto.check(rc, willOperation)
        }

        let connectProperties = MosquittoProperties()
        if isV5 {
            // The broker must not send us larger packets (MQTT 5 section 3.1.2.11.4); mosquitto drops such messages.
            try connectProperties.add(
                int32: MQTT_PROP_MAXIMUM_PACKET_SIZE, UInt32(config.maximumIncomingPacketSize), operation)
        }
        if isV5 && !config.cleanSession {
            let seconds = UInt32(clamping: config.sessionExpiry.components.seconds)
            try connectProperties.add(int32: MQTT_PROP_SESSION_EXPIRY_INTERVAL, seconds, operation)
        }
        return connectProperties
    }

    private func readSecret(path: String) throws(MQTTError) -> String {
        let operation = "read MQTT password file \(path)"
        let file = fopen(path, "r")
        guard let file else {
            throw MQTTError(.invalidConfiguration, operation: operation, detail: String(cString: strerror(errno)))
        }
        defer { fclose(file) }
        var bytes: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 4096)
        while true {
            let count = buffer.withUnsafeMutableBytes { fread($0.baseAddress, 1, $0.count, file) }
            if count > 0 { bytes.append(contentsOf: buffer[0..<count]) }
            if count < buffer.count { break }
            if bytes.count > 65_535 {
                throw MQTTError(.invalidConfiguration, operation: operation, detail: "longer than 65535 bytes")
            }
        }
        if bytes.last == UInt8(ascii: "\n") { bytes.removeLast() }
        if bytes.last == UInt8(ascii: "\r") { bytes.removeLast() }
        guard let text = String(validating: bytes, as: UTF8.self) else {
            throw MQTTError(.invalidConfiguration, operation: operation, detail: "not valid UTF-8")
        }
        return text
    }

    // MARK: The loop thread

    private func runLoop(connectProperties: MosquittoProperties) {
        clinux_name_thread("mqtt")
        loopThread.withLock { $0 = pthread_self() }
        let raw = handle.raw
        let config = configuration
        let keepAlive = Int32(config.keepAlive.components.seconds)
        var isFirst = true
        while !stopping {
            let attempt = state.withLock { state in
                state.attempt += 1
                state.refusal = nil
                state.connection = .connecting(attempt: state.attempt)
                return state.attempt
            }
            states.yield(.connecting(attempt: attempt))
            lastLog.withLock { $0 = nil }
            var rc: Int32
            if isFirst {
                rc = mosquitto_connect_bind_v5(
                    raw, config.broker.host, Int32(config.broker.port), keepAlive, nil,
                    isV5 ? connectProperties.list : nil)
                isFirst = false
            } else {
                rc = mosquitto_reconnect(raw)
            }
            if rc == Mosquitto.success {
                if writesFromCaller {
                    rc = serviceConnection(raw)
                } else {
                    repeat {
                        rc = loopOnce(raw, timeout: 1000)
                    } while rc == Mosquitto.success && !stopping
                }
            }
            if stopping { break }
            let extra = lastLog.withLock { $0 }
            let error = state.withLock { state in
                state.connected = false
                return state.refusal
                    ?? Mosquitto.error(rc, "connection to MQTT broker \(brokerName)", extra: extra)
            }
            firstOutcome.complete(.failure(error))
            let delay = config.reconnect.delay(forAttempt: attempt)
            let waiting = MQTTConnectionState.waitingToReconnect(retryIn: delay, attempt: attempt, error: error)
            state.withLock { $0.connection = waiting }
            states.yield(waiting)
            if stopping { break }
            let nanoseconds = delay.components.seconds * 1_000_000_000 + delay.components.attoseconds / 1_000_000_000
            _ = wakeup.wait(timeout: .now() + .nanoseconds(Int(nanoseconds)))
        }
        // The acknowledgements of what is in flight first (see `requestStop`), for at most a second.
        let ackDeadline = ContinuousClock.now + .seconds(1)
        while mosquitto_socket(raw) >= 0 && state.withLock({ $0.inflight }) > 0 && ContinuousClock.now < ackDeadline {
            if loopOnce(raw, timeout: 50) != Mosquitto.success { break }
        }
        // Queue a DISCONNECT and let it go out; the library closes the socket once it is written. Bounded, in case
        // the broker stopped reading. Without it the broker would see an unclean close and publish the will.
        if mosquitto_disconnect(raw) == Mosquitto.success || mosquitto_socket(raw) >= 0 {
            var flushes = 0
            while mosquitto_socket(raw) >= 0 && flushes < 20 {
                if loopOnce(raw, timeout: 100) != Mosquitto.success { break }
                flushes += 1
            }
        }
        finishEverything()
    }

    /// Serves one connection over plain TCP until it ends or the client stops: reads what the broker sends, writes
    /// what libmosquitto queued itself (acknowledgements, pings, CONNECT) or what a caller could not write, and runs
    /// libmosquitto's timers. Returns libmosquitto's reason for the end.
    private func serviceConnection(_ raw: OpaquePointer) -> Int32 {
        callerWriteFailure.store(0, ordering: .relaxed)
        buffers.attach(mosquitto_socket(raw))
        defer { buffers.detach() }
        var lastWake: UInt64 = 0
        // Under load (readable again within two gathering intervals), what the broker sends comes in a stream:
        // chiefly one PUBACK per QoS 1 publish. The loop then waits out a gathering interval after a read and
        // before its next poll, so that one read (one recv(2), with the read buffer) takes every acknowledgement
        // of that interval, and the poll finds them there without blocking: one wake-up per interval. (Waiting
        // after the poll had woken the thread cost a second wake-up, and a fifth of the thread's CPU, bench/bridge.sh
        // passive.) At low rates, and for the first packet after a quiet spell, nothing waits. It adds at most that
        // interval to an incoming command's way under load; the in-flight window covers the acknowledgements held
        // back, so outgoing messages do not wait for it.
        var gather = false
        while !stopping {
            // With half the window in flight, acknowledgements are read at once: held back, they would hold back
            // publishes (a broker's Receive Maximum can be as small as mosquitto's default of 20).
            if gather && state.withLock({ $0.inflight }) * 2 < window {
                clinux_sleep_ns(CUnsignedLongLong(ClientCore.readGatherNanoseconds))
            }
            gather = false
            let socket = mosquitto_socket(raw)
            guard socket >= 0 else {
                let failure = callerWriteFailure.exchange(0, ordering: .relaxed)
                return failure != 0 ? failure : MOSQ_ERR_NO_CONN.rawValue
            }
            // Held bytes are not waited for: they leave when the holder releases them.
            let wantsWrite = mosquitto_want_write(raw) || buffers.hasWaitingWrites
            var fd = pollfd(fd: socket, events: Int16(POLLIN) | (wantsWrite ? Int16(POLLOUT) : 0), revents: 0)
            // Bytes already in the read buffer are as good as a readable socket: no waiting for more.
            let buffered = buffers.hasBufferedBytes
            let n = poll(&fd, 1, buffered ? 0 : ClientCore.ownLoopPoll)
            if n < 0 {
                if errno == EINTR { continue }
                return MOSQ_ERR_ERRNO.rawValue
            }
            if buffered { fd.revents |= Int16(POLLIN) }
            if fd.revents != 0 && mosquitto_socket(raw) >= 0 {
                let wake = UInt64(clinux_monotonic_ns())
                gather = wake &- lastWake < 2 * ClientCore.readGatherNanoseconds
                lastWake = wake
                // Read everything that came, not one packet per wake-up (which under load, with the wait above,
                // caps acknowledgements at about 1,000/s and fills the in-flight window). libmosquitto stops a call
                // when errno is EAGAIN after any packet, also a stale one (the previous call's last read; the
                // callbacks keep errno as they found it), and reads at most as many packets as QoS 1/2 messages are
                // outstanding, one when none are (a subscriber); so errno is cleared and the call repeated while the
                // socket stays readable.
                var reads = 0
                repeat {
                    errno = 0
                    let rc = mosquitto_loop_read(raw, 1)
                    if rc != Mosquitto.success { return rc }
                    reads += 1
                } while reads < ClientCore.readsPerWake
                    && (buffers.hasBufferedBytes || Self.isReadable(mosquitto_socket(raw)))
            }
            // What a released hold could not send (the socket was full) goes before anything libmosquitto writes.
            if fd.revents & Int16(POLLOUT) != 0 { _ = buffers.flush() }
            if mosquitto_socket(raw) >= 0 && mosquitto_want_write(raw) {
                let rc = mosquitto_loop_write(raw, 1)
                if rc != Mosquitto.success { return rc }
                // The loop's own writes (acknowledgements, pings, publishes the window let go) never wait for
                // another thread's hold to end (`sendHeldForTheWindow`).
                buffers.sendHeld()
            }
            if mosquitto_socket(raw) >= 0 {
                let rc = mosquitto_loop_misc(raw)
                if rc != Mosquitto.success { return rc }
            }
        }
        return Mosquitto.success
    }

    /// One turn of libmosquitto's `mosquitto_loop` (lib/loop.c), with poll(2) where it uses select(2): select
    /// cannot watch a descriptor numbered 1,024 or more, and mosquitto_loop then fails with MOSQ_ERR_INVAL ("Invalid
    /// function arguments provided"), which a process holding many descriptors (a test run, a bridge with many
    /// devices) reaches. Waits up to `timeout` ms for the broker socket (readable, or writable when libmosquitto has
    /// something to write) or the wake-up pair (a packet queued by another thread); reads (which also carries on a
    /// TLS handshake, and so runs on any event, as libmosquitto's "always try to read" does), writes, and runs the
    /// timers. Used under TLS, and for the last flush of any connection.
    private func loopOnce(_ raw: OpaquePointer, timeout: Int32) -> Int32 {
        let socket = mosquitto_socket(raw)
        guard socket >= 0 else { return MOSQ_ERR_NO_CONN.rawValue }
        let wake = handle.wakeUpRead
        // A tuple, not an array: nothing allocated per turn (the layout is that of `struct pollfd[2]`).
        var fds = (
            pollfd(fd: socket, events: Int16(POLLIN) | (mosquitto_want_write(raw) ? Int16(POLLOUT) : 0), revents: 0),
            pollfd(fd: wake, events: Int16(POLLIN), revents: 0)
        )
        let n = withUnsafeMutableBytes(of: &fds) {
            poll($0.baseAddress!.assumingMemoryBound(to: pollfd.self), wake >= 0 ? 2 : 1, timeout)
        }
        if n < 0 { return errno == EINTR ? Mosquitto.success : MOSQ_ERR_ERRNO.rawValue }
        var write = fds.0.revents & Int16(POLLOUT) != 0
        if fds.0.revents != 0 {
            let rc = mosquitto_loop_read(raw, 1)
            if rc != Mosquitto.success || mosquitto_socket(raw) < 0 { return rc }
        }
        if wake >= 0 && fds.1.revents != 0 {
            var bytes: UInt64 = 0
            _ = read(wake, &bytes, MemoryLayout<UInt64>.size)
            // Something was queued after the poll began: try to write it now.
            write = true
        }
        if write && mosquitto_socket(raw) >= 0 && mosquitto_want_write(raw) {
            let rc = mosquitto_loop_write(raw, 1)
            if rc != Mosquitto.success || mosquitto_socket(raw) < 0 { return rc }
        }
        return mosquitto_loop_misc(raw)
    }

    /// Holds (`true`) or sends (`false`) what is written to the broker socket: while held, the packets written are
    /// kept in the socket's write buffer (up to 16 KiB) and leave together in one write(2) when released, in order
    /// with everything else written to the socket; earlier when the in-flight window fills or the loop thread writes
    /// (`sendHeldForTheWindow`). Plain TCP only.
    func holdWrites(_ on: Bool) {
        guard writesFromCaller else { return }
        guard on else {
            buffers.release()
            return
        }
        // No hold once a stop was asked for (see `requestStop`); one taken while it was being asked for is let go.
        if stopRequested.load(ordering: .sequentiallyConsistent) { return }
        buffers.hold()
        if stopRequested.load(ordering: .sequentiallyConsistent) { buffers.release() }
    }

    /// How long the plain-TCP loop waits in poll (ms): what nothing else wakes it for (a stop, a write from
    /// another thread that found the connection broken) waits at most this long. It has no wake-up descriptor (the
    /// process may hold more than select's 1,024, and libmosquitto's TLS loop uses select). 250 ms: at 50 ms its
    /// twenty wake-ups a second were a third of the thread's CPU with 500 advertisers (3.7-4.0 against 2.4 µs per
    /// advertisement, bench/bridge.sh passive, 2026-12-05) and a fifth of the bridge's idle CPU (0.25 against 0.20 %
    /// of a core); keepalive pings (`mosquitto_loop_misc`) need a call only every few seconds.
    static let ownLoopPoll: Int32 = 250

    /// How long the plain-TCP loop lets what the broker sends gather between reads, under load (see
    /// `serviceConnection`). 8 ms: at 5,000 QoS 1 publishes a second, 125 wake-ups instead of 1,000 (1 ms). 4 ms
    /// was measured with bench/bridge.sh on 2026-12-04, together with the notify reader's 2 ms rounds and the read
    /// buffer: 29-35 -> 17-25 µs per notification; 8 ms on 2026-12-06 (with 2.5 ms rounds): the thread's CPU 1.24-1.75
    /// against 1.63-1.97 µs per notification at 100 × 50 Hz. The in-flight window bounds what waits: with half of
    /// it in flight the acknowledgements are read at once (100 by default: 10 ms of 5,000 a second).
    static let readGatherNanoseconds: UInt64 = 8_000_000

    /// At most this many `mosquitto_loop_read` calls per wake-up, so writes and timers are served in between.
    static let readsPerWake = 256

    /// True when `socket` has something to read now.
    private static func isReadable(_ socket: Int32) -> Bool {
        guard socket >= 0 else { return false }
        var fd = pollfd(fd: socket, events: Int16(POLLIN), revents: 0)
        return poll(&fd, 1, 0) > 0 && fd.revents & Int16(POLLIN) != 0
    }

    /// After handing libmosquitto a packet: on plain TCP, writes it out from this thread (no loop wake-up per
    /// message); on the loop thread itself, or under TLS, the loop writes it.
    private func writeOut() {
        guard writesFromCaller else { return }
        if let loop = loopThread.withLock({ $0 }), pthread_equal(loop, pthread_self()) != 0 { return }
        let rc = mosquitto_loop_write(handle.raw, 1)
        if rc != Mosquitto.success {
            // libmosquitto closed the socket and reported the disconnection; the loop thread reconnects.
            callerWriteFailure.store(rc, ordering: .relaxed)
        }
    }

    /// Fails everything still waiting, ends every stream, and marks the loop finished.
    private func finishEverything() {
        let operation = "MQTT client for \(brokerName)"
        let shutDown = MQTTError(.shutDown, operation: operation, detail: "the client was shut down")
        let (queued, acks, subscribes, unsubscribes) = state.withLock { state in
            state.lifecycle = .stopped
            state.connected = false
            state.connection = .stopped
            state.statistics.queued = 0
            let queued = state.queue.removeAll()
            let acks = state.publishWaiters.values.compactMap(\.completion)
            let subscribes = state.subscribeRequests.values.compactMap(\.completion)
            let unsubscribes = Array(state.unsubscribeWaiters.values)
            state.publishWaiters = [:]
            state.subscribeRequests = [:]
            state.unsubscribeWaiters = [:]
            state.inflight = 0
            return (queued, acks, subscribes, unsubscribes)
        }
        for item in queued { item.completion?.complete(.failure(shutDown)) }
        for ack in acks { ack.complete(.failure(shutDown)) }
        for subscribe in subscribes { subscribe.complete(.failure(shutDown)) }
        for unsubscribe in unsubscribes { unsubscribe.complete(.failure(shutDown)) }
        firstOutcome.complete(.failure(shutDown))
        states.yield(.stopped)
        states.finish()
        incoming.finish()
        finished.complete(.success(()))
    }

    // MARK: Publishing

    /// Sends or queues `message`; `completion` (nil when nobody waits) ends when it is acknowledged (QoS 1/2) or
    /// handed to libmosquitto (QoS 0), or fails.
    func send(_ message: MQTTOutgoingMessage, completion: Completion<Void>?) throws(MQTTError) {
        // Built only for an error: this is the path of every publish.
        func operation() -> String { Self.publishOperation(message.topic) }
        try MQTTTopic.validateName(message.topic)
        guard message.payload.count <= 268_435_455 else {
            throw Mosquitto.error(MOSQ_ERR_PAYLOAD_SIZE.rawValue, operation(), extra: "\(message.payload.count) bytes")
        }
        if !isV5 && !message.properties.isEmpty {
            throw MQTTError(.invalidConfiguration, operation: operation(), detail: "properties need MQTT 5")
        }
        let item = QueuedPublish(message: message, completion: completion)
        enum Decision {
            case sendNow
            case queued(dropped: QueuedPublish?)
            case rejected
        }
        let capacity = configuration.offlineQueueCapacity
        let decision = state.withLock { state -> Decision in
            guard state.lifecycle == .idle || state.lifecycle == .running else { return .rejected }
            if state.connected && !state.draining && state.queue.isEmpty
                && (message.qos == .atMostOnce || state.inflight < window)
            {
                if message.qos != .atMostOnce { state.inflight += 1 }
                return .sendNow
            }
            var dropped: QueuedPublish?
            if state.queue.count >= capacity {
                if let oldest = state.queue.removeOldestQoS0() {
                    dropped = oldest
                    state.statistics.droppedQoS0 += 1
                } else {
                    dropped = state.queue.removeFirst()
                    state.statistics.droppedQoS1Or2 += 1
                }
            }
            state.queue.append(item)
            state.statistics.queued = state.queue.count
            return .queued(dropped: dropped)
        }
        switch decision {
        case .rejected:
            throw MQTTError(.shutDown, operation: operation(), detail: "the client was shut down")
        case .sendNow:
            switch transmit(item) {
            case .sent:
                break
            case .notConnected:
                requeue([item])
            case .failed(let error):
                throw error
            }
        case .queued(let dropped):
            if let dropped {
                dropped.completion?.complete(
                    .failure(
                        MQTTError(
                            .dropped, operation: Self.publishOperation(dropped.message.topic),
                            detail: "dropped from the full offline queue (capacity \(capacity))")))
            }
            drainIfNeeded()
        }
    }

    /// What a publish's errors name as the operation.
    private static func publishOperation(_ topic: String) -> String { "publish to \(topic)" }

    private enum TransmitOutcome {
        case sent
        case notConnected
        case failed(MQTTError)
    }

    /// Hands one message to libmosquitto. Its in-flight slot (QoS 1/2) was taken by the caller; it is given back
    /// here when the message did not go out.
    private func transmit(_ item: QueuedPublish) -> TransmitOutcome {
        let message = item.message
        // libmosquitto 2.0.11 aborts the process (an assert in its logging) when asked to publish a packet over the
        // broker's maximum, so such packets never reach it: the check here is exact and stricter than its own.
        let maximum = maximumPacketSize.load(ordering: .relaxed)
        if maximum > 0 {
            let size = message.packetSize(isV5: isV5)
            if size > Int(maximum) {
                releaseSlot(message.qos)
                let error = Mosquitto.error(
                    MOSQ_ERR_OVERSIZE_PACKET.rawValue, Self.publishOperation(message.topic),
                    extra: "a \(size)-byte packet; the broker accepts at most \(maximum) bytes")
                item.completion?.complete(.failure(error))
                return .failed(error)
            }
        }
        var mid: Int32 = 0
        var rc: Int32
        var properties: MosquittoProperties?
        if isV5 && !message.properties.isEmpty {
            do {
                properties = try MosquittoProperties.publish(message.properties, Self.publishOperation(message.topic))
            } catch {
                releaseSlot(message.qos)
                item.completion?.complete(.failure(error))
                return .failed(error)
            }
        }
        // For QoS 1/2, MOSQ_ERR_NO_CONN means libmosquitto found its socket closed (the connection was lost a moment
        // ago, its disconnect callback has not run yet) but kept the message, and resends it under this mid after
        // reconnecting: it is in flight like any other, and queueing it again would send it twice.
        let keptByLibrary = { (rc: Int32) in
            rc == Mosquitto.success || (rc == MOSQ_ERR_NO_CONN.rawValue && message.qos != .atMostOnce)
        }
        rc = handoff.withLock { _ in
            // withCString: a native string's own bytes; passing the String for the pointer copies it into an array.
            let rc = message.topic.withCString { topic in
                message.payload.withUnsafeBytes { bytes in
                    mosquitto_publish_v5(
                        handle.raw, &mid, topic, Int32(bytes.count), bytes.baseAddress,
                        Int32(message.qos.rawValue), message.retain, properties?.list)
                }
            }
            if keptByLibrary(rc) { register(mid: mid, item: item) }
            return rc
        }
        withExtendedLifetime(properties) {}
        if rc == Mosquitto.success { writeOut() }
        if keptByLibrary(rc) {
            if message.qos == .atMostOnce { item.completion?.complete(.success(())) }
            return .sent
        }
        releaseSlot(message.qos)
        if rc == MOSQ_ERR_NO_CONN.rawValue { return .notConnected }
        let error = Mosquitto.error(
            rc, Self.publishOperation(message.topic), extra: "\(message.payload.count) bytes payload")
        item.completion?.complete(.failure(error))
        return .failed(error)
    }

    private func releaseSlot(_ qos: MQTTQoS) {
        guard qos != .atMostOnce else { return }
        state.withLock { $0.inflight -= 1 }
    }

    /// Records the mid of a message libmosquitto accepted (called under `handoff`, so its acknowledgement cannot
    /// be looked up before this). QoS 0 messages get no waiter: their "sent" notifications are ignored.
    private func register(mid: Int32, item: QueuedPublish) {
        let qos = item.message.qos
        state.withLock { state in
            state.statistics.published += 1
            if qos == .atMostOnce {
                state.ignoredAcks.insert(mid)
            } else {
                state.publishWaiters[mid] = CoreState.PendingAck(
                    completion: item.completion, topic: item.message.topic)
            }
        }
    }

    private func publishResult(_ reason: Int32, topic: String) -> Result<Void, MQTTError> {
        guard reason >= 0x80 else { return .success(()) }
        let code = MQTTReasonCode(rawValue: UInt8(truncatingIfNeeded: reason))
        return .failure(
            MQTTError(.rejected(code), operation: Self.publishOperation(topic), detail: "the broker answered \(code)"))
    }

    private func requeue(_ items: [QueuedPublish]) {
        state.withLock { state in
            state.queue.prepend(items)
            state.statistics.queued = state.queue.count
        }
    }

    /// A hold (`holdWrites`) never keeps the in-flight window full: the messages in flight that it holds back are
    /// sent at once when a publish must wait for the window, or nothing would free it before the holder's release
    /// (with mosquitto's default Receive Maximum of 20 and the bridge's 50 ms holds, 500 advertisements a second
    /// queued without end: about 400 left a second). The hold goes on for what is written next. What the loop
    /// thread writes (the publishes that acknowledgements let go) is sent at once likewise (`serviceConnection`).
    private func sendHeldForTheWindow() {
        guard writesFromCaller else { return }
        buffers.sendHeld()
    }

    /// Hands queued messages to libmosquitto, in order, while connected and the window allows. One thread drains
    /// at a time (`draining`); new publishes queue behind it so nothing overtakes. When the window stops it (a
    /// publish waits for an acknowledgement), what a hold keeps is sent (`sendHeldForTheWindow`).
    func drainIfNeeded() {
        let window = self.window
        var windowFull = false
        defer { if windowFull { sendHeldForTheWindow() } }
        let start = state.withLock { state -> Bool in
            guard state.connected, !state.draining, let head = state.queue.peek() else { return false }
            guard head.message.qos == .atMostOnce || state.inflight < window else {
                windowFull = true
                return false
            }
            state.draining = true
            return true
        }
        guard start else { return }
        while true {
            let batch = state.withLock { state -> [QueuedPublish] in
                guard state.connected else {
                    state.draining = false
                    return []
                }
                var items: [QueuedPublish] = []
                while items.count < 256, let head = state.queue.peek(),
                    head.message.qos == .atMostOnce || state.inflight < window
                {
                    _ = state.queue.removeFirst()
                    if head.message.qos != .atMostOnce { state.inflight += 1 }
                    items.append(head)
                }
                if items.isEmpty { state.draining = false }
                if !state.queue.isEmpty && state.inflight >= window { windowFull = true }
                state.statistics.queued = state.queue.count
                return items
            }
            if batch.isEmpty { return }
            for (index, item) in batch.enumerated() {
                if case .notConnected = transmit(item) {
                    let rest = Array(batch[(index + 1)...])
                    state.withLock { state in
                        for later in rest where later.message.qos != .atMostOnce { state.inflight -= 1 }
                        state.queue.prepend([item] + rest)
                        state.statistics.queued = state.queue.count
                        state.draining = false
                    }
                    return
                }
            }
        }
    }

    // MARK: Subscriptions

    func subscribe(filter: String, qos: MQTTQoS) async throws(MQTTError) -> MQTTQoS {
        let operation = "subscribe to \(filter)"
        try MQTTTopic.validateFilter(filter)
        let (running, connected) = state.withLock { state in
            state.pendingUnsubscribes.removeAll { $0 == filter }
            if state.subscriptions[filter] == nil { state.subscriptionOrder.append(filter) }
            state.subscriptions[filter] = CoreState.Subscription(qos: qos, active: false)
            return (state.lifecycle == .idle || state.lifecycle == .running, state.connected)
        }
        guard running else { throw MQTTError(.shutDown, operation: operation, detail: "the client was shut down") }
        // Not connected: the subscription is made when the connection comes up.
        guard connected else { return qos }
        let completion = Completion<MQTTQoS>()
        switch sendSubscribe(filter: filter, qos: qos, completion: completion) {
        case .sent: return try await completion.value(operation: operation)
        case .notConnected: return qos
        case .failed(let error): throw error
        }
    }

    private func sendSubscribe(filter: String, qos: MQTTQoS, completion: Completion<MQTTQoS>?) -> TransmitOutcome {
        let rc = handoff.withLock { _ in
            var mid: Int32 = 0
            let rc = mosquitto_subscribe_v5(handle.raw, &mid, filter, Int32(qos.rawValue), 0, nil)
            if rc == Mosquitto.success {
                state.withLock { state in
                    state.subscribeRequests[mid] = CoreState.SubscribeRequest(
                        filter: filter, qos: qos, completion: completion)
                }
            }
            return rc
        }
        if rc == Mosquitto.success { writeOut() }
        if rc == MOSQ_ERR_NO_CONN.rawValue { return .notConnected }
        guard rc == Mosquitto.success else {
            let error = Mosquitto.error(rc, "subscribe to \(filter)")
            completion?.complete(.failure(error))
            return .failed(error)
        }
        return .sent
    }

    private func finishSubscribe(filter: String, granted: Int32, completion: Completion<MQTTQoS>?) {
        let qos = granted < 0x80 ? MQTTQoS(rawValue: Int(granted)) : nil
        state.withLock { state in
            if qos != nil, state.subscriptions[filter] != nil { state.subscriptions[filter]?.active = true }
        }
        if let qos {
            completion?.complete(.success(qos))
        } else {
            let code = MQTTReasonCode(rawValue: UInt8(truncatingIfNeeded: granted))
            completion?.complete(
                .failure(
                    MQTTError(
                        .rejected(code), operation: "subscribe to \(filter)", detail: "the broker answered \(code)")
                ))
        }
    }

    func unsubscribe(filter: String) async throws(MQTTError) {
        let operation = "unsubscribe from \(filter)"
        try MQTTTopic.validateFilter(filter)
        let connected = state.withLock { state in
            state.subscriptions[filter] = nil
            state.subscriptionOrder.removeAll { $0 == filter }
            if !state.connected && !state.pendingUnsubscribes.contains(filter) {
                state.pendingUnsubscribes.append(filter)
            }
            return state.connected
        }
        guard connected else { return }
        let completion = Completion<Void>()
        let rc = sendUnsubscribe(filter: filter, completion: completion)
        if rc == MOSQ_ERR_NO_CONN.rawValue { return }
        try Mosquitto.check(rc, operation)
        try await completion.value(operation: operation)
    }

    /// Sends UNSUBSCRIBE and records `completion` as its waiter; returns libmosquitto's result.
    private func sendUnsubscribe(filter: String, completion: Completion<Void>) -> Int32 {
        let rc = handoff.withLock { _ in
            var mid: Int32 = 0
            let rc = mosquitto_unsubscribe_v5(handle.raw, &mid, filter, nil)
            if rc == Mosquitto.success { state.withLock { $0.unsubscribeWaiters[mid] = completion } }
            return rc
        }
        if rc == Mosquitto.success { writeOut() }
        return rc
    }

    // MARK: Callbacks (loop thread)

    private func installCallbacks() {
        let raw = handle.raw
        mosquitto_connect_v5_callback_set(raw) { _, context, rc, flags, properties in
            guard let context else { return }
            Unmanaged<ClientCore>.fromOpaque(context).takeUnretainedValue()
                .onConnect(rc: rc, flags: flags, properties: properties)
        }
        mosquitto_disconnect_v5_callback_set(raw) { _, context, rc, properties in
            guard let context else { return }
            Unmanaged<ClientCore>.fromOpaque(context).takeUnretainedValue().onDisconnect(rc: rc, properties: properties)
        }
        mosquitto_publish_v5_callback_set(raw) { _, context, mid, reason, _ in
            guard let context else { return }
            // errno is libmosquitto's again once this returns: what runs here (a contended lock's futex, a
            // drain's write) can leave an EAGAIN that would end its read loop (see serviceConnection).
            let saved = errno
            defer { errno = saved }
            Unmanaged<ClientCore>.fromOpaque(context).takeUnretainedValue().onPublish(mid: mid, reason: reason)
        }
        mosquitto_subscribe_v5_callback_set(raw) { _, context, mid, count, granted, _ in
            guard let context else { return }
            let first: Int32 = (count > 0 ? granted?.pointee : nil) ?? 0x80
            Unmanaged<ClientCore>.fromOpaque(context).takeUnretainedValue().onSubscribe(mid: mid, granted: first)
        }
        mosquitto_unsubscribe_v5_callback_set(raw) { _, context, mid, _ in
            guard let context else { return }
            Unmanaged<ClientCore>.fromOpaque(context).takeUnretainedValue().onUnsubscribe(mid: mid)
        }
        mosquitto_message_v5_callback_set(raw) { _, context, message, properties in
            guard let context, let message else { return }
            let saved = errno  // as in the publish callback
            defer { errno = saved }
            Unmanaged<ClientCore>.fromOpaque(context).takeUnretainedValue()
                .onMessage(message.pointee, properties: properties)
        }
        setLogging(true)
    }

    /// The log callback is only needed to explain failed connections (OpenSSL's reasons appear nowhere else). It is
    /// off while connected: with a callback set, libmosquitto formats a debug line for every packet (measured: about
    /// 3 % of the client's CPU time in the QoS 1 benchmark).
    private func setLogging(_ on: Bool) {
        guard on else {
            mosquitto_log_callback_set(handle.raw, nil)
            return
        }
        mosquitto_log_callback_set(handle.raw) { _, context, level, text in
            guard let context, let text, level & Int32(MOSQ_LOG_ERR | MOSQ_LOG_WARNING) != 0 else { return }
            let line = String(cString: text)
            Unmanaged<ClientCore>.fromOpaque(context).takeUnretainedValue().lastLog.withLock { $0 = line }
        }
    }

    private func onConnect(rc: Int32, flags: Int32, properties: OpaquePointer?) {
        guard rc == 0 else {
            let code = MQTTReasonCode(rawValue: UInt8(truncatingIfNeeded: rc))
            var detail = isV5 ? Mosquitto.reasonString(rc) : Mosquitto.connackString(rc)
            if let reason = MosquittoProperties.string(properties, MQTT_PROP_REASON_STRING) {
                detail += " (\(reason))"
            }
            let error = MQTTError(
                .connectionRefused(code), operation: "connect to MQTT broker \(brokerName)", detail: detail)
            state.withLock { $0.refusal = error }
            return
        }
        let sessionPresent = flags & 1 != 0
        var maximum: UInt32 = 0
        if properties != nil {
            _ = mosquitto_property_read_int32(
                properties, Int32(MQTT_PROP_MAXIMUM_PACKET_SIZE.rawValue), &maximum, false)
        }
        maximumPacketSize.store(maximum, ordering: .relaxed)
        var receiveMaximum: UInt16 = 0
        if properties != nil {
            _ = mosquitto_property_read_int16(
                properties, Int32(MQTT_PROP_RECEIVE_MAXIMUM.rawValue), &receiveMaximum, false)
        }
        brokerReceiveMaximum.store(receiveMaximum > 0 ? Int(receiveMaximum) : 65_535, ordering: .relaxed)
        setLogging(false)
        let (resubscribe, unsubscribe) = state.withLock { state -> ([(String, MQTTQoS)], [String]) in
            defer { state.pendingUnsubscribes = [] }
            state.connected = true
            state.attempt = 0
            state.ignoredAcks.removeAll()
            state.statistics.connections += 1
            state.connection = .connected(sessionPresent: sessionPresent)
            var list: [(String, MQTTQoS)] = []
            for filter in state.subscriptionOrder {
                guard let subscription = state.subscriptions[filter] else { continue }
                if !sessionPresent || !subscription.active { list.append((filter, subscription.qos)) }
            }
            return (list, sessionPresent ? state.pendingUnsubscribes : [])
        }
        for filter in unsubscribe {
            _ = sendUnsubscribe(filter: filter, completion: Completion<Void>())  // nobody waits
        }
        for (filter, qos) in resubscribe {
            _ = sendSubscribe(filter: filter, qos: qos, completion: nil)
        }
        // Said after the subscriptions went out: what a reader of `states` publishes on hearing it follows them on
        // the connection, so the broker has them before anyone can answer it.
        states.yield(.connected(sessionPresent: sessionPresent))
        firstOutcome.complete(.success(()))
        drainIfNeeded()
    }

    private func onDisconnect(rc: Int32, properties: OpaquePointer?) {
        // Subscriptions keep their `active` flag: the next CONNACK's session-present bit decides whether the
        // broker still has them. SUBACKs and UNSUBACKs of the lost connection will never come: the subscription set
        // is already recorded and is restored on reconnect, so those waits end now as if acknowledged.
        // Unacknowledged QoS 1/2 publishes stay: libmosquitto resends them after reconnecting.
        setLogging(true)
        // Under MQTT 5 a broker DISCONNECT carries a reason code (0x80 and up); libmosquitto's own errors are small
        // mosq_err_t values. (libmosquitto 2.0.11 passes NULL properties here, so the reason string shows only with
        // later versions.)
        var brokerReason: MQTTError?
        if isV5 && rc >= 0x80 && rc <= 0xFF {
            let code = MQTTReasonCode(rawValue: UInt8(rc))
            var detail = "the broker disconnected us: \(code)"
            if let reason = MosquittoProperties.string(properties, MQTT_PROP_REASON_STRING) { detail += " (\(reason))" }
            brokerReason = MQTTError(
                .disconnectedByBroker(code), operation: "connection to MQTT broker \(brokerName)", detail: detail)
        }
        let (subscribes, unsubscribes) = state.withLock { state in
            if let brokerReason { state.refusal = brokerReason }
            state.connected = false
            defer {
                state.subscribeRequests = [:]
                state.unsubscribeWaiters = [:]
            }
            return (Array(state.subscribeRequests.values), Array(state.unsubscribeWaiters.values))
        }
        for request in subscribes { request.completion?.complete(.success(request.qos)) }
        for waiter in unsubscribes { waiter.complete(.success(())) }
    }

    /// Test hook: breaks the TCP connection under libmosquitto (no DISCONNECT), as a network failure would.
    func breakConnectionForTesting() {
        let socket = mosquitto_socket(handle.raw)
        if socket >= 0 { _ = shutdown(socket, Int32(SHUT_RDWR)) }
    }

    private func onPublish(mid: Int32, reason: Int32) {
        let waiter = handoff.withLock { _ in
            state.withLock { state -> CoreState.PendingAck? in
                if state.ignoredAcks.remove(mid) != nil { return nil }
                guard let waiter = state.publishWaiters.removeValue(forKey: mid) else { return nil }
                state.inflight -= 1
                state.statistics.acknowledged += 1
                return waiter
            }
        }
        guard let waiter else { return }
        waiter.completion?.complete(publishResult(reason, topic: waiter.topic))
        drainIfNeeded()
    }

    private func onSubscribe(mid: Int32, granted: Int32) {
        let request = handoff.withLock { _ in
            state.withLock { $0.subscribeRequests.removeValue(forKey: mid) }
        }
        guard let request else { return }
        finishSubscribe(filter: request.filter, granted: granted, completion: request.completion)
    }

    private func onUnsubscribe(mid: Int32) {
        let waiter = handoff.withLock { _ in
            state.withLock { $0.unsubscribeWaiters.removeValue(forKey: mid) }
        }
        waiter?.complete(.success(()))
    }

    private func onMessage(_ message: mosquitto_message, properties: OpaquePointer?) {
        guard let topic = message.topic else { return }
        // libmosquitto has read the whole packet by now (it has no incoming limit of its own); this keeps it from
        // going further. Under MQTT 5 the broker knows our maximum and does not send larger packets, so this only
        // matters for MQTT 3.1.1 (and a broker that ignores the maximum). Without the MQTT 5 property block the size
        // is exact; with it, it is a lower bound.
        let size = Self.publishPacketSize(
            topicBytes: strlen(topic), payloadBytes: Int(max(0, message.payloadlen)), qos: message.qos, isV5: isV5)
        guard size <= configuration.maximumIncomingPacketSize else {
            receiveOversizeDropped.add(1, ordering: .relaxed)
            return
        }
        let payload: [UInt8]
        if let bytes = message.payload, message.payloadlen > 0 {
            payload = Array(UnsafeRawBufferPointer(start: bytes, count: Int(message.payloadlen)))
        } else {
            payload = []
        }
        let received = MQTTMessage(
            topic: String(cString: topic), payload: payload,
            qos: MQTTQoS(rawValue: Int(message.qos)) ?? .atMostOnce, retain: message.retain,
            properties: properties == nil ? MQTTPublishProperties() : MosquittoProperties.decodePublish(properties))
        self.received.add(1, ordering: .relaxed)
        let dropped = incoming.yield(received, bytes: received.bufferedSize)
        if dropped > 0 { receiveDropped.add(dropped, ordering: .relaxed) }
    }

    /// The size of a received PUBLISH packet with an empty MQTT 5 property block: fixed header, topic, packet id
    /// (QoS 1/2) and payload.
    static func publishPacketSize(topicBytes: Int, payloadBytes: Int, qos: Int32, isV5: Bool) -> Int {
        let remaining = 2 + topicBytes + (qos > 0 ? 2 : 0) + (isV5 ? 1 : 0) + payloadBytes
        let lengthBytes =
            switch remaining {
            case ..<128: 1
            case ..<16_384: 2
            case ..<2_097_152: 3
            default: 4
            }
        return 1 + lengthBytes + remaining
    }
}
