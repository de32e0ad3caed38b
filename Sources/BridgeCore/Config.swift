// The bridge configuration (config/blebridge.example.yaml, every key in config/README.md), and its loader.
import GATT
import Logging
import YAML

/// How the bridge talks to a device.
public enum DeviceMode: String, Sendable, Hashable, CaseIterable {
    /// Advertisements only.
    case passive
    /// Keep a connection and stream notifications.
    case connected
    /// Connect every interval, read, disconnect.
    case poll
    /// Connect only to serve a command.
    case onDemand = "on-demand"
}

/// What the bridge publishes per device.
public enum OutputMode: String, Sendable, Hashable {
    /// `blebridge/<device>` with the JSON state.
    case json
    /// `blebridge/<device>/<field>` with plain values only.
    case attribute
    /// Both.
    case attributeAndJSON = "attribute_and_json"
}

/// How a configured device is recognised.
public struct DeviceMatch: Sendable, Hashable {
    /// Exact address.
    public var address: BLEAddress?
    /// An advertised service UUID.
    public var service: BluetoothUUID?
    /// A name pattern (`*` and `?` wildcards).
    public var namePattern: String?
    /// A manufacturer (company) id in the advertisement.
    public var manufacturer: UInt16?

    /// A match.
    public init(
        address: BLEAddress? = nil, service: BluetoothUUID? = nil, namePattern: String? = nil,
        manufacturer: UInt16? = nil
    ) {
        self.address = address
        self.service = service
        self.namePattern = namePattern
        self.manufacturer = manufacturer
    }

    /// True when every given criterion holds for `advertisement`.
    public func matches(_ advertisement: BLEAdvertisement) -> Bool {
        if let address, advertisement.address != address { return false }
        if let service, !advertisement.serviceUUIDs.contains(service), advertisement.serviceData[service] == nil {
            return false
        }
        if let namePattern {
            guard let name = advertisement.name, globMatch(namePattern, name) else { return false }
        }
        if let manufacturer, advertisement.manufacturerData[manufacturer] == nil { return false }
        return true
    }
}

/// A value a device accepts through `/set`.
public struct WritableSpec: Sendable, Hashable {
    /// The field name (`setpoint_c`).
    public var name: String
    /// The characteristic it is written to.
    public var characteristic: BluetoothUUID
    /// The parser that encodes it (nil: raw hex).
    public var parserName: String?
    /// Write with response (nil: from the characteristic's flags).
    public var withResponse: Bool?
    /// Lowest accepted number.
    public var minimum: Double?
    /// Highest accepted number.
    public var maximum: Double?
    /// Step (for Home Assistant's number entity).
    public var step: Double?
    /// Allowed values (a select).
    public var options: [String]?
    /// The Home Assistant platform: number, switch, select, text.
    public var platform: String

    /// A writable value.
    public init(
        name: String, characteristic: BluetoothUUID, parserName: String?, withResponse: Bool? = nil,
        minimum: Double? = nil, maximum: Double? = nil, step: Double? = nil, options: [String]? = nil,
        platform: String = "number"
    ) {
        self.name = name
        self.characteristic = characteristic
        self.parserName = parserName
        self.withResponse = withResponse
        self.minimum = minimum
        self.maximum = maximum
        self.step = step
        self.options = options
        self.platform = platform
    }
}

/// One configured device.
public struct DeviceConfig: Sendable, Hashable {
    /// The sanitized id used in topics (`chest_strap`, or the compact address).
    public var id: String
    /// The friendly name as written (nil: none given).
    public var friendlyName: String?
    /// How it is recognised.
    public var match: DeviceMatch
    /// How the bridge talks to it.
    public var mode: DeviceMode
    /// Characteristics to subscribe to (empty: every notifying one with a parser).
    public var subscribe: [BluetoothUUID]
    /// Characteristics to read on each poll (and once after connecting).
    public var poll: [BluetoothUUID]
    /// Seconds between polls.
    public var pollInterval: Duration
    /// Values accepted by `/set`.
    public var writable: [WritableSpec]
    /// Publish only after no new data came for this long.
    public var debounce: Duration?
    /// Publish at most once per this long.
    public var throttle: Duration?
    /// Retain the state topic (nil: `mqtt.retain`).
    public var retain: Bool?
    /// QoS of the state topic.
    public var qos: Int
    /// What to publish.
    public var output: OutputMode
    /// AES key for encrypted advertisements (BTHome, MiBeacon).
    public var bindKey: [UInt8]?
    /// Offline after no advertisement for this long (nil: learned from the advertising interval).
    public var availabilityTimeout: Duration?

    /// Index in `devices`, for error messages.
    public var index: Int
}

