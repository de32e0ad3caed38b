// The mirror's indexes (adapter paths, devices by address) follow every signal, and events say whether they can
// change the adapters.
import DBus
import Testing

@testable import BlueZ

private func added(_ path: String, _ interfaces: [(String, [(String, DBusValue)])]) -> DBusMessage {
    var m = DBusMessage.signal(
        path: "/", interface: "org.freedesktop.DBus.ObjectManager", name: "InterfacesAdded",
        body: [
            .objectPath(DBusObjectPath(stringLiteral: path)),
            .dictionary(
                key: "s", value: "a{sv}",
                interfaces.map { DBusDictEntry(key: .string($0.0), value: .stringVariantDictionary($0.1)) }),
        ])
    m.sender = ":1.1"
    return m
}

private func removed(_ path: String, _ names: [String]) -> DBusMessage {
    var m = DBusMessage.signal(
        path: "/", interface: "org.freedesktop.DBus.ObjectManager", name: "InterfacesRemoved",
        body: [.objectPath(DBusObjectPath(stringLiteral: path)), .array("s", names.map { .string($0) })])
    m.sender = ":1.1"
    return m
}

private func changed(_ path: String, _ interface: String, _ props: [(String, DBusValue)], invalidated: [String] = [])
    -> DBusMessage
{
    var m = DBusMessage.signal(
        path: DBusObjectPath(stringLiteral: path), interface: "org.freedesktop.DBus.Properties",
        name: "PropertiesChanged",
        body: [.string(interface), .stringVariantDictionary(props), .array("s", invalidated.map { .string($0) })])
    m.sender = ":1.1"
    return m
}

private func adapter(_ address: String) -> [(String, [(String, DBusValue)])] {
    [("org.bluez.Adapter1", [("Address", .string(address)), ("Powered", .boolean(true))])]
}

private func device(_ address: String, on adapter: String) -> [(String, [(String, DBusValue)])] {
    [
        (
            "org.bluez.Device1",
            [("Address", .string(address)), ("Adapter", .objectPath(DBusObjectPath(stringLiteral: adapter)))]
        )
    ]
}

@Suite struct ObjectTreeIndexTests {
    @Test func adaptersStayInPathOrderAsTheyComeAndGo() {
        var tree = BlueZObjectTree()
        _ = tree.apply(added("/org/bluez/hci1", adapter("00:00:00:00:00:01")))
        _ = tree.apply(added("/org/bluez/hci0", adapter("00:00:00:00:00:00")))
        _ = tree.apply(added("/org/bluez/hci0/dev_AA", device("aa:00:00:00:00:01", on: "/org/bluez/hci0")))
        #expect(tree.adapters.map(\.name) == ["hci0", "hci1"])
        _ = tree.apply(removed("/org/bluez/hci0", ["org.bluez.Adapter1"]))
        #expect(tree.adapters.map(\.name) == ["hci1"])
        _ = tree.apply(added("/org/bluez/hci2", adapter("00:00:00:00:00:02")))
        #expect(tree.adapters.map(\.name) == ["hci1", "hci2"])
        tree.clear()
        #expect(tree.adapters.isEmpty && tree.devices.isEmpty)
    }

