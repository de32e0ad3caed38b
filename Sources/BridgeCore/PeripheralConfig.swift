// The `peripheral:` section: the bridge as a GATT server and broadcaster (MQTT → BLE). Every value is checked at
// load, so a characteristic that cannot be encoded or a broadcast that does not fit in 31 octets is a config error,
// not a run-time surprise.
import GATT
import YAML

/// Where a served value comes from: an MQTT topic, and optionally one field of its JSON payload.
public struct PeripheralSource: Sendable, Hashable, CustomStringConvertible {
    /// The topic (no wildcards).
    public var topic: String
    /// The JSON field of the payload (a dotted path such as `state.temperature`); nil: the whole payload.
    public var field: String?

    /// A source.
    public init(topic: String, field: String? = nil) {
        self.topic = topic
        self.field = field
    }

    /// `topic` or `topic field`.
    public var description: String { field.map { "\(topic) field \($0)" } ?? topic }
}

/// One characteristic of a served service.
public struct PeripheralCharacteristicConfig: Sendable, Hashable {
    /// A stable id (`s0c1`): service and characteristic positions.
    public var id: String
    /// Its config path (`peripheral.services[0].characteristics[1]`), for messages.
    public var path: String
    /// The characteristic UUID.
    public var uuid: BluetoothUUID
    /// The parser that encodes sources and decodes writes; nil: raw bytes (hex on MQTT).
    public var parserName: String?
    /// BlueZ flag strings (`read`, `notify`, `write`, ...).
    public var flags: [String]
    /// Where its value comes from.
    public var source: PeripheralSource?
    /// Where a central's writes are published.
    public var sink: String?
    /// The value before the first message from the source.
    public var initialValue: [UInt8]
    /// A Characteristic User Description (0x2901), when given.
    public var userDescription: String?
    /// A bridge-owned value (`bridge_status` preset): `devices_online`, `mqtt_connected` or `status`.
    public var internalValue: String?
}

/// One served service.
public struct PeripheralServiceConfig: Sendable, Hashable {
    /// The service UUID.
    public var uuid: BluetoothUUID
    /// A name for `bridge/info` (the preset's, or `name:`).
    public var name: String?
    /// The preset it came from.
    public var preset: String?
    /// Its characteristics.
    public var characteristics: [PeripheralCharacteristicConfig]
}

/// One value in the BTHome broadcast.
public struct BroadcastValueConfig: Sendable, Hashable {
    /// The BTHome field name as our parser publishes it (`temperature_c`, `humidity_pct`, `battery_pct`).
    public var field: String
    /// Where the value comes from.
    public var source: PeripheralSource
}

/// `peripheral.broadcast`: values advertised as BTHome v2 service data.
public struct BroadcastConfig: Sendable, Hashable {
    /// A local name put in the advertisement, when given (it must fit too).
    public var name: String?
    /// The shortest time between two updates of the advertised data.
    public var interval: Duration = .seconds(10)
    /// The AES-CCM bind key (16 octets); nil: unencrypted.
    public var bindKey: [UInt8]?
    /// The values, in object-id order in the packet.
    public var values: [BroadcastValueConfig] = []
    /// The legacy advertising payload length with every value present (≤ 31).
    public var payloadLength: Int = 0
}

/// The `peripheral:` section.
public struct PeripheralConfig: Sendable, Hashable {
    /// The adapter (`hci0`); nil: the first one.
    public var adapter: String?
    /// The local name in the connectable advertisement.
    public var name: String = "blebridge"
    /// Advertise the services (connectable), so centrals can find the bridge.
    public var advertise: Bool = true
    /// Served services.
    public var services: [PeripheralServiceConfig] = []
    /// The broadcaster role.
    public var broadcast: BroadcastConfig?

    /// Every characteristic, in order.
    public var characteristics: [PeripheralCharacteristicConfig] { services.flatMap(\.characteristics) }

    /// Every MQTT topic a value comes from.
    public var sourceTopics: [String] {
        var out: [String] = []
        for c in characteristics { if let t = c.source?.topic, !out.contains(t) { out.append(t) } }
        for v in broadcast?.values ?? [] where !out.contains(v.source.topic) { out.append(v.source.topic) }
        return out
    }

    /// The UUIDs put in the connectable advertisement: the non-preset-internal services, as many as fit.
    public var advertisedServiceUUIDs: [BluetoothUUID] { services.map(\.uuid) }
}

