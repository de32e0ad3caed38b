// One mirror of bluetoothd's ObjectManager tree. Pure state: it is filled from GetManagedObjects and updated
// from InterfacesAdded/InterfacesRemoved/PropertiesChanged. Relations follow the Device/Service/Characteristic
// properties, never the shape of the paths. The standard interfaces BlueZ lists with empty dicts are dropped.
import DBus

#if canImport(Glibc)
    import Glibc
#endif

/// Interfaces every object lists and that carry nothing for a client.
let ignoredInterfaces: Set<String> = [
    "org.freedesktop.DBus.Introspectable", "org.freedesktop.DBus.Properties", "org.freedesktop.DBus.Peer",
    "org.freedesktop.DBus.ObjectManager",
]

/// One change to the mirror, or a signal the mirror does not store (Device1.Disconnected).
enum BlueZTreeEvent: Sendable {
    /// Interfaces appeared on an object (with their properties).
    case interfacesAdded(path: String, interfaces: [String: [String: DBusValue]])
    /// Interfaces were removed; `previous` holds what the object had before.
    case interfacesRemoved(path: String, interfaces: [String], previous: [String: [String: DBusValue]])
    /// Properties changed or were invalidated.
    case propertiesChanged(path: String, interface: String, changed: [String: DBusValue], invalidated: [String])
    /// `Device1.Disconnected(reason, message)`, emitted right before `Connected: false`.
    case deviceDisconnected(path: String, reason: String, message: String)
    /// The mirror was replaced by a fresh GetManagedObjects.
    case reloaded
    /// bluetoothd left the bus, or the bus connection itself was lost (`busLost`); `previous` is the mirror before
    /// it was cleared.
    case daemonLost(previous: BlueZObjectTree, busLost: Bool)
    /// The bus connection was opened again after it had been lost (bluetoothd may or may not be there).
    case busRestored
}

extension BlueZTreeEvent {
    /// True when the event can change what `BlueZObjectTree.adapters` returns: an `Adapter1` (or the
    /// `AdvertisementMonitorManager1` an adapter offers) came, went or changed, or the whole mirror was replaced.
    var touchesAdapters: Bool {
        switch self {
        case .interfacesAdded(_, let interfaces):
            return interfaces[BlueZName.adapter] != nil || interfaces[BlueZName.monitorManager] != nil
        case .interfacesRemoved(_, let interfaces, _):
            return interfaces.contains(BlueZName.adapter) || interfaces.contains(BlueZName.monitorManager)
        case .propertiesChanged(_, let interface, _, _):
            return interface == BlueZName.adapter || interface == BlueZName.monitorManager
        case .deviceDisconnected:
            return false
        case .reloaded, .daemonLost, .busRestored:
            return true
        }
    }
}

/// The advertisement fields of a device that the mirror updates in place.
struct AdvertisementFields: OptionSet, Sendable {
    let rawValue: UInt8
    static let rssi = AdvertisementFields(rawValue: 1)
    static let txPower = AdvertisementFields(rawValue: 2)
    static let manufacturerData = AdvertisementFields(rawValue: 4)
    static let serviceData = AdvertisementFields(rawValue: 8)
}

/// The mirror itself: properties by path and interface.
///
/// Besides the objects it keeps indexes (adapter paths, device paths, devices by address) up to date with every
/// change, so that the queries a signal triggers cost what the signal touched, not a scan of the whole tree.
struct BlueZObjectTree: Sendable {
    /// The properties by path and interface. For a device whose advertisement fields were last updated in place
    /// (its slot's `ahead`), its RSSI, TxPower, ManufacturerData and ServiceData here are older than its device
    /// value until `settle(_:)` writes them back, which every other change to that object does first.
    private var storage: [String: [String: [String: DBusValue]]] = [:]
    /// How many device slots have fields `ahead` of `storage`.
    private var slotsAhead = 0
    /// Paths of the objects with an `Adapter1`, in path order.
    private(set) var adapterPaths: [String] = []
    /// Paths of the objects with a `Device1`.
    private(set) var devicePaths: Set<String> = []
    /// Device paths by upper-cased `Address`.
    private var devicesByAddress: [String: Set<String>] = [:]
    /// The upper-cased `Address` each device path is indexed under.
    private var deviceAddresses: [String: String] = [:]
    /// Each `Device1` as a value, kept up to date field by field: a signal that changed one property (an
    /// advertisement's RSSI or data) rebuilds that field, not the whole device. With it, the advertisement fields
    /// updated in place since they were last written to `storage` (one lookup of the path serves both).
    private var deviceValues: [ObjectPathKey: DeviceSlot] = [:]

    private struct DeviceSlot: Sendable {
        var device: BlueZDevice
        var ahead: AdvertisementFields = []
    }