/// `auto_devices`: publish any advertiser a built-in advertisement parser decodes.
public struct AutoDevicesConfig: Sendable, Hashable {
    /// Off by default.
    public var enabled: Bool = false
    /// Only these addresses (empty: any).
    public var allow: Set<BLEAddress> = []
    /// Never these.
    public var deny: Set<BLEAddress> = []
    /// Ignore advertisers weaker than this (dBm).
    public var minimumRSSI: Int?
}

/// `mqtt:` — the broker connection and the topics.
public struct MQTTSettings: Sendable, Hashable {
    /// `mqtt://host:port` or `mqtts://`.
    public var url: String = "mqtt://127.0.0.1:1883"
    /// Client id (default `blebridge-<hostname>` chosen by the adapter).
    public var clientID: String?
    /// User name.
    public var username: String?
    /// Password in the config.
    public var password: String?
    /// Password file.
    public var passwordFile: String?
    /// TLS files.
    public var caFile: String?
    /// CA directory.
    public var caDirectory: String?
    /// Client certificate.
    public var certificateFile: String?
    /// Client key.
    public var keyFile: String?
    /// Check the broker's host name.
    public var verifyHostname: Bool = true
    /// `5` or `3.1.1`.
    public var protocolVersion: String = "5"
    /// Base topic.
    public var baseTopic: String = "blebridge"
    /// Keepalive.
    public var keepAlive: Duration = .seconds(60)
    /// QoS of state and availability.
    public var qos: Int = 1
    /// Retain state topics.
    public var retain: Bool = false
    /// Messages held while the broker is away.
    public var offlineQueue: Int = 10000
    /// `offline_queue: disk`: QoS 1 messages are journaled under the state directory until acknowledged.
    public var offlineQueueOnDisk = false
    /// Largest accepted incoming payload, bytes.
    public var maxPayload: Int = 65536
    /// Resume the broker-side session (`clean_session: false`).
    public var cleanSession: Bool = true
    /// MQTT 5 session expiry with a persistent session.
    public var sessionExpiry: Duration = .seconds(86400)
    /// QoS 1/2 messages in flight.
    public var maxInflight: Int = 100
    /// Received messages buffered.
    public var receiveBuffer: Int = 100_000
    /// Largest incoming MQTT packet (MQTT 5 Maximum Packet Size; dropped and counted under 3.1.1).
    public var maxIncomingPacket: Int = 1 << 20
    /// Received bytes buffered.
    public var receiveBufferBytes: Int = 16 << 20
    /// Reconnect delays.
    public var reconnectInitialDelay: Duration = .seconds(1)
    /// Longest reconnect delay.
    public var reconnectMaximumDelay: Duration = .seconds(60)
}

/// `homeassistant:` — MQTT discovery.
public struct HomeAssistantSettings: Sendable, Hashable {
    /// Publish discovery.
    public var enabled: Bool = true
    /// Discovery prefix.
    public var prefix: String = "homeassistant"
    /// Home Assistant's birth topic; `online` there republishes discovery, and the device states after
    /// `stateResendDelay`.
    public var statusTopic: String = "homeassistant/status"
    /// How long after Home Assistant's birth every device's state is published again (the time Home Assistant takes
    /// to make the entities and subscribe to their state topics; Zigbee2MQTT waits 30 s too).
    public var stateResendDelay: Duration = .seconds(30)
}

/// `bluetooth:` — adapters and scanning.
public struct BluetoothSettings: Sendable, Hashable {
    /// Adapters to use (names or addresses; empty: all).
    public var adapters: [String] = []
    /// Extra service UUIDs to scan for (the devices' `match.service` are always included).
    public var scanServices: [BluetoothUUID] = []
    /// Passive scanning.
    public var passive: Bool = false
    /// Ask for every advertisement (needed to learn advertising intervals of beacons whose data does not change).
    public var duplicateData: Bool = true
    /// Simultaneous connections per adapter.
    public var connectionSlots: Int = 5
    /// Connect timeout.
    public var connectTimeout: Duration = .seconds(20)
    /// First reconnect delay.
    public var reconnectInitialDelay: Duration = .seconds(1)
    /// Longest reconnect delay.
    public var reconnectMaximumDelay: Duration = .seconds(300)
    /// A subscription silent for this many times its usual interval triggers a reconnect.
    public var silenceFactor: Double = 10
}

/// `availability:`.
public struct AvailabilitySettings: Sendable, Hashable {
    /// Passive devices: never offline sooner than this after their last advertisement.
    public var passiveMinimumTimeout: Duration = .seconds(60)
    /// Passive devices: offline after this many missed advertising intervals.
    public var passiveIntervals: Double = 10
}

/// `logging:`.
public struct LoggingSettings: Sendable, Hashable {
    /// Minimum level on stderr.
    public var level: String = "info"
    /// `text` or `json`.
    public var format: String = "text"
    /// Minimum level forwarded to `bridge/logging`.
    public var mqttLevel: String = "warning"
}

