// Config and scenario files are outside input: absurdly deep nesting must be rejected with an error naming the
// position, not overflow the stack (building, comparing or freeing a deeply nested value tree recurses).
import Testing
import YAML

@Suite struct YAMLNestingTests {
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
