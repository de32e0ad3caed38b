// Discovery: per-sender sessions and filters, the advertising loop, property diffs, temporary-device expiry and
// AdvertisementMonitor (passive scanning).
import DBus

extension BlueZSimulator {
    func startDiscovery(_ call: DBusMethodCall) {
        guard let a = adapters.first(where: { $0.path == call.path }) else { return call.reply.fail(Self.doesNotExist) }
        guard a.powered else { return call.reply.fail(Self.notReady) }
        guard !a.sessions.contains(call.sender) else {
            return call.reply.fail(Self.bluezError("InProgress", "Operation already in progress"))
        }
        let wasScanning = isScanning(a)
        a.sessions.insert(call.sender)
        count("discovery_starts")
        if a.sessions.count == 1 {
            server?.setProperty(at: a.path, interface: "org.bluez.Adapter1", "Discovering", .boolean(true))
        }
        call.reply.succeed()
        if !wasScanning { startAdvertising(a) }
    }

    func stopDiscovery(_ call: DBusMethodCall) {
        guard let a = adapters.first(where: { $0.path == call.path }) else { return call.reply.fail(Self.doesNotExist) }
        guard a.powered else { return call.reply.fail(Self.notReady) }
        guard a.sessions.contains(call.sender) else {
            return call.reply.fail(Self.bluezError("Failed", "No discovery started"))
        }
        endSession(a, call.sender)
        call.reply.succeed()
    }

    /// Drops one discovery session; the last one stops discovery (Discovering false, RSSI/TxPower invalidated,
    /// non-connectable temporary devices removed).
    func endSession(_ a: SimAdapter, _ sender: String) {
        guard a.sessions.remove(sender) != nil, a.sessions.isEmpty else { return }
        server?.setProperty(at: a.path, interface: "org.bluez.Adapter1", "Discovering", .boolean(false))
        for d in devices where d.adapterID == a.spec.id && d.exported && d.seenInDiscovery {
            d.seenInDiscovery = false
            if d.temporary, !d.spec.connectable, !d.isConnected {
                unexportDevice(d)
                continue
            }
            var invalid: [String] = []
            if d.adv.rssi != nil { invalid.append("RSSI") }
            if d.adv.txPower != nil { invalid.append("TxPower") }
            d.adv.rssi = nil
            d.adv.txPower = nil
            for name in invalid { server?.invalidateProperty(at: d.path, interface: "org.bluez.Device1", name) }
        }
    }

    func setDiscoveryFilter(_ call: DBusMethodCall) {
        guard let a = adapters.first(where: { $0.path == call.path }) else { return call.reply.fail(Self.doesNotExist) }
        guard a.powered else { return call.reply.fail(Self.notReady) }
        guard let entries = call.arguments.first?.dictionaryEntries else {
            return call.reply.fail(Self.invalidArguments)
        }
        if entries.isEmpty {
            a.filters[call.sender] = nil
            return call.reply.succeed()
        }
        var f = SimDiscoveryFilter()
        for entry in entries {
            guard let key = entry.key.string, SimDiscoveryFilter.knownKeys.contains(key) else {
                return call.reply.fail(Self.invalidArguments)
            }
            let v = entry.value
            switch key {
            case "UUIDs":
                guard let items = v.arrayElements else { return call.reply.fail(Self.invalidArguments) }
                var uuids: [SimUUID] = []
                for item in items {
                    guard let s = item.string, let u = SimUUID(s) else { return call.reply.fail(Self.invalidArguments) }
                    uuids.append(u)
                }
                f.uuids = uuids
            case "RSSI":
                guard let r = v.int16 else { return call.reply.fail(Self.invalidArguments) }
                f.rssi = Int(r)
            case "Pathloss":
                guard let p = v.uint16 else { return call.reply.fail(Self.invalidArguments) }
                f.pathloss = Int(p)
            case "Transport":
                guard let t = v.string, ["auto", "bredr", "le"].contains(t) else {
                    return call.reply.fail(Self.invalidArguments)
                }
                f.transport = t
            case "DuplicateData":
                guard let b = v.bool else { return call.reply.fail(Self.invalidArguments) }
                f.duplicateData = b
            case "Discoverable":
                guard let b = v.bool else { return call.reply.fail(Self.invalidArguments) }
                f.discoverable = b
            case "Pattern":
                guard let s = v.string else { return call.reply.fail(Self.invalidArguments) }
                f.pattern = s
            default:
                guard v.bool != nil else { return call.reply.fail(Self.invalidArguments) }
            }
        }
        if f.rssi != nil, f.pathloss != nil { return call.reply.fail(Self.invalidArguments) }
        a.filters[call.sender] = f
        call.reply.succeed()
    }