    /// How many GATT services each device (by path) lost since the tree was loaded: a reconnect that removes and
    /// re-exports them (bluez#1489) shows as a change here, whatever is in the tree when ServicesResolved arrives.
    private(set) var serviceRemovals: [String: Int] = [:]

    /// Replaces everything with a GetManagedObjects reply body (`a{oa{sa{sv}}}`).
    mutating func load(managedObjects value: DBusValue) {
        clear()
        for entry in value.dictionaryEntries ?? [] {
            guard let path = entry.key.string else { continue }
            let interfaces = Self.interfaces(entry.value)
            if !interfaces.isEmpty { storage[path] = interfaces }
        }
        for path in storage.keys { reindex(path) }
    }

    /// Brings the indexes up to date for the object at `path` after it changed.
    private mutating func reindex(_ path: String) {
        let interfaces = storage[path]
        let isAdapter = interfaces?[BlueZName.adapter] != nil
        let adapterIndex = Self.insertionIndex(path, in: adapterPaths)
        let listed = adapterIndex < adapterPaths.count && adapterPaths[adapterIndex] == path
        if isAdapter, !listed {
            adapterPaths.insert(path, at: adapterIndex)
        } else if !isAdapter, listed {
            adapterPaths.remove(at: adapterIndex)
        }
        let address: String?
        if let device = interfaces?[BlueZName.device] {
            devicePaths.insert(path)
            let value = BlueZDevice(path: path, properties: device)
            address = value.address
            // The object was settled before this change (every change settles first), so nothing is ahead.
            let replaced = deviceValues.updateValue(DeviceSlot(device: value), forKey: ObjectPathKey(path))
            if replaced?.ahead.isEmpty == false { slotsAhead -= 1 }
        } else {
            devicePaths.remove(path)
            if deviceValues.removeValue(forKey: ObjectPathKey(path))?.ahead.isEmpty == false { slotsAhead -= 1 }
            address = nil
        }
        let old = deviceAddresses[path]
        guard old != address else { return }
        if let old {
            devicesByAddress[old]?.remove(path)
            if devicesByAddress[old]?.isEmpty == true { devicesByAddress[old] = nil }
        }
        deviceAddresses[path] = address
        if let address { devicesByAddress[address, default: []].insert(path) }
    }

    /// Where `path` is, or would go, in the sorted `paths`.
    private static func insertionIndex(_ path: String, in paths: [String]) -> Int {
        var low = 0
        var high = paths.count
        while low < high {
            let mid = (low + high) / 2
            if paths[mid] < path { low = mid + 1 } else { high = mid }
        }
        return low
    }

    /// Parses `a{sa{sv}}`, dropping the standard interfaces.
    static func interfaces(_ value: DBusValue) -> [String: [String: DBusValue]] {
        var out: [String: [String: DBusValue]] = [:]
        for entry in value.dictionaryEntries ?? [] {
            guard let name = entry.key.string, !ignoredInterfaces.contains(name) else { continue }
            out[name] = entry.value.stringVariantDictionary ?? [:]
        }
        return out
    }

    /// Reads a GetManagedObjects reply (`a{oa{sa{sv}}}`) in place: the path of every object it lists with an
    /// interface the mirror keeps, and the interfaces of those objects `known` lacks (as `load` would store them).
    /// The objects `known` has are not decoded.
    /// - Throws: `DBusError` (invalid arguments) when the reply has another shape.
    static func readMissing(_ reader: inout DBusArgumentReader, from known: BlueZObjectTree) throws(DBusError)
        -> (exported: Set<String>, missing: [(String, [String: [String: DBusValue]])])
    {
        let malformed = DBusError(
            name: DBusError.invalidArgs, message: "the GetManagedObjects reply is not of type a{oa{sa{sv}}}")
        guard reader.currentType == "a", var objects = reader.enter() else { throw malformed }
        var exported = Set<String>()
        var missing: [(String, [String: [String: DBusValue]])] = []
        while !objects.isAtEnd {
            guard var entry = objects.enter(), let path = entry.string() else { throw malformed }
            if known.hasObject(path) {
                // One interface the mirror keeps is all that is asked of an object it has; nothing is decoded.
                guard var list = entry.enter() else { throw malformed }
                while !list.isAtEnd {
                    guard var pair = list.enter(), let name = pair.string() else { throw malformed }
                    if !ignoredInterfaces.contains(name) {
                        exported.insert(path)
                        break
                    }
                }
            } else {
                guard let value = try entry.value() else { throw malformed }
                let interfaces = Self.interfaces(value)
                if !interfaces.isEmpty {
                    exported.insert(path)
                    missing.append((path, interfaces))
                }
            }
        }
        return (exported, missing)
    }

