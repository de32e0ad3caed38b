// Config and scenario files are outside input: absurdly deep nesting must be rejected with an error naming the
// position, not overflow the stack (building, comparing or freeing a deeply nested value tree recurses).
import Testing
import YAML

@Suite struct AuditYAMLNestingTests {
    /// Deeply nested documents (by index, so that test names stay short).
    static let deepDocuments = [
        String(repeating: "[", count: 100_000) + String(repeating: "]", count: 100_000),
        String(repeating: "{a: ", count: 50_000) + "1" + String(repeating: "}", count: 50_000),
        String(repeating: "[", count: YAMLParser.maximumDepth + 1)
            + String(repeating: "]", count: YAMLParser.maximumDepth + 1),
    ]

    @Test(arguments: deepDocuments.indices)
    func deepNestingIsAnError(_ index: Int) {
        do {
            _ = try YAMLParser.parse(Self.deepDocuments[index])
            Issue.record("document \(index) parsed")
        } catch {
            #expect(error.message.contains("nesting deeper than 256 levels"), "\(error)")
            #expect(
                error.line == 1 && error.column == YAMLParser.maximumDepth + 1 + (index == 1 ? 3 * 256 : 0), "\(error)")
        }
    }

    @Test func moderateNestingStillParses() throws {
        let depth = YAMLParser.maximumDepth
        let node = try YAMLParser.parse(
            String(repeating: "[", count: depth) + "1" + String(repeating: "]", count: depth))
        var current: YAMLNode? = node
        var levels = 0
        while let items = current?.sequence {
            levels += 1
            current = items.first
        }
        #expect(levels == depth)
        #expect(current?.scalar == "1")
    }
}

@Suite struct AuditYAMLIntegerTests {
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

@Suite struct AuditYAMLLargeMappingTests {
    /// The duplicate-key check compared each key with every earlier one: 100000 keys took minutes.
    @Test func largeMappingParsesQuicklyAndStillRejectsDuplicates() throws {
        let count = 100_000
        let text = (0..<count).map { "k\($0): \($0)" }.joined(separator: "\n")
        let clock = ContinuousClock()
        let start = clock.now
        let node = try YAMLParser.parse(text)
        let elapsed = clock.now - start
        #expect(node.mapping?.count == count)
        #expect(node["k99999"]?.integer == 99_999)
        #expect(elapsed < .seconds(15), "\(elapsed)")
        do {
            _ = try YAMLParser.parse(text + "\nk5: again")
            Issue.record("duplicate accepted")
        } catch {
            #expect(error.message == "duplicate key \"k5\"")
            #expect(error.line == count + 1)
        }
    }
}
