// The shared decoding vectors (Tests/Fixtures/vectors.json, SPEC.md §0) and the comparison rules the GATT and CLI
// tests apply: numbers within the vector's tolerance (absolute, default 1e-6) or 1e-9 relative, `null` expected =
// absent or null, expected objects are subsets of the actual ones.
import Foundation

/// A JSON value as the tests see it (numbers as Double).
public enum JSONValue: Sendable, Equatable, Decodable, CustomStringConvertible {
    case null
    case bool(Bool)
    case number(Double)
    case string(String)
    case array([JSONValue])
    case object([String: JSONValue])

    public init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        if container.decodeNil() {
            self = .null
        } else if let b = try? container.decode(Bool.self) {
            self = .bool(b)
        } else if let d = try? container.decode(Double.self) {
            self = .number(d)
        } else if let s = try? container.decode(String.self) {
            self = .string(s)
        } else if let a = try? container.decode([JSONValue].self) {
            self = .array(a)
        } else {
            self = .object(try container.decode([String: JSONValue].self))
        }
    }

    /// Parses one JSON text.
    public static func parse(_ text: String) throws -> JSONValue {
        try JSONDecoder().decode(JSONValue.self, from: Data(text.utf8))
    }

    public var description: String {
        switch self {
        case .null: return "null"
        case .bool(let b): return "\(b)"
        case .number(let d): return "\(d)"
        case .string(let s): return "\"\(s)\""
        case .array(let a): return "[\(a.map(\.description).joined(separator: ", "))]"
        case .object(let o):
            return "{\(o.keys.sorted().map { "\"\($0)\": \(o[$0]!.description)" }.joined(separator: ", "))}"
        }
    }

    public subscript(key: String) -> JSONValue? {
        if case .object(let o) = self { return o[key] }
        return nil
    }

    public var stringValue: String? {
        if case .string(let s) = self { return s }
        return nil
    }

    public var numberValue: Double? {
        if case .number(let d) = self { return d }
        return nil
    }
}

/// One vector of Tests/Fixtures/vectors.json.
public struct GATTVector: Sendable, Decodable, CustomStringConvertible {
    public let id: String
    public let kind: String
    public let uuid: String
    public let payloadHex: String
    public let expected: [String: JSONValue]
    public let error: String?
    public let params: [String: JSONValue]?
    public let tolerance: Double?

    enum CodingKeys: String, CodingKey {
        case id, kind, uuid, expected, error, params, tolerance
        case payloadHex = "payload_hex"
    }

    public var description: String { id }

    /// The absolute tolerance for numbers (default 1e-6).
    public var absoluteTolerance: Double { tolerance ?? 1e-6 }

    /// A string parameter (`mac`, `bindkey`, `name`, `value_hex`, `value_unit`).
    public func param(_ key: String) -> String? { params?[key]?.stringValue }

    /// True when the vector's payload must be rejected.
    public var mustReject: Bool { error != nil }

    /// For advertisement vectors: true when the UUID column is a company id (manufacturer data), not a service UUID.
    public var isManufacturerData: Bool { ["0499", "004C", "EC88"].contains(uuid.uppercased()) }
}

/// Loads the vectors once.
public enum GATTVectors {
    /// Every vector in the fixture file.
    public static let all: [GATTVector] = {
        do {
            let data = try Data(contentsOf: Fixtures.url("vectors.json"))
            return try JSONDecoder().decode([GATTVector].self, from: data)
        } catch {
            // A missing or unreadable fixture must fail the tests loudly, not make them vacuous.
            print("cannot load Tests/Fixtures/vectors.json: \(error)")
            return []
        }
    }()

    /// The GATT (characteristic and descriptor) vectors.
    public static var gatt: [GATTVector] { all.filter { $0.kind == "gatt" } }

    /// The advertisement vectors.
    public static var advertisements: [GATTVector] { all.filter { $0.kind == "adv" } }
}

/// Compares an expected JSON value with an actual one under the vector rules. Returns nil when they match, else
/// a description of the first difference.
public func jsonMismatch(expected: JSONValue, actual: JSONValue?, tolerance: Double, path: String = "$") -> String? {
    switch expected {
    case .null:
        if actual == nil || actual == .null { return nil }
        return "\(path): expected null or absent, got \(actual!)"
    case .number(let e):
        guard case .number(let a)? = actual else { return "\(path): expected \(e), got \(actual.map(\.description) ?? "nothing")" }
        return abs(e - a) <= max(tolerance, 1e-9 * abs(e)) ? nil : "\(path): expected \(e), got \(a)"
    case .bool, .string:
        return expected == actual ? nil : "\(path): expected \(expected), got \(actual.map(\.description) ?? "nothing")"
    case .array(let e):
        guard case .array(let a)? = actual, a.count == e.count else {
            return "\(path): expected \(expected), got \(actual.map(\.description) ?? "nothing")"
        }
        for (i, (x, y)) in zip(e, a).enumerated() {
            if let m = jsonMismatch(expected: x, actual: y, tolerance: tolerance, path: "\(path)[\(i)]") { return m }
        }
        return nil
    case .object(let e):
        guard case .object(let a)? = actual else {
            return "\(path): expected an object, got \(actual.map(\.description) ?? "nothing")"
        }
        for key in e.keys.sorted() {
            if let m = jsonMismatch(expected: e[key]!, actual: a[key], tolerance: tolerance, path: "\(path).\(key)") {
                return m
            }
        }
        return nil
    }
}
