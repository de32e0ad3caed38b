// The scenario model: what the simulated radio world contains, parsed from YAML/JSON with errors naming the key path.
import YAML

/// A scenario error: the key path that caused it and why (`peripherals[2].gatt[0].uuid: "2A3" is not a UUID`).
public struct ScenarioError: Error, Sendable, Equatable, CustomStringConvertible {
    /// The key path, e.g. `peripherals[2].gatt[0].characteristics[1].uuid` (empty for the document itself).
    public var path: String
    /// Why the value was rejected.
    public var reason: String
    /// Creates an error for `path` (empty for the document) with a human-readable `reason`.
    public init(path: String, reason: String) {
        self.path = path
        self.reason = reason
    }
    /// `path: reason`, or just the reason for the whole document.
    public var description: String { path.isEmpty ? reason : "\(path): \(reason)" }
}

/// A Bluetooth UUID normalised to BlueZ's 128-bit lowercase text (`0000180d-0000-1000-8000-00805f9b34fb`).
public struct SimUUID: Hashable, Sendable, CustomStringConvertible {
    /// The 128-bit lowercase form.
    public let string: String

    /// Accepts `180D`, `0x180d`, 32-bit `0000180D`, or the 128-bit dashed form; nil otherwise.
    public init?(_ text: String) {
        var t = text.lowercased()
        if t.hasPrefix("0x") { t.removeFirst(2) }
        let hex = Set("0123456789abcdef")
        if t.count == 4 || t.count == 8, t.allSatisfy({ hex.contains($0) }) {
            string = String(repeating: "0", count: 8 - t.count) + t + "-0000-1000-8000-00805f9b34fb"
            return
        }
        let parts = t.split(separator: "-", omittingEmptySubsequences: false)
        guard parts.map(\.count) == [8, 4, 4, 4, 12], parts.allSatisfy({ $0.allSatisfy { hex.contains($0) } }) else {
            return nil
        }
        string = t
    }

    /// The 16-bit short form when this is a SIG base UUID with a 16-bit value.
    public var short16: UInt16? {
        guard string.hasSuffix("-0000-1000-8000-00805f9b34fb"), string.hasPrefix("0000") else { return nil }
        return UInt16(string.dropFirst(4).prefix(4), radix: 16)
    }

    /// The 128-bit lowercase form.
    public var description: String { string }
}

/// A value that cycles through a list (or stays fixed when the list has one element).
public struct SimSequence: Sendable, Equatable {
    /// The values, in order (at least one).
    public var values: [[UInt8]]
    /// Seconds each value lasts; nil = advance on every advertisement.
    public var period: Double?
    /// Creates a sequence; `period` nil advances on every advertisement.
    public init(values: [[UInt8]], period: Double? = nil) {
        self.values = values
        self.period = period
    }
    /// The value current at `time` (seconds since start), or for advertisement number `count`.
    public func value(at time: Double, count: Int) -> [UInt8] {
        guard !values.isEmpty else { return [] }
        let index: Int
        if let period, period > 0 { index = Int((time / period).rounded(.down)) } else { index = count }
        return values[((index % values.count) + values.count) % values.count]
    }
}

/// How a characteristic's notifications are generated.
public struct SimNotifyGenerator: Sendable, Equatable {
    /// Where the values come from.
    public enum Source: Sendable, Equatable {
        /// Cycles through the values.
        case sequence([[UInt8]])
        /// An unsigned little-endian counter of `size` bytes.
        case counter(start: UInt64, step: UInt64, size: Int)
    }
    /// The value source.
    public var source: Source
    /// Notifications per second; 0 = only on demand (PushNotification).
    public var rateHz: Double

    /// The value of notification number `index`.
    public func value(_ index: Int) -> [UInt8] {
        switch source {
        case .sequence(let values):
            return values.isEmpty ? [] : values[index % values.count]
        case .counter(let start, let step, let size):
            let v = start &+ step &* UInt64(index)
            return (0..<size).map { UInt8(truncatingIfNeeded: v >> (8 * UInt64($0))) }
        }
    }
}

