// The mirror on its own: fed GetManagedObjects bodies and signals exactly as bluetoothd sends them.
import DBus
import Testing

@testable import BlueZ

private func props(_ entries: [(String, DBusValue)]) -> DBusValue { .stringVariantDictionary(entries) }

private func interfaces(_ list: [(String, DBusValue)]) -> DBusValue {
    .dictionary(key: "s", value: "a{sv}", list.map { DBusDictEntry(key: .string($0.0), value: $0.1) })
}

private func managed(_ objects: [(String, DBusValue)]) -> DBusValue {
    .dictionary(
        key: "o", value: "a{sa{sv}}",
        objects.map { DBusDictEntry(key: .objectPath(DBusObjectPath(stringLiteral: $0.0)), value: $0.1) })
}

private let standard: [(String, DBusValue)] = [
    ("org.freedesktop.DBus.Introspectable", props([])), ("org.freedesktop.DBus.Properties", props([])),
]

private func signal(_ path: String, _ interface: String, _ name: String, _ body: [DBusValue]) -> DBusMessage {
    var m = DBusMessage.signal(path: DBusObjectPath(stringLiteral: path), interface: interface, name: name, body: body)
    m.sender = ":1.1"
    return m
}

private let dev = "/org/bluez/hci0/dev_AA_BB_CC_DD_EE_FF"

private func baseTree() -> BlueZObjectTree {
    var tree = BlueZObjectTree()
    tree.load(
        managedObjects: managed([
            ("/org/bluez", interfaces(standard + [("org.bluez.AgentManager1", props([]))])),
            (
                "/org/bluez/hci0",
                interfaces(
                    standard + [
                        (
                            "org.bluez.Adapter1",
                            props([
                                ("Address", .string("00:1a:7d:da:71:10")), ("Powered", .boolean(true)),
                                ("Discovering", .boolean(false)), ("Roles", .array("s", [.string("central")])),
                            ])
                        )
                    ])
            ),
            (
                dev,
                interfaces(
                    standard + [
                        (
                            "org.bluez.Device1",
                            props([
                                ("Address", .string("AA:BB:CC:DD:EE:FF")), ("AddressType", .string("random")),
                                ("Adapter", .objectPath("/org/bluez/hci0")), ("RSSI", .int16(-61)),
                                ("Connected", .boolean(false)),
                                (
                                    "ManufacturerData",
                                    .dictionary(
                                        key: "q", value: "v",
                                        [DBusDictEntry(key: .uint16(0x0499), value: .variant(.bytes([5, 1])))])
                                ),
                            ])
                        )
                    ])
            ),
            // Deliberately not nested under the device path: relations must come from the properties.
            (
                "/elsewhere/s1",
                interfaces([
                    (
                        "org.bluez.GattService1",
                        props([
                            ("UUID", .string("0000180F-0000-1000-8000-00805F9B34FB")),
                            ("Device", .objectPath(DBusObjectPath(stringLiteral: dev))), ("Primary", .boolean(true)),
                        ])
                    )
                ])
            ),
            (
                "/elsewhere/c1",
                interfaces([
                    (
                        "org.bluez.GattCharacteristic1",
                        props([
                            ("UUID", .string("00002a19-0000-1000-8000-00805f9b34fb")),
                            ("Service", .objectPath("/elsewhere/s1")),
                            ("Flags", .array("s", [.string("read"), .string("notify")])),
                            ("NotifyAcquired", .boolean(false)),
                        ])
                    )
                ])
            ),
        ]))
    return tree
}

@Suite struct ObjectTreeTests {
    @Test func loadsAndIgnoresStandardInterfaces() {
        let tree = baseTree()
        #expect(tree.properties("/org/bluez/hci0", "org.freedesktop.DBus.Properties") == nil)
        #expect(tree.adapters.map(\.name) == ["hci0"])
        #expect(tree.adapters.first?.address == "00:1A:7D:DA:71:10")
        let d = tree.device(address: "aa:bb:cc:dd:ee:ff", adapterPath: "/org/bluez/hci0")
        #expect(d?.addressType == "random")
        #expect(d?.rssi == -61)
        #expect(d?.manufacturerData == [0x0499: [5, 1]])
        #expect(d?.name == nil)
    }

