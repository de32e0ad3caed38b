// Declarative characteristic parsers: a vendor characteristic described in the configuration as a list of fields
// (name, type, offset, optional scale, add and enum names). The same description decodes values and encodes writes.
// The configuration loader fills `DeclarativeParserSpec`; `DeclarativeParser` validates it and names the path of
// every problem (`parsers[0].fields[2].type: "u17" is not a field type`). See config/PARSERS.md.

/// One declared parser, as written in the configuration.
public struct DeclarativeParserSpec: Sendable, Equatable {
    /// snake_case name (`acme_climate`), unique among all parsers.
    public var name: String
    /// The characteristic UUID in any form `BluetoothUUID(_:)` accepts.
    public var uuid: String
    /// The fields, in publishing order.
    public var fields: [DeclarativeFieldSpec]

    /// A declaration; `DeclarativeParser.init` validates it.
    public init(name: String, uuid: String, fields: [DeclarativeFieldSpec]) {
        self.name = name
        self.uuid = uuid
        self.fields = fields
    }
}

/// One field of a declared parser.
public struct DeclarativeFieldSpec: Sendable, Equatable {
    /// The published field name (snake_case, the unit as a suffix: `temperature_c`).
    public var name: String
    /// `u8 u16 u24 u32 s8 s16 s24 s32` with `le` or `be` (`u16le`; no suffix = little-endian), `sfloat`, `float`,
    /// `utf8`, `hex`, or `bool:bitN` (bit N counted from the octet at `offset`, least significant first).
    public var type: String
    /// The octet offset of the field in the value.
    public var offset: Int
    /// value = raw × scale + add (numeric types only).
    public var scale: Double?
    /// Added after scaling.
    public var add: Double?
    /// Names for raw integer values; publishes `<name>` (the integer) and `<name>_name`.
    public var enumNames: [Int64: String]?
    /// For `utf8` and `hex`: the length in octets; nil = to the end of the value.
    public var length: Int?
    /// The Home Assistant `unit_of_measurement` (`"°C"`, `"hPa"`); nil = inferred from the name's suffix.
    public var unit: String?
    /// The Home Assistant device class (`temperature`; `door` for a `bool:bitN`); nil = inferred from the name.
    public var deviceClass: String?
    /// The Home Assistant state class (`measurement`, `total`, `total_increasing`); nil = inferred from the name.
    public var stateClass: String?

    /// Creates a field; `type` and the other values are checked when the parser is built.
    public init(
        name: String, type: String, offset: Int, scale: Double? = nil, add: Double? = nil,
        enumNames: [Int64: String]? = nil, length: Int? = nil, unit: String? = nil, deviceClass: String? = nil,
        stateClass: String? = nil
    ) {
        self.name = name
        self.type = type
        self.offset = offset
        self.scale = scale
        self.add = add
        self.enumNames = enumNames
        self.length = length
        self.unit = unit
        self.deviceClass = deviceClass
        self.stateClass = stateClass
    }
}

/// An invalid declaration: the path of the offending item and what is wrong with it.
public struct DeclarativeParserError: Error, Sendable, Equatable, CustomStringConvertible {
    /// `parsers[0].fields[2].type`
    public let path: String
    /// What is wrong (`"u17" is not a field type`).
    public let reason: String

    /// An error at `path`.
    public init(path: String, reason: String) {
        self.path = path
        self.reason = reason
    }

    /// The text people read in logs and error output.
    public var description: String { "\(path): \(reason)" }
}

/// A validated field type.
public enum DeclarativeFieldType: Sendable, Equatable {
    /// An integer of 1 to 4 octets (`u8`, `s16le`, `u24be`, ...).
    case integer(width: Int, signed: Bool, bigEndian: Bool)
    /// An IEEE 11073 16-bit SFLOAT.
    case sfloat
    /// An IEEE 11073 32-bit FLOAT.
    case float
    /// UTF-8 text (`length` octets, or to the end of the value).
    case utf8
    /// Raw bytes published as hex (`length` octets, or to the end of the value).
    case hex
    /// One bit (0...31, counted from the least significant bit of the octet at `offset`), as true or false.
    case bit(Int)