    @Test func devicesAreFoundByAddressAfterEveryChange() {
        var tree = BlueZObjectTree()
        _ = tree.apply(added("/org/bluez/hci0", adapter("00:00:00:00:00:00")))
        _ = tree.apply(added("/org/bluez/hci1", adapter("00:00:00:00:00:01")))
        _ = tree.apply(added("/org/bluez/hci1/dev_1", device("aa:bb:cc:dd:ee:ff", on: "/org/bluez/hci1")))
        _ = tree.apply(added("/org/bluez/hci0/dev_1", device("AA:BB:CC:DD:EE:FF", on: "/org/bluez/hci0")))
        // The first in path order when no adapter is given, as a scan of every device in order would find.
        #expect(tree.device(address: "aa:bb:cc:dd:ee:ff", adapterPath: nil)?.path == "/org/bluez/hci0/dev_1")
        #expect(
            tree.device(address: "AA:BB:CC:DD:EE:FF", adapterPath: "/org/bluez/hci1")?.path == "/org/bluez/hci1/dev_1")
        #expect(tree.device(address: "AA:BB:CC:DD:EE:FF", adapterPath: "/org/bluez/hci9") == nil)
        #expect(tree.devices.map(\.path) == ["/org/bluez/hci0/dev_1", "/org/bluez/hci1/dev_1"])
        _ = tree.apply(
            changed("/org/bluez/hci0/dev_1", "org.bluez.Device1", [("Address", .string("11:22:33:44:55:66"))]))
        #expect(tree.device(address: "AA:BB:CC:DD:EE:FF", adapterPath: nil)?.path == "/org/bluez/hci1/dev_1")
        #expect(tree.device(address: "11:22:33:44:55:66", adapterPath: nil)?.path == "/org/bluez/hci0/dev_1")
        _ = tree.apply(removed("/org/bluez/hci1/dev_1", ["org.bluez.Device1"]))
        #expect(tree.device(address: "AA:BB:CC:DD:EE:FF", adapterPath: nil) == nil)
        #expect(tree.devices.map(\.path) == ["/org/bluez/hci0/dev_1"])
    }

    @Test func onlyAdapterSignalsTouchTheAdapters() {
        var tree = BlueZObjectTree()
        let events = [
            tree.apply(added("/org/bluez/hci0", adapter("00:00:00:00:00:00"))),
            tree.apply(added("/org/bluez/hci0/dev_1", device("AA:BB:CC:DD:EE:FF", on: "/org/bluez/hci0"))),
            tree.apply(changed("/org/bluez/hci0/dev_1", "org.bluez.Device1", [("RSSI", .int16(-50))])),
            tree.apply(changed("/org/bluez/hci0", "org.bluez.Adapter1", [("Discovering", .boolean(true))])),
            tree.apply(added("/org/bluez/hci0", [("org.bluez.AdvertisementMonitorManager1", [])])),
            tree.apply(removed("/org/bluez/hci0/dev_1", ["org.bluez.Device1"])),
        ]
        #expect(events.map { $0?.touchesAdapters } == [true, false, false, true, true, false])
        #expect(BlueZTreeEvent.reloaded.touchesAdapters)
        #expect(!BlueZTreeEvent.deviceDisconnected(path: "/x", reason: "", message: "").touchesAdapters)
    }
}

/// The mirror finds a signal's device over the message's own path bytes (no String per signal): a borrowed key must
/// hash and compare exactly like the stored one, and match nothing else.
@Suite struct ObjectPathKeyTests {
    @Test func aBorrowedKeyFindsTheOwnedEntryAndNothingElse() {
        let paths = [
            "/org/bluez/hci0/dev_AA_BB_CC_DD_EE_FF", "/org/bluez/hci0/dev_AA_BB_CC_DD_EE_F0",
            "/org/bluez/hci1/dev_AA_BB_CC_DD_EE_FF", "/org/bluez/hci0",
        ]
        var table: [ObjectPathKey: Int] = [:]
        for (index, path) in paths.enumerated() { table[ObjectPathKey(path)] = index }
        func lookUp(_ path: String) -> Int? {
            var bytes = Array(path.utf8)
            return bytes.withUnsafeMutableBufferPointer { buffer in
                table[ObjectPathKey(unsafeBorrowing: UnsafeBufferPointer(buffer))]
            }
        }
        for (index, path) in paths.enumerated() { #expect(lookUp(path) == index) }
        #expect(lookUp("/org/bluez/hci0/dev_AA_BB_CC_DD_EE_F") == nil)
        #expect(lookUp("/org/bluez/hci0/dev_AA_BB_CC_DD_EE_FF0") == nil)
        #expect(lookUp("/org/bluez/hci0/dev_aa_BB_CC_DD_EE_FF") == nil)
        #expect(lookUp("") == nil)
        #expect(table[ObjectPathKey("/org/bluez/hci0")] == 3)
        #expect(ObjectPathKey("/a").path == "/a")
    }
}
