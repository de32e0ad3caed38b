// The only code that touches libmosquitto. Everything here is internal: no C type leaves this file's callers
// inside the target. Each C call goes through `check`, which turns a mosq_err_t into an MQTTError with context.
internal import CMosquitto

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

/// Library-wide helpers (initialisation, error strings, topic checks).
enum Mosquitto {
    /// `mosquitto_lib_init` once per process. Swift runs a global's initialiser exactly once, thread-safely.
    private static let initialised: Int32 = mosquitto_lib_init()

    /// Initialises libmosquitto if nobody did yet; returns its result code.
    @discardableResult
    static func initialise() -> Int32 { initialised }

    static let success = MOSQ_ERR_SUCCESS.rawValue

    /// libmosquitto's text for a mosq_err_t (errno's text for MOSQ_ERR_ERRNO).
    static func errorString(_ code: Int32) -> String {
        String(cString: mosquitto_strerror(code))
    }

    /// libmosquitto's text for an MQTT 5 reason code.
    static func reasonString(_ code: Int32) -> String {
        String(cString: mosquitto_reason_string(code))
    }

    /// libmosquitto's text for an MQTT 3.1.1 CONNACK return code.
    static func connackString(_ code: Int32) -> String {
        String(cString: mosquitto_connack_string(code))
    }

    /// Turns a mosq_err_t into a thrown error naming `operation`.
    static func check(_ code: Int32, _ operation: @autoclosure () -> String) throws(MQTTError) {
        guard code != success else { return }
        throw error(code, operation())
    }

    /// An `MQTTError` for a mosq_err_t.
    static func error(_ code: Int32, _ operation: String, extra: String? = nil) -> MQTTError {
        var detail = errorString(code)
        if let extra, !extra.isEmpty { detail += " (\(extra))" }
        return MQTTError(.library(code), operation: operation, detail: detail)
    }

    /// libmosquitto's own topic matcher (used by the tests to check `MQTTTopic.matches`).
    static func topicMatches(filter: String, topic: String) -> Bool? {
        var result = false
        let rc = mosquitto_topic_matches_sub(filter, topic, &result)
        return rc == success ? result : nil
    }

    /// libmosquitto's filter check (used by the tests to check `MQTTTopic.validateFilter`).
    static func isValidFilter(_ filter: String) -> Bool {
        mosquitto_sub_topic_check(filter) == success
    }

    /// libmosquitto's topic-name check.
    static func isValidTopicName(_ topic: String) -> Bool {
        mosquitto_pub_topic_check(topic) == success
    }
}

/// An owned `mosquitto_property` list; freed in `deinit` unless ownership moved to libmosquitto.
/// Sendable because it is built on one thread and only read after being handed over (the connect properties go
/// to the loop thread once).
final class MosquittoProperties: @unchecked Sendable {
    var list: OpaquePointer?

    init() {}

    deinit { mosquitto_property_free_all(&list) }

    /// Gives the list away (libmosquitto took it); `deinit` then frees nothing.
    func release() { list = nil }

    func add(byte id: mqtt5_property, _ value: UInt8, _ operation: String) throws(MQTTError) {
        try Mosquitto.check(mosquitto_property_add_byte(&list, Int32(id.rawValue), value), operation)
    }

    func add(int32 id: mqtt5_property, _ value: UInt32, _ operation: String) throws(MQTTError) {
        try Mosquitto.check(mosquitto_property_add_int32(&list, Int32(id.rawValue), value), operation)
    }

    func add(int16 id: mqtt5_property, _ value: UInt16, _ operation: String) throws(MQTTError) {
        try Mosquitto.check(mosquitto_property_add_int16(&list, Int32(id.rawValue), value), operation)
    }

    func add(string id: mqtt5_property, _ value: String, _ operation: String) throws(MQTTError) {
        try Mosquitto.check(mosquitto_property_add_string(&list, Int32(id.rawValue), value), operation)
    }

    func add(binary id: mqtt5_property, _ value: [UInt8], _ operation: String) throws(MQTTError) {
        guard value.count <= Int(UInt16.max) else {
            throw MQTTError(.invalidConfiguration, operation: operation, detail: "binary property over 65535 bytes")
        }
        let rc = value.withUnsafeBytes { raw in
            mosquitto_property_add_binary(&list, Int32(id.rawValue), raw.baseAddress, UInt16(raw.count))
        }
        try Mosquitto.check(rc, operation)
    }

