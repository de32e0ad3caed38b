// Errors of the MQTT target. Every failure names what we were doing and carries libmosquitto's own text
// (mosquitto_strerror, mosquitto_reason_string or mosquitto_connack_string), so a log line is self-explanatory.

/// An MQTT reason code (MQTT 5 §2.4) or, for MQTT 3.1.1 CONNACK refusals, the CONNACK return code.
///
/// Open-ended like the broker's vocabulary: any byte is representable; the common ones have Swift names.
public struct MQTTReasonCode: RawRepresentable, Hashable, Sendable, CustomStringConvertible {
    /// The code byte as sent on the wire.
    public let rawValue: UInt8
    /// Wraps a code byte.
    public init(rawValue: UInt8) { self.rawValue = rawValue }

    /// 0x00: success (also "granted QoS 0" and "normal disconnection").
    public static let success = MQTTReasonCode(rawValue: 0x00)
    /// 0x10: accepted, but nobody subscribes to the topic (a success).
    public static let noMatchingSubscribers = MQTTReasonCode(rawValue: 0x10)
    /// 0x80: the broker did not say why.
    public static let unspecifiedError = MQTTReasonCode(rawValue: 0x80)
    /// 0x83: refused for a broker-specific reason.
    public static let implementationSpecificError = MQTTReasonCode(rawValue: 0x83)
    /// 0x85: the client identifier is not acceptable.
    public static let clientIdentifierNotValid = MQTTReasonCode(rawValue: 0x85)
    /// 0x86: wrong user name or password.
    public static let badUserNameOrPassword = MQTTReasonCode(rawValue: 0x86)
    /// 0x87: not allowed (credentials or ACL).
    public static let notAuthorized = MQTTReasonCode(rawValue: 0x87)
    /// 0x8B: the broker is shutting down.
    public static let serverShuttingDown = MQTTReasonCode(rawValue: 0x8B)
    /// 0x8E: another connection with the same client identifier took the session over.
    public static let sessionTakenOver = MQTTReasonCode(rawValue: 0x8E)
    /// 0x8F: the broker does not accept this topic filter.
    public static let topicFilterInvalid = MQTTReasonCode(rawValue: 0x8F)
    /// 0x90: the broker does not accept this topic name.
    public static let topicNameInvalid = MQTTReasonCode(rawValue: 0x90)
    /// 0x95: the packet exceeds the broker's maximum packet size.
    public static let packetTooLarge = MQTTReasonCode(rawValue: 0x95)
    /// 0x97: a broker quota was exceeded.
    public static let quotaExceeded = MQTTReasonCode(rawValue: 0x97)

    /// True for codes below 0x80, which MQTT 5 defines as success.
    public var isSuccess: Bool { rawValue < 0x80 }

    /// libmosquitto's text for the code, e.g. `Bad User Name or Password`.
    public var description: String {
        "\(Mosquitto.reasonString(Int32(rawValue))) (0x\(String(rawValue, radix: 16, uppercase: true)))"
    }
}

/// A failure of the MQTT client: what it was doing, why, and libmosquitto's own message.
public struct MQTTError: Error, Sendable, Equatable, CustomStringConvertible {
    /// What kind of failure this is; switch on it to decide whether to retry.
    public enum Code: Sendable, Equatable {
        /// The broker URL could not be parsed or uses an unsupported scheme.
        case invalidURL
        /// A configuration value is out of range, missing or contradictory; `detail` names it.
        case invalidConfiguration
        /// A topic name or filter breaks the MQTT rules.
        case invalidTopic
        /// libmosquitto returned this `mosq_err_t` value.
        case library(Int32)
        /// The broker refused the connection (CONNACK) with this reason code.
        case connectionRefused(MQTTReasonCode)
        /// The broker answered a publish, subscribe or unsubscribe with a failure reason code (MQTT 5).
        case rejected(MQTTReasonCode)
        /// The broker ended the connection with a DISCONNECT carrying this reason code (MQTT 5), e.g. session taken
        /// over by another client with the same client ID.
        case disconnectedByBroker(MQTTReasonCode)
        /// The message was dropped from the offline queue because the queue was full.
        case dropped
        /// The client was shut down before the operation finished.
        case shutDown
        /// The awaiting task was cancelled (the operation itself may still complete).
        case cancelled
    }

    /// The kind of failure.
    public let code: Code
    /// What the client was doing, e.g. `publish to sensors/kitchen/temperature`.
    public let operation: String
    /// Why it failed, in libmosquitto's words where it has any.
    public let detail: String

    /// Creates an error; `detail` should be the library's text when there is one.
    public init(_ code: Code, operation: String, detail: String) {
        self.code = code
        self.operation = operation
        self.detail = detail
    }

    /// `operation: detail`, ready for a log line.
    public var description: String { "\(operation): \(detail)" }

    /// The MQTT reason code, when the broker sent one.
    public var reasonCode: MQTTReasonCode? {
        switch code {
        case .connectionRefused(let reason), .rejected(let reason), .disconnectedByBroker(let reason): reason
        default: nil
        }
    }
}
