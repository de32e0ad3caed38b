// The org.bluez object tree: interface declarations and the property dictionaries of each object.
import DBus

extension BlueZSimulator {
    // MARK: interface specs

    func rootInterfaces() -> [(DBusInterfaceSpec, [String: DBusValue])] {
        let agent = DBusInterfaceSpec(
            "org.bluez.AgentManager1",
            methods: [
                DBusMethodSpec("RegisterAgent", in: "os", argumentNames: ["agent", "capability"]) { _ in .reply([]) },
                DBusMethodSpec("UnregisterAgent", in: "o", argumentNames: ["agent"]) { _ in .reply([]) },
                DBusMethodSpec("RequestDefaultAgent", in: "o", argumentNames: ["agent"]) { _ in .reply([]) },
            ])
        let profile = DBusInterfaceSpec(
            "org.bluez.ProfileManager1",
            methods: [
                DBusMethodSpec("RegisterProfile", in: "osa{sv}", argumentNames: ["profile", "UUID", "options"]) { _ in
                    .reply([])
                },
                DBusMethodSpec("UnregisterProfile", in: "o", argumentNames: ["profile"]) { _ in .reply([]) },
            ])
        return [(agent, [:]), (profile, [:])]
    }

    func adapterInterfaces(_ a: SimAdapter) -> [(DBusInterfaceSpec, [String: DBusValue])] {
        let adapter = DBusInterfaceSpec(
            "org.bluez.Adapter1",
            methods: [
                DBusMethodSpec("StartDiscovery", handler: onQueue { $0.startDiscovery($1) }),
                DBusMethodSpec("StopDiscovery", handler: onQueue { $0.stopDiscovery($1) }),
                DBusMethodSpec(
                    "SetDiscoveryFilter", in: "a{sv}", argumentNames: ["properties"],
                    handler: onQueue { $0.setDiscoveryFilter($1) }),
                DBusMethodSpec("GetDiscoveryFilters", out: "as", resultNames: ["filters"]) { _ in
                    .reply([.stringArray(SimDiscoveryFilter.knownKeys.sorted())])
                },
                DBusMethodSpec(
                    "RemoveDevice", in: "o", argumentNames: ["device"],
                    handler: onQueue { $0.removeDeviceCall($1) }),
                DBusMethodSpec("ConnectDevice", in: "a{sv}", out: "o", argumentNames: ["properties"]) { _ in
                    .error(BlueZSimulator.notSupported)
                },
            ],
            properties: [
                DBusPropertySpec("Address", "s"), DBusPropertySpec("AddressType", "s"), DBusPropertySpec("Name", "s"),
                DBusPropertySpec("Alias", "s", access: .readWrite), DBusPropertySpec("Class", "u"),
                DBusPropertySpec("Connectable", "b", access: .readWrite),
                DBusPropertySpec("Powered", "b", access: .readWrite), DBusPropertySpec("PowerState", "s"),
                DBusPropertySpec("Discoverable", "b", access: .readWrite),
                DBusPropertySpec("DiscoverableTimeout", "u", access: .readWrite),
                DBusPropertySpec("Pairable", "b", access: .readWrite),
                DBusPropertySpec("PairableTimeout", "u", access: .readWrite), DBusPropertySpec("Discovering", "b"),
                DBusPropertySpec("UUIDs", "as"), DBusPropertySpec("Modalias", "s"), DBusPropertySpec("Roles", "as"),
                DBusPropertySpec("ExperimentalFeatures", "as"),
            ],
            setHandler: { [weak self] name, value, _ in
                guard let self else { return nil }
                if name == "Powered", let on = value.bool {
                    // Set handlers run on the loop too.
                    do {
                        let was = a.powered
                        a.powered = on
                        self.server?.setProperty(
                            at: a.path, interface: "org.bluez.Adapter1", "PowerState",
                            .string(on ? "on" : "off"))
                        if was, !on { self.poweredOff(a) }
                    }
                }
                return nil
            })
        let props: [String: DBusValue] = [
            "Address": .string(a.spec.address), "AddressType": .string("public"), "Name": .string(a.spec.name),
            "Alias": .string(a.spec.name), "Class": .uint32(0x6c010c), "Connectable": .boolean(true),
            "Powered": .boolean(a.powered), "PowerState": .string(a.powered ? "on" : "off"),
            "Discoverable": .boolean(false), "DiscoverableTimeout": .uint32(180), "Pairable": .boolean(false),
            "PairableTimeout": .uint32(0), "Discovering": .boolean(false),
            "UUIDs": .stringArray([
                "00001801-0000-1000-8000-00805f9b34fb", "00001800-0000-1000-8000-00805f9b34fb",
                "0000180a-0000-1000-8000-00805f9b34fb",
            ]),
            "Modalias": .string("usb:v1D6Bp0246d0542"), "Roles": .stringArray(["central", "peripheral"]),
            "ExperimentalFeatures": .stringArray([]),
        ]
        let gattManager = DBusInterfaceSpec(
            "org.bluez.GattManager1",
            methods: [
                DBusMethodSpec(
                    "RegisterApplication", in: "oa{sv}", argumentNames: ["application", "options"],
                    handler: onQueue { $0.registerApplication($1) }),
                DBusMethodSpec(
                    "UnregisterApplication", in: "o", argumentNames: ["application"],
                    handler: onQueue { $0.unregisterApplication($1) }),
            ])
        let advertising = DBusInterfaceSpec(
            "org.bluez.LEAdvertisingManager1",
            methods: [
                DBusMethodSpec(
                    "RegisterAdvertisement", in: "oa{sv}", argumentNames: ["advertisement", "options"],
                    handler: onQueue { $0.registerAdvertisement($1) }),
                DBusMethodSpec(
                    "UnregisterAdvertisement", in: "o", argumentNames: ["service"],
                    handler: onQueue { $0.unregisterAdvertisement($1) }),
            ],
            properties: [
                DBusPropertySpec("ActiveInstances", "y"), DBusPropertySpec("SupportedInstances", "y"),
                DBusPropertySpec("SupportedIncludes", "as"), DBusPropertySpec("SupportedSecondaryChannels", "as"),
            ])
        let monitor = DBusInterfaceSpec(
            "org.bluez.AdvertisementMonitorManager1",
            methods: [
                DBusMethodSpec(
                    "RegisterMonitor", in: "o", argumentNames: ["application"],
                    handler: onQueue { $0.registerMonitor($1) }),
                DBusMethodSpec(
                    "UnregisterMonitor", in: "o", argumentNames: ["application"],
                    handler: onQueue { $0.unregisterMonitor($1) }),
            ],
            properties: [DBusPropertySpec("SupportedMonitorTypes", "as"), DBusPropertySpec("SupportedFeatures", "as")])
        return [
            (adapter, props), (gattManager, [:]),
            (
                advertising,
                [
                    "ActiveInstances": .byte(0), "SupportedInstances": .byte(5),
                    "SupportedIncludes": .stringArray(["tx-power", "appearance", "local-name"]),
                    "SupportedSecondaryChannels": .stringArray(["1M", "2M", "Coded"]),
                ]
            ),
            (
                monitor,
                [
                    "SupportedMonitorTypes": .stringArray(["or_patterns"]),
                    "SupportedFeatures": .stringArray(["controller-patterns"]),
                ]
            ),
        ]
    }

