// A fake MQTT broker for what mosquitto cannot be made to do on cue: close the connection at a chosen packet, half
// close it while the client writes, count PUBLISH packets by packet id, withhold acknowledgements.
import Foundation
import Synchronization
import TestSupport

/// One MQTT control packet as read off the wire.
struct WirePacket {
    /// The packet type (the fixed header's high nibble: 1 CONNECT, 3 PUBLISH, 8 SUBSCRIBE, ...).
    let type: UInt8
    /// The fixed header's low nibble.
    let flags: UInt8
    /// The variable header and payload.
    let body: [UInt8]

    /// The protocol level of a CONNECT (4 for 3.1.1, 5 for MQTT 5), nil for other packets.
    var connectProtocolLevel: UInt8? {
        guard type == 1, body.count >= 7 else { return nil }
        let nameLength = Int(body[0]) << 8 | Int(body[1])
        return body.count > 2 + nameLength ? body[2 + nameLength] : nil
    }

    /// A PUBLISH, decoded (`isV5` decides whether a property block follows the packet id).
    struct Publish {
        let topic: String
        let packetID: UInt16?
        let qos: Int
        let duplicate: Bool
        let payload: [UInt8]
    }

    /// The PUBLISH this packet is, or nil.
    func publish(isV5: Bool) -> Publish? {
        guard type == 3, body.count >= 2 else { return nil }
        let qos = Int(flags >> 1) & 3
        var index = 0
        let topicLength = Int(body[0]) << 8 | Int(body[1])
        index = 2 + topicLength
        guard body.count >= index else { return nil }
        let topic = String(decoding: body[2..<index], as: UTF8.self)
        var packetID: UInt16?
        if qos > 0 {
            guard body.count >= index + 2 else { return nil }
            packetID = UInt16(body[index]) << 8 | UInt16(body[index + 1])
            index += 2
        }
        if isV5 {
            var length = 0
            var shift = 0
            while index < body.count {
                let byte = body[index]
                index += 1
                length |= Int(byte & 0x7F) << shift
                shift += 7
                if byte & 0x80 == 0 { break }
            }
            index += length
            guard body.count >= index else { return nil }
        }
        return Publish(
            topic: topic, packetID: packetID, qos: qos, duplicate: flags & 0x08 != 0, payload: Array(body[index...]))
    }

    /// A CONNACK accepting the connection (session not present).
    static func connack(isV5: Bool) -> [UInt8] { isV5 ? [0x20, 0x03, 0x00, 0x00, 0x00] : [0x20, 0x02, 0x00, 0x00] }

    /// A PUBACK for `packetID` (success; MQTT 5 allows leaving the reason code out).
    static func puback(_ packetID: UInt16) -> [UInt8] { [0x40, 0x02, UInt8(packetID >> 8), UInt8(packetID & 0xFF)] }
}

/// One accepted client connection of a `ScriptedBroker`; used from its session thread only.
final class PeerConnection: @unchecked Sendable {
    /// The connection's descriptor.
    let fd: Int32
    /// Which connection this is: 0 for the first the broker accepted.
    let index: Int
    private var buffer: [UInt8] = []
    private var head = 0
    /// Bytes received so far.
    private(set) var bytesRead = 0

    init(fd: Int32, index: Int) {
        self.fd = fd
        self.index = index
    }

    /// Reads more bytes into the buffer; false at end of stream or on an error.
    private func fill() -> Bool {
        if head > 0 && head == buffer.count {
            buffer.removeAll(keepingCapacity: true)
            head = 0
        }
        var chunk = [UInt8](repeating: 0, count: 65_536)
        let count = chunk.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
        guard count > 0 else { return false }
        buffer.append(contentsOf: chunk[0..<count])
        bytesRead += count
        return true
    }

    /// The next packet, or nil when the client closed the connection (or sent garbage).
    func readPacket() -> WirePacket? {
        while true {
            if let packet = parse() { return packet }
            if head > 1 << 20 {
                buffer.removeFirst(head)
                head = 0
            }
            guard fill() else { return nil }
        }
    }

    /// Every packet that is complete after at most one more read (at least one), or nil when the client closed the
    /// connection. Lets a script answer a burst with one write.
    func readPackets() -> [WirePacket]? {
        var packets: [WirePacket] = []
        while let packet = parse() { packets.append(packet) }
        if !packets.isEmpty { return packets }
        guard let first = readPacket() else { return nil }
        packets.append(first)
        while let packet = parse() { packets.append(packet) }
        return packets
    }

