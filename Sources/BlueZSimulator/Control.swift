// io.blebridge.Simulator1 at /org/bluez/sim: the control interface tests use to steer the simulated world.
// Every method takes basic types only, so `dbus-send` can drive it; options are YAML/JSON text.
import DBus
import YAML

extension BlueZSimulator {
    /// The control interface's name.
    public static let controlInterfaceName = "io.blebridge.Simulator1"

    static func controlError(_ text: String) -> DBusError {
        DBusError(name: "io.blebridge.Simulator1.Error.Failed", message: text)
    }

    static let reasons: [String: (String, String)] = [
        "remote": ("org.bluez.Reason.Remote", "Connection terminated by remote user"),
        "local": ("org.bluez.Reason.Local", "Connection terminated by local host"),
        "timeout": ("org.bluez.Reason.Timeout", "Connection timeout"),
        "authentication": ("org.bluez.Reason.Authentication", "Connection terminated due to authentication failure"),
        "suspend": ("org.bluez.Reason.Suspend", "Connection terminated by local host for suspend"),
        "unknown": ("org.bluez.Reason.Unknown", "Unspecified"),
    ]

    func controlInterface() -> DBusInterfaceSpec {
        DBusInterfaceSpec(
            Self.controlInterfaceName,
            methods: [
                DBusMethodSpec(
                    "AddPeripheral", in: "s", out: "o", argumentNames: ["peripheral"], resultNames: ["device"],
                    handler: onQueue { $0.addPeripheral($1) }),
                DBusMethodSpec(
                    "RemovePeripheral", in: "s", argumentNames: ["address"],
                    handler: onQueue { $0.removePeripheral($1) }),
                DBusMethodSpec(
                    "SetAdvertisement", in: "ss", argumentNames: ["address", "changes"],
                    handler: onQueue { $0.setAdvertisement($1) }),
                DBusMethodSpec(
                    "PushNotification", in: "ssay", argumentNames: ["address", "uuid", "value"],
                    handler: onQueue { $0.pushNotification($1) }),
                DBusMethodSpec(
                    "EndNotify", in: "ss", argumentNames: ["address", "uuid"],
                    handler: onQueue { $0.endNotify($1) }),
                DBusMethodSpec(
                    "ServiceChanged", in: "s", argumentNames: ["address"],
                    handler: onQueue { $0.serviceChanged($1) }),
                DBusMethodSpec(
                    "SetNotificationRate", in: "ssd", argumentNames: ["address", "uuid", "hz"],
                    handler: onQueue { $0.setNotificationRate($1) }),
                DBusMethodSpec(
                    "InjectFault", in: "sss", argumentNames: ["address", "fault", "options"],
                    handler: onQueue { $0.injectFault($1) }),
                DBusMethodSpec(
                    "ClearFaults", in: "s", argumentNames: ["address"],
                    handler: onQueue { $0.clearFaults($1) }),
                DBusMethodSpec(
                    "Disconnect", in: "ss", argumentNames: ["address", "reason"],
                    handler: onQueue { $0.remoteDisconnect($1) }),
                DBusMethodSpec(
                    "RemoveAdapter", in: "s", argumentNames: ["adapter"],
                    handler: onQueue { $0.removeAdapter($1) }),
                DBusMethodSpec(
                    "AddAdapter", in: "s", out: "o", argumentNames: ["adapter"], resultNames: ["path"],
                    handler: onQueue { $0.addAdapter($1) }),
                DBusMethodSpec(
                    "RestartDaemon", in: "d", argumentNames: ["seconds"],
                    handler: onQueue { $0.restartDaemon($1) }),
                DBusMethodSpec(
                    "RestartDaemonSlowly", in: "dd", argumentNames: ["seconds", "exportDelay"],
                    handler: onQueue { $0.restartDaemon($1) }),
                DBusMethodSpec(
                    "GetWrites", in: "s", out: "a(says)", argumentNames: ["address"],
                    resultNames: ["writes"], handler: onQueue { $0.getWrites($1) }),
                DBusMethodSpec(
                    "GetCounters", out: "a{sv}", resultNames: ["counters"],
                    handler: onQueue { $0.getCounters($1) }),
                DBusMethodSpec(
                    "Burst", in: "ssu", out: "u", argumentNames: ["address", "uuid", "count"],
                    resultNames: ["sent"], handler: onQueue { $0.burst($1) }),
                DBusMethodSpec(
                    "GetLocalGatt", in: "s", out: "s", argumentNames: ["adapter"], resultNames: ["json"],
                    handler: onQueue { $0.getLocalGatt($1) }),
                DBusMethodSpec(
                    "GetAdvertisements", in: "s", out: "s", argumentNames: ["adapter"], resultNames: ["json"],
                    handler: onQueue { $0.getAdvertisements($1) }),
                DBusMethodSpec(
                    "CentralConnect", in: "ss", out: "o", argumentNames: ["adapter", "central"],
                    resultNames: ["device"], handler: onQueue { $0.centralConnect($1) }),
                DBusMethodSpec(
                    "CentralRead", in: "ssu", out: "ay", argumentNames: ["central", "uuid", "offset"],
                    resultNames: ["value"], handler: onQueue { $0.centralRead($1) }),
                DBusMethodSpec(
                    "CentralWrite", in: "ssays", argumentNames: ["central", "uuid", "value", "type"],
                    handler: onQueue { $0.centralWrite($1) }),
                DBusMethodSpec(
                    "CentralSubscribe", in: "ssb", argumentNames: ["central", "uuid", "enable"],
                    handler: onQueue { $0.centralSubscribe($1) }),
                DBusMethodSpec(
                    "CentralNotifications", in: "ss", out: "aay", argumentNames: ["central", "uuid"],
                    resultNames: ["values"], handler: onQueue { $0.centralNotifications($1) }),
                DBusMethodSpec(
                    "CentralDisconnect", in: "s", argumentNames: ["central"],
                    handler: onQueue { $0.centralDisconnect($1) }),
            ])
    }

