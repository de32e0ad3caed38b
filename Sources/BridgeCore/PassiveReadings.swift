// Multi-gateway mode, passive devices (docs/MULTI-GATEWAY.md#passive-devices): an advertisement that several gateways
// hear is published once. Every gateway reads the device's state topic; a reading is a duplicate when a state
// published lately (by any gateway) already carries it: the same value of the format's own counter together with
// the same fields (BTHome packet id, MiBeacon frame counter, the pvvx/ATC packet counter, RuuviTag's measurement
// sequence), or, for a format without one, the same fields within `gateway.dedup_window`. The gateway that hears the
// device best publishes at once; the k-th best waits k × `gateway.passive_delay` first, so it only publishes what the
// better ones missed.
import GATT
import Synchronization

/// What gateways have published for passive devices lately, and whether a new reading is one of them.
final class PassiveReadings: Sendable {
    /// Fields that count readings in the advertisement formats.
    static let counterFields: Set<String> = ["packet_id", "frame_counter", "packet_counter", "measurement_sequence"]
    /// Fields of the state that are not the reading (this gateway's view of the radio and the time).
    static let ignoredFields: Set<String> = ["rssi", "last_seen", "rssi_by_gateway"]
    /// How many recent states are kept per device.
    static let depth = 8
    /// How long a state with a counter counts (a counter wraps long after this: BTHome's after 256 readings).
    static let counterMemory: Double = 30

    struct Published {
        var fields: [String: JSONValue]
        var at: Double
    }

    let window: Double
    let delay: Double
    let recent = Mutex<[String: [Published]]>([:])

    init(window: Double, delay: Double) {
        self.window = window
        self.delay = delay
    }

    /// A state message of `device` from the broker (ours or another gateway's).
    func noteState(_ device: String, _ payload: [UInt8], wall: Double) {
        guard case .object(let entries)? = try? JSONReader.parse(payload) else { return }
        var fields: [String: JSONValue] = [:]
        for (name, value) in entries where !Self.ignoredFields.contains(name) { fields[name] = value }
        guard !fields.isEmpty else { return }
        note(device, fields, wall: wall)
    }

    /// A reading this gateway publishes now (before its echo comes back).
    func notePublished(_ device: String, _ reading: GATTReading, wall: Double) {
        var fields: [String: JSONValue] = [:]
        for f in reading.fields { fields[f.name] = JSONValue(f.value) }
        note(device, fields, wall: wall)
    }

    func note(_ device: String, _ fields: [String: JSONValue], wall: Double) {
        recent.withLock { all in
            var list = all[device, default: []]
            // Our own state coming back from the broker carries the reading noted when it was published: it takes
            // that entry's place (with every field of the state) instead of a second one.
            if let last = list.last, last.fields.allSatisfy({ k, v in fields[k].map { Self.same($0, v) } ?? false }) {
                list[list.count - 1].fields = fields
            } else {
                list.append(Published(fields: fields, at: wall))
            }
            if list.count > Self.depth { list.removeFirst(list.count - Self.depth) }
            all[device] = list
        }
    }

    /// Whether a state published lately already carries `reading`.
    func isDuplicate(_ device: String, _ reading: GATTReading, wall: Double) -> Bool {
        guard !reading.fields.isEmpty else { return false }
        let counted = reading.fields.contains { Self.counterFields.contains($0.name) }
        let memory = counted ? Self.counterMemory : window
        return recent.withLock { all in
            guard let list = all[device] else { return false }
            return list.contains { p in
                wall - p.at <= memory
                    && reading.fields.allSatisfy { f in
                        p.fields[f.name].map { Self.same($0, JSONValue(f.value)) } ?? false
                    }
            }
        }
    }

    /// A device left the configuration: its history goes too.
    func forget(_ device: String) { _ = recent.withLock { $0.removeValue(forKey: device) } }

    /// Equal values; numbers by value (a JSON `50` is the `50.0` that was published).
    static func same(_ a: JSONValue, _ b: JSONValue) -> Bool {
        switch (a, b) {
        case (.int(let x), .double(let y)), (.double(let y), .int(let x)): return Double(x) == y
        case (.double(let x), .double(let y)): return x == y || abs(x - y) <= 1e-9 * max(abs(x), abs(y))
        case (.array(let x), .array(let y)): return x.count == y.count && zip(x, y).allSatisfy { same($0, $1) }
        case (.object(let x), .object(let y)):
            return x.count == y.count && zip(x, y).allSatisfy { $0.0 == $1.0 && same($0.1, $1.1) }
        default: return a == b
        }
    }
}
