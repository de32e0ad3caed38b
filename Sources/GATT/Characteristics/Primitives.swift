// Primitive GATT encodings shared by the characteristic parsers (SPEC.md §2): IEEE 11073 SFLOAT/FLOAT, Date Time,
// exact decimal scaling, and the writer and field accessors the encoders use.

// MARK: - Decimal scaling

/// Exact powers of ten up to 10^22 (every one is exactly representable as a Double).
private let exactPowersOfTen: [Double] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19,
    1e20, 1e21, 1e22,
]

/// 10^n for n >= 0 (exact up to 22, a correctly chained product above).
@inline(__always)
func powerOfTen(_ n: Int) -> Double {
    if n >= 0 && n <= 22 { return exactPowersOfTen[n] }
    var value = 1e22
    var k = n - 22
    while k > 0 && value.isFinite {
        value *= 10
        k -= 1
    }
    return value
}

/// `mantissa × 10^exponent`, dividing for negative exponents so that `364 × 10^-1` is exactly the double nearest
/// 36.4 (multiplying by 0.1 would give 36.400000000000006).
@inline(__always)
public func scaledDecimal(_ mantissa: Int64, exponent: Int) -> Double {
    if exponent >= 0 { return Double(mantissa) * powerOfTen(exponent) }
    if exponent < -300 { return Double(mantissa) / powerOfTen(300) / powerOfTen(-exponent - 300) }
    return Double(mantissa) / powerOfTen(-exponent)
}

// MARK: - IEEE 11073-20601 SFLOAT / FLOAT

/// IEEE 11073-20601 medical floats (SPEC.md §2): SFLOAT (16-bit) and FLOAT (32-bit), with their special values.
public enum MedicalFloat {
    /// The special values, by their JSON spelling.
    static let nanText = "NaN"
    static let nresText = "NRes"
    static let positiveInfinityText = "+INF"
    static let negativeInfinityText = "-INF"
    static let reservedText = "RFU"

    /// Splits a raw SFLOAT into (mantissa, exponent), or nil for a special value (which `decodeSFLOAT` names).
    @inline(__always)
    static func sfloatParts(_ raw: UInt16) -> (mantissa: Int64, exponent: Int)? {
        switch raw {
        case 0x07FF, 0x0800, 0x07FE, 0x0802, 0x0801: return nil
        default:
            let exponent = Int(signExtend(UInt64(raw >> 12), bits: 4))
            let mantissa = signExtend(UInt64(raw & 0x0FFF), bits: 12)
            return (mantissa, exponent)
        }
    }

    /// Decodes a raw SFLOAT: a number, or the special value's string (`"NaN"`, `"NRes"`, `"+INF"`, `"-INF"`, `"RFU"`).
    @inline(__always)
    public static func decodeSFLOAT(_ raw: UInt16, scale: Int = 0) -> GATTValue {
        switch raw {
        case 0x07FF: return .string(nanText)
        case 0x0800: return .string(nresText)
        case 0x07FE: return .string(positiveInfinityText)
        case 0x0802: return .string(negativeInfinityText)
        case 0x0801: return .string(reservedText)
        default:
            let exponent = Int(signExtend(UInt64(raw >> 12), bits: 4))
            let mantissa = signExtend(UInt64(raw & 0x0FFF), bits: 12)
            return .double(scaledDecimal(mantissa, exponent: exponent + scale))
        }
    }

    /// Decodes a raw FLOAT: a number, or the special value's string.
    @inline(__always)
    public static func decodeFLOAT(_ raw: UInt32, scale: Int = 0) -> GATTValue {
        switch raw {
        case 0x007F_FFFF: return .string(nanText)
        case 0x0080_0000: return .string(nresText)
        case 0x007F_FFFE: return .string(positiveInfinityText)
        case 0x0080_0002: return .string(negativeInfinityText)
        case 0x0080_0001: return .string(reservedText)
        default:
            let exponent = Int(Int8(truncatingIfNeeded: raw >> 24))
            let mantissa = signExtend(UInt64(raw & 0x00FF_FFFF), bits: 24)
            return .double(scaledDecimal(mantissa, exponent: exponent + scale))
        }
    }