/// The custom 128-bit service of the `bridge_status` preset, and its characteristics.
public enum BridgeStatusService {
    /// The service.
    public static let service = BluetoothUUID("b1eb0000-4272-6964-6765-537461747573")!
    /// Devices online (uint16, little-endian).
    public static let devicesOnline = BluetoothUUID("b1eb0001-4272-6964-6765-537461747573")!
    /// MQTT connected (uint8, 0 or 1).
    public static let mqttConnected = BluetoothUUID("b1eb0002-4272-6964-6765-537461747573")!
    /// The status line (UTF-8).
    public static let status = BluetoothUUID("b1eb0003-4272-6964-6765-537461747573")!
}

/// The flags BlueZ's GattCharacteristic1 accepts (doc/org.bluez.GattCharacteristic.rst).
let bluezCharacteristicFlags: [String] = [
    "broadcast", "read", "write-without-response", "write", "notify", "indicate", "authenticated-signed-writes",
    "extended-properties", "reliable-write", "writable-auxiliaries", "encrypt-read", "encrypt-write",
    "encrypt-notify", "encrypt-indicate", "encrypt-authenticated-read", "encrypt-authenticated-write",
    "encrypt-authenticated-notify", "encrypt-authenticated-indicate", "secure-read", "secure-write",
    "secure-notify", "secure-indicate", "authorize",
]

extension BridgeConfig {
    static let peripheralPresets = ["battery", "device_information", "environmental_sensing", "bridge_status"]

    static func loadPeripheral(_ n: ConfigNode, registry: GATTParserRegistry) -> PeripheralConfig {
        var p = PeripheralConfig()
        guard n.expectMapping(allowed: ["adapter", "name", "advertise", "services", "broadcast"]) else {
            n.fail("'peripheral' must be a mapping with 'services' and/or 'broadcast'")
            return p
        }
        p.adapter = n["adapter"]?.string
        if let name = n["name"]?.string {
            if name.isEmpty || name.utf8.count > 29 {
                n["name"]?.fail("a local name is 1 to 29 octets of UTF-8 (it must fit in an advertisement)")
            } else {
                p.name = name
            }
        }
        if let a = n["advertise"]?.bool { p.advertise = a }
        if let s = n["services"] {
            for (i, item) in s.items.enumerated() {
                if let service = loadPeripheralService(item, index: i, registry: registry) {
                    p.services.append(service)
                }
            }
        }
        if let b = n["broadcast"] { p.broadcast = loadBroadcast(b) }
        if n["services"] == nil, n["broadcast"] == nil { n.fail("give 'services', 'broadcast' or both") }
        if p.advertise, !p.services.isEmpty {
            // Flags (3) + local name (2 + n) must fit; service UUIDs are added as far as they fit.
            let used = 3 + 2 + p.name.utf8.count
            if used > 31 { n["name"]?.fail("the local name does not fit in an advertisement with flags") }
        }
        return p
    }

    static func loadSource(_ n: ConfigNode) -> PeripheralSource? {
        var source: PeripheralSource?
        if n.node.scalar != nil {
            source = n.string.map { PeripheralSource(topic: $0) }
        } else {
            n.expectMapping(allowed: ["topic", "field"])
            guard let topic = n["topic"]?.string else {
                n.fail("missing 'topic'")
                return nil
            }
            source = PeripheralSource(topic: topic, field: n["field"]?.string)
        }
        if let t = source?.topic, t.isEmpty || t.contains("+") || t.contains("#") {
            n.fail("\"\(t)\" is not a topic to subscribe to (no wildcards)")
            return nil
        }
        return source
    }

    static func loadSink(_ n: ConfigNode) -> String? {
        guard let t = n.string else { return nil }
        if t.isEmpty || t.contains("+") || t.contains("#") {
            n.fail("\"\(t)\" is not a topic to publish to (no wildcards)")
            return nil
        }
        return t
    }

    static func loadPeripheralService(_ n: ConfigNode, index: Int, registry: GATTParserRegistry)
        -> PeripheralServiceConfig?
    {
        if let preset = n["preset"] {
            guard let name = preset.oneOf(peripheralPresets) else { return nil }
            return loadPreset(name, n, index: index, registry: registry)
        }
        guard n.expectMapping(allowed: ["uuid", "name", "characteristics"]) else {
            n.fail("a service is a mapping with 'uuid' and 'characteristics' (or a 'preset')")
            return nil
        }
        guard let uuid = n["uuid"]?.uuid else {
            if n["uuid"] == nil {
                n.fail("missing 'uuid' (or give a 'preset': \(peripheralPresets.joined(separator: ", ")))")
            }
            return nil
        }
        var chars: [PeripheralCharacteristicConfig] = []
        if let list = n["characteristics"] {
            for (j, item) in list.items.enumerated() {
                if let c = loadPeripheralCharacteristic(item, id: "s\(index)c\(j)", registry: registry) {
                    chars.append(c)
                }
            }
        } else {
            n.fail("missing 'characteristics'")
        }
        return PeripheralServiceConfig(uuid: uuid, name: n["name"]?.string, preset: nil, characteristics: chars)
    }

