// Message values: what we publish and what we receive, with their MQTT 5 properties.

/// MQTT delivery guarantee.
public enum MQTTQoS: Int, Sendable, Hashable, Comparable, CaseIterable {
    /// Fire and forget (QoS 0).
    case atMostOnce = 0
    /// Acknowledged, may be duplicated (QoS 1).
    case atLeastOnce = 1
    /// Acknowledged in a four-way handshake, delivered once (QoS 2).
    case exactlyOnce = 2

    /// Orders by guarantee: at most once < at least once < exactly once.
    public static func < (lhs: MQTTQoS, rhs: MQTTQoS) -> Bool { lhs.rawValue < rhs.rawValue }
}

/// One MQTT 5 user property (a name/value pair; names may repeat, order is kept).
public struct MQTTUserProperty: Sendable, Hashable {
    /// The name.
    public var name: String
    /// The value.
    public var value: String

    /// Creates a user property.
    public init(_ name: String, _ value: String) {
        self.name = name
        self.value = value
    }
}

/// The MQTT 5 properties of a PUBLISH (and of a will). All are optional; MQTT 3.1.1 carries none.
public struct MQTTPublishProperties: Sendable, Hashable {
    /// True when the payload is UTF-8 text (payload format indicator 1).
    public var payloadIsUTF8: Bool?
    /// How long the broker keeps the message for subscribers that have not received it (whole seconds).
    public var messageExpiry: Duration?
    /// MIME type of the payload, e.g. `application/json`.
    public var contentType: String?
    /// Topic the receiver should send its response to (request/response pattern).
    public var responseTopic: String?
    /// Opaque bytes that tie a response to its request.
    public var correlationData: [UInt8]?
    /// User properties, in order.
    public var userProperties: [MQTTUserProperty]

    /// Creates properties.
    public init(
        payloadIsUTF8: Bool? = nil, messageExpiry: Duration? = nil, contentType: String? = nil,
        responseTopic: String? = nil, correlationData: [UInt8]? = nil, userProperties: [MQTTUserProperty] = []
    ) {
        self.payloadIsUTF8 = payloadIsUTF8
        self.messageExpiry = messageExpiry
        self.contentType = contentType
        self.responseTopic = responseTopic
        self.correlationData = correlationData
        self.userProperties = userProperties
    }

    /// True when no property is set.
    public var isEmpty: Bool {
        payloadIsUTF8 == nil && messageExpiry == nil && contentType == nil && responseTopic == nil
            && correlationData == nil && userProperties.isEmpty
    }
}

/// A message to publish.
public struct MQTTOutgoingMessage: Sendable, Hashable {
    /// Topic name (no wildcards).
    public var topic: String
    /// Payload bytes.
    public var payload: [UInt8]
    /// Delivery guarantee.
    public var qos: MQTTQoS
    /// Whether the broker keeps it as the topic's retained message.
    public var retain: Bool
    /// MQTT 5 properties; must be empty under MQTT 3.1.1.
    public var properties: MQTTPublishProperties

    /// Creates a message.
    public init(
        topic: String, payload: [UInt8], qos: MQTTQoS = .atMostOnce, retain: Bool = false,
        properties: MQTTPublishProperties = MQTTPublishProperties()
    ) {
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.properties = properties
    }
}

/// A message received from the broker. Its bytes were copied out of libmosquitto before the callback returned.
public struct MQTTMessage: Sendable, Hashable {
    /// The topic it was published to.
    public var topic: String
    /// Payload bytes.
    public var payload: [UInt8]
    /// The QoS it was delivered with.
    public var qos: MQTTQoS
    /// True when this is a retained message sent because we subscribed.
    public var retain: Bool
    /// MQTT 5 properties (empty under 3.1.1).
    public var properties: MQTTPublishProperties

    /// Creates a message (tests and fakes use this).
    public init(
        topic: String, payload: [UInt8], qos: MQTTQoS, retain: Bool,
        properties: MQTTPublishProperties = MQTTPublishProperties()
    ) {
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.properties = properties
    }

    /// The payload decoded as UTF-8 (invalid bytes replaced).
    public var payloadString: String { String(decoding: payload, as: UTF8.self) }
}

/// Counters of one client since it was created. Read with `MQTTClient.statistics`.
public struct MQTTClientStatistics: Sendable, Hashable {
    /// Messages handed to libmosquitto for sending.
    public var published: Int = 0
    /// QoS 1/2 messages the broker acknowledged.
    public var acknowledged: Int = 0
    /// Messages waiting in the offline queue right now.
    public var queued: Int = 0
    /// QoS 0 messages dropped because the offline queue was full.
    public var droppedQoS0: Int = 0
    /// QoS 1/2 messages dropped because the offline queue was full of them.
    public var droppedQoS1Or2: Int = 0
    /// Messages received from the broker (not counting those dropped as oversized).
    public var received: Int = 0
    /// Received messages a stream dropped because its reader fell behind (its message or byte bound was reached);
    /// a message dropped by two streams counts twice.
    public var receiveDropped: Int = 0
    /// Received messages dropped because their packet was larger than `MQTTConfiguration.maximumIncomingPacketSize`
    /// (MQTT 3.1.1; under MQTT 5 the broker drops them before they are sent).
    public var receiveOversizeDropped: Int = 0
    /// Successful connections (the first one included).
    public var connections: Int = 0
}

extension MQTTOutgoingMessage {
    /// The size in bytes of this message's PUBLISH packet (fixed header included), as MQTT 3.1.1 / 5 define it.
    func packetSize(isV5: Bool) -> Int {
        func varintSize(_ value: Int) -> Int {
            switch value {
            case ..<128: 1
            case ..<16_384: 2
            case ..<2_097_152: 3
            default: 4
            }
        }
        var remaining = 2 + topic.utf8.count + (qos == .atMostOnce ? 0 : 2) + payload.count
        if isV5 {
            var properties = 0
            if self.properties.payloadIsUTF8 != nil { properties += 2 }
            if self.properties.messageExpiry != nil { properties += 5 }
            if let contentType = self.properties.contentType { properties += 3 + contentType.utf8.count }
            if let responseTopic = self.properties.responseTopic { properties += 3 + responseTopic.utf8.count }
            if let correlationData = self.properties.correlationData { properties += 3 + correlationData.count }
            for property in self.properties.userProperties {
                properties += 5 + property.name.utf8.count + property.value.utf8.count
            }
            remaining += varintSize(properties) + properties
        }
        return 1 + varintSize(remaining) + remaining
    }
}
