// The pure parts of the simulation: GATT handle numbering, object paths, discovery filters, advertisement content
// and the property diff rules of BlueZ's device.c. No D-Bus here, so all of it is unit-testable.

/// A characteristic or descriptor of the simulated GATT database with its BlueZ handle.
struct SimGATTLayout: Sendable, Equatable {
    struct Descriptor: Sendable, Equatable {
        var handle: UInt16
        var uuid: SimUUID
        var value: [UInt8]
        /// The object path suffix (`/service000c/char000d/desc000f`).
        var pathSuffix: String
    }
    struct Characteristic: Sendable, Equatable {
        /// The declaration handle (the object path and `Handle` property use it; the value handle is +1).
        var handle: UInt16
        var spec: SimCharacteristicSpec
        var descriptors: [Descriptor]
        var pathSuffix: String
        /// Index into `descriptors` of the CCCD, if any.
        var cccdIndex: Int?
    }
    struct Service: Sendable, Equatable {
        var handle: UInt16
        var endHandle: UInt16
        var uuid: SimUUID
        var primary: Bool
        var characteristics: [Characteristic]
        var pathSuffix: String
    }
    var services: [Service]

    /// Numbers attributes the way a typical peripheral lays them out and BlueZ reports them: the first service at
    /// handle 0x0001; a characteristic takes a declaration and a value handle; its CCCD (added for notify/indicate)
    /// comes right after the value, then the scenario's descriptors.
    init(_ gatt: [SimServiceSpec]) {
        var handle: UInt16 = 1
        services = []
        for s in gatt {
            let sh = handle
            handle &+= 1
            let sp = "/service" + hex4(sh)
            var chars: [Characteristic] = []
            for c in s.characteristics {
                let ch = handle
                handle &+= 2
                let cp = sp + "/char" + hex4(ch)
                var descs: [Descriptor] = []
                var cccd: Int?
                if c.flags.contains("notify") || c.flags.contains("indicate") {
                    cccd = 0
                    descs.append(
                        Descriptor(
                            handle: handle, uuid: SimUUID("2902")!, value: [0, 0],
                            pathSuffix: cp + "/desc" + hex4(handle)))
                    handle &+= 1
                }
                for d in c.descriptors {
                    descs.append(
                        Descriptor(
                            handle: handle, uuid: d.uuid, value: d.value, pathSuffix: cp + "/desc" + hex4(handle)))
                    handle &+= 1
                }
                chars.append(Characteristic(handle: ch, spec: c, descriptors: descs, pathSuffix: cp, cccdIndex: cccd))
            }
            services.append(
                Service(
                    handle: sh, endHandle: handle &- 1, uuid: s.uuid, primary: s.primary,
                    characteristics: chars, pathSuffix: sp))
        }
    }
}

/// `%04x`.
func hex4(_ v: UInt16) -> String {
    let s = String(v, radix: 16)
    return String(repeating: "0", count: max(0, 4 - s.count)) + s
}

/// `dev_AA_BB_CC_DD_EE_FF`.
func deviceComponent(_ address: String) -> String {
    "dev_" + address.uppercased().map { $0 == ":" ? "_" : $0 }.map(String.init).joined()
}

/// One client's discovery filter (Adapter1.SetDiscoveryFilter).
struct SimDiscoveryFilter: Sendable, Equatable {
    var uuids: [SimUUID] = []
    var rssi: Int?
    var pathloss: Int?
    var transport: String = "auto"
    var duplicateData = false
    var discoverable = false
    var pattern: String?
    init() {}

    /// The keys BlueZ accepts.
    static let knownKeys: Set<String> = [
        "UUIDs", "RSSI", "Pathloss", "Transport", "DuplicateData", "Discoverable", "Pattern", "AutoConnect",
    ]

    /// True when an advertisement with these properties passes this filter (adapter.c `is_filter_match`).
    func matches(name: String?, address: String, rssi: Int, txPower: Int?, uuids: [SimUUID]) -> Bool {
        if transport == "bredr" { return false }
        if !self.uuids.isEmpty, !uuids.contains(where: { self.uuids.contains($0) }) { return false }
        if let threshold = self.rssi, rssi < threshold { return false }
        if let pathloss, let txPower, txPower - rssi > pathloss { return false }
        if let pattern, !pattern.isEmpty {
            if !address.hasPrefix(pattern.uppercased()), !(name ?? "").hasPrefix(pattern) { return false }
        }
        return true
    }
}

/// Per-device advertisement state as BlueZ has reported it, and the diff rules for a new advertisement.
struct SimAdvertisementState: Sendable, Equatable {
    /// What BlueZ last signalled (nil = absent or invalidated).
    var rssi: Int?
    var txPower: Int?
    var manufacturerData: [UInt16: [UInt8]] = [:]
    var serviceData: [String: [UInt8]] = [:]
    var uuids: [String] = []
    var name: String?
    init() {}

    /// One received advertisement.
    struct Advertisement: Sendable, Equatable {
        var rssi: Int
        var txPower: Int?
        var name: String?
        var manufacturerData: [(UInt16, [UInt8])]
        var serviceData: [(SimUUID, [UInt8])]
        var uuids: [SimUUID]
        static func == (a: Advertisement, b: Advertisement) -> Bool {
            a.rssi == b.rssi && a.txPower == b.txPower && a.name == b.name && a.uuids == b.uuids
                && a.manufacturerData.map(\.0) == b.manufacturerData.map(\.0)
                && a.manufacturerData.map(\.1) == b.manufacturerData.map(\.1)
                && a.serviceData.map(\.0) == b.serviceData.map(\.0) && a.serviceData.map(\.1) == b.serviceData.map(\.1)
        }
    }

