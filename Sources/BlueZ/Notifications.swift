// Notification sessions: AcquireNotify sockets read by a dispatch source (one datagram per notification), or
// StartNotify with values routed from the mirror's PropertiesChanged(Value).
import DBus
import Dispatch
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Values notified or indicated by one characteristic, in arrival order.
///
/// Ends normally when notifications are stopped, or throws `BlueZError.disconnected` when the connection ends.
/// Stopping iteration (or dropping the sequence) stops the subscription.
public struct BlueZNotifications: AsyncSequence, Sendable {
    /// The element type.
    public typealias Element = [UInt8]
    let base: AsyncThrowingStream<[UInt8], any Error>

    /// Iterates the events in order.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncThrowingStream<[UInt8], any Error>.AsyncIterator
        /// The next element, or nil at the end.
        public mutating func next() async throws -> [UInt8]? { try await base.next() }
    }

    /// Returns an iterator; iterate once.
    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(base: base.makeAsyncIterator()) }
}

final class NotifySession: Sendable {
    let characteristic: BlueZCharacteristic
    weak let peripheral: BlueZPeripheral?
    let label: BlueZDeviceLabel
    let stream: BlueZNotifications
    private let continuation: AsyncThrowingStream<[UInt8], any Error>.Continuation

    private struct State: @unchecked Sendable {
        // DispatchSourceRead is thread-safe; it is only touched under the lock here.
        var source: (any DispatchSourceRead)?
        var startNotify = false
        var ended = false
    }
    private let state = Mutex(State())
    private static let queue = DispatchQueue(label: "blebridge.bluez.notify")

    init(peripheral: BlueZPeripheral, characteristic: BlueZCharacteristic) {
        self.peripheral = peripheral
        self.characteristic = characteristic
        self.label = peripheral.label
        let (stream, continuation) = AsyncThrowingStream<[UInt8], any Error>.makeStream(
            bufferingPolicy: .bufferingNewest(4096))
        self.stream = BlueZNotifications(base: stream)
        self.continuation = continuation
        continuation.onTermination = { [weak self] termination in
            guard let self, case .cancelled = termination else { return }
            Task { await self.stop() }
        }
    }

    deinit {
        state.withLock { $0.source }?.cancel()
    }

    /// A value from PropertiesChanged(Value) (StartNotify mode).
    func deliver(_ value: [UInt8]) {
        let live = state.withLock { $0.startNotify && !$0.ended }
        if live { continuation.yield(value) }
    }

    func markStarted() { state.withLock { $0.startNotify = true } }

    /// Reads the AcquireNotify socket: each readable event drains every queued datagram.
    func startSocket(fd: Int32) {
        let flags = fcntl(fd, F_GETFL)
        if flags >= 0 { _ = fcntl(fd, F_SETFL, flags | O_NONBLOCK) }
        let source = DispatchSource.makeReadSource(fileDescriptor: fd, queue: Self.queue)
        source.setEventHandler { [weak self] in
            guard let self else { return }
            var buffer = [UInt8](repeating: 0, count: 1024)
            while true {
                let n = buffer.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
                if n > 0 {
                    self.continuation.yield(Array(buffer[0..<n]))
                    continue
                }
                if n < 0 {
                    let e = errno
                    if e == EINTR { continue }
                    if e == EAGAIN || e == EWOULDBLOCK { return }
                }
                // EOF or a hard error: BlueZ shut the socket (disconnect, release, or bluetoothd stopped).
                self.socketClosed()
                return
            }
        }
        source.setCancelHandler { close(fd) }
        state.withLock { $0.source = source }
        source.resume()
    }

    private func socketClosed() {
        let source = state.withLock { s -> (any DispatchSourceRead)? in
            defer { s.source = nil }
            return s.source
        }
        source?.cancel()
        Task { [weak self] in
            guard let self else { return }
            // The socket closes just before Connected=false: give the disconnect a moment to be told why.
            var reason = self.peripheral?.disconnection
            if reason == nil, let p = self.peripheral {
                let r = await withTaskGroup(of: BlueZDisconnectReason?.self) { group in
                    group.addTask { await p.waitForDisconnection() }
                    group.addTask {
                        try? await Task.sleep(for: .seconds(1))
                        return nil
                    }
                    let first = await group.next() ?? nil
                    group.cancelAll()
                    return first
                }
                reason = r
            }
            let final =
                reason
                ?? BlueZDisconnectReason(
                    kind: .unknown, message: "bluetoothd closed the notification socket", requested: false)
            self.peripheral?.unregister(self)
            self.end(.disconnected(device: self.label, reason: final))
        }
    }

    /// Ends the stream (once): normally when `error` is nil.
    func end(_ error: BlueZError?) {
        let (first, source) = state.withLock { s -> (Bool, (any DispatchSourceRead)?) in
            let first = !s.ended
            s.ended = true
            defer { s.source = nil }
            return (first, s.source)
        }
        source?.cancel()
        guard first else { return }
        if let error {
            continuation.finish(throwing: error)
        } else {
            continuation.finish()
        }
    }

    /// Stops the subscription: StopNotify (StartNotify mode) or closing the socket (AcquireNotify mode).
    func stop() async {
        let (ended, startNotify) = state.withLock { ($0.ended, $0.startNotify) }
        guard !ended else { return }
        peripheral?.unregister(self)
        if startNotify, let p = peripheral, p.disconnection == nil {
            _ = try? await p.gattCall(
                characteristic.path, interface: BlueZName.characteristic, method: "StopNotify", arguments: [],
                operation: "stop notify \(shortUUID(characteristic.uuid))", timeout: .seconds(5))
        }
        end(nil)
    }
}