    func removeDeviceCall(_ call: DBusMethodCall) {
        guard let a = adapters.first(where: { $0.path == call.path }) else { return call.reply.fail(Self.doesNotExist) }
        guard let path = call.arguments.first?.objectPath else { return call.reply.fail(Self.invalidArguments) }
        guard a.powered else { return call.reply.fail(Self.notReady) }
        if let central = centrals.first(where: { $0.devicePath == path && $0.adapterID == a.spec.id }) {
            return removeCentral(central, call)
        }
        guard let d = device(at: path), d.exported, d.adapterID == a.spec.id else {
            return call.reply.fail(Self.doesNotExist)
        }
        if d.isConnected || { if case .connecting = d.link { return true } else { return false } }() {
            disconnect(d, reason: ("org.bluez.Reason.Local", "Connection terminated by local host")) { [weak self] in
                self?.unexportDevice(d)
                call.reply.succeed()
            }
        } else {
            unexportDevice(d)
            call.reply.succeed()
        }
    }

    // MARK: advertising

    func isScanning(_ a: SimAdapter) -> Bool { a.discovering || monitors.contains { _ in true } }

    func startAdvertising(_ a: SimAdapter) {
        for d in devices where d.adapterID == a.spec.id { scheduleAdvertisement(d, first: true) }
    }

    func scheduleAdvertisement(_ d: SimDevice, first: Bool = false) {
        d.advertisementGeneration += 1
        let generation = d.advertisementGeneration
        // As a radio hears independent advertisers: the first advertisement at a random point of the device's
        // interval after scanning starts (devices are switched on at unrelated times), and each advertising event
        // after the interval plus advDelay, a pseudo-random 0-10 ms that every advertiser adds so that no two stay in
        // step (Bluetooth Core Specification, Vol 6, Part B, 4.4.2.2.1). Without it, devices that started together
        // would advertise in one burst each interval, forever, which no receiver sees.
        let interval = d.spec.advertisingInterval
        let delay =
            first
            ? Double(d.random.next() % UInt64(max(1, interval * 1000))) / 1000 + 0.005
            : interval + Double(d.random.next() % 10_001) / 1_000_000
        after(delay) { [weak self] in
            guard let self, d.advertisementGeneration == generation else { return }
            self.advertise(d)
        }
    }

