// The 0x2904 Characteristic Presentation Format descriptor (SPEC.md §3.16): decoding the descriptor itself, and
// decoding any characteristic value by it.

/// A decoded Characteristic Presentation Format descriptor, which describes one characteristic value: its format,
/// a decimal exponent, a unit (a unit UUID) and a description in a name space.
public struct PresentationFormat: Sendable, Equatable {
    /// The format code (`0x06` = uint16; see `formatName`).
    public var format: UInt8
    /// value = raw × 10^exponent, for the integer formats.
    public var exponent: Int8
    /// The 16-bit unit UUID (`0x272F` = degree Celsius).
    public var unit: UInt16
    /// 0x01 = Bluetooth SIG.
    public var namespace: UInt8
    /// The description code in `namespace` (0 = unknown).
    public var descriptionCode: UInt16

    /// The descriptor's UUID, 0x2904.
    public static let uuid = BluetoothUUID(UInt16(0x2904))

    /// A descriptor from its parts.
    public init(format: UInt8, exponent: Int8, unit: UInt16, namespace: UInt8 = 1, description: UInt16 = 0) {
        self.format = format
        self.exponent = exponent
        self.unit = unit
        self.namespace = namespace
        self.descriptionCode = description
    }

    /// Parses the 7-octet descriptor value. Throws `truncated` when shorter, `invalidLength` when longer.
    public init(descriptor bytes: [UInt8]) throws(GATTParseError) {
        try checkLength(bytes, 7)
        var cursor = ByteCursor(bytes)
        format = try cursor.u8()
        exponent = try cursor.s8()
        unit = try cursor.u16()
        namespace = try cursor.u8()
        descriptionCode = try cursor.u16()
    }

    /// The 7 octets.
    public var descriptorBytes: [UInt8] {
        var writer = ByteWriter(capacity: 7)
        writer.u8(format)
        writer.u8(UInt8(bitPattern: exponent))
        writer.u16(unit)
        writer.u8(namespace)
        writer.u16(descriptionCode)
        return writer.bytes
    }

    /// The format's short name (`uint16`, `medfloat16`), or nil for a reserved code.
    public var formatName: String? { Self.formats[Int(format)]?.name }

    /// The unit's name (`degree_celsius`), when it is in the table.
    public var unitName: String? { Self.units[unit]?.name }

    /// The field suffix for the unit (`c` for degree Celsius, `pct` for percentage), when known.
    public var unitSuffix: String? { Self.units[unit]?.suffix }

    /// The descriptor itself as a reading: `format`, `format_name`, `exponent`, `unit_uuid`, `unit_name`,
    /// `namespace`, `description`, `description_name`.
    public var reading: GATTReading {
        var reading = GATTReading(capacity: 8)
        reading.append("format", .int(Int64(format)))
        reading.append("format_name", formatName.map { .string($0) } ?? .null)
        reading.append("exponent", .int(Int64(exponent)))
        reading.append("unit_uuid", .string(hex(UInt64(unit), 4).uppercased()))
        reading.append("unit_name", unitName.map { .string($0) } ?? .null)
        reading.append("namespace", .int(Int64(namespace)))
        reading.append("description", .int(Int64(descriptionCode)))
        if namespace == 1, let name = Self.descriptionName(descriptionCode) {
            reading.append("description_name", .string(name))
        }
        return reading
    }

