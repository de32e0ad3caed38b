// Notification sessions: AcquireNotify sockets read by a dispatch source (one datagram per notification), or
// StartNotify with values routed from the mirror's PropertiesChanged(Value).
internal import CLinux
import DBus
import Dispatch
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Values notified or indicated by one characteristic, in arrival order.
///
/// Ends normally when notifications are stopped, throws `BlueZError.disconnected` when the connection ends, and
/// `BlueZError.notificationsEnded` when BlueZ ends the subscription while the device stays connected (subscribe
/// again with `BlueZPeripheral.notifications(for:)`). A zero-length notification is an empty element.
/// Stopping iteration (or dropping the sequence) stops the subscription.
public struct BlueZNotifications: AsyncSequence, Sendable {
    /// The element type.
    public typealias Element = [UInt8]
    let base: AsyncThrowingStream<[UInt8], any Error>
    let drops: DropCounter

    /// Values dropped because the consumer fell more than 4096 behind (the oldest went first; logged).
    public var droppedValues: Int { drops.value.load(ordering: .relaxed) }

    /// Iterates the events in order.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncThrowingStream<[UInt8], any Error>.AsyncIterator
        /// The next element, or nil at the end.
        public mutating func next() async throws -> [UInt8]? { try await base.next() }
    }

    /// Returns an iterator; iterate once.
    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(base: base.makeAsyncIterator()) }

    /// The values as a plain stream, to hand on without a task of one's own that relays them (each relay is a
    /// wake-up and a copy per notification). Iterate either this or the sequence itself, once.
    public var stream: AsyncThrowingStream<[UInt8], any Error> { base }
}

/// Counts values a full notification buffer dropped.
final class DropCounter: Sendable {
    let value = Atomic<Int>(0)
}

final class NotifySession: Sendable {
    let characteristic: BlueZCharacteristic
    weak let peripheral: BlueZPeripheral?
    let label: BlueZDeviceLabel
    /// The consumer's end of the stream, until `takeStream()` hands it over: the session must not keep it, or
    /// dropping it would not stop the subscription.
    private let pending: Mutex<BlueZNotifications?>
    private let continuation: AsyncThrowingStream<[UInt8], any Error>.Continuation
    /// Turns the error the stream ends with into the one its consumer expects.
    private let mapError: @Sendable (BlueZError) -> any Error
    /// When set, every value goes to it, on the thread that read it (the notify reader, or the D-Bus I/O thread for
    /// StartNotify), instead of into the stream; the stream then only ends.
    private let consumer: (@Sendable ([UInt8]) -> Void)?
    /// Told once, when the stream ends, what it ends with (nil: it finished): so that a consumer learns of the end
    /// without a task of its own waiting on the stream.
    private let ended: (@Sendable ((any Error)?) -> Void)?

    private struct State: @unchecked Sendable {
        // DispatchSourceRead is thread-safe; it is only touched under the lock here.
        var source: (any DispatchSourceRead)?
        /// The socket, while `NotifySocketReader.shared` reads it.
        var readerFD: Int32?
        var startNotify = false
        /// A `Notifying: true` signal was seen after this session started.
        var confirmed = false
        var ended = false
    }
    private let state = Mutex(State())
    private static let queue = DispatchQueue(label: "blebridge.bluez.notify")

    init(
        peripheral: BlueZPeripheral, characteristic: BlueZCharacteristic,
        mapError: @escaping @Sendable (BlueZError) -> any Error = { $0 },
        consumer: (@Sendable ([UInt8]) -> Void)? = nil,
        ended: (@Sendable ((any Error)?) -> Void)? = nil
    ) {
        self.mapError = mapError
        self.consumer = consumer
        self.ended = ended
        self.peripheral = peripheral
        self.characteristic = characteristic
        self.label = peripheral.label
        let (stream, continuation) = AsyncThrowingStream<[UInt8], any Error>.makeStream(
            bufferingPolicy: .bufferingNewest(4096))
        self.pending = Mutex(BlueZNotifications(base: stream, drops: drops))
        self.continuation = continuation
        continuation.onTermination = { [weak self] termination in
            guard let self, case .cancelled = termination else { return }
            Task { await self.stop() }
        }
    }

