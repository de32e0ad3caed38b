// What the bridge remembers across restarts (under systemd's StateDirectory): each device's last state, address,
// learned advertising interval and the fields it publishes, so that retained topics and Home Assistant discovery are
// right at once after a restart. The store itself (a file written atomically) is an adapter's.
import GATT
import Logging

/// Where the bridge's memory lives.
public protocol BridgeStateStore: Sendable {
    /// The saved state, nil when there is none. A corrupt store is set aside by the store and reported as an error.
    func load() throws(BridgeTransportError) -> JSONValue?
    /// Saves the state (atomically: a crash leaves the old or the new state, never a mix).
    func save(_ state: JSONValue) throws(BridgeTransportError)
}

extension GATTFieldDescriptor {
    var json: JSONValue {
        var o: [(String, JSONValue)] = [("name", .string(name)), ("kind", .string(kind.rawValue))]
        if let unit { o.append(("unit", .string(unit))) }
        if let deviceClass { o.append(("device_class", .string(deviceClass))) }
        if let stateClass { o.append(("state_class", .string(stateClass))) }
        return .object(o)
    }

    init?(json: JSONValue) {
        guard let name = json["name"]?.string, let kind = json["kind"]?.string.flatMap(GATTFieldKind.init) else {
            return nil
        }
        self.init(
            name, kind: kind, unit: json["unit"]?.string, deviceClass: json["device_class"]?.string,
            stateClass: json["state_class"]?.string)
    }
}

extension Bridge {
    /// The state worth keeping, as JSON.
    func persistentState() -> JSONValue {
        let devices = records.map { r -> (String, JSONValue) in
            let d = r.data.withLock { $0 }
            var o: [(String, JSONValue)] = []
            if let a = d.address { o.append(("address", .string(a.text))) }
            o.append(("fields", .object(d.fields)))
            if let rssi = d.rssi { o.append(("rssi", .int(Int64(rssi)))) }
            if let wall = d.lastSeenWall { o.append(("last_seen", .double(wall))) }
            if let interval = d.advertInterval { o.append(("advertising_interval_s", .double(interval))) }
            o.append(("advertisement_fields", .array(d.advertFields.map(\.json))))
            o.append(("characteristic_fields", .array(d.characteristicFields.map(\.json))))
            o.append(("auto", .bool(r.config.index < 0)))
            return (r.id, .object(o))
        }
        return .object([("version", .int(1)), ("devices", .object(devices))])
    }

    /// Applies a saved state to the configured devices (and auto devices, when they are on). Unknown or malformed
    /// entries are skipped.
    func restore(_ state: JSONValue) -> Int {
        guard case .object(let devices)? = state["devices"] else { return 0 }
        var restored = 0
        for (id, saved) in devices {
            var r = record(id)
            if r == nil, saved["auto"] == .bool(true), config.autoDevices.enabled,
                let a = saved["address"]?.string.flatMap(BLEAddress.init)
            {
                r = autoDevice(for: a)
            }
            guard let r else { continue }
            let address = saved["address"]?.string.flatMap(BLEAddress.init)
            r.data.withLock { d in
                if d.address == nil, let address { d.address = address }
                if case .object(let fields)? = saved["fields"] { d.fields = fields }
                if case .int(let rssi)? = saved["rssi"], let v = Int(exactly: rssi) { d.rssi = v }
                d.lastSeenWall = saved["last_seen"]?.number
                d.advertInterval = saved["advertising_interval_s"]?.number
                if case .array(let items)? = saved["advertisement_fields"] {
                    d.advertFields = items.compactMap(GATTFieldDescriptor.init(json:))
                }
                if case .array(let items)? = saved["characteristic_fields"] {
                    d.characteristicFields = items.compactMap(GATTFieldDescriptor.init(json:))
                }
            }
            if let a = r.address { engine.withLock { s in if s.byAddress[a] == nil { s.byAddress[a] = r } } }
            restored += 1
        }
        return restored
    }

    /// Makes (or finds) the auto device for `address`.
    func autoDevice(for address: BLEAddress) -> DeviceRecord {
        engine.withLock { s in
            if let r = s.byAddress[address] { return r }
            let id = address.compact
            let config = DeviceConfig(
                id: id, friendlyName: nil, match: DeviceMatch(address: address), mode: .passive, subscribe: [],
                poll: [], pollInterval: .seconds(300), writable: [], debounce: nil, throttle: nil, retain: nil,
                qos: -1, output: .json, bindKey: nil, availabilityTimeout: nil, index: -1)
            let r = DeviceRecord(id: id, config: config, address: address)
            s.devices[id] = r
            s.order.append(id)
            s.byAddress[address] = r
            return r
        }
    }

    func loadState() {
        guard let store else { return }
        do {
            guard let state = try store.load() else { return }
            let n = restore(state)
            logger.info("restored the state of \(n) device\(n == 1 ? "" : "s") from the last run")
        } catch {
            logger.warning("\(error); starting without it")
        }
    }

    func saveState() {
        guard let store else { return }
        do {
            try store.save(persistentState())
        } catch {
            logger.warning("cannot save the bridge's state: \(error)")
        }
    }

    func runStateSaver() async {
        guard store != nil else { return }
        while !Task.isCancelled {
            do { try await clock.sleep(for: .seconds(30)) } catch { return }
            saveState()
        }
    }
}