    @Test func followsRelationPropertiesNotPaths() {
        let tree = baseTree()
        let services = tree.services(ofDevice: dev)
        #expect(services.map(\.uuid) == ["0000180f-0000-1000-8000-00805f9b34fb"])
        let chars = tree.characteristics(ofService: "/elsewhere/s1")
        #expect(chars.map(\.uuid) == ["00002a19-0000-1000-8000-00805f9b34fb"])
        #expect(chars.first?.canNotify == true)
        #expect(chars.first?.notifyAcquireAvailable == true)
        #expect(tree.devicePath(ofAttribute: "/elsewhere/c1") == dev)
    }

    @Test func appliesPropertiesChangedWithInvalidation() {
        var tree = baseTree()
        let event = tree.apply(
            signal(
                dev, "org.freedesktop.DBus.Properties", "PropertiesChanged",
                [.string("org.bluez.Device1"), props([("Name", .string("Thermo"))]), .array("s", [.string("RSSI")])]))
        guard case .propertiesChanged(let path, _, let changed, let invalidated)? = event else {
            Issue.record("no event")
            return
        }
        #expect(path == dev)
        #expect(changed["Name"]?.string == "Thermo")
        #expect(invalidated == ["RSSI"])
        #expect(tree.device(at: dev)?.rssi == nil)
        #expect(tree.device(at: dev)?.name == "Thermo")
        // A change for an object the mirror does not have creates nothing.
        let stray = tree.apply(
            signal(
                "/org/bluez/hci0/dev_11_22_33_44_55_66", "org.freedesktop.DBus.Properties", "PropertiesChanged",
                [.string("org.bluez.Device1"), props([("RSSI", .int16(-40))]), .array("s", [])]))
        #expect(stray == nil)
        #expect(tree.devices.count == 1)
    }

    @Test func interfacesAddedAndRemovedWithStandardNames() {
        var tree = baseTree()
        let newDev = "/org/bluez/hci0/dev_11_22_33_44_55_66"
        _ = tree.apply(
            signal(
                "/", "org.freedesktop.DBus.ObjectManager", "InterfacesAdded",
                [
                    .objectPath(DBusObjectPath(stringLiteral: newDev)),
                    interfaces(
                        standard + [
                            (
                                "org.bluez.Device1",
                                props([
                                    ("Address", .string("11:22:33:44:55:66")),
                                    ("Adapter", .objectPath("/org/bluez/hci0")),
                                ])
                            )
                        ]),
                ]))
        #expect(tree.devices.count == 2)
        let removed = tree.apply(
            signal(
                "/", "org.freedesktop.DBus.ObjectManager", "InterfacesRemoved",
                [
                    .objectPath(DBusObjectPath(stringLiteral: newDev)),
                    .array(
                        "s",
                        [
                            .string("org.freedesktop.DBus.Properties"), .string("org.freedesktop.DBus.Introspectable"),
                            .string("org.bluez.Device1"),
                        ]),
                ]))
        guard case .interfacesRemoved(_, let names, let previous)? = removed else {
            Issue.record("no removal event")
            return
        }
        #expect(names == ["org.bluez.Device1"])
        #expect(previous["org.bluez.Device1"]?["Address"]?.string == "11:22:33:44:55:66")
        #expect(tree.devices.count == 1)
    }

    @Test func disconnectedSignalCarriesReason() {
        var tree = baseTree()
        let event = tree.apply(
            signal(
                dev, "org.bluez.Device1", "Disconnected",
                [.string("org.bluez.Reason.Remote"), .string("Connection terminated by remote user")]))
        guard case .deviceDisconnected(let path, let reason, let message)? = event else {
            Issue.record("no event")
            return
        }
        #expect(path == dev)
        #expect(reason == "org.bluez.Reason.Remote")
        #expect(message == "Connection terminated by remote user")
        let r = BlueZDisconnectReason(signalReason: reason, message: message, requested: false)
        #expect(r.kind == .remote && r.isLinkLoss)
    }
}

@Suite struct ValueTests {
    @Test func uuidNormalisation() {
        #expect(bluezUUIDString("2A37") == "00002a37-0000-1000-8000-00805f9b34fb")
        #expect(bluezUUIDString("0x180d") == "0000180d-0000-1000-8000-00805f9b34fb")
        #expect(bluezUUIDString("12345678123456781234567812345678") == "12345678-1234-5678-1234-567812345678")
        #expect(bluezUUIDString("heart_rate") == nil)
        #expect(bluezUUIDString("123") == nil)
    }