    /// The stream, for the subscriber (once).
    func takeStream() -> BlueZNotifications {
        pending.withLock { held in
            defer { held = nil }
            guard let held else { preconditionFailure("NotifySession.takeStream called twice") }
            return held
        }
    }

    deinit {
        let (source, fd) = state.withLock { ($0.source, $0.readerFD) }
        source?.cancel()
        if let fd { NotifySocketReader.shared.remove(fd) }
    }

    /// Stops reading the socket (closing it), whichever way it is read.
    private func stopReading() {
        let (source, fd) = state.withLock { s -> ((any DispatchSourceRead)?, Int32?) in
            defer {
                s.source = nil
                s.readerFD = nil
            }
            return (s.source, s.readerFD)
        }
        source?.cancel()
        if let fd { NotifySocketReader.shared.remove(fd) }
    }

    /// A value from PropertiesChanged(Value) (StartNotify mode).
    func deliver(_ value: [UInt8]) {
        let live = state.withLock { $0.startNotify && !$0.ended }
        if live { yield(value) }
    }

    private let drops = DropCounter()

    /// Queues a value; when the buffer is full the oldest value is dropped, counted, and the first drop of the
    /// stream is logged (a notification is a value, not a state change: there is nothing to resynchronise).
    private func yield(_ value: [UInt8]) {
        if let consumer {
            if !state.withLock({ $0.ended }) { consumer(value) }
            return
        }
        if case .dropped = continuation.yield(value) {
            let n = drops.value.add(1, ordering: .relaxed).newValue
            if n == 1 || n % 10000 == 0 {
                peripheral?.client.logger.warning(
                    "\(label): notifications of \(characteristic.uuid) arrive faster than they are consumed; \(n) "
                        + "dropped so far (the oldest of 4096 queued)")
            }
        }
    }

    func markStarted() { state.withLock { $0.startNotify = true } }

    /// Reads the AcquireNotify socket: each readable event drains every queued datagram.
    ///
    /// On a SOCK_SEQPACKET socket `recv` returns 0 both for a zero-length notification and at end of file. A
    /// socket that is not shut down, or that still holds data behind the empty datagram, was a notification;
    /// only a shut-down socket with nothing queued is the end (an empty notification sent right before the
    /// close cannot be told apart from it and is dropped).
    func startSocket(fd: Int32) {
        let flags = fcntl(fd, F_GETFL)
        if flags >= 0 { _ = fcntl(fd, F_SETFL, flags | O_NONBLOCK) }
        // One buffer for all the sockets the reader thread reads, and one for those read on the serial queue: no two
        // handlers of either kind ever run at once, and each is done with the buffer when it returns (a buffer per
        // socket was 8 KiB per subscription, 0.6 MB of the bridge's heap with a hundred devices).
        let drain: @Sendable () -> Void = { [weak self] in
            guard let self else { return }
            ReadBuffer.reader.drain(fd, self)
        }
        // Recorded first: the reader may run the handler (and find the end of the socket) before add returns.
        state.withLock { $0.readerFD = fd }
        if NotifySocketReader.shared.add(fd, handler: drain) {
            // Ended in between (its stopReading found nothing registered yet): unregister now.
            if state.withLock({ $0.ended }) { NotifySocketReader.shared.remove(fd) }
            return
        }
        state.withLock { $0.readerFD = nil }
        let source = DispatchSource.makeReadSource(fileDescriptor: fd, queue: Self.queue)
        source.setEventHandler { [weak self] in
            guard let self else { return }
            ReadBuffer.queue.drain(fd, self)
        }
        source.setCancelHandler { close(fd) }
        state.withLock { $0.source = source }
        source.resume()
    }

