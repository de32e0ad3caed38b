// The registry: literal built-in list, duplicates rejected naming both, UUID forms, names, unknown -> raw.
import GATT
import Testing

struct FakeParser: GATTCharacteristicParser {
    let uuids: [BluetoothUUID]
    let name: String
    func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        GATTReading([GATTField("n", .int(Int64(bytes.count)))])
    }
}

@Suite struct RegistryTests {
    @Test func builtInsHaveDistinctSnakeCaseNamesAndUUIDs() throws {
        var uuids: Set<BluetoothUUID> = []
        var names: Set<String> = []
        for parser in BuiltInCharacteristicParsers.all {
            #expect(parser.name.allSatisfy { $0.isLowercase || $0.isNumber || $0 == "_" }, "\(parser.name)")
            #expect(names.insert(parser.name).inserted, "duplicate name \(parser.name)")
            for uuid in parser.uuids { #expect(uuids.insert(uuid).inserted, "duplicate \(uuid)") }
        }
        #expect(sharedRegistry.characteristicParsers.count == BuiltInCharacteristicParsers.all.count)
    }

    @Test func everySpecCharacteristicIsRegistered() {
        let required: [UInt16] = [
            0x2A37, 0x2A38, 0x2A1C, 0x2A1E, 0x2A1D, 0x2A19, 0x2A6E, 0x2A6F, 0x2A6D, 0x2A6C, 0x2A76, 0x2AFB, 0x2B8C,
            0x2BD5, 0x2BD6, 0x2BD7, 0x2A5B, 0x2A53, 0x2A63, 0x2A9D, 0x2A35, 0x2A36, 0x2A5E, 0x2A5F, 0x2A18, 0x2A08,
            0x2A2B, 0x2A29, 0x2A24, 0x2A26, 0x2A00, 0x2A01, 0x2904,
        ]
        for short in required {
            #expect(sharedRegistry.parser(for: BluetoothUUID(short)) != nil, "no parser for \(BluetoothUUID(short))")
        }
    }

    @Test(arguments: ["2A37", "2a37", "0x2A37", "00002a37", "00002A37-0000-1000-8000-00805F9B34FB",
        "00002a37000010008000 00805f9b34fb".replacingOccurrences(of: " ", with: "")])
    func lookupByAnyUUIDForm(_ text: String) throws {
        let uuid = try #require(BluetoothUUID(text))
        #expect(sharedRegistry.parser(for: uuid)?.name == "heart_rate_measurement")
        #expect(uuid.shortValue == 0x2A37)
        #expect(uuid.uuidString == "00002a37-0000-1000-8000-00805f9b34fb")
    }

    @Test func thirtyTwoBitForms() throws {
        var registry = GATTParserRegistry()
        try registry.register(FakeParser(uuids: [BluetoothUUID(UInt32(0x1234_5678))], name: "wide"))
        #expect(registry.parser(for: BluetoothUUID("12345678")!)?.name == "wide")
        #expect(registry.parser(for: BluetoothUUID("12345678-0000-1000-8000-00805f9b34fb")!)?.name == "wide")
        #expect(registry.parser(for: BluetoothUUID("5678")!) == nil)
    }

    @Test func rejectsMalformedUUIDs() {
        for text in ["", "2A3", "2A37X", "0x", "12345", "00002a37-0000-1000-8000-00805f9b34f", "0000-2a37-0000-1000-8000-00805f9b34fb",
            "g0002a37-0000-1000-8000-00805f9b34fb"]
        {
            #expect(BluetoothUUID(text) == nil, "\(text)")
        }
    }

    @Test func lookupByName() {
        #expect(sharedRegistry.parser(named: "battery_level")?.uuids == [BluetoothUUID(UInt16(0x2A19))])
        #expect(sharedRegistry.parser(named: "no_such_parser") == nil)
    }

    @Test func unknownCharacteristicIsRaw() throws {
        let reading = try sharedRegistry.decode(BluetoothUUID("f000aa01-0451-4000-b000-000000000000")!, [0xDE, 0xAD])
        #expect(reading.jsonString == #"{"raw":"dead"}"#)
        let empty = try sharedRegistry.decode(BluetoothUUID(UInt16(0xFFF1)), [])
        #expect(empty.jsonString == #"{"raw":""}"#)
    }

    @Test func unknownAdvertisementIsRaw() throws {
        let reading = try sharedRegistry.decode(.manufacturer(0xFFFF), [1, 2], context: AdvertisementContext())
        #expect(reading.jsonString == #"{"raw":"0102"}"#)
    }

    @Test func duplicateUUIDNamesBoth() throws {
        var registry = try GATTParserRegistry.builtIn()
        do {
            try registry.register(FakeParser(uuids: [BluetoothUUID("00002a6e-0000-1000-8000-00805f9b34fb")!], name: "mine"))
            Issue.record("duplicate accepted")
        } catch {
            #expect(error.description.contains("'mine'"))
            #expect(error.description.contains("'temperature'"))
            #expect(error.description.contains("2A6E"))
        }
    }

    @Test func duplicateNameIsRejected() throws {
        var registry = GATTParserRegistry()
        try registry.register(FakeParser(uuids: [BluetoothUUID(UInt16(0xFFF1))], name: "same"))
        #expect(throws: GATTRegistryError.self) {
            try registry.register(FakeParser(uuids: [BluetoothUUID(UInt16(0xFFF2))], name: "same"))
        }
    }

    @Test func declaredParserCollidingWithBuiltInIsAStartupError() {
        let spec = DeclarativeParserSpec(
            name: "my_battery", uuid: "2a19", fields: [DeclarativeFieldSpec(name: "battery_pct", type: "u8", offset: 0)])
        do {
            _ = try GATTParserRegistry.builtIn(declaring: [spec])
            Issue.record("accepted")
        } catch {
            #expect(error.description.hasPrefix("parsers[0]: "))
            #expect(error.description.contains("'my_battery'") && error.description.contains("'battery_level'"))
        }
    }

    @Test func decodeErrorsNameParserUUIDAndOffset() {
        do {
            _ = try sharedRegistry.decode(BluetoothUUID(UInt16(0x2A37)), [0x10, 0x50])
            Issue.record("accepted")
        } catch {
            #expect(error.characteristic == "heart_rate_measurement")
            #expect(error.reason == .truncated(offset: 2, needed: 2, available: 0))
            #expect(error.description == "heart_rate_measurement (2A37): truncated at offset 2: needed 2 octet(s), 0 available")
        }
    }

    @Test func presentationFormatDecodesCharacteristicsWithoutParser() throws {
        // sint16, exponent -2, degree Celsius: 0x09C4 -> 25.00 (SPEC.md §3.16).
        let cpf = bytesFromHex("0EFE2F27010000")!
        let reading = try sharedRegistry.decode(vendorUUID, [0xC4, 0x09], context: GATTDecodeContext(presentationFormat: cpf))
        #expect(reading.jsonString == #"{"value_c":25.0,"unit":"degree_celsius"}"#)
        // A characteristic with a parser of its own keeps it.
        let own = try sharedRegistry.decode(
            BluetoothUUID(UInt16(0x2A19)), [0x50], context: GATTDecodeContext(presentationFormat: cpf))
        #expect(own.jsonString == #"{"battery_pct":80}"#)
        // A malformed descriptor rejects, naming the descriptor.
        do {
            _ = try sharedRegistry.decode(vendorUUID, [0xC4, 0x09], context: GATTDecodeContext(presentationFormat: [0x0E]))
            Issue.record("accepted")
        } catch {
            #expect(error.characteristic == "characteristic_presentation_format")
        }
    }
}
