// One device the bridge knows: its configuration, what it last reported, and its session's state.
import GATT
import Logging
import Synchronization

/// Where a device's session stands (logged, and shown in `bridge/devices`).
public enum SessionState: String, Sendable, Hashable {
    /// Known from the configuration, not seen yet.
    case idle
    /// Seen advertising; not connected.
    case discovered
    /// `Connect()` under way.
    case connecting
    /// Services being resolved.
    case resolving
    /// Subscriptions being made.
    case subscribing
    /// Connected, data flowing.
    case streaming
    /// Waiting before the next connection attempt.
    case backingOff = "backing_off"
    /// Multi-gateway mode: another gateway serves it, or this one's claim has not stood yet.
    case standby
    /// A poll (connect, read, disconnect) under way.
    case polling
    /// Disconnected on request (`bridge/request/device/disconnect`); not reconnecting.
    case disconnected
}

/// A device's Device Information Service strings (0x180A), as far as it has them: read once per run after the
/// first connection, for its Home Assistant device and `bridge/devices`.
struct DeviceInformation: Sendable, Equatable {
    /// 2A29 Manufacturer Name String.
    var manufacturer: String?
    /// 2A24 Model Number String.
    var model: String?
    /// 2A26 Firmware Revision String.
    var firmware: String?
    /// 2A27 Hardware Revision String.
    var hardware: String?

    /// The characteristics read, and where each string goes (the registry's string parsers decode them).
    static var characteristics: [(BluetoothUUID, WritableKeyPath<DeviceInformation, String?>)] {
        [
            (BluetoothUUID(UInt16(0x2A29)), \.manufacturer), (BluetoothUUID(UInt16(0x2A24)), \.model),
            (BluetoothUUID(UInt16(0x2A26)), \.firmware), (BluetoothUUID(UInt16(0x2A27)), \.hardware),
        ]
    }
}

/// The mutable part of a device record.
struct DeviceData {
    var address: BLEAddress?
    var advertisedName: String?
    /// Read once per run (`Bridge.readDeviceInformation`); nil until then.
    var deviceInformation: DeviceInformation?
    var fields: [(String, JSONValue)] = []
    var rssi: Int?
    var rssiByAdapter: [String: (rssi: Int, at: Duration)] = [:]
    /// Multi-gateway mode, passive devices: each gateway's smoothed RSSI, best first (`rssi_by_gateway`).
    var rssiByGateway: [(String, Double)] = []
    var lastSeenWall: Double?
    var lastSeen: Duration?
    var lastAdvert: Duration?
    /// Smoothed seconds between advertisements.
    var advertInterval: Double?
    var lastPayloads: [AdvertisementSource: [UInt8]] = [:]
    var advertFields: [GATTFieldDescriptor] = []
    var online: Bool?
    var session: SessionState = .idle
    var link: (any BLELink)?
    var characteristics: [BLECharacteristic] = []
    var characteristicFields: [GATTFieldDescriptor] = []
    /// The hash of the last discovery message published (`publishDiscovery`).
    var discoverySignature: Int?
    var lastError: String?
    var reconnects = 0
    var messages = 0
    var connectedSince: Duration?
    var publishPending = false
    var nextPublishAllowed: Duration = .zero
    var debounceDeadline: Duration?
    var flushScheduled = false
    /// Per notifying characteristic: when it last notified (this connection) and its usual interval (learned
    /// over connections). One dictionary, so that a notification hashes its UUID once and touches one storage.
    var notifyTiming: [BluetoothUUID: NotifyTiming] = [:]
    var wake: CheckedContinuation<Void, Never>?
    var wakeRequested = false
    var sessionTask: Task<Void, Never>?
    var userDisconnected = false
    /// Multi-gateway mode: another gateway serves the device now (its id); the session disconnects and waits.
    var handOverTo: String?
    /// While the device streams: where the bridge's once-a-second tick reports a hand-over or a silent subscription
    /// (one tick for every device, not a timer task each).
    var streamWatch: StreamWatch?
    /// Connected on this adapter by an earlier run, with no link of this process (`adoptConnected`).
    var leftConnectedOn: String?
    var adapter: String?
    /// The class of the last failed attempt (decides whether an advertisement cuts the backoff short).
    var lastFailure: BLEError.Kind?
    /// Commands for this device run one after the other, in the order they arrived.
    var commandTail: Task<Void, Never>?
    /// The state topic and the base topic it was made under (built once, not per published state).
    var stateTopic: (base: String, topic: String)?
}