    /// Applies one signal from bluetoothd. Returns the event it amounts to, or nil when it means nothing here.
    mutating func apply(_ message: DBusMessage) -> BlueZTreeEvent? {
        guard message.type == .signal, let member = message.member else { return nil }
        switch (message.interface, member) {
        case (BlueZName.objectManager?, "InterfacesAdded"):
            guard message.body.count >= 2, let path = message.body[0].string else { return nil }
            let added = Self.interfaces(message.body[1])
            guard !added.isEmpty else { return nil }
            settle(path)
            storage[path, default: [:]].merge(added) { old, new in old.merging(new) { $1 } }
            reindex(path)
            return .interfacesAdded(path: path, interfaces: added)
        case (BlueZName.objectManager?, "InterfacesRemoved"):
            guard message.body.count >= 2, let path = message.body[0].string else { return nil }
            let names = (message.body[1].arrayElements ?? []).compactMap(\.string).filter {
                !ignoredInterfaces.contains($0)
            }
            settle(path)
            guard let previous = storage[path], !names.isEmpty else { return nil }
            var remaining = previous
            for name in names { remaining[name] = nil }
            if names.contains(BlueZName.gattService), let device = previous[BlueZName.gattService]?["Device"]?.string {
                serviceRemovals[device, default: 0] += 1
            }
            storage[path] = remaining.isEmpty ? nil : remaining
            reindex(path)
            return .interfacesRemoved(path: path, interfaces: names, previous: previous)
        case (BlueZName.properties?, "PropertiesChanged"):
            guard let path = message.path?.rawValue, message.body.count >= 2,
                let interface = message.body[0].string
            else { return nil }
            // A signal for an object we do not know (e.g. one exported before our snapshot was taken and removed
            // since) still updates what we have; it cannot create an interface out of nothing (nor one of the
            // ignored standard ones, which are never stored). One lookup of the path serves the whole update.
            settle(path)
            guard let at = storage.index(forKey: path), storage.values[at][interface] != nil else { return nil }
            var changed = message.body[1].stringVariantDictionary ?? [:]
            let invalidated =
                message.body.count >= 3 ? (message.body[2].arrayElements ?? []).compactMap(\.string) : []
            let isDevice = interface == BlueZName.device
            if isDevice, changed["ServicesResolved"]?.bool == true, changed["Connected"] == nil,
                storage.values[at][interface]?["Connected"]?.bool != true
            {
                // Services are resolved only over a link that is up. bluetoothd 5.66 sometimes never signals
                // Connected=true (the ATT channel came up before the kernel's Device Connected event, and
                // device_add_connection() returned early as "already connected"): the link is up all the same.
                changed["Connected"] = DBusValue.boolean(true)
            }
            storage.values[at][interface]?.merge(changed) { $1 }
            for name in invalidated { storage.values[at][interface]?[name] = nil }
            if isDevice {
                if changed["Address"] != nil || invalidated.contains("Address") {
                    reindex(path)
                } else if let properties = storage.values[at][interface] {
                    deviceValues[ObjectPathKey(path)]?.device.refresh(changed.keys, invalidated, from: properties)
                }
            }
            return .propertiesChanged(path: path, interface: interface, changed: changed, invalidated: invalidated)
        case (BlueZName.device?, "Disconnected"):
            guard let path = message.path?.rawValue else { return nil }
            let reason = message.body.first?.string ?? "org.bluez.Reason.Unknown"
            let text = message.body.count > 1 ? (message.body[1].string ?? "") : ""
            return .deviceDisconnected(path: path, reason: reason, message: text)
        default:
            return nil
        }
    }

    /// The common PropertiesChanged of discovery, applied as it is read from the message: `Device1` of a known
    /// device, nothing invalidated, and only RSSI, TxPower, ManufacturerData (`a{qv}` of `ay`) and ServiceData
    /// (`a{sv}` of `ay`) changed. The whole signal is checked before anything is changed. The device value is then
    /// updated (its data overwritten in place when the advertiser sent the same keys as before, as it nearly always
    /// does), the object's properties when anything else touches that object (or `objects` is read), so the mirror
    /// reads exactly as `apply(_:)` would have left it (a dictionary's entries then in key order). Returns the device
    /// as it is now; nil, having changed nothing, for any other signal or shape: the caller then decodes it and uses
    /// `apply(_:)`.
    mutating func applyAdvertisement(_ signal: DBusSignalView) -> BlueZDevice? {
        var arguments = signal.arguments()
        guard arguments.string(equals: BlueZName.device), var changed = arguments.enter(),
            let invalidated = arguments.enter(), invalidated.isAtEnd, arguments.isAtEnd,
            // An empty change is no advertisement (apply(_:) reports it as a property change that touched nothing).
            !changed.isAtEnd,
            // Looked up over the message's own bytes: no String is made for the path of every signal.
            let path = signal.unsafePathBytes,
            let device = deviceValues.index(forKey: ObjectPathKey(unsafeBorrowing: path))
        else { return nil }
        // One pass over the signal into entries that point into the message (alive until this returns), then the
        // changes: the whole signal is checked before anything is changed.
        return withUnsafeTemporaryAllocation(of: AdvertisedEntry.self, capacity: Self.advertisedEntries) { entries in
            guard let read = Self.readAdvertisement(&changed, into: entries) else { return nil }
            // One in-place access to the slot: through the dictionary's `values[index]` getter each read copied the
            // whole slot (a retain and release of every string, array and dictionary of the device).
            let (updated, settled) = Self.apply(
                read, of: UnsafeBufferPointer(entries), to: &deviceValues.values[device])
            if settled { slotsAhead += 1 }
            return updated
        }
    }