    /// Receive buffers: `batch` datagrams of up to 1,024 bytes each (an ATT value is at most 512), read with one
    /// recvmmsg(2).
    private final class ReadBuffer: @unchecked Sendable {
        /// The buffer of the notify reader thread, only touched by the handlers it runs, one at a time.
        static let reader = ReadBuffer()
        /// The buffer of the sockets read on `NotifySession.queue` (when the reader thread could not take them),
        /// serial.
        static let queue = ReadBuffer()
        static let batch = 8
        static let size = 1024
        let bytes = UnsafeMutableRawPointer.allocate(byteCount: batch * size, alignment: 16)
        let vectors = UnsafeMutablePointer<iovec>.allocate(capacity: batch)
        let headers = UnsafeMutablePointer<clinux_mmsghdr>.allocate(capacity: batch)

        init() {
            // Set once: recvmmsg(2) only writes each entry's msg_len and msg_flags back (no name, no control).
            for i in 0..<Self.batch {
                vectors[i] = iovec(iov_base: bytes + i * Self.size, iov_len: Self.size)
                headers[i] = clinux_mmsghdr()
                headers[i].msg_hdr.msg_iov = vectors + i
                headers[i].msg_hdr.msg_iovlen = 1
            }
        }

        deinit {
            bytes.deallocate()
            vectors.deallocate()
            headers.deallocate()
        }

        /// Reads every queued datagram.
        func drain(_ fd: Int32, _ session: NotifySession) {
            session.drainSocket(fd, self)
        }

        /// Reads up to `batch` queued datagrams without waiting: their count, or -1 with errno set.
        func receive(_ fd: Int32) -> Int {
            return Int(clinux_recvmmsg(fd, headers, UInt32(Self.batch), Int32(MSG_DONTWAIT), nil))
        }

        func length(_ i: Int) -> Int { Int(headers[i].msg_len) }

        func value(_ i: Int) -> [UInt8] {
            [UInt8](UnsafeRawBufferPointer(start: bytes + i * Self.size, count: length(i)))
        }
    }

    /// Reads every queued datagram from `fd` and yields each; on end of file ends the session. One recvmmsg(2)
    /// reads what is queued, up to a batch: fewer than a batch means the queue was empty, so a wake-up with one
    /// notification costs one call (a `recv` loop needed a second, to see EAGAIN).
    private func drainSocket(_ fd: Int32, _ buffer: ReadBuffer) {
        while true {
            let count = buffer.receive(fd)
            if count < 0 {
                let e = errno
                if e == EINTR { continue }
                if e == EAGAIN || e == EWOULDBLOCK { return }
                // A hard error: BlueZ shut the socket (disconnect, release, or bluetoothd stopped).
                self.socketClosed()
                return
            }
            for i in 0..<count {
                if buffer.length(i) > 0 {
                    self.yield(buffer.value(i))
                    continue
                }
                // At end of file every entry of the batch reads as empty; a real empty notification is followed
                // by an open socket, a later non-empty entry, or queued data.
                let dataAfter = (i + 1..<count).contains { buffer.length($0) > 0 }
                if !Self.isShutDown(fd) || dataAfter || Self.bytesQueued(fd) > 0 {
                    self.yield([])
                    continue
                }
                self.socketClosed()
                return
            }
            if count < ReadBuffer.batch { return }
        }
    }

    /// Linux's POLLRDHUP (peer shut down writing); Glibc only declares it under _GNU_SOURCE.
    private static let pollReadHangUp: Int16 = 0x2000

    /// True when the peer closed or shut down its end.
    private static func isShutDown(_ fd: Int32) -> Bool {
        var p = pollfd(fd: fd, events: Int16(POLLIN) | pollReadHangUp, revents: 0)
        guard poll(&p, 1, 0) >= 0 else { return true }
        return p.revents & (Int16(POLLHUP) | pollReadHangUp | Int16(POLLERR)) != 0
    }

