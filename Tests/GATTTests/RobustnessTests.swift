// Never trap: every truncated prefix of every vector, and a few hundred thousand random and mutated payloads, go to
// every registered parser (characteristics, the 0x2904 path, declared parsers and advertisement parsers). Each call
// must return a reading or throw; a trap would crash the test process.
//
// The loops are CPU-bound and take tens of seconds together in debug builds: they run through `cpuBound` (a
// low-priority thread of their own) so they never hold the cooperative threads the other tests need.
import GATT
import TestSupport
import Testing

/// A deterministic generator, so a failure reproduces.
struct SplitMix64: RandomNumberGenerator {
    var state: UInt64
    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var z = state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}

/// "Decrypts" by returning the ciphertext, so that the code after decryption sees arbitrary plaintext.
struct PassThroughCipher: AESCCMKeystreamCipher {
    func decryptUnauthenticated(key: [UInt8], nonce: [UInt8], ciphertext: [UInt8]) throws(GATTParseError) -> [UInt8] {
        ciphertext
    }
    func decrypt(key: [UInt8], nonce: [UInt8], ciphertext: [UInt8], tag: [UInt8], aad: [UInt8])
        throws(GATTParseError) -> [UInt8]
    { ciphertext }
    func encrypt(key: [UInt8], nonce: [UInt8], plaintext: [UInt8], aad: [UInt8], tagLength: Int)
        throws(GATTParseError) -> (ciphertext: [UInt8], tag: [UInt8])
    { (plaintext, [UInt8](repeating: 0, count: tagLength)) }
}

/// Everything that decodes bytes, as closures.
struct DecodeTarget: Sendable {
    let label: String
    let decode: @Sendable ([UInt8]) -> Bool  // true = value, false = thrown error
}

let robustnessTargets: [DecodeTarget] = {
    var targets: [DecodeTarget] = []
    for parser in BuiltInCharacteristicParsers.all {
        targets.append(
            DecodeTarget(label: parser.name) { bytes in (try? parser.decode(bytes, context: GATTDecodeContext())) != nil
            })
    }
    // The 0x2904 path with every format code, and declared parsers of every field type.
    for format in UInt8(0)...0x1D {
        let cpf = PresentationFormat(format: format, exponent: -3, unit: 0x272F)
        targets.append(DecodeTarget(label: "cpf \(format)") { bytes in (try? cpf.decodeValue(bytes)) != nil })
    }
    let declared = try! DeclarativeParser(
        DeclarativeParserSpec(
            name: "fuzz_declared", uuid: "FFF1",
            fields: [
                .init(name: "a", type: "s24be", offset: 0, scale: 0.01, add: 3),
                .init(name: "b", type: "sfloat", offset: 3),
                .init(name: "c", type: "float", offset: 5, scale: 2), .init(name: "d", type: "bool:bit12", offset: 1),
                .init(name: "e", type: "u8", offset: 9, enumNames: [1: "one"]),
                .init(name: "f", type: "utf8", offset: 10, length: 3), .init(name: "g", type: "hex", offset: 13),
            ]))
    targets.append(
        DecodeTarget(label: declared.name) { bytes in (try? declared.decode(bytes, context: .init())) != nil })
    // Advertisement parsers, each source, without a cipher, with a pass-through cipher, with and without a MAC.
    let contexts = [
        AdvertisementContext(),
        AdvertisementContext(
            mac: "A4:C1:38:8D:18:B2", bindKey: Array(repeating: 0x11, count: 16), cipher: PassThroughCipher()),
        AdvertisementContext(
            mac: "A4:C1:38:8D:18:B2", bindKey: Array(repeating: 0x22, count: 12), cipher: PassThroughCipher()),
    ]
    for parser in BuiltInAdvertisementParsers.all {
        for source in parser.sources {
            for (i, context) in contexts.enumerated() {
                targets.append(
                    DecodeTarget(label: "\(parser.name) \(source) ctx\(i)") { bytes in
                        (try? parser.decode(bytes, from: source, context: context)) != nil
                    })
            }
        }
    }
    return targets
}()