    /// Stores what `readAdvertisement` read into `slot`; returns the device as it is now and whether the slot was
    /// settled before (it is now ahead of the object's properties).
    private static func apply(
        _ read: AdvertisedFields, of entries: UnsafeBufferPointer<AdvertisedEntry>, to slot: inout DeviceSlot
    ) -> (BlueZDevice, Bool) {
        var fields: AdvertisementFields = []
        if let rssi = read.rssi {
            slot.device.rssi = rssi
            fields.insert(.rssi)
        }
        if let txPower = read.txPower {
            slot.device.txPower = txPower
            fields.insert(.txPower)
        }
        if let range = read.manufacturer {
            store(
                UnsafeBufferPointer(rebasing: entries[range]), into: &slot.device.manufacturerData,
                find: { entry, data in data.index(forKey: entry.company) }, key: { $0.company })
            fields.insert(.manufacturerData)
        }
        if let range = read.service {
            store(
                UnsafeBufferPointer(rebasing: entries[range]), into: &slot.device.serviceData,
                find: storedUUID, key: { $0.uuid.map { BlueZDevice.lowercasedUUID(String(cString: $0)) } })
            fields.insert(.serviceData)
        }
        // The device value now; the object's Device1 properties when something else touches it (settle).
        let settled = mark(&slot.ahead, fields)
        return (slot.device, settled)
    }

    /// One entry of an advertisement's ManufacturerData (`company`) or ServiceData (`uuid`), pointing into the
    /// message.
    private struct AdvertisedEntry {
        var company: UInt16
        var uuid: UnsafePointer<CChar>?
        var bytes: UnsafeBufferPointer<UInt8>
    }

    /// The most ManufacturerData and ServiceData entries one advertisement signal is applied in place with; one with
    /// more (no advertiser sends that many) goes the general way, `apply(_:)`.
    private static let advertisedEntries = 16

    /// What `readAdvertisement` found: the fields sent, the dictionaries as ranges of the entries.
    private struct AdvertisedFields {
        var rssi: Int16?
        var txPower: Int16?
        var manufacturer: Range<Int>?
        var service: Range<Int>?
    }

    /// Reads the changed properties of an advertisement (`a{sv}` of RSSI and TxPower `n`, ManufacturerData `a{qv}`
    /// and ServiceData `a{sv}` of `ay`) into `entries`; nil for any other property or shape, a dictionary sent twice,
    /// or more entries than `entries` holds.
    private static func readAdvertisement(
        _ changed: inout DBusArgumentReader, into entries: UnsafeMutableBufferPointer<AdvertisedEntry>
    ) -> AdvertisedFields? {
        var read = AdvertisedFields()
        var count = 0
        while !changed.isAtEnd {
            guard var entry = changed.enter(), let name = entry.unsafeString(), var variant = entry.enter() else {
                return nil
            }
            switch AdvertisedProperty(name) {
            case .rssi?:
                guard let value = variant.int16() else { return nil }
                read.rssi = value
            case .txPower?:
                guard let value = variant.int16() else { return nil }
                read.txPower = value
            case .manufacturerData?:
                guard read.manufacturer == nil,
                    let range = readEntries(&variant, into: entries, from: &count, key: { e in
                        e.uint16().map { (company: $0, uuid: nil) }
                    })
                else { return nil }
                read.manufacturer = range
            case .serviceData?:
                guard read.service == nil,
                    let range = readEntries(&variant, into: entries, from: &count, key: { e in
                        e.unsafeString().map { (company: 0, uuid: $0) }
                    })
                else { return nil }
                read.service = range
            case nil:
                return nil
            }
        }
        return read
    }