    /// Powering off (adapter_stop): links drop and every discovery session ends (Discovering false, temporary
    /// broadcasters removed); clients must StartDiscovery again once it is back on.
    func poweredOff(_ a: SimAdapter) {
        for d in devices where d.adapterID == a.spec.id && d.isConnected {
            linkDown(d, reason: ("org.bluez.Reason.Local", "Connection terminated by local host"))
        }
        for sender in a.sessions { endSession(a, sender) }
        localPoweredOff(a.spec.id)
    }

    func exportRoot() {
        guard let server else { return }
        server.addInterfaces(at: "/org/bluez", rootInterfaces())
        for a in adapters { server.addInterfaces(at: a.path, adapterInterfaces(a)) }
        // Paired devices come from BlueZ's storage: exported at start-up, without RSSI, never temporary.
        for d in devices where d.spec.paired {
            d.paired = true
            d.temporary = false
            d.adv.name = d.spec.name
            d.adv.uuids = d.spec.serviceUUIDs.map(\.string)
            exportDevice(d)
        }
        // The control object has its own server (an ObjectManager of its own at its path), so that clients
        // reading org.bluez's tree through GetManagedObjects on "/" see only what bluetoothd would export.
        controlServer?.addInterfaces(at: "/org/bluez/sim", [(controlInterface(), [:])])
    }

