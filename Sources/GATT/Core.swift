// Core types of the characteristic-parser registry: UUIDs, decoded readings, the byte cursor and parser protocols.
// Pure Swift: no C, no I/O.

/// A Bluetooth UUID. 16- and 32-bit forms are stored expanded on the Bluetooth base UUID
/// (`0000xxxx-0000-1000-8000-00805f9b34fb`), so `2A37`, `00002a37` and the full form are the same key.
public struct BluetoothUUID: Hashable, Sendable, Comparable, CustomStringConvertible {
    /// The 128 bits, most significant first.
    public let high: UInt64
    /// The low 64 bits.
    public let low: UInt64

    static let baseHigh: UInt64 = 0x0000_0000_0000_1000
    static let baseLow: UInt64 = 0x8000_0080_5F9B_34FB

    /// A 16-bit SIG-assigned UUID.
    public init(_ short: UInt16) { self.init(UInt32(short)) }

    /// A 32-bit SIG-assigned UUID.
    public init(_ short: UInt32) {
        high = (UInt64(short) << 32) | Self.baseHigh
        low = Self.baseLow
    }

    /// A full 128-bit UUID.
    public init(high: UInt64, low: UInt64) {
        self.high = high
        self.low = low
    }

    /// Parses `2A37`, `0x2a37`, `00002a37`, or `0000180d-0000-1000-8000-00805f9b34fb` (any case).
    /// Returns nil for anything else.
    public init?(_ text: String) {
        var s = Substring(text)
        if s.hasPrefix("0x") || s.hasPrefix("0X") { s = s.dropFirst(2) }
        let hex = s.filter { $0 != "-" }
        guard hex.allSatisfy({ $0.isHexDigit }) else { return nil }
        switch hex.count {
        case 4, 8:
            guard s.count == hex.count, let v = UInt32(hex, radix: 16) else { return nil }
            self.init(v)
        case 32:
            // Dashes, when present, must be in the canonical 8-4-4-4-12 places.
            if s.count == 36 {
                let dashes = s.enumerated().filter { $0.element == "-" }.map(\.offset)
                guard dashes == [8, 13, 18, 23] else { return nil }
            } else if s.count != 32 {
                return nil
            }
            guard let h = UInt64(hex.prefix(16), radix: 16), let l = UInt64(hex.suffix(16), radix: 16) else {
                return nil
            }
            self.init(high: h, low: l)
        default:
            return nil
        }
    }

    /// The 16-bit value when this UUID is a 16-bit SIG UUID on the base.
    public var shortValue: UInt16? {
        guard low == Self.baseLow, high & 0xFFFF_FFFF == Self.baseHigh, high >> 48 == 0 else { return nil }
        return UInt16(truncatingIfNeeded: high >> 32)
    }

    /// The 32-bit value when this UUID is on the Bluetooth base.
    public var value32: UInt32? {
        guard low == Self.baseLow, high & 0xFFFF_FFFF == Self.baseHigh else { return nil }
        return UInt32(truncatingIfNeeded: high >> 32)
    }

    /// Lower-case canonical 8-4-4-4-12 form, as BlueZ prints it.
    public var uuidString: String {
        let h = hex(high, 16)
        let l = hex(low, 16)
        let a = h.prefix(8)
        let b = h.dropFirst(8).prefix(4)
        let c = h.dropFirst(12)
        let d = l.prefix(4)
        let e = l.dropFirst(4)
        return "\(a)-\(b)-\(c)-\(d)-\(e)"
    }

    /// `2A37` for 16-bit SIG UUIDs, else the canonical form.
    public var description: String {
        if let s = shortValue { return hex(UInt64(s), 4).uppercased() }
        return uuidString
    }

    /// Orders UUIDs by their 128-bit value.
    public static func < (lhs: BluetoothUUID, rhs: BluetoothUUID) -> Bool {
        (lhs.high, lhs.low) < (rhs.high, rhs.low)
    }
}

func hex(_ value: UInt64, _ digits: Int) -> String {
    let s = String(value, radix: 16)
    return String(repeating: "0", count: max(0, digits - s.count)) + s
}

/// One decoded value, ready to become JSON.
///
/// Not `indirect`: arrays and nested readings already live in heap storage, and boxing every scalar would cost an
/// allocation per field on the hot decode path.
public enum GATTValue: Sendable, Equatable {
    /// No value (a "not known" special value, or an absent optional field); JSON `null`.
    case null
    /// A flag.
    case bool(Bool)
    /// An integer.
    case int(Int64)
    /// A number with a fraction, or a scaled value.
    case double(Double)
    /// Text (names, hex, ISO dates).
    case string(String)
    /// A list (RR intervals, ...).
    case array([GATTValue])
    /// A nested reading.
    case object(GATTReading)
}