    func controlDevice(_ call: DBusMethodCall) -> SimDevice? {
        guard let address = call.arguments.first?.string else {
            call.reply.fail(Self.invalidArguments)
            return nil
        }
        guard let d = device(address: address) else {
            call.reply.fail(Self.bluezError("DoesNotExist", "No peripheral \(address)"))
            return nil
        }
        return d
    }

    func controlCharacteristic(_ call: DBusMethodCall) -> (SimDevice, SimCharacteristic)? {
        guard let d = controlDevice(call) else { return nil }
        guard call.arguments.count > 1, let text = call.arguments[1].string, let uuid = SimUUID(text) else {
            call.reply.fail(Self.invalidArguments)
            return nil
        }
        guard let c = d.characteristic(uuid) else {
            call.reply.fail(Self.bluezError("DoesNotExist", "No characteristic \(text) on \(d.spec.address)"))
            return nil
        }
        return (d, c)
    }

    func addPeripheral(_ call: DBusMethodCall) {
        guard let text = call.arguments.first?.string else { return call.reply.fail(Self.invalidArguments) }
        let spec: SimPeripheralSpec
        do { spec = try scenario.parsePeripheral(text) } catch {
            return call.reply.fail(Self.bluezError("InvalidArguments", error.description))
        }
        guard device(address: spec.address) == nil, let a = adapters.first(where: { $0.spec.id == spec.adapter }) else {
            return call.reply.fail(Self.alreadyExists)
        }
        let d = SimDevice(spec: spec, adapterPath: a.path, now: monotonicSeconds())
        devices.append(d)
        count("peripherals_added")
        call.reply.succeed([.objectPath(d.path)])
        if isScanning(a) { scheduleAdvertisement(d, first: true) }
    }

    func removePeripheral(_ call: DBusMethodCall) {
        guard let d = controlDevice(call) else { return }
        if d.isConnected { linkDown(d, reason: Self.reasons["timeout"]!) }
        if case .connecting(let pending, _) = d.link {
            d.link = .disconnected
            pending.fail(Self.bluezError("Failed", "le-connection-abort-by-local"))
        }
        d.linkGeneration += 1
        d.advertisementGeneration += 1
        for c in d.characteristics {
            c.timer?.cancel()
            c.timer = nil
        }
        unexportDevice(d)
        devices.removeAll { $0 === d }
        call.reply.succeed()
    }