    // MARK: devices

    var deviceInterface: DBusInterfaceSpec {
        DBusInterfaceSpec(
            "org.bluez.Device1",
            methods: [
                DBusMethodSpec("Connect", handler: onQueue { $0.connectCall($1) }),
                DBusMethodSpec("Disconnect", handler: onQueue { $0.disconnectCall($1) }),
                DBusMethodSpec("ConnectProfile", in: "s", argumentNames: ["UUID"]) { _ in
                    .error(BlueZSimulator.notSupported)
                },
                DBusMethodSpec("DisconnectProfile", in: "s", argumentNames: ["UUID"]) { _ in
                    .error(BlueZSimulator.notSupported)
                },
                DBusMethodSpec("Pair", handler: onQueue { $0.pairCall($1) }),
                DBusMethodSpec("CancelPairing") { _ in .error(BlueZSimulator.doesNotExist) },
            ],
            properties: [
                DBusPropertySpec("Address", "s"), DBusPropertySpec("AddressType", "s"), DBusPropertySpec("Name", "s"),
                DBusPropertySpec("Alias", "s", access: .readWrite), DBusPropertySpec("Class", "u"),
                DBusPropertySpec("Appearance", "q"), DBusPropertySpec("Icon", "s"), DBusPropertySpec("Paired", "b"),
                DBusPropertySpec("Bonded", "b"), DBusPropertySpec("Trusted", "b", access: .readWrite),
                DBusPropertySpec("Blocked", "b", access: .readWrite), DBusPropertySpec("LegacyPairing", "b"),
                DBusPropertySpec("CablePairing", "b"), DBusPropertySpec("RSSI", "n"),
                DBusPropertySpec("Connected", "b"), DBusPropertySpec("UUIDs", "as"), DBusPropertySpec("Modalias", "s"),
                DBusPropertySpec("Adapter", "o"), DBusPropertySpec("ManufacturerData", "a{qv}"),
                DBusPropertySpec("ServiceData", "a{sv}"), DBusPropertySpec("TxPower", "n"),
                DBusPropertySpec("ServicesResolved", "b"), DBusPropertySpec("AdvertisingFlags", "ay"),
                DBusPropertySpec("AdvertisingData", "a{yv}"), DBusPropertySpec("WakeAllowed", "b", access: .readWrite),
            ],
            signals: [DBusSignalSpec("Disconnected", "ss", argumentNames: ["name", "message"])],
            setHandler: { name, _, _ in
                ["Alias", "Trusted", "Blocked", "WakeAllowed"].contains(name)
                    ? nil : DBusError(name: DBusError.propertyReadOnly, message: "Property '\(name)' is not writable")
            })
    }

    static func manufacturerValue(_ m: [UInt16: [UInt8]]) -> DBusValue {
        .dictionary(
            key: "q", value: "v",
            m.keys.sorted().map { DBusDictEntry(key: .uint16($0), value: .variant(.bytes(m[$0] ?? []))) })
    }

    static func serviceDataValue(_ s: [String: [UInt8]]) -> DBusValue {
        .dictionary(
            key: "s", value: "v",
            s.keys.sorted().map { DBusDictEntry(key: .string($0), value: .variant(.bytes(s[$0] ?? []))) })
    }

