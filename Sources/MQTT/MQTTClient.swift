// The public client. A thin shell over `ClientCore`; see that file for the threading and queueing design.

/// An MQTT client over libmosquitto: one broker connection with automatic reconnect, an ordered bounded offline
/// queue, acknowledged publishes, and received messages as async sequences.
///
/// A client runs once: `start()` (or `connect()`) begins connecting on a dedicated thread that also reconnects with
/// exponential backoff; `disconnect()` ends it. All methods are safe to call from any thread or task; none blocks
/// the Swift concurrency pool.
///
/// ```swift
/// let client = try MQTTClient(configuration: .init(broker: try MQTTBrokerURL(parsing: "mqtt://localhost")))
/// try await client.connect()
/// try await client.subscribe(to: "sensors/#")
/// try await client.publish(to: "sensors/kitchen", payload: Array("21.5".utf8), qos: .atLeastOnce)
/// for await message in client.messages() { print(message.topic, message.payloadString) }
/// ```
public final class MQTTClient: Sendable {
    let core: ClientCore

    /// Creates a client; nothing connects until `start()` or `connect()`.
    ///
    /// - Throws: `MQTTError` when the configuration is invalid (`.invalidConfiguration`, `.invalidTopic`) or
    ///   libmosquitto cannot make a client.
    public init(configuration: MQTTConfiguration) throws(MQTTError) {
        core = try ClientCore(configuration: configuration)
    }

    /// Shuts the connection down if the owner forgot to.
    deinit { core.requestStop() }

    /// The settings this client was made with.
    public var configuration: MQTTConfiguration { core.configuration }

    // MARK: Connection

    /// Starts connecting in the background and keeps reconnecting until `disconnect()`; returns at once.
    ///
    /// Watch `connectionStates()` for progress. Publishes made before the connection is up are queued.
    /// - Throws: `MQTTError` when a setting cannot be applied (unreadable password file, missing TLS files) or the
    ///   client was started before.
    public func start() throws(MQTTError) {
        try core.start()
    }

    /// Starts the client and waits for the first connection attempt.
    ///
    /// - Throws: `MQTTError` when the first attempt fails: `.connectionRefused(reason)` when the broker refused
    ///   (bad credentials, not authorised...), `.library(code)` for network and TLS failures; `.cancelled` at once
    ///   when the calling task is cancelled, even while the attempt hangs in a TCP connect. The client is then shut
    ///   down; use `start()` instead to keep retrying in the background.
    public func connect() async throws(MQTTError) {
        try core.start()
        do {
            try await core.firstOutcome.value(operation: "connect to MQTT broker \(core.configuration.broker)")
        } catch {
            await disconnect()
            throw error
        }
    }

    /// Runs the client for the life of the calling task: starts it (see `start()`), then waits; when the task is
    /// cancelled it disconnects cleanly and returns once the connection is closed, or at the latest
    /// `MQTTClient.shutdownGracePeriod` (3 s) after the cancellation, when the loop thread is stuck in a TCP connect
    /// or a name lookup (it then ends by itself in the background).
    ///
    /// - Throws: `MQTTError` from `start()`.
    public func run() async throws(MQTTError) {
        try core.start()
        let operation = "run MQTT client for \(core.configuration.broker)"
        await withTaskCancellationHandler {
            _ = await core.finished.wait(operation: operation)
        } onCancel: {
            core.requestStop()
        }
        // Cancelled (or the client was shut down otherwise): give the DISCONNECT its chance to go out.
        _ = await core.finished.wait(atMost: Self.shutdownGracePeriod, operation: operation)
    }

    /// How long `run()` waits, after its task was cancelled, for the connection to close.
    public static let shutdownGracePeriod = Duration.seconds(3)

    /// Disconnects cleanly (the broker does not publish the will) and stops reconnecting. Messages already handed to
    /// libmosquitto are written before the DISCONNECT; queued ones and unacknowledged waits fail with `.shutDown`.
    /// Returns when the loop thread has ended: within about 2 s even if the broker stopped answering, later only while
    /// it hangs in a TCP connect or a name lookup. When the calling task is cancelled it returns at once; the
    /// client then finishes shutting down in the background.
    public func disconnect() async {
        core.requestStop()
        _ = await core.finished.wait(operation: "disconnect from MQTT broker \(core.configuration.broker)")
    }

    /// Holds back what is written to the broker until `releaseWrites()`, so that the messages published in between
    /// leave in as few TCP segments as possible (one wake-up of the broker, one burst of acknowledgements, instead
    /// of one each, and one write(2) instead of one per packet). For a caller that publishes several messages in one
    /// go; keep the span short: nothing held leaves before `releaseWrites()` unless 16 KiB pile up, or a publish
    /// must wait for the in-flight window (what is held then leaves at once, and the hold goes on), or the client's
    /// own loop writes (acknowledgements, pings). Does nothing under TLS.
    public func holdWrites() { core.holdWrites(true) }

    /// Sends what `holdWrites()` held back.
    public func releaseWrites() { core.holdWrites(false) }

    /// The current connection state.
    public var connectionState: MQTTConnectionState { core.state.withLock { $0.connection } }

