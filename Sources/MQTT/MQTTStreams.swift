// The named AsyncSequence types the client hands out.

/// Messages received from the broker, optionally narrowed to one topic filter.
///
/// Each stream has its own buffer, bounded in messages (`MQTTConfiguration.receiveBufferCapacity`) and in bytes
/// (`MQTTConfiguration.receiveBufferBytes`, payload plus topic); when a reader falls behind, new messages are dropped
/// for that stream and counted (`MQTTClientStatistics.receiveDropped`). Messages the filter rejects pass through the
/// buffer too. The stream ends when the client shuts down.
public struct MQTTMessageStream: AsyncSequence, Sendable {
    /// The element type.
    public typealias Element = MQTTMessage

    let base: AsyncStream<MQTTMessage>
    let filter: String?
    let budget: ByteBudget?

    /// The iterator; use it from one task.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncStream<MQTTMessage>.AsyncIterator
        let filter: String?
        let budget: ByteBudget?

        /// The next message that matches the stream's filter, or nil when the client shut down.
        public mutating func next() async -> MQTTMessage? {
            while let message = await base.next() {
                budget?.giveBack(message.bufferedSize)
                if let filter, !MQTTTopic.matches(filter: filter, topic: message.topic) { continue }
                return message
            }
            return nil
        }

        /// The next element, on the caller's actor.
        public mutating func next(isolation actor: isolated (any Actor)?) async -> MQTTMessage? {
            while let message = await base.next(isolation: actor) {
                budget?.giveBack(message.bufferedSize)
                if let filter, !MQTTTopic.matches(filter: filter, topic: message.topic) { continue }
                return message
            }
            return nil
        }
    }

    /// Makes the iterator.
    public func makeAsyncIterator() -> AsyncIterator {
        AsyncIterator(base: base.makeAsyncIterator(), filter: filter, budget: budget)
    }
}

extension MQTTMessage {
    /// What a buffered message counts against `MQTTConfiguration.receiveBufferBytes`: its payload and topic bytes.
    var bufferedSize: Int { payload.count + topic.utf8.count }
}

/// Where the client's connection stands.
public enum MQTTConnectionState: Sendable, Equatable, CustomStringConvertible {
    /// Created, not started.
    case idle
    /// Opening the connection (attempt 1 is the first).
    case connecting(attempt: Int)
    /// Connected; `sessionPresent` tells whether the broker resumed a stored session.
    case connected(sessionPresent: Bool)
    /// The connection failed or was lost; the client retries after `retryIn`.
    case waitingToReconnect(retryIn: Duration, attempt: Int, error: MQTTError)
    /// Shut down for good.
    case stopped

    /// A log-friendly text.
    public var description: String {
        switch self {
        case .idle: "idle"
        case .connecting(let attempt): "connecting (attempt \(attempt))"
        case .connected(let sessionPresent): "connected (session present: \(sessionPresent))"
        case .waitingToReconnect(let delay, let attempt, let error):
            "disconnected: \(error); retrying in \(delay) (attempt \(attempt))"
        case .stopped: "stopped"
        }
    }

    /// True in `.connected`.
    public var isConnected: Bool {
        if case .connected = self { return true }
        return false
    }
}

/// The client's connection states: the current state first, then every change. Ends after `.stopped`.
public struct MQTTConnectionStateStream: AsyncSequence, Sendable {
    /// The element type.
    public typealias Element = MQTTConnectionState

    let base: AsyncStream<MQTTConnectionState>

    /// The iterator; use it from one task.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncStream<MQTTConnectionState>.AsyncIterator

        /// The next state, or nil after `.stopped`.
        public mutating func next() async -> MQTTConnectionState? { await base.next() }

        /// The next element, on the caller's actor.
        public mutating func next(isolation actor: isolated (any Actor)?) async -> MQTTConnectionState? {
            await base.next(isolation: actor)
        }
    }

    /// Makes the iterator.
    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(base: base.makeAsyncIterator()) }
}