    func deviceProperties(_ d: SimDevice, adapterPath: DBusObjectPath) -> [String: DBusValue] {
        var p: [String: DBusValue] = [
            "Address": .string(d.spec.address), "AddressType": .string(d.spec.addressType),
            "Alias": .string(d.adv.name ?? d.spec.address.map { $0 == ":" ? "-" : $0 }.map(String.init).joined()),
            "Paired": .boolean(d.paired), "Bonded": .boolean(d.paired), "Trusted": .boolean(false),
            "Blocked": .boolean(false), "LegacyPairing": .boolean(false), "CablePairing": .boolean(false),
            "Connected": .boolean(d.isConnected), "UUIDs": .stringArray(d.adv.uuids),
            "Adapter": .objectPath(adapterPath), "ServicesResolved": .boolean(d.servicesResolved),
            "AdvertisingFlags": .bytes([d.spec.connectable ? 0x06 : 0x04]),
        ]
        if let n = d.adv.name { p["Name"] = .string(n) }
        if let r = d.adv.rssi { p["RSSI"] = .int16(Int16(r)) }
        if let t = d.adv.txPower { p["TxPower"] = .int16(Int16(t)) }
        if let a = d.spec.appearance { p["Appearance"] = .uint16(a) }
        if !d.adv.manufacturerData.isEmpty { p["ManufacturerData"] = Self.manufacturerValue(d.adv.manufacturerData) }
        if !d.adv.serviceData.isEmpty { p["ServiceData"] = Self.serviceDataValue(d.adv.serviceData) }
        return p
    }

    func exportDevice(_ d: SimDevice) {
        guard let server, let a = adapter(of: d), !d.exported else { return }
        d.exported = true
        server.addInterfaces(at: d.path, [(deviceInterface, deviceProperties(d, adapterPath: a.path))])
        count("devices_added")
    }

    /// Removes a device object (and its GATT objects, children first) and resets it to "never seen".
    func unexportDevice(_ d: SimDevice) {
        guard let server, d.exported else { return }
        unexportGATT(d)
        server.removeObject(at: d.path)
        d.exported = false
        d.temporary = true
        d.paired = false
        d.adv = SimAdvertisementState()
        d.seenInDiscovery = false
        d.expiryGeneration += 1
        d.servicesResolved = false
        for c in d.characteristics { c.sessions = [] }
        for key in d.foundBy {
            if let m = monitors.first(where: { $0.key == key }) { callMonitor(m, "DeviceLost", d.path) }
        }
        d.foundBy = []
        count("devices_removed")
    }

    // MARK: GATT objects

    var serviceInterface: DBusInterfaceSpec {
        DBusInterfaceSpec(
            "org.bluez.GattService1",
            properties: [
                DBusPropertySpec("Handle", "q"), DBusPropertySpec("UUID", "s"), DBusPropertySpec("Device", "o"),
                DBusPropertySpec("Primary", "b"), DBusPropertySpec("Includes", "ao"),
            ])
    }

    var characteristicInterface: DBusInterfaceSpec {
        DBusInterfaceSpec(
            "org.bluez.GattCharacteristic1",
            methods: [
                DBusMethodSpec(
                    "ReadValue", in: "a{sv}", out: "ay", argumentNames: ["options"], resultNames: ["value"],
                    handler: onQueue { $0.readValue($1) }),
                DBusMethodSpec(
                    "WriteValue", in: "aya{sv}", argumentNames: ["value", "options"],
                    handler: onQueue { $0.writeValue($1) }),
                DBusMethodSpec(
                    "AcquireWrite", in: "a{sv}", out: "hq", argumentNames: ["options"],
                    resultNames: ["fd", "mtu"], handler: onQueue { $0.acquire($1, notify: false) }),
                DBusMethodSpec(
                    "AcquireNotify", in: "a{sv}", out: "hq", argumentNames: ["options"],
                    resultNames: ["fd", "mtu"], handler: onQueue { $0.acquire($1, notify: true) }),
                DBusMethodSpec("StartNotify", handler: onQueue { $0.startNotify($1) }),
                DBusMethodSpec("StopNotify", handler: onQueue { $0.stopNotify($1) }),
            ],
            properties: [
                DBusPropertySpec("Handle", "q"), DBusPropertySpec("UUID", "s"), DBusPropertySpec("Service", "o"),
                DBusPropertySpec("Value", "ay"), DBusPropertySpec("Notifying", "b"), DBusPropertySpec("Flags", "as"),
                DBusPropertySpec("WriteAcquired", "b"), DBusPropertySpec("NotifyAcquired", "b"),
                DBusPropertySpec("MTU", "q"),
            ])
    }