/// One named field of a reading.
public struct GATTField: Sendable, Equatable {
    /// The published name (SPEC.md §1: snake_case, unit as a suffix).
    public var name: String
    /// The value.
    public var value: GATTValue
    /// A field called `name` holding `value`.
    public init(_ name: String, _ value: GATTValue) {
        self.name = name
        self.value = value
    }
}

/// An ordered set of named fields (SPEC.md §1 names), in the order they should be published.
public struct GATTReading: Sendable, Equatable {
    /// The fields, in publishing order.
    public var fields: [GATTField]

    /// A reading with these fields.
    public init(_ fields: [GATTField] = []) { self.fields = fields }

    /// Reserves room for `count` fields (avoids regrowth in hot decoders).
    public init(capacity: Int) {
        fields = []
        fields.reserveCapacity(capacity)
    }

    /// Appends a field (does not check for duplicates).
    public mutating func append(_ name: String, _ value: GATTValue) {
        fields.append(GATTField(name, value))
    }

    /// The value of the first field called `name`.
    public subscript(name: String) -> GATTValue? {
        fields.first { $0.name == name }?.value
    }

    /// `{"raw": "<hex>"}`: what an unknown characteristic or payload becomes.
    public static func raw(_ bytes: [UInt8]) -> GATTReading {
        GATTReading([GATTField("raw", .string(hexString(bytes)))])
    }
}

/// Lower-case hex of `bytes`, no separators.
public func hexString(_ bytes: some Sequence<UInt8>) -> String {
    let digits: [UInt8] = Array("0123456789abcdef".utf8)
    var out: [UInt8] = []
    for b in bytes {
        out.append(digits[Int(b >> 4)])
        out.append(digits[Int(b & 0x0F)])
    }
    return String(decoding: out, as: UTF8.self)
}

/// Parses hex (`"0a1B"`, also with spaces, `:` or `-` between octets, or a `0x` prefix). Nil when invalid.
public func bytesFromHex(_ text: String) -> [UInt8]? {
    var s = Substring(text)
    if s.hasPrefix("0x") || s.hasPrefix("0X") { s = s.dropFirst(2) }
    let digits = s.utf8.filter { $0 != UInt8(ascii: " ") && $0 != UInt8(ascii: ":") && $0 != UInt8(ascii: "-") }
    guard digits.count % 2 == 0 else { return nil }
    var out: [UInt8] = []
    out.reserveCapacity(digits.count / 2)
    var i = 0
    while i < digits.count {
        guard let hi = hexNibble(digits[i]), let lo = hexNibble(digits[i + 1]) else { return nil }
        out.append(hi << 4 | lo)
        i += 2
    }
    return out
}

private func hexNibble(_ c: UInt8) -> UInt8? {
    switch c {
    case UInt8(ascii: "0")...UInt8(ascii: "9"): return c - UInt8(ascii: "0")
    case UInt8(ascii: "a")...UInt8(ascii: "f"): return c - UInt8(ascii: "a") + 10
    case UInt8(ascii: "A")...UInt8(ascii: "F"): return c - UInt8(ascii: "A") + 10
    default: return nil
    }
}

/// Why a payload was rejected. Every case says where (`offset`) where that makes sense.
public enum GATTParseError: Error, Sendable, Equatable, CustomStringConvertible {
    /// The payload ended early: `needed` octets were wanted at `offset`, `available` remained.
    case truncated(offset: Int, needed: Int, available: Int)
    /// The payload is longer or shorter than the format allows.
    case invalidLength(expected: String, actual: Int)
    /// A field holds a value the format does not allow.
    case invalidValue(field: String, offset: Int, reason: String)
    /// Decryption or authentication failed, or a key is missing.
    case decryptionFailed(String)
    /// The value cannot be encoded (missing field, out of range, no encoder).
    case notEncodable(String)
    /// The payload is not in this format at all.
    case unsupported(String)

    /// The text people read in logs and error output.
    public var description: String {
        switch self {
        case .truncated(let offset, let needed, let available):
            return "truncated at offset \(offset): needed \(needed) octet(s), \(available) available"
        case .invalidLength(let expected, let actual):
            // The offset where the value ends, so every rejection names one.
            return "invalid length \(actual): expected \(expected) (the value ends at offset \(actual))"
        case .invalidValue(let field, let offset, let reason):
            return "invalid \(field) at offset \(offset): \(reason)"
        case .decryptionFailed(let reason):
            return "decryption failed: \(reason)"
        case .notEncodable(let reason):
            return "cannot encode: \(reason)"
        case .unsupported(let reason):
            return "unsupported: \(reason)"
        }
    }
}