    /// Encodes a value as SFLOAT: a number (the most precise exponent that fits, then normalised so that exact
    /// decimals keep their shortest form, down to exponent 0) or a special-value string. Throws when the number is out of range.
    public static func encodeSFLOAT(_ value: GATTValue, field: String) throws(GATTParseError) -> UInt16 {
        if let special = specialCode(value, nan: 0x07FF, nres: 0x0800, plus: 0x07FE, minus: 0x0802, rfu: 0x0801) {
            return UInt16(special)
        }
        guard let number = value.numberValue else { throw .notEncodable("\(field): \(value) is not a number") }
        guard let (mantissa, exponent) = decimalParts(number, mantissaBits: 12, exponents: -8...7) else {
            throw .notEncodable("\(field): \(number) does not fit an SFLOAT")
        }
        return UInt16(truncatingIfNeeded: (exponent & 0xF) << 12) | UInt16(truncatingIfNeeded: mantissa & 0x0FFF)
    }

    /// Encodes a value as FLOAT (see `encodeSFLOAT`).
    public static func encodeFLOAT(_ value: GATTValue, field: String) throws(GATTParseError) -> UInt32 {
        if let special = specialCode(
            value, nan: 0x007F_FFFF, nres: 0x0080_0000, plus: 0x007F_FFFE, minus: 0x0080_0002, rfu: 0x0080_0001)
        {
            return special
        }
        guard let number = value.numberValue else { throw .notEncodable("\(field): \(value) is not a number") }
        guard let (mantissa, exponent) = decimalParts(number, mantissaBits: 24, exponents: -128...127) else {
            throw .notEncodable("\(field): \(number) does not fit a FLOAT")
        }
        return UInt32(truncatingIfNeeded: (exponent & 0xFF) << 24) | UInt32(truncatingIfNeeded: mantissa & 0xFF_FFFF)
    }

    private static func specialCode(
        _ value: GATTValue, nan: UInt32, nres: UInt32, plus: UInt32, minus: UInt32, rfu: UInt32
    ) -> UInt32? {
        switch value {
        case .string(nanText): return nan
        case .string(nresText): return nres
        case .string(positiveInfinityText): return plus
        case .string(negativeInfinityText): return minus
        case .string(reservedText): return rfu
        case .double(let d) where d.isNaN: return nan
        case .double(let d) where d == .infinity: return plus
        case .double(let d) where d == -.infinity: return minus
        default: return nil
        }
    }

    /// The (mantissa, exponent) with the smallest exponent whose mantissa fits `mantissaBits` (two's complement),
    /// then with trailing decimal zeros moved into a negative exponent (36.40 -> 364 × 10^-1; 120 stays 120 × 10^0,
    /// as devices send it). With exponent 0 the five mantissas next to the
    /// limits are the special values, so they are not used for numbers.
    static func decimalParts(_ number: Double, mantissaBits: Int, exponents: ClosedRange<Int>) -> (Int64, Int)? {
        guard number.isFinite else { return nil }
        if number == 0 { return (0, 0) }
        let maxMantissa = Int64(1) << (mantissaBits - 1) - 1
        let minMantissa = -maxMantissa - 1
        for exponent in exponents {
            let scaled = exponent >= 0 ? number / powerOfTen(exponent) : number * powerOfTen(-exponent)
            guard scaled.magnitude <= Double(maxMantissa) + 1 else { continue }
            var mantissa = Int64(scaled.rounded())
            guard mantissa >= minMantissa, mantissa <= maxMantissa else { continue }
            if exponent == 0 && (mantissa >= maxMantissa - 1 || mantissa <= minMantissa + 2) { continue }
            var e = exponent
            while mantissa != 0 && mantissa % 10 == 0 && e < 0 {
                mantissa /= 10
                e += 1
            }
            return (mantissa, e)
        }
        return nil
    }
}