/// A GATT descriptor in the scenario.
public struct SimDescriptorSpec: Sendable, Equatable {
    /// The descriptor UUID.
    public var uuid: SimUUID
    /// The value reads return.
    public var value: [UInt8]
}

/// A GATT characteristic in the scenario.
public struct SimCharacteristicSpec: Sendable, Equatable {
    /// The characteristic UUID.
    public var uuid: SimUUID
    /// Client-side flags in BlueZ's order (`read`, `write-without-response`, `write`, `notify`, `indicate`...).
    public var flags: [String]
    /// The peripheral-side value (what reads return).
    public var value: [UInt8]
    /// Descriptors besides the automatic CCCD (a 0x2904 from `presentation_format` included).
    public var descriptors: [SimDescriptorSpec]
    /// The notification generator, if any.
    public var notify: SimNotifyGenerator?
    /// UUID of the characteristic on which a write is echoed as a notification.
    public var echoTo: SimUUID?
}

/// A GATT service in the scenario.
public struct SimServiceSpec: Sendable, Equatable {
    /// The service UUID.
    public var uuid: SimUUID
    /// Whether it is a primary service.
    public var primary: Bool
    /// The characteristics, in handle order.
    public var characteristics: [SimCharacteristicSpec]
}

/// The order of `ServicesResolved` against `Connected` and the `Connect()` reply on a reconnect whose GATT database
/// bluetoothd has cached (the DB hash matched, so it skips discovery). A first connect always uses `afterReply`.
public enum SimServicesResolvedOrder: String, Sendable, Hashable, CaseIterable {
    /// `Connected: true`, the reply, then (after the services delay) `{UUIDs, ServicesResolved: true}`.
    case afterReply = "after-reply"
    /// One `PropertiesChanged {Connected: true, UUIDs, ServicesResolved: true}`, then (after the services delay)
    /// the reply.
    case withConnected = "with-connected"
    /// `Connected: true`, then `ServicesResolved: true` in a signal of its own, then (after the services delay) the
    /// reply.
    case beforeReply = "before-reply"
    /// `ServicesResolved` is not reset on disconnect: it stays true while `Connected` toggles, so a reconnect
    /// signals only `Connected: true` and the reply.
    case kept
}

/// One simulated peripheral.
public struct SimPeripheralSpec: Sendable, Equatable {
    /// The device address, upper-case.
    public var address: String
    /// `public` or `random`.
    public var addressType: String
    /// The adapter id (`hci0`).
    public var adapter: String
    /// The advertised local name.
    public var name: String?
    /// The GAP appearance.
    public var appearance: UInt16?
    /// Mean RSSI in dBm.
    public var rssi: Int
    /// Uniform jitter in dBm around `rssi`.
    public var rssiJitter: Int
    /// Advertised TX power in dBm.
    public var txPower: Int?
    /// Seconds between advertisements.
    public var advertisingInterval: Double
    /// Whether it accepts connections.
    public var connectable: Bool
    /// Whether it advertises.
    public var advertising: Bool
    /// Advertised service UUIDs.
    public var serviceUUIDs: [SimUUID]
    /// Manufacturer data per company id.
    public var manufacturerData: [(company: UInt16, data: SimSequence)]
    /// Service data per UUID.
    public var serviceData: [(uuid: SimUUID, data: SimSequence)]
    /// Seconds from Connect() to the link coming up.
    public var connectDelay: Double
    /// Seconds from the Connect reply to ServicesResolved.
    public var servicesDelay: Double
    /// Seconds from Disconnect() to Connected=false.
    public var disconnectDelay: Double
    /// The GATT database.
    public var gatt: [SimServiceSpec]
    /// Paired and bonded before start-up: the device object exists from the start (no RSSI) like BlueZ's cache.
    public var paired: Bool = false
    /// How `ServicesResolved` arrives on a reconnect with the GATT cache.
    public var servicesResolved: SimServicesResolvedOrder = .afterReply