/// Multi-gateway mode (`gateway:`): several bridges share the devices through the broker, each connected device
/// served by one of them at a time (docs/MULTI-GATEWAY.md).
public struct GatewaySettings: Sendable, Equatable {
    /// The gateway's id, sanitized like a device name (`attic`).
    public var id: String
    /// Lease, hand-over margin and time, link-lost grace.
    public var ownership = OwnershipSettings()
    /// Passive devices: the k-th best-hearing gateway waits k × this (seconds) before it publishes a reading.
    public var passiveDelay: Double = 0.3
    /// Passive devices without a counter: the same fields within this many seconds are one reading.
    public var dedupWindow: Double = 2

    /// Settings for gateway `id`.
    public init(id: String) { self.id = id }
}

/// The whole configuration.
public struct BridgeConfig: Sendable {
    /// Broker and topics.
    public var mqtt = MQTTSettings()
    /// Discovery.
    public var homeAssistant = HomeAssistantSettings()
    /// Adapters and scanning.
    public var bluetooth = BluetoothSettings()
    /// Availability timing.
    public var availability = AvailabilitySettings()
    /// Logging.
    public var logging = LoggingSettings()
    /// Allow `bridge/request/device/read` and `device/write` on any UUID.
    public var allowRawGATT = false
    /// `metrics.listen`: the address of the Prometheus endpoint (nil: off).
    public var metricsListen: String?
    /// How often `bridge/health` is published (zero: never).
    public var healthInterval: Duration = .seconds(60)
    /// Configured devices.
    public var devices: [DeviceConfig] = []
    /// Auto-added advertisers.
    public var autoDevices = AutoDevicesConfig()
    /// Declarative parsers as written.
    public var parserSpecs: [DeclarativeParserSpec] = []
    /// The registry: built-in parsers plus the declared ones.
    public var registry = GATTParserRegistry()
    /// The peripheral role (GATT server, advertising, BTHome broadcast); nil: off.
    public var peripheral: PeripheralConfig?
    /// Multi-gateway mode; nil: a single gateway.
    public var gateway: GatewaySettings?

    /// The topics of this configuration (base topic, discovery prefix, gateway).
    public var topics: BridgeTopics {
        BridgeTopics(base: mqtt.baseTopic, discoveryPrefix: homeAssistant.prefix, gateway: gateway?.id)
    }

    /// An empty configuration with the built-in parsers.
    public init() {
        registry = (try? GATTParserRegistry.builtIn()) ?? GATTParserRegistry()
    }

    /// The service UUIDs to scan for: the devices' `match.service`, `bluetooth.scan_services`, and none (scan
    /// everything) when a device matches by something else or auto devices are on.
    public var scanServiceUUIDs: [BluetoothUUID] {
        if autoDevices.enabled { return [] }
        var out = bluetooth.scanServices
        for device in devices {
            guard let s = device.match.service else { return [] }
            if !out.contains(s) { out.append(s) }
        }
        return out
    }
}

/// Turns a name into a topic-safe id: lower-case letters, digits, `_` and `-`; everything else (`/`, `+`, `#`, `$`,
/// spaces, controls) becomes `_`; at most 64 characters.
public func sanitizeDeviceID(_ name: String) -> String {
    var out = ""
    for scalar in name.unicodeScalars {
        if out.unicodeScalars.count >= 64 { break }
        switch scalar {
        case "a"..."z", "0"..."9", "_", "-": out.unicodeScalars.append(scalar)
        case "A"..."Z": out += String(scalar).lowercased()
        default: out += "_"
        }
    }
    while out.hasPrefix("_") { out.removeFirst() }
    return out
}

/// `*` and `?` wildcards, case-insensitive.
public func globMatch(_ pattern: String, _ text: String) -> Bool {
    let p = Array(pattern.lowercased())
    let t = Array(text.lowercased())
    var memo: [Int: Bool] = [:]
    func go(_ i: Int, _ j: Int) -> Bool {
        let key = i * (t.count + 1) + j
        if let m = memo[key] { return m }
        let r: Bool
        if i == p.count {
            r = j == t.count
        } else if p[i] == "*" {
            r = go(i + 1, j) || (j < t.count && go(i, j + 1))
        } else {
            r = j < t.count && (p[i] == "?" || p[i] == t[j]) && go(i + 1, j + 1)
        }
        memo[key] = r
        return r
    }
    return go(0, 0)
}

// MARK: Loading

extension BridgeConfig {
    /// Parses and checks a configuration file's text (YAML, or JSON).
    ///
    /// - Throws: `ConfigErrors` listing every problem with its path.
    public static func load(text: String) throws(ConfigErrors) -> BridgeConfig {
        let root: YAMLNode
        do {
            root = try YAMLParser.parse(text)
        } catch {
            throw ConfigErrors([ConfigError(path: "", reason: "not valid YAML or JSON: \(error)")])
        }
        let problems = ConfigProblems()
        let config = load(ConfigNode(node: root, path: "", problems: problems))
        if !problems.errors.isEmpty { throw ConfigErrors(problems.errors) }
        return config
    }