    /// Reads the dictionary in `variant` (of `ay` values, keys read by `key`) into `entries` from `count` on; returns
    /// the entries' range, nil for another shape or more entries than `entries` holds.
    private static func readEntries(
        _ variant: inout DBusArgumentReader, into entries: UnsafeMutableBufferPointer<AdvertisedEntry>,
        from count: inout Int,
        key: (inout DBusArgumentReader) -> (company: UInt16, uuid: UnsafePointer<CChar>?)?
    ) -> Range<Int>? {
        guard var dictionary = variant.enter() else { return nil }
        let first = count
        while !dictionary.isAtEnd {
            guard count < entries.count, var e = dictionary.enter(), let (company, uuid) = key(&e),
                var value = e.enter(), let bytes = value.unsafeBytes()
            else { return nil }
            entries.initializeElement(at: count, to: AdvertisedEntry(company: company, uuid: uuid, bytes: bytes))
            count += 1
        }
        return first..<count
    }

    /// The properties an advertisement changes, told apart by their names in place.
    private enum AdvertisedProperty {
        case rssi, txPower, manufacturerData, serviceData

        init?(_ name: UnsafePointer<CChar>) {
            func equal(_ expected: StaticString) -> Bool {
                strncmp(name, UnsafeRawPointer(expected.utf8Start).assumingMemoryBound(to: CChar.self),
                    expected.utf8CodeUnitCount + 1) == 0
            }
            switch UInt8(bitPattern: name[0]) {
            case UInt8(ascii: "R") where equal("RSSI"): self = .rssi
            case UInt8(ascii: "T") where equal("TxPower"): self = .txPower
            case UInt8(ascii: "M") where equal("ManufacturerData"): self = .manufacturerData
            case UInt8(ascii: "S") where equal("ServiceData"): self = .serviceData
            default: return nil
            }
        }
    }

    /// Stores an advertisement's ManufacturerData or ServiceData: when the entries have exactly the keys `data` has,
    /// each once (the advertiser sent the keys it sent last time, as it nearly always does), each value is
    /// overwritten in place, so no storage is allocated while nothing else holds `data`; otherwise `data` becomes a
    /// new dictionary of the entries (the last of a key sent twice). `find` is where an entry's key is in `data`,
    /// `key` the key an entry is stored under (nil: none, and the entry is left out).
    private static func store<Key: Hashable>(
        _ entries: UnsafeBufferPointer<AdvertisedEntry>, into data: inout [Key: [UInt8]],
        find: (AdvertisedEntry, [Key: [UInt8]]) -> Dictionary<Key, [UInt8]>.Index?, key: (AdvertisedEntry) -> Key?
    ) {
        // Every entry found, and no two at the same key: with as many entries as keys, the same key set.
        var sameKeys = entries.count == data.count
        for i in entries.indices where sameKeys {
            guard let at = find(entries[i], data) else {
                sameKeys = false
                break
            }
            sameKeys = !entries[..<i].contains { find($0, data) == at }
        }
        if sameKeys {
            for entry in entries {
                if let at = find(entry, data) { overwrite(&data.values[at], with: entry.bytes) }
            }
            return
        }
        var fresh = [Key: [UInt8]](minimumCapacity: entries.count)
        for entry in entries {
            if let key = key(entry) { fresh[key] = Array(entry.bytes) }
        }
        data = fresh
    }

    /// Where a ServiceData entry's UUID is among the stored ones, kept in lower case (`lowercasedUUID`): an ASCII
    /// case-blind scan (there are one or two).
    private static func storedUUID(
        of entry: AdvertisedEntry, in data: [String: [UInt8]]
    ) -> Dictionary<String, [UInt8]>.Index? {
        guard let uuid = entry.uuid else { return nil }
        var i = data.startIndex
        while i != data.endIndex {
            if data.keys[i].withCString({ strcasecmp(uuid, $0) == 0 }) { return i }
            data.formIndex(after: &i)
        }
        return nil
    }

    /// A notification under StartNotify, read in place: `PropertiesChanged` of `GattCharacteristic1` that changed
    /// `Value` (an `ay`) and nothing else, with nothing invalidated. Returns the object path and the value; nil for
    /// any other signal or shape. Nothing is changed: `setValue(_:at:)` stores it.
    static func readValueSignal(_ signal: DBusSignalView) -> (path: String, value: [UInt8])? {
        var arguments = signal.arguments()
        guard arguments.string(equals: BlueZName.characteristic), var changed = arguments.enter(),
            let invalidated = arguments.enter(), invalidated.isAtEnd, arguments.isAtEnd,
            var entry = changed.enter(), changed.isAtEnd, entry.string(equals: "Value"),
            var variant = entry.enter(), entry.isAtEnd, let value = variant.bytes(), variant.isAtEnd,
            let path = signal.path
        else { return nil }
        return (path, value)
    }