    var descriptorInterface: DBusInterfaceSpec {
        DBusInterfaceSpec(
            "org.bluez.GattDescriptor1",
            methods: [
                DBusMethodSpec(
                    "ReadValue", in: "a{sv}", out: "ay", argumentNames: ["options"], resultNames: ["value"],
                    handler: onQueue { $0.readDescriptor($1) }),
                DBusMethodSpec(
                    "WriteValue", in: "aya{sv}", argumentNames: ["value", "options"],
                    handler: onQueue { $0.writeDescriptor($1) }),
            ],
            properties: [
                DBusPropertySpec("Handle", "q"), DBusPropertySpec("UUID", "s"),
                DBusPropertySpec("Characteristic", "o"), DBusPropertySpec("Value", "ay"),
            ])
    }

    func exportGATT(_ d: SimDevice) {
        guard let server, !d.gattExported else { return }
        d.gattExported = true
        var index = 0
        for s in d.layout.services {
            let sp = DBusObjectPath(stringLiteral: d.path.rawValue + s.pathSuffix)
            server.addInterfaces(
                at: sp,
                [
                    (
                        serviceInterface,
                        [
                            "Handle": .uint16(s.handle), "UUID": .string(s.uuid.string), "Device": .objectPath(d.path),
                            "Primary": .boolean(s.primary), "Includes": .objectPathArray([]),
                        ]
                    )
                ])
            for _ in s.characteristics {
                let c = d.characteristics[index]
                index += 1
                var props: [String: DBusValue] = [
                    "Handle": .uint16(c.layout.handle), "UUID": .string(c.uuid.string), "Service": .objectPath(sp),
                    "Value": .bytes([]), "Flags": .stringArray(c.layout.spec.flags), "MTU": .uint16(scenario.mtu),
                ]
                if c.canNotify { props["Notifying"] = .boolean(!c.sessions.isEmpty) }
                if c.layout.spec.flags.contains("write-without-response") {
                    props["WriteAcquired"] = .boolean(c.writeSocket != nil)
                }
                if c.layout.spec.flags.contains("notify") { props["NotifyAcquired"] = .boolean(c.notifySocket != nil) }
                server.addInterfaces(at: c.path, [(characteristicInterface, props)])
                for desc in c.layout.descriptors {
                    server.addInterfaces(
                        at: DBusObjectPath(stringLiteral: d.path.rawValue + desc.pathSuffix),
                        [
                            (
                                descriptorInterface,
                                [
                                    "Handle": .uint16(desc.handle), "UUID": .string(desc.uuid.string),
                                    "Characteristic": .objectPath(c.path), "Value": .bytes([]),
                                ]
                            )
                        ])
                }
            }
        }
        server.flush()
    }

    /// Removes the GATT objects, children first (descriptors, characteristics, then services).
    func unexportGATT(_ d: SimDevice) {
        guard let server, d.gattExported else { return }
        d.gattExported = false
        for c in d.characteristics {
            for desc in c.layout.descriptors.reversed() {
                server.removeObject(at: DBusObjectPath(stringLiteral: d.path.rawValue + desc.pathSuffix))
            }
        }
        for c in d.characteristics.reversed() { server.removeObject(at: c.path) }
        for s in d.layout.services.reversed() {
            server.removeObject(at: DBusObjectPath(stringLiteral: d.path.rawValue + s.pathSuffix))
        }
    }
}