    func add(pair id: mqtt5_property, _ name: String, _ value: String, _ operation: String) throws(MQTTError) {
        try Mosquitto.check(mosquitto_property_add_string_pair(&list, Int32(id.rawValue), name, value), operation)
    }

    /// Builds the PUBLISH (or will) property list for `properties`.
    static func publish(_ properties: MQTTPublishProperties, _ operation: String) throws(MQTTError)
        -> MosquittoProperties
    {
        let built = MosquittoProperties()
        if let utf8 = properties.payloadIsUTF8 {
            try built.add(byte: MQTT_PROP_PAYLOAD_FORMAT_INDICATOR, utf8 ? 1 : 0, operation)
        }
        if let expiry = properties.messageExpiry {
            let seconds = max(0, min(expiry.components.seconds, Int64(UInt32.max)))
            try built.add(int32: MQTT_PROP_MESSAGE_EXPIRY_INTERVAL, UInt32(seconds), operation)
        }
        if let contentType = properties.contentType {
            try built.add(string: MQTT_PROP_CONTENT_TYPE, contentType, operation)
        }
        if let responseTopic = properties.responseTopic {
            try built.add(string: MQTT_PROP_RESPONSE_TOPIC, responseTopic, operation)
        }
        if let correlationData = properties.correlationData {
            try built.add(binary: MQTT_PROP_CORRELATION_DATA, correlationData, operation)
        }
        for property in properties.userProperties {
            try built.add(pair: MQTT_PROP_USER_PROPERTY, property.name, property.value, operation)
        }
        return built
    }

    /// Copies the PUBLISH properties out of a received list (strings and bytes are copied and the C copies freed).
    static func decodePublish(_ list: OpaquePointer?) -> MQTTPublishProperties {
        var result = MQTTPublishProperties()
        var cursor = list
        while let property = cursor {
            let id = mosquitto_property_identifier(property)
            switch UInt32(bitPattern: id) {
            case MQTT_PROP_PAYLOAD_FORMAT_INDICATOR.rawValue:
                var value: UInt8 = 0
                if mosquitto_property_read_byte(property, id, &value, false) != nil {
                    result.payloadIsUTF8 = value == 1
                }
            case MQTT_PROP_MESSAGE_EXPIRY_INTERVAL.rawValue:
                var value: UInt32 = 0
                if mosquitto_property_read_int32(property, id, &value, false) != nil {
                    result.messageExpiry = .seconds(Int64(value))
                }
            case MQTT_PROP_CONTENT_TYPE.rawValue:
                result.contentType = readString(property, id)
            case MQTT_PROP_RESPONSE_TOPIC.rawValue:
                result.responseTopic = readString(property, id)
            case MQTT_PROP_CORRELATION_DATA.rawValue:
                var value: UnsafeMutableRawPointer? = nil
                var length: UInt16 = 0
                if mosquitto_property_read_binary(property, id, &value, &length, false) != nil {
                    if let value {
                        result.correlationData = Array(UnsafeRawBufferPointer(start: value, count: Int(length)))
                        free(value)
                    } else {
                        result.correlationData = []
                    }
                }
            case MQTT_PROP_USER_PROPERTY.rawValue:
                var name: UnsafeMutablePointer<CChar>? = nil
                var value: UnsafeMutablePointer<CChar>? = nil
                if mosquitto_property_read_string_pair(property, id, &name, &value, false) != nil {
                    let pair = MQTTUserProperty(
                        name.map { String(cString: $0) } ?? "", value.map { String(cString: $0) } ?? "")
                    result.userProperties.append(pair)
                    free(name)
                    free(value)
                }
            default:
                break
            }
            cursor = mosquitto_property_next(property)
        }
        return result
    }

    /// Reads one string property (e.g. a reason string) out of a list, if present.
    static func string(_ list: OpaquePointer?, _ id: mqtt5_property) -> String? {
        var value: UnsafeMutablePointer<CChar>? = nil
        guard mosquitto_property_read_string(list, Int32(id.rawValue), &value, false) != nil, let value else {
            return nil
        }
        defer { free(value) }
        return String(cString: value)
    }

    private static func readString(_ property: OpaquePointer, _ id: Int32) -> String? {
        var value: UnsafeMutablePointer<CChar>? = nil
        guard mosquitto_property_read_string(property, id, &value, false) != nil, let value else { return nil }
        defer { free(value) }
        return String(cString: value)
    }
}
