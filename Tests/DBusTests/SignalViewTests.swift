// Signals read in place: the pull reader over libdbus's iterator, and `signals(matching:ended:reader:)` on a real
// private bus (header-only rules matched in place, argument rules through the decoded message).
import DBus
import Glibc
import Synchronization
import TestSupport
import Testing

@Suite struct SignalViewTests {
    /// A PropertiesChanged as bluetoothd sends one: `s a{sv} as`.
    private func propertiesChanged() -> DBusMessage {
        var message = DBusMessage.signal(
            path: "/org/bluez/hci0/dev_AA", interface: "org.freedesktop.DBus.Properties", name: "PropertiesChanged",
            body: [
                .string("org.bluez.Device1"),
                .stringVariantDictionary([
                    ("RSSI", .int16(-61)),
                    (
                        "ManufacturerData",
                        .dictionary(
                            key: "q", value: "v",
                            [DBusDictEntry(key: .uint16(0x0499), value: .variant(.bytes([5, 1])))])
                    ),
                    ("Name", .string("Ruuvi")),
                ]),
                .array("s", [.string("TxPower")]),
            ])
        message.sender = ":1.7"
        return message
    }

    @Test func typedReadsFollowTheSignatureAndAMismatchStaysPut() throws {
        try DBusSignalView.withView(of: propertiesChanged()) { view in
            #expect(view.isSignal(interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged"))
            #expect(!view.isSignal(interface: "org.freedesktop.DBus.Properties", member: "Other"))
            #expect(view.path == "/org/bluez/hci0/dev_AA")
            #expect(view.unsafePathBytes.map { Array($0) } == Array("/org/bluez/hci0/dev_AA".utf8))
            #expect(view.member == "PropertiesChanged")
            var arguments = view.arguments()
            #expect(arguments.currentType == "s")
            // Wrong type or wrong text: nil / false, and the reader has not moved.
            let wrongInt = arguments.int16()
            let wrongBytes = arguments.bytes()
            let wrongContainer = arguments.enter()
            let wrongText = arguments.string(equals: "org.bluez.Adapter1")
            #expect(wrongInt == nil && wrongBytes == nil && wrongContainer == nil && !wrongText)
            #expect(arguments.currentType == "s")
            let interface = arguments.string(equals: "org.bluez.Device1")
            #expect(interface)
            #expect(arguments.currentType == "a")
            var changed = try enter(&arguments)
            var rssi = try enter(&changed)
            var keyInPlace = rssi
            let noBytes = keyInPlace.withBytes { $0.count }
            let keyLength = keyInPlace.withString { strlen($0) }
            #expect(noBytes == nil && keyLength == 4 && keyInPlace.currentType == "v")
            var unsafeKey = rssi
            let keyAsBytes = unsafeKey.unsafeBytes()
            let keyText = unsafeKey.unsafeString().map { String(cString: $0) }
            #expect(keyAsBytes == nil && keyText == "RSSI" && unsafeKey.currentType == "v")
            let key = rssi.string()
            #expect(key == "RSSI")
            var variant = try enter(&rssi)
            let asUnsigned = variant.uint16()
            let asSigned = variant.int16()
            #expect(asUnsigned == nil && asSigned == -61)
            #expect(variant.isAtEnd)
            #expect(rssi.isAtEnd)
            var manufacturer = try enter(&changed)
            let isManufacturer = manufacturer.string(equals: "ManufacturerData")
            #expect(isManufacturer)
            var inner = try enter(&manufacturer)
            var dictionary = try enter(&inner)
            var entry = try enter(&dictionary)
            let company = entry.uint16()
            #expect(company == 0x0499)
            var bytes = try enter(&entry)
            // In place: a mismatch hands nothing over and stays put; a match moves on.
            var copy = bytes
            let notText = copy.withString { _ in true }
            let inPlace = copy.withBytes { Array($0) }
            #expect(notText == nil && inPlace == [5, 1] && copy.isAtEnd)
            var unsafeCopy = bytes
            let bytesAsText = unsafeCopy.unsafeString()
            let unsafeBytes = unsafeCopy.unsafeBytes().map(Array.init)
            #expect(bytesAsText == nil && unsafeBytes == [5, 1] && unsafeCopy.isAtEnd)
            let data = bytes.bytes()
            #expect(data == [5, 1])
            #expect(dictionary.isAtEnd)
            // Anything can also be read as a value.
            var name = try enter(&changed)
            let nameKey = name.string()
            let nameValue = try name.value()
            let pastTheEnd = try name.value()
            #expect(nameKey == "Name" && nameValue == .variant(.string("Ruuvi")) && pastTheEnd == nil)
            #expect(changed.isAtEnd)
            var invalidated = try enter(&arguments)
            invalidated.skip()
            #expect(invalidated.isAtEnd)
            #expect(arguments.isAtEnd)
            let afterTheEnd = arguments.string()
            #expect(arguments.currentType == nil && afterTheEnd == nil)
            // The view still decodes the whole message.
            #expect(try view.decode().body == propertiesChanged().body)
        }
    }

    @Test func aReaderSubscriptionGetsMatchingSignalsOnTheIOThreadAndArgumentRulesStillApply() async throws {
        let fixture = try await BusFixture()
        let emitter = try fixture.connect()
        let listener = try fixture.connect()
        let seen = Mutex<[String]>([])
        let threads = Mutex<Set<String>>([])
        let byHeader = try await listener.signals(
            matching: DBusMatchRule(sender: emitter.uniqueName, interface: "org.example.View", path: "/v"),
            reader: { view in
                threads.withLock { _ = $0.insert(currentThreadName()) }
                var arguments = view.arguments()
                let first = arguments.string() ?? "-"
                seen.withLock { $0.append("header:\(view.member ?? "?"):\(first)") }
            })
        let byArgument = try await listener.signals(
            matching: DBusMatchRule(interface: "org.example.View", arguments: [0: "wanted"]),
            reader: { view in seen.withLock { $0.append("argument:\(view.member ?? "?")") } })
        // A decoded subscription on the same connection still gets its messages.
        let decoded = try await listener.signals(matching: DBusMatchRule(interface: "org.example.View", member: "End"))
        try emitter.emitSignal(path: "/v", interface: "org.example.View", name: "One", arguments: [.string("x")])
        try emitter.emitSignal(
            path: "/elsewhere", interface: "org.example.View", name: "Two", arguments: [.string("x")])
        try emitter.emitSignal(path: "/w", interface: "org.example.View", name: "Three", arguments: [.string("wanted")])
        try emitter.emitSignal(path: "/v", interface: "org.example.Other", name: "Four", arguments: [.string("x")])
        try emitter.emitSignal(path: "/w", interface: "org.example.View", name: "End", arguments: [.string("x")])
        var iterator = decoded.makeAsyncIterator()
        #expect(await iterator.next()?.member == "End")
        // End went out last on one connection, so everything before it has been handled by now.
        #expect(seen.withLock { $0 } == ["header:One:x", "argument:Three"])
        #expect(threads.withLock { $0 } == ["dbus-io"])
        byHeader.cancel()
        byArgument.cancel()
    }
}

/// Enters the container at `reader`, failing the test when there is none.
private func enter(_ reader: inout DBusArgumentReader, sourceLocation: SourceLocation = #_sourceLocation) throws
    -> DBusArgumentReader
{
    let sub = reader.enter()
    return try #require(sub, sourceLocation: sourceLocation)
}