    private func parse() -> WirePacket? {
        var index = head + 1
        var length = 0
        var shift = 0
        while true {
            guard index < buffer.count, shift <= 21 else { return nil }
            let byte = buffer[index]
            index += 1
            length |= Int(byte & 0x7F) << shift
            shift += 7
            if byte & 0x80 == 0 { break }
        }
        guard buffer.count - index >= length else { return nil }
        let first = buffer[head]
        let packet = WirePacket(type: first >> 4, flags: first & 0x0F, body: Array(buffer[index..<index + length]))
        head = index + length
        return packet
    }

    /// Reads and discards until `count` bytes in all were received or the stream ends; true when they were.
    @discardableResult
    func discard(untilTotal count: Int) -> Bool {
        while bytesRead < count {
            head = buffer.count
            guard fill() else { return false }
        }
        return true
    }

    /// Writes all of `bytes`; false when the client is gone.
    @discardableResult
    func send(_ bytes: [UInt8]) -> Bool {
        var offset = 0
        while offset < bytes.count {
            let written = bytes[offset...].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
            guard written > 0 else { return false }
            offset += written
        }
        return true
    }

    /// Sends FIN (the client reads end of stream) and keeps reading possible.
    func shutdownWrite() { shutdown(fd, Int32(SHUT_WR)) }
}

/// A TCP listener on a free loopback port that plays an MQTT broker: every accepted connection runs `session` on a
/// thread of its own; the socket is closed when `session` returns (so returning early is how a script drops the
/// client). Stops accepting and shuts every connection down when deinitialised.
final class ScriptedBroker: @unchecked Sendable {
    let port: UInt16
    private let listener: Int32
    private let open = OpenDescriptors()

    /// The accepted connections not yet closed (a class: the accept thread and each session share it).
    private final class OpenDescriptors: Sendable {
        let fds = Mutex<[Int32]>([])
    }

    init(session: @escaping @Sendable (PeerConnection) -> Void) throws {
        port = try freeLoopbackPort()
        let listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        self.listener = listener
        var reuse: Int32 = 1
        setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &reuse, socklen_t(MemoryLayout<Int32>.size))
        let bound = withLoopbackAddress(port: port) { address, length in bind(listener, address, length) }.result
        guard bound == 0, listen(listener, 8) == 0 else { throw HarnessError("scripted broker: bind/listen failed") }
        let open = self.open
        Thread.detachNewThread {
            var index = 0
            while true {
                let fd = accept(listener, nil, nil)
                guard fd >= 0 else {
                    close(listener)  // here, not in deinit: this thread is the last to use it
                    return
                }
                open.fds.withLock { $0.append(fd) }
                let connection = PeerConnection(fd: fd, index: index)
                index += 1
                Thread.detachNewThread {
                    session(connection)
                    // Closed by its own thread only, under the lock `deinit` shuts connections down with: neither can
                    // touch a descriptor number the kernel has handed to someone else in the meantime.
                    open.fds.withLock { fds in
                        fds.removeAll { $0 == fd }
                        close(fd)
                    }
                }
            }
        }
    }

    deinit {
        shutdown(listener, Int32(SHUT_RDWR))  // accept fails from now on
        // Wakes every session (its reads end); each then closes its own connection.
        open.fds.withLock { fds in
            for fd in fds { shutdown(fd, Int32(SHUT_RDWR)) }
        }
    }
}

/// A listener whose accept queue is full and which never accepts: a TCP connect to it hangs (Linux drops the SYN),
/// as a connect to a host that silently drops packets does.
final class BlackholeListener: @unchecked Sendable {
    let port: UInt16
    private let listener: Int32
    private var fillers: [Int32] = []

    init() throws {
        port = try freeLoopbackPort()
        let listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        self.listener = listener
        let bound = withLoopbackAddress(port: port) { address, length in bind(listener, address, length) }.result
        guard bound == 0, listen(listener, 0) == 0 else { throw HarnessError("blackhole: bind/listen failed") }
        // A backlog of 0 still queues one connection; a second fills the SYN queue's way in.
        for _ in 0..<2 {
            let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0)
            _ = withLoopbackAddress(port: port) { address, length in connect(fd, address, length) }
            fillers.append(fd)
        }
    }

    deinit {
        close(listener)
        for fd in fillers { close(fd) }
    }
}