    /// Stores a characteristic's `Value` as `apply(_:)` stores it from a `PropertiesChanged`; false (nothing
    /// changed) when the mirror has no such characteristic.
    mutating func setValue(_ value: [UInt8], at path: String) -> Bool {
        guard let at = storage.index(forKey: path), storage.values[at][BlueZName.characteristic] != nil else {
            return false
        }
        storage.values[at][BlueZName.characteristic]?["Value"] = .bytes(value)
        return true
    }

    /// Adds `fields` to a slot's `ahead`; true when nothing was ahead before. (One access to the slot, in place: a
    /// read through `Dictionary.Values` copies the whole device value.)
    private static func mark(_ ahead: inout AdvertisementFields, _ fields: AdvertisementFields) -> Bool {
        let wasSettled = ahead.isEmpty
        ahead.formUnion(fields)
        return wasSettled
    }

    /// Replaces `bytes`' contents, in its own storage when that is unshared and large enough.
    private static func overwrite(_ bytes: inout [UInt8], with new: UnsafeBufferPointer<UInt8>) {
        bytes.replaceSubrange(0..<bytes.count, with: new)
    }

    /// Writes the advertisement fields of `path` that were updated in place back into its properties.
    private mutating func settle(_ path: String) {
        guard slotsAhead > 0, let at = deviceValues.index(forKey: ObjectPathKey(path)),
            !deviceValues.values[at].ahead.isEmpty
        else { return }
        Self.write(deviceValues.values[at].ahead, of: deviceValues.values[at].device, into: &storage[path])
        deviceValues.values[at].ahead = []
        slotsAhead -= 1
    }

    /// Sets `fields` of `device` in `interfaces`' Device1 properties, as `apply(_:)` would have stored them.
    private static func write(
        _ fields: AdvertisementFields, of device: BlueZDevice, into interfaces: inout [String: [String: DBusValue]]?
    ) {
        guard interfaces?[BlueZName.device] != nil else { return }
        if fields.contains(.rssi) { interfaces?[BlueZName.device]?["RSSI"] = device.rssi.map { .int16($0) } }
        if fields.contains(.txPower) { interfaces?[BlueZName.device]?["TxPower"] = device.txPower.map { .int16($0) } }
        if fields.contains(.manufacturerData) {
            let entries = device.manufacturerData.sorted { $0.key < $1.key }.map {
                DBusDictEntry(key: .uint16($0.key), value: .variant(.bytes($0.value)))
            }
            interfaces?[BlueZName.device]?["ManufacturerData"] = .dictionary(key: "q", value: "v", entries)
        }
        if fields.contains(.serviceData) {
            let entries = device.serviceData.sorted { $0.key < $1.key }.map {
                DBusDictEntry(key: .string($0.key), value: .variant(.bytes($0.value)))
            }
            interfaces?[BlueZName.device]?["ServiceData"] = .dictionary(key: "s", value: "v", entries)
        }
    }

    mutating func clear() {
        storage = [:]
        slotsAhead = 0
        adapterPaths = []
        devicePaths = []
        devicesByAddress = [:]
        deviceAddresses = [:]
        deviceValues = [:]
    }

    // MARK: queries

    func properties(_ path: String, _ interface: String) -> [String: DBusValue]? {
        guard interface == BlueZName.device, slotsAhead > 0, let slot = deviceValues[ObjectPathKey(path)],
            !slot.ahead.isEmpty
        else {
            return storage[path]?[interface]
        }
        var interfaces = storage[path]
        Self.write(slot.ahead, of: slot.device, into: &interfaces)
        return interfaces?[interface]
    }

    func has(_ path: String, _ interface: String) -> Bool { storage[path]?[interface] != nil }

    /// True when the mirror has an object at `path`.
    func hasObject(_ path: String) -> Bool { storage[path] != nil }

    /// The paths of every object.
    var objectPaths: Dictionary<String, [String: [String: DBusValue]]>.Keys { storage.keys }

    /// Every object with its properties (the advertisement fields updated in place written in: a dictionary's
    /// entries then come in key order, ServiceData's UUIDs in lower case).
    var objects: [String: [String: [String: DBusValue]]] {
        guard slotsAhead > 0 else { return storage }
        var copy = storage
        for (key, slot) in deviceValues where !slot.ahead.isEmpty {
            Self.write(slot.ahead, of: slot.device, into: &copy[key.path])
        }
        return copy
    }

    var adapters: [BlueZAdapter] {
        adapterPaths.compactMap { adapter(at: $0) }
    }

