// A config or scenario file with a very large mapping parses in reasonable time and still rejects a duplicate key
// with its line.
import Testing
import YAML

@Suite struct YAMLLargeMappingTests {
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
