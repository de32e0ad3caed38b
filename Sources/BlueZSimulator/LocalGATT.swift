// GattManager1 on each adapter: external GATT applications registered the way BlueZ's src/gatt-database.c takes
// them (GetManagedObjects on the sender, then GattService1/GattCharacteristic1/GattDescriptor1 parsed and checked),
// and the remote-central side the control interface drives (CentralRead/Write/Subscribe): ATT permission checks,
// ReadValue/WriteValue/StartNotify/StopNotify/AcquireWrite/AcquireNotify/Confirm calls, and error mapping.
import DBus
import Dispatch

extension BlueZSimulator {
    static let gattServiceInterface = "org.bluez.GattService1"
    static let gattDescriptorInterface = "org.bluez.GattDescriptor1"

    /// An application's error as bluetoothd's client_ready_cb answers it.
    static func appFailed(_ text: String) -> DBusError { bluezError("Failed", text) }

    // MARK: RegisterApplication

    func registerApplication(_ call: DBusMethodCall) {
        guard let root = call.arguments.first?.objectPath, call.arguments.count == 2 else {
            return call.reply.fail(Self.invalidArguments)
        }
        guard let a = adapters.first(where: { $0.path == call.path }) else { return call.reply.fail(Self.doesNotExist) }
        let adapterID = a.spec.id
        // manager_register_app: the same sender may not register the same path twice (per adapter database).
        if localApps.contains(where: { $0.owner == call.sender && $0.path == root && $0.adapterID == adapterID })
            || pendingApps.contains(where: { $0.owner == call.sender && $0.path == root && $0.adapterID == adapterID })
        {
            return call.reply.fail(Self.alreadyExists)
        }
        guard let connection else { return call.reply.fail(Self.appFailed("Failed to register application")) }
        let sender = call.sender
        let epoch = self.epoch
        pendingApps.append((sender, root, adapterID))
        Task { [weak self] in
            // Like bleak and GDBusClient: the match rules go in before GetManagedObjects, so no change is lost.
            let changes = try? await connection.signals(
                matching: DBusMatchRule(
                    type: .signal, sender: sender, interface: "org.freedesktop.DBus.Properties",
                    member: "PropertiesChanged", pathNamespace: root.rawValue == "/" ? nil : root))
            let removed = try? await connection.signals(
                matching: DBusMatchRule(
                    type: .signal, sender: sender, interface: "org.freedesktop.DBus.ObjectManager",
                    member: "InterfacesRemoved", path: root))
            var objects: [DBusDictEntry]? = nil
            if let reply = try? await connection.call(
                destination: sender, path: root, interface: "org.freedesktop.DBus.ObjectManager",
                method: "GetManagedObjects", timeout: .seconds(5))
            {
                objects = reply.first?.dictionaryEntries
            }
            guard let self else { return }
            let parsed = Self.parseApplication(objects ?? [], root: root)
            self.onLoop(epoch: epoch) {
                let isPending = { (p: (owner: String, path: DBusObjectPath, adapterID: String)) in
                    p.owner == sender && p.path == root && p.adapterID == adapterID
                }
                // Gone meanwhile: the owner left the bus, or the adapter was removed (app_free).
                guard self.pendingApps.contains(where: isPending) else {
                    return call.reply.fail(Self.appFailed("Failed to create entry in database"))
                }
                self.pendingApps.removeAll(where: isPending)
                guard self.adapters.contains(where: { $0.spec.id == adapterID }) else {
                    return call.reply.fail(Self.appFailed("Failed to create entry in database"))
                }
                switch parsed {
                case .failure(let error):
                    self.count("local_apps_rejected")
                    call.reply.fail(error)
                case .success(var services):
                    guard let a = self.adapters.first(where: { $0.spec.id == adapterID }),
                        self.assignHandles(&services, adapter: a)
                    else {
                        self.count("local_apps_rejected")
                        return call.reply.fail(Self.appFailed("Failed to create entry in database"))
                    }
                    let app = SimLocalApp(owner: sender, path: root, adapterID: adapterID, services: services)
                    self.localApps.append(app)
                    self.count("local_apps_registered")
                    self.writeHandles(app)
                    call.reply.succeed()
                    // The watch is cancelled when the app goes (removeApp, resetState), so it may hold the simulator.
                    app.watch = Task { [self] in
                        await withTaskGroup(of: Void.self) { group in
                            if let changes {
                                group.addTask {
                                    for await m in changes {
                                        self.onLoop(epoch: epoch) { self.appPropertiesChanged(app, m) }
                                    }
                                }
                            }
                            if let removed {
                                group.addTask {
                                    for await m in removed {
                                        self.onLoop(epoch: epoch) { self.appInterfacesRemoved(app, m) }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Reads the application's objects the way client_ready_cb does: services first, then characteristics (each
    /// needs its service), then descriptors (each needs its characteristic); any bad object fails the whole app.
    static func parseApplication(_ objects: [DBusDictEntry], root: DBusObjectPath) -> Result<
        [SimLocalService], DBusError
    > {
        var entries: [(DBusObjectPath, [String: [String: DBusValue]])] = []
        for entry in objects {
            guard let path = entry.key.objectPath, path.isDescendant(ofOrEqualTo: root) else { continue }
            var ifaces: [String: [String: DBusValue]] = [:]
            for i in entry.value.dictionaryEntries ?? [] {
                if let name = i.key.string { ifaces[name] = i.value.stringVariantDictionary ?? [:] }
            }
            entries.append((path, ifaces))
        }
        guard !entries.isEmpty else { return .failure(appFailed("No object received")) }
        // The reply's order is the database order (queue_foreach over the proxies as they arrived).
        let invalid = appFailed("No valid service object found")
        var services: [SimLocalService] = []
        for (path, ifaces) in entries {
            guard let p = ifaces[gattServiceInterface] else { continue }
            // create_service: a duplicate path is rejected; database_add_service needs UUID and Primary.
            guard !services.contains(where: { $0.path == path }) else { return .failure(invalid) }
            guard let uuid = applicationUUID(p["UUID"]), let primary = p["Primary"]?.bool else {
                return .failure(appFailed("Failed to create entry in database"))
            }
            var includes: [DBusObjectPath] = []
            if let inc = p["Includes"] {
                guard let elements = inc.arrayElements, inc.signature.rawValue == "ao" else {
                    return .failure(appFailed("Failed to create entry in database"))
                }
                includes = elements.compactMap(\.objectPath)
            }
            if let h = p["Handle"], h.uint16 == nil { return .failure(appFailed("Failed to create entry in database")) }
            services.append(
                SimLocalService(
                    path: path, uuid: uuid, primary: primary, includes: includes, characteristics: [],
                    handleProperty: p["Handle"]?.uint16))
        }
        for (path, ifaces) in entries {
            guard let p = ifaces[characteristicInterfaceName] else { continue }
            // chrc_create: the Service must be one of this app's services, and every flag must be known.
            guard let service = p["Service"]?.objectPath, let si = services.firstIndex(where: { $0.path == service })
            else { return .failure(invalid) }
            guard let flags = p["Flags"].flatMap(stringList), let perms = characteristicPermissions(flags) else {
                return .failure(invalid)
            }
            guard let uuid = applicationUUID(p["UUID"]) else {
                return .failure(appFailed("Failed to create entry in database"))
            }
            if let h = p["Handle"], h.uint16 == nil { return .failure(appFailed("Failed to create entry in database")) }
            let c = SimLocalCharacteristic(
                path: path, uuid: uuid, flags: flags, permissions: perms,
                hasWriteAcquired: p["WriteAcquired"] != nil, hasNotifyAcquired: p["NotifyAcquired"] != nil)
            c.handleProperty = p["Handle"]?.uint16
            services[si].characteristics.append(c)
        }
        for (path, ifaces) in entries {
            guard let p = ifaces[gattDescriptorInterface] else { continue }
            // desc_create: the Characteristic must belong to one of this app's services.
            guard let chrc = p["Characteristic"]?.objectPath,
                let c = services.flatMap(\.characteristics).first(where: { $0.path == chrc })
            else { return .failure(invalid) }
            guard let flags = p["Flags"].flatMap(stringList), let perms = descriptorPermissions(flags) else {
                return .failure(invalid)
            }
            guard let uuid = applicationUUID(p["UUID"]) else {
                return .failure(appFailed("Failed to create entry in database"))
            }
            if let h = p["Handle"], h.uint16 == nil { return .failure(appFailed("Failed to create entry in database")) }
            c.descriptors.append(
                SimLocalDescriptor(
                    path: path, uuid: uuid, flags: flags, permissions: perms, handleProperty: p["Handle"]?.uint16))
        }
        guard !services.isEmpty else { return .failure(invalid) }
        return .success(services)
    }

    /// gatt_db_insert_service and database_add_chrc: a service goes at its own `Handle` when it has a non-zero one,
    /// else at the database's next free handle; inside it the declaration, includes, then per characteristic its
    /// declaration and value (the value handle is the characteristic's handle), CCC, Extended Properties and
    /// descriptors. False when a service does not fit below 0xffff or overlaps one already there.
    func assignHandles(_ services: inout [SimLocalService], adapter a: SimAdapter) -> Bool {
        var taken: [ClosedRange<Int>] = localApps.filter { $0.adapterID == a.spec.id }.flatMap(\.services).map {
            Int($0.handle)...(Int($0.handle) + $0.attributeCount - 1)
        }
        taken.append(1...0x0014)
        var nextHandle = a.nextHandle
        for i in services.indices {
            let count = services[i].attributeCount
            let own = Int(services[i].handleProperty ?? 0)
            let start = own != 0 ? own : nextHandle
            let range = start...(start + count - 1)
            guard range.upperBound <= 0xffff, !taken.contains(where: { $0.overlaps(range) }) else { return false }
            taken.append(range)
            nextHandle = max(nextHandle, range.upperBound + 1)
            services[i].handle = UInt16(start)
            var next = start + 1 + services[i].includes.count
            for c in services[i].characteristics {
                c.handle = UInt16(next + 1)
                next += 2 + (c.notify || c.indicate ? 1 : 0) + (c.extendedProperties ? 1 : 0)
                for d in c.descriptors.indices {
                    c.descriptors[d].handle = UInt16(next)
                    next += 1
                }
            }
        }
        a.nextHandle = nextHandle
        return true
    }

    /// write_handle: an attribute whose `Handle` property is 0 is told its handle with Properties.Set.
    func writeHandles(_ app: SimLocalApp) {
        func set(_ path: DBusObjectPath, _ interface: String, _ handle: UInt16) {
            callApp(
                app, path, "org.freedesktop.DBus.Properties", "Set",
                [.string(interface), .string("Handle"), .variant(.uint16(handle))]
            ) { _ in }
        }
        for s in app.services {
            if s.handleProperty == 0 { set(s.path, Self.gattServiceInterface, s.handle) }
            for c in s.characteristics {
                if c.handleProperty == 0 { set(c.path, Self.characteristicInterfaceName, c.handle) }
                for d in c.descriptors where d.handleProperty == 0 {
                    set(d.path, Self.gattDescriptorInterface, d.handle)
                }
            }
        }
    }

    static func stringList(_ value: DBusValue) -> [String]? {
        guard let elements = value.arrayElements else { return nil }
        var out: [String] = []
        for e in elements {
            guard case .string(let s) = e else { return nil }
            out.append(s)
        }
        return out
    }

    /// parse_uuid: any UUID text bt_string_to_uuid accepts, except the GAP and GATT services bluetoothd owns.
    static func applicationUUID(_ value: DBusValue?) -> SimUUID? {
        guard case .string(let text)? = value, let uuid = SimUUID(text) else { return nil }
        if uuid.short16 == 0x1800 || uuid.short16 == 0x1801 { return nil }
        return uuid
    }

    /// parse_chrc_flags in BlueZ's src/gatt-database.c; nil for an unknown flag.
    static func characteristicPermissions(_ flags: [String]) -> SimATTPermissions? {
        var p: SimATTPermissions = []
        for flag in flags {
            switch flag {
            case "broadcast", "notify", "indicate", "extended-properties", "writable-auxiliaries", "authorize",
                "encrypt-notify", "encrypt-authenticated-notify", "secure-notify", "encrypt-indicate",
                "encrypt-authenticated-indicate", "secure-indicate":
                break
            case "read": p.insert(.read)
            case "write-without-response", "write", "authenticated-signed-writes", "reliable-write": p.insert(.write)
            case "encrypt-read": p.formUnion([.read, .readEncrypt])
            case "encrypt-write": p.formUnion([.write, .writeEncrypt])
            case "encrypt-authenticated-read": p.formUnion([.read, .readAuthenticated])
            case "encrypt-authenticated-write": p.formUnion([.write, .writeAuthenticated])
            case "secure-read": p.formUnion([.read, .readSecure])
            case "secure-write": p.formUnion([.write, .writeSecure])
            default: return nil
            }
        }
        return p
    }

    /// parse_desc_flags in BlueZ's src/gatt-database.c; nil for an unknown flag.
    static func descriptorPermissions(_ flags: [String]) -> SimATTPermissions? {
        var p: SimATTPermissions = []
        for flag in flags {
            switch flag {
            case "read": p.insert(.read)
            case "write": p.insert(.write)
            case "encrypt-read": p.formUnion([.read, .readEncrypt])
            case "encrypt-write": p.formUnion([.write, .writeEncrypt])
            case "encrypt-authenticated-read": p.formUnion([.read, .readAuthenticated])
            case "encrypt-authenticated-write": p.formUnion([.write, .writeAuthenticated])
            case "secure-read": p.formUnion([.read, .readSecure])
            case "secure-write": p.formUnion([.write, .writeSecure])
            case "authorize": break
            default: return nil
            }
        }
        return p
    }

    func unregisterApplication(_ call: DBusMethodCall) {
        guard let root = call.arguments.first?.objectPath else { return call.reply.fail(Self.invalidArguments) }
        guard
            let app = localApps.first(where: {
                $0.owner == call.sender && $0.path == root && $0.adapterID == adapterID(call.path)
            })
        else { return call.reply.fail(Self.doesNotExist) }
        removeApp(app)
        call.reply.succeed()
    }

    func adapterID(_ path: DBusObjectPath) -> String? { adapters.first { $0.path == path }?.spec.id }

    /// Drops an application (app_free): its sockets close, its subscriptions are forgotten.
    func removeApp(_ app: SimLocalApp) {
        app.watch?.cancel()
        app.watch = nil
        for c in app.characteristics {
            c.notifySocket?.close()
            c.notifySocket = nil
            c.writeSocket?.close()
            c.writeSocket = nil
            c.ccc = [:]
            c.notifyCount = 0
        }
        localApps.removeAll { $0 === app }
        count("local_apps_removed")
    }

    /// bluetoothd's gatt database follows the app's InterfacesRemoved: a removed service leaves the database
    /// (proxy_removed_cb); other objects removed on their own are only noticed when the service goes.
    func appInterfacesRemoved(_ app: SimLocalApp, _ m: DBusMessage) {
        guard localApps.contains(where: { $0 === app }), m.body.count == 2, let path = m.body[0].objectPath,
            let names = m.body[1].arrayElements?.compactMap(\.string), names.contains(Self.gattServiceInterface)
        else { return }
        for s in app.services where s.path == path {
            for c in s.characteristics {
                c.notifySocket?.close()
                c.writeSocket?.close()
            }
        }
        app.services.removeAll { $0.path == path }
        count("local_services_removed")
    }

    /// property_changed_cb: a new `Value` of a characteristic with a CCC is sent to every subscribed central.
    /// An invalidated `Value` is sent as an empty notification (the callback gets no value then); a `Value` that
    /// is not a byte array is ignored ("Malformed").
    func appPropertiesChanged(_ app: SimLocalApp, _ m: DBusMessage) {
        guard localApps.contains(where: { $0 === app }), m.body.count >= 2,
            m.body[0].string == Self.characteristicInterfaceName, let path = m.path,
            let changed = m.body[1].stringVariantDictionary,
            let c = app.characteristics.first(where: { $0.path == path }), c.notify || c.indicate
        else { return }
        if let v = changed["Value"] {
            guard let value = v.bytes else { return }
            deliver(app, c, value, viaSocket: nil)
        } else if m.body.count == 3, m.body[2].arrayElements?.contains(where: { $0.string == "Value" }) == true {
            deliver(app, c, [], viaSocket: nil)
        }
    }

    /// send_notification_to_devices: each connected central whose CCC is enabled gets the value (truncated to
    /// 512 bytes, then to what one PDU carries at the MTU); an indication is confirmed by the central, and the
    /// confirmation reaches the app as `Confirm()` (conf_cb) or a byte on the notify socket (sock_io_conf).
    func deliver(_ app: SimLocalApp, _ c: SimLocalCharacteristic, _ value: [UInt8], viaSocket socket: SimSocket?) {
        let limit = min(512, Int(scenario.mtu) - 3)
        let payload = Array(value.prefix(limit))
        for central in centrals where central.connected && central.adapterID == app.adapterID {
            guard let ccc = c.ccc[central.address], ccc & 3 != 0 else { continue }
            var list = central.notifications[c.path, default: []]
            if list.count >= Self.notificationBufferLimit {
                list.removeFirst()
                count("central_notifications_dropped")
            }
            list.append(payload)
            central.notifications[c.path] = list
            count("central_notifications")
            if ccc & 1 == 0 {
                count("central_indications")
                if let socket {
                    _ = sendDatagram(socket.fd, [1])
                } else {
                    callApp(app, c.path, Self.characteristicInterfaceName, "Confirm", []) { _ in }
                    count("local_confirms")
                }
            }
        }
    }

    static let notificationBufferLimit = 100_000

    // MARK: calls into the application

    /// Calls a method of the application, and hands the reply (or the error, a timeout included) back on the
    /// loop; nothing happens after a restart.
    func callApp(
        _ app: SimLocalApp, _ path: DBusObjectPath, _ interface: String, _ method: String, _ args: [DBusValue],
        _ done: @escaping @Sendable (Result<DBusMessage, DBusError>) -> Void
    ) {
        guard let connection else { return done(.failure(DBusError(name: DBusError.disconnected, message: ""))) }
        let epoch = self.epoch
        let timeout = scenario.localGATTTimeout
        let message = DBusMessage.methodCall(
            destination: app.owner, path: path, interface: interface, method: method, body: args)
        count("local_app_calls")
        Task { [weak self] in
            let result: Result<DBusMessage, DBusError>
            do throws(DBusError) {
                result = .success(try await connection.call(message, timeout: .milliseconds(Int(timeout * 1000))))
            } catch {
                result = .failure(error)
            }
            self?.onLoop(epoch: epoch) { done(result) }
        }
    }

    /// append_options in BlueZ's src/gatt-database.c: device, offset (only when not zero), link, mtu.
    func appOptions(_ central: SimCentral, offset: UInt16 = 0) -> DBusValue {
        var entries: [(String, DBusValue)] = [("device", .objectPath(central.devicePath))]
        if offset != 0 { entries.append(("offset", .uint16(offset))) }
        entries.append(("link", .string("LE")))
        entries.append(("mtu", .uint16(scenario.mtu)))
        return .stringVariantDictionary(entries)
    }

    // MARK: control: centrals

    static func controlFailure(_ kind: String, _ text: String) -> DBusError {
        DBusError(name: "io.blebridge.Simulator1.Error." + kind, message: text)
    }

    func controlAdapter(_ id: String) -> SimAdapter? {
        id.isEmpty ? adapters.first : adapters.first { $0.spec.id == id || $0.path.rawValue == id }
    }

    /// `CentralConnect(s adapter, s central) -> o`: the central's Device1 appears (or is reused) Connected.
    func centralConnect(_ call: DBusMethodCall) {
        guard call.arguments.count == 2, let id = call.arguments[0].string, let text = call.arguments[1].string else {
            return call.reply.fail(Self.controlFailure("InvalidArguments", "expected (adapter, central address)"))
        }
        guard let a = controlAdapter(id) else {
            return call.reply.fail(Self.controlFailure("DoesNotExist", "No adapter \"\(id)\""))
        }
        guard let address = ScenarioReader.normaliseMAC(text) else {
            return call.reply.fail(Self.controlFailure("InvalidArguments", "\"\(text)\" is not a Bluetooth address"))
        }
        guard a.powered else { return call.reply.fail(Self.controlFailure("NotReady", "adapter \(a.spec.id) is off")) }
        if let existing = centrals.first(where: { $0.address == address }) {
            guard !existing.connected else {
                return call.reply.fail(Self.controlFailure("AlreadyConnected", "central \(address) is connected"))
            }
            guard existing.adapterID == a.spec.id else {
                return call.reply.fail(
                    Self.controlFailure("InvalidArguments", "central \(address) belongs to \(existing.adapterID)"))
            }
            existing.connected = true
            server?.setProperty(at: existing.devicePath, interface: "org.bluez.Device1", "Connected", .boolean(true))
            count("central_connects")
            return call.reply.succeed([.objectPath(existing.devicePath)])
        }
        let path = a.path.appending(deviceComponent(address))
        guard devices.first(where: { $0.path == path && $0.exported }) == nil else {
            return call.reply.fail(
                Self.controlFailure("InvalidArguments", "\(address) is a simulated peripheral on \(a.spec.id)"))
        }
        let central = SimCentral(address: address, adapterID: a.spec.id, devicePath: path)
        centrals.append(central)
        let props: [String: DBusValue] = [
            "Address": .string(address), "AddressType": .string("public"),
            "Alias": .string(address.map { $0 == ":" ? "-" : $0 }.map(String.init).joined()),
            "Paired": .boolean(false), "Bonded": .boolean(false), "Trusted": .boolean(false),
            "Blocked": .boolean(false), "LegacyPairing": .boolean(false), "CablePairing": .boolean(false),
            "Connected": .boolean(true), "UUIDs": .stringArray([]), "Adapter": .objectPath(a.path),
            "ServicesResolved": .boolean(false),
        ]
        server?.addInterfaces(at: path, [(deviceInterface, props)])
        count("central_connects")
        call.reply.succeed([.objectPath(path)])
    }

    func controlCentral(_ call: DBusMethodCall) -> SimCentral? {
        guard let text = call.arguments.first?.string else {
            call.reply.fail(Self.controlFailure("InvalidArguments", "expected a central address"))
            return nil
        }
        guard let c = centrals.first(where: { $0.address == text.uppercased() }) else {
            call.reply.fail(Self.controlFailure("DoesNotExist", "No central \(text) (call CentralConnect first)"))
            return nil
        }
        guard c.connected else {
            call.reply.fail(Self.controlFailure("NotConnected", "central \(c.address) is not connected"))
            return nil
        }
        return c
    }

    /// The first characteristic or descriptor with `uuid` in the adapter's applications, in registration order.
    enum LocalAttribute {
        case characteristic(SimLocalApp, SimLocalCharacteristic)
        case descriptor(SimLocalApp, SimLocalCharacteristic, SimLocalDescriptor)
    }

    func localAttribute(_ central: SimCentral, _ call: DBusMethodCall) -> LocalAttribute? {
        // An object path (from GetLocalGatt) picks one attribute when several share a UUID.
        if call.arguments.count > 1, let text = call.arguments[1].string, text.hasPrefix("/") {
            for app in localApps where app.adapterID == central.adapterID {
                for c in app.characteristics {
                    if c.path.rawValue == text { return .characteristic(app, c) }
                    if let d = c.descriptors.first(where: { $0.path.rawValue == text }) {
                        return .descriptor(app, c, d)
                    }
                }
            }
            call.reply.fail(
                Self.controlFailure("DoesNotExist", "No local characteristic or descriptor at \(text)"))
            return nil
        }
        guard call.arguments.count > 1, let text = call.arguments[1].string, let uuid = SimUUID(text) else {
            call.reply.fail(Self.controlFailure("InvalidArguments", "expected a UUID or an object path"))
            return nil
        }
        for app in localApps where app.adapterID == central.adapterID {
            for c in app.characteristics {
                if c.uuid == uuid { return .characteristic(app, c) }
                if let d = c.descriptors.first(where: { $0.uuid == uuid }) { return .descriptor(app, c, d) }
            }
        }
        call.reply.fail(
            Self.controlFailure("DoesNotExist", "No local characteristic or descriptor \(uuid) on \(central.adapterID)")
        )
        return nil
    }

    /// `CentralRead(s central, s uuid, u offset) -> ay`: a Read (offset 0) or Read Blob Request.
    func centralRead(_ call: DBusMethodCall) {
        guard let central = controlCentral(call), let attribute = localAttribute(central, call) else { return }
        guard call.arguments.count == 3, let offset = call.arguments[2].uint32, offset <= 0xffff else {
            return call.reply.fail(Self.controlFailure("InvalidArguments", "offset must be 0...65535"))
        }
        let (app, path, interface, permissions): (SimLocalApp, DBusObjectPath, String, SimATTPermissions)
        switch attribute {
        case .characteristic(let a, let c):
            (app, path, interface, permissions) = (a, c.path, Self.characteristicInterfaceName, c.permissions)
        case .descriptor(let a, _, let d):
            (app, path, interface, permissions) = (a, d.path, Self.gattDescriptorInterface, d.permissions)
        }
        count("local_reads")
        if let code = permissions.check(write: false) { return call.reply.fail(SimATT.error(code)) }
        let mtu = Int(scenario.mtu)
        callApp(app, path, interface, "ReadValue", [appOptions(central, offset: UInt16(offset))]) { result in
            switch result {
            case .failure(let error):
                call.reply.fail(Self.attError(error, permissionError: SimATT.readNotPermitted))
            case .success(let reply):
                // read_reply_cb: anything but an array is Request Not Supported; the response carries MTU-1 bytes.
                guard reply.body.count >= 1, reply.body[0].signature.rawValue == "ay", let value = reply.body[0].bytes
                else {
                    return call.reply.fail(SimATT.error(SimATT.requestNotSupported, "ReadValue returned no byte array"))
                }
                call.reply.succeed([.bytes(Array(value.prefix(min(512, mtu - 1))))])
            }
        }
    }

    /// The ATT code for an application's error reply; a call that timed out is Unlikely Error.
    static func attCode(_ error: DBusError, permissionError: UInt8) -> UInt8 {
        if error.name == DBusError.noReply || error.name == DBusError.timedOut { return SimATT.unlikely }
        return SimATT.code(forError: error.name, message: error.message, permissionError: permissionError)
    }

    static func attError(_ error: DBusError, permissionError: UInt8) -> DBusError {
        SimATT.error(attCode(error, permissionError: permissionError), "\(error.name) \(error.message)")
    }

    /// `CentralWrite(s central, s uuid, ay value, s type)`: a Write Request (`request`), Write Command (`command`)
    /// or a Prepare+Execute Write (`reliable`).
    func centralWrite(_ call: DBusMethodCall) {
        guard let central = controlCentral(call), let attribute = localAttribute(central, call) else { return }
        guard call.arguments.count == 4, let value = call.arguments[2].bytes, let type = call.arguments[3].string,
            ["request", "command", "reliable"].contains(type)
        else {
            return call.reply.fail(
                Self.controlFailure("InvalidArguments", "expected (central, uuid, value, request|command|reliable)"))
        }
        count("local_writes")
        let command = type == "command"
        // A Write Command has no response: the central never learns the outcome, the simulator counts it.
        @Sendable func answer(_ code: UInt8?, _ detail: String) {
            guard let code else { return call.reply.succeed() }
            if command {
                self.count("local_write_commands_failed")
                self.lastCommandError = SimATT.text(code, detail)
                return call.reply.succeed()
            }
            call.reply.fail(SimATT.error(code, detail))
        }
        guard value.count <= 512 else { return answer(SimATT.invalidValueLength, "longer than 512 bytes") }
        switch attribute {
        case .descriptor(let app, _, let d):
            if let code = d.permissions.check(write: true) { return answer(code, "") }
            callApp(app, d.path, Self.gattDescriptorInterface, "WriteValue", [.bytes(value), appOptions(central)]) {
                result in
                if case .failure(let error) = result {
                    return answer(
                        Self.attCode(error, permissionError: SimATT.writeNotPermitted), "\(error.name) \(error.message)"
                    )
                }
                answer(nil, "")
            }
        case .characteristic(let app, let c):
            if type == "reliable", !c.reliableWrite { return answer(SimATT.requestNotSupported, "no reliable-write") }
            if let code = c.permissions.check(write: true) { return answer(code, "") }
            writeCharacteristic(app, c, central, value, answer)
        }
    }

    /// chrc_write_cb: through the AcquireWrite socket when there is one (or the app exposes WriteAcquired),
    /// else WriteValue; with `write-without-response` among the flags bluetoothd does not wait for WriteValue's
    /// reply and acknowledges at once.
    func writeCharacteristic(
        _ app: SimLocalApp, _ c: SimLocalCharacteristic, _ central: SimCentral, _ value: [UInt8],
        _ answer: @escaping @Sendable (UInt8?, String) -> Void
    ) {
        if let socket = c.writeSocket {
            guard sendDatagram(socket.fd, value) else { return answer(SimATT.unlikely, "write socket") }
            count("local_socket_writes")
            return answer(nil, "")
        }
        if c.hasWriteAcquired {
            if c.acquiringWrite != nil {
                c.acquiringWrite?.append(value)
                return answer(nil, "")
            }
            c.acquiringWrite = [value]
            callApp(app, c.path, Self.characteristicInterfaceName, "AcquireWrite", [appOptions(central)]) {
                [weak self] result in
                guard let self else { return }
                let queued = c.acquiringWrite ?? []
                c.acquiringWrite = nil
                switch result {
                case .success(let reply):
                    if reply.body.count == 2, let fd = reply.body[0].fileDescriptor?.take(), fd >= 0 {
                        let socket = self.appSocket(app, c, fd, notify: false)
                        c.writeSocket = socket
                        for v in queued { _ = sendDatagram(fd, v) }
                        self.count("local_write_acquired")
                        return answer(nil, "")
                    }
                case .failure(let error):
                    // acquire_write_reply: a mapped error other than Unlikely answers the write; else fall back.
                    let code = SimATT.code(
                        forError: error.name, message: error.message, permissionError: SimATT.writeNotPermitted)
                    if code != SimATT.unlikely { return answer(code, "\(error.name) \(error.message)") }
                }
                for v in queued { self.sendWriteValue(app, c, central, v) { _, _ in } }
                answer(nil, "")
            }
            return
        }
        sendWriteValue(app, c, central, value, answer)
    }

    func sendWriteValue(
        _ app: SimLocalApp, _ c: SimLocalCharacteristic, _ central: SimCentral, _ value: [UInt8],
        _ answer: @escaping @Sendable (UInt8?, String) -> Void
    ) {
        let ignoreReply = c.writeWithoutResponse
        callApp(app, c.path, Self.characteristicInterfaceName, "WriteValue", [.bytes(value), appOptions(central)]) {
            result in
            guard !ignoreReply else { return }
            switch result {
            case .failure(let error):
                let code = Self.attCode(error, permissionError: SimATT.writeNotPermitted)
                answer(code, "\(error.name) \(error.message)")
            case .success(let reply):
                answer(
                    reply.body.isEmpty ? nil : SimATT.requestNotSupported,
                    reply.body.isEmpty ? "" : "WriteValue returned values")
            }
        }
        if ignoreReply { answer(nil, "") }
    }

    /// A socket from AcquireWrite/AcquireNotify; datagrams on a notify socket are notifications (sock_io_read),
    /// hang-up drops it (sock_hup).
    func appSocket(_ app: SimLocalApp, _ c: SimLocalCharacteristic, _ fd: Int32, notify: Bool) -> SimSocket {
        let socket = SimSocket(fd: fd)
        let source = DispatchSource.makeReadSource(fileDescriptor: fd, queue: queue)
        let epoch = self.epoch
        source.setEventHandler { [weak self, weak socket, source] in
            let (datagrams, eof) = readAllDatagrams(fd)
            if eof { source.cancel() }
            guard let self, let socket else { return }
            let (received, closed) = (datagrams, eof)
            self.onLoop(epoch: epoch) {
                if notify, c.notifySocket === socket {
                    for v in received { self.deliver(app, c, v, viaSocket: socket) }
                }
                if closed {
                    if c.notifySocket === socket { c.notifySocket = nil }
                    if c.writeSocket === socket { c.writeSocket = nil }
                }
            }
        }
        source.setCancelHandler { _ = closeFD(fd) }
        socket.source = source
        source.resume()
        return socket
    }

    /// `CentralSubscribe(s central, s uuid, b enable)`: the central writes the characteristic's CCC
    /// (gatt_ccc_write_cb, then ccc_write_cb in BlueZ's src/gatt-database.c).
    func centralSubscribe(_ call: DBusMethodCall) {
        guard let central = controlCentral(call), let attribute = localAttribute(central, call) else { return }
        guard call.arguments.count == 3, let enable = call.arguments[2].bool else {
            return call.reply.fail(Self.controlFailure("InvalidArguments", "expected (central, uuid, enable)"))
        }
        guard case .characteristic(let app, let c) = attribute else {
            return call.reply.fail(Self.controlFailure("InvalidArguments", "\(call.arguments[1]) is a descriptor"))
        }
        guard c.notify || c.indicate else {
            // No CCC descriptor exists; a write of either value is what ccc_write_cb refuses.
            return call.reply.fail(SimATT.error(SimATT.cccImproperlyConfigured, "no notify or indicate flag"))
        }
        let value: UInt16 = enable ? (c.notify ? 1 : 2) : 0
        // "If value is identical, then just succeed."
        guard (c.ccc[central.address] ?? 0) != value else { return call.reply.succeed() }
        if value == 0 {
            c.ccc[central.address] = nil
            cccDisabled(app, c)
        } else {
            c.ccc[central.address] = value
            cccEnabled(app, c, central)
        }
        count(enable ? "central_subscribes" : "central_unsubscribes")
        call.reply.succeed()
    }

    func cccEnabled(_ app: SimLocalApp, _ c: SimLocalCharacteristic, _ central: SimCentral) {
        if c.notifySocket != nil {
            c.notifyCount += 1
            return
        }
        c.notifyCount += 1
        guard c.notifyCount == 1 else { return }
        if c.hasNotifyAcquired {
            callApp(app, c.path, Self.characteristicInterfaceName, "AcquireNotify", [appOptions(central)]) {
                [weak self] result in
                guard let self else { return }
                switch result {
                case .success(let reply):
                    if reply.body.count == 2, let fd = reply.body[0].fileDescriptor?.take(), fd >= 0 {
                        guard c.notifyCount > 0 else {
                            _ = closeFD(fd)
                            return
                        }
                        c.notifySocket = self.appSocket(app, c, fd, notify: true)
                        self.count("local_notify_acquired")
                        return
                    }
                case .failure(let error):
                    // acquire_notify_reply: NoReply and Failed end it there; other errors retry with StartNotify.
                    if error.name == DBusError.noReply || error.name == "org.bluez.Error.Failed" { return }
                }
                self.callApp(app, c.path, Self.characteristicInterfaceName, "StartNotify", []) { _ in }
                self.count("local_start_notify")
            }
            return
        }
        callApp(app, c.path, Self.characteristicInterfaceName, "StartNotify", []) { _ in }
        count("local_start_notify")
    }

    func cccDisabled(_ app: SimLocalApp, _ c: SimLocalCharacteristic) {
        guard c.notifyCount > 0 else { return }
        c.notifyCount -= 1
        guard c.notifyCount == 0 else { return }
        if let socket = c.notifySocket {
            socket.close()
            c.notifySocket = nil
            count("local_notify_released")
            return
        }
        callApp(app, c.path, Self.characteristicInterfaceName, "StopNotify", []) { _ in }
        count("local_stop_notify")
    }

    /// `CentralNotifications(s central, s uuid) -> aay`: what arrived since the last call, oldest first.
    func centralNotifications(_ call: DBusMethodCall) {
        guard let text = call.arguments.first?.string,
            let central = centrals.first(where: { $0.address == text.uppercased() })
        else {
            return call.reply.fail(
                Self.controlFailure("DoesNotExist", "No central \(call.arguments.first?.string ?? "")"))
        }
        guard call.arguments.count == 2, let utext = call.arguments[1].string, let uuid = SimUUID(utext) else {
            return call.reply.fail(Self.controlFailure("InvalidArguments", "expected (central, uuid)"))
        }
        guard
            let c = localApps.filter({ $0.adapterID == central.adapterID }).flatMap(\.characteristics).first(where: {
                $0.uuid == uuid
            })
        else {
            return call.reply.fail(Self.controlFailure("DoesNotExist", "No local characteristic \(uuid)"))
        }
        let values = central.notifications[c.path] ?? []
        central.notifications[c.path] = nil
        call.reply.succeed([.array("ay", values.map { .bytes($0) })])
    }

    /// `CentralDisconnect(s central)`: the link drops; its CCCs are disabled as att_disconnected does for an
    /// unbonded device (StopNotify or the notify socket closed when it was the last), Connected goes false.
    func centralDisconnect(_ call: DBusMethodCall) {
        guard let central = controlCentral(call) else { return }
        dropCentral(central, reason: Self.reasons["remote"] ?? ("", ""))
        call.reply.succeed()
    }

    /// Device1.Connect on a central's object: it is already connected, or it is not advertising to be reached.
    func centralConnectCall(_ central: SimCentral, _ call: DBusMethodCall) {
        guard central.connected else {
            return call.reply.fail(Self.bluezError("Failed", "le-connection-abort-by-local"))
        }
        call.reply.succeed()
    }

    /// Adapter1.RemoveDevice of a central: the link drops (local) and its object goes.
    func removeCentral(_ central: SimCentral, _ call: DBusMethodCall) {
        if central.connected { dropCentral(central, reason: Self.reasons["local"] ?? ("", "")) }
        server?.removeObject(at: central.devicePath)
        centrals.removeAll { $0 === central }
        call.reply.succeed()
    }

    /// The link to a central drops: its CCCs are disabled, then `Disconnected(reason, message)` and
    /// `Connected=false` as for a peripheral's link.
    func dropCentral(_ central: SimCentral, reason: (String, String)) {
        central.connected = false
        for app in localApps where app.adapterID == central.adapterID {
            for c in app.characteristics where c.ccc[central.address] != nil {
                c.ccc[central.address] = nil
                cccDisabled(app, c)
            }
        }
        server?.emitSignal(
            path: central.devicePath, interface: "org.bluez.Device1", name: "Disconnected",
            arguments: [.string(reason.0), .string(reason.1)])
        server?.setProperty(at: central.devicePath, interface: "org.bluez.Device1", "Connected", .boolean(false))
        count("central_disconnects")
    }

    /// Everything of one client goes when its unique name leaves the bus (client_disconnect_cb in
    /// src/gatt-database.c and src/advertising.c; no Release for advertisements then).
    func localClientLeft(_ name: String) {
        for app in localApps where app.owner == name { removeApp(app) }
        pendingApps.removeAll { $0.owner == name }
        pendingAds.removeAll { $0.owner == name }
        for ad in advertisements where ad.owner == name { removeAdvertisement(ad, release: false) }
    }

    /// The adapter goes (btd_gatt_database_destroy, btd_adv_manager_destroy): apps dropped, advertisements released.
    func localAdapterRemoved(_ id: String) {
        for app in localApps where app.adapterID == id { removeApp(app) }
        pendingApps.removeAll { $0.adapterID == id }
        pendingAds.removeAll { $0.adapterID == id }
        for ad in advertisements where ad.adapterID == id { removeAdvertisement(ad, release: true) }
        for central in centrals where central.adapterID == id {
            if central.connected { dropCentral(central, reason: Self.reasons["local"] ?? ("", "")) }
            server?.removeObject(at: central.devicePath)
        }
        centrals.removeAll { $0.adapterID == id }
    }

    /// Powering off drops the links of the centrals (registrations stay, as in bluetoothd).
    func localPoweredOff(_ id: String) {
        for central in centrals where central.adapterID == id && central.connected {
            dropCentral(central, reason: Self.reasons["local"] ?? ("", ""))
        }
    }

    func getLocalGatt(_ call: DBusMethodCall) {
        guard let id = call.arguments.first?.string, let a = controlAdapter(id) else {
            return call.reply.fail(
                Self.controlFailure("DoesNotExist", "No adapter \"\(call.arguments.first?.string ?? "")\""))
        }
        var out = SimJSON()
        out.array(localApps.filter { $0.adapterID == a.spec.id }) { o, app in
            o.object {
                $0.field("owner", app.owner)
                $0.field("path", app.path.rawValue)
                $0.key("services")
                $0.array(app.services) { o, s in
                    o.object {
                        $0.field("path", s.path.rawValue)
                        $0.field("handle", Int(s.handle))
                        $0.field("uuid", s.uuid.string)
                        $0.field("primary", s.primary)
                        $0.key("includes")
                        $0.strings(s.includes.map(\.rawValue))
                        $0.key("characteristics")
                        $0.array(s.characteristics) { o, c in
                            o.object {
                                $0.field("path", c.path.rawValue)
                                $0.field("handle", Int(c.handle))
                                $0.field("uuid", c.uuid.string)
                                $0.key("flags")
                                $0.strings(c.flags)
                                $0.key("descriptors")
                                $0.array(c.descriptors) { o, d in
                                    o.object {
                                        $0.field("path", d.path.rawValue)
                                        $0.field("handle", Int(d.handle))
                                        $0.field("uuid", d.uuid.string)
                                        $0.key("flags")
                                        $0.strings(d.flags)
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        call.reply.succeed([.string(out.text)])
    }
}

/// A small JSON writer for the control interface's answers.
struct SimJSON {
    private(set) var text = ""
    private var needsComma = false

    private mutating func separator() {
        if needsComma { text += "," }
        needsComma = true
    }

    mutating func key(_ k: String) {
        separator()
        text += Self.quote(k) + ":"
        needsComma = false
    }

    mutating func field(_ k: String, _ v: String?) {
        key(k)
        value(v)
    }
    mutating func field(_ k: String, _ v: Bool?) {
        key(k)
        separator()
        text += v.map { $0 ? "true" : "false" } ?? "null"
    }
    mutating func field(_ k: String, _ v: Int?) {
        key(k)
        separator()
        text += v.map(String.init) ?? "null"
    }

    mutating func value(_ v: String?) {
        separator()
        text += v.map(Self.quote) ?? "null"
    }

    mutating func strings(_ list: [String]) {
        separator()
        text += "[" + list.map(Self.quote).joined(separator: ",") + "]"
    }

    mutating func object(_ body: (inout SimJSON) -> Void) {
        separator()
        text += "{"
        needsComma = false
        body(&self)
        text += "}"
        needsComma = true
    }

    mutating func array<T>(_ items: [T], _ body: (inout SimJSON, T) -> Void) {
        separator()
        text += "["
        needsComma = false
        for item in items { body(&self, item) }
        text += "]"
        needsComma = true
    }

    static func quote(_ s: String) -> String {
        var out = "\""
        for u in s.unicodeScalars {
            switch u {
            case "\"": out += "\\\""
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case "\r": out += "\\r"
            case "\t": out += "\\t"
            default:
                if u.value < 0x20 {
                    let h = String(u.value, radix: 16)
                    out += "\\u" + String(repeating: "0", count: 4 - h.count) + h
                } else {
                    out.unicodeScalars.append(u)
                }
            }
        }
        return out + "\""
    }
}