    func setAdvertisement(_ call: DBusMethodCall) {
        guard let d = controlDevice(call) else { return }
        guard call.arguments.count == 2, let text = call.arguments[1].string else {
            return call.reply.fail(Self.invalidArguments)
        }
        do {
            let node = try YAMLParser.parse(text)
            guard let entries = node.mapping else { throw ScenarioError(path: "", reason: "expected a mapping") }
            let allowed: Set<String> = [
                "name", "rssi", "rssi_jitter", "tx_power", "advertising", "advertising_interval", "connectable",
                "service_uuids", "manufacturer_data", "service_data", "appearance",
            ]
            // Merge onto the current spec through the scenario reader, so every key is validated the same way.
            var merged: [(key: String, value: YAMLNode)] = [
                ("address", YAMLNode(.scalar(d.spec.address, quoted: true)))
            ]
            for entry in entries {
                guard allowed.contains(entry.key) else {
                    throw ScenarioError(
                        path: entry.key,
                        reason: "cannot be changed (changeable: \(allowed.sorted().joined(separator: ", ")))")
                }
                merged.append(entry)
            }
            let patch = try ScenarioReader.peripheral(YAMLNode(.mapping(merged)), path: "", defaultAdapter: d.adapterID)
            for entry in entries {
                switch entry.key {
                case "name": d.spec.name = patch.name
                case "rssi": d.spec.rssi = patch.rssi
                case "rssi_jitter": d.spec.rssiJitter = patch.rssiJitter
                case "tx_power": d.spec.txPower = patch.txPower
                case "advertising": d.spec.advertising = patch.advertising
                case "advertising_interval": d.spec.advertisingInterval = patch.advertisingInterval
                case "connectable": d.spec.connectable = patch.connectable
                case "service_uuids": d.spec.serviceUUIDs = patch.serviceUUIDs
                case "manufacturer_data": d.spec.manufacturerData = patch.manufacturerData
                case "service_data": d.spec.serviceData = patch.serviceData
                case "appearance": d.spec.appearance = patch.appearance
                default: break
                }
            }
        } catch let error as ScenarioError {
            return call.reply.fail(Self.bluezError("InvalidArguments", error.description))
        } catch {
            return call.reply.fail(Self.bluezError("InvalidArguments", "\(error)"))
        }
        d.startTime = monotonicSeconds()
        d.advertisementCount = 0
        count("advertisement_changes")
        call.reply.succeed()
    }

    func pushNotification(_ call: DBusMethodCall) {
        guard let (d, c) = controlCharacteristic(call) else { return }
        guard call.arguments.count == 3, let value = call.arguments[2].bytes else {
            return call.reply.fail(Self.invalidArguments)
        }
        guard c.canNotify else { return call.reply.fail(Self.notSupported) }
        guard d.isConnected else { return call.reply.fail(Self.notConnectedFailed) }
        c.stored = value
        notify(d, c, value)
        call.reply.succeed()
    }

    /// bluetoothd ends every notification subscription of a characteristic while the link stays up (another
    /// client's StopNotify on an acquired characteristic, Service Changed): the AcquireNotify socket is closed
    /// (`NotifyAcquired` false) and the StartNotify sessions are dropped (`Notifying` false).
    func endNotify(_ call: DBusMethodCall) {
        guard let (d, c) = controlCharacteristic(call) else { return }
        guard c.notifySocket != nil || !c.sessions.isEmpty else {
            return call.reply.fail(Self.bluezError("Failed", "No notify session started"))
        }
        count("notify_ended")
        if c.notifySocket != nil { releaseNotifySocket(d, c) }
        for sender in c.sessions { removeNotifySession(d, c, sender) }
        call.reply.succeed()
    }

