// Advertisement vectors (Tests/Fixtures/vectors.json, "kind": "adv") through the Swift API, plus robustness.
import Foundation
import GATT
import GATTCrypto
import TestSupport
import Testing

/// One `adv` vector from the shared file (SPEC.md §0).
struct AdvVector: Sendable, CustomTestStringConvertible {
    let id: String
    let source: AdvertisementSource
    let payload: [UInt8]
    /// Expected fields as JSON values (NSNull for null).
    let expected: [(String, ExpectedValue)]
    let error: String?
    let mac: String?
    let bindKey: [UInt8]?
    let name: String?
    let tolerance: Double

    var testDescription: String { id }

    enum ExpectedValue: Sendable {
        case null
        case bool(Bool)
        case number(Double)
        case string(String)
    }

    var context: AdvertisementContext {
        AdvertisementContext(mac: mac, bindKey: bindKey, localName: name, cipher: OpenSSLAESCCM())
    }

    /// The JSON shapes of the vector file that matter here.
    private struct Entry: Decodable {
        let id: String
        let kind: String
        let uuid: String
        let payloadHex: String
        let expected: [String: JSONScalar]?
        let error: String?
        let params: [String: JSONScalar]?
        let tolerance: Double?

        enum CodingKeys: String, CodingKey {
            case id, kind, uuid, expected, error, params, tolerance
            case payloadHex = "payload_hex"
        }
    }

    enum JSONScalar: Decodable {
        case null
        case bool(Bool)
        case number(Double)
        case string(String)
        case other

        init(from decoder: any Decoder) throws {
            let c = try decoder.singleValueContainer()
            if c.decodeNil() {
                self = .null
            } else if let b = try? c.decode(Bool.self) {
                self = .bool(b)
            } else if let n = try? c.decode(Double.self) {
                self = .number(n)
            } else if let s = try? c.decode(String.self) {
                self = .string(s)
            } else {
                self = .other
            }
        }

        var string: String? { if case .string(let s) = self { s } else { nil } }
    }

    static let all: [AdvVector] = {
        let url = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("Fixtures/vectors.json")
        guard let data = try? Data(contentsOf: url), let entries = try? JSONDecoder().decode([Entry].self, from: data)
        else { return [] }
        // SPEC.md §0: the company ids used by the vectors; everything else is a 16-bit service-data UUID.
        let companies: Set<UInt16> = [0x0499, 0x004C, 0xEC88]
        return entries.compactMap { e -> AdvVector? in
            guard e.kind == "adv", let code = UInt16(e.uuid, radix: 16), let payload = bytesFromHex(e.payloadHex)
            else { return nil }
            let source: AdvertisementSource =
                companies.contains(code) ? .manufacturer(code) : .serviceData(BluetoothUUID(code))
            let expected: [(String, ExpectedValue)] = (e.expected ?? [:]).sorted { $0.key < $1.key }.map {
                switch $0.value {
                case .null, .other: ($0.key, .null)
                case .bool(let b): ($0.key, .bool(b))
                case .number(let n): ($0.key, .number(n))
                case .string(let s): ($0.key, .string(s))
                }
            }
            let params = e.params ?? [:]
            return AdvVector(
                id: e.id, source: source, payload: payload, expected: expected, error: e.error,
                mac: params["mac"]?.string, bindKey: params["bindkey"]?.string.flatMap(bytesFromHex),
                name: params["name"]?.string, tolerance: e.tolerance ?? 1e-6)
        }
    }()
}

func advRegistry() throws -> GATTParserRegistry {
    var registry = GATTParserRegistry()
    for parser in BuiltInAdvertisementParsers.all { try registry.register(parser) }
    return registry
}

