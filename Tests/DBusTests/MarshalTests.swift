import DBus
import Foundation
import TestSupport
import Testing

/// One value of every D-Bus type, nested containers included.
let everyType: [DBusValue] = [
    .byte(0xfe), .boolean(true), .boolean(false), .int16(-12345), .uint16(54321), .int32(-2_000_000_000),
    .uint32(4_000_000_000), .int64(-9_000_000_000_000), .uint64(18_000_000_000_000_000_000), .double(-1.5e300),
    .string("héllo wörld ✓"), .string(""), .objectPath("/org/bluez/hci0/dev_AA_BB"), .objectPath("/"),
    .signature("a{sv}"), .signature(""),
    .bytes([0, 1, 2, 0xff]), .bytes([]),
    .array("s", [.string("a"), .string("b")]), .array("o", []), .array("ay", [.bytes([1]), .bytes([])]),
    .array("(yyay)", [.structure([.byte(1), .byte(2), .bytes([3, 4])])]),
    .array("as", [.array("s", [.string("x")]), .array("s", [])]),
    .dictionary(
        key: "s", value: "v",
        [
            DBusDictEntry(key: .string("n"), value: .variant(.int16(-1))),
            DBusDictEntry(key: .string("nested"), value: .variant(.variant(.variant(.string("deep"))))),
            DBusDictEntry(
                key: .string("dict"),
                value: .variant(
                    .dictionary(
                        key: "q", value: "ay", [DBusDictEntry(key: .uint16(0x004c), value: .bytes([1, 2, 3]))]))),
        ]),
    .dictionary(key: "o", value: "a{sa{sv}}", []),
    .dictionary(key: "h", value: "s", []),
    // Read off the first entry's type codes (basic value), and from libdbus's signature (a struct value).
    .dictionary(key: "s", value: "s", [DBusDictEntry(key: .string("k"), value: .string("v"))]),
    .dictionary(key: "u", value: "(ii)", [DBusDictEntry(key: .uint32(7), value: .structure([.int32(1), .int32(2)]))]),
    .structure([.int32(1), .string("two"), .structure([.double(3.0), .array("i", [.int32(4)])])]),
    .variant(.array("v", [.variant(.boolean(true)), .variant(.bytes([9]))])),
    .variant(.structure([.objectPath("/a"), .signature("(ii)")])),
]

@Suite struct MarshalTests {
    @Test func everyTypeRoundTripsThroughTheWireFormat() throws {
        let message = DBusMessage.signal(path: "/test", interface: "org.example.T", name: "All", body: everyType)
        let bytes = try message.wireFormat()
        let decoded = try DBusMessage(wireFormat: bytes)
        #expect(decoded.body == everyType)
        #expect(decoded.signature == message.signature)
        #expect(decoded.path == "/test")
        #expect(decoded.interface == "org.example.T")
        #expect(decoded.member == "All")
        #expect(decoded.type == .signal)
    }

    @Test func eachValueRoundTripsAlone() throws {
        for value in everyType {
            let message = DBusMessage.signal(path: "/t", interface: "org.example.T", name: "One", body: [value])
            let decoded = try DBusMessage(wireFormat: message.wireFormat())
            #expect(decoded.body == [value], "\(value)")
            #expect(decoded.body.first?.signature == value.signature)
        }
    }

    @Test func arraysOfBytesReadBackAsBytes() throws {
        let message = DBusMessage.signal(
            path: "/t", interface: "org.example.T", name: "B", body: [.array("y", [.byte(1), .byte(2)])])
        let decoded = try DBusMessage(wireFormat: message.wireFormat())
        #expect(decoded.body == [.bytes([1, 2])])
        #expect(DBusValue.array("y", [.byte(1), .byte(2)]).bytes == [1, 2])
    }

    @Test func everyTypeRoundTripsThroughTheBus() async throws {
        let fixture = try await BusFixture()
        let connection = try fixture.connect()
        let stream = try await connection.signals(
            matching: DBusMatchRule(interface: "org.example.T", member: "All", path: "/roundtrip"))
        try connection.emitSignal(path: "/roundtrip", interface: "org.example.T", name: "All", arguments: everyType)
        var iterator = stream.makeAsyncIterator()
        let received = await iterator.next()
        #expect(received?.body == everyType)
        #expect(received?.sender == connection.uniqueName)
    }

