import Testing
import YAML

@Suite struct YAMLParserTests {
    @Test func parsesMappingsSequencesAndScalars() throws {
        let root = try YAMLParser.parse(
            """
            name: Strap
            rssi: -60
            hex: 0x2A
            flags: [read, notify]
            quoted: "123"
            on: yes
            list:
              - a: 1
              - b
            """)
        #expect(root["name"]?.scalar == "Strap")
        #expect(root["rssi"]?.integer == -60)
        #expect(root["hex"]?.integer == 42)
        #expect(root["flags"]?.sequence?.compactMap(\.scalar) == ["read", "notify"])
        #expect(root["quoted"]?.integer == nil)
        #expect(root["quoted"]?.scalar == "123")
        #expect(root["on"]?.bool == true)
        #expect(root["list"]?.sequence?.count == 2)
        #expect(root["list"]?.sequence?.first?["a"]?.integer == 1)
        #expect(root["list"]?.sequence?.first?.line == 8)
        #expect(root.mapping?.map(\.key) == ["name", "rssi", "hex", "flags", "quoted", "on", "list"])
    }

    @Test func parsesJSON() throws {
        let root = try YAMLParser.parse(#"{"a": [1, 2.5, "x"], "b": {"c": null, "d": true}}"#)
        #expect(root["a"]?.sequence?.map(\.double) == [1, 2.5, nil])
        #expect(root["b"]?["c"]?.isNull == true)
        #expect(root["b"]?["d"]?.bool == true)
    }

    @Test func emptyDocumentIsEmptyMapping() throws {
        #expect(try YAMLParser.parse("").mapping?.isEmpty == true)
        #expect(try YAMLParser.parse("# only a comment\n").mapping?.isEmpty == true)
    }

    @Test func reportsSyntaxErrorsWithPosition() {
        #expect(throws: YAMLError.self) { try YAMLParser.parse("a: [1, 2\nb: 3") }
        do {
            _ = try YAMLParser.parse("a: 1\nb: : :\n  - x\n")
            Issue.record("expected an error")
        } catch {
            #expect(error.line >= 2)
        }
    }

    @Test func rejectsDuplicateKeysAndAliases() {
        do {
            _ = try YAMLParser.parse("a: 1\na: 2\n")
            Issue.record("expected an error")
        } catch {
            #expect(error.message.contains("duplicate key \"a\""))
            #expect(error.line == 2)
        }
        #expect(throws: YAMLError.self) { try YAMLParser.parse("a: &x 1\nb: *x\n") }
        #expect(throws: YAMLError.self) { try YAMLParser.parse("? [1, 2]\n: x\n") }
    }

    @Test func numbersAndBooleansOnlyFromPlainScalars() throws {
        let root = try YAMLParser.parse("a: '0x10'\nb: 1_000\nc: -0b101\nd: .inf\ne: off\nf: maybe\n")
        #expect(root["a"]?.integer == nil)
        #expect(root["b"]?.integer == 1000)
        #expect(root["c"]?.integer == -5)
        #expect(root["d"]?.double == .infinity)
        #expect(root["e"]?.bool == false)
        #expect(root["f"]?.bool == nil)
    }

    @Test func survivesGarbage() {
        for text in ["\u{0}", "[", "{a", "- - - [", "a:\n\t- b", String(repeating: "[", count: 500)] {
            _ = try? YAMLParser.parse(text)
        }
    }
}