    @Test func passivePatternsFromServiceUUIDs() {
        let filter = BlueZDiscoveryFilter(serviceUUIDs: ["181A"], passive: true)
        #expect(filter.effectivePatterns.map(\.adType) == [0x02, 0x03, 0x16])
        #expect(filter.effectivePatterns.first?.content == [0x1A, 0x18])
        let long = BlueZDiscoveryFilter(serviceUUIDs: ["12345678-1234-5678-1234-56789abcdef0"])
        #expect(long.effectivePatterns.first?.content.first == 0xF0)
        #expect(long.effectivePatterns.first?.content.count == 16)
    }

    @Test func passiveFallsBackWithoutAMonitorManager() {
        var adapter = baseTree().adapters[0]
        #expect(!adapter.supportsAdvertisementMonitor)
        let passive = BlueZDiscoveryFilter(serviceUUIDs: ["FCD2"], passive: true)
        let (mode, reason) = BlueZDiscovery.scanMode(adapter: adapter, filter: passive)
        #expect(mode == .active)
        #expect(reason == "adapter hci0 has no AdvertisementMonitorManager1 (bluetoothd needs --experimental)")
        adapter.supportsAdvertisementMonitor = true
        #expect(BlueZDiscovery.scanMode(adapter: adapter, filter: passive) == (.passive, nil))
        #expect(BlueZDiscovery.scanMode(adapter: adapter, filter: BlueZDiscoveryFilter()) == (.active, nil))
    }

    @Test func clientSideFilter() {
        let tree = baseTree()
        let d = tree.device(at: dev)!
        #expect(BlueZDiscoveryFilter(rssiThreshold: -70).matches(d))
        #expect(!BlueZDiscoveryFilter(rssiThreshold: -50).matches(d))
        #expect(!BlueZDiscoveryFilter(serviceUUIDs: ["180D"]).matches(d))
    }

    @Test func errorMessagesNameTheDevice() {
        let label = BlueZDeviceLabel(address: "A4:C1:38:00:11:22", name: "kitchen-thermo")
        let e = BlueZError.connectionFailed(
            device: label, reason: "le-connection-abort-by-local",
            failure: BlueZDBusFailure(name: "org.bluez.Error.Failed", message: "le-connection-abort-by-local"))
        #expect(
            e.description
                == "device kitchen-thermo (A4:C1:38:00:11:22): connect failed: org.bluez.Error.Failed le-connection-abort-by-local"
        )
        let nf = BlueZError.deviceNotFound(device: BlueZDeviceLabel(address: "A4:C1:38:00:11:22"), failure: nil)
        #expect(nf.description.hasPrefix("device A4:C1:38:00:11:22: not found"))
        let unknown = mapDBusError(
            DBusError(name: DBusError.unknownObject, message: "Unknown object"), device: label, operation: "connect",
            objectIsDevice: true)
        guard case .deviceNotFound = unknown else {
            Issue.record("UnknownObject should map to deviceNotFound, got \(unknown)")
            return
        }
    }
}

/// The advertisement update read in place must leave the mirror exactly as the decoded signal does, and must leave
/// every other signal (other keys, other shapes, invalidations, unknown objects) to `apply(_:)` untouched.
@Suite struct AdvertisementInPlaceTests {
    private func changed(
        _ entries: [(String, DBusValue)], path: String = dev, interface: String = "org.bluez.Device1",
        invalidated: [String] = []
    ) -> DBusMessage {
        signal(
            path, "org.freedesktop.DBus.Properties", "PropertiesChanged",
            [.string(interface), props(entries), .array("s", invalidated.map { .string($0) })])
    }

    private func manufacturer(_ entries: [(UInt16, DBusValue)]) -> DBusValue {
        .dictionary(key: "q", value: "v", entries.map { DBusDictEntry(key: .uint16($0.0), value: .variant($0.1)) })
    }