    /// One advertisement from `d` reaches the adapter.
    func advertise(_ d: SimDevice) {
        guard let a = adapter(of: d), devices.contains(where: { $0 === d }), isScanning(a), a.powered else { return }
        defer { scheduleAdvertisement(d) }
        guard d.spec.advertising, !d.isConnected else { return }
        count("advertisements")
        let adv = d.nextAdvertisement(now: monotonicSeconds())
        let sessions = a.sessions.map { a.filters[$0] }
        var passes = sessions.contains { f in
            f.map {
                $0.matches(
                    name: adv.name, address: d.spec.address, rssi: adv.rssi, txPower: adv.txPower,
                    uuids: adv.uuids + adv.serviceData.map(\.0))
            } ?? true
        }
        let structures = monitors.isEmpty ? [] : advertisingStructures(adv, connectable: d.spec.connectable)
        let matchingMonitors = monitors.filter { m in m.patterns.contains { $0.matches(structures) } }
        if !matchingMonitors.isEmpty { passes = true }
        guard passes || d.exported else { return }
        if !passes { return }
        let anyRSSIFilter = sessions.contains { $0?.rssi != nil || $0?.pathloss != nil }
        let duplicate = sessions.contains { $0?.duplicateData == true }
        let changed = d.adv.apply(
            adv, rssiThreshold: anyRSSIFilter ? 0 : 8, duplicateData: duplicate,
            servicesResolved: d.servicesResolved)
        if a.discovering { d.seenInDiscovery = true }
        if !d.exported {
            exportDevice(d)
        } else if let server {
            let iface = "org.bluez.Device1"
            for name in changed.sorted() {
                switch name {
                case "RSSI": server.setProperty(at: d.path, interface: iface, "RSSI", .int16(Int16(d.adv.rssi ?? 0)))
                case "TxPower":
                    server.setProperty(at: d.path, interface: iface, "TxPower", .int16(Int16(d.adv.txPower ?? 0)))
                case "Name":
                    server.setProperty(at: d.path, interface: iface, "Name", .string(d.adv.name ?? ""))
                    server.setProperty(at: d.path, interface: iface, "Alias", .string(d.adv.name ?? ""))
                case "ManufacturerData":
                    server.setProperty(
                        at: d.path, interface: iface, name, Self.manufacturerValue(d.adv.manufacturerData))
                case "ServiceData":
                    server.setProperty(at: d.path, interface: iface, name, Self.serviceDataValue(d.adv.serviceData))
                case "UUIDs": server.setProperty(at: d.path, interface: iface, name, .stringArray(d.adv.uuids))
                default: break
                }
            }
        }
        for m in matchingMonitors where !d.foundBy.contains(m.key) {
            d.foundBy.insert(m.key)
            callMonitor(m, "DeviceFound", d.path)
        }
        scheduleExpiry(d)
    }

    /// Temporary devices disappear `temporaryTimeout` seconds after their last advertisement.
    func scheduleExpiry(_ d: SimDevice) {
        d.expiryGeneration += 1
        let generation = d.expiryGeneration
        after(scenario.temporaryTimeout) { [weak self] in
            guard let self, d.expiryGeneration == generation, d.exported else { return }
            let linkIdle: Bool
            if case .disconnected = d.link { linkIdle = true } else { linkIdle = false }
            guard d.temporary, linkIdle else { return }
            self.count("devices_expired")
            self.unexportDevice(d)
        }
    }

    // MARK: clients leaving

    func clientLeft(_ name: String) {
        for a in adapters {
            a.filters[name] = nil
            if a.sessions.contains(name) { endSession(a, name) }
        }
        for d in devices {
            for c in d.characteristics {
                if c.sessions.contains(name) { removeNotifySession(d, c, name) }
                if c.notifyOwner == name { releaseNotifySocket(d, c) }
            }
        }
        let before = monitors.count
        monitorApps.removeAll { $0.owner == name }
        monitors.removeAll { $0.owner == name }
        if before != monitors.count { count("monitors_dropped") }
        localClientLeft(name)
    }

    // MARK: AdvertisementMonitor

    /// Reads AdvertisementMonitor1 objects (or_patterns) out of a GetManagedObjects/InterfacesAdded dictionary.
    static func monitors(in objects: [DBusDictEntry], owner: String, root: DBusObjectPath) -> [SimMonitor] {
        var found: [SimMonitor] = []
        for entry in objects {
            guard let path = entry.key.objectPath, let ifaces = entry.value.dictionaryEntries else { continue }
            found += monitors(at: path, interfaces: ifaces, owner: owner, root: root)
        }
        return found
    }

    static func monitors(at path: DBusObjectPath, interfaces: [DBusDictEntry], owner: String, root: DBusObjectPath)
        -> [SimMonitor]
    {
        guard path.rawValue.hasPrefix(root.rawValue),
            let props = interfaces.first(where: { $0.key.string == "org.bluez.AdvertisementMonitor1" })?.value
                .stringVariantDictionary, props["Type"]?.string == "or_patterns"
        else { return [] }
        var patterns: [SimMonitorPattern] = []
        for p in props["Patterns"]?.arrayElements ?? [] {
            guard case .structure(let fields) = p, fields.count == 3, let start = fields[0].uint8,
                let type = fields[1].uint8, let content = fields[2].bytes
            else { continue }
            patterns.append(SimMonitorPattern(start: Int(start), adType: type, content: content))
        }
        guard !patterns.isEmpty else { return [] }
        return [SimMonitor(owner: owner, root: root, path: path, patterns: patterns)]
    }

