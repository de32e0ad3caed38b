// JSON in and out: a strict RFC 8259 reader for command payloads from the broker (bounded depth and size, errors
// with the offset), and a writer with ordered keys for what the bridge publishes.
import GATT
import Logging

/// A JSON value; objects keep their key order. Not `indirect`: arrays and objects already live in heap storage, and
/// boxing every scalar cost an allocation per field of every published state.
public enum JSONValue: Sendable, Equatable {
    /// `null`
    case null
    /// `true` / `false`
    case bool(Bool)
    /// An integer that fits 64 bits.
    case int(Int64)
    /// Any other number.
    case double(Double)
    /// A string.
    case string(String)
    /// An array.
    case array([JSONValue])
    /// An object, in document order.
    case object([(String, JSONValue)])

    /// Structural equality (object order matters).
    public static func == (lhs: JSONValue, rhs: JSONValue) -> Bool {
        switch (lhs, rhs) {
        case (.null, .null): return true
        case (.bool(let a), .bool(let b)): return a == b
        case (.int(let a), .int(let b)): return a == b
        case (.double(let a), .double(let b)): return a == b
        case (.string(let a), .string(let b)): return a == b
        case (.array(let a), .array(let b)): return a == b
        case (.object(let a), .object(let b)):
            return a.count == b.count && zip(a, b).allSatisfy { $0.0 == $1.0 && $0.1 == $1.1 }
        default: return false
        }
    }

    /// The value for `key` in an object.
    public subscript(key: String) -> JSONValue? {
        if case .object(let fields) = self { return fields.first { $0.0 == key }?.1 }
        return nil
    }

    /// The element at `index` of an array (nil when out of range or not an array).
    public subscript(index: Int) -> JSONValue? {
        if case .array(let items) = self, items.indices.contains(index) { return items[index] }
        return nil
    }

    /// The string, if this is one.
    public var string: String? {
        if case .string(let s) = self { return s }
        return nil
    }

    /// The number as a Double, if this is one.
    public var number: Double? {
        switch self {
        case .int(let i): return Double(i)
        case .double(let d): return d
        default: return nil
        }
    }

    /// Compact JSON text.
    public var text: String {
        var out: [UInt8] = []
        write(into: &out)
        return String(decoding: out, as: UTF8.self)
    }

    /// Compact JSON bytes.
    public var bytes: [UInt8] {
        var out: [UInt8] = []
        write(into: &out)
        return out
    }

    /// Appends compact JSON to `out`.
    public func write(into out: inout [UInt8]) {
        switch self {
        case .null: out += Array("null".utf8)
        case .bool(let b): out += Array((b ? "true" : "false").utf8)
        case .int(let i): out += Array(String(i).utf8)
        case .double(let d): GATTValue.double(d).appendJSON(to: &out)
        case .string(let s): GATTValue.string(s).appendJSON(to: &out)
        case .array(let items):
            out.append(UInt8(ascii: "["))
            for (i, item) in items.enumerated() {
                if i > 0 { out.append(UInt8(ascii: ",")) }
                item.write(into: &out)
            }
            out.append(UInt8(ascii: "]"))
        case .object(let fields):
            out.append(UInt8(ascii: "{"))
            for (i, (key, value)) in fields.enumerated() {
                if i > 0 { out.append(UInt8(ascii: ",")) }
                GATTValue.string(key).appendJSON(to: &out)
                out.append(UInt8(ascii: ":"))
                value.write(into: &out)
            }
            out.append(UInt8(ascii: "}"))
        }
    }

    /// The GATT value for an encoder.
    public var gattValue: GATTValue {
        switch self {
        case .null: return .null
        case .bool(let b): return .bool(b)
        case .int(let i): return .int(i)
        case .double(let d): return .double(d)
        case .string(let s): return .string(s)
        case .array(let a): return .array(a.map(\.gattValue))
        case .object(let f): return .object(GATTReading(f.map { GATTField($0.0, $0.1.gattValue) }))
        }
    }

    /// The JSON form of a decoded value.
    public init(_ value: GATTValue) {
        switch value {
        case .null: self = .null
        case .bool(let b): self = .bool(b)
        case .int(let i): self = .int(i)
        case .double(let d): self = d.isFinite ? .double(d) : .string(d.isNaN ? "NaN" : (d > 0 ? "+INF" : "-INF"))
        case .string(let s): self = .string(s)
        case .array(let a): self = .array(a.map(JSONValue.init))
        case .object(let r): self = .object(r.fields.map { ($0.name, JSONValue($0.value)) })
        }
    }
}