    /// The connection states: the current one first, then each change, ending after `.stopped`. A reader that falls
    /// more than 64 states behind loses the oldest ones (a stream nobody reads does not grow without bound).
    /// `.connected` comes after the connection's subscriptions were sent again: a message published on hearing it
    /// reaches the broker after them.
    public func connectionStates() -> MQTTConnectionStateStream {
        // The current state is read under the broadcaster's lock: read before it, a change made in between was lost.
        MQTTConnectionStateStream(
            base: core.states.makeStream(bufferingPolicy: .bufferingNewest(64), current: { self.connectionState }))
    }

    /// Counters since the client was created.
    public var statistics: MQTTClientStatistics {
        var statistics = core.state.withLock { $0.statistics }
        statistics.received = core.received.load(ordering: .relaxed)
        statistics.receiveDropped = core.receiveDropped.load(ordering: .relaxed)
        statistics.receiveOversizeDropped = core.receiveOversizeDropped.load(ordering: .relaxed)
        return statistics
    }

    // MARK: Publishing

    /// Publishes without waiting: sends now when connected, otherwise queues (bounded, in order).
    ///
    /// - Returns: a delivery to await when you need to know the broker has the message.
    /// - Throws: `MQTTError` at once for an invalid topic, an oversized payload, properties under MQTT 3.1.1, a
    ///   packet over the broker's maximum packet size (MQTT 5), or a shut-down client.
    @discardableResult
    public func send(_ message: MQTTOutgoingMessage) throws(MQTTError) -> MQTTDelivery {
        let completion = Completion<Void>()
        try core.send(message, completion: completion)
        return MQTTDelivery(completion: completion, topic: message.topic)
    }

    /// Publishes without waiting and without a delivery to wait for (`send(_:)` when its outcome is of no interest:
    /// the queue, the in-flight window and the statistics are the same, and nothing is allocated to report it).
    ///
    /// - Throws: `MQTTError`: see `send(_:)`.
    public func post(_ message: MQTTOutgoingMessage) throws(MQTTError) {
        try core.send(message, completion: nil)
    }

    /// Publishes and waits: for QoS 1 and 2 until the broker acknowledged, for QoS 0 until handed to libmosquitto
    /// (or queued while disconnected).
    ///
    /// - Throws: `MQTTError`: see `send(_:)`; also `.rejected(reason)` when the broker refused it (MQTT 5),
    ///   `.dropped` when it was pushed out of the full offline queue, `.shutDown`, `.cancelled`.
    public func publish(
        to topic: String, payload: [UInt8], qos: MQTTQoS = .atMostOnce, retain: Bool = false,
        properties: MQTTPublishProperties = MQTTPublishProperties()
    ) async throws(MQTTError) {
        let message = MQTTOutgoingMessage(
            topic: topic, payload: payload, qos: qos, retain: retain, properties: properties)
        let delivery = try send(message)
        if qos == .atMostOnce && delivery.completion.result == nil { return }  // queued: do not wait for a connection
        try await delivery.acknowledged()
    }

    // MARK: Subscriptions

    /// Subscribes to `filter` (wildcards `+` and `#` allowed) and keeps the subscription across reconnects.
    ///
    /// - Returns: the QoS the broker granted; when not connected, the requested QoS (the subscription is made as soon
    ///   as the connection is up).
    /// - Throws: `MQTTError` `.invalidTopic` for a malformed filter, `.rejected(reason)` when the broker refused it.
    @discardableResult
    public func subscribe(to filter: String, qos: MQTTQoS = .atLeastOnce) async throws(MQTTError) -> MQTTQoS {
        try await core.subscribe(filter: filter, qos: qos)
    }

    /// Removes a subscription made with `subscribe(to:qos:)`; waits for the broker's UNSUBACK when connected.
    public func unsubscribe(from filter: String) async throws(MQTTError) {
        try await core.unsubscribe(filter: filter)
    }

    /// Received messages, optionally only those matching `filter`. Every call makes a new independent stream;
    /// make it before subscribing so no message is missed (retained messages arrive right after the SUBACK).
    ///
    /// Each stream buffers at most `receiveBufferCapacity` messages and `receiveBufferBytes` bytes (payload plus
    /// topic) for its reader; beyond either bound new messages are dropped for that stream and counted in
    /// `statistics.receiveDropped`.
    public func messages(matching filter: String? = nil) -> MQTTMessageStream {
        let capacity = core.configuration.receiveBufferCapacity
        let budget = ByteBudget(limit: core.configuration.receiveBufferBytes)
        return MQTTMessageStream(
            base: core.incoming.makeStream(bufferingPolicy: .bufferingOldest(capacity), budget: budget),
            filter: filter, budget: budget)
    }
}

/// The outcome of one `MQTTClient.send(_:)`.
public struct MQTTDelivery: Sendable {
    let completion: Completion<Void>
    /// The topic the message goes to.
    public let topic: String

    /// Waits until the broker acknowledged the message (QoS 1/2) or it was handed to libmosquitto (QoS 0).
    ///
    /// Safe to call before or after the acknowledgement arrived, and from several tasks.
    /// - Throws: `MQTTError` `.rejected`, `.dropped`, `.shutDown`, `.library`, or `.cancelled` for this wait only.
    public func acknowledged() async throws(MQTTError) {
        try await completion.value(operation: "publish to \(topic)")
    }

    /// True once the delivery finished, either way.
    public var isFinished: Bool { completion.result != nil }
}
