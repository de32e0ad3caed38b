// Topic names and filters (MQTT 5 §4.7): validation and matching in pure Swift, checked in the tests against
// libmosquitto's own mosquitto_topic_matches_sub and mosquitto_sub_topic_check.

/// Topic name and topic filter rules.
public enum MQTTTopic {
    /// Checks a topic name we publish to: not empty, at most 65535 bytes, no `+`, `#` or NUL.
    ///
    /// - Throws: `MQTTError` with code `.invalidTopic`.
    public static func validateName(_ topic: String) throws(MQTTError) {
        func fail(_ why: String) -> MQTTError {
            MQTTError(.invalidTopic, operation: "check topic \"\(topic)\"", detail: why)
        }
        let utf8 = topic.utf8
        guard !utf8.isEmpty else { throw fail("a topic name must not be empty") }
        guard utf8.count <= 65_535 else { throw fail("longer than 65535 bytes") }
        for byte in utf8 {
            switch byte {
            case UInt8(ascii: "+"), UInt8(ascii: "#"): throw fail("wildcards (+, #) are only allowed in filters")
            case 0: throw fail("contains a NUL character")
            default: continue
            }
        }
    }

    /// Checks a topic filter we subscribe with: not empty, at most 65535 bytes, `+` only as a whole level, `#` only
    /// as the whole last level, no NUL.
    ///
    /// - Throws: `MQTTError` with code `.invalidTopic`.
    public static func validateFilter(_ filter: String) throws(MQTTError) {
        func fail(_ why: String) -> MQTTError {
            MQTTError(.invalidTopic, operation: "check topic filter \"\(filter)\"", detail: why)
        }
        let bytes = Array(filter.utf8)
        guard !bytes.isEmpty else { throw fail("a topic filter must not be empty") }
        guard bytes.count <= 65_535 else { throw fail("longer than 65535 bytes") }
        let slash = UInt8(ascii: "/")
        for (index, byte) in bytes.enumerated() {
            let before: UInt8? = index > 0 ? bytes[index - 1] : nil
            let after: UInt8? = index + 1 < bytes.count ? bytes[index + 1] : nil
            switch byte {
            case 0:
                throw fail("contains a NUL character")
            case UInt8(ascii: "+"):
                guard (before == nil || before == slash) && (after == nil || after == slash) else {
                    throw fail("+ must be a whole level, as in a/+/c")
                }
            case UInt8(ascii: "#"):
                guard (before == nil || before == slash) && after == nil else {
                    throw fail("# must be the whole last level, as in a/b/#")
                }
            default:
                continue
            }
        }
    }

    /// True when `topic` (a topic name) matches `filter` (a valid filter).
    ///
    /// `+` matches exactly one level (an empty level too), `#` matches the parent level and any number of levels
    /// below it, and topics that start with `$` (like `$SYS/...`) are not matched by a filter whose first level
    /// is a wildcard.
    public static func matches(filter: String, topic: String) -> Bool {
        let filterLevels = filter.utf8.split(separator: UInt8(ascii: "/"), omittingEmptySubsequences: false)
        let topicLevels = topic.utf8.split(separator: UInt8(ascii: "/"), omittingEmptySubsequences: false)
        if topic.utf8.first == UInt8(ascii: "$") {
            if let first = filterLevels.first, first.elementsEqual("+".utf8) || first.elementsEqual("#".utf8) {
                return false
            }
        }
        var index = 0
        while index < filterLevels.count {
            let level = filterLevels[index]
            if level.elementsEqual("#".utf8) {
                return index == filterLevels.count - 1
            }
            guard index < topicLevels.count else { return false }
            if !level.elementsEqual("+".utf8) && !level.elementsEqual(topicLevels[index]) {
                return false
            }
            index += 1
        }
        return index == topicLevels.count
    }
}
