// Declarative parsers: validation errors name the path, every field type decodes and encodes, and the documented
// example (config/example-parsers.yaml) loads and works.
import Foundation
import GATT
import TestSupport
import Testing

/// A tiny reader for the YAML subset the example uses (block maps, block lists, plain or quoted scalars, comments).
/// The real configuration loader lives in the YAML target; this keeps the GATT tests independent of it.
indirect enum MiniYAML: Equatable {
    case scalar(String)
    case map([(String, MiniYAML)])
    case list([MiniYAML])

    static func == (a: MiniYAML, b: MiniYAML) -> Bool {
        switch (a, b) {
        case (.scalar(let x), .scalar(let y)): return x == y
        case (.list(let x), .list(let y)): return x == y
        case (.map(let x), .map(let y)):
            return x.count == y.count && zip(x, y).allSatisfy { $0.0 == $1.0 && $0.1 == $1.1 }
        default: return false
        }
    }

    subscript(key: String) -> MiniYAML? {
        if case .map(let pairs) = self { return pairs.first { $0.0 == key }?.1 }
        return nil
    }

    var text: String? {
        if case .scalar(let s) = self { return s }
        return nil
    }

    static func parse(_ source: String) -> MiniYAML {
        var lines: [(indent: Int, text: String)] = []
        for raw in source.split(separator: "\n", omittingEmptySubsequences: false) {
            var line = String(raw)
            if let hash = line.range(of: " #") { line = String(line[..<hash.lowerBound]) }
            let trimmed = line.trimmingCharacters(in: .whitespaces)
            if trimmed.isEmpty || trimmed.hasPrefix("#") { continue }
            lines.append((line.prefix { $0 == " " }.count, trimmed))
        }
        var index = 0
        return block(&lines, &index, indent: lines.first?.indent ?? 0)
    }

    private static func block(_ lines: inout [(indent: Int, text: String)], _ index: inout Int, indent: Int) -> MiniYAML
    {
        if index < lines.count, lines[index].text.hasPrefix("-") {
            var items: [MiniYAML] = []
            while index < lines.count, lines[index].indent == indent, lines[index].text.hasPrefix("-") {
                let rest = lines[index].text.dropFirst().trimmingCharacters(in: .whitespaces)
                if rest.isEmpty {
                    index += 1
                    items.append(block(&lines, &index, indent: lines[index].indent))
                } else {
                    // "- key: value" opens a map whose keys sit two columns further in.
                    lines[index] = (indent + 2, rest)
                    items.append(block(&lines, &index, indent: indent + 2))
                }
            }
            return .list(items)
        }
        var pairs: [(String, MiniYAML)] = []
        while index < lines.count, lines[index].indent == indent {
            let text = lines[index].text
            let colon = text.range(of: ": ") ?? text.range(of: ":", options: .backwards)!
            let key = unquote(String(text[..<colon.lowerBound]))
            let value = text[colon.upperBound...].trimmingCharacters(in: .whitespaces)
            index += 1
            if value.isEmpty, index < lines.count, lines[index].indent > indent {
                pairs.append((key, block(&lines, &index, indent: lines[index].indent)))
            } else {
                pairs.append((key, .scalar(unquote(value))))
            }
        }
        return .map(pairs)
    }

    private static func unquote(_ s: String) -> String {
        if s.count >= 2, let f = s.first, f == "\"" || f == "'", s.last == f { return String(s.dropFirst().dropLast()) }
        return s
    }
}

/// Fills the specs from the YAML tree, as the configuration loader does.
func specs(from yaml: MiniYAML) throws -> [DeclarativeParserSpec] {
    guard case .list(let parsers)? = yaml["parsers"] else { throw HarnessError("no parsers list") }
    return try parsers.map { parser in
        guard case .list(let fields)? = parser["fields"] else { throw HarnessError("no fields") }
        return DeclarativeParserSpec(
            name: parser["name"]?.text ?? "", uuid: parser["uuid"]?.text ?? "",
            fields: fields.map { field in
                var enumNames: [Int64: String]?
                if case .map(let pairs)? = field["enum"] {
                    enumNames = Dictionary(uniqueKeysWithValues: pairs.map { (Int64($0.0)!, $0.1.text!) })
                }
                return DeclarativeFieldSpec(
                    name: field["name"]?.text ?? "", type: field["type"]?.text ?? "",
                    offset: Int(field["offset"]?.text ?? "") ?? -1, scale: field["scale"]?.text.flatMap(Double.init),
                    add: field["add"]?.text.flatMap(Double.init), enumNames: enumNames,
                    length: field["length"]?.text.flatMap { Int($0) }, unit: field["unit"]?.text,
                    deviceClass: field["device_class"]?.text, stateClass: field["state_class"]?.text)
            })
    }
}

