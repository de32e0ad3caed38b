// BridgeTopics.command(for:) and the strict JSONReader that reads command payloads from the broker.
import BridgeCore
import Testing

@Suite struct TopicTests {
    let topics = BridgeTopics(base: "blebridge")

    @Test func classifiesCommands() {
        #expect(topics.command(for: "blebridge/radiator/set") == .set(device: "radiator", name: nil))
        #expect(
            topics.command(for: "blebridge/radiator/set/setpoint_c") == .set(device: "radiator", name: "setpoint_c"))
        #expect(topics.command(for: "blebridge/radiator/get") == .get(device: "radiator", name: nil))
        #expect(
            topics.command(for: "blebridge/radiator/get/setpoint_c") == .get(device: "radiator", name: "setpoint_c"))
        #expect(topics.command(for: "blebridge/bridge/request/devices") == .request(op: "devices"))
        #expect(topics.command(for: "blebridge/bridge/request/device/read") == .request(op: "device/read"))
    }

    @Test func ignoresResultsAndEverythingElse() {
        for topic in [
            "blebridge/radiator/set/result", "blebridge/radiator/get/result", "blebridge/radiator",
            "blebridge/radiator/availability", "blebridge/bridge/state", "blebridge/bridge/response/devices",
            "blebridge/bridge/set", "blebridge/bridge/request", "blebridgex/radiator/set", "other/radiator/set",
            "blebridge/radiator/set/a/b", "blebridge",
        ] {
            #expect(topics.command(for: topic) == nil, "\(topic)")
        }
    }

    @Test func followsTheBaseTopic() {
        let t = BridgeTopics(base: "home/ble", discoveryPrefix: "ha")
        #expect(t.command(for: "home/ble/radiator/set") == .set(device: "radiator", name: nil))
        #expect(t.command(for: "blebridge/radiator/set") == nil)
        #expect(t.discovery("blebridge_radiator") == "ha/device/blebridge_radiator/config")
        #expect(t.subscriptions.allSatisfy { $0.hasPrefix("home/ble/") })
    }
}

@Suite struct JSONReaderTests {
    func parse(_ text: String) throws(JSONParseError) -> JSONValue { try JSONReader.parse(Array(text.utf8)) }

    func failure(_ bytes: [UInt8]) -> JSONParseError? {
        do {
            let v = try JSONReader.parse(bytes)
            Issue.record("accepted \(bytes): \(v.text)")
            return nil
        } catch {
            return error
        }
    }

    func failure(_ text: String) -> JSONParseError? { failure(Array(text.utf8)) }

    @Test func readsValidDocuments() throws {
        let v = try parse(#" {"b": [true, false, null], "a": -12, "c": "x\u00e9\n", "d": 21.5, "e": 1e2, "f": {}} "#)
        #expect(v.keys == ["b", "a", "c", "d", "e", "f"])
        #expect(v["b"] == .array([.bool(true), .bool(false), .null]))
        #expect(v["a"] == .int(-12))
        #expect(v["c"] == .string("xé\n"))
        #expect(v["d"] == .double(21.5))
        #expect(v["e"] == .double(100))
        #expect(v["f"] == .object([]))
        #expect(try parse("-0") == .int(0))
        #expect(try parse("[]") == .array([]))
        #expect(try parse(#""\/\\\"\b\f\r\t""#) == .string("/\\\"\u{8}\u{c}\r\t"))
        #expect(try parse("9223372036854775807") == .int(Int64.max))
        #expect(try parse("9223372036854775808") == .double(9_223_372_036_854_775_808))
    }

    @Test func writesWhatItReads() throws {
        let text = #"{"z":-5,"a":[1,2.5,"s"],"n":null}"#
        #expect(try parse(text).text == text)
    }

    @Test(arguments: [
        ("", 0), ("{", 1), (#"{"a":1,}"#, 7), (#"{"a" 1}"#, 5), ("[1 2]", 3), ("[1,]", 3), ("tru", 0),
        ("{} x", 3), (#""abc"#, 4), ("1.", 2), ("1e", 2), ("-", 1), ("nul", 0), (#"{"a":}"#, 5),
    ])
    func rejectsInvalidDocumentsWithTheirOffset(input: String, offset: Int) {
        #expect(failure(input)?.offset == offset, "\(input)")
    }

    @Test func rejectsOtherMistakes() {
        #expect(failure("01")?.reason.contains("leading zero") == true)
        #expect(failure("1e400")?.reason.contains("out of range") == true)
        #expect(failure("NaN") != nil)
        #expect(failure("'a'") != nil)
        #expect(failure(#"{a:1}"#)?.reason.contains("key") == true)
        #expect(failure([0x22, 0xFF, 0x22])?.reason.contains("UTF-8") == true)
        #expect(failure(#""\q""#)?.reason.contains("escape") == true)
        #expect(failure(#""\u12G4""#)?.reason.contains("escape") == true)
        #expect(failure(#""\u12""#) != nil)
    }

    /// An offset points at the byte at fault: the control character, not the one after it.
    @Test func controlCharacterOffsetPointsAtIt() {
        let error = failure([0x22, 0x61, 0x01, 0x22])
        #expect(error?.reason.contains("control character") == true)
        #expect(error?.offset == 2)
    }

    @Test func limitsNestingDepth() throws {
        let depth = JSONReader.maximumDepth
        let ok = String(repeating: "[", count: depth) + String(repeating: "]", count: depth)
        #expect(throws: Never.self) { try parse(ok) }
        let deep = String(repeating: "[", count: depth + 1) + String(repeating: "]", count: depth + 1)
        #expect(failure(deep)?.reason.contains("nested deeper") == true)
        // Far deeper than the limit (a hostile payload) fails without exhausting the stack.
        let hostile = String(repeating: #"{"a":"#, count: 100_000)
        #expect(failure(hostile)?.reason.contains("nested deeper") == true)
    }

    @Test func decodesSurrogatePairsAndRejectsUnpairedOnes() throws {
        #expect(try parse(#""\ud83d\ude00""#) == .string("😀"))
        #expect(try parse(#""\uD834\uDD1E""#) == .string("\u{1D11E}"))
        #expect(failure(#""\ud83d""#)?.reason.contains("unpaired surrogate") == true)
        #expect(failure(#""\ud83dx""#)?.reason.contains("unpaired surrogate") == true)
        #expect(failure(#""\ude00""#)?.reason.contains("unpaired surrogate") == true)
        #expect(failure(#""\ud83d\u0041""#)?.reason.contains("unpaired surrogate") == true)
        #expect(try parse(#""\u0000""#) == .string("\u{0}"))
    }
}
