// Encoders take values from outside (the `write` command's JSON, later MQTT set payloads), so they must never trap
// either: every field of every decodable reading is replaced by extreme numbers, long strings and wrong types, and
// each encode must return bytes or throw.
import GATT
import Testing

/// Values that a careless encoder would turn into a trapping integer conversion.
let hostileEncoderValues: [GATTValue] = [
    .double(1e300), .double(-1e300), .double(.nan), .double(.infinity), .double(-.infinity), .double(1e19),
    .double(-1e19), .double(9.3e18), .int(.max), .int(.min), .int(-1), .int(70_000), .int(5_000_000_000),
    .string(String(repeating: "x", count: 300)), .string(""), .string("255.255.255.256"), .bool(true), .null,
    .array([.int(.max), .double(.nan)]), .array([]),
]

@Suite("Encoders never trap")
struct EncodeRobustnessTests {
    @Test("every field of decodable readings, replaced by hostile values, encodes or throws")
    func hostileFieldValues() {
        var rng = SplitMix64(state: 0xA0D1_7E5C)
        var attempts = 0
        for parser in BuiltInCharacteristicParsers.all {
            var readings: [GATTReading] = []
            for _ in 0..<400 where readings.count < 6 {
                let bytes = (0..<Int.random(in: 1...24, using: &rng)).map { _ in UInt8.random(in: 0...255, using: &rng)
                }
                if let reading = try? parser.decode(bytes, context: GATTDecodeContext()) { readings.append(reading) }
            }
            for reading in readings {
                for index in reading.fields.indices {
                    for hostile in hostileEncoderValues {
                        var mutated = reading
                        mutated.fields[index].value = hostile
                        _ = try? parser.encode(mutated)
                        attempts += 1
                    }
                }
            }
        }
        #expect(attempts > 1000)
    }

    @Test("a reading with only hostile fields encodes or throws for every parser")
    func hostileOnly() {
        for parser in BuiltInCharacteristicParsers.all {
            for hostile in hostileEncoderValues {
                let names = ["value", "flags", "year", "heart_rate_bpm", "temperature_celsius", "level_pct"]
                _ = try? parser.encode(GATTReading(names.map { GATTField($0, hostile) }))
            }
        }
    }

    @Test("battery_level rejects values outside 0...100 that do not fit an Int64, naming the field")
    func batteryLevelHugeValues() throws {
        let registry = try GATTParserRegistry.builtIn()
        let parser = try #require(registry.parser(named: "battery_level"))
        for value: GATTValue in [.double(1e300), .double(-1e300), .double(.nan), .double(.infinity), .int(101)] {
            #expect(throws: GATTParseError.self) { try parser.encode(GATTReading([GATTField("battery_pct", value)])) }
            do {
                _ = try parser.encode(GATTReading([GATTField("battery_pct", value)]))
            } catch {
                #expect("\(error)".contains("battery_pct"), "\(error)")
            }
        }
        #expect(try parser.encode(GATTReading([GATTField("battery_pct", .int(57))])) == [57])
    }

    @Test("BTHome objects of every id with hostile values encode or throw")
    func bthomeHostileObjects() {
        var encoded = 0
        for id in UInt8(0)...255 {
            for hostile in hostileEncoderValues + [.array([.string("rotate_left"), .double(1e300)])] {
                if (try? BTHomeEncoder.encode([BTHomeObject(id: id, hostile)])) != nil { encoded += 1 }
            }
        }
        #expect(encoded > 0)
    }

    @Test("a declared parser of every field type encodes hostile values or throws")
    func declaredHostileValues() throws {
        let fields: [DeclarativeFieldSpec] = [
            .init(name: "a", type: "s24be", offset: 0, scale: 0.01, add: 3),
            .init(name: "b", type: "sfloat", offset: 3),
            .init(name: "c", type: "float", offset: 5, scale: 1e-300), .init(name: "d", type: "bool:bit12", offset: 1),
            .init(name: "e", type: "u8", offset: 9, enumNames: [1: "one"]),
            .init(name: "f", type: "utf8", offset: 10, length: 3), .init(name: "g", type: "hex", offset: 13),
        ]
        let parser = try DeclarativeParser(
            DeclarativeParserSpec(name: "hostile_declared", uuid: "FFF2", fields: fields))
        let valid: [GATTValue] = [
            .double(1.5), .double(2), .double(3), .bool(true), .int(1), .string("ab"), .string("00"),
        ]
        for index in fields.indices {
            for hostile in hostileEncoderValues {
                var values = valid
                values[index] = hostile
                _ = try? parser.encode(GATTReading(zip(fields, values).map { GATTField($0.name, $1) }))
            }
        }
        #expect(throws: GATTParseError.self) {
            try parser.encode(
                GATTReading(zip(fields, [.double(1e300)] + valid.dropFirst()).map { GATTField($0.name, $1) }))
        }
    }
}
