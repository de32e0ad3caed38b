internal import CMosquittoIO
// The broker socket's buffers (CMosquittoIO): libmosquitto's reads of an attached socket are served from what one
// recv(2) took, byte for byte as the kernel would have served them; its writes between hold and release leave in one
// write(2), in order with every other write; nothing changes for any other descriptor. The first tests drive read(2),
// write(2) and close(2) directly on socket pairs (the process's own calls are the buffered ones, as libmosquitto's
// are); the last ones run the client against a scripted broker and a real mosquitto.
import Foundation
import Synchronization
import TestSupport
import Testing

@testable import MQTT

#if canImport(Glibc)
    import Glibc
#endif

/// A connected pair of non-blocking stream sockets, closed at the end of the test. Each end is closed once only:
/// tests run in parallel, and a second close(2) of a number the kernel has handed out again would close (and
/// detach) another test's socket.
private final class SocketPair {
    let reader: Int32
    let writer: Int32
    private var readerOpen = true
    private var writerOpen = true

    init() throws {
        var fds: [Int32] = [-1, -1]
        guard socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &fds) == 0 else {
            throw HarnessError("socketpair failed: errno \(errno)")
        }
        reader = fds[0]
        writer = fds[1]
        _ = fcntl(reader, F_SETFL, fcntl(reader, F_GETFL) | O_NONBLOCK)
    }

    func send(_ bytes: [UInt8]) { _ = bytes.withUnsafeBytes { write(writer, $0.baseAddress, $0.count) } }

    /// write(2) of `bytes` to the reader end (the end a test attaches for writing): the result.
    @discardableResult
    func writeToReaderEnd(_ bytes: [UInt8]) -> Int { bytes.withUnsafeBytes { write(reader, $0.baseAddress, $0.count) } }

    /// Everything readable now at the writer end.
    func drainWriterEnd() -> [UInt8] {
        var all: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65_536)
        while true {
            let n = chunk.withUnsafeMutableBytes { recv(writer, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
            guard n > 0 else { return all }
            all += chunk[0..<n]
        }
    }

    /// read(2) of at most `count` bytes: the bytes, or the result and errno when it returned none.
    func read(_ count: Int) -> (bytes: [UInt8], result: Int, error: Int32) {
        var bytes = [UInt8](repeating: 0, count: count)
        errno = 0
        let n = bytes.withUnsafeMutableBytes { Glibc.read(reader, $0.baseAddress, count) }
        return (n > 0 ? Array(bytes[0..<n]) : [], n, errno)
    }

    /// Closes the reader end (as libmosquitto closes a lost connection).
    func closeReader() {
        guard readerOpen else { return }
        readerOpen = false
        close(reader)
    }

    func closeBoth() {
        closeReader()
        guard writerOpen else { return }
        writerOpen = false
        close(writer)
    }

    deinit { closeBoth() }
}

// Serialized: libmosquitto's TLS loop (select(2)) fails a client whose socket number passes 1,024, so tests that
// start brokers and clients keep the parallel suite's peak of descriptors down.
@Suite(.serialized) struct SocketBufferTests {
    @Test func readsOfAnAttachedSocketAreServedFromOneReceive() throws {
        let pair = try SocketPair()
        let buffer = MosquittoSocketBuffers(enabled: true)
        buffer.attach(pair.reader)
        defer { buffer.detach() }
        // Two PUBACKs and the start of a third, as one segment: libmosquitto reads 1, 1, 2 bytes per packet.
        pair.send([0x40, 0x02, 0x00, 0x01, 0x40, 0x02, 0x00, 0x02, 0x40])
        #expect(pair.read(1).bytes == [0x40])
        #expect(pair.read(1).bytes == [0x02])
        #expect(pair.read(2).bytes == [0x00, 0x01])
        #expect(pair.read(1).bytes == [0x40])
        #expect(pair.read(1).bytes == [0x02])
        #expect(pair.read(8).bytes == [0x00, 0x02, 0x40], "a short read: what is buffered, no more")
        #expect(buffer.counts.fills == 1)
        #expect(!buffer.hasBufferedBytes)
        let empty = pair.read(1)
        #expect(empty.result == -1 && empty.error == EAGAIN, "nothing there: EAGAIN, as from the socket")
        pair.send([0x02, 0x00, 0x03])
        #expect(pair.read(1).bytes == [0x02])
        #expect(buffer.hasBufferedBytes)
        #expect(pair.read(2).bytes == [0x00, 0x03])
        #expect(buffer.counts.fills == 2)
        #expect(buffer.counts.reads == 9)
        shutdown(pair.writer, Int32(SHUT_WR))
        #expect(pair.read(1).result == 0, "end of stream reads as 0")
    }

