// JSON output for readings: keys in field order, integers as integers, doubles in their shortest round-trip form,
// strings escaped per RFC 8259. JSON has no NaN or infinity: non-finite doubles become the IEEE-11073 strings.

extension GATTReading {
    /// The reading as one compact JSON object (`{"heart_rate_bpm":72,"sensor_contact":true}`).
    public var jsonString: String {
        var out: [UInt8] = []
        out.reserveCapacity(32 + fields.count * 24)
        appendJSON(to: &out)
        return String(decoding: out, as: UTF8.self)
    }

    /// Appends the JSON object to `out` (UTF-8).
    public func appendJSON(to out: inout [UInt8]) {
        out.append(UInt8(ascii: "{"))
        var first = true
        for field in fields {
            if !first { out.append(UInt8(ascii: ",")) }
            first = false
            appendJSONString(field.name, to: &out)
            out.append(UInt8(ascii: ":"))
            field.value.appendJSON(to: &out)
        }
        out.append(UInt8(ascii: "}"))
    }
}

extension GATTValue {
    /// The value as JSON text.
    public var jsonString: String {
        var out: [UInt8] = []
        appendJSON(to: &out)
        return String(decoding: out, as: UTF8.self)
    }

    /// Appends the value's JSON to `out` (UTF-8).
    public func appendJSON(to out: inout [UInt8]) {
        switch self {
        case .null: out.append(contentsOf: "null".utf8)
        case .bool(let b): out.append(contentsOf: (b ? "true" : "false").utf8)
        case .int(let i): out.append(contentsOf: String(i).utf8)
        case .double(let d):
            if d.isNaN {
                appendJSONString("NaN", to: &out)
            } else if d.isInfinite {
                appendJSONString(d > 0 ? "+INF" : "-INF", to: &out)
            } else {
                // Swift's description is the shortest text that reads back to the same double ("36.4", "1.5e-07",
                // "100.0"), and every form it prints is valid JSON.
                out.append(contentsOf: d.description.utf8)
            }
        case .string(let s): appendJSONString(s, to: &out)
        case .array(let values):
            out.append(UInt8(ascii: "["))
            for (i, v) in values.enumerated() {
                if i > 0 { out.append(UInt8(ascii: ",")) }
                v.appendJSON(to: &out)
            }
            out.append(UInt8(ascii: "]"))
        case .object(let reading): reading.appendJSON(to: &out)
        }
    }
}

private let hexDigits: [UInt8] = Array("0123456789abcdef".utf8)

/// Appends `text` as a JSON string literal: `"` and `\` escaped, control characters as `\n`, `\t`, ... or `\u00XX`;
/// everything else (including non-ASCII) as UTF-8. Runs that need no escape (field names, most values: all of it,
/// usually) are copied in one go, not appended byte by byte.
func appendJSONString(_ text: String, to out: inout [UInt8]) {
    out.append(UInt8(ascii: "\""))
    var text = text
    text.withUTF8 { bytes in
        var run = 0
        for index in bytes.indices {
            let byte = bytes[index]
            guard byte < 0x20 || byte == UInt8(ascii: "\"") || byte == UInt8(ascii: "\\") || byte == 0x7F else {
                continue
            }
            if run < index { out.append(contentsOf: UnsafeBufferPointer(rebasing: bytes[run..<index])) }
            appendEscaped(byte, to: &out)
            run = index + 1
        }
        if run < bytes.count { out.append(contentsOf: UnsafeBufferPointer(rebasing: bytes[run...])) }
    }
    out.append(UInt8(ascii: "\""))
}

/// The JSON escape of one byte that needs one.
private func appendEscaped(_ byte: UInt8, to out: inout [UInt8]) {
    out.append(UInt8(ascii: "\\"))
    switch byte {
    case UInt8(ascii: "\""), UInt8(ascii: "\\"): out.append(byte)
    case 0x0A: out.append(UInt8(ascii: "n"))
    case 0x0D: out.append(UInt8(ascii: "r"))
    case 0x09: out.append(UInt8(ascii: "t"))
    case 0x08: out.append(UInt8(ascii: "b"))
    case 0x0C: out.append(UInt8(ascii: "f"))
    default:
        out.append(UInt8(ascii: "u"))
        out.append(UInt8(ascii: "0"))
        out.append(UInt8(ascii: "0"))
        out.append(hexDigits[Int(byte >> 4)])
        out.append(hexDigits[Int(byte & 0x0F)])
    }
}