    static let topKeys: Set<String> = [
        "mqtt", "homeassistant", "bluetooth", "availability", "logging", "allow_raw_gatt", "devices", "auto_devices",
        "parsers", "health", "metrics", "peripheral", "gateway",
    ]

    static func loadGateway(_ g: ConfigNode) -> GatewaySettings? {
        let allowed: Set<String> = [
            "id", "lease", "handover_margin", "handover_after", "link_lost_grace", "passive_delay", "dedup_window",
        ]
        guard g.expectMapping(allowed: allowed) else {
            g.fail("must be a mapping (gateway: {id: attic})")
            return nil
        }
        guard let node = g["id"] else {
            g.fail("missing 'id' (gateway: {id: attic})")
            return nil
        }
        guard let raw = node.string else { return nil }
        let id = sanitizeDeviceID(raw)
        guard !id.isEmpty, id != "claims", !["state", "info", "devices", "event", "logging", "health", "request",
            "response"].contains(id)
        else {
            node.fail("\"\(raw)\" cannot be a gateway id (it must have a letter or digit, and not be a bridge topic name)")
            return nil
        }
        var settings = GatewaySettings(id: id)
        if let v = g["lease"]?.number(3...3600) { settings.ownership.lease = v }
        if let v = g["handover_margin"]?.number(0...100) { settings.ownership.handoverMargin = v }
        if let v = g["handover_after"]?.number(0...86400) { settings.ownership.handoverAfter = v }
        if let v = g["link_lost_grace"]?.number(0...86400) { settings.ownership.linkLostGrace = v }
        if let v = g["passive_delay"]?.number(0...10) { settings.passiveDelay = v }
        if let v = g["dedup_window"]?.number(0...600) { settings.dedupWindow = v }
        return settings
    }

    static func load(_ root: ConfigNode) -> BridgeConfig {
        var config = BridgeConfig()
        guard root.expectMapping(allowed: topKeys) else {
            root.fail("the configuration must be a mapping with at least an 'mqtt' section")
            return config
        }
        if let m = root["mqtt"] {
            config.mqtt = loadMQTT(m)
        } else {
            root.fail("missing 'mqtt' section (mqtt: {url: mqtt://127.0.0.1:1883})")
        }
        if let h = root["homeassistant"] { config.homeAssistant = loadHomeAssistant(h) }
        if let b = root["bluetooth"] { config.bluetooth = loadBluetooth(b) }
        if let a = root["availability"] { config.availability = loadAvailability(a) }
        if let l = root["logging"] { config.logging = loadLogging(l) }
        if let r = root["allow_raw_gatt"], let b = r.bool { config.allowRawGATT = b }
        if let m = root["metrics"] {
            m.expectMapping(allowed: ["listen"])
            if let l = m["listen"]?.string {
                let parts = l.split(separator: ":", omittingEmptySubsequences: false)
                if parts.count < 2 || Int(parts.last ?? "").map({ !(0...65535).contains($0) }) ?? true {
                    m["listen"]?.fail(
                        "\"\(l)\" is not HOST:PORT (\"127.0.0.1:9464\", \"[::1]:9464\", \":9464\" for every address)")
                } else {
                    config.metricsListen = l
                }
            }
        }
        if let g = root["gateway"] { config.gateway = loadGateway(g) }
        if let h = root["health"] {
            h.expectMapping(allowed: ["interval"])
            if let i = h["interval"]?.seconds(0...86400) { config.healthInterval = i }
        }
        if let p = root["parsers"] {
            // Each declaration is checked on its own, so one bad parser neither hides the others' problems nor
            // makes the devices that use a good one fail ("no parser declares ...").
            var accepted: [DeclarativeParserSpec] = []
            for (index, item) in p.items.enumerated() {
                guard let spec = loadParserSpec(item) else { continue }
                do {
                    config.registry = try GATTParserRegistry.builtIn(declaring: accepted + [spec])
                    accepted.append(spec)
                } catch {
                    // "parsers[K].fields[2].type: reason" with K the position among the accepted ones.
                    var text = error.description
                    let prefix = "parsers[\(accepted.count)]"
                    if text.hasPrefix(prefix) { text = "parsers[\(index)]" + text.dropFirst(prefix.count) }
                    if let colon = text.indices.first(where: { text[$0...].hasPrefix(": ") }) {
                        root.problems.add(String(text[..<colon]), String(text[colon...].dropFirst(2)))
                    } else {
                        root.problems.add("parsers[\(index)]", text)
                    }
                }
            }
            config.parserSpecs = accepted
        }
        if let a = root["auto_devices"] { config.autoDevices = loadAutoDevices(a) }
        if let p = root["peripheral"] { config.peripheral = loadPeripheral(p, registry: config.registry) }
        if let d = root["devices"] {
            var ids: [String: String] = [:]
            for (index, item) in d.items.enumerated() {
                guard let device = loadDevice(item, index: index, registry: config.registry) else { continue }
                if let other = ids[device.id] {
                    item.fail("device id '\(device.id)' is also used by \(other); names must be unique")
                }
                ids[device.id] = item.path
                config.devices.append(device)
            }
        }
        return config
    }