/// A device: its configuration and its data behind a lock. Safe from any task.
final class DeviceRecord: Sendable {
    let id: String
    let config: DeviceConfig
    let data: Mutex<DeviceData>

    init(id: String, config: DeviceConfig, address: BLEAddress?) {
        self.id = id
        self.config = config
        var d = DeviceData()
        d.address = address
        data = Mutex(d)
    }

    /// Merges fields into the state (later values replace earlier ones, new names are appended).
    func merge(_ reading: GATTReading, now: Duration, wall: Double) {
        data.withLock { d in
            for (k, field) in reading.fields.enumerated() {
                let value = JSONValue(field.value)
                // A parser gives its fields in the same order every time: the k-th is looked at first.
                if k < d.fields.count, d.fields[k].0 == field.name {
                    d.fields[k].1 = value
                } else if let i = d.fields.firstIndex(where: { $0.0 == field.name }) {
                    d.fields[i].1 = value
                } else {
                    d.fields.append((field.name, value))
                }
            }
            d.lastSeen = now
            d.lastSeenWall = wall
            d.messages += 1
        }
    }

    /// The JSON state: the merged fields, then `rssi`, `rssi_by_gateway` (several gateways, passive devices) and
    /// `last_seen`.
    func stateJSON() -> [UInt8] {
        // Written straight into one buffer: the same text as JSONValue.object(fields + rssi + last_seen).bytes,
        // without copying the fields or building the timestamp as a string first.
        data.withLock { d in
            var out: [UInt8] = []
            out.reserveCapacity(64 + 24 * d.fields.count)
            out.append(UInt8(ascii: "{"))
            var first = true
            for (name, value) in d.fields {
                if !first { out.append(UInt8(ascii: ",")) }
                first = false
                GATTValue.string(name).appendJSON(to: &out)
                out.append(UInt8(ascii: ":"))
                value.appendCompact(to: &out)
            }
            if let rssi = d.rssi {
                if !first { out.append(UInt8(ascii: ",")) }
                first = false
                out.append(contentsOf: "\"rssi\":".utf8)
                appendDecimal(Int64(rssi), to: &out)
            }
            if !d.rssiByGateway.isEmpty {
                if !first { out.append(UInt8(ascii: ",")) }
                first = false
                out.append(contentsOf: "\"rssi_by_gateway\":".utf8)
                JSONValue.object(d.rssiByGateway.map { ($0.0, .double($0.1)) }).appendCompact(to: &out)
            }
            if let wall = d.lastSeenWall {
                if !first { out.append(UInt8(ascii: ",")) }
                out.append(contentsOf: "\"last_seen\":".utf8)
                appendISO8601JSON(wall, to: &out)
            }
            out.append(UInt8(ascii: "}"))
            return out
        }
    }

    var address: BLEAddress? { data.withLock { $0.address } }

    /// `topics.state(id)`, made again only when the base topic changed (a reload).
    func stateTopic(_ topics: BridgeTopics) -> String {
        data.withLock { d in
            if let cached = d.stateTopic, cached.base == topics.base { return cached.topic }
            let topic = topics.state(id)
            d.stateTopic = (topics.base, topic)
            return topic
        }
    }

    /// Wakes a session waiting out a backoff.
    func wakeSession() {
        let c = data.withLock { d -> CheckedContinuation<Void, Never>? in
            let c = d.wake
            d.wake = nil
            if c == nil { d.wakeRequested = true }
            return c
        }
        c?.resume()
    }
}

/// When a characteristic last notified and how often it usually does (an exponential average of the gaps).
struct NotifyTiming: Sendable {
    /// The last notification on the current connection; nil before the first one.
    var last: Duration?
    /// The usual gap between notifications, in seconds; nil until two have come.
    var interval: Double?

    /// Notes a notification at `now`.
    mutating func record(_ now: Duration) {
        if let last {
            let gap = (now - last).seconds
            interval = interval.map { $0 * 0.9 + gap * 0.1 } ?? gap
        }
        last = now
    }
}