    /// Decodes a characteristic value by this format. The value becomes `value_<unit suffix>` (`value_c`), or
    /// `value` for unitless and unknown units, followed by `unit` (the unit's name) or `unit_uuid`.
    /// Throws when the value's length does not match a fixed-size format.
    public func decodeValue(_ bytes: [UInt8]) throws(GATTParseError) -> GATTReading {
        guard let info = Self.formats[Int(format)] else {
            throw .unsupported("presentation format 0x\(hex(UInt64(format), 2)) is reserved")
        }
        if let size = info.size {
            guard bytes.count == size else {
                if bytes.count < size { throw .truncated(offset: 0, needed: size, available: bytes.count) }
                throw .invalidLength(expected: "\(size) octet(s) for \(info.name)", actual: bytes.count)
            }
        }
        var cursor = ByteCursor(bytes)
        let value: GATTValue
        switch format {
        case 0x01: value = .bool(try cursor.u8() & 0x01 != 0)
        case 0x02: value = .int(Int64(try cursor.u8() & 0x03))
        case 0x03: value = .int(Int64(try cursor.u8() & 0x0F))
        case 0x04, 0x06, 0x07, 0x08, 0x09:
            value = scaled(Int64(try cursor.uintLE(info.size ?? 1)))
        case 0x05: value = scaled(Int64(try cursor.u16() & 0x0FFF))
        case 0x0A:
            let raw = try cursor.uintLE(8)
            value = raw > UInt64(Int64.max) ? .double(Double(raw) * decimalFactor) : scaled(Int64(raw))
        case 0x0C, 0x0E, 0x0F, 0x10, 0x11, 0x12:
            value = scaled(try cursor.sintLE(info.size ?? 1))
        case 0x0D: value = scaled(signExtend(UInt64(try cursor.u16() & 0x0FFF), bits: 12))
        case 0x14:
            let f = Float(bitPattern: try cursor.u32())
            value = finite(Double(f))
        case 0x15: value = finite(Double(bitPattern: try cursor.uintLE(8)))
        case 0x16: value = MedicalFloat.decodeSFLOAT(try cursor.u16())
        case 0x17: value = MedicalFloat.decodeFLOAT(try cursor.u32())
        case 0x18: value = .array([.int(Int64(try cursor.u16())), .int(Int64(try cursor.u16()))])
        case 0x19: value = .string(decodeUTF8(bytes[...]))
        case 0x1A:
            var codeUnits: [UInt16] = []
            while cursor.remaining >= 2 { codeUnits.append(try cursor.u16()) }
            while codeUnits.last == 0 { codeUnits.removeLast() }
            value = .string(String(decoding: codeUnits, as: UTF16.self))
        default:
            // uint128, sint128, struct, medASN1: published as hex.
            value = .string(hexString(bytes))
        }
        var reading = GATTReading(capacity: 2)
        if let suffix = unitSuffix, unit != 0x2700 {
            reading.append("value_\(suffix)", value)
        } else {
            reading.append("value", value)
        }
        if let unitName {
            reading.append("unit", .string(unitName))
        } else {
            reading.append("unit_uuid", .string(hex(UInt64(unit), 4).uppercased()))
        }
        return reading
    }

    /// The fields `decodeValue` publishes, known before any value: `value_<unit suffix>` (`value` when unitless or
    /// unknown) with its Home Assistant unit, device and state class, then `unit` (the unit's name) or `unit_uuid`.
    /// Empty for a reserved format, which `decodeValue` rejects.
    public var fields: [GATTFieldDescriptor] {
        guard Self.formats[Int(format)] != nil else { return [] }
        let suffix = unit == 0x2700 ? nil : unitSuffix
        let name = suffix.map { "value_\($0)" } ?? "value"
        var value: GATTFieldDescriptor
        switch format {
        case 0x01: value = .boolean(name)
        case 0x18: value = .structured(name)
        case 0x0B, 0x13, 0x19, 0x1A, 0x1B, 0x1C: value = .text(name)
        default:
            // The unit's Home Assistant spelling and classes come from the same suffix conventions as every name.
            value = suffix == nil ? .plain(name, stateClass: "measurement") : .number(name)
        }
        return [value, .text(unitName == nil ? "unit_uuid" : "unit")]
    }

    /// Decodes `bytes` as the 7-octet descriptor `descriptor` describes.
    public static func decode(_ bytes: [UInt8], descriptor: [UInt8]) throws(GATTParseError) -> GATTReading {
        try PresentationFormat(descriptor: descriptor).decodeValue(bytes)
    }

    private var decimalFactor: Double {
        exponent >= 0 ? powerOfTen(Int(exponent)) : 1 / powerOfTen(-Int(exponent))
    }

    private func scaled(_ raw: Int64) -> GATTValue {
        exponent == 0 ? .int(raw) : .double(scaledDecimal(raw, exponent: Int(exponent)))
    }

    private func finite(_ d: Double) -> GATTValue {
        if d.isNaN { return .string("NaN") }
        if d.isInfinite { return .string(d > 0 ? "+INF" : "-INF") }
        return .double(d)
    }

    static func descriptionName(_ code: UInt16) -> String? {
        let names = [
            "front", "back", "top", "bottom", "upper", "lower", "main", "backup", "auxiliary", "supplementary",
            "flash", "inside", "outside", "left", "right", "internal", "external",
        ]
        if code == 0 { return "unknown" }
        if code >= 1 && code <= 255 { return "\(code)" }
        let index = Int(code) - 0x0100
        return index >= 0 && index < names.count ? names[index] : nil
    }