    /// Equality over the fields tests compare (tuples are not Equatable).
    public static func == (a: SimPeripheralSpec, b: SimPeripheralSpec) -> Bool {
        a.address == b.address && a.name == b.name && a.gatt == b.gatt && a.rssi == b.rssi
            && a.manufacturerData.map(\.company) == b.manufacturerData.map(\.company)
            && a.manufacturerData.map(\.data) == b.manufacturerData.map(\.data)
            && a.serviceData.map(\.uuid) == b.serviceData.map(\.uuid)
            && a.serviceData.map(\.data) == b.serviceData.map(\.data)
    }
}

/// One simulated adapter.
public struct SimAdapterSpec: Sendable, Equatable {
    /// The adapter name (`hci0`).
    public var id: String
    /// The adapter address.
    public var address: String
    /// Name and Alias.
    public var name: String
    /// Whether it starts powered.
    public var powered: Bool
}

/// A whole scenario.
public struct Scenario: Sendable, Equatable {
    /// The adapters (at least one).
    public var adapters: [SimAdapterSpec]
    /// The peripherals, in file order.
    public var peripherals: [SimPeripheralSpec]
    /// Seconds after its last advertisement that a temporary device is removed (BlueZ TemporaryTimeout).
    public var temporaryTimeout: Double
    /// The ATT MTU reported by AcquireNotify/AcquireWrite and the MTU property.
    public var mtu: UInt16
    /// Keep GATT objects exported across disconnects (BlueZ `[GATT] Cache = always`).
    public var gattCache: Bool
    /// Seconds bluetoothd waits for a local GATT application's or advertisement's answer before the simulated
    /// central gets an ATT error (`settings.local_gatt_timeout`; real bluetoothd waits the D-Bus default of 25 s).
    public var localGATTTimeout: Double = 5
    /// Seconds after each (re)start before the adapters the scenario powers are powered: they are exported with
    /// `Powered: false` first, as bluetoothd's AutoEnable does on real hardware (`settings.auto_enable_delay`).
    public var autoEnableDelay: Double = 0
    /// Emit `Device1.Disconnected(reason, message)` before `Connected: false` (newer BlueZ); bluetoothd 5.66 of
    /// Debian 12 has no such signal (`settings.disconnected_signal`).
    public var disconnectedSignal: Bool = true

    /// Parses and validates scenario text (YAML or JSON).
    public static func parse(_ text: String) throws(ScenarioError) -> Scenario {
        let root: YAMLNode
        do { root = try YAMLParser.parse(text) } catch {
            throw ScenarioError(path: "", reason: "invalid YAML at \(error)")
        }
        return try ScenarioReader.scenario(root)
    }

    /// Parses one peripheral (the control interface's AddPeripheral), with the scenario's adapters for checks.
    public func parsePeripheral(_ text: String, path: String = "peripheral") throws(ScenarioError) -> SimPeripheralSpec
    {
        let root: YAMLNode
        do { root = try YAMLParser.parse(text) } catch {
            throw ScenarioError(path: path, reason: "invalid YAML at \(error)")
        }
        let p = try ScenarioReader.peripheral(root, path: path, defaultAdapter: adapters.first?.id ?? "hci0")
        guard adapters.contains(where: { $0.id == p.adapter }) else {
            throw ScenarioError(path: path + ".adapter", reason: "\"\(p.adapter)\" is not a declared adapter")
        }
        return p
    }
}

/// Key-path-aware readers of the YAML tree.
enum ScenarioReader {
    typealias E = ScenarioError

    static func mapping(_ node: YAMLNode, _ path: String, allowed: Set<String>) throws(E) -> YAMLNode {
        guard let entries = node.mapping else {
            throw E(path: path, reason: "expected a mapping, found \(node.kindDescription)")
        }
        for entry in entries where !allowed.contains(entry.key) {
            let known = allowed.sorted().joined(separator: ", ")
            throw E(path: join(path, entry.key), reason: "unknown key (known keys: \(known))")
        }
        return node
    }

