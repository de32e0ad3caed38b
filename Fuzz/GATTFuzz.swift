// libFuzzer target for every decoder in the GATT module. Not part of the package build: bench/fuzz.sh compiles it
// together with Sources/GATT (one module, so no `import GATT`) using `swiftc -sanitize=fuzzer,address`.
//
// Each input goes to every characteristic parser, the 0x2904 path (descriptor = the first 7 octets), a declared
// parser with every field type, and every advertisement parser (with and without a MAC, key and cipher). A decoder
// may return a reading or throw; a trap, an out-of-bounds access (ASan) or a broken invariant is a crash:
//   * a reading's JSON must be ASCII-safe UTF-8 that starts with `{` and ends with `}`;
//   * where a parser encodes, re-decoding its own encoding of a decoded reading must succeed.

/// "Decrypts" by returning the ciphertext, so the code after decryption sees arbitrary plaintext.
struct FuzzCipher: AESCCMKeystreamCipher {
    func decrypt(key: [UInt8], nonce: [UInt8], ciphertext: [UInt8], tag: [UInt8], aad: [UInt8])
        throws(GATTParseError) -> [UInt8]
    {
        if tag.first == 0xFF { throw .decryptionFailed("fuzz") }
        return ciphertext
    }
    func encrypt(key: [UInt8], nonce: [UInt8], plaintext: [UInt8], aad: [UInt8], tagLength: Int)
        throws(GATTParseError) -> (ciphertext: [UInt8], tag: [UInt8])
    { (plaintext, [UInt8](repeating: 0, count: tagLength)) }
    func decryptUnauthenticated(key: [UInt8], nonce: [UInt8], ciphertext: [UInt8]) throws(GATTParseError) -> [UInt8] {
        ciphertext
    }
}

let declaredParser: DeclarativeParser? = try? DeclarativeParser(
    DeclarativeParserSpec(
        name: "fuzz_declared", uuid: "FFF1",
        fields: [
            .init(name: "a", type: "s24be", offset: 0, scale: 0.01, add: 3), .init(name: "b", type: "sfloat", offset: 3),
            .init(name: "c", type: "float", offset: 5, scale: 2), .init(name: "d", type: "bool:bit12", offset: 1),
            .init(name: "e", type: "u8", offset: 9, enumNames: [1: "one"]),
            .init(name: "f", type: "utf8", offset: 10, length: 3), .init(name: "g", type: "hex", offset: 13),
        ]))

let characteristicParsers: [any GATTCharacteristicParser] =
    BuiltInCharacteristicParsers.all + (declaredParser.map { [$0] } ?? [])

let advertisementTargets: [(any AdvertisementParser, AdvertisementSource)] = BuiltInAdvertisementParsers.all.flatMap {
    parser in parser.sources.map { (parser, $0) }
}

let advertisementContexts = [
    AdvertisementContext(),
    AdvertisementContext(mac: "A4:C1:38:8D:18:B2", bindKey: [UInt8](repeating: 0x11, count: 16), cipher: FuzzCipher()),
    AdvertisementContext(mac: "A4:C1:38:8D:18:B2", bindKey: [UInt8](repeating: 0x22, count: 12), cipher: FuzzCipher()),
]

func check(_ reading: GATTReading) {
    let json = reading.jsonString
    guard json.utf8.first == UInt8(ascii: "{"), json.utf8.last == UInt8(ascii: "}") else {
        fatalError("malformed JSON: \(json)")
    }
}

@_cdecl("LLVMFuzzerTestOneInput")
public func fuzzOneInput(_ data: UnsafePointer<UInt8>, _ size: Int) -> Int32 {
    let bytes = Array(UnsafeBufferPointer(start: data, count: size))
    let context = GATTDecodeContext()
    for parser in characteristicParsers {
        guard let reading = try? parser.decode(bytes, context: context) else { continue }
        check(reading)
        if let encoded = try? parser.encode(reading) {
            do {
                check(try parser.decode(encoded, context: context))
            } catch {
                fatalError("\(parser.name): its own encoding \(hexString(encoded)) of \(hexString(bytes)) is rejected: \(error)")
            }
        }
    }
    if bytes.count >= 7 {
        let descriptor = Array(bytes.prefix(7))
        if let reading = try? PresentationFormat.decode(Array(bytes.dropFirst(7)), descriptor: descriptor) { check(reading) }
    }
    for (parser, source) in advertisementTargets {
        for advContext in advertisementContexts {
            if let reading = try? parser.decode(bytes, from: source, context: advContext) { check(reading) }
        }
    }
    return 0
}
