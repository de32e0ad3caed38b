import Foundation
import MQTT
import TestSupport

struct TimeoutError: Error, CustomStringConvertible {
    let description: String
}

/// Runs `body`, failing with a `TimeoutError` naming `what` after `seconds`.
func within<T: Sendable>(
    _ seconds: Double, _ what: String, _ body: @escaping @Sendable () async throws -> T
) async throws -> T {
    try await withThrowingTaskGroup(of: T?.self) { group in
        group.addTask { try await body() }
        group.addTask {
            try await Task.sleep(for: .seconds(seconds))
            return nil
        }
        defer { group.cancelAll() }
        guard let first = try await group.next(), let value = first else {
            throw TimeoutError(description: "timed out after \(seconds) s: \(what)")
        }
        return value
    }
}

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
            throw TimeoutError(description: "state stream ended before: \(what)")
        }
    }
}

/// Runs a command and throws if it fails.
@discardableResult
func run(_ program: String, _ arguments: [String]) throws -> String {
    guard let url = which(program) else { throw HarnessError("\(program) not found") }
    let result = try runCommand(url, arguments)
    guard result.status == 0 else {
        throw HarnessError("\(program) \(arguments.joined(separator: " ")) failed: \(result.stderr)")
    }
    return result.stdout
}