@Suite struct RobustnessTests {
    @Test func everyTruncatedPrefixOfEveryVector() async throws {
        let payloads = try GATTVectors.all.map { try #require(bytesFromHex($0.payloadHex), "\($0.id)") }
        let calls = try await cpuBound {
            var calls = 0
            for payload in payloads {
                for length in 0...payload.count {
                    let prefix = Array(payload.prefix(length))
                    for target in robustnessTargets {
                        _ = target.decode(prefix)
                        calls += 1
                    }
                }
            }
            return calls
        }
        #expect(calls > 50_000)
    }

    /// Cutting bytes off a payload that must be rejected never makes it acceptable.
    @Test func truncatedErrorVectorsStayRejected() throws {
        for vector in GATTVectors.gatt where vector.mustReject {
            let uuid = try #require(BluetoothUUID(vector.uuid))
            let payload = try #require(bytesFromHex(vector.payloadHex))
            for length in 0..<payload.count {
                #expect(throws: GATTDecodeError.self, "\(vector.id) prefix \(length)") {
                    try sharedRegistry.decode(uuid, Array(payload.prefix(length)))
                }
            }
        }
    }

    @Test(arguments: 0..<4)
    func randomPayloads(shard: Int) async throws {
        let (accepted, rejected) = try await cpuBound { Self.randomPayloadOutcomes(shard: shard) }
        // Both outcomes happen, so the decoders are really being exercised.
        #expect(accepted > 10_000)
        #expect(rejected > 10_000)
    }

    static func randomPayloadOutcomes(shard: Int) -> (accepted: Int, rejected: Int) {
        // 4 shards × 50,000 payloads (200,000 per parser), each fed to every target: two thirds random, one third
        // mutations of real vectors (flip, insert, delete, truncate), so the decoders get past their first checks.
        // (Debug builds decode at a few µs per call; bench/fuzz.sh runs millions more through libFuzzer in release.)
        var rng = SplitMix64(state: 0x5EED_0000 + UInt64(shard))
        let vectors = GATTVectors.all.compactMap { bytesFromHex($0.payloadHex) }.filter { !$0.isEmpty }
        var accepted = 0
        var rejected = 0
        for i in 0..<50_000 {
            var payload: [UInt8]
            if i % 3 == 2, let base = vectors.randomElement(using: &rng) {
                payload = base
                for _ in 0..<Int.random(in: 1...3, using: &rng) {
                    switch Int.random(in: 0..<4, using: &rng) {
                    case 0:
                        payload[Int.random(in: 0..<payload.count, using: &rng)] ^= UInt8(
                            1 << Int.random(in: 0..<8, using: &rng))
                    case 1:
                        payload.insert(
                            UInt8.random(in: 0...255, using: &rng), at: Int.random(in: 0...payload.count, using: &rng))
                    case 2: if payload.count > 1 { payload.remove(at: Int.random(in: 0..<payload.count, using: &rng)) }
                    default: payload = Array(payload.prefix(Int.random(in: 0...payload.count, using: &rng)))
                    }
                    if payload.isEmpty { payload = [0] }
                }
            } else {
                let length = Int.random(in: 0...(i % 5 == 0 ? 64 : 24), using: &rng)
                payload = (0..<length).map { _ in UInt8.random(in: 0...255, using: &rng) }
            }
            for target in robustnessTargets {
                if target.decode(payload) { accepted += 1 } else { rejected += 1 }
            }
        }
        return (accepted, rejected)
    }

    /// 300,000 more random payloads through the registry, each to one registered characteristic or advertisement
    /// source picked at random (so the lookup and error-wrapping paths are fuzzed too).
    @Test func randomPayloadsThroughTheRegistry() async throws {
        let outcomes = try await cpuBound { Self.registryOutcomes() }
        #expect(outcomes[0] > 1000 && outcomes[1] > 1000)
    }

    static func registryOutcomes() -> [Int] {
        var rng = SplitMix64(state: 0xFEED)
        let uuids = sharedRegistry.characteristicParsers.flatMap(\.uuids) + [vendorUUID]
        let sources = BuiltInAdvertisementParsers.all.flatMap(\.sources) + [.manufacturer(0xFFFF)]
        let context = AdvertisementContext(
            mac: "A4:C1:38:8D:18:B2", bindKey: Array(repeating: 0x33, count: 16), cipher: PassThroughCipher())
        var outcomes = [0, 0]
        for i in 0..<300_000 {
            let payload = (0..<Int.random(in: 0...20, using: &rng)).map { _ in UInt8.random(in: 0...255, using: &rng) }
            if i % 4 == 3 {
                let source = sources.randomElement(using: &rng)!
                outcomes[(try? sharedRegistry.decode(source, payload, context: context)) == nil ? 0 : 1] += 1
            } else {
                let uuid = uuids.randomElement(using: &rng)!
                let cpf = i % 8 == 0 ? Array(payload.prefix(7)) : nil
                outcomes[
                    (try? sharedRegistry.decode(uuid, payload, context: GATTDecodeContext(presentationFormat: cpf)))
                        == nil ? 0 : 1] += 1
            }
        }
        return outcomes
    }
}