    static func loadMQTT(_ n: ConfigNode) -> MQTTSettings {
        var m = MQTTSettings()
        n.expectMapping(allowed: [
            "url", "client_id", "username", "password", "password_file", "tls", "protocol", "base_topic", "keepalive",
            "qos", "retain", "offline_queue", "max_payload", "reconnect", "clean_session", "session_expiry",
            "max_inflight", "receive_buffer", "max_incoming_packet", "receive_buffer_bytes",
        ])
        if let v = n["url"]?.string {
            if v.hasPrefix("mqtt://") || v.hasPrefix("mqtts://") || v.hasPrefix("tcp://") || v.hasPrefix("ssl://") {
                m.url = v
            } else {
                n["url"]?.fail("\"\(v)\" is not a broker URL (mqtt://host[:port] or mqtts://host[:port])")
            }
        } else {
            n.fail("missing 'url' (mqtt://host[:port])")
        }
        m.clientID = n["client_id"]?.string
        m.username = n["username"]?.string
        m.password = n["password"]?.string
        m.passwordFile = n["password_file"]?.string
        if m.password != nil, m.passwordFile != nil { n.fail("give 'password' or 'password_file', not both") }
        if let t = n["tls"] {
            t.expectMapping(allowed: ["ca_file", "ca_dir", "cert_file", "key_file", "verify_hostname"])
            m.caFile = t["ca_file"]?.string
            m.caDirectory = t["ca_dir"]?.string
            m.certificateFile = t["cert_file"]?.string
            m.keyFile = t["key_file"]?.string
            if let v = t["verify_hostname"]?.bool { m.verifyHostname = v }
        }
        if let p = n["protocol"] {
            let text = p.node.scalar ?? ""
            if ["5", "5.0", "3.1.1", "311"].contains(text) {
                m.protocolVersion = text.hasPrefix("5") ? "5" : "3.1.1"
            } else {
                p.fail("\"\(text)\" is not an MQTT protocol version (5 or 3.1.1)")
            }
        }
        if let b = n["base_topic"]?.string {
            if b.isEmpty || b.contains("+") || b.contains("#") || b.hasPrefix("$") || b.hasPrefix("/")
                || b.hasSuffix("/") || zip(b, b.dropFirst()).contains(where: { $0 == "/" && $1 == "/" })
            {
                n["base_topic"]?.fail("\"\(b)\" is not a usable base topic (no wildcards, no leading $ or /)")
            } else {
                m.baseTopic = b
            }
        }
        if let k = n["keepalive"]?.seconds(5...65535) { m.keepAlive = k }
        if let q = n["qos"]?.integer(0...2) { m.qos = q }
        if let r = n["retain"]?.bool { m.retain = r }
        if let q = n["offline_queue"] {
            if q.node.scalar == "disk" {
                m.offlineQueueOnDisk = true
            } else if let v = q.integer(1...10_000_000) {
                m.offlineQueue = v
            }
        }
        if let b = n["clean_session"]?.bool { m.cleanSession = b }
        if let d = n["session_expiry"]?.seconds(0...4_294_967_295) { m.sessionExpiry = d }
        if let i = n["max_inflight"]?.integer(1...32768) { m.maxInflight = i }
        if let i = n["receive_buffer"]?.integer(1...10_000_000) { m.receiveBuffer = i }
        if let i = n["max_incoming_packet"]?.integer(256...268_435_460) { m.maxIncomingPacket = i }
        if let i = n["receive_buffer_bytes"]?.integer(256...4_294_967_295) { m.receiveBufferBytes = i }
        if m.cleanSession == false, m.clientID == nil {
            n["clean_session"]?.fail("a persistent session (clean_session: false) needs a stable client_id")
        }
        if m.password != nil || m.passwordFile != nil, m.username == nil {
            n.fail("a password needs a 'username'")
        }
        if n["tls"] != nil, !(m.url.hasPrefix("mqtts://") || m.url.hasPrefix("ssl://")) {
            n["tls"]?.fail("TLS settings need an mqtts:// url (the url is \(m.url))")
        }
        if let q = n["max_payload"]?.integer(64...268_435_455) { m.maxPayload = q }
        if let r = n["reconnect"] {
            r.expectMapping(allowed: ["initial_delay", "max_delay"])
            if let d = r["initial_delay"]?.seconds(0.01...86400) { m.reconnectInitialDelay = d }
            if let d = r["max_delay"]?.seconds(0.01...86400) { m.reconnectMaximumDelay = d }
        }
        return m
    }