    /// Applies `message` both ways; returns whether the in-place path took it.
    private func compare(_ message: DBusMessage, sourceLocation: SourceLocation = #_sourceLocation) throws -> Bool {
        var decoded = baseTree()
        let decodedEvent = decoded.apply(message)
        var inPlace = baseTree()
        let device = try DBusSignalView.withView(of: message) { inPlace.applyAdvertisement($0) }
        guard let device else {
            #expect(
                inPlace.objects == baseTree().objects, "declined but changed the mirror", sourceLocation: sourceLocation
            )
            #expect(inPlace.devices == baseTree().devices, sourceLocation: sourceLocation)
            return false
        }
        let path = device.path
        #expect(path == message.path?.rawValue, sourceLocation: sourceLocation)
        #expect(device == inPlace.device(at: path), "the device returned is the mirror's", sourceLocation: sourceLocation)
        guard case .propertiesChanged = decodedEvent else {
            Issue.record("apply(_:) gave \(String(describing: decodedEvent))", sourceLocation: sourceLocation)
            return true
        }
        #expect(inPlace.objects == decoded.objects, sourceLocation: sourceLocation)
        #expect(inPlace.devices == decoded.devices, sourceLocation: sourceLocation)
        return true
    }

    @Test func advertisementFieldsAreAppliedInPlaceExactlyAsDecoded() throws {
        #expect(try compare(changed([("RSSI", .int16(-40))])))
        #expect(
            try compare(
                changed([
                    ("RSSI", .int16(-70)), ("TxPower", .int16(4)),
                    // In key order: the properties written back from the device value list entries in key order.
                    ("ManufacturerData", manufacturer([(0x004C, .bytes([])), (0x0499, .bytes([5, 2, 3]))])),
                    (
                        "ServiceData",
                        .dictionary(
                            key: "s", value: "v",
                            [
                                DBusDictEntry(
                                    key: .string("0000fcd2-0000-1000-8000-00805f9b34fb"),
                                    value: .variant(.bytes([64, 1]))
                                )
                            ])
                    ),
                ])))
        var tree = baseTree()
        let message = changed([
            ("RSSI", .int16(-33)), ("ManufacturerData", manufacturer([(0x0499, .bytes([9]))])),
            (
                "ServiceData",
                .dictionary(
                    key: "s", value: "v",
                    [DBusDictEntry(key: .string("0000FCD2-0000-1000-8000-00805F9B34FB"), value: .variant(.bytes([1])))])
            ),
        ])
        _ = try DBusSignalView.withView(of: message) { tree.applyAdvertisement($0) }
        #expect(tree.device(at: dev)?.rssi == -33)
        #expect(tree.device(at: dev)?.manufacturerData == [0x0499: [9]])
        #expect(tree.device(at: dev)?.serviceData == ["0000fcd2-0000-1000-8000-00805f9b34fb": [1]])
        #expect(tree.properties(dev, "org.bluez.Device1")?["RSSI"] == .int16(-33))
    }

    /// Updates in place, then the signals that touch the same object in other ways: the properties written back
    /// first, so each step leaves both mirrors alike (and the newer advertisement fields are not lost).
    @Test func laterChangesToTheObjectSeeTheFieldsUpdatedInPlace() throws {
        let battery = signal(
            "/", "org.freedesktop.DBus.ObjectManager", "InterfacesAdded",
            [
                .objectPath(DBusObjectPath(stringLiteral: dev)),
                interfaces([("org.bluez.Battery1", props([("Percentage", .byte(80))]))]),
            ])
        let removeBattery = signal(
            "/", "org.freedesktop.DBus.ObjectManager", "InterfacesRemoved",
            [.objectPath(DBusObjectPath(stringLiteral: dev)), .array("s", [.string("org.bluez.Battery1")])])
        let steps: [(DBusMessage, Bool)] = [
            (changed([("RSSI", .int16(-50)), ("ManufacturerData", manufacturer([(0x0499, .bytes([7]))]))]), true),
            (changed([("Name", .string("Ruuvi 1234"))]), false),
            (changed([("RSSI", .int16(-51))]), true),
            (battery, false),
            (changed([("TxPower", .int16(8))]), true),
            (changed([("Connected", .boolean(true))], invalidated: ["RSSI"]), false),
            (changed([("RSSI", .int16(-52))]), true),
            (removeBattery, false),
            (changed([("ManufacturerData", manufacturer([(0x0499, .bytes([8]))]))]), true),
            (changed([("Address", .string("AA:BB:CC:DD:EE:00"))]), false),
        ]
        var decoded = baseTree()
        var inPlace = baseTree()
        for (index, (message, fast)) in steps.enumerated() {
            _ = decoded.apply(message)
            let event = try DBusSignalView.withView(of: message) { inPlace.applyAdvertisement($0) }
            if event == nil { _ = inPlace.apply(message) }
            #expect((event != nil) == fast, "step \(index)")
            #expect(inPlace.devices == decoded.devices, "step \(index)")
            #expect(inPlace.objects == decoded.objects, "step \(index)")
            #expect(inPlace.properties(dev, "org.bluez.Device1") == decoded.properties(dev, "org.bluez.Device1"))
        }
        #expect(inPlace.device(at: dev)?.rssi == -52)
        #expect(inPlace.device(at: dev)?.txPower == 8)
        #expect(inPlace.device(at: dev)?.address == "AA:BB:CC:DD:EE:00")
        #expect(inPlace.device(address: "AA:BB:CC:DD:EE:00", adapterPath: nil)?.manufacturerData == [0x0499: [8]])
    }

    /// A StartNotify notification read in place (`readValueSignal` + `setValue`) leaves the mirror as `apply(_:)`
    /// does; any other shape is declined.
    @Test func characteristicValueReadInPlaceReadsAsDecoded() throws {
        let char = dev + "/service0010/char0011"
        func tree() -> BlueZObjectTree {
            var t = baseTree()
            _ = t.apply(
                signal(
                    "/", "org.freedesktop.DBus.ObjectManager", "InterfacesAdded",
                    [
                        .objectPath(DBusObjectPath(stringLiteral: char)),
                        interfaces([
                            (
                                "org.bluez.GattCharacteristic1",
                                props([
                                    ("UUID", .string("00002a37-0000-1000-8000-00805f9b34fb")), ("Value", .bytes([1])),
                                    ("Notifying", .boolean(true)),
                                ])
                            )
                        ]),
                    ]))
            return t
        }
        func changed(_ interface: String, _ entries: [(String, DBusValue)], invalidated: [String] = []) -> DBusMessage
        {
            signal(
                char, "org.freedesktop.DBus.Properties", "PropertiesChanged",
                [.string(interface), props(entries), .stringArray(invalidated)])
        }
        func readValue(_ message: DBusMessage) throws -> (path: String, value: [UInt8])? {
            try DBusSignalView.withView(of: message) { BlueZObjectTree.readValueSignal($0) }
        }
        #expect(tree().characteristic(at: char)?.value == [1])
        for value: [UInt8] in [[0, 72], [], Array(0..<200)] {
            let message = changed("org.bluez.GattCharacteristic1", [("Value", .bytes(value))])
            let read = try readValue(message)
            #expect(read?.path == char)
            #expect(read?.value == value)
            var decoded = tree()
            _ = decoded.apply(message)
            var inPlace = tree()
            let stored = inPlace.setValue(value, at: char)
            #expect(stored)
            #expect(inPlace.objects == decoded.objects)
            #expect(inPlace.characteristic(at: char)?.value == value)
        }
        // Not a StartNotify value alone: declined.
        let declined = [
            changed("org.bluez.GattCharacteristic1", [("Value", .bytes([1])), ("Notifying", .boolean(false))]),
            changed("org.bluez.GattCharacteristic1", [("Notifying", .boolean(false))]),
            changed("org.bluez.GattCharacteristic1", [("Value", .bytes([1]))], invalidated: ["Flags"]),
            changed("org.bluez.GattCharacteristic1", [("Value", .string("x"))]),
            changed("org.bluez.GattDescriptor1", [("Value", .bytes([1]))]),
            changed("org.bluez.GattCharacteristic1", []),
        ]
        for message in declined { #expect(try readValue(message) == nil) }
        // Unknown to the mirror: nothing stored.
        var t = tree()
        let stored = t.setValue([1], at: char + "/nothing")
        #expect(!stored)
        #expect(t.objects == tree().objects)
    }

    /// Data overwritten in place (the same keys as before) and rebuilt (other keys): a run of advertisements on one
    /// mirror reads like the decoded path at every step, and a device value taken before a step keeps its data.
    @Test func dataOverwrittenInPlaceReadsAsDecodedAndCopiesKeepTheirValues() throws {
        func service(_ entries: [(String, [UInt8])]) -> DBusValue {
            .dictionary(
                key: "s", value: "v", entries.map { DBusDictEntry(key: .string($0.0), value: .variant(.bytes($0.1))) })
        }
        let fcd2 = "0000fcd2-0000-1000-8000-00805f9b34fb"
        let steps: [(String, [(String, DBusValue)])] = [
            ("first data", [("ManufacturerData", manufacturer([(0x0499, .bytes([5, 1, 2]))]))]),
            ("same key, same length", [("ManufacturerData", manufacturer([(0x0499, .bytes([5, 3, 4]))]))]),
            ("same key, longer", [("ManufacturerData", manufacturer([(0x0499, .bytes(Array(0..<40)))]))]),
            ("same key, shorter", [("ManufacturerData", manufacturer([(0x0499, .bytes([9]))]))]),
            ("same key, empty", [("ManufacturerData", manufacturer([(0x0499, .bytes([]))]))]),
            ("a key added", [("ManufacturerData", manufacturer([(0x0499, .bytes([1])), (0x004C, .bytes([2]))]))]),
            (
                "both keys, other order",
                [("ManufacturerData", manufacturer([(0x004C, .bytes([3])), (0x0499, .bytes([4]))]))]
            ),
            ("a key twice", [("ManufacturerData", manufacturer([(0x0499, .bytes([5])), (0x0499, .bytes([6]))]))]),
            ("a key dropped", [("ManufacturerData", manufacturer([(0x004C, .bytes([7]))]))]),
            ("no keys", [("ManufacturerData", manufacturer([]))]),
            ("service data", [("ServiceData", service([(fcd2, [0x40, 1])]))]),
            ("service data, upper case", [("ServiceData", service([(fcd2.uppercased(), [0x40, 2, 3])]))]),
            ("service data, another UUID", [("ServiceData", service([("0000181a-0000-1000-8000-00805f9b34fb", [1])]))]),
            (
                "both at once",
                [
                    ("ManufacturerData", manufacturer([(0x004C, .bytes([8]))])),
                    ("ServiceData", service([("0000181A-0000-1000-8000-00805F9B34FB", [2])])),
                ]
            ),
        ]
        var decoded = baseTree()
        var inPlace = baseTree()
        for (name, entries) in steps {
            let message = changed(entries)
            let before = inPlace.device(at: dev)
            _ = decoded.apply(message)
            let event = try DBusSignalView.withView(of: message) { inPlace.applyAdvertisement($0) }
            #expect(event != nil, "\(name): taken in place")
            #expect(inPlace.devices == decoded.devices, "\(name)")
            // The properties written back mean the same device (entries in key order, UUIDs in lower case, one
            // entry per key: what the device value holds).
            let written = inPlace.properties(dev, "org.bluez.Device1").map { BlueZDevice(path: dev, properties: $0) }
            #expect(written == decoded.device(at: dev), "\(name): the written-back properties")
            // The value taken before the step still reads as the device did then.
            let then = decoded.device(at: dev)
            #expect(before != nil && before != then, "\(name): the step changed the device")
            #expect(before == Self.replay(steps.prefix { $0.0 != name }.map(\.1)), "\(name): an earlier copy changed")
        }
        #expect(inPlace.device(at: dev)?.manufacturerData == [0x004C: [8]])
        #expect(inPlace.device(at: dev)?.serviceData == ["0000181a-0000-1000-8000-00805f9b34fb": [2]])
    }

    /// The device after `steps` on the decoded path.
    private static func replay(_ steps: [[(String, DBusValue)]]) -> BlueZDevice? {
        var tree = baseTree()
        for entries in steps {
            _ = tree.apply(
                signal(
                    dev, "org.freedesktop.DBus.Properties", "PropertiesChanged",
                    [.string("org.bluez.Device1"), props(entries), .array("s", [])]))
        }
        return tree.device(at: dev)
    }

    @Test func everythingElseIsLeftToTheDecodedPath() throws {
        // Another property among them, a value of another shape, an invalidation, nothing at all.
        #expect(try !compare(changed([("RSSI", .int16(-40)), ("Name", .string("x"))])))
        #expect(try !compare(changed([("ManufacturerData", manufacturer([(0x0499, .string("not bytes"))]))])))
        #expect(try !compare(changed([("RSSI", .int32(-40))])))
        let pathKeyed = DBusValue.dictionary(
            key: "o", value: "v", [DBusDictEntry(key: .objectPath("/x"), value: .variant(.bytes([1])))])
        #expect(try !compare(changed([("ServiceData", pathKeyed)])))
        #expect(try !compare(changed([("RSSI", .int16(-40))], invalidated: ["TxPower"])))
        #expect(try !compare(changed([])))
        // A dictionary sent twice in one signal, and more entries than one advertisement is read into in place.
        #expect(
            try !compare(
                changed([
                    ("ManufacturerData", manufacturer([(0x0499, .bytes([1]))])),
                    ("ManufacturerData", manufacturer([(0x0499, .bytes([2]))])),
                ])))
        let many = (0..<17).map { (UInt16($0), DBusValue.bytes([UInt8($0)])) }
        #expect(try !compare(changed([("ManufacturerData", manufacturer(many))])))
        #expect(try compare(changed([("ManufacturerData", manufacturer(Array(many.prefix(16))))])))
        // Another interface, an object the mirror does not have, a device without Device1 in the mirror.
        #expect(try !compare(changed([("RSSI", .int16(-40))], interface: "org.bluez.Adapter1")))
        #expect(try !compare(changed([("RSSI", .int16(-40))], path: "/org/bluez/hci0/dev_00_00_00_00_00_01")))
        #expect(try !compare(changed([("RSSI", .int16(-40))], path: "/elsewhere/s1")))
        // Not a PropertiesChanged at all.
        #expect(try !compare(signal(dev, "org.bluez.Device1", "Disconnected", [.string("r"), .string("m")])))
    }
}