/// A bounds-checked little-endian (or big-endian) reader over a byte array. Never traps.
public struct ByteCursor: Sendable {
    /// The whole payload.
    public let bytes: [UInt8]
    /// The offset of the next octet to read.
    public private(set) var offset: Int

    /// A cursor over `bytes`, starting at `offset`.
    public init(_ bytes: [UInt8], offset: Int = 0) {
        self.bytes = bytes
        self.offset = offset
    }

    /// Octets left to read.
    @inlinable public var remaining: Int { bytes.count - offset }
    /// True when nothing is left to read.
    public var isAtEnd: Bool { offset >= bytes.count }

    @inline(__always)
    mutating func take(_ n: Int) throws(GATTParseError) -> Int {
        guard n >= 0, remaining >= n else {
            throw .truncated(offset: offset, needed: n, available: max(0, remaining))
        }
        let start = offset
        offset += n
        return start
    }

    /// One unsigned octet; throws `truncated` at the end.
    public mutating func u8() throws(GATTParseError) -> UInt8 {
        let i = try take(1)
        return bytes[i]
    }

    /// One signed octet.
    public mutating func s8() throws(GATTParseError) -> Int8 { Int8(bitPattern: try u8()) }

    /// An unsigned little-endian integer of `width` octets (1...8).
    public mutating func uintLE(_ width: Int) throws(GATTParseError) -> UInt64 {
        let i = try take(width)
        var v: UInt64 = 0
        for k in stride(from: width - 1, through: 0, by: -1) { v = v << 8 | UInt64(bytes[i + k]) }
        return v
    }

    /// An unsigned big-endian integer of `width` octets (1...8).
    public mutating func uintBE(_ width: Int) throws(GATTParseError) -> UInt64 {
        let i = try take(width)
        var v: UInt64 = 0
        for k in 0..<width { v = v << 8 | UInt64(bytes[i + k]) }
        return v
    }

    /// A two's-complement little-endian integer of `width` octets, sign-extended.
    public mutating func sintLE(_ width: Int) throws(GATTParseError) -> Int64 {
        signExtend(try uintLE(width), bits: width * 8)
    }

    /// A two's-complement big-endian integer of `width` octets, sign-extended.
    public mutating func sintBE(_ width: Int) throws(GATTParseError) -> Int64 {
        signExtend(try uintBE(width), bits: width * 8)
    }

    /// Little-endian fixed-width integers; each throws `truncated` (with the offset) when too few octets remain.
    public mutating func u16() throws(GATTParseError) -> UInt16 { UInt16(truncatingIfNeeded: try uintLE(2)) }
    /// Reads a little-endian signed 16-bit integer.
    public mutating func s16() throws(GATTParseError) -> Int16 { Int16(truncatingIfNeeded: try sintLE(2)) }
    /// Reads a little-endian unsigned 24-bit integer.
    public mutating func u24() throws(GATTParseError) -> UInt32 { UInt32(truncatingIfNeeded: try uintLE(3)) }
    /// Reads a little-endian signed 24-bit integer.
    public mutating func s24() throws(GATTParseError) -> Int32 { Int32(truncatingIfNeeded: try sintLE(3)) }
    /// Reads a little-endian unsigned 32-bit integer.
    public mutating func u32() throws(GATTParseError) -> UInt32 { UInt32(truncatingIfNeeded: try uintLE(4)) }
    /// Reads a little-endian signed 32-bit integer.
    public mutating func s32() throws(GATTParseError) -> Int32 { Int32(truncatingIfNeeded: try sintLE(4)) }

    /// `n` raw octets.
    public mutating func bytes(_ n: Int) throws(GATTParseError) -> ArraySlice<UInt8> {
        let i = try take(n)
        return bytes[i..<(i + n)]
    }

    /// Everything that is left.
    public mutating func rest() -> ArraySlice<UInt8> {
        let i = min(offset, bytes.count)
        offset = bytes.count
        return bytes[i...]
    }

    /// Skips `n` octets.
    public mutating func skip(_ n: Int) throws(GATTParseError) { _ = try take(n) }
}

/// Sign-extends the low `bits` bits of `raw`.
@inline(__always)
public func signExtend(_ raw: UInt64, bits: Int) -> Int64 {
    guard bits > 0, bits < 64 else { return Int64(bitPattern: raw) }
    let shift = UInt64(64 - bits)
    return Int64(bitPattern: raw << shift) >> Int64(shift)
}