/// A payload that is not valid JSON: where and why.
public struct JSONParseError: Error, Sendable, Equatable, CustomStringConvertible {
    /// Byte offset.
    public var offset: Int
    /// What is wrong.
    public var reason: String
    /// An error at `offset`.
    public init(offset: Int, reason: String) {
        self.offset = offset
        self.reason = reason
    }

    /// `invalid JSON at offset N: reason`.
    public var description: String { "invalid JSON at offset \(offset): \(reason)" }
}

/// Parses JSON text strictly (RFC 8259): one value, nothing after it but white space.
public enum JSONReader {
    /// Deepest nesting accepted.
    public static let maximumDepth = 32

    /// Parses `bytes`.
    public static func parse(_ bytes: [UInt8]) throws(JSONParseError) -> JSONValue {
        var p = Parser(bytes: bytes)
        p.skipSpace()
        let v = try p.value(depth: 0)
        p.skipSpace()
        guard p.i == bytes.count else { throw JSONParseError(offset: p.i, reason: "unexpected text after the value") }
        return v
    }

    struct Parser {
        let bytes: [UInt8]
        var i = 0

        mutating func skipSpace() {
            while i < bytes.count, [0x20, 0x09, 0x0A, 0x0D].contains(bytes[i]) { i += 1 }
        }

        func fail(_ reason: String) -> JSONParseError { JSONParseError(offset: i, reason: reason) }

        mutating func value(depth: Int) throws(JSONParseError) -> JSONValue {
            guard depth < JSONReader.maximumDepth else { throw fail("nested deeper than \(JSONReader.maximumDepth)") }
            guard i < bytes.count else { throw fail("unexpected end") }
            switch bytes[i] {
            case UInt8(ascii: "{"):
                i += 1
                var fields: [(String, JSONValue)] = []
                skipSpace()
                if i < bytes.count, bytes[i] == UInt8(ascii: "}") {
                    i += 1
                    return .object(fields)
                }
                while true {
                    skipSpace()
                    guard i < bytes.count, bytes[i] == UInt8(ascii: "\"") else { throw fail("expected a key string") }
                    let key = try string()
                    skipSpace()
                    guard i < bytes.count, bytes[i] == UInt8(ascii: ":") else { throw fail("expected ':'") }
                    i += 1
                    skipSpace()
                    fields.append((key, try value(depth: depth + 1)))
                    skipSpace()
                    guard i < bytes.count else { throw fail("unexpected end in an object") }
                    if bytes[i] == UInt8(ascii: ",") {
                        i += 1
                        continue
                    }
                    guard bytes[i] == UInt8(ascii: "}") else { throw fail("expected ',' or '}'") }
                    i += 1
                    return .object(fields)
                }
            case UInt8(ascii: "["):
                i += 1
                var items: [JSONValue] = []
                skipSpace()
                if i < bytes.count, bytes[i] == UInt8(ascii: "]") {
                    i += 1
                    return .array(items)
                }
                while true {
                    skipSpace()
                    items.append(try value(depth: depth + 1))
                    skipSpace()
                    guard i < bytes.count else { throw fail("unexpected end in an array") }
                    if bytes[i] == UInt8(ascii: ",") {
                        i += 1
                        continue
                    }
                    guard bytes[i] == UInt8(ascii: "]") else { throw fail("expected ',' or ']'") }
                    i += 1
                    return .array(items)
                }
            case UInt8(ascii: "\""):
                return .string(try string())
            case UInt8(ascii: "t"):
                try literal("true")
                return .bool(true)
            case UInt8(ascii: "f"):
                try literal("false")
                return .bool(false)
            case UInt8(ascii: "n"):
                try literal("null")
                return .null
            default:
                return try number()
            }
        }

        mutating func literal(_ word: String) throws(JSONParseError) {
            let w = Array(word.utf8)
            guard i + w.count <= bytes.count, Array(bytes[i..<i + w.count]) == w else {
                throw fail("unexpected character")
            }
            i += w.count
        }