extension GATTValue {
    /// The value as a Double when it is a number.
    public var numberValue: Double? {
        switch self {
        case .int(let i): return Double(i)
        case .double(let d): return d
        default: return nil
        }
    }

    /// The value as an integer when it is an integer (or an integral double).
    public var integerValue: Int64? {
        switch self {
        case .int(let i): return i
        case .double(let d) where d.rounded() == d && abs(d) < 9.2e18: return Int64(d)
        default: return nil
        }
    }

    /// The value as a Bool when it is one.
    public var boolValue: Bool? {
        if case .bool(let b) = self { return b }
        return nil
    }

    /// The value as a String when it is one.
    public var stringValue: String? {
        if case .string(let s) = self { return s }
        return nil
    }
}

// MARK: - Date Time

/// The 7-octet GATT Date Time (SPEC.md §2).
public struct GATTDateTime: Sendable, Equatable {
    public var year: Int
    public var month: Int
    public var day: Int
    public var hours: Int
    public var minutes: Int
    public var seconds: Int

    public init(year: Int, month: Int, day: Int, hours: Int, minutes: Int, seconds: Int) {
        self.year = year
        self.month = month
        self.day = day
        self.hours = hours
        self.minutes = minutes
        self.seconds = seconds
    }

    /// True when every part is known and in range, so that it can become an ISO-8601 timestamp.
    public var isComplete: Bool {
        (1582...9999).contains(year) && (1...12).contains(month) && (1...Self.daysIn(month, of: year)).contains(day)
            && hours < 24 && minutes < 60 && seconds < 60
    }

    /// `YYYY-MM-DDTHH:MM:SS`, or nil when not complete. Written straight into the string's storage (one allocation).
    public var isoString: String? {
        guard isComplete else { return nil }
        return String(unsafeUninitializedCapacity: 19) { buffer in
            guard buffer.count >= 19 else { return 0 }
            func put(_ value: Int, at start: Int, width: Int) {
                var v = value
                var i = start + width - 1
                while i >= start {
                    buffer[i] = UInt8(ascii: "0") &+ UInt8(truncatingIfNeeded: v % 10)
                    v /= 10
                    i -= 1
                }
            }
            put(year, at: 0, width: 4)
            buffer[4] = UInt8(ascii: "-")
            put(month, at: 5, width: 2)
            buffer[7] = UInt8(ascii: "-")
            put(day, at: 8, width: 2)
            buffer[10] = UInt8(ascii: "T")
            put(hours, at: 11, width: 2)
            buffer[13] = UInt8(ascii: ":")
            put(minutes, at: 14, width: 2)
            buffer[16] = UInt8(ascii: ":")
            put(seconds, at: 17, width: 2)
            return 19
        }
    }

    /// Parses `YYYY-MM-DDTHH:MM:SS`.
    public init?(iso text: String) {
        let u = Array(text.utf8)
        guard u.count == 19, u[4] == UInt8(ascii: "-"), u[7] == UInt8(ascii: "-"), u[10] == UInt8(ascii: "T"),
            u[13] == UInt8(ascii: ":"), u[16] == UInt8(ascii: ":")
        else { return nil }
        func number(_ range: Range<Int>) -> Int? {
            var v = 0
            for i in range {
                guard u[i] >= UInt8(ascii: "0"), u[i] <= UInt8(ascii: "9") else { return nil }
                v = v * 10 + Int(u[i] - UInt8(ascii: "0"))
            }
            return v
        }
        guard let y = number(0..<4), let mo = number(5..<7), let d = number(8..<10), let h = number(11..<13),
            let mi = number(14..<16), let s = number(17..<19)
        else { return nil }
        self.init(year: y, month: mo, day: d, hours: h, minutes: mi, seconds: s)
        guard isComplete else { return nil }
    }