@Suite struct AdvertisementVectorTests {
    @Test func vectorFileHasEveryFormat() {
        let sources = Set(AdvVector.all.map(\.source))
        #expect(AdvVector.all.count >= 40)
        for code in [0xFCD2, 0x181A, 0xFE95, 0xFEAA] as [UInt16] {
            #expect(sources.contains(.serviceData(BluetoothUUID(code))))
        }
        for company in [0x0499, 0x004C, 0xEC88] as [UInt16] { #expect(sources.contains(.manufacturer(company))) }
    }

    @Test(arguments: AdvVector.all)
    func vector(_ v: AdvVector) throws {
        let registry = try advRegistry()
        #expect(registry.parser(for: v.source) != nil, "no parser for \(v.source)")
        if let error = v.error {
            #expect(throws: GATTParseError.self, "\(v.id) must be rejected: \(error)") {
                try registry.decode(v.source, v.payload, context: v.context)
            }
            return
        }
        let reading = try registry.decode(v.source, v.payload, context: v.context)
        for (name, want) in v.expected {
            let got = reading[name]
            switch want {
            case .null:
                #expect(got == nil || got == .null, "\(v.id).\(name): expected null, got \(String(describing: got))")
            case .bool(let b):
                #expect(got == .bool(b), "\(v.id).\(name): expected \(b), got \(String(describing: got))")
            case .string(let s):
                #expect(got == .string(s), "\(v.id).\(name): expected \(s), got \(String(describing: got))")
            case .number(let n):
                let value: Double? =
                    switch got {
                    case .int(let i): Double(i)
                    case .double(let d): d
                    default: nil
                    }
                guard let value else {
                    Issue.record("\(v.id).\(name): expected \(n), got \(String(describing: got))")
                    continue
                }
                #expect(
                    abs(value - n) <= v.tolerance + 1e-9 * abs(n), "\(v.id).\(name): expected \(n), got \(value)")
            }
        }
    }

    /// Every rejection names its format, so a log line or `blebridge decode`'s stderr says what failed.
    @Test func errorsNameTheFormat() throws {
        let registry = try advRegistry()
        let names: [AdvertisementSource: String] = [
            .serviceData(BluetoothUUID(UInt16(0xFCD2))): "BTHome v2", .manufacturer(0x0499): "Ruuvi",
            .serviceData(BluetoothUUID(UInt16(0x181A))): "ATC", .serviceData(BluetoothUUID(UInt16(0xFE95))): "MiBeacon",
            .manufacturer(0x004C): "iBeacon", .serviceData(BluetoothUUID(UInt16(0xFEAA))): "Eddystone",
            .manufacturer(0xEC88): "Govee",
        ]
        for v in AdvVector.all {
            // Every vector's prefixes that are rejected, plus the error vectors themselves.
            for length in 0...v.payload.count {
                do {
                    _ = try registry.decode(v.source, Array(v.payload.prefix(length)), context: v.context)
                } catch {
                    let name = try #require(names[v.source])
                    #expect(error.description.contains(name), "\(v.id)[..<\(length)]: \(error)")
                }
            }
        }
    }

    /// Every truncated prefix of every adv vector: a value or a thrown error, never a crash. Prefixes of a
    /// fixed-length or encrypted format must be rejected.
    @Test func truncatedPrefixesNeverTrap() throws {
        let registry = try advRegistry()
        var decoded = 0
        var rejected = 0
        for v in AdvVector.all {
            for length in 0..<v.payload.count {
                do {
                    _ = try registry.decode(v.source, Array(v.payload.prefix(length)), context: v.context)
                    decoded += 1
                } catch {
                    rejected += 1
                }
            }
        }
        #expect(rejected > decoded)
        // Fixed-size formats reject every proper prefix.
        for v in AdvVector.all
        where v.error == nil
            && [.manufacturer(0x0499), .manufacturer(0x004C), .manufacturer(0xEC88)].contains(v.source)
        {
            for length in 0..<v.payload.count {
                #expect(throws: GATTParseError.self) {
                    try registry.decode(v.source, Array(v.payload.prefix(length)), context: v.context)
                }
            }
        }
    }

    /// ~200k random payloads (lengths 0...40) per parser, half of them starting with a plausible header so the
    /// deeper paths (objects, decryption) run: a value or an error, never a crash.
    @Test(arguments: BuiltInAdvertisementParsers.all.map(\.name))
    func randomPayloadsNeverTrap(_ parserName: String) async throws {
        #expect(BuiltInAdvertisementParsers.all.contains { $0.name == parserName })
        // CPU-bound (seconds in debug builds): on a low-priority thread of its own, off the cooperative pool.
        let outcomes = try await cpuBound { try Self.randomPayloadOutcomes(parserName) }
        #expect(outcomes.values + outcomes.errors == 200_000)
        #expect(outcomes.errors > 0)
    }

    static func randomPayloadOutcomes(_ parserName: String) throws -> (values: Int, errors: Int) {
        guard let parser = BuiltInAdvertisementParsers.all.first(where: { $0.name == parserName }) else {
            throw HarnessError("no parser \(parserName)")
        }
        let source = parser.sources[0]
        let headers: [[UInt8]] = AdvVector.all.filter { $0.source == source }.map { Array($0.payload.prefix(3)) }
        let contexts = [
            AdvertisementContext(),
            AdvertisementContext(
                mac: "A4:C1:38:8D:18:B2", bindKey: Array(repeating: 0x42, count: 16), cipher: OpenSSLAESCCM()),
            AdvertisementContext(
                mac: "A4:C1:38:8D:18:B2", bindKey: Array(repeating: 0x42, count: 12), cipher: OpenSSLAESCCM()),
        ]
        var rng = AdvertisementTestRNG(seed: UInt64(parserName.utf8.reduce(7) { $0 &* 31 &+ UInt64($1) }))
        var outcomes = (values: 0, errors: 0)
        for round in 0..<200_000 {
            let length = Int(rng.next() % 41)
            var payload = (0..<length).map { _ in UInt8(truncatingIfNeeded: rng.next()) }
            if round % 2 == 0, let header = headers.randomElement(using: &rng) {
                for (k, b) in header.prefix(min(length, 2)).enumerated() { payload[k] = b }
            }
            do {
                _ = try parser.decode(payload, from: source, context: contexts[round % contexts.count])
                outcomes.values += 1
            } catch {
                outcomes.errors += 1
            }
        }
        return outcomes
    }
}

/// A small deterministic PRNG so random tests reproduce.
struct AdvertisementTestRNG: RandomNumberGenerator {
    var state: UInt64
    init(seed: UInt64) { state = seed }
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}