    static func join(_ path: String, _ key: String) -> String { path.isEmpty ? key : "\(path).\(key)" }

    static func list(_ node: YAMLNode?, _ path: String) throws(E) -> [YAMLNode] {
        guard let node, !node.isNull else { return [] }
        guard let items = node.sequence else {
            throw E(path: path, reason: "expected a list, found \(node.kindDescription)")
        }
        return items
    }

    static func string(_ node: YAMLNode?, _ path: String) throws(E) -> String? {
        guard let node, !node.isNull else { return nil }
        guard let s = node.scalar else { throw E(path: path, reason: "expected text, found \(node.kindDescription)") }
        return s
    }

    static func bool(_ node: YAMLNode?, _ path: String, default d: Bool) throws(E) -> Bool {
        guard let node, !node.isNull else { return d }
        guard let b = node.bool else { throw E(path: path, reason: "\(node.kindDescription) is not true or false") }
        return b
    }

    static func int(_ node: YAMLNode?, _ path: String, range: ClosedRange<Int>) throws(E) -> Int? {
        guard let node, !node.isNull else { return nil }
        guard let i = node.integer else { throw E(path: path, reason: "\(node.kindDescription) is not an integer") }
        guard range.contains(i) else {
            throw E(path: path, reason: "\(i) is out of range \(range.lowerBound)...\(range.upperBound)")
        }
        return i
    }

    static func number(_ node: YAMLNode?, _ path: String, min: Double = 0, max: Double = 1e9) throws(E) -> Double? {
        guard let node, !node.isNull else { return nil }
        guard let d = node.double, d.isFinite else {
            throw E(path: path, reason: "\(node.kindDescription) is not a number")
        }
        guard d >= min, d <= max else { throw E(path: path, reason: "\(d) is out of range \(min)...\(max)") }
        return d
    }

    static func uuid(_ node: YAMLNode?, _ path: String) throws(E) -> SimUUID {
        guard let node, !node.isNull else { throw E(path: path, reason: "is required") }
        let text: String
        if let i = node.integer, (0...0xFFFF).contains(i) {
            // A plain 180D would parse as text, but 2902 parses as an integer: read it back as hex digits.
            text = node.scalar ?? String(i, radix: 16)
        } else {
            guard let s = node.scalar else { throw E(path: path, reason: "\(node.kindDescription) is not a UUID") }
            text = s
        }
        guard let u = SimUUID(text) else { throw E(path: path, reason: "\"\(text)\" is not a UUID") }
        return u
    }

    static func mac(_ node: YAMLNode?, _ path: String) throws(E) -> String {
        guard let text = try string(node, path) else { throw E(path: path, reason: "is required") }
        guard let m = normaliseMAC(text) else { throw E(path: path, reason: "\"\(text)\" is not a MAC address") }
        return m
    }

    static func normaliseMAC(_ text: String) -> String? {
        let parts = text.split(separator: ":", omittingEmptySubsequences: false)
        guard parts.count == 6, parts.allSatisfy({ $0.count == 2 && UInt8($0, radix: 16) != nil }) else { return nil }
        return text.uppercased()
    }