@Suite struct DeclarativeParserTests {
    func parser(_ fields: [DeclarativeFieldSpec]) throws -> DeclarativeParser {
        try DeclarativeParser(DeclarativeParserSpec(name: "test_parser", uuid: "FFF1", fields: fields))
    }

    func field(_ name: String, _ type: String, _ offset: Int, scale: Double? = nil, add: Double? = nil)
        -> DeclarativeFieldSpec
    {
        DeclarativeFieldSpec(name: name, type: type, offset: offset, scale: scale, add: add)
    }

    @Test func exampleConfigurationLoadsAndDecodes() throws {
        let text = try String(contentsOf: Fixtures.config("example-parsers.yaml"), encoding: .utf8)
        let declared = try specs(from: MiniYAML.parse(text))
        #expect(declared.map(\.name) == ["acme_climate", "acme_label"])
        let registry = try GATTParserRegistry.builtIn(declaring: declared)
        let climate = try #require(registry.parser(named: "acme_climate"))
        let uuid = try #require(BluetoothUUID("6E400010-B5A3-F393-E0A9-E50E24DCCA9E"))
        // The payload documented in config/PARSERS.md.
        let payload = try #require(bytesFromHex("29094D10020100C87D"))
        let reading = try registry.decode(uuid, payload)
        #expect(
            reading.jsonString
                == #"{"temperature_c":23.45,"humidity_pct":41.73,"battery_low":false,"heater_on":true,"mode":1,"mode_name":"eco","pressure_pa":101325.0}"#
        )
        #expect(try climate.encode(reading) == payload)
        // Writes may name the enum value.
        var write = reading
        write.fields[4] = GATTField("mode", .string("comfort"))
        #expect(hexString(try climate.encode(write)) == "29094d10020200c87d")
        let label = try registry.decode(
            BluetoothUUID("6e400011-b5a3-f393-e0a9-e50e24dcca9e")!, Array("Kitchen\0\0".utf8))
        #expect(label.jsonString == #"{"label":"Kitchen"}"#)
        // Too short: rejected, naming the parser and the offset.
        do {
            _ = try registry.decode(uuid, Array(payload.prefix(7)))
            Issue.record("accepted")
        } catch {
            #expect(
                error.description
                    == "acme_climate (6e400010-b5a3-f393-e0a9-e50e24dcca9e): truncated at offset 6: needed 3 octet(s), 1 available"
            )
        }
    }

    @Test func documentationShowsTheExample() throws {
        let doc = try String(contentsOf: Fixtures.config("PARSERS.md"), encoding: .utf8)
        #expect(doc.contains("29094D10020100C87D"))
        #expect(doc.contains("example-parsers.yaml"))
        // The table of built-in parsers lists every one of them.
        for parser in BuiltInCharacteristicParsers.all {
            let short = parser.name.replacingOccurrences(of: "_concentration", with: "_")
            #expect(
                doc.contains("`\(parser.name)`") || doc.contains("`\(short)…`"), "\(parser.name) is not in PARSERS.md")
        }
    }

    @Test(arguments: [
        ("u8", "FE", GATTValue.int(254)), ("s8", "FE", .int(-2)), ("u16", "0102", .int(0x0201)),
        ("u16le", "0102", .int(0x0201)), ("u16be", "0102", .int(0x0102)), ("s16le", "FEFF", .int(-2)),
        ("s16be", "FFFE", .int(-2)), ("u24le", "010203", .int(0x030201)), ("u24be", "010203", .int(0x010203)),
        ("s24le", "FFFF7F", .int(0x7FFFFF)), ("s24be", "800000", .int(-0x800000)),
        ("u32le", "FFFFFFFF", .int(0xFFFF_FFFF)),
        ("u32be", "00000102", .int(0x0102)), ("s32le", "FFFFFFFF", .int(-1)), ("s32be", "80000000", .int(-0x8000_0000)),
        ("sfloat", "6DF1", .double(36.5)), ("sfloat", "FF07", .string("NaN")), ("float", "6C0100FF", .double(36.4)),
        ("utf8", "4869", .string("Hi")), ("hex", "BEEF", .string("beef")), ("bool:bit0", "01", .bool(true)),
        ("bool:bit9", "0002", .bool(true)), ("bool:bit9", "FFFD", .bool(false)),
    ])
    func everyTypeDecodesAndEncodes(type: String, hex: String, value: GATTValue) throws {
        let p = try parser([field("v", type, 0)])
        let bytes = try #require(bytesFromHex(hex))
        let reading = try p.decode(bytes, context: GATTDecodeContext())
        #expect(reading["v"] == value)
        let encoded = try p.encode(reading)
        if type.hasPrefix("bool") {
            #expect(try p.decode(encoded, context: GATTDecodeContext())["v"] == value)
        } else {
            #expect(encoded == bytes)
        }
    }

    @Test func scaleAndAdd() throws {
        let p = try parser([field("t", "s16le", 0, scale: 0.1, add: -40), field("h", "u8", 2, scale: 0.5)])
        let reading = try p.decode([0x2C, 0x01, 0x55], context: GATTDecodeContext())
        #expect(reading["t"] == .double(-10.0))
        #expect(reading["h"] == .double(42.5))
        #expect(try p.encode(reading) == [0x2C, 0x01, 0x55])
        #expect(throws: GATTParseError.self) {
            try p.encode(GATTReading([GATTField("t", .double(10_000)), GATTField("h", .int(1))]))
        }
        #expect(throws: GATTParseError.self) { try p.encode(GATTReading([GATTField("t", .double(1))])) }
    }

    @Test func fixedLengthStringsPad() throws {
        let p = try parser([
            DeclarativeFieldSpec(name: "name", type: "utf8", offset: 0, length: 4), field("n", "u8", 4),
            DeclarativeFieldSpec(name: "tail", type: "hex", offset: 5),
        ])
        let reading = try p.decode(
            bytesFromHex("41420000 07 AABB".replacingOccurrences(of: " ", with: ""))!, context: .init())
        #expect(reading.jsonString == #"{"name":"AB","n":7,"tail":"aabb"}"#)
        #expect(hexString(try p.encode(reading)) == "4142000007aabb")
        #expect(throws: GATTParseError.self) {
            try p.encode(
                GATTReading([
                    GATTField("name", .string("TOOLONG")), GATTField("n", .int(1)), GATTField("tail", .string("")),
                ]))
        }
    }

    @Test func validationNamesThePath() {
        let good = field("a", "u8", 0)
        func spec(_ fields: [DeclarativeFieldSpec], name: String = "vendor", uuid: String = "FFF1")
            -> DeclarativeParserSpec
        {
            DeclarativeParserSpec(name: name, uuid: uuid, fields: fields)
        }
        func error(_ s: DeclarativeParserSpec) -> String {
            do {
                _ = try GATTParserRegistry.builtIn(declaring: [s])
                return "accepted"
            } catch {
                return error.description
            }
        }
        #expect(
            error(spec([good, good.renamed("b"), field("c", "u17", 2)])).hasPrefix(
                #"parsers[0].fields[2].type: "u17" is not a field type"#))
        #expect(
            error(spec([good], uuid: "xyz")) == #"parsers[0].uuid: "xyz" is not a UUID (2A6E, 0x2a6e or 8-4-4-4-12)"#)
        #expect(error(spec([good], name: "Bad Name")).hasPrefix("parsers[0].name:"))
        #expect(error(spec([])) == "parsers[0].fields: at least one field is needed")
        #expect(error(spec([good, good])).hasPrefix("parsers[0].fields[1].name:"))
        #expect(error(spec([field("a", "utf8", 0, scale: 2)])).hasPrefix("parsers[0].fields[0].scale:"))
        #expect(error(spec([field("a", "u8", 0, scale: 0)])).hasPrefix("parsers[0].fields[0].scale:"))
        #expect(error(spec([field("a", "u8", -1)])).hasPrefix("parsers[0].fields[0].offset:"))
        #expect(
            error(spec([DeclarativeFieldSpec(name: "a", type: "sfloat", offset: 0, enumNames: [0: "x"])])).hasPrefix(
                "parsers[0].fields[0].enum:"))
        #expect(
            error(spec([DeclarativeFieldSpec(name: "a", type: "u8", offset: 0, length: 2)])).hasPrefix(
                "parsers[0].fields[0].length:"))
        #expect(error(spec([field("a", "hex", 0), field("b", "utf8", 1)])).hasPrefix("parsers[0].fields[1].length:"))
        #expect(error(spec([field("a", "hex", 0), field("b", "u8", 1)])).hasPrefix("parsers[0].fields[0].offset:"))
        for bad in ["bool:bit", "bool:bit32", "bool:bitx", "u16xe", "u", "f32", "U8", "sfloatbe"] {
            #expect(error(spec([field("a", bad, 0)])).hasPrefix("parsers[0].fields[0].type:"), "\(bad)")
        }
        #expect(error(spec([good])) == "accepted")
    }
}

extension DeclarativeFieldSpec {
    func renamed(_ name: String) -> DeclarativeFieldSpec {
        var copy = self
        copy.name = name
        return copy
    }
}