    /// Format codes: short name and size in octets (nil = variable).
    static let formats: [Int: (name: String, size: Int?)] = [
        0x01: ("boolean", 1), 0x02: ("uint2", 1), 0x03: ("uint4", 1), 0x04: ("uint8", 1), 0x05: ("uint12", 2),
        0x06: ("uint16", 2), 0x07: ("uint24", 3), 0x08: ("uint32", 4), 0x09: ("uint48", 6), 0x0A: ("uint64", 8),
        0x0B: ("uint128", 16), 0x0C: ("sint8", 1), 0x0D: ("sint12", 2), 0x0E: ("sint16", 2), 0x0F: ("sint24", 3),
        0x10: ("sint32", 4), 0x11: ("sint48", 6), 0x12: ("sint64", 8), 0x13: ("sint128", 16), 0x14: ("float32", 4),
        0x15: ("float64", 8), 0x16: ("medfloat16", 2), 0x17: ("medfloat32", 4), 0x18: ("uint16[2]", 4),
        0x19: ("utf8s", nil), 0x1A: ("utf16s", nil), 0x1B: ("struct", nil), 0x1C: ("medASN1", nil),
    ]

    /// Unit UUIDs: name (the last part of `org.bluetooth.unit.*`) and field suffix.
    static let units: [UInt16: (name: String, suffix: String)] = [
        0x2700: ("unitless", ""), 0x2701: ("metre", "m"), 0x2702: ("kilogram", "kg"), 0x2703: ("second", "s"),
        0x2704: ("ampere", "a"), 0x2705: ("kelvin", "k"), 0x272F: ("degree_celsius", "c"),
        0x27AC: ("degree_fahrenheit", "f"), 0x27AD: ("percentage", "pct"), 0x2724: ("pascal", "pa"),
        0x2780: ("bar", "bar"), 0x2781: ("millimetre_of_mercury", "mmhg"), 0x2731: ("lux", "lx"),
        0x2728: ("volt", "v"), 0x2726: ("watt", "w"), 0x2725: ("joule", "j"), 0x27AB: ("kilowatt_hour", "kwh"),
        0x2722: ("hertz", "hz"), 0x2712: ("metres_per_second", "m_s"),
        0x2713: ("metres_per_second_squared", "m_s2"), 0x271B: ("kilogram_per_cubic_metre", "kg_m3"),
        0x2715: ("kilogram_per_cubic_metre", "kg_m3"), 0x27AF: ("beats_per_minute", "bpm"),
        0x27A8: ("revolution_per_minute", "rpm"), 0x2763: ("degree", "deg"), 0x27A3: ("foot", "ft"),
        0x27A2: ("inch", "in"), 0x27B8: ("pound", "lb"), 0x27C3: ("decibel_spl", "db"), 0x2760: ("minute", "min"),
        0x2761: ("hour", "h"), 0x2762: ("day", "d"), 0x27B0: ("ampere_hours", "ah"),
        0x27AA: ("kilogram_calorie", "kcal"),
    ]
}

/// The 0x2904 descriptor itself as a "characteristic", so that `blebridge decode gatt 2904 HEX` describes it.
public struct PresentationFormatDescriptorParser: GATTCharacteristicParser {
    /// The descriptor UUID (0x2904).
    public let uuids = [PresentationFormat.uuid]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "characteristic_presentation_format"

    /// Creates the parser.
    public init() {}

    /// `format`, `format_name`, `exponent`, `unit_uuid`, `unit_name`, `namespace`, `description`,
    /// `description_name`: codes and names, without units.
    public var fields: [GATTFieldDescriptor] {
        [
            .plain("format"), .text("format_name"), .plain("exponent"), .text("unit_uuid"), .text("unit_name"),
            .plain("namespace"), .plain("description"), .text("description_name"),
        ]
    }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        try PresentationFormat(descriptor: bytes).reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        func field(_ key: String, _ range: ClosedRange<Int64>) throws(GATTParseError) -> Int64 {
            let raw = try value.required(key, in: name)
            if key == "unit_uuid", let text = raw.stringValue, let uuid = BluetoothUUID(text),
                let short = uuid.shortValue
            {
                return Int64(short)
            }
            guard let i = raw.integerValue, range.contains(i) else {
                throw .notEncodable("\(name): \(key) \(raw) is out of range")
            }
            return i
        }
        return PresentationFormat(
            format: UInt8(try field("format", 0...255)), exponent: Int8(try field("exponent", -128...127)),
            unit: UInt16(try field("unit_uuid", 0...0xFFFF)), namespace: UInt8(try field("namespace", 0...255)),
            description: UInt16(try field("description", 0...0xFFFF))
        ).descriptorBytes
    }
}