    /// Hex bytes: "06 48 0a", "06:48:0A", "06480a"; or a mapping {text: "..."} for UTF-8.
    static func bytes(_ node: YAMLNode?, _ path: String) throws(E) -> [UInt8]? {
        guard let node, !node.isNull else { return nil }
        if node.mapping != nil {
            let m = try mapping(node, path, allowed: ["text"])
            guard let t = try string(m["text"], path + ".text") else {
                throw E(path: path + ".text", reason: "is required")
            }
            return Array(t.utf8)
        }
        if node.sequence != nil {
            throw E(path: path, reason: "expected hex bytes like \"06 48\" or {text: ...}, found a sequence")
        }
        guard let s = node.scalar else { return nil }
        let digits = s.filter { !" :-_\t".contains($0) }
        guard digits.count % 2 == 0 else {
            throw E(path: path, reason: "\"\(s)\" is not hex bytes (odd number of digits)")
        }
        var out: [UInt8] = []
        var i = digits.startIndex
        while i < digits.endIndex {
            let j = digits.index(i, offsetBy: 2)
            guard let b = UInt8(digits[i..<j], radix: 16) else {
                throw E(path: path, reason: "\"\(s)\" is not hex bytes")
            }
            out.append(b)
            i = j
        }
        return out
    }

    static func sequence(_ node: YAMLNode, _ path: String) throws(E) -> SimSequence {
        var values: [[UInt8]] = []
        if let v = try bytes(node["value"], path + ".value") { values.append(v) }
        for (i, item) in try list(node["sequence"], path + ".sequence").enumerated() {
            values.append(try bytes(item, "\(path).sequence[\(i)]") ?? [])
        }
        guard !values.isEmpty else { throw E(path: path, reason: "needs `value` or `sequence`") }
        if node["value"] != nil, node["sequence"] != nil {
            throw E(path: path, reason: "has both `value` and `sequence`; give one")
        }
        return SimSequence(values: values, period: try number(node["period"], path + ".period", min: 0.001))
    }

    static func scenario(_ node: YAMLNode) throws(E) -> Scenario {
        let root = try mapping(node, "", allowed: ["settings", "adapters", "peripherals"])
        var temporaryTimeout = 30.0
        var mtu: UInt16 = 517
        var cache = true
        var localTimeout = 5.0
        var autoEnable = 0.0
        var disconnectedSignal = true
        if let s = root["settings"] {
            let settings = try mapping(
                s, "settings",
                allowed: [
                    "temporary_timeout", "mtu", "gatt_cache", "local_gatt_timeout", "auto_enable_delay",
                    "disconnected_signal",
                ])
            disconnectedSignal = try bool(
                settings["disconnected_signal"], "settings.disconnected_signal", default: true)
            autoEnable = try number(settings["auto_enable_delay"], "settings.auto_enable_delay", min: 0) ?? 0
            localTimeout =
                try number(settings["local_gatt_timeout"], "settings.local_gatt_timeout", min: 0.05) ?? 5
            temporaryTimeout = try number(settings["temporary_timeout"], "settings.temporary_timeout", min: 0.01) ?? 30
            mtu = UInt16(try int(settings["mtu"], "settings.mtu", range: 23...517) ?? 517)
            cache = try bool(settings["gatt_cache"], "settings.gatt_cache", default: true)
        }
        var adapters: [SimAdapterSpec] = []
        for (i, item) in try list(root["adapters"], "adapters").enumerated() {
            let path = "adapters[\(i)]"
            let a = try mapping(item, path, allowed: ["id", "address", "name", "powered"])
            let id = try string(a["id"], path + ".id") ?? "hci\(i)"
            guard id.hasPrefix("hci"), Int(id.dropFirst(3)) != nil else {
                throw E(path: path + ".id", reason: "\"\(id)\" is not an adapter name like hci0")
            }
            if adapters.contains(where: { $0.id == id }) {
                throw E(path: path + ".id", reason: "duplicate adapter \"\(id)\"")
            }
            let address = a["address"] == nil ? "00:1A:7D:DA:71:1\(i % 10)" : try mac(a["address"], path + ".address")
            adapters.append(
                SimAdapterSpec(
                    id: id, address: address, name: try string(a["name"], path + ".name") ?? "bluez-sim",
                    powered: try bool(a["powered"], path + ".powered", default: true)))
        }
        if adapters.isEmpty {
            adapters = [SimAdapterSpec(id: "hci0", address: "00:1A:7D:DA:71:10", name: "bluez-sim", powered: true)]
        }
        var peripherals: [SimPeripheralSpec] = []
        for (i, item) in try list(root["peripherals"], "peripherals").enumerated() {
            let path = "peripherals[\(i)]"
            let p = try peripheral(item, path: path, defaultAdapter: adapters[0].id)
            guard adapters.contains(where: { $0.id == p.adapter }) else {
                throw E(path: path + ".adapter", reason: "\"\(p.adapter)\" is not a declared adapter")
            }
            if peripherals.contains(where: { $0.address == p.address && $0.adapter == p.adapter }) {
                throw E(path: path + ".address", reason: "duplicate peripheral address \(p.address)")
            }
            peripherals.append(p)
        }
        return Scenario(
            adapters: adapters, peripherals: peripherals, temporaryTimeout: temporaryTimeout, mtu: mtu,
            gattCache: cache, localGATTTimeout: min(localTimeout, 600), autoEnableDelay: min(autoEnable, 60),
            disconnectedSignal: disconnectedSignal)
    }