    /// RegisterMonitor(root): like bluetoothd, act as an ObjectManager client of the caller's `root`: read its
    /// monitors with GetManagedObjects (an application may have none yet), then follow its InterfacesAdded.
    func registerMonitor(_ call: DBusMethodCall) {
        guard let root = call.arguments.first?.objectPath else { return call.reply.fail(Self.invalidArguments) }
        guard let a = adapters.first(where: { $0.path == call.path }) else { return call.reply.fail(Self.doesNotExist) }
        if monitorApps.contains(where: { $0.owner == call.sender && $0.root == root }) {
            return call.reply.fail(Self.alreadyExists)
        }
        guard let connection else { return call.reply.fail(Self.bluezError("Failed", "Failed")) }
        let sender = call.sender
        let epoch = self.epoch
        monitorApps.append((sender, root))
        Task { [weak self] in
            let added: DBusSignalStream?
            do {
                added = try await connection.signals(
                    matching: DBusMatchRule(
                        type: .signal, sender: sender, interface: "org.freedesktop.DBus.ObjectManager",
                        member: "InterfacesAdded", path: root))
            } catch {
                added = nil
            }
            let objects: [DBusValue]
            do {
                objects = try await connection.call(
                    destination: sender, path: root, interface: "org.freedesktop.DBus.ObjectManager",
                    method: "GetManagedObjects", timeout: .seconds(5))
            } catch {
                if let strong = self {
                    strong.onLoop(epoch: epoch) {
                        strong.monitorApps.removeAll { $0.owner == sender && $0.root == root }
                    }
                }
                call.reply.fail(Self.bluezError("Failed", "Failed to get managed objects"))
                return
            }
            let found = Self.monitors(in: objects.first?.dictionaryEntries ?? [], owner: sender, root: root)
            guard let self else { return }
            self.queue.async {
                guard self.epoch == epoch else { return }
                call.reply.succeed()
                self.addMonitors(found, adapter: a)
            }
            guard let added else { return }
            do {
                for await message in added {
                    guard message.body.count == 2, let path = message.body[0].objectPath,
                        let ifaces = message.body[1].dictionaryEntries
                    else { continue }
                    let more = Self.monitors(at: path, interfaces: ifaces, owner: sender, root: root)
                    guard self.epoch == epoch else { return }
                    self.onLoop(epoch: epoch) {
                        guard self.monitorApps.contains(where: { $0.owner == sender && $0.root == root }) else {
                            return
                        }
                        self.addMonitors(more, adapter: a)
                    }
                }
            }
        }
    }

    func addMonitors(_ found: [SimMonitor], adapter a: SimAdapter) {
        guard !found.isEmpty else { return }
        let wasScanning = isScanning(a)
        monitors += found
        count("monitors_registered", found.count)
        for m in found { callMonitor(m, "Activate", nil) }
        if !wasScanning { startAdvertising(a) }
    }

    func unregisterMonitor(_ call: DBusMethodCall) {
        guard let root = call.arguments.first?.objectPath else { return call.reply.fail(Self.invalidArguments) }
        let gone = monitors.filter { $0.owner == call.sender && $0.root == root }
        guard monitorApps.contains(where: { $0.owner == call.sender && $0.root == root }) else {
            return call.reply.fail(Self.doesNotExist)
        }
        monitorApps.removeAll { $0.owner == call.sender && $0.root == root }
        monitors.removeAll { $0.owner == call.sender && $0.root == root }
        for m in gone { callMonitor(m, "Release", nil) }
        call.reply.succeed()
    }

    /// Calls a method on a client's AdvertisementMonitor1 object without waiting for a reply.
    func callMonitor(_ m: SimMonitor, _ method: String, _ device: DBusObjectPath?) {
        guard let connection else { return }
        var message = DBusMessage.methodCall(
            destination: m.owner, path: m.path, interface: "org.bluez.AdvertisementMonitor1", method: method,
            body: device.map { [.objectPath($0)] } ?? [])
        message.noReplyExpected = true
        try? connection.send(message)
    }
}