    /// A Service Changed indication from the connected peripheral covering its whole database: bluetoothd drops
    /// the notify subscriptions and removes every service object, then exports the database again ~50 ms later.
    func serviceChanged(_ call: DBusMethodCall) {
        guard let d = controlDevice(call) else { return }
        guard d.isConnected, d.gattExported else { return call.reply.fail(Self.notConnectedFailed) }
        count("service_changes")
        for c in d.characteristics {
            c.timer?.cancel()
            c.timer = nil
            if c.notifySocket != nil { releaseNotifySocket(d, c) }
            c.sessions = []
        }
        unexportGATT(d)
        call.reply.succeed()
        let generation = d.linkGeneration
        after(0.05) { [weak self] in
            guard let self, d.linkGeneration == generation, d.isConnected else { return }
            self.exportGATT(d)
        }
    }

    func setNotificationRate(_ call: DBusMethodCall) {
        guard let (d, c) = controlCharacteristic(call) else { return }
        guard call.arguments.count == 3, let hz = call.arguments[2].double, hz.isFinite, hz >= 0, hz <= 100_000 else {
            return call.reply.fail(Self.invalidArguments)
        }
        c.rateHz = hz
        c.timer?.cancel()
        c.timer = nil
        updateGenerator(d, c)
        call.reply.succeed()
    }

    func injectFault(_ call: DBusMethodCall) {
        guard let d = controlDevice(call) else { return }
        guard call.arguments.count == 3, let name = call.arguments[1].string, let text = call.arguments[2].string else {
            return call.reply.fail(Self.invalidArguments)
        }
        guard let kind = SimFault.Kind(rawValue: name) else {
            let known = SimFault.Kind.allCases.map(\.rawValue).joined(separator: ", ")
            return call.reply.fail(Self.bluezError("InvalidArguments", "unknown fault \"\(name)\" (known: \(known))"))
        }
        do {
            let options = try YAMLParser.parse(text)
            let m = try ScenarioReader.mapping(
                options, "options", allowed: ["count", "uuid", "att", "error", "message"])
            var fault = SimFault(
                kind: kind, remaining: try ScenarioReader.int(m["count"], "options.count", range: 0...1_000_000) ?? 1,
                uuid: m["uuid"] == nil ? nil : try ScenarioReader.uuid(m["uuid"], "options.uuid"),
                errorName: "org.bluez.Error.Failed", errorMessage: "le-connection-abort-by-local")
            switch kind {
            case .inProgress:
                (fault.errorName, fault.errorMessage) = ("org.bluez.Error.InProgress", "In Progress")
            case .connectFailed:
                fault.errorMessage =
                    try ScenarioReader.string(m["message"], "options.message") ?? "le-connection-abort-by-remote"
            case .readError, .writeError, .notifyError:
                if let error = try ScenarioReader.string(m["error"], "options.error") {
                    fault.errorName = error.contains(".") ? error : "org.bluez.Error." + error
                    fault.errorMessage = try ScenarioReader.string(m["message"], "options.message") ?? error
                } else {
                    let att = try ScenarioReader.int(m["att"], "options.att", range: 0...255) ?? 0x0e
                    (fault.errorName, fault.errorMessage) = simATTError(UInt8(att), write: kind != .readError)
                }
            default: break
            }
            d.faults.append(fault)
        } catch let error as ScenarioError {
            return call.reply.fail(Self.bluezError("InvalidArguments", error.description))
        } catch {
            return call.reply.fail(Self.bluezError("InvalidArguments", "options: \(error)"))
        }
        count("faults_injected")
        call.reply.succeed()
    }

    func clearFaults(_ call: DBusMethodCall) {
        guard let d = controlDevice(call) else { return }
        d.faults = []
        call.reply.succeed()
    }

    func remoteDisconnect(_ call: DBusMethodCall) {
        guard let d = controlDevice(call) else { return }
        guard call.arguments.count == 2, let text = call.arguments[1].string else {
            return call.reply.fail(Self.invalidArguments)
        }
        let reason =
            Self.reasons[text.lowercased()]
            ?? Self.reasons.values.first { $0.0 == text }
        guard let reason else {
            return call.reply.fail(
                Self.bluezError(
                    "InvalidArguments",
                    "unknown reason \"\(text)\" (known: \(Self.reasons.keys.sorted().joined(separator: ", ")))"))
        }
        guard d.isConnected else { return call.reply.fail(Self.notConnectedFailed) }
        count("remote_disconnects")
        linkDown(d, reason: reason)
        call.reply.succeed()
    }