    /// Parses the configuration's spelling, or nil.
    public init?(_ text: String) {
        switch text {
        case "sfloat": self = .sfloat
        case "float": self = .float
        case "utf8": self = .utf8
        case "hex": self = .hex
        default:
            if text.hasPrefix("bool:bit") {
                guard let n = Int(text.dropFirst("bool:bit".count)), (0...31).contains(n),
                    !text.hasSuffix("+"), text.dropFirst("bool:bit".count).allSatisfy(\.isNumber)
                else { return nil }
                self = .bit(n)
                return
            }
            guard let first = text.first, first == "u" || first == "s" else { return nil }
            var rest = text.dropFirst()
            var bigEndian = false
            if rest.hasSuffix("le") {
                rest = rest.dropLast(2)
            } else if rest.hasSuffix("be") {
                rest = rest.dropLast(2)
                bigEndian = true
            }
            let width: Int
            switch rest {
            case "8": width = 1
            case "16": width = 2
            case "24": width = 3
            case "32": width = 4
            default: return nil
            }
            self = .integer(width: width, signed: first == "s", bigEndian: bigEndian)
        }
    }

    /// Fixed size in octets (nil for `utf8`/`hex` to the end).
    func size(length: Int?) -> Int? {
        switch self {
        case .integer(let width, _, _): return width
        case .sfloat: return 2
        case .float: return 4
        case .utf8, .hex: return length
        case .bit(let n): return n / 8 + 1
        }
    }

    var isNumeric: Bool {
        switch self {
        case .integer, .sfloat, .float: return true
        default: return false
        }
    }
}

/// A characteristic parser built from a `DeclarativeParserSpec`.
public struct DeclarativeParser: GATTCharacteristicParser {
    struct Field: Sendable {
        let name: String
        let type: DeclarativeFieldType
        let offset: Int
        let size: Int?
        let scale: Double?
        let add: Double?
        let enumNames: [Int64: String]?
    }

    /// The characteristic UUIDs this parser handles.
    public let uuids: [BluetoothUUID]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name: String
    /// The published fields in order, with their declared (or inferred) unit and Home Assistant classes; an `enum`
    /// field adds `<name>_name` (text) after the integer.
    public let fields: [GATTFieldDescriptor]
    let layout: [Field]
    /// Octets the fixed-size fields need.
    let minimumLength: Int