    /// Builds one characteristic; `parser` may be given by the caller (presets) or by `parser:` / the UUID.
    static func loadPeripheralCharacteristic(_ n: ConfigNode, id: String, registry: GATTParserRegistry)
        -> PeripheralCharacteristicConfig?
    {
        guard
            n.expectMapping(allowed: ["uuid", "parser", "flags", "source", "sink", "value", "description"])
        else {
            n.fail("a characteristic is a mapping with at least 'uuid'")
            return nil
        }
        var uuid: BluetoothUUID?
        var parser: (any GATTCharacteristicParser)?
        if let text = n["uuid"]?.string {
            if let u = BluetoothUUID(text) {
                uuid = u
            } else if let named = registry.parser(named: text), let u = named.uuids.first {
                uuid = u
                parser = named
            } else {
                n["uuid"]?.fail("\"\(text)\" is neither a characteristic UUID nor a parser name")
            }
        } else if n["uuid"] == nil {
            n.fail("missing 'uuid' (a UUID such as 2A6E, or a parser name such as temperature)")
        }
        if let text = n["parser"]?.string {
            if let named = registry.parser(named: text) {
                parser = named
            } else {
                n["parser"]?.fail("no parser is called \"\(text)\" (built in or under 'parsers')")
            }
        } else if parser == nil, let uuid {
            parser = registry.parser(for: uuid)
        }
        guard let uuid else { return nil }
        let source = n["source"].flatMap(loadSource)
        let sink = n["sink"].flatMap(loadSink)
        var flags: [String]
        if let f = n["flags"] {
            flags = []
            for item in (f.node.sequence != nil ? f.items : [f]) {
                guard let flag = item.string else { continue }
                if bluezCharacteristicFlags.contains(flag) {
                    if !flags.contains(flag) { flags.append(flag) }
                } else {
                    let hint = closest(flag, in: Set(bluezCharacteristicFlags)).map { " (did you mean '\($0)'?)" } ?? ""
                    item.fail("\"\(flag)\" is not a GATT characteristic flag\(hint)")
                }
            }
        } else {
            flags = ["read"]
            if source != nil { flags.append("notify") }
            if sink != nil { flags.append("write") }
        }
        let writes =
            flags.contains("write") || flags.contains("write-without-response")
            || flags.contains("reliable-write")
        if writes, sink == nil { n.fail("a writable characteristic needs a 'sink' topic for what centrals write") }
        if sink != nil, !writes { n["sink"]?.fail("a 'sink' needs a write flag (write or write-without-response)") }
        let notifies = flags.contains("notify") || flags.contains("indicate")
        if source != nil, !flags.contains("read"), !notifies {
            n["source"]?.fail("a 'source' needs the read, notify or indicate flag")
        }
        var initial: [UInt8] = []
        if let v = n["value"] {
            // Raw bytes are hex text even when YAML would read them as a number (`value: 1234`).
            let json = parser == nil && v.node.scalar != nil ? .string(v.node.scalar ?? "") : jsonValue(of: v.node)
            switch encodePeripheralValue(json, parser: parser) {
            case .success(let bytes): initial = bytes
            case .failure(let e): v.fail(e.reason)
            }
        }
        return PeripheralCharacteristicConfig(
            id: id, path: n.path, uuid: uuid, parserName: parser?.name, flags: flags, source: source, sink: sink,
            initialValue: initial, userDescription: n["description"]?.string, internalValue: nil)
    }

