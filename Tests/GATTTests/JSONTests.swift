// The JSON writer: key order, integers, shortest round-trip doubles, escaping, no NaN.
import Foundation
import GATT
import Testing

@Suite struct JSONTests {
    @Test func keepsFieldOrderAndTypes() {
        let reading = GATTReading([
            GATTField("z", .int(-5)), GATTField("a", .double(36.4)), GATTField("m", .bool(true)),
            GATTField("n", .null), GATTField("list", .array([.double(0.0009765625), .int(2)])),
            GATTField("obj", .object(GATTReading([GATTField("year", .null), GATTField("month", .int(4))]))),
        ])
        #expect(
            reading.jsonString
                == #"{"z":-5,"a":36.4,"m":true,"n":null,"list":[0.0009765625,2],"obj":{"year":null,"month":4}}"#)
    }

    @Test(arguments: [
        (36.4, "36.4"), (100.0, "100.0"), (1.5e-7, "1.5e-07"), (0.1 + 0.2, "0.30000000000000004"),
        (-163.835, "-163.835"), (1e22, "1e+22"), (Double.leastNonzeroMagnitude, "5e-324"), (402653184.1, "402653184.1"),
    ])
    func doublesAreShortestRoundTrip(value: Double, text: String) throws {
        let json = GATTValue.double(value).jsonString
        #expect(json == text)
        // Valid JSON (Foundation's parser accepts it) that reads back to the same double (Swift's own parser is
        // exact; Foundation's on Linux is not always).
        #expect(try JSONSerialization.jsonObject(with: Data("[\(json)]".utf8), options: []) is [Any])
        #expect(Double(json) == value)
    }

    @Test func integersAreIntegers() {
        #expect(GATTValue.int(Int64.max).jsonString == "9223372036854775807")
        #expect(GATTValue.int(Int64.min).jsonString == "-9223372036854775808")
        #expect(GATTValue.int(0).jsonString == "0")
    }

    @Test func nonFiniteDoublesBecomeStrings() {
        #expect(GATTValue.double(.nan).jsonString == #""NaN""#)
        #expect(GATTValue.double(.infinity).jsonString == #""+INF""#)
        #expect(GATTValue.double(-.infinity).jsonString == #""-INF""#)
    }

    @Test func stringsAreEscaped() throws {
        let tricky = "q\"b\\s/\n\r\t\u{8}\u{c}\u{1}\u{1f}\u{7f} Société 😀"
        let json = GATTReading([GATTField("k\"", .string(tricky))]).jsonString
        #expect(json.hasPrefix(#"{"k\"":"q\"b\\s/\n\r\t\b\f\u0001\u001f\u007f Soci"#))
        let object = try JSONSerialization.jsonObject(with: Data(json.utf8)) as? [String: String]
        #expect(object == ["k\"": tricky])
    }

    @Test func rawPassThrough() {
        #expect(GATTReading.raw([0x00, 0xAB, 0x7F]).jsonString == #"{"raw":"00ab7f"}"#)
        #expect(GATTReading.raw([]).jsonString == #"{"raw":""}"#)
    }
}