    /// Validates `spec`. `path` prefixes every error (`parsers[0]`).
    public init(_ spec: DeclarativeParserSpec, path: String = "parser") throws(DeclarativeParserError) {
        guard isSnakeCase(spec.name) else {
            throw DeclarativeParserError(path: "\(path).name", reason: "\"\(spec.name)\" is not a snake_case name")
        }
        guard let uuid = BluetoothUUID(spec.uuid) else {
            throw DeclarativeParserError(
                path: "\(path).uuid", reason: "\"\(spec.uuid)\" is not a UUID (2A6E, 0x2a6e or 8-4-4-4-12)")
        }
        guard !spec.fields.isEmpty else {
            throw DeclarativeParserError(path: "\(path).fields", reason: "at least one field is needed")
        }
        var layout: [Field] = []
        var descriptors: [GATTFieldDescriptor] = []
        var names: Set<String> = []
        var minimumLength = 0
        var toEnd: (offset: Int, path: String)?
        for (index, field) in spec.fields.enumerated() {
            let fieldPath = "\(path).fields[\(index)]"
            guard isSnakeCase(field.name) else {
                throw DeclarativeParserError(
                    path: "\(fieldPath).name", reason: "\"\(field.name)\" is not a snake_case name")
            }
            guard names.insert(field.name).inserted else {
                throw DeclarativeParserError(path: "\(fieldPath).name", reason: "\"\(field.name)\" is used twice")
            }
            guard let type = DeclarativeFieldType(field.type) else {
                throw DeclarativeParserError(
                    path: "\(fieldPath).type",
                    reason: "\"\(field.type)\" is not a field type (u8, s8, u16le, u16be, s16le, ... u32be, s32be, "
                        + "sfloat, float, utf8, hex, bool:bitN)")
            }
            guard field.offset >= 0, field.offset < 512 else {
                throw DeclarativeParserError(path: "\(fieldPath).offset", reason: "\(field.offset) is not 0...511")
            }
            if let scale = field.scale {
                guard type.isNumeric, scale.isFinite, scale != 0 else {
                    throw DeclarativeParserError(
                        path: "\(fieldPath).scale",
                        reason: type.isNumeric ? "must be a non-zero number" : "only numeric fields have a scale")
                }
            }
            if let add = field.add {
                guard type.isNumeric, add.isFinite else {
                    throw DeclarativeParserError(
                        path: "\(fieldPath).add",
                        reason: type.isNumeric ? "must be a number" : "only numeric fields have an add")
                }
            }
            if field.enumNames != nil {
                guard case .integer = type, field.scale == nil, field.add == nil else {
                    throw DeclarativeParserError(
                        path: "\(fieldPath).enum", reason: "only integer fields without scale or add have enum names")
                }
            }
            if let length = field.length {
                guard type == .utf8 || type == .hex else {
                    throw DeclarativeParserError(
                        path: "\(fieldPath).length", reason: "only utf8 and hex fields have a length")
                }
                guard length > 0, length <= 512 else {
                    throw DeclarativeParserError(path: "\(fieldPath).length", reason: "\(length) is not 1...512")
                }
            }
            let size = type.size(length: field.length)
            if let size {
                minimumLength = max(minimumLength, field.offset + size)
            } else {
                if let toEnd {
                    throw DeclarativeParserError(
                        path: "\(fieldPath).length",
                        reason: "only one field may run to the end of the value (\(toEnd.path) does already)")
                }
                toEnd = (field.offset, fieldPath)
            }
            layout.append(
                Field(
                    name: field.name, type: type, offset: field.offset, size: size, scale: field.scale,
                    add: field.add, enumNames: field.enumNames))
            descriptors += try Self.descriptors(field, type: type, path: fieldPath)
        }
        if let toEnd, toEnd.offset < minimumLength {
            throw DeclarativeParserError(
                path: "\(toEnd.path).offset",
                reason: "a field without a length runs to the end of the value, so it must come after every other field"
            )
        }
        self.uuids = [uuid]
        self.name = spec.name
        self.layout = layout
        self.fields = descriptors
        self.minimumLength = minimumLength
    }

