// The JSON text of string values: escapes where RFC 8259 requires them, runs without escapes copied as they are.
import Testing

@testable import GATT

@Suite struct JSONStringTests {
    @Test(arguments: [
        ("", #""""#),
        ("temperature_c", #""temperature_c""#),
        ("a\"b", #""a\"b""#),
        ("\\", #""\\""#),
        ("line\nnext\r\t", #""line\nnext\r\t""#),
        ("\u{08}\u{0C}", #""\b\f""#),
        ("\u{01}x\u{1F}\u{7F}", #""\u0001x\u001f\u007f""#),
        ("\"\"", #""\"\"""#),
        ("Küche 温度", "\"Küche 温度\""),
        ("end\\", #""end\\""#),
    ])
    func stringsAreEscapedExactlyWhereNeeded(text: String, expected: String) {
        var out: [UInt8] = [UInt8(ascii: "[")]
        appendJSONString(text, to: &out)
        #expect(String(decoding: out.dropFirst(), as: UTF8.self) == expected)
        #expect(GATTValue.string(text).jsonString == expected)
    }
}
