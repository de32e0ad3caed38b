// The 0x2904 Characteristic Presentation Format: the descriptor itself and values decoded by it.
import GATT
import Testing

@Suite struct PresentationFormatTests {
    func decode(_ format: UInt8, exponent: Int8 = 0, unit: UInt16 = 0x2700, _ value: String) throws -> GATTValue? {
        let cpf = PresentationFormat(format: format, exponent: exponent, unit: unit)
        return try cpf.decodeValue(bytesFromHex(value)!)[unit == 0x2700 ? "value" : "value_\(cpf.unitSuffix!)"]
    }

    @Test func integerFormatsApplyTheExponent() throws {
        #expect(try decode(0x01, "01") == .bool(true))
        #expect(try decode(0x02, "07") == .int(3))
        #expect(try decode(0x03, "FF") == .int(15))
        #expect(try decode(0x04, "55") == .int(85))
        #expect(try decode(0x05, "FFFF") == .int(4095))
        #expect(try decode(0x06, exponent: -2, unit: 0x272F, "C409") == .double(25.0))
        #expect(try decode(0x07, "010203") == .int(0x030201))
        #expect(try decode(0x08, exponent: 3, "01000000") == .double(1000))
        #expect(try decode(0x09, "010000000080") == .int(0x8000_0000_0001))
        #expect(try decode(0x0A, "FFFFFFFFFFFFFFFF") == .double(Double(UInt64.max)))
        #expect(try decode(0x0C, exponent: -1, "F6") == .double(-1.0))
        #expect(try decode(0x0D, "FF0F") == .int(-1))
        #expect(try decode(0x0E, exponent: -2, unit: 0x272F, "3CF6") == .double(-25.0))
        #expect(try decode(0x0F, "FFFFFF") == .int(-1))
        #expect(try decode(0x10, "FEFFFFFF") == .int(-2))
        #expect(try decode(0x12, "FFFFFFFFFFFFFF7F") == .int(Int64.max))
    }

    @Test func otherFormats() throws {
        #expect(try decode(0x14, "0000C03F") == .double(1.5))
        #expect(try decode(0x14, "0000C07F") == .string("NaN"))
        #expect(try decode(0x15, "000000000000F0FF") == .string("-INF"))
        #expect(try decode(0x16, exponent: 3, "6DF1") == .double(36.5))  // medfloat ignores the CPF exponent
        #expect(try decode(0x17, "6C0100FF") == .double(36.4))
        #expect(try decode(0x18, "01000200") == .array([.int(1), .int(2)]))
        #expect(try decode(0x19, "4869") == .string("Hi"))
        #expect(try decode(0x1A, "48006900") == .string("Hi"))
        #expect(try decode(0x1B, "0102") == .string("0102"))
        #expect(try decode(0x0B, "00112233445566778899AABBCCDDEEFF") == .string("00112233445566778899aabbccddeeff"))
    }

    @Test func valueLengthMustMatchTheFormat() {
        let cpf = PresentationFormat(format: 0x06, exponent: 0, unit: 0x27AD)
        #expect(throws: GATTParseError.truncated(offset: 0, needed: 2, available: 1)) { try cpf.decodeValue([1]) }
        #expect(throws: GATTParseError.self) { try cpf.decodeValue([1, 2, 3]) }
        #expect(throws: GATTParseError.self) {
            try PresentationFormat(format: 0x00, exponent: 0, unit: 0x2700).decodeValue([1])
        }
        #expect(throws: GATTParseError.self) {
            try PresentationFormat(format: 0xFF, exponent: 0, unit: 0x2700).decodeValue([1])
        }
    }

    @Test func unknownUnitsKeepTheirUUID() throws {
        let reading = try PresentationFormat(format: 0x04, exponent: 0, unit: 0x27FE).decodeValue([7])
        #expect(reading.jsonString == #"{"value":7,"unit_uuid":"27FE"}"#)
    }

    @Test func descriptorItself() throws {
        let cpf = try PresentationFormat(descriptor: bytesFromHex("0EFE2F27010E01")!)
        #expect(cpf.format == 0x0E && cpf.exponent == -2 && cpf.unit == 0x272F && cpf.descriptionCode == 0x010E)
        #expect(
            cpf.reading.jsonString
                == #"{"format":14,"format_name":"sint16","exponent":-2,"unit_uuid":"272F","unit_name":"degree_celsius","namespace":1,"description":270,"description_name":"right"}"#
        )
        #expect(cpf.descriptorBytes == bytesFromHex("0EFE2F27010E01"))
        #expect(throws: GATTParseError.self) { try PresentationFormat(descriptor: bytesFromHex("0EFE2F27010E0100")!) }
        #expect(throws: GATTParseError.self) { try PresentationFormat(descriptor: []) }
    }
}