    /// The published fields of one declared field, its metadata checked against Home Assistant's rules.
    ///
    /// Each of unit, device class and state class comes from the declaration when given, else from the name's
    /// conventions (`GATTFieldDescriptor.inferred(fromName:)`) as long as they fit what was declared: an inferred
    /// device class (and its state class) is dropped when the declared unit differs from the inferred one, an inferred
    /// unit or state class when the declared device class does not allow it.
    static func descriptors(_ field: DeclarativeFieldSpec, type: DeclarativeFieldType, path: String)
        throws(DeclarativeParserError) -> [GATTFieldDescriptor]
    {
        let kind: GATTFieldKind
        switch type {
        case .integer, .sfloat, .float: kind = .number
        case .utf8, .hex: kind = .text
        case .bit: kind = .boolean
        }
        let inferred = GATTFieldDescriptor.inferred(fromName: field.name)
        var descriptor = GATTFieldDescriptor(field.name, kind: kind)
        switch kind {
        case .number where field.enumNames != nil:
            // The integer is a code and `<name>_name` its meaning: neither has a unit or statistics.
            if field.unit != nil {
                throw DeclarativeParserError(path: "\(path).unit", reason: "an enum field has no unit")
            }
            if field.stateClass != nil {
                throw DeclarativeParserError(path: "\(path).state_class", reason: "an enum field has no state class")
            }
            var names = GATTFieldDescriptor.text(field.name + "_name")
            if let deviceClass = field.deviceClass {
                guard deviceClass == "enum" else {
                    throw DeclarativeParserError(
                        path: "\(path).device_class",
                        reason: "\"\(deviceClass)\": an enum field can only have device class enum (for <name>_name)")
                }
                names.deviceClass = deviceClass
            }
            return [descriptor, names]
        case .number:
            var unit = field.unit
            if unit == nil, let inferredUnit = inferred.unit {
                if let declared = field.deviceClass {
                    if GATTHomeAssistant.sensorDeviceClasses[declared]?.contains(inferredUnit) == true {
                        unit = inferredUnit
                    }
                } else {
                    unit = inferredUnit
                }
            }
            let deviceClass = field.deviceClass ?? (unit == inferred.unit ? inferred.deviceClass : nil)
            let asInferred = unit == inferred.unit && deviceClass == inferred.deviceClass
            descriptor.unit = unit
            descriptor.deviceClass = deviceClass
            descriptor.stateClass = field.stateClass ?? (asInferred ? inferred.stateClass : nil)
        case .boolean:
            descriptor.unit = field.unit
            descriptor.stateClass = field.stateClass
            descriptor.deviceClass =
                field.deviceClass ?? GATTHomeAssistant.binarySensorDeviceClass(forName: field.name)
        case .text, .structured:
            descriptor.unit = field.unit
            descriptor.stateClass = field.stateClass
            descriptor.deviceClass = field.deviceClass
        }
        do {
            try GATTHomeAssistant.validate(descriptor)
        } catch {
            throw DeclarativeParserError(path: "\(path).\(error.key)", reason: error.reason)
        }
        return [descriptor]
    }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var reading = GATTReading(capacity: layout.count + 2)
        for field in layout {
            let size = field.size ?? max(0, bytes.count - field.offset)
            guard field.offset + size <= bytes.count, field.offset <= bytes.count else {
                throw .truncated(
                    offset: field.offset, needed: size, available: max(0, bytes.count - field.offset))
            }
            var cursor = ByteCursor(bytes, offset: field.offset)
            switch field.type {
            case .integer(let width, let signed, let bigEndian):
                let raw: Int64
                if signed {
                    raw = bigEndian ? try cursor.sintBE(width) : try cursor.sintLE(width)
                } else {
                    raw = Int64(bigEndian ? try cursor.uintBE(width) : try cursor.uintLE(width))
                }
                reading.append(field.name, numeric(.int(raw), field))
                if let names = field.enumNames {
                    reading.append("\(field.name)_name", names[raw].map { .string($0) } ?? .null)
                }
            case .sfloat: reading.append(field.name, numeric(MedicalFloat.decodeSFLOAT(try cursor.u16()), field))
            case .float: reading.append(field.name, numeric(MedicalFloat.decodeFLOAT(try cursor.u32()), field))
            case .utf8: reading.append(field.name, .string(decodeUTF8(try cursor.bytes(size))))
            case .hex: reading.append(field.name, .string(hexString(try cursor.bytes(size))))
            case .bit(let n):
                try cursor.skip(n / 8)
                reading.append(field.name, .bool((try cursor.u8() >> UInt8(n % 8)) & 1 != 0))
            }
        }
        return reading
    }

    /// Applies scale and add; integers stay integers when there are none.
    private func numeric(_ value: GATTValue, _ field: Field) -> GATTValue {
        guard field.scale != nil || field.add != nil else { return value }
        guard let number = value.numberValue else { return value }  // IEEE-11073 special values stay strings
        var result = number
        if let scale = field.scale {
            // Divide by 100 rather than multiply by 0.01, so 2506 × 0.01 is exactly the double nearest 25.06.
            let inverse = 1 / scale
            if abs(inverse) > 1, inverse.rounded() == inverse {
                result = number / inverse
            } else {
                result = number * scale
            }
        }
        if let add = field.add { result += add }
        return .double(result)
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var out = [UInt8](repeating: 0, count: minimumLength)
        for field in layout {
            guard let fieldValue = value[field.name], fieldValue != .null else {
                if case .bit = field.type { continue }  // an absent flag is false
                throw .notEncodable("\(name): field \(field.name) is missing")
            }
            switch field.type {
            case .integer(let width, let signed, let bigEndian):
                var raw: Double
                if case .string(let text) = fieldValue, let names = field.enumNames,
                    let match = names.first(where: { $0.value == text })
                {
                    raw = Double(match.key)
                } else {
                    guard let number = unscaled(fieldValue, field) else {
                        throw .notEncodable("\(name): \(field.name) \(fieldValue) is not a number")
                    }
                    raw = number.rounded()
                }
                var writer = ByteWriter(capacity: width)
                try writer.integer(raw, width: width, signed: signed, field: field.name)
                let octets = bigEndian ? Array(writer.bytes.reversed()) : writer.bytes
                out.replaceSubrange(field.offset..<(field.offset + width), with: octets)
            case .sfloat, .float:
                let raw: GATTValue = unscaled(fieldValue, field).map { .double($0) } ?? fieldValue
                var writer = ByteWriter(capacity: 4)
                if field.type == .sfloat {
                    writer.u16(try MedicalFloat.encodeSFLOAT(raw, field: field.name))
                } else {
                    writer.u32(try MedicalFloat.encodeFLOAT(raw, field: field.name))
                }
                out.replaceSubrange(field.offset..<(field.offset + writer.bytes.count), with: writer.bytes)
            case .bit(let n):
                guard let flag = fieldValue.boolValue else {
                    throw .notEncodable("\(name): \(field.name) \(fieldValue) is not true or false")
                }
                if flag { out[field.offset + n / 8] |= 1 << UInt8(n % 8) }
            case .utf8, .hex:
                guard let text = fieldValue.stringValue else {
                    throw .notEncodable("\(name): \(field.name) \(fieldValue) is not a string")
                }
                var octets: [UInt8]
                if field.type == .utf8 {
                    octets = Array(text.utf8)
                } else {
                    guard let parsed = bytesFromHex(text) else {
                        throw .notEncodable("\(name): \(field.name) \"\(text)\" is not hex")
                    }
                    octets = parsed
                }
                if let size = field.size {
                    guard octets.count <= size, field.type == .utf8 || octets.count == size else {
                        throw .notEncodable("\(name): \(field.name) needs \(size) octet(s), got \(octets.count)")
                    }
                    octets += [UInt8](repeating: 0, count: size - octets.count)
                    out.replaceSubrange(field.offset..<(field.offset + size), with: octets)
                } else {
                    if out.count < field.offset { out += [UInt8](repeating: 0, count: field.offset - out.count) }
                    out.replaceSubrange(field.offset..<out.count, with: octets)
                }
            }
        }
        return out
    }

    /// The raw number before scale and add, for encoding.
    private func unscaled(_ value: GATTValue, _ field: Field) -> Double? {
        guard var number = value.numberValue else { return nil }
        if let add = field.add { number -= add }
        if let scale = field.scale {
            let inverse = 1 / scale
            number = abs(inverse) > 1 && inverse.rounded() == inverse ? number * inverse : number / scale
        }
        return number
    }
}

/// `[a-z][a-z0-9_]*`
func isSnakeCase(_ text: String) -> Bool {
    guard let first = text.utf8.first, first >= UInt8(ascii: "a"), first <= UInt8(ascii: "z") else { return false }
    return text.utf8.allSatisfy {
        ($0 >= UInt8(ascii: "a") && $0 <= UInt8(ascii: "z")) || ($0 >= UInt8(ascii: "0") && $0 <= UInt8(ascii: "9"))
            || $0 == UInt8(ascii: "_")
    }
}