/// What a characteristic parser may know besides the bytes.
public struct GATTDecodeContext: Sendable {
    /// The raw 0x2904 Characteristic Presentation Format descriptor value, when the characteristic has one.
    public var presentationFormat: [UInt8]?
    /// A context, optionally with the characteristic's 0x2904 descriptor value.
    public init(presentationFormat: [UInt8]? = nil) { self.presentationFormat = presentationFormat }
}

/// Decodes (and, where the characteristic is writable, encodes) one kind of characteristic value.
public protocol GATTCharacteristicParser: Sendable {
    /// The characteristic UUIDs this parser handles.
    var uuids: [BluetoothUUID] { get }
    /// A snake_case name (`heart_rate_measurement`), usable on the command line in place of the UUID.
    var name: String { get }
    /// Decodes one value. Throws on a payload that must be rejected (SPEC.md §5).
    func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading
    /// Encodes a value for a write. The default throws `notEncodable`.
    func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8]
    /// Every top-level field `decode` can publish, in publishing order, with its unit and Home Assistant classes;
    /// known before any value arrives (for MQTT discovery). The default is empty (nothing declared).
    var fields: [GATTFieldDescriptor] { get }
}

extension GATTCharacteristicParser {
    /// Parsers that declare nothing: no field is known ahead of data.
    public var fields: [GATTFieldDescriptor] { [] }

    /// Parsers without an encoder: always throws `notEncodable` naming the parser.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        throw .notEncodable("\(name) has no encoder")
    }
}

/// Performs AES-128-CCM. The GATT target has no C; `GATTCrypto` supplies an implementation over libcrypto.
public protocol AESCCMCipher: Sendable {
    /// Decrypts and authenticates; throws `decryptionFailed` when the tag does not match.
    func decrypt(key: [UInt8], nonce: [UInt8], ciphertext: [UInt8], tag: [UInt8], aad: [UInt8])
        throws(GATTParseError) -> [UInt8]
    /// Encrypts; returns the ciphertext and a tag of `tagLength` octets.
    func encrypt(key: [UInt8], nonce: [UInt8], plaintext: [UInt8], aad: [UInt8], tagLength: Int)
        throws(GATTParseError) -> (ciphertext: [UInt8], tag: [UInt8])
}

/// Where an advertisement payload came from.
public enum AdvertisementSource: Hashable, Sendable, CustomStringConvertible {
    /// Service data (AD type 0x16/0x20/0x21) for this service UUID.
    case serviceData(BluetoothUUID)
    /// Manufacturer-specific data (AD type 0xFF) for this company id.
    case manufacturer(UInt16)

    /// The text people read in logs and error output.
    public var description: String {
        switch self {
        case .serviceData(let uuid): return "service data \(uuid)"
        case .manufacturer(let id): return "manufacturer 0x\(hex(UInt64(id), 4).uppercased())"
        }
    }
}

/// What an advertisement parser may know besides the payload.
public struct AdvertisementContext: Sendable {
    /// The advertiser's address, as printed (`A4:C1:38:00:11:22`).
    public var mac: String?
    /// The AES key for encrypted formats.
    public var bindKey: [UInt8]?
    /// The advertised local name.
    public var localName: String?
    /// The cipher for encrypted formats.
    public var cipher: (any AESCCMCipher)?

    /// Creates a context; encrypted formats need `mac`, `bindKey` and `cipher`.
    public init(
        mac: String? = nil, bindKey: [UInt8]? = nil, localName: String? = nil, cipher: (any AESCCMCipher)? = nil
    ) {
        self.mac = mac
        self.bindKey = bindKey
        self.localName = localName
        self.cipher = cipher
    }
}

/// Decodes one advertisement format (BTHome, RuuviTag, iBeacon, ...).
public protocol AdvertisementParser: Sendable {
    /// The service-data UUIDs and company ids this parser handles.
    var sources: [AdvertisementSource] { get }
    /// A snake_case name (`bthome_v2`).
    var name: String { get }
    /// Decodes one payload. Throws on a payload that must be rejected.
    func decode(_ payload: [UInt8], from source: AdvertisementSource, context: AdvertisementContext)
        throws(GATTParseError) -> GATTReading
    /// Every top-level field `decode` can publish, with its unit and Home Assistant classes; known before any
    /// payload arrives (for MQTT discovery). The default is empty (nothing declared).
    var fields: [GATTFieldDescriptor] { get }
}

extension AdvertisementParser {
    /// Parsers that declare nothing: no field is known ahead of data.
    public var fields: [GATTFieldDescriptor] { [] }
}