    /// Reads 7 octets.
    static func read(_ cursor: inout ByteCursor) throws(GATTParseError) -> GATTDateTime {
        let year = Int(try cursor.u16())
        let month = Int(try cursor.u8())
        let day = Int(try cursor.u8())
        let hours = Int(try cursor.u8())
        let minutes = Int(try cursor.u8())
        let seconds = Int(try cursor.u8())
        return GATTDateTime(year: year, month: month, day: day, hours: hours, minutes: minutes, seconds: seconds)
    }

    /// Appends `timestamp` (and, when it is not complete, `timestamp_fields` with `null` for unknown parts).
    func append(to reading: inout GATTReading, name: String = "timestamp") {
        if let iso = isoString {
            reading.append(name, .string(iso))
            return
        }
        reading.append(name, .null)
        reading.append("\(name)_fields", .object(fieldsReading))
    }

    var fieldsReading: GATTReading {
        GATTReading([
            GATTField("year", year == 0 ? .null : .int(Int64(year))),
            GATTField("month", month == 0 ? .null : .int(Int64(month))),
            GATTField("day", day == 0 ? .null : .int(Int64(day))),
            GATTField("hours", .int(Int64(hours))),
            GATTField("minutes", .int(Int64(minutes))),
            GATTField("seconds", .int(Int64(seconds))),
        ])
    }

    /// The Date Time a reading's `timestamp` (or `timestamp_fields`) describes.
    static func from(_ reading: GATTReading, name: String = "timestamp") throws(GATTParseError) -> GATTDateTime {
        if case .string(let text)? = reading[name] {
            guard let dt = GATTDateTime(iso: text) else {
                throw .notEncodable("\(name): \"\(text)\" is not YYYY-MM-DDTHH:MM:SS")
            }
            return dt
        }
        guard case .object(let parts)? = reading["\(name)_fields"] else {
            throw .notEncodable("\(name) is missing")
        }
        func part(_ key: String) throws(GATTParseError) -> Int {
            switch parts[key] {
            case nil, .null?: return 0
            case let value?:
                guard let i = value.integerValue, i >= 0, i <= 0xFFFF else {
                    throw .notEncodable("\(name)_fields.\(key): \(value) is not valid")
                }
                return Int(i)
            }
        }
        return GATTDateTime(
            year: try part("year"), month: try part("month"), day: try part("day"), hours: try part("hours"),
            minutes: try part("minutes"), seconds: try part("seconds"))
    }

    func write(to writer: inout ByteWriter, field: String) throws(GATTParseError) {
        guard year <= 0xFFFF, [month, day, hours, minutes, seconds].allSatisfy({ (0...255).contains($0) }) else {
            throw .notEncodable("\(field): out of range")
        }
        writer.u16(UInt16(year))
        for part in [month, day, hours, minutes, seconds] { writer.u8(UInt8(part)) }
    }

    /// This time plus `minutes` (calendar arithmetic on the proleptic Gregorian calendar). Nil when not complete.
    func adding(minutes delta: Int) -> GATTDateTime? {
        guard isComplete else { return nil }
        let days = Self.daysFromCivil(year, month, day)
        var total = (days * 1440 + hours * 60 + minutes + delta) * 60 + seconds
        let dayCount = Self.floorDiv(total, 86400)
        total -= dayCount * 86400
        let (y, m, d) = Self.civilFromDays(dayCount)
        let result = GATTDateTime(
            year: y, month: m, day: d, hours: total / 3600, minutes: (total % 3600) / 60, seconds: total % 60)
        return result.isComplete ? result : nil
    }

    static func isLeap(_ y: Int) -> Bool { (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 }

    static func daysIn(_ month: Int, of year: Int) -> Int {
        switch month {
        case 2: return isLeap(year) ? 29 : 28
        case 4, 6, 9, 11: return 30
        default: return 31
        }
    }

    static func floorDiv(_ a: Int, _ b: Int) -> Int { a >= 0 ? a / b : -((-a + b - 1) / b) }

    // Days since 1970-01-01 (H. Hinnant's civil calendar algorithms).
    static func daysFromCivil(_ year: Int, _ month: Int, _ day: Int) -> Int {
        let y = month <= 2 ? year - 1 : year
        let era = floorDiv(y, 400)
        let yoe = y - era * 400
        let mp = (month + 9) % 12
        let doy = (153 * mp + 2) / 5 + day - 1
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy
        return era * 146097 + doe - 719468
    }

    static func civilFromDays(_ days: Int) -> (Int, Int, Int) {
        let z = days + 719468
        let era = floorDiv(z, 146097)
        let doe = z - era * 146097
        let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100)
        let mp = (5 * doy + 2) / 153
        let d = doy - (153 * mp + 2) / 5 + 1
        let m = mp < 10 ? mp + 3 : mp - 9
        return (yoe + era * 400 + (m <= 2 ? 1 : 0), m, d)
    }
}

