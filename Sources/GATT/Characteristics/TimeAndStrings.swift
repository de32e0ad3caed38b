// Date Time and Current Time (SPEC.md §3.14), Device Information strings (§3.15), GAP Device Name, PnP ID.

/// Date Time 0x2A08: exactly 7 octets → `timestamp` (or `null` + `timestamp_fields` when a part is not known).
public struct DateTimeParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A08))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "date_time"

    /// `timestamp` (ISO 8601 without a zone), `timestamp_fields` when a part is not known.
    public var fields: [GATTFieldDescriptor] { [.text("timestamp"), .structured("timestamp_fields")] }

    /// Creates the parser.
    public init() {}

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        try checkLength(bytes, 7)
        var cursor = ByteCursor(bytes)
        var reading = GATTReading(capacity: 2)
        try GATTDateTime.read(&cursor).append(to: &reading)
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var writer = ByteWriter(capacity: 7)
        try GATTDateTime.from(value).write(to: &writer, field: "timestamp")
        return writer.bytes
    }
}

/// Current Time 0x2A2B: exactly 10 octets → `timestamp`, `day_of_week` (1 = Monday, 0 = unknown → null),
/// `fractions256`, `adjust_reason` (bit field).
public struct CurrentTimeParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A2B))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "current_time"

    /// `timestamp` (+ `timestamp_fields`), `day_of_week`, `fractions256`, `adjust_reason`.
    public var fields: [GATTFieldDescriptor] {
        [
            .text("timestamp"), .structured("timestamp_fields"), .plain("day_of_week"), .plain("fractions256"),
            .plain("adjust_reason"),
        ]
    }

    /// Creates the parser.
    public init() {}

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        try checkLength(bytes, 10)
        var cursor = ByteCursor(bytes)
        var reading = GATTReading(capacity: 5)
        try GATTDateTime.read(&cursor).append(to: &reading)
        let dayOfWeek = try cursor.u8()
        reading.append("day_of_week", dayOfWeek == 0 ? .null : .int(Int64(dayOfWeek)))
        reading.append("fractions256", .int(Int64(try cursor.u8())))
        reading.append("adjust_reason", .int(Int64(try cursor.u8())))
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var writer = ByteWriter(capacity: 10)
        try GATTDateTime.from(value).write(to: &writer, field: "timestamp")
        let dayOfWeek = value["day_of_week"] ?? .null
        try writer.scaled(
            dayOfWeek == .null ? .int(0) : dayOfWeek, multiplier: 1, width: 1, signed: false, field: "day_of_week")
        try writer.scaled(
            value["fractions256"] ?? .int(0), multiplier: 1, width: 1, signed: false, field: "fractions256")
        try writer.scaled(
            value["adjust_reason"] ?? .int(0), multiplier: 1, width: 1, signed: false, field: "adjust_reason")
        return writer.bytes
    }
}

/// A UTF-8 string characteristic (utf8s): no terminator, trailing NUL padding stripped (SPEC.md §5.6); invalid
/// UTF-8 becomes U+FFFD rather than an error.
public struct StringCharacteristicParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids: [BluetoothUUID]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name: String
    /// The published field (`manufacturer_name`).
    public let field: String

    init(uuid: UInt16, name: String, field: String? = nil) {
        uuids = [BluetoothUUID(uuid)]
        self.name = name
        self.field = field ?? name
    }

    /// The string field.
    public var fields: [GATTFieldDescriptor] { [.text(field)] }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        GATTReading([GATTField(field, .string(decodeUTF8(bytes[...])))])
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        guard let text = try value.required(field, in: name).stringValue else {
            throw .notEncodable("\(name): \(field) is not a string")
        }
        return Array(text.utf8)
    }

    /// The Device Information and GAP strings.
    static let builtIn: [StringCharacteristicParser] = [
        StringCharacteristicParser(uuid: 0x2A00, name: "device_name"),
        StringCharacteristicParser(uuid: 0x2A29, name: "manufacturer_name"),
        StringCharacteristicParser(uuid: 0x2A24, name: "model_number"),
        StringCharacteristicParser(uuid: 0x2A25, name: "serial_number"),
        StringCharacteristicParser(uuid: 0x2A26, name: "firmware_revision"),
        StringCharacteristicParser(uuid: 0x2A27, name: "hardware_revision"),
        StringCharacteristicParser(uuid: 0x2A28, name: "software_revision"),
    ]
}

/// PnP ID 0x2A50: `vendor_id_source` (1 Bluetooth SIG, 2 USB-IF), `vendor_id`, `product_id`, `product_version`.
public struct PnPIDParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A50))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "pnp_id"

    /// `vendor_id_source`, `vendor_id`, `product_id`, `product_version`: identifiers.
    public var fields: [GATTFieldDescriptor] {
        [.plain("vendor_id_source"), .plain("vendor_id"), .plain("product_id"), .plain("product_version")]
    }

    /// Creates the parser.
    public init() {}

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        try checkLength(bytes, 7)
        var cursor = ByteCursor(bytes)
        return GATTReading([
            GATTField("vendor_id_source", .int(Int64(try cursor.u8()))),
            GATTField("vendor_id", .int(Int64(try cursor.u16()))),
            GATTField("product_id", .int(Int64(try cursor.u16()))),
            GATTField("product_version", .int(Int64(try cursor.u16()))),
        ])
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var writer = ByteWriter(capacity: 7)
        for (field, width) in [("vendor_id_source", 1), ("vendor_id", 2), ("product_id", 2), ("product_version", 2)] {
            try writer.scaled(
                try value.required(field, in: name), multiplier: 1, width: width, signed: false, field: field)
        }
        return writer.bytes
    }
}

/// Rejects anything but exactly `length` octets: shorter is `truncated`, longer `invalidLength`.
func checkLength(_ bytes: [UInt8], _ length: Int) throws(GATTParseError) {
    if bytes.count < length { throw .truncated(offset: 0, needed: length, available: bytes.count) }
    if bytes.count > length { throw .invalidLength(expected: "\(length) octets", actual: bytes.count) }
}

/// UTF-8 text with trailing NULs removed.
func decodeUTF8(_ bytes: ArraySlice<UInt8>) -> String {
    var end = bytes.endIndex
    while end > bytes.startIndex && bytes[end - 1] == 0 { end -= 1 }
    return String(decoding: bytes[bytes.startIndex..<end], as: UTF8.self)
}