    static let peripheralKeys: Set<String> = [
        "address", "address_type", "adapter", "name", "appearance", "rssi", "rssi_jitter", "tx_power",
        "advertising_interval", "connectable", "advertising", "service_uuids", "manufacturer_data", "service_data",
        "delays", "gatt", "paired", "services_resolved",
    ]

    static func peripheral(_ node: YAMLNode, path: String, defaultAdapter: String) throws(E) -> SimPeripheralSpec {
        let p = try mapping(node, path, allowed: peripheralKeys)
        let addressType = try string(p["address_type"], path + ".address_type") ?? "public"
        guard ["public", "random"].contains(addressType) else {
            throw E(path: path + ".address_type", reason: "\"\(addressType)\" is not public or random")
        }
        var spec = SimPeripheralSpec(
            address: try mac(p["address"], path + ".address"), addressType: addressType,
            adapter: try string(p["adapter"], path + ".adapter") ?? defaultAdapter,
            name: try string(p["name"], path + ".name"),
            appearance: try int(p["appearance"], path + ".appearance", range: 0...0xFFFF).map { UInt16($0) },
            rssi: try int(p["rssi"], path + ".rssi", range: -127...20) ?? -60,
            rssiJitter: try int(p["rssi_jitter"], path + ".rssi_jitter", range: 0...60) ?? 0,
            txPower: try int(p["tx_power"], path + ".tx_power", range: -127...126),
            advertisingInterval: try number(
                p["advertising_interval"], path + ".advertising_interval", min: 0.02, max: 10.24)
                ?? 0.1,
            connectable: try bool(p["connectable"], path + ".connectable", default: true),
            advertising: try bool(p["advertising"], path + ".advertising", default: true),
            serviceUUIDs: [], manufacturerData: [], serviceData: [], connectDelay: 0.02, servicesDelay: 0.02,
            disconnectDelay: 0.01, gatt: [], paired: try bool(p["paired"], path + ".paired", default: false))
        for (i, u) in try list(p["service_uuids"], path + ".service_uuids").enumerated() {
            spec.serviceUUIDs.append(try uuid(u, "\(path).service_uuids[\(i)]"))
        }
        for (i, item) in try list(p["manufacturer_data"], path + ".manufacturer_data").enumerated() {
            let ip = "\(path).manufacturer_data[\(i)]"
            let m = try mapping(item, ip, allowed: ["company", "value", "sequence", "period"])
            guard let company = try int(m["company"], ip + ".company", range: 0...0xFFFF) else {
                throw E(path: ip + ".company", reason: "is required")
            }
            if spec.manufacturerData.contains(where: { $0.company == UInt16(company) }) {
                throw E(path: ip + ".company", reason: "duplicate company id")
            }
            spec.manufacturerData.append((UInt16(company), try sequence(m, ip)))
        }
        for (i, item) in try list(p["service_data"], path + ".service_data").enumerated() {
            let ip = "\(path).service_data[\(i)]"
            let m = try mapping(item, ip, allowed: ["uuid", "value", "sequence", "period"])
            spec.serviceData.append((try uuid(m["uuid"], ip + ".uuid"), try sequence(m, ip)))
        }
        if let text = try string(p["services_resolved"], path + ".services_resolved") {
            guard let order = SimServicesResolvedOrder(rawValue: text) else {
                let known = SimServicesResolvedOrder.allCases.map(\.rawValue).joined(separator: ", ")
                throw E(path: path + ".services_resolved", reason: "\"\(text)\" is not one of \(known)")
            }
            spec.servicesResolved = order
        }
        if let d = p["delays"] {
            let dp = path + ".delays"
            let delays = try mapping(d, dp, allowed: ["connect", "services", "disconnect"])
            spec.connectDelay = try number(delays["connect"], dp + ".connect", max: 600) ?? spec.connectDelay
            spec.servicesDelay = try number(delays["services"], dp + ".services", max: 600) ?? spec.servicesDelay
            spec.disconnectDelay =
                try number(delays["disconnect"], dp + ".disconnect", max: 600) ?? spec.disconnectDelay
        }
        for (i, item) in try list(p["gatt"], path + ".gatt").enumerated() {
            spec.gatt.append(try service(item, "\(path).gatt[\(i)]"))
        }
        try checkEchoTargets(spec, path)
        return spec
    }