    static func loadHomeAssistant(_ n: ConfigNode) -> HomeAssistantSettings {
        var h = HomeAssistantSettings()
        if n.node.scalar != nil {
            if let b = n.bool { h.enabled = b }
            return h
        }
        n.expectMapping(allowed: ["enabled", "prefix", "status_topic", "state_resend_delay"])
        if let b = n["enabled"]?.bool { h.enabled = b }
        if let p = n["prefix"]?.string { h.prefix = p }
        if let s = n["status_topic"]?.string { h.statusTopic = s }
        if let d = n["state_resend_delay"]?.seconds(0...3600) { h.stateResendDelay = d }
        return h
    }

    static func loadBluetooth(_ n: ConfigNode) -> BluetoothSettings {
        var b = BluetoothSettings()
        n.expectMapping(allowed: [
            "adapters", "scan_services", "passive", "duplicate_data", "connection_slots", "connect_timeout",
            "reconnect", "silence_factor",
        ])
        if let a = n["adapters"] {
            // Addresses upper-case, as BlueZ reports them.
            b.adapters = a.stringList.map { BLEAddress($0)?.text ?? $0 }
            for (i, name) in b.adapters.enumerated()
            where !(name.hasPrefix("hci") && Int(name.dropFirst(3)) != nil) && BLEAddress(name) == nil {
                a.fail("[\(i)] \"\(name)\" is not an adapter name (hci0) or address")
            }
        }
        if let s = n["scan_services"] {
            for item in (s.node.sequence != nil ? s.items : [s]) { if let u = item.uuid { b.scanServices.append(u) } }
        }
        if let p = n["passive"]?.bool { b.passive = p }
        if let d = n["duplicate_data"]?.bool { b.duplicateData = d }
        if let c = n["connection_slots"]?.integer(1...32) { b.connectionSlots = c }
        if let t = n["connect_timeout"]?.seconds(1...600) { b.connectTimeout = t }
        if let r = n["reconnect"] {
            r.expectMapping(allowed: ["initial_delay", "max_delay"])
            if let d = r["initial_delay"]?.seconds(0.01...3600) { b.reconnectInitialDelay = d }
            if let d = r["max_delay"]?.seconds(0.1...86400) { b.reconnectMaximumDelay = d }
        }
        if let f = n["silence_factor"]?.number(2...1000) { b.silenceFactor = f }
        return b
    }

    static func loadAvailability(_ n: ConfigNode) -> AvailabilitySettings {
        var a = AvailabilitySettings()
        n.expectMapping(allowed: ["passive_timeout", "passive_intervals"])
        if let t = n["passive_timeout"]?.seconds(1...86400) { a.passiveMinimumTimeout = t }
        if let i = n["passive_intervals"]?.number(1...1000) { a.passiveIntervals = i }
        return a
    }

    static func loadLogging(_ n: ConfigNode) -> LoggingSettings {
        var l = LoggingSettings()
        n.expectMapping(allowed: ["level", "format", "mqtt_level"])
        let levels = ["trace", "debug", "info", "warning", "error"]
        if let v = n["level"]?.oneOf(levels) { l.level = v }
        if let v = n["format"]?.oneOf(["text", "json"]) { l.format = v }
        if let v = n["mqtt_level"]?.oneOf(levels + ["off"]) { l.mqttLevel = v }
        return l
    }

    static func loadAutoDevices(_ n: ConfigNode) -> AutoDevicesConfig {
        var a = AutoDevicesConfig()
        if n.node.scalar != nil {
            if let b = n.bool { a.enabled = b }
            return a
        }
        n.expectMapping(allowed: ["enabled", "allow", "deny", "min_rssi"])
        if let b = n["enabled"]?.bool { a.enabled = b }
        if let l = n["allow"] { a.allow = Set(l.items.compactMap(\.address)) }
        if let l = n["deny"] { a.deny = Set(l.items.compactMap(\.address)) }
        if let r = n["min_rssi"]?.integer(-127...20) { a.minimumRSSI = r }
        return a
    }