    @Test func fileDescriptorsPassThroughTheBus() async throws {
        let fixture = try await BusFixture()
        let sender = try fixture.connect()
        let receiver = try fixture.connect()
        #expect(sender.canPassUnixFDs && receiver.canPassUnixFDs)
        let stream = try await receiver.signals(matching: DBusMatchRule(interface: "org.example.Fd", member: "Pipe"))
        var fds: [Int32] = [0, 0]
        #expect(pipe(&fds) == 0)
        let readEnd = DBusFileDescriptor(owning: fds[0])
        let writeEnd = DBusFileDescriptor(owning: fds[1])
        try sender.emitSignal(
            path: "/fd", interface: "org.example.Fd", name: "Pipe",
            arguments: [.unixFD(writeEnd), .structure([.string("x"), .unixFD(readEnd)])])
        var iterator = stream.makeAsyncIterator()
        let message = try #require(await iterator.next())
        let receivedWrite = try #require(message.body.first?.fileDescriptor)
        let receivedRead = try #require(message.body.last?.structureFields?.last?.fileDescriptor)
        #expect(receivedWrite.rawValue != writeEnd.rawValue)
        // Write through the received duplicate, read through the original read end.
        let payload: [UInt8] = Array("through the bus".utf8)
        #expect(write(receivedWrite.rawValue, payload, payload.count) == payload.count)
        var buffer = [UInt8](repeating: 0, count: 64)
        let count = read(readEnd.rawValue, &buffer, buffer.count)
        #expect(Array(buffer.prefix(max(0, count))) == payload)
        // And the other way: write the original, read the received read end.
        let two: [UInt8] = [7, 8]
        #expect(write(writeEnd.rawValue, two, 2) == 2)
        #expect(read(receivedRead.rawValue, &buffer, buffer.count) == 2)
        #expect(buffer[0] == 7 && buffer[1] == 8)
        // take() hands ownership out exactly once.
        let taken = receivedRead.take()
        #expect(taken >= 0)
        #expect(receivedRead.take() == -1)
        close(taken)
    }