    @Test func aReadAsLargeAsTheBufferGoesStraightToTheSocket() throws {
        let pair = try SocketPair()
        let buffer = MosquittoSocketBuffers(enabled: true)
        buffer.attach(pair.reader)
        defer { buffer.detach() }
        let body = (0..<20_000).map { UInt8(truncatingIfNeeded: $0 &* 7) }
        var sndbuf: Int32 = 1 << 20
        setsockopt(pair.writer, SOL_SOCKET, SO_SNDBUF, &sndbuf, socklen_t(MemoryLayout<Int32>.size))
        pair.send(body)
        var received: [UInt8] = []
        while received.count < body.count {
            let got = pair.read(body.count - received.count)
            guard got.result > 0 else { break }
            received += got.bytes
        }
        #expect(received == body)
        #expect(buffer.counts.fills == 0, "never copied through the buffer")
    }

    @Test func closeDetachesAndALateDetachLeavesTheNextOwnerAlone() throws {
        let pair = try SocketPair()
        let buffer = MosquittoSocketBuffers(enabled: true)
        buffer.attach(pair.reader)
        let number = pair.reader
        #expect(MosquittoSocketBuffers.isAttached(number))
        pair.send([1, 2, 3])
        #expect(pair.read(1).bytes == [1])
        pair.closeReader()  // as libmosquitto closes a lost connection, with two bytes still buffered
        #expect(
            !MosquittoSocketBuffers.isAttached(number), "close(2) detached it: a reused number reads its own socket")
        buffer.detach()
        // A number may serve another client's connection by the time the first client detaches: here both attach
        // one open socket of this test's, the second one last (no closed number is attached: in a parallel run it
        // may be another test's socket already).
        let second = try SocketPair()
        let first = MosquittoSocketBuffers(enabled: true)
        let next = MosquittoSocketBuffers(enabled: true)
        first.attach(second.reader)
        next.attach(second.reader)
        first.detach()
        #expect(MosquittoSocketBuffers.isAttached(second.reader), "the late detach left the next owner attached")
        second.send([7, 8])
        #expect(second.read(1).bytes == [7])
        #expect(next.counts.fills == 1 && first.counts.fills == 0)
        next.detach()
        #expect(!MosquittoSocketBuffers.isAttached(second.reader))
    }

    @Test func heldWritesLeaveTogetherAtRelease() throws {
        let pair = try SocketPair()
        let buffers = MosquittoSocketBuffers(enabled: true)
        buffers.attach(pair.reader)
        defer { buffers.detach() }
        pair.writeToReaderEnd([1])
        #expect(pair.drainWriterEnd() == [1], "not held: written at once")
        buffers.hold()
        #expect(pair.writeToReaderEnd([2, 3]) == 2)
        #expect(pair.writeToReaderEnd([4]) == 1)
        #expect(pair.writeToReaderEnd([5, 6, 7]) == 3)
        #expect(pair.drainWriterEnd() == [], "held")
        #expect(buffers.hasPendingWrites)
        buffers.release()
        #expect(pair.drainWriterEnd() == [2, 3, 4, 5, 6, 7])
        #expect(!buffers.hasPendingWrites)
        let counts = buffers.counts
        #expect(counts.keptWrites == 3 && counts.flushes == 1, "three writes, one system call")
    }

    /// The loop thread flushes what waits for the socket whenever it wakes; a hold (writes batched over rounds of
    /// signals, for up to 10 ms) must survive that, and leave only at release.
    @Test func aFlushDuringAHoldSendsNothing() throws {
        let pair = try SocketPair()
        let buffers = MosquittoSocketBuffers(enabled: true)
        buffers.attach(pair.reader)
        defer { buffers.detach() }
        buffers.hold()
        #expect(pair.writeToReaderEnd([1, 2]) == 2)
        #expect(buffers.hasPendingWrites && !buffers.hasWaitingWrites, "held, not waiting for the socket")
        #expect(buffers.flush())
        #expect(pair.drainWriterEnd() == [], "still held after a flush")
        buffers.release()
        #expect(pair.drainWriterEnd() == [1, 2])
        #expect(!buffers.hasPendingWrites && !buffers.hasWaitingWrites)
    }

    @Test func aWriteThatDoesNotFitSendsWhatWasHeldFirst() throws {
        let pair = try SocketPair()
        var sndbuf: Int32 = 1 << 20
        setsockopt(pair.reader, SOL_SOCKET, SO_SNDBUF, &sndbuf, socklen_t(MemoryLayout<Int32>.size))
        let buffers = MosquittoSocketBuffers(enabled: true)
        buffers.attach(pair.reader)
        defer { buffers.detach() }
        buffers.hold()
        pair.writeToReaderEnd([1, 2])
        let large = [UInt8](repeating: 9, count: 20_000)
        #expect(pair.writeToReaderEnd(large) == large.count)
        pair.writeToReaderEnd([3])
        buffers.release()
        var received: [UInt8] = []
        for _ in 0..<100 where received.count < 20_003 {
            received += pair.drainWriterEnd()
        }
        #expect(received == [1, 2] + large + [3], "in the order written")
    }

    @Test func whatAFullSocketDidNotTakeWaitsForFlushInOrder() throws {
        let pair = try SocketPair()
        _ = fcntl(pair.reader, F_SETFL, fcntl(pair.reader, F_GETFL) | O_NONBLOCK)
        var sndbuf: Int32 = 4096
        setsockopt(pair.reader, SOL_SOCKET, SO_SNDBUF, &sndbuf, socklen_t(MemoryLayout<Int32>.size))
        let buffers = MosquittoSocketBuffers(enabled: true)
        buffers.attach(pair.reader)
        defer { buffers.detach() }
        var expected: [UInt8] = []
        buffers.hold()
        for index in 0..<15 {
            let chunk = [UInt8](repeating: UInt8(index), count: 1000)
            expected += chunk
            #expect(pair.writeToReaderEnd(chunk) == chunk.count)
        }
        buffers.release()
        #expect(buffers.hasPendingWrites, "the socket took only part of it")
        // Written while bytes still wait: queued behind them, never ahead.
        #expect(pair.writeToReaderEnd([0xEE]) == 1)
        expected.append(0xEE)
        var received: [UInt8] = []
        for _ in 0..<1000 where received.count < expected.count {
            received += pair.drainWriterEnd()
            #expect(buffers.flush())
        }
        #expect(received == expected)
        #expect(!buffers.hasPendingWrites)
    }

    @Test func closeDropsWhatWasHeld() throws {
        let pair = try SocketPair()
        let buffers = MosquittoSocketBuffers(enabled: true)
        buffers.attach(pair.reader)
        buffers.hold()
        pair.writeToReaderEnd([1, 2, 3])
        pair.closeReader()  // as libmosquitto closes a lost connection
        #expect(!buffers.hasPendingWrites)
        buffers.release()
        #expect(pair.drainWriterEnd() == [], "nothing reached the closed socket's peer")
        #expect(buffers.counts.flushes == 0)
    }

    @Test func aWakeUpSocketPairsWritesAreDroppedUntilItIsClosed() throws {
        var fds: [Int32] = [-1, -1]
        _ = mosquitto_io_silence_socketpair(1)
        #expect(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &fds) == 0)
        let marked = mosquitto_io_silence_socketpair(0)
        #expect(marked == fds[1], "the write end is marked")
        _ = fcntl(fds[0], F_SETFL, fcntl(fds[0], F_GETFL) | O_NONBLOCK)
        let before = mosquitto_io_dropped_writes()
        var byte: UInt8 = 0
        #expect(write(fds[1], &byte, 1) == 1)
        #expect(mosquitto_io_dropped_writes() >= before + 1)
        #expect(recv(fds[0], &byte, 1, Int32(MSG_DONTWAIT)) == -1 && errno == EAGAIN, "nothing reached the read end")
        // A pair made without asking is left alone.
        var other: [Int32] = [-1, -1]
        #expect(socketpair(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0, &other) == 0)
        #expect(mosquitto_io_is_silenced(other[1]) == 0)
        #expect(write(other[1], &byte, 1) == 1)
        #expect(read(other[0], &byte, 1) == 1)
        close(other[0])
        close(other[1])
        close(fds[1])
        #expect(mosquitto_io_is_silenced(marked) == 0, "close(2) ends it: the number may be reused")
        close(fds[0])
    }

    @Test func otherDescriptorsAreReadAsBefore() throws {
        let pair = try SocketPair()
        pair.send([5, 6, 7])
        #expect(pair.read(1).bytes == [5])
        #expect(pair.read(10).bytes == [6, 7])
        let empty = pair.read(1)
        #expect(empty.result == -1 && empty.error == EAGAIN)
    }

    /// A broker that answers a burst of QoS 1 publishes with all their PUBACKs in one write, after a CONNACK sent a
    /// byte at a time: every publish is acknowledged by its own PUBACK, and the burst's acknowledgements are read
    /// with one recv(2), not three read(2) calls each.
    @Test(arguments: [MQTTProtocolVersion.v311, .v5])
    func acknowledgementsOfABurstAreReadTogether(version: MQTTProtocolVersion) async throws {
        let count = 40
        let isV5 = version == .v5
        // The client's socket buffers, once it exists: the broker sends the next piece of the CONNACK only after
        // the client read the last one (a fixed pause between pieces was not enough on a loaded machine, where the
        // loop thread could wake after several of them had come and read them with one recv).
        let reader = Mutex<MosquittoSocketBuffers?>(nil)
        let fills: @Sendable () -> UInt64 = { reader.withLock { $0?.counts.fills } ?? 0 }
        let broker = try ScriptedBroker { peer in
            guard peer.readPacket()?.type == 1 else { return }
            for byte in WirePacket.connack(isV5: isV5) {
                let before = fills()
                guard peer.send([byte]) else { return }
                let deadline = ContinuousClock.now + .seconds(5)
                while fills() == before && ContinuousClock.now < deadline { usleep(500) }
            }
            var ids: [UInt16] = []
            while ids.count < count, let packets = peer.readPackets() {
                ids += packets.compactMap { $0.publish(isV5: isV5)?.packetID }
            }
            guard peer.send(ids.flatMap(WirePacket.puback)) else { return }
            while peer.readPacket() != nil {}
        }
        var config = MQTTConfiguration(
            broker: MQTTBrokerURL(host: "127.0.0.1", port: broker.port), protocolVersion: version)
        config.maxInflightMessages = count
        let client = try MQTTClient(configuration: config)
        reader.withLock { $0 = client.core.buffers }
        try await within(10, "connect to \(config.broker)") { try await client.connect() }
        let fillsAfterConnect = client.core.buffers.counts.fills
        #expect(fillsAfterConnect >= 2, "the CONNACK came in pieces, each read when it came")
        var deliveries: [MQTTDelivery] = []
        for index in 0..<count {
            deliveries.append(
                try client.send(
                    MQTTOutgoingMessage(topic: "burst/\(index)", payload: [UInt8(index)], qos: .atLeastOnce)))
        }
        for delivery in deliveries { try await within(10, "acknowledged") { try await delivery.acknowledged() } }
        #expect(client.statistics.acknowledged == count)
        let counts = client.core.buffers.counts
        #expect(counts.fills - fillsAfterConnect <= 2, "one segment of \(count) PUBACKs, read at once")
        #expect(counts.reads >= UInt64(3 * count), "libmosquitto still read each packet its own way")
        await client.disconnect()
    }

    /// Against a real mosquitto, a stream of QoS 1 publishes in held rounds (as the bridge publishes notifications):
    /// every message arrives and is acknowledged, each round leaves in about one write(2), and the acknowledgements
    /// take far fewer recv(2) calls than libmosquitto made reads.
    @Test func aRealBrokersAcknowledgementsAreReadInBatches() async throws {
        // A Receive Maximum above the publisher's window: no publish waits for an acknowledgement.
        let broker = try await MosquittoBroker.start(extraConfig: "max_inflight_messages 5000\n")
        let subscriber = try await connectedClient(configuration(broker))
        var publishing = configuration(broker)
        publishing.maxInflightMessages = 2000  // no publish waits for the window (it would leave from the loop thread)
        let publisher = try await connectedClient(publishing)
        let messages = subscriber.messages(matching: "batch/#")
        _ = try await subscriber.subscribe(to: "batch/#", qos: .atLeastOnce)
        let before = publisher.core.buffers.counts
        // libmosquitto's wake-up socket pair: marked, and one dropped write per packet queued.
        let wakeUp = publisher.core.handle.silencedWakeUp
        #expect(wakeUp >= 0 && mosquitto_io_is_silenced(wakeUp) == 1)
        let droppedBefore = mosquitto_io_dropped_writes()
        var deliveries: [MQTTDelivery] = []
        for round in 0..<50 {
            publisher.holdWrites()
            for index in 0..<20 {
                let n = round * 20 + index
                deliveries.append(
                    try publisher.send(
                        MQTTOutgoingMessage(topic: "batch/\(n % 7)", payload: Array("\(n)".utf8), qos: .atLeastOnce)))
            }
            publisher.releaseWrites()
            usleep(1_000)
        }
        let received = try await messages.first(1000, timeout: 30)
        #expect(Set(received.map { String(decoding: $0.payload, as: UTF8.self) }).count == 1000)
        for delivery in deliveries { try await within(10, "acknowledged") { try await delivery.acknowledged() } }
        let after = publisher.core.buffers.counts
        let fills = after.fills - before.fills
        let reads = after.reads - before.reads
        #expect(reads >= 3000, "three reads per PUBACK by libmosquitto")
        #expect(fills * 4 < reads, "fewer than one recv(2) per PUBACK: \(fills) receives for \(reads) reads")
        let kept = after.keptWrites - before.keptWrites
        let flushes = after.flushes - before.flushes
        #expect(kept >= 1000, "every publish of a round was held")
        #expect(flushes <= 100, "about one write(2) per round of 20: \(flushes) for \(kept) publishes")
        #expect(mosquitto_io_dropped_writes() - droppedBefore >= 1000, "no system call for libmosquitto's wake-ups")
        await publisher.disconnect()
        await subscriber.disconnect()
    }
}

