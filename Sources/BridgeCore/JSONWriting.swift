// The hot path's JSON writer: the same compact text as `JSONValue.write(into:)` and `iso8601(_:)`, appended
// straight into one byte buffer (no intermediate arrays or strings per value).
import GATT

extension JSONValue {
    /// Appends the same compact JSON as `write(into:)`, without a temporary array per scalar.
    func appendCompact(to out: inout [UInt8]) {
        switch self {
        case .null: out.append(contentsOf: "null".utf8)
        case .bool(let b): out.append(contentsOf: (b ? "true" : "false").utf8)
        case .int(let i): appendDecimal(i, to: &out)
        case .double(let d): GATTValue.double(d).appendJSON(to: &out)
        case .string(let s): GATTValue.string(s).appendJSON(to: &out)
        case .array(let items):
            out.append(UInt8(ascii: "["))
            var first = true
            for item in items {
                if !first { out.append(UInt8(ascii: ",")) }
                first = false
                item.appendCompact(to: &out)
            }
            out.append(UInt8(ascii: "]"))
        case .object(let fields):
            out.append(UInt8(ascii: "{"))
            var first = true
            for (key, value) in fields {
                if !first { out.append(UInt8(ascii: ",")) }
                first = false
                GATTValue.string(key).appendJSON(to: &out)
                out.append(UInt8(ascii: ":"))
                value.appendCompact(to: &out)
            }
            out.append(UInt8(ascii: "}"))
        }
    }
}

/// Appends `value` in decimal (as `String(value)` writes it).
func appendDecimal(_ value: Int64, to out: inout [UInt8]) {
    if value < 0 {
        out.append(UInt8(ascii: "-"))
    }
    // The magnitude as unsigned, so that Int64.min does not overflow.
    var magnitude = value.magnitude
    var digits:
        (
            UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8,
            UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8, UInt8
        ) =
            (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    var count = 0
    withUnsafeMutableBytes(of: &digits) { buffer in
        repeat {
            buffer[count] = UInt8(ascii: "0") + UInt8(magnitude % 10)
            magnitude /= 10
            count += 1
        } while magnitude > 0
        var i = count
        while i > 0 {
            i -= 1
            out.append(buffer[i])
        }
    }
}

/// Appends `v` in decimal, left-padded with zeros to `width` digits (as `iso8601(_:)` pads).
private func appendPadded(_ v: Int64, _ width: Int, to out: inout [UInt8]) {
    guard v >= 0 else {
        // Only years before 0 are negative; the general form keeps the text identical to `iso8601(_:)`.
        let s = String(v)
        out.append(contentsOf: repeatElement(UInt8(ascii: "0"), count: max(0, width - s.utf8.count)))
        out.append(contentsOf: s.utf8)
        return
    }
    var digits = 1
    var rest = v / 10
    while rest > 0 {
        digits += 1
        rest /= 10
    }
    if digits < width { out.append(contentsOf: repeatElement(UInt8(ascii: "0"), count: width - digits)) }
    appendDecimal(v, to: &out)
}

/// Appends `iso8601(seconds)` as a JSON string (its characters never need escaping).
func appendISO8601JSON(_ seconds: Double, to out: inout [UInt8]) {
    out.append(UInt8(ascii: "\""))
    appendISO8601(seconds, to: &out)
    out.append(UInt8(ascii: "\""))
}

/// Appends `2026-12-01T21:12:51.123Z` for seconds since 1970 (UTC, milliseconds; out-of-range values give the epoch).
func appendISO8601(_ seconds: Double, to out: inout [UInt8]) {
    guard seconds.isFinite, seconds > -1e12, seconds < 1e12 else {
        out.append(contentsOf: "1970-01-01T00:00:00.000Z".utf8)
        return
    }
    // H. Hinnant's civil-from-days algorithm.
    let totalMillis = Int64((seconds * 1000).rounded(.down))
    var days = totalMillis / 86_400_000
    var rest = totalMillis % 86_400_000
    if rest < 0 {
        rest += 86_400_000
        days -= 1
    }
    let z = days + 719_468
    let era = (z >= 0 ? z : z - 146_096) / 146_097
    let doe = z - era * 146_097
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365
    var year = yoe + era * 400
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100)
    let mp = (5 * doy + 2) / 153
    let day = doy - (153 * mp + 2) / 5 + 1
    let month = mp < 10 ? mp + 3 : mp - 9
    if month <= 2 { year += 1 }
    appendPadded(year, 4, to: &out)
    out.append(UInt8(ascii: "-"))
    appendPadded(month, 2, to: &out)
    out.append(UInt8(ascii: "-"))
    appendPadded(day, 2, to: &out)
    out.append(UInt8(ascii: "T"))
    appendPadded(rest / 3_600_000, 2, to: &out)
    out.append(UInt8(ascii: ":"))
    appendPadded(rest / 60_000 % 60, 2, to: &out)
    out.append(UInt8(ascii: ":"))
    appendPadded(rest / 1000 % 60, 2, to: &out)
    out.append(UInt8(ascii: "."))
    appendPadded(rest % 1000, 3, to: &out)
    out.append(UInt8(ascii: "Z"))
}