    /// Bytes waiting in the socket's receive queue (all datagrams, for SOCK_SEQPACKET).
    private static func bytesQueued(_ fd: Int32) -> Int32 {
        var count: Int32 = 0
        guard ioctl(fd, UInt(FIONREAD), &count) == 0 else { return 0 }
        return count
    }

    private func socketClosed() {
        stopReading()
        // The socket closes just before Connected=false on a disconnect: give the disconnect a moment to be told.
        endUnlessDisconnecting(
            "bluetoothd closed the notification socket while the device stayed connected (another client's "
                + "StopNotify, Service Changed, or the peripheral's own doing)", grace: .seconds(1))
    }

    /// Ends the stream because BlueZ stopped this subscription, unless the connection ends within `grace`: then it
    /// ends with that disconnection (a disconnect, or an adapter going away, also closes sockets and removes
    /// objects, a moment before it is told). The wait is cancellable, so the cap really ends the group.
    func endUnlessDisconnecting(_ reason: String, grace: Duration) {
        Task { [weak self] in
            let peripheral = self?.peripheral
            var ended = peripheral?.disconnection
            if ended == nil, let p = peripheral {
                ended = await withTaskGroup(of: BlueZDisconnectReason?.self) { group in
                    group.addTask { await p.disconnectionUnlessCancelled() }
                    group.addTask {
                        try? await Task.sleep(for: grace)
                        return nil
                    }
                    let first = await group.next() ?? nil
                    group.cancelAll()
                    return first
                }
            }
            guard let self else { return }
            self.peripheral?.unregister(self)
            if let ended {
                self.end(.disconnected(device: self.label, reason: ended))
            } else {
                self.endWhileConnected(reason)
            }
        }
    }

    /// Ends the stream with `notificationsEnded`: BlueZ stopped this subscription while the link stayed up.
    func endWhileConnected(_ reason: String) {
        // Already over (stopped by the consumer, or ended by the disconnection): nothing to report.
        guard !state.withLock({ $0.ended }) else { return }
        peripheral?.unregister(self)
        let uuid = shortUUID(characteristic.uuid)
        peripheral?.client.logger.warning(
            "device \(label): notifications from \(uuid) ended: \(reason)", ["ble.address": label.address])
        end(.notificationsEnded(device: label, characteristic: uuid, reason: reason))
    }

    /// `Notifying` changed in the mirror (StartNotify mode). `false` after our session was confirmed means BlueZ
    /// dropped it; a `false` before that can be a late signal about a session that ended earlier.
    func notifyingChanged(_ notifying: Bool) {
        let ended = state.withLock { s -> Bool in
            guard s.startNotify, !s.ended else { return false }
            if notifying {
                s.confirmed = true
                return false
            }
            return s.confirmed
        }
        if ended { endWhileConnected("BlueZ ended the notify session (Notifying became false)") }
    }

    /// Ends the stream (once): normally when `error` is nil. `tell: false` (a subscription that never started,
    /// whose caller gets the error instead) leaves `ended` uncalled.
    func end(_ error: BlueZError?, tell: Bool = true) {
        let first = state.withLock { s -> Bool in
            let first = !s.ended
            s.ended = true
            return first
        }
        stopReading()
        guard first else { return }
        let mapped = error.map(mapError)
        if let mapped {
            continuation.finish(throwing: mapped)
        } else {
            continuation.finish()
        }
        if tell { ended?(mapped) }
    }

    /// Stops the subscription: StopNotify (StartNotify mode) or closing the socket (AcquireNotify mode).
    func stop() async {
        let (ended, startNotify) = state.withLock { ($0.ended, $0.startNotify) }
        guard !ended else { return }
        peripheral?.unregister(self)
        if startNotify, let p = peripheral, p.disconnection == nil {
            _ = try? await p.gattCall(
                characteristic.path, interface: BlueZName.characteristic, method: "StopNotify", arguments: [],
                operation: "stop notify \(shortUUID(characteristic.uuid))", timeout: .seconds(5), session: true)
        }
        end(nil)
    }
}
