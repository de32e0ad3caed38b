// Integer scalars in config and scenario files: one optional sign, then digits in one base; a second sign
// anywhere is not a number.
import Testing
import YAML

@Suite struct YAMLIntegerTests {
    private func integer(_ text: String) throws -> Int? { try YAMLParser.parse("v: \(text)")["v"]?.integer }

    @Test func oneSignOnly() throws {
        for text in ["--5", "+-5", "-+5", "0x-5", "-0x-5", "0b+1"] {
            #expect(try integer(text) == nil, "\(text)")
        }
        #expect(try integer("-5") == -5)
        #expect(try integer("+0x1F") == 31)
        #expect(try integer("-0b101") == -5)
        #expect(try integer("1_000") == 1000)
    }
}