/// `readMissing`: a GetManagedObjects reply read in place gives what loading it as a tree gives, for the objects the
/// mirror lacks, and decodes nothing of those it has.
@Suite struct ReadMissingObjectsTests {
    private let service = dev + "/service0001"
    private let characteristic = dev + "/service0001/char0002"

    /// bluetoothd's whole tree after the connect: the mirror's objects, a service, a characteristic, and an object
    /// with only the standard interfaces.
    private var reply: DBusValue {
        var objects: [(String, DBusValue)] = []
        for (path, interfaceMap) in baseTree().objects.sorted(by: { $0.key < $1.key }) {
            objects.append(
                (path, interfaces(standard + interfaceMap.map { ($0.key, .stringVariantDictionary(Array($0.value))) }))
            )
        }
        objects.append(
            (
                service,
                interfaces(
                    standard + [
                        (
                            "org.bluez.GattService1",
                            props([
                                ("UUID", .string("0000180d-0000-1000-8000-00805f9b34fb")),
                                ("Device", .objectPath(DBusObjectPath(stringLiteral: dev))), ("Primary", .boolean(true)),
                            ])
                        )
                    ])
            ))
        objects.append(
            (
                characteristic,
                interfaces(
                    standard + [
                        (
                            "org.bluez.GattCharacteristic1",
                            props([
                                ("UUID", .string("00002a37-0000-1000-8000-00805f9b34fb")),
                                ("Service", .objectPath(DBusObjectPath(stringLiteral: service))),
                                ("Flags", .array("s", [.string("notify")])),
                            ])
                        )
                    ])
            ))
        objects.append(("/org/bluez/hci0/empty", interfaces(standard)))
        return managed(objects)
    }