// MARK: - Writing

/// Builds a little-endian payload for the encoders.
struct ByteWriter {
    var bytes: [UInt8] = []

    init(capacity: Int = 16) { bytes.reserveCapacity(capacity) }

    mutating func u8(_ v: UInt8) { bytes.append(v) }
    mutating func u16(_ v: UInt16) { uintLE(UInt64(v), 2) }
    mutating func u24(_ v: UInt32) { uintLE(UInt64(v), 3) }
    mutating func u32(_ v: UInt32) { uintLE(UInt64(v), 4) }
    mutating func uintLE(_ v: UInt64, _ width: Int) {
        for k in 0..<width { bytes.append(UInt8(truncatingIfNeeded: v >> (8 * UInt64(k)))) }
    }
    mutating func uintBE(_ v: UInt64, _ width: Int) {
        for k in stride(from: width - 1, through: 0, by: -1) { bytes.append(UInt8(truncatingIfNeeded: v >> (8 * UInt64(k)))) }
    }

    /// Writes `round(value × multiplier)` as an integer of `width` octets, checking the range.
    mutating func scaled(
        _ value: GATTValue, multiplier: Double, width: Int, signed: Bool, field: String
    ) throws(GATTParseError) {
        guard let number = value.numberValue, number.isFinite else {
            throw .notEncodable("\(field): \(value) is not a number")
        }
        let raw = (number * multiplier).rounded()
        try integer(raw, width: width, signed: signed, field: field)
    }

    /// Writes an integral Double as an integer of `width` octets, checking the range.
    mutating func integer(_ raw: Double, width: Int, signed: Bool, field: String) throws(GATTParseError) {
        let bits = Double(width * 8)
        let (low, high): (Double, Double) =
            signed ? (-(powerOfTwo(bits - 1)), powerOfTwo(bits - 1) - 1) : (0, powerOfTwo(bits) - 1)
        guard width >= 1, width <= 4, raw.isFinite, raw >= low, raw <= high else {
            throw .notEncodable("\(field): \(raw) is out of range for \(signed ? "s" : "u")int\(width * 8)")
        }
        uintLE(UInt64(bitPattern: Int64(raw)), width)
    }
}

private func powerOfTwo(_ bits: Double) -> Double {
    var v = 1.0
    var k = 0.0
    while k < bits {
        v *= 2
        k += 1
    }
    return v
}

// MARK: - Reading a value for encoding

extension GATTReading {
    /// The value called `name`, or a `notEncodable` error naming the parser and field.
    func required(_ name: String, in parser: String) throws(GATTParseError) -> GATTValue {
        guard let value = self[name], value != .null else {
            throw .notEncodable("\(parser): field \(name) is missing")
        }
        return value
    }

    /// True when `name` is present and not null.
    func has(_ name: String) -> Bool {
        guard let value = self[name] else { return false }
        return value != .null
    }
}

// MARK: - Enumerations

/// A snake_case name table for an enumerated uint8 (index = value; nil entries are RFU).
struct EnumNames: Sendable {
    let names: [String?]
    init(_ names: [String?]) { self.names = names }
    func callAsFunction(_ value: Int) -> GATTValue {
        guard value >= 0, value < names.count, let name = names[value] else { return .null }
        return .string(name)
    }
    func value(named name: String) -> Int? { names.firstIndex { $0 == name } }
}