    static func loadParserSpec(_ n: ConfigNode) -> DeclarativeParserSpec? {
        guard n.expectMapping(allowed: ["name", "uuid", "fields"]) else { return nil }
        guard let name = n["name"]?.string else {
            n.fail("missing 'name'")
            return nil
        }
        guard let uuid = n["uuid"]?.string else {
            n.fail("missing 'uuid'")
            return nil
        }
        var fields: [DeclarativeFieldSpec] = []
        if let f = n["fields"] {
            for item in f.items {
                guard
                    item.expectMapping(allowed: [
                        "name", "type", "offset", "scale", "add", "enum", "length", "unit", "device_class",
                        "state_class",
                    ])
                else { continue }
                guard let fname = item["name"]?.string, let type = item["type"]?.string else {
                    item.fail("a field needs 'name', 'type' and 'offset'")
                    continue
                }
                guard item["offset"] != nil else {
                    item.fail("field '\(fname)' needs 'offset' (the octet where it starts)")
                    continue
                }
                var spec = DeclarativeFieldSpec(
                    name: fname, type: type, offset: item["offset"]?.integer(0...65535) ?? 0,
                    scale: item["scale"]?.number(-1e300...1e300), add: item["add"]?.number(-1e300...1e300),
                    length: item["length"]?.integer(0...65535))
                if let e = item["enum"] {
                    var names: [Int64: String] = [:]
                    if e.expectMapping(allowed: Set(e.node.mapping?.map(\.key) ?? [])) {
                        for (key, value) in e.node.mapping ?? [] {
                            guard let k = Int64(key) ?? (key.hasPrefix("0x") ? Int64(key.dropFirst(2), radix: 16) : nil)
                            else {
                                e.fail("enum key \"\(key)\" is not an integer")
                                continue
                            }
                            names[k] = value.scalar ?? ""
                        }
                    }
                    spec.enumNames = names
                }
                applyFieldMetadata(&spec, item)
                fields.append(spec)
            }
        } else {
            n.fail("missing 'fields'")
        }
        return DeclarativeParserSpec(name: name, uuid: uuid, fields: fields)
    }

    static func loadDevice(_ n: ConfigNode, index: Int, registry: GATTParserRegistry) -> DeviceConfig? {
        guard
            n.expectMapping(allowed: [
                "name", "match", "mode", "subscribe", "poll", "poll_interval", "writable", "debounce", "throttle",
                "retain", "qos", "output", "bindkey", "availability_timeout",
            ])
        else {
            n.fail("a device must be a mapping with at least 'match'")
            return nil
        }
        var match = DeviceMatch()
        if let m = n["match"] {
            m.expectMapping(allowed: ["address", "service", "name", "manufacturer"])
            match.address = m["address"]?.address
            match.service = m["service"]?.uuid
            match.namePattern = m["name"]?.string
            if let c = m["manufacturer"] { match.manufacturer = c.integer(0...0xFFFF).map { UInt16($0) } }
            if match.address == nil, match.service == nil, match.namePattern == nil, match.manufacturer == nil,
                m.problems.errors.isEmpty
            {
                m.fail("give at least one of address, service, name, manufacturer")
            }
        } else {
            n.fail("missing 'match' (for example match: {address: \"A4:C1:38:12:34:56\"})")
        }
        let friendly = n["name"]?.string
        var id: String
        if let friendly {
            id = sanitizeDeviceID(friendly)
            if id.isEmpty || id == "bridge" || id.hasPrefix("bridge_") {
                n["name"]?.fail(
                    "\"\(friendly)\" cannot be a device name (it has no usable characters, or 'bridge' is reserved)")
            }
        } else if let a = match.address {
            id = a.compact
        } else {
            n.fail("a device matched by service, name or manufacturer needs a 'name'")
            id = "device\(index)"
        }
        var mode = DeviceMode.passive
        if let m = n["mode"]?.oneOf(DeviceMode.allCases.map(\.rawValue)) { mode = DeviceMode(rawValue: m) ?? .passive }
        func characteristics(_ key: String) -> [BluetoothUUID] {
            guard let list = n[key] else { return [] }
            var out: [BluetoothUUID] = []
            for item in (list.node.sequence != nil ? list.items : [list]) {
                guard let text = item.string else { continue }
                if let parser = registry.parser(named: text), let u = parser.uuids.first {
                    out.append(u)
                } else if let u = BluetoothUUID(text) {
                    out.append(u)
                } else {
                    item.fail("\"\(text)\" is neither a characteristic UUID nor a parser name")
                }
            }
            return out
        }
        let subscribe = characteristics("subscribe")
        let poll = characteristics("poll")
        var writable: [WritableSpec] = []
        if let w = n["writable"] {
            for item in (w.node.sequence != nil ? w.items : [w]) {
                if let spec = loadWritable(item, registry: registry) { writable.append(spec) }
            }
        }
        if mode == .poll, poll.isEmpty {
            n.fail("a poll device needs 'poll': the characteristics to read (UUIDs or parser names)")
        }
        if mode == .passive, !writable.isEmpty {
            n["writable"]?.fail("a passive device cannot be written; use mode connected, poll or on-demand")
        }
        var output = OutputMode.json
        if let o = n["output"]?.oneOf(["json", "attribute", "attribute_and_json"]) {
            output = OutputMode(rawValue: o) ?? .json
        }
        var bindKey: [UInt8]?
        if let k = n["bindkey"]?.string {
            if let bytes = bytesFromHex(k), bytes.count == 16 || bytes.count == 12 {
                bindKey = bytes
            } else {
                n["bindkey"]?.fail("a bind key is 32 hex digits (16 octets; 24 for a legacy MiBeacon key)")
            }
        }
        return DeviceConfig(
            id: id, friendlyName: friendly, match: match, mode: mode, subscribe: subscribe, poll: poll,
            pollInterval: n["poll_interval"]?.seconds(1...604800) ?? .seconds(300), writable: writable,
            debounce: n["debounce"]?.seconds(0...3600), throttle: n["throttle"]?.seconds(0...3600),
            retain: n["retain"]?.bool, qos: n["qos"]?.integer(0...2) ?? -1, output: output,
            bindKey: bindKey, availabilityTimeout: n["availability_timeout"]?.seconds(1...604800), index: index)
    }