    private func read(_ body: [DBusValue], known: BlueZObjectTree) throws
        -> (exported: Set<String>, missing: [(String, [String: [String: DBusValue]])])
    {
        let message = DBusMessage.signal(path: "/", interface: "org.example.Test", name: "Reply", body: body)
        return try DBusSignalView.withView(of: message) { view in
            var reader = view.arguments()
            return try BlueZObjectTree.readMissing(&reader, from: known)
        }
    }

    @Test func onlyTheObjectsTheMirrorLacksAreReturnedAsLoadWouldStoreThem() throws {
        let known = baseTree()
        var loaded = BlueZObjectTree()
        loaded.load(managedObjects: reply)
        let (exported, missing) = try read([reply], known: known)
        #expect(exported == Set(loaded.objectPaths))
        #expect(!exported.contains("/org/bluez/hci0/empty"))
        #expect(missing.map(\.0).sorted() == [service, characteristic].sorted())
        for (path, interfaces) in missing {
            #expect(interfaces == loaded.objects[path], "\(path)")
        }
        // An empty mirror lacks everything.
        let all = try read([reply], known: BlueZObjectTree())
        #expect(Set(all.missing.map(\.0)) == exported)
    }

    @Test func aReplyOfAnotherShapeIsAnErrorNotATrap() throws {
        for body: [DBusValue] in [[], [.string("x")], [.array("s", [.string("x")])]] {
            #expect(throws: DBusError.self) { try read(body, known: BlueZObjectTree()) }
        }
    }
}
