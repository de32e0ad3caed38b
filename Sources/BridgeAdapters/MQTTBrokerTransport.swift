// BridgeCore's MQTT port over the MQTT client (libmosquitto): the will is `bridge/state` (with several gateways
// `bridge/<gateway>/state`) offline, retained.
import BridgeCore
import Logging
import MQTT

/// `MQTTTransport` over an `MQTTClient`.
public final class MQTTBrokerTransport: MQTTTransport {
    /// The client (the daemon starts and stops it).
    public let client: MQTTClient
    let isV5: Bool

    /// Makes the client from the bridge's `mqtt:` settings; `clientID` when the config gives none.
    /// - Throws: `ConfigError` naming the `mqtt.*` key a setting is wrong in.
    public init(settings m: MQTTSettings, defaultClientID: String, gateway: String? = nil) throws(ConfigError) {
        let broker: MQTTBrokerURL
        do {
            broker = try MQTTBrokerURL(parsing: m.url)
        } catch {
            throw ConfigError(path: "mqtt.url", reason: error.detail)
        }
        var credentials: MQTTCredentials?
        if let user = m.username {
            let password: MQTTCredentials.Password? =
                m.password.map { .literal($0) } ?? m.passwordFile.map { .file($0) }
            credentials = MQTTCredentials(username: user, password: password)
        }
        var tls: MQTTTLSConfiguration?
        if broker.usesTLS {
            tls = MQTTTLSConfiguration(
                caFile: m.caFile, caDirectory: m.caDirectory, certificateFile: m.certificateFile,
                privateKeyFile: m.keyFile, verifyHostname: m.verifyHostname)
        }
        let will = MQTTOutgoingMessage(
            topic: BridgeTopics(base: m.baseTopic, gateway: gateway).bridgeState, payload: Array("{\"state\":\"offline\"}".utf8),
            qos: .atLeastOnce, retain: true)
        var configuration = MQTTConfiguration(
            broker: broker, clientID: m.clientID ?? defaultClientID,
            protocolVersion: m.protocolVersion == "5" ? .v5 : .v311, keepAlive: m.keepAlive, credentials: credentials,
            tls: tls, will: will,
            reconnect: MQTTReconnectPolicy(
                initialDelay: m.reconnectInitialDelay, maximumDelay: m.reconnectMaximumDelay),
            offlineQueueCapacity: max(1, m.offlineQueue), maxInflightMessages: m.maxInflight,
            receiveBufferCapacity: m.receiveBuffer)
        configuration.cleanSession = m.cleanSession
        configuration.sessionExpiry = m.sessionExpiry
        configuration.maximumIncomingPacketSize = m.maxIncomingPacket
        configuration.receiveBufferBytes = m.receiveBufferBytes
        do {
            try configuration.validate()
            client = try MQTTClient(configuration: configuration)
        } catch {
            throw ConfigError(path: "mqtt", reason: error.description)
        }
        isV5 = configuration.protocolVersion == .v5
    }

    /// `MQTTClient.holdWrites()`: the messages published until `releaseWrites()` leave together.
    public func holdWrites() { client.holdWrites() }

    /// `MQTTClient.releaseWrites()`.
    public func releaseWrites() { client.releaseWrites() }

    /// Publishes (or queues) without waiting.
    public func publish(_ message: BridgeOutgoingMessage) throws(BridgeTransportError) {
        var properties = MQTTPublishProperties()
        if isV5, let c = message.correlationData { properties.correlationData = c }
        let qos: MQTTQoS = message.qos >= 2 ? .exactlyOnce : (message.qos == 1 ? .atLeastOnce : .atMostOnce)
        do {
            try client.post(
                MQTTOutgoingMessage(
                    topic: message.topic, payload: message.payload, qos: qos, retain: message.retain,
                    properties: properties))
        } catch {
            throw BridgeTransportError(error.description)
        }
    }

    /// Publishes (or queues) and returns the delivery, to wait for the broker's acknowledgement.
    public func sendTracked(_ message: BridgeOutgoingMessage) throws(BridgeTransportError) -> MQTTDelivery {
        let qos: MQTTQoS = message.qos >= 2 ? .exactlyOnce : (message.qos == 1 ? .atLeastOnce : .atMostOnce)
        do {
            return try client.send(
                MQTTOutgoingMessage(topic: message.topic, payload: message.payload, qos: qos, retain: message.retain))
        } catch {
            throw BridgeTransportError(error.description)
        }
    }

    /// Publishes and waits for the broker's acknowledgement (or `timeout`); false when it did not come.
    public func publishAndWait(_ message: BridgeOutgoingMessage, timeout: Duration) async -> Bool {
        let qos: MQTTQoS = message.qos >= 1 ? .atLeastOnce : .atMostOnce
        guard
            let delivery = try? client.send(
                MQTTOutgoingMessage(topic: message.topic, payload: message.payload, qos: qos, retain: message.retain))
        else { return false }
        return await withTaskGroup(of: Bool.self) { group in
            group.addTask { (try? await delivery.acknowledged()) != nil }
            group.addTask {
                try? await Task.sleep(for: timeout)
                return false
            }
            let first = await group.next() ?? false
            group.cancelAll()
            return first
        }
    }

    /// Subscribes (kept across reconnects).
    public func subscribe(_ filter: String) async throws(BridgeTransportError) {
        do {
            try await client.subscribe(to: filter, qos: .atLeastOnce)
        } catch {
            throw BridgeTransportError(error.description)
        }
    }

    /// Received messages.
    public func incoming() -> AsyncStream<BridgeIncomingMessage> {
        let messages = client.messages()
        return AsyncStream(bufferingPolicy: .bufferingOldest(10_000)) { continuation in
            let task = Task {
                for await m in messages {
                    continuation.yield(
                        BridgeIncomingMessage(
                            topic: m.topic, payload: m.payload, retain: m.retain,
                            responseTopic: m.properties.responseTopic, correlationData: m.properties.correlationData))
                }
                continuation.finish()
            }
            continuation.onTermination = { _ in task.cancel() }
        }
    }

    /// Connection states.
    public func states() -> AsyncStream<BridgeTransportState> {
        let states = client.connectionStates()
        // The stream's first element is the state read just before it was registered; a change in between would be
        // lost, so the state now (after registration) goes first. A repeated or stale state is harmless here.
        let now = client.connectionState
        return AsyncStream { continuation in
            let task = Task {
                if case .connected = now { continuation.yield(.connected) }
                for await s in states {
                    switch s {
                    case .connected: continuation.yield(.connected)
                    case .idle, .connecting: continuation.yield(.connecting)
                    case .waitingToReconnect(_, _, let error):
                        continuation.yield(.disconnected(reason: error.description))
                    case .stopped: continuation.yield(.disconnected(reason: "stopped"))
                    }
                }
                continuation.finish()
            }
            continuation.onTermination = { _ in task.cancel() }
        }
    }

    /// Counters.
    public var statistics: BridgeTransportStatistics {
        let s = client.statistics
        return BridgeTransportStatistics(
            published: s.published, received: s.received, queued: s.queued, dropped: s.droppedQoS0 + s.droppedQoS1Or2)
    }
}