    func adapter(at path: String) -> BlueZAdapter? {
        guard let ifaces = storage[path], let p = ifaces[BlueZName.adapter] else { return nil }
        let name = path.split(separator: "/").last.map(String.init) ?? path
        return BlueZAdapter(
            path: path, name: name, address: (p["Address"]?.string ?? "").uppercased(),
            powered: p["Powered"]?.bool ?? false, discovering: p["Discovering"]?.bool ?? false,
            roles: (p["Roles"]?.arrayElements ?? []).compactMap(\.string),
            supportsAdvertisementMonitor: ifaces[BlueZName.monitorManager] != nil)
    }

    func adapterState(_ selector: BlueZAdapterSelector) -> BlueZAdapterState {
        guard let adapter = adapters.first(where: selector.matches) else { return .absent }
        return adapter.powered ? .on(adapter) : .off(adapter)
    }

    func device(at path: String) -> BlueZDevice? { deviceValues[ObjectPathKey(path)]?.device }

    var devices: [BlueZDevice] { devicePaths.sorted().compactMap { device(at: $0) } }

    /// The device with `address` on `adapterPath` (any adapter when nil); the first in path order when several are.
    func device(address: String, adapterPath: String?) -> BlueZDevice? {
        guard let paths = devicesByAddress[address.uppercased()] else { return nil }
        return paths.sorted().lazy.compactMap { device(at: $0) }.first {
            adapterPath == nil || $0.adapterPath == adapterPath
        }
    }

    func service(at path: String) -> BlueZService? {
        guard let p = storage[path]?[BlueZName.gattService] else { return nil }
        return BlueZService(
            path: path, uuid: (p["UUID"]?.string ?? "").lowercased(), primary: p["Primary"]?.bool ?? true,
            handle: p["Handle"]?.uint16, devicePath: p["Device"]?.string ?? "")
    }

    func services(ofDevice devicePath: String) -> [BlueZService] {
        storage.keys.compactMap { service(at: $0) }.filter { $0.devicePath == devicePath }
            .sorted { ($0.handle ?? 0, $0.path) < ($1.handle ?? 0, $1.path) }
    }

    func characteristic(at path: String) -> BlueZCharacteristic? {
        guard let p = storage[path]?[BlueZName.characteristic] else { return nil }
        return BlueZCharacteristic(
            path: path, uuid: (p["UUID"]?.string ?? "").lowercased(), servicePath: p["Service"]?.string ?? "",
            flags: (p["Flags"]?.arrayElements ?? []).compactMap(\.string), handle: p["Handle"]?.uint16,
            mtu: p["MTU"]?.uint16, notifyAcquireAvailable: p["NotifyAcquired"] != nil,
            notifying: p["Notifying"]?.bool ?? false, value: p["Value"]?.bytes)
    }

    func characteristics(ofService servicePath: String) -> [BlueZCharacteristic] {
        storage.keys.compactMap { characteristic(at: $0) }.filter { $0.servicePath == servicePath }
            .sorted { ($0.handle ?? 0, $0.path) < ($1.handle ?? 0, $1.path) }
    }

    func descriptor(at path: String) -> BlueZDescriptor? {
        guard let p = storage[path]?[BlueZName.descriptor] else { return nil }
        return BlueZDescriptor(
            path: path, uuid: (p["UUID"]?.string ?? "").lowercased(),
            characteristicPath: p["Characteristic"]?.string ?? "",
            flags: (p["Flags"]?.arrayElements ?? []).compactMap(\.string), value: p["Value"]?.bytes)
    }

    func descriptors(ofCharacteristic characteristicPath: String) -> [BlueZDescriptor] {
        storage.keys.compactMap { descriptor(at: $0) }.filter { $0.characteristicPath == characteristicPath }
            .sorted { $0.path < $1.path }
    }

    /// The device path a service, characteristic or descriptor belongs to, following the properties upwards.
    func devicePath(ofAttribute path: String) -> String? {
        if let d = descriptor(at: path) { return devicePath(ofAttribute: d.characteristicPath) }
        if let c = characteristic(at: path) { return service(at: c.servicePath)?.devicePath }
        if let s = service(at: path) { return s.devicePath }
        return nil
    }
}

extension BlueZDevice {
    /// The device as `Device1`'s properties describe it.
    init(path: String, properties p: [String: DBusValue]) {
        self.init(
            path: path, adapterPath: p["Adapter"]?.string ?? "", address: Self.address(p),
            addressType: p["AddressType"]?.string ?? "public", name: p["Name"]?.string, alias: p["Alias"]?.string,
            rssi: p["RSSI"]?.int16, txPower: p["TxPower"]?.int16, manufacturerData: Self.manufacturerData(p),
            serviceData: Self.serviceData(p), uuids: Self.uuids(p), connected: p["Connected"]?.bool ?? false,
            servicesResolved: p["ServicesResolved"]?.bool ?? false, paired: p["Paired"]?.bool ?? false)
    }