        mutating func number() throws(JSONParseError) -> JSONValue {
            let start = i
            if i < bytes.count, bytes[i] == UInt8(ascii: "-") { i += 1 }
            func digits(_ p: inout Parser) -> Int {
                let s = p.i
                while p.i < p.bytes.count, p.bytes[p.i] >= 0x30, p.bytes[p.i] <= 0x39 { p.i += 1 }
                return p.i - s
            }
            let intStart = i
            let n = digits(&self)
            guard n > 0 else { throw fail("unexpected character") }
            if n > 1, bytes[intStart] == UInt8(ascii: "0") { throw fail("leading zero in a number") }
            var isInteger = true
            if i < bytes.count, bytes[i] == UInt8(ascii: ".") {
                i += 1
                isInteger = false
                guard digits(&self) > 0 else { throw fail("expected digits after '.'") }
            }
            if i < bytes.count, bytes[i] == UInt8(ascii: "e") || bytes[i] == UInt8(ascii: "E") {
                i += 1
                isInteger = false
                if i < bytes.count, bytes[i] == UInt8(ascii: "+") || bytes[i] == UInt8(ascii: "-") { i += 1 }
                guard digits(&self) > 0 else { throw fail("expected digits in the exponent") }
            }
            let text = String(decoding: bytes[start..<i], as: UTF8.self)
            if isInteger, let v = Int64(text) { return .int(v) }
            guard let d = Double(text), d.isFinite else {
                throw JSONParseError(offset: start, reason: "number out of range")
            }
            return .double(d)
        }

        mutating func string() throws(JSONParseError) -> String {
            i += 1  // opening quote
            var out: [UInt8] = []
            while i < bytes.count {
                let b = bytes[i]
                i += 1
                switch b {
                case UInt8(ascii: "\""):
                    guard let s = String(validating: out, as: UTF8.self) else { throw fail("string is not UTF-8") }
                    return s
                case UInt8(ascii: "\\"):
                    guard i < bytes.count else { throw fail("unexpected end in an escape") }
                    let e = bytes[i]
                    i += 1
                    switch e {
                    case UInt8(ascii: "\""): out.append(0x22)
                    case UInt8(ascii: "\\"): out.append(0x5C)
                    case UInt8(ascii: "/"): out.append(0x2F)
                    case UInt8(ascii: "b"): out.append(0x08)
                    case UInt8(ascii: "f"): out.append(0x0C)
                    case UInt8(ascii: "n"): out.append(0x0A)
                    case UInt8(ascii: "r"): out.append(0x0D)
                    case UInt8(ascii: "t"): out.append(0x09)
                    case UInt8(ascii: "u"):
                        var scalar = try hex4()
                        if (0xD800..<0xDC00).contains(scalar) {
                            guard i + 1 < bytes.count, bytes[i] == UInt8(ascii: "\\"), bytes[i + 1] == UInt8(ascii: "u")
                            else { throw fail("unpaired surrogate") }
                            i += 2
                            let low = try hex4()
                            guard (0xDC00..<0xE000).contains(low) else { throw fail("unpaired surrogate") }
                            scalar = 0x10000 + ((scalar - 0xD800) << 10) + (low - 0xDC00)
                        } else if (0xDC00..<0xE000).contains(scalar) {
                            throw fail("unpaired surrogate")
                        }
                        guard let u = Unicode.Scalar(scalar) else { throw fail("invalid \\u escape") }
                        out += Array(String(Character(u)).utf8)
                    default: throw JSONParseError(offset: i - 1, reason: "invalid escape")
                    }
                default:
                    guard b >= 0x20 else {
                        throw JSONParseError(offset: i - 1, reason: "control character in a string")
                    }
                    out.append(b)
                }
            }
            throw fail("unterminated string")
        }

        mutating func hex4() throws(JSONParseError) -> UInt32 {
            guard i + 4 <= bytes.count else { throw fail("short \\u escape") }
            var v: UInt32 = 0
            for _ in 0..<4 {
                let b = bytes[i]
                i += 1
                let d: UInt32
                switch b {
                case 0x30...0x39: d = UInt32(b - 0x30)
                case 0x41...0x46: d = UInt32(b - 0x41 + 10)
                case 0x61...0x66: d = UInt32(b - 0x61 + 10)
                default: throw fail("invalid \\u escape")
                }
                v = v << 4 | d
            }
            return v
        }
    }
}