    static func loadPreset(_ preset: String, _ n: ConfigNode, index: Int, registry: GATTParserRegistry)
        -> PeripheralServiceConfig?
    {
        func char(
            _ j: Int, _ uuid: UInt16, flags: [String], source: PeripheralSource? = nil, value: [UInt8] = [],
            description: String? = nil, key: String
        ) -> PeripheralCharacteristicConfig {
            PeripheralCharacteristicConfig(
                id: "s\(index)c\(j)", path: n.child(key), uuid: BluetoothUUID(uuid),
                parserName: registry.parser(for: BluetoothUUID(uuid))?.name, flags: flags, source: source, sink: nil,
                initialValue: value, userDescription: description, internalValue: nil)
        }
        switch preset {
        case "battery":
            n.expectMapping(allowed: ["preset", "level"])
            guard let level = n["level"].flatMap(loadSource) else {
                if n["level"] == nil {
                    n.fail("the battery preset needs 'level': the source of the battery percentage")
                }
                return nil
            }
            return PeripheralServiceConfig(
                uuid: BluetoothUUID(UInt16(0x180F)), name: "battery", preset: preset,
                characteristics: [char(0, 0x2A19, flags: ["read", "notify"], source: level, key: "level")])
        case "environmental_sensing":
            n.expectMapping(allowed: ["preset", "temperature", "humidity", "pressure"])
            var chars: [PeripheralCharacteristicConfig] = []
            for (key, uuid) in [("temperature", UInt16(0x2A6E)), ("humidity", 0x2A6F), ("pressure", 0x2A6D)] {
                guard let node = n[key], let source = loadSource(node) else { continue }
                chars.append(char(chars.count, uuid, flags: ["read", "notify"], source: source, key: key))
            }
            if chars.isEmpty, n.problems.errors.allSatisfy({ !$0.path.hasPrefix(n.path + ".") }) {
                n.fail("the environmental_sensing preset needs at least one of temperature, humidity, pressure")
            }
            return PeripheralServiceConfig(
                uuid: BluetoothUUID(UInt16(0x181A)), name: "environmental_sensing", preset: preset,
                characteristics: chars)
        case "device_information":
            n.expectMapping(allowed: ["preset", "manufacturer", "model", "serial", "firmware", "hardware"])
            var chars: [PeripheralCharacteristicConfig] = []
            let fields: [(String, UInt16, String?)] = [
                ("manufacturer", 0x2A29, "blebridge"), ("model", 0x2A24, "blebridge"), ("serial", 0x2A25, nil),
                ("firmware", 0x2A26, BridgeVersion.current), ("hardware", 0x2A27, nil),
            ]
            for (key, uuid, fallback) in fields {
                guard let text = n[key]?.string ?? fallback else { continue }
                if text.utf8.count > 512 {
                    n[key]?.fail("at most 512 octets (an attribute value's limit)")
                    continue
                }
                chars.append(char(chars.count, uuid, flags: ["read"], value: Array(text.utf8), key: key))
            }
            return PeripheralServiceConfig(
                uuid: BluetoothUUID(UInt16(0x180A)), name: "device_information", preset: preset,
                characteristics: chars)
        default:  // bridge_status
            n.expectMapping(allowed: ["preset"])
            var chars = [
                char(0, 0, flags: ["read", "notify"], value: [0, 0], description: "Devices online", key: "preset"),
                char(1, 0, flags: ["read", "notify"], value: [0], description: "MQTT connected", key: "preset"),
                char(2, 0, flags: ["read", "notify"], description: "Bridge status", key: "preset"),
            ]
            let uuids = [
                BridgeStatusService.devicesOnline, BridgeStatusService.mqttConnected, BridgeStatusService.status,
            ]
            let internals = ["devices_online", "mqtt_connected", "status"]
            for k in chars.indices {
                chars[k].uuid = uuids[k]
                chars[k].parserName = nil
                chars[k].internalValue = internals[k]
            }
            return PeripheralServiceConfig(
                uuid: BridgeStatusService.service, name: "bridge_status", preset: preset, characteristics: chars)
        }
    }