    /// Rebuilds the fields of the properties that changed or were invalidated from `p`, the merged properties.
    mutating func refresh<Keys: Sequence<String>>(_ changed: Keys, _ invalidated: [String], from p: [String: DBusValue])
    {
        for key in changed { refresh(key, from: p) }
        for key in invalidated { refresh(key, from: p) }
    }

    private mutating func refresh(_ key: String, from p: [String: DBusValue]) {
        switch key {
        case "RSSI": rssi = p["RSSI"]?.int16
        case "ManufacturerData": manufacturerData = Self.manufacturerData(p)
        case "ServiceData": serviceData = Self.serviceData(p)
        case "TxPower": txPower = p["TxPower"]?.int16
        case "Name": name = p["Name"]?.string
        case "Alias": alias = p["Alias"]?.string
        case "UUIDs": uuids = Self.uuids(p)
        case "Connected": connected = p["Connected"]?.bool ?? false
        case "ServicesResolved": servicesResolved = p["ServicesResolved"]?.bool ?? false
        case "Paired": paired = p["Paired"]?.bool ?? false
        case "Adapter": adapterPath = p["Adapter"]?.string ?? ""
        case "AddressType": addressType = p["AddressType"]?.string ?? "public"
        case "Address": address = Self.address(p)
        default: return
        }
    }

    private static func address(_ p: [String: DBusValue]) -> String {
        let text = p["Address"]?.string ?? ""
        // BlueZ spells addresses in upper case already; uppercased() would allocate a copy of every one.
        return text.utf8.contains(where: { $0 >= UInt8(ascii: "a") && $0 <= UInt8(ascii: "z") })
            ? text.uppercased() : text
    }

    private static func manufacturerData(_ p: [String: DBusValue]) -> [UInt16: [UInt8]] {
        var out: [UInt16: [UInt8]] = [:]
        for entry in p["ManufacturerData"]?.dictionaryEntries ?? [] {
            if let id = entry.key.uint16, let bytes = entry.value.bytes { out[id] = bytes }
        }
        return out
    }

    private static func serviceData(_ p: [String: DBusValue]) -> [String: [UInt8]] {
        var out: [String: [UInt8]] = [:]
        for entry in p["ServiceData"]?.dictionaryEntries ?? [] {
            if let uuid = entry.key.string, let bytes = entry.value.bytes { out[lowercasedUUID(uuid)] = bytes }
        }
        return out
    }

    /// BlueZ spells UUIDs in lower case already; lowercased() would allocate a copy of every one.
    static func lowercasedUUID(_ text: String) -> String {
        text.utf8.contains(where: { $0 >= UInt8(ascii: "A") && $0 <= UInt8(ascii: "Z") }) ? text.lowercased() : text
    }

    private static func uuids(_ p: [String: DBusValue]) -> [String] {
        (p["UUIDs"]?.arrayElements ?? []).compactMap { $0.string?.lowercased() }
    }
}

/// An object path as a dictionary key: made from a String to be stored, or over a message's own bytes for a lookup
/// that allocates nothing (`init(unsafeBorrowing:)`). Both hash and compare as their UTF-8 bytes.
struct ObjectPathKey: Hashable, @unchecked Sendable {
    // @unchecked: a borrowed key is only made for a lookup; stored keys always own their String.
    private let owned: String
    private let borrowed: UnsafeBufferPointer<UInt8>?

    /// A key that owns `path`.
    init(_ path: String) {
        owned = path
        borrowed = nil
    }

    /// A key over `bytes`, for a lookup while they live; never stored.
    init(unsafeBorrowing bytes: UnsafeBufferPointer<UInt8>) {
        owned = ""
        borrowed = bytes
    }

    /// The path (of an owned key).
    var path: String { owned }

    private func withBytes<R>(_ body: (UnsafeBufferPointer<UInt8>) -> R) -> R {
        if let borrowed { return body(borrowed) }
        // A native string's bytes in place: no copy of the String (a retain and a release per comparison).
        if let result = owned.utf8.withContiguousStorageIfAvailable(body) { return result }
        var path = owned
        return path.withUTF8(body)
    }

    func hash(into hasher: inout Hasher) {
        withBytes { hasher.combine(bytes: UnsafeRawBufferPointer($0)) }
    }

    static func == (lhs: ObjectPathKey, rhs: ObjectPathKey) -> Bool {
        lhs.withBytes { a in
            rhs.withBytes { b in
                guard a.count == b.count else { return false }
                guard let x = a.baseAddress, let y = b.baseAddress else { return true }  // both empty
                return memcmp(x, y, a.count) == 0
            }
        }
    }
}