    static func service(_ node: YAMLNode, _ path: String) throws(E) -> SimServiceSpec {
        let s = try mapping(node, path, allowed: ["uuid", "primary", "characteristics"])
        var chars: [SimCharacteristicSpec] = []
        for (i, item) in try list(s["characteristics"], path + ".characteristics").enumerated() {
            chars.append(try characteristic(item, "\(path).characteristics[\(i)]"))
        }
        return SimServiceSpec(
            uuid: try uuid(s["uuid"], path + ".uuid"),
            primary: try bool(s["primary"], path + ".primary", default: true), characteristics: chars)
    }

    /// BlueZ's client-side flag order.
    static let flagOrder = [
        "broadcast", "read", "write-without-response", "write", "notify", "indicate", "authenticated-signed-writes",
        "extended-properties", "reliable-write", "writable-auxiliaries",
    ]

    static func characteristic(_ node: YAMLNode, _ path: String) throws(E) -> SimCharacteristicSpec {
        let c = try mapping(
            node, path, allowed: ["uuid", "flags", "value", "descriptors", "notify", "on_write", "presentation_format"])
        let u = try uuid(c["uuid"], path + ".uuid")
        var flags: [String] = []
        for (i, f) in try list(c["flags"], path + ".flags").enumerated() {
            guard let name = f.scalar, flagOrder.contains(name) else {
                throw E(
                    path: "\(path).flags[\(i)]",
                    reason: "\(f.kindDescription) is not a flag (one of \(flagOrder.joined(separator: ", ")))")
            }
            flags.append(name)
        }
        if flags.isEmpty { throw E(path: path + ".flags", reason: "is required (e.g. [read, notify])") }
        flags = flagOrder.filter { flags.contains($0) }
        var descriptors: [SimDescriptorSpec] = []
        for (i, item) in try list(c["descriptors"], path + ".descriptors").enumerated() {
            let dp = "\(path).descriptors[\(i)]"
            let d = try mapping(item, dp, allowed: ["uuid", "value"])
            let du = try uuid(d["uuid"], dp + ".uuid")
            if du.short16 == 0x2902 {
                throw E(path: dp + ".uuid", reason: "the CCCD (2902) is added automatically for notify/indicate")
            }
            descriptors.append(SimDescriptorSpec(uuid: du, value: try bytes(d["value"], dp + ".value") ?? []))
        }
        if let pf = c["presentation_format"] {
            let pp = path + ".presentation_format"
            let m = try mapping(pf, pp, allowed: ["format", "exponent", "unit", "namespace", "description"])
            guard let format = try int(m["format"], pp + ".format", range: 0...0xFF) else {
                throw E(path: pp + ".format", reason: "is required")
            }
            let exponent = try int(m["exponent"], pp + ".exponent", range: -128...127) ?? 0
            let unit = try int(m["unit"], pp + ".unit", range: 0...0xFFFF) ?? 0x2700
            let namespace = try int(m["namespace"], pp + ".namespace", range: 0...0xFF) ?? 1
            let desc = try int(m["description"], pp + ".description", range: 0...0xFFFF) ?? 0
            let value: [UInt8] = [
                UInt8(format), UInt8(bitPattern: Int8(exponent)), UInt8(unit & 0xFF), UInt8(unit >> 8),
                UInt8(namespace), UInt8(desc & 0xFF), UInt8(desc >> 8),
            ]
            descriptors.append(SimDescriptorSpec(uuid: SimUUID("2904")!, value: value))
        }
        var notify: SimNotifyGenerator?
        if let n = c["notify"] {
            let np = path + ".notify"
            guard flags.contains("notify") || flags.contains("indicate") else {
                throw E(path: np, reason: "the characteristic has neither the notify nor the indicate flag")
            }
            let m = try mapping(n, np, allowed: ["rate", "sequence", "counter"])
            let rate = try number(m["rate"], np + ".rate", max: 100_000) ?? 1
            if let counter = m["counter"] {
                let cp = np + ".counter"
                let cm = try mapping(counter, cp, allowed: ["start", "step", "size"])
                let start = try int(cm["start"], cp + ".start", range: 0...Int.max) ?? 0
                let step = try int(cm["step"], cp + ".step", range: 0...Int.max) ?? 1
                let size = try int(cm["size"], cp + ".size", range: 1...8) ?? 1
                if m["sequence"] != nil { throw E(path: np, reason: "has both `sequence` and `counter`; give one") }
                notify = SimNotifyGenerator(
                    source: .counter(start: UInt64(start), step: UInt64(step), size: size), rateHz: rate)
            } else {
                var values: [[UInt8]] = []
                for (i, item) in try list(m["sequence"], np + ".sequence").enumerated() {
                    values.append(try bytes(item, "\(np).sequence[\(i)]") ?? [])
                }
                guard !values.isEmpty else { throw E(path: np, reason: "needs `sequence` or `counter`") }
                notify = SimNotifyGenerator(source: .sequence(values), rateHz: rate)
            }
        }
        var echo: SimUUID?
        if let w = c["on_write"] {
            let wp = path + ".on_write"
            let m = try mapping(w, wp, allowed: ["echo_to"])
            if m["echo_to"] != nil { echo = try uuid(m["echo_to"], wp + ".echo_to") }
            guard flags.contains("write") || flags.contains("write-without-response") else {
                throw E(
                    path: wp, reason: "the characteristic has neither the write nor the write-without-response flag")
            }
        }
        return SimCharacteristicSpec(
            uuid: u, flags: flags, value: try bytes(c["value"], path + ".value") ?? [],
            descriptors: descriptors, notify: notify, echoTo: echo)
    }

    static func checkEchoTargets(_ spec: SimPeripheralSpec, _ path: String) throws(E) {
        let all = spec.gatt.flatMap(\.characteristics)
        for (si, s) in spec.gatt.enumerated() {
            for (ci, c) in s.characteristics.enumerated() {
                guard let target = c.echoTo else { continue }
                let p = "\(path).gatt[\(si)].characteristics[\(ci)].on_write.echo_to"
                guard let t = all.first(where: { $0.uuid == target }) else {
                    throw E(path: p, reason: "no characteristic \(target.string) on this peripheral")
                }
                guard t.flags.contains("notify") || t.flags.contains("indicate") else {
                    throw E(path: p, reason: "characteristic \(target.string) has neither notify nor indicate")
                }
            }
        }
    }
}