    static func loadBroadcast(_ n: ConfigNode) -> BroadcastConfig? {
        var b = BroadcastConfig()
        guard n.expectMapping(allowed: ["name", "interval", "bind_key", "values"]) else {
            n.fail("'broadcast' is a mapping with 'values'")
            return nil
        }
        b.name = n["name"]?.string
        if let i = n["interval"]?.seconds(0.1...3600) { b.interval = i }
        if let k = n["bind_key"]?.string {
            if let bytes = bytesFromHex(k), bytes.count == 16 {
                b.bindKey = bytes
            } else {
                n["bind_key"]?.fail("a BTHome bind key is 32 hex digits (16 octets)")
            }
        }
        guard let list = n["values"] else {
            n.fail("missing 'values' (for example [{field: temperature_c, source: {topic: blebridge/attic}}])")
            return nil
        }
        var placeholder = GATTReading()
        for item in list.items {
            item.expectMapping(allowed: ["field", "source"])
            guard let field = item["field"]?.string else {
                if item["field"] == nil { item.fail("missing 'field' (a BTHome field such as temperature_c)") }
                continue
            }
            guard BTHomeEncoder.objectID(forField: field) != nil else {
                item["field"]?.fail("\"\(field)\" is not a BTHome v2 field this bridge can encode")
                continue
            }
            if field == "packet_id" {
                item["field"]?.fail("the bridge sets packet_id itself")
                continue
            }
            guard let sourceNode = item["source"] else {
                item.fail("missing 'source' (a topic, or {topic, field})")
                continue
            }
            guard let source = loadSource(sourceNode) else { continue }
            if b.values.contains(where: { $0.field == field }) {
                item["field"]?.fail("\"\(field)\" is broadcast twice")
                continue
            }
            b.values.append(BroadcastValueConfig(field: field, source: source))
            placeholder.append(field, BTHomeEncoder.placeholder(forField: field))
        }
        if b.values.isEmpty { list.fail("at least one value to broadcast") }
        // The longest payload: every value present, the packet id (unencrypted) or counter and MIC (encrypted).
        let objects: Int
        do {
            objects = try BTHomeEncoder.encode(placeholder).count - 1
        } catch {
            list.fail("cannot encode: \(error)")
            return nil
        }
        let serviceData = 1 + objects + (b.bindKey == nil ? 2 : 8)  // device info, objects, packet id or counter+MIC
        b.payloadLength = 3 + (2 + 2 + serviceData) + (b.name.map { 2 + $0.utf8.count } ?? 0)
        if b.payloadLength > 31 {
            n.fail(
                "the broadcast needs \(b.payloadLength) octets of advertising data; a legacy advertisement holds 31 "
                    + "(flags 3, service data \(4 + serviceData)\(b.name.map { ", name \(2 + $0.utf8.count)" } ?? ""))"
                    + ": broadcast fewer values or drop the name")
        }
        return b
    }

    /// A YAML node as JSON: scalars that read as numbers or booleans become those.
    static func jsonValue(of node: YAMLNode) -> JSONValue {
        if let m = node.mapping { return .object(m.map { ($0.key, jsonValue(of: $0.value)) }) }
        if let s = node.sequence { return .array(s.map(jsonValue)) }
        if node.isNull { return .null }
        if let i = node.integer { return .int(Int64(i)) }
        if let d = node.double { return .double(d) }
        if let b = node.bool { return .bool(b) }
        return .string(node.scalar ?? "")
    }
}

/// Encodes a value from MQTT (or the config) into a characteristic value with `parser`; raw hex when there is none.
///
/// An object is taken as the parser's fields (`{"temperature_c": 21.5}`); a bare value is the parser's first field.
public func encodePeripheralValue(_ value: JSONValue, parser: (any GATTCharacteristicParser)?) -> Result<
    [UInt8], PeripheralValueError
> {
    guard let parser else {
        let text: String
        switch value {
        case .string(let s): text = s
        case .object(let fields):
            guard let raw = fields.first(where: { $0.0 == "raw" })?.1.string else {
                return .failure(
                    PeripheralValueError(
                        "a characteristic without a parser takes hex (\"0a1b\" or {\"raw\": \"0a1b\"})"))
            }
            text = raw
        default:
            return .failure(
                PeripheralValueError("a characteristic without a parser takes hex (\"0a1b\" or {\"raw\": \"0a1b\"})"))
        }
        guard let bytes = bytesFromHex(text) else { return .failure(PeripheralValueError("\"\(text)\" is not hex")) }
        guard bytes.count <= 512 else {
            return .failure(PeripheralValueError("\(bytes.count) octets is more than an attribute holds (512)"))
        }
        return .success(bytes)
    }
    var reading = GATTReading()
    switch value {
    case .object(let fields):
        for (k, v) in fields { reading.append(k, v.gattValue) }
    default:
        guard let first = parser.fields.first else {
            return .failure(PeripheralValueError("\(parser.name) takes an object of its fields, not a single value"))
        }
        var v = value
        if case .string(let s) = value, first.kind == .number {
            if let i = Int64(s) { v = .int(i) } else if let d = Double(s) { v = .double(d) }
        }
        reading.append(first.name, v.gattValue)
    }
    do {
        let bytes = try parser.encode(reading)
        guard bytes.count <= 512 else {
            return .failure(PeripheralValueError("\(bytes.count) octets is more than an attribute holds (512)"))
        }
        return .success(bytes)
    } catch {
        return .failure(PeripheralValueError("\(parser.name): \(error)"))
    }
}

/// Why a value could not be encoded for a served characteristic.
public struct PeripheralValueError: Error, Sendable, Equatable, CustomStringConvertible {
    /// What is wrong.
    public var reason: String
    /// An error.
    public init(_ reason: String) { self.reason = reason }
    /// The reason.
    public var description: String { reason }
}
