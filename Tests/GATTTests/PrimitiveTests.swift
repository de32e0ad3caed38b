// SFLOAT/FLOAT (SPEC.md §2 worked examples and special values), Date Time and its calendar arithmetic, the cursor.
import GATT
import TestSupport
import Testing

@Suite struct PrimitiveTests {
    @Test(arguments: [
        ("B00E00FE", 37.60), ("6C0100FF", 36.4), ("9CFFFFFF", -10.0), ("00000000", 0.0), ("0A0000FD", 0.01),
    ])
    func floatWorkedExamples(hex: String, value: Double) throws {
        let b = try #require(bytesFromHex(hex))
        let raw = UInt32(b[0]) | UInt32(b[1]) << 8 | UInt32(b[2]) << 16 | UInt32(b[3]) << 24
        #expect(MedicalFloat.decodeFLOAT(raw) == .double(value))
    }

    @Test(arguments: [
        ("BDF0", 18.9), ("1EF0", 3.0), ("37C0", 0.0055), ("0180", 1e-8), ("FF0F", -1.0), ("FF77", 2047e7),
        ("0088", -2048e-8),
    ])
    func sfloatWorkedExamples(hex: String, value: Double) throws {
        let b = try #require(bytesFromHex(hex))
        #expect(MedicalFloat.decodeSFLOAT(UInt16(b[0]) | UInt16(b[1]) << 8) == .double(value))
    }

    @Test func specialValuesAreStrings() {
        #expect(MedicalFloat.decodeSFLOAT(0x07FF) == .string("NaN"))
        #expect(MedicalFloat.decodeSFLOAT(0x0800) == .string("NRes"))
        #expect(MedicalFloat.decodeSFLOAT(0x07FE) == .string("+INF"))
        #expect(MedicalFloat.decodeSFLOAT(0x0802) == .string("-INF"))
        #expect(MedicalFloat.decodeSFLOAT(0x0801) == .string("RFU"))
        #expect(MedicalFloat.decodeFLOAT(0x007F_FFFF) == .string("NaN"))
        #expect(MedicalFloat.decodeFLOAT(0x0080_0000) == .string("NRes"))
        #expect(MedicalFloat.decodeFLOAT(0x007F_FFFE) == .string("+INF"))
        #expect(MedicalFloat.decodeFLOAT(0x0080_0002) == .string("-INF"))
        #expect(MedicalFloat.decodeFLOAT(0x0080_0001) == .string("RFU"))
        // With a non-zero exponent the same mantissas are ordinary numbers.
        #expect(MedicalFloat.decodeSFLOAT(0x17FF) == .double(20470))
    }

    @Test func sfloatEncodingRoundTripsEveryRawValue() throws {
        for raw in UInt16.min...UInt16.max {
            let value = MedicalFloat.decodeSFLOAT(raw)
            let encoded = try MedicalFloat.encodeSFLOAT(value, field: "x")
            #expect(MedicalFloat.decodeSFLOAT(encoded) == value, "raw 0x\(String(raw, radix: 16))")
        }
    }

    @Test func floatEncodingRoundTripsSampledRawValues() async throws {
        // CPU-bound (seconds in debug builds): on a low-priority thread of its own, off the cooperative pool; the
        // mismatches come back as descriptions.
        let mismatches = try await cpuBound {
            var mismatches: [String] = []
            var raw: UInt32 = 0
            for _ in 0..<50_000 {
                raw = raw &* 1_664_525 &+ 1_013_904_223
                let value = MedicalFloat.decodeFLOAT(raw)
                let encoded = try MedicalFloat.encodeFLOAT(value, field: "x")
                let again = MedicalFloat.decodeFLOAT(encoded)
                let label = "raw 0x\(String(raw, radix: 16)): \(value) -> 0x\(String(encoded, radix: 16)) -> \(again)"
                // Exact while 10^|exponent| is exact (|exponent| <= 22); beyond, the same decimal may be reached
                // through another exponent, which can differ in the last bit.
                if let a = again.numberValue, let b = value.numberValue {
                    if !(abs(a - b) <= 1e-15 * abs(b)) { mismatches.append("\(label): not within 1e-15") }
                    let exponent = Int(Int8(truncatingIfNeeded: raw >> 24))
                    if abs(exponent) <= 15 && a != b { mismatches.append("\(label): not exact") }
                } else if again != value {
                    mismatches.append(label)
                }
            }
            return mismatches
        }
        #expect(mismatches.isEmpty, "\(mismatches.count) mismatches: \(mismatches.prefix(20))")
    }

    @Test func encodingPicksShortExactForms() throws {
        #expect(try MedicalFloat.encodeSFLOAT(.double(36.4), field: "t") == 0xF16C)
        #expect(try MedicalFloat.encodeFLOAT(.double(36.4), field: "t") == 0xFF00_016C)
        #expect(try MedicalFloat.encodeSFLOAT(.string("NaN"), field: "t") == 0x07FF)
        #expect(try MedicalFloat.encodeFLOAT(.double(-.infinity), field: "t") == 0x0080_0002)
        #expect(throws: GATTParseError.self) { try MedicalFloat.encodeSFLOAT(.double(1e30), field: "t") }
        #expect(throws: GATTParseError.self) { try MedicalFloat.encodeSFLOAT(.string("warm"), field: "t") }
    }

    @Test func dateTimeFormatsAndParses() throws {
        let dt = GATTDateTime(year: 2023, month: 12, day: 25, hours: 14, minutes: 30, seconds: 5)
        #expect(dt.isoString == "2023-12-25T14:30:05")
        #expect(GATTDateTime(iso: "2023-12-25T14:30:05") == dt)
        #expect(GATTDateTime(iso: "2023-02-30T00:00:00") == nil)
        #expect(GATTDateTime(iso: "2023-12-25 14:30:05") == nil)
        #expect(GATTDateTime(year: 0, month: 4, day: 17, hours: 1, minutes: 2, seconds: 3).isoString == nil)
        #expect(GATTDateTime(year: 2024, month: 2, day: 29, hours: 0, minutes: 0, seconds: 0).isComplete)
        #expect(!GATTDateTime(year: 2023, month: 2, day: 29, hours: 0, minutes: 0, seconds: 0).isComplete)
    }

    @Test func glucoseOffsetCrossesDaysMonthsAndYears() throws {
        let parser = GlucoseMeasurementParser()
        // 2019-12-31 23:58:00 + 5 min; 2020-03-01 00:02:00 - 5 min (leap year).
        let forward = try parser.decode(bytesFromHex("010100E3070C1F173A000500")!, context: .init())
        #expect(forward["timestamp"] == .string("2020-01-01T00:03:00"))
        let backward = try parser.decode(
            bytesFromHex("010100E40703010002 00FBFF".replacingOccurrences(of: " ", with: ""))!, context: .init())
        #expect(backward["timestamp"] == .string("2020-02-29T23:57:00"))
        #expect(backward["base_time"] == .string("2020-03-01T00:02:00"))
    }

    @Test func cursorNeverReadsPastTheEnd() {
        var cursor = ByteCursor([1, 2, 3])
        #expect(throws: GATTParseError.truncated(offset: 0, needed: 4, available: 3)) { try cursor.u32() }
        #expect((try? cursor.u16()) == 0x0201)
        #expect(throws: GATTParseError.truncated(offset: 2, needed: 2, available: 1)) { try cursor.s16() }
        #expect((try? cursor.s8()) == 3)
        #expect(cursor.isAtEnd)
        #expect(throws: GATTParseError.self) { try cursor.bytes(-1) }
        #expect((try? cursor.sintBE(0)) == 0)
    }
}