    static func loadWritable(_ n: ConfigNode, registry: GATTParserRegistry) -> WritableSpec? {
        var name: String?
        var characteristic: BluetoothUUID?
        var spec = WritableSpec(name: "", characteristic: BluetoothUUID(UInt16(0)), parserName: nil)
        if n.node.scalar != nil {
            name = n.string
        } else {
            n.expectMapping(allowed: [
                "name", "characteristic", "with_response", "min", "max", "step", "options", "platform",
            ])
            name = n["name"]?.string
            if let c = n["characteristic"]?.string {
                if let p = registry.parser(named: c) {
                    characteristic = p.uuids.first
                } else if let u = BluetoothUUID(c) {
                    characteristic = u
                } else {
                    n["characteristic"]?.fail("\"\(c)\" is neither a characteristic UUID nor a parser name")
                }
            }
            spec.withResponse = n["with_response"]?.bool
            spec.minimum = n["min"]?.number(-1e15...1e15)
            spec.maximum = n["max"]?.number(-1e15...1e15)
            spec.step = n["step"]?.number(1e-9...1e15)
            spec.options = n["options"]?.stringList
            if let p = n["platform"]?.oneOf(["number", "switch", "select", "text"]) {
                spec.platform = p
            } else if spec.options != nil {
                spec.platform = "select"
            }
        }
        guard let name, !name.isEmpty else {
            n.fail("a writable value needs a name")
            return nil
        }
        spec.name = name
        // The parser that declares the field decides the characteristic (unless one is given).
        guard name != "result" else {
            n.fail("'result' cannot be a writable name (blebridge/<device>/set/result is the result topic)")
            return nil
        }
        // Parsers declared in the configuration come first: a vendor parser that declares `temperature_c` wins
        // over a built-in one with the same field.
        let candidates = registry.characteristicParsers.filter { parser in
            parser.fields.contains { $0.name == name }
                && (characteristic.map { parser.uuids.contains($0) } ?? true)
        }
        let declaring = candidates.filter { $0 is DeclarativeParser } + candidates.filter { !($0 is DeclarativeParser) }
        if characteristic == nil, declaring.count > 1, !(declaring[0] is DeclarativeParser) {
            n.fail(
                "several parsers declare '\(name)' (\(declaring.map(\.name).joined(separator: ", "))); "
                    + "say which with 'characteristic'")
            return nil
        }
        if let parser = declaring.first, let first = parser.uuids.first {
            spec.parserName = parser.name
            spec.characteristic = characteristic ?? first
            if let field = parser.fields.first(where: { $0.name == name }),
                n.node.mapping?.contains(where: { $0.key == "platform" || $0.key == "options" }) != true
            {
                if field.kind == .boolean {
                    spec.platform = "switch"
                } else if field.kind == .text {
                    spec.platform = "text"
                }
            }
        } else if let characteristic {
            spec.characteristic = characteristic
            spec.parserName = nil
            spec.platform = n.node.mapping?.contains(where: { $0.key == "platform" }) == true ? spec.platform : "text"
        } else {
            n.fail(
                "no parser declares a field '\(name)'; declare one under 'parsers' or give 'characteristic' (raw hex)")
            return nil
        }
        if let lo = spec.minimum, let hi = spec.maximum, lo > hi { n.fail("min \(lo) is above max \(hi)") }
        return spec
    }
}

/// Copies `unit`, `device_class`, `state_class` of a declared field into its spec.
func applyFieldMetadata(_ spec: inout DeclarativeFieldSpec, _ item: ConfigNode) {
    spec.unit = item["unit"]?.string
    spec.deviceClass = item["device_class"]?.string
    spec.stateClass = item["state_class"]?.string
}