    /// The controller goes away (unplugged, `hciconfig down` of a USB dongle that resets): its devices vanish with
    /// their GATT objects (links dropped, sockets shut, pending Connect() calls failed), then the adapter object.
    func removeAdapter(_ call: DBusMethodCall) {
        guard let id = call.arguments.first?.string else { return call.reply.fail(Self.invalidArguments) }
        guard let a = adapters.first(where: { $0.spec.id == id || $0.path.rawValue == id }) else {
            return call.reply.fail(Self.bluezError("DoesNotExist", "No adapter \(id)"))
        }
        for d in devices where d.adapterID == a.spec.id {
            if case .connecting(let pending, _) = d.link {
                pending.fail(Self.bluezError("Failed", "le-connection-abort-by-local"))
            }
            d.link = .disconnected
            d.linkGeneration += 1
            d.advertisementGeneration += 1
            for c in d.characteristics {
                c.timer?.cancel()
                c.timer = nil
                if c.notifySocket != nil { releaseNotifySocket(d, c) }
                if c.writeSocket != nil { releaseWriteSocket(d, c) }
            }
            unexportDevice(d)
        }
        a.sessions = []
        a.filters = [:]
        localAdapterRemoved(a.spec.id)
        server?.removeObject(at: a.path)
        adapters.removeAll { $0 === a }
        removedAdapters.removeAll { $0.address == a.spec.address }
        removedAdapters.append(a.spec)
        count("adapters_removed")
        call.reply.succeed()
    }

    /// An adapter appears (`{id, address, name, powered}` as in the scenario). When its address is that of a removed
    /// adapter it takes over that adapter's peripherals, under the new name if it has one.
    func addAdapter(_ call: DBusMethodCall) {
        guard let text = call.arguments.first?.string else { return call.reply.fail(Self.invalidArguments) }
        let spec: SimAdapterSpec
        do {
            let m = try ScenarioReader.mapping(
                try YAMLParser.parse(text), "adapter", allowed: ["id", "address", "name", "powered"])
            guard let id = try ScenarioReader.string(m["id"], "adapter.id"), id.hasPrefix("hci"),
                Int(id.dropFirst(3)) != nil
            else {
                throw ScenarioError(path: "adapter.id", reason: "is required and must be an adapter name like hci0")
            }
            spec = SimAdapterSpec(
                id: id, address: try ScenarioReader.mac(m["address"], "adapter.address"),
                name: try ScenarioReader.string(m["name"], "adapter.name") ?? "bluez-sim",
                powered: try ScenarioReader.bool(m["powered"], "adapter.powered", default: true))
        } catch let error as ScenarioError {
            return call.reply.fail(Self.bluezError("InvalidArguments", error.description))
        } catch {
            return call.reply.fail(Self.bluezError("InvalidArguments", "adapter: \(error)"))
        }
        guard !adapters.contains(where: { $0.spec.id == spec.id || $0.spec.address == spec.address }) else {
            return call.reply.fail(Self.alreadyExists)
        }
        let a = SimAdapter(spec: spec)
        adapters.append(a)
        adapters.sort { $0.path.rawValue < $1.path.rawValue }
        server?.addInterfaces(at: a.path, adapterInterfaces(a))
        if let old = removedAdapters.first(where: { $0.address == spec.address }) {
            removedAdapters.removeAll { $0.address == spec.address }
            let now = monotonicSeconds()
            devices = devices.map { d in
                guard d.adapterID == old.id, old.id != spec.id else { return d }
                var moved = d.spec
                moved.adapter = spec.id
                return SimDevice(spec: moved, adapterPath: a.path, now: now)
            }
        }
        for d in devices where d.adapterID == spec.id && d.spec.paired && !d.exported {
            d.paired = true
            d.temporary = false
            d.adv.name = d.spec.name
            d.adv.uuids = d.spec.serviceUUIDs.map(\.string)
            exportDevice(d)
        }
        count("adapters_added")
        call.reply.succeed([.objectPath(a.path)])
    }