    @Test func invalidSignaturesAreRejected() {
        for text in ["a", "a{", "{sv}", "(", "()", "a{vs}", "z", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaay"]
        {
            #expect(throws: DBusError.self, "\(text)") { try DBusSignature(validating: text) }
            do {
                _ = try DBusSignature(validating: text)
            } catch {
                #expect(error.name == DBusError.invalidSignature)
            }
        }
        #expect(throws: Never.self) { try DBusSignature(validating: "a{sv}(iay)v") }
        #expect(throws: Never.self) { try DBusSignature(validating: "") }
    }

    @Test func invalidObjectPathsAreRejected() {
        for text in ["", "x", "/a/", "//", "/a//b", "/a-b", "/ä"] {
            #expect(throws: DBusError.self, "\(text)") { try DBusObjectPath(validating: text) }
        }
        #expect(throws: Never.self) { try DBusObjectPath(validating: "/org/bluez/hci0") }
        #expect(DBusObjectPath("/a/b").parent == "/a")
        #expect(DBusObjectPath("/a").parent == "/")
        #expect(DBusObjectPath("/").parent == nil)
        #expect(DBusObjectPath("/").appending("x") == "/x")
        #expect(DBusObjectPath("/x").appending("y") == "/x/y")
    }

    /// Each of these would make libdbus abort the process if it reached it unchecked.
    @Test(
        arguments: [
            ("mismatched array element", [DBusValue.array("s", [.string("ok"), .int32(1)])]),
            ("array of dict entries", [DBusValue.array("{sv}", [])]),
            ("invalid element signature", [DBusValue.array("a{", [])]),
            ("dict key not basic", [DBusValue.dictionary(key: "v", value: "s", [])]),
            (
                "dict key mismatch",
                [DBusValue.dictionary(key: "s", value: "v", [DBusDictEntry(key: .int32(1), value: .variant(.byte(1)))])]
            ),
            (
                "dict value mismatch",
                [DBusValue.dictionary(key: "s", value: "v", [DBusDictEntry(key: .string("k"), value: .byte(1))])]
            ),
            ("empty struct", [DBusValue.structure([])]),
            ("invalid object path", [DBusValue.objectPath("not/a/path")]),
            ("invalid nested path", [DBusValue.variant(.array("o", [.objectPath("/ok"), .objectPath("/bad/")]))]),
            ("invalid signature value", [DBusValue.signature("a{")]),
            ("string with NUL", [DBusValue.string("a\u{0}b")]),
            ("variant of invalid struct", [DBusValue.variant(.structure([]))]),
            ("taken fd", [DBusValue.unixFD(DBusFileDescriptor(owning: -1))]),
        ] as [(String, [DBusValue])])
    func invalidBodiesThrowInsteadOfAborting(_ label: String, _ body: [DBusValue]) {
        let message = DBusMessage.signal(path: "/t", interface: "org.example.T", name: "Bad", body: body)
        #expect(throws: DBusError.self, "\(label)") { try message.wireFormat() }
    }

    @Test func invalidHeaderFieldsThrow() {
        let bad: [DBusMessage] = [
            .signal(path: "bad", interface: "org.example.T", name: "S"),
            .signal(path: "/t", interface: "noDots", name: "S"),
            .signal(path: "/t", interface: "org.example.T", name: "Bad-Member"),
            .signal(path: "/t", interface: "org..x", name: "S"),
            .methodCall(destination: "not a bus name", path: "/", interface: nil, method: "M"),
            DBusMessage(type: .error, replySerial: 1, errorName: "nodots"),
            DBusMessage(type: .methodReturn),
        ]
        for message in bad {
            #expect(throws: DBusError.self, "\(message)") { try message.wireFormat() }
        }
    }

    @Test func sendingInvalidMessagesThrowsAndTheConnectionSurvives() async throws {
        let fixture = try await BusFixture()
        let connection = try fixture.connect()
        #expect(throws: DBusError.self) {
            try connection.emitSignal(
                path: "/t", interface: "org.example.T", name: "S", arguments: [.array("s", [.int32(1)])])
        }
        await #expect(throws: DBusError.self) {
            try await connection.call(
                destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                method: "GetNameOwner", arguments: [.string("bad\u{0}")])
        }
        await #expect(throws: DBusError.self) {
            try await connection.call(
                destination: "org.freedesktop.DBus", path: "no-slash", interface: "org.freedesktop.DBus",
                method: "ListNames")
        }
        // A signature the callee does not expect is the callee's error, not ours.
        do {
            _ = try await connection.call(
                destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
                method: "GetNameOwner", arguments: [.int32(1)])
            Issue.record("expected an error reply")
        } catch {
            #expect(error.name == DBusError.invalidArgs)
        }
        let names = try await connection.call(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            method: "ListNames")
        #expect(!names.isEmpty)
    }

    @Test func fileDescriptorsCannotBeSerialisedToBytes() {
        var fds: [Int32] = [0, 0]
        #expect(pipe(&fds) == 0)
        let a = DBusFileDescriptor(owning: fds[0])
        let b = DBusFileDescriptor(owning: fds[1])
        let message = DBusMessage.signal(
            path: "/t", interface: "org.example.T", name: "F", body: [.variant(.array("h", [.unixFD(a), .unixFD(b)]))])
        #expect(throws: DBusError.self) { try message.wireFormat() }
    }

    @Test func invalidUTF8OnTheWireIsRejected() throws {
        let good = try DBusMessage.signal(
            path: "/t", interface: "org.example.T", name: "S", body: [.string("zqzqzq")]
        ).wireFormat()
        #expect(try DBusMessage(wireFormat: good).body == [.string("zqzqzq")])
        var bad = good
        let marker = Array("zqzqzq".utf8)
        let start = try #require(
            (0...(bad.count - marker.count)).first { Array(bad[$0..<($0 + marker.count)]) == marker })
        bad[start + 1] = 0xff  // not UTF-8
        #expect(throws: DBusError.self) { try DBusMessage(wireFormat: bad) }
        bad[start + 1] = 0x00  // embedded NUL
        #expect(throws: DBusError.self) { try DBusMessage(wireFormat: bad) }
    }

    @Test func malformedWireBytesThrow() throws {
        #expect(throws: DBusError.self) { try DBusMessage(wireFormat: []) }
        #expect(throws: DBusError.self) { try DBusMessage(wireFormat: [UInt8](repeating: 0x41, count: 64)) }
        let good = try DBusMessage.signal(path: "/t", interface: "org.example.T", name: "S", body: everyType)
            .wireFormat()
        for cut in stride(from: 1, to: good.count, by: 7) {
            #expect(throws: DBusError.self) { try DBusMessage(wireFormat: Array(good.prefix(cut))) }
        }
        // Corrupt the body signature so that it disagrees with the body.
        var corrupted = good
        if let index = corrupted.firstIndex(of: UInt8(ascii: "y")) { corrupted[index] = UInt8(ascii: "o") }
        #expect(throws: DBusError.self) { try DBusMessage(wireFormat: corrupted) }
    }

    @Test func accessorsSeeThroughOneVariant() {
        #expect(DBusValue.variant(.string("x")).string == "x")
        #expect(DBusValue.variant(.objectPath("/p")).objectPath == "/p")
        #expect(DBusValue.variant(.uint16(7)).uint16 == 7)
        #expect(DBusValue.int32(7).uint32 == nil)
        #expect(DBusValue.variant(.variant(.int32(1))).int32 == nil)
        let dict = DBusValue.stringVariantDictionary([("a", .int32(1)), ("b", .variant(.string("s")))])
        #expect(dict.signature == "a{sv}")
        #expect(dict.stringVariantDictionary == ["a": .int32(1), "b": .string("s")])
        #expect(DBusValue.stringArray(["a"]).signature == "as")
        #expect(DBusValue.bytes([1]).arrayElements == [.byte(1)])
    }

    @Test func matchRuleText() {
        let rule = DBusMatchRule(
            sender: "org.bluez", interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged",
            pathNamespace: "/org/bluez", arguments: [0: "it's"], argumentPaths: [1: "/a/"])
        #expect(
            rule.rule
                == "type='signal',sender='org.bluez',interface='org.freedesktop.DBus.Properties',member='PropertiesChanged',path_namespace='/org/bluez',arg0='it'\\''s',arg1path='/a/'"
        )
    }
}