    /// The names of the Device1 properties that changed; updates the state.
    /// - Parameters:
    ///   - rssiThreshold: 8 dBm, or 0 when a filter sets RSSI/Pathloss.
    ///   - duplicateData: a client asked for DuplicateData: data is re-signalled on every advertisement.
    ///   - servicesResolved: after resolution, advertised UUIDs are ignored.
    mutating func apply(_ adv: Advertisement, rssiThreshold: Int, duplicateData: Bool, servicesResolved: Bool)
        -> Set<String>
    {
        var changed: Set<String> = []
        if rssi == nil || abs((rssi ?? 0) - adv.rssi) >= max(rssiThreshold, 1)
            || (rssiThreshold == 0 && rssi != adv.rssi)
        {
            rssi = adv.rssi
            changed.insert("RSSI")
        }
        if adv.txPower != txPower, let t = adv.txPower {
            txPower = t
            changed.insert("TxPower")
        }
        if let n = adv.name, n != name {
            name = n
            changed.insert("Name")
        }
        if duplicateData, !adv.manufacturerData.isEmpty { manufacturerData = [:] }
        for (company, data) in adv.manufacturerData where manufacturerData[company] != data || duplicateData {
            manufacturerData[company] = data
            changed.insert("ManufacturerData")
        }
        if duplicateData, !adv.serviceData.isEmpty { serviceData = [:] }
        for (uuid, data) in adv.serviceData where serviceData[uuid.string] != data || duplicateData {
            serviceData[uuid.string] = data
            changed.insert("ServiceData")
        }
        if !servicesResolved {
            for u in adv.uuids.map(\.string) + adv.serviceData.map(\.0.string) where !uuids.contains(u) {
                uuids.append(u)
                changed.insert("UUIDs")
            }
        }
        return changed
    }
}

/// An ATT error a read or write can be made to fail with, and its BlueZ D-Bus mapping (`create_gatt_dbus_error`).
func simATTError(_ code: UInt8, write: Bool) -> (name: String, message: String) {
    switch code {
    case 0x02: return ("org.bluez.Error.NotPermitted", "Read not permitted")
    case 0x03: return ("org.bluez.Error.NotPermitted", "Write not permitted")
    case 0x05, 0x0f, 0x0c: return ("org.bluez.Error.NotPermitted", "Not paired")
    case 0x07: return ("org.bluez.Error.InvalidArguments", "Invalid offset")
    case 0x0d: return ("org.bluez.Error.InvalidArguments", "Invalid Length")
    case 0x08: return ("org.bluez.Error.NotAuthorized", "Operation Not Authorized")
    case 0x06: return ("org.bluez.Error.NotSupported", "Operation is not supported")
    case 0x00: return ("org.bluez.Error.Failed", "Operation failed")
    default:
        let h = String(code, radix: 16)
        return ("org.bluez.Error.Failed", "Operation failed with ATT error: 0x" + (h.count < 2 ? "0" + h : h))
    }
}

/// True for a private (resolvable or non-resolvable) random address, which BlueZ never makes non-temporary.
func isPrivateRandomAddress(_ address: String, type: String) -> Bool {
    guard type == "random", let first = UInt8(address.prefix(2), radix: 16) else { return false }
    return first >> 6 != 0b11
}

/// A small deterministic PRNG (xorshift) so RSSI jitter is reproducible per peripheral.
struct SimRandom: Sendable {
    var state: UInt64
    init(seed: String) {
        var h: UInt64 = 0xcbf2_9ce4_8422_2325
        for b in seed.utf8 { h = (h ^ UInt64(b)) &* 0x100_0000_01b3 }
        state = h | 1
    }
    mutating func next() -> UInt64 {
        state ^= state << 13
        state ^= state >> 7
        state ^= state << 17
        return state
    }
    /// Uniform in -jitter...jitter.
    mutating func jitter(_ jitter: Int) -> Int {
        guard jitter > 0 else { return 0 }
        return Int(next() % UInt64(2 * jitter + 1)) - jitter
    }
}

/// Advertising-data structures (AD type + bytes) of an advertisement, for AdvertisementMonitor pattern matching.
func advertisingStructures(_ adv: SimAdvertisementState.Advertisement, connectable: Bool) -> [(UInt8, [UInt8])] {
    var out: [(UInt8, [UInt8])] = [(0x01, [connectable ? 0x06 : 0x04])]
    let short = adv.uuids.compactMap(\.short16)
    if !short.isEmpty { out.append((0x03, short.flatMap { [UInt8($0 & 0xFF), UInt8($0 >> 8)] })) }
    if let n = adv.name { out.append((0x09, Array(n.utf8))) }
    if let t = adv.txPower { out.append((0x0A, [UInt8(bitPattern: Int8(clamping: t))])) }
    for (uuid, data) in adv.serviceData {
        if let s = uuid.short16 { out.append((0x16, [UInt8(s & 0xFF), UInt8(s >> 8)] + data)) }
    }
    for (company, data) in adv.manufacturerData {
        out.append((0xFF, [UInt8(company & 0xFF), UInt8(company >> 8)] + data))
    }
    return out
}

/// An or_patterns entry: (start position, AD type, content).
struct SimMonitorPattern: Sendable, Equatable {
    var start: Int
    var adType: UInt8
    var content: [UInt8]
    func matches(_ structures: [(UInt8, [UInt8])]) -> Bool {
        structures.contains { type, data in
            type == adType && start >= 0 && data.count >= start + content.count
                && Array(data[start..<(start + content.count)]) == content
        }
    }
}