/// The in-flight window follows the broker's Receive Maximum (MQTT 5), so that libmosquitto never holds a publish
/// back itself (it would send it later from the loop thread, outside the caller's held round).
@Suite struct ReceiveMaximumTests {
    @Test func windowIsTheSmallerOfOursAndTheBrokers() async throws {
        let broker = try await MosquittoBroker.start()  // mosquitto's default max_inflight_messages: 20
        for (version, expected) in [(MQTTProtocolVersion.v5, 20), (.v311, 100)] {
            let client = try await connectedClient(configuration(broker, version: version))
            #expect(client.core.window == expected, "\(version)")
            var deliveries: [MQTTDelivery] = []
            for index in 0..<300 {
                deliveries.append(
                    try client.send(MQTTOutgoingMessage(topic: "window/\(index)", payload: [1], qos: .atLeastOnce)))
            }
            for delivery in deliveries { try await within(10, "acknowledged") { try await delivery.acknowledged() } }
            #expect(client.statistics.acknowledged == 300)
            await client.disconnect()
        }
    }

    /// A hold (as the bridge keeps over its advertisement rounds) never keeps the window full: with the broker's 20
    /// in flight and held, the publishes behind them would wait for the release, and at the bridge's rate queue
    /// without end. Here the hold is never released, and every publish is acknowledged all the same.
    @Test func aHoldNeverKeepsTheWindowFull() async throws {
        let broker = try await MosquittoBroker.start()  // mosquitto's default max_inflight_messages: 20
        let client = try await connectedClient(configuration(broker, version: .v5))
        #expect(client.core.window == 20)
        client.holdWrites()
        var deliveries: [MQTTDelivery] = []
        for index in 0..<100 {
            deliveries.append(
                try client.send(MQTTOutgoingMessage(topic: "held/\(index)", payload: [1], qos: .atLeastOnce)))
        }
        for delivery in deliveries {
            try await within(10, "acknowledged during the hold") { try await delivery.acknowledged() }
        }
        #expect(client.statistics.acknowledged == 100)
        client.releaseWrites()
        await client.disconnect()
    }
}
