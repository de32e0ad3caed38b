import Foundation
import MQTT
import TestSupport

/// A configuration for a broker started by the harness.
func configuration(
    _ broker: MosquittoBroker, version: MQTTProtocolVersion = .v5, clientID: String? = nil
) -> MQTTConfiguration {
    var configuration = MQTTConfiguration(
        broker: MQTTBrokerURL(host: "127.0.0.1", port: broker.port), clientID: clientID, protocolVersion: version)
    configuration.reconnect = MQTTReconnectPolicy(initialDelay: .milliseconds(50), maximumDelay: .milliseconds(400))
    return configuration
}

/// A connected client.
func connectedClient(_ configuration: MQTTConfiguration) async throws -> MQTTClient {
    let client = try MQTTClient(configuration: configuration)
    try await within(10, "connect to \(configuration.broker)") { try await client.connect() }
    return client
}

extension MQTTMessageStream {
    /// The first `count` messages, or a timeout.
    func first(_ count: Int, timeout: Double = 10) async throws -> [MQTTMessage] {
        let stream = self
        return try await within(timeout, "receive \(count) messages") {
            var messages: [MQTTMessage] = []
            for await message in stream {
                messages.append(message)
                if messages.count == count { break }
            }
            return messages
        }
    }
}

extension MQTTClient {
    /// Waits until the connection state satisfies `predicate`.
    func waitForState(
        timeout: Double = 10, _ what: String, _ predicate: @escaping @Sendable (MQTTConnectionState) -> Bool
    ) async throws {
        let states = connectionStates()
        _ = try await within(timeout, "connection state: \(what)") {
            for await state in states where predicate(state) { return true }
            throw TimeoutError("state stream ended before: \(what)")
        }
    }
}

/// A TCP peer on a free loopback port that accepts one connection, reads once, writes its scripted replies and
/// keeps the socket open until it is deinitialised. For broker behaviour mosquitto does not show.
final class ScriptedPeer: @unchecked Sendable {
    let port: UInt16
    private let listener: Int32
    private let lock = NSLock()
    private var connection: Int32 = -1

    init(replies: [[UInt8]]) throws {
        port = try freeLoopbackPort()
        let listener = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        self.listener = listener
        var reuse: Int32 = 1
        setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &reuse, socklen_t(MemoryLayout<Int32>.size))
        let bound = withLoopbackAddress(port: port) { address, length in bind(listener, address, length) }.result
        guard bound == 0, listen(listener, 1) == 0 else { throw HarnessError("scripted peer: bind/listen failed") }
        Thread.detachNewThread { [self] in
            let fd = accept(listener, nil, nil)
            guard fd >= 0 else { return }
            lock.withLock { connection = fd }
            var buffer = [UInt8](repeating: 0, count: 4096)
            _ = read(fd, &buffer, buffer.count)
            for reply in replies {
                _ = reply.withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
                usleep(50_000)
            }
        }
    }

    deinit {
        shutdown(listener, Int32(SHUT_RDWR))
        close(listener)
        lock.withLock { if connection >= 0 { close(connection) } }
    }
}