    func restartDaemon(_ call: DBusMethodCall) {
        guard let seconds = call.arguments.first?.double, seconds.isFinite, seconds >= 0, seconds <= 3600 else {
            return call.reply.fail(Self.invalidArguments)
        }
        // RestartDaemonSlowly: own org.bluez `exportDelay` seconds before exporting anything.
        let exportDelay = call.arguments.count > 1 ? (call.arguments[1].double ?? -1) : 0
        guard exportDelay.isFinite, exportDelay >= 0, exportDelay <= 3600 else {
            return call.reply.fail(Self.invalidArguments)
        }
        count("restarts")
        call.reply.succeed()
        // bluetoothd going down destroys each adapter's advertising manager, which releases every advertisement
        // (manager_destroy -> client_destroy in src/advertising.c); GATT applications are just forgotten.
        for ad in advertisements { removeAdvertisement(ad, release: true) }
        for app in localApps { removeApp(app) }
        // Let the reply leave before the connection (and with it org.bluez and every object) goes away.
        after(0.05) { [weak self] in
            guard let self else { return }
            self.tearDownDevices()
            self.detachConnection()?.close()
            self.queue.asyncAfter(deadline: simDeadline(seconds)) { [weak self] in
                Task { [weak self] in
                    guard let self else { return }
                    do { try await self.start(exportDelay: exportDelay) } catch {
                        printError("bluez-sim: restart failed: \(error)")
                        self.stop()
                    }
                }
            }
        }
    }

    func getWrites(_ call: DBusMethodCall) {
        guard let d = controlDevice(call) else { return }
        call.reply.succeed([
            .array("(says)", d.writes.map { .structure([.string($0.uuid), .bytes($0.value), .string($0.type)]) })
        ])
    }

    func getCounters(_ call: DBusMethodCall) {
        var all = counters
        all["devices_exported"] = devices.filter(\.exported).count
        all["devices_connected"] = devices.filter(\.isConnected).count
        all["monitors"] = monitors.count
        all["discovery_sessions"] = adapters.reduce(0) { $0 + $1.sessions.count }
        all["local_apps"] = localApps.count
        all["local_advertisements"] = advertisements.count
        all["centrals_connected"] = centrals.filter(\.connected).count
        call.reply.succeed([.stringVariantDictionary(all.keys.sorted().map { ($0, .int64(Int64(all[$0] ?? 0))) })])
    }

    /// Sends `count` notifications as fast as possible; each value is its 4-byte little-endian sequence number.
    func burst(_ call: DBusMethodCall) {
        guard let (d, c) = controlCharacteristic(call) else { return }
        guard call.arguments.count == 3, let n = call.arguments[2].uint32, n <= 1_000_000 else {
            return call.reply.fail(Self.invalidArguments)
        }
        guard d.isConnected, c.isSubscribed else {
            return call.reply.fail(Self.bluezError("Failed", "not connected or not subscribed"))
        }
        @Sendable func value(_ i: UInt32) -> [UInt8] {
            [UInt8(i & 0xFF), UInt8((i >> 8) & 0xFF), UInt8((i >> 16) & 0xFF), UInt8(i >> 24)]
        }
        guard c.notifySocket == nil, let server else {
            var sent: UInt32 = 0
            for i in 0..<n where notify(d, c, value(i)) { sent += 1 }
            return call.reply.succeed([.uint32(sent)])
        }
        // The StartNotify path builds its signals off the loop, in parallel with the loop sending them; the server
        // is thread-safe and a single producer keeps the order.
        let epoch = self.epoch
        let path = c.path
        queue.async { [weak self] in
            for i in 0..<n {
                server.setProperty(
                    at: path, interface: Self.characteristicInterfaceName, "Value", .bytes(value(i)),
                    flush: true)
            }
            self?.onLoop(epoch: epoch) { [weak self] in
                self?.count("notifications", Int(n))
                call.reply.succeed([.uint32(n)])
            }
        }
    }
}
