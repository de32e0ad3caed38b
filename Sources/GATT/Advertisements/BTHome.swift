// BTHome v2 (SPEC.md §4.1): service data 0xFCD2, plain and AES-CCM encrypted, with an encoder.

/// How one BTHome object's value octets become a field.
enum BTHomeValueKind: Sendable {
    /// An unsigned or signed little-endian integer, published as an integer.
    case integer(signed: Bool)
    /// An unsigned or signed little-endian integer divided by `divisor` (a power of ten), published as a double.
    case decimal(signed: Bool, divisor: Double)
    /// A signed integer times 0.35 rounded to 0.1 (object 0x58, as bthome-ble rounds it).
    case timesPoint35
    /// A binary sensor: any non-zero value is `true`.
    case binary
    /// Button event (0x3A): a snake_case event name.
    case button
    /// Dimmer event (0x3C): event name + steps.
    case dimmer
    /// Seconds since the Unix epoch, published as `YYYY-MM-DDTHH:MM:SS` (UTC).
    case timestamp
    /// UTF-8 text with a 1-octet length prefix.
    case text
    /// Octets with a 1-octet length prefix, published as hex.
    case raw
    /// A firmware version, most significant part last (`01 00 02 03` → `"3.2.0.1"`).
    case firmwareVersion
}

/// One row of the BTHome object table (SPEC.md §4.1, from bthome-ble `const.MEAS_TYPES`).
struct BTHomeObjectInfo: Sendable {
    let name: String
    /// Value octets; 0 means a 1-octet length prefix follows the id (text, raw).
    let length: Int
    let kind: BTHomeValueKind
    /// A small number per distinct `name`, so the decoder spots repeated fields without comparing strings.
    var nameIndex = 0

    init(name: String, length: Int, kind: BTHomeValueKind) {
        self.name = name
        self.length = length
        self.kind = kind
    }
}

/// The BTHome v2 object table and its field names.
enum BTHomeObjects {
    private static func int(_ name: String, _ length: Int, signed: Bool = false) -> BTHomeObjectInfo {
        BTHomeObjectInfo(name: name, length: length, kind: .integer(signed: signed))
    }
    private static func dec(_ name: String, _ length: Int, _ divisor: Double, signed: Bool = false)
        -> BTHomeObjectInfo
    {
        BTHomeObjectInfo(name: name, length: length, kind: .decimal(signed: signed, divisor: divisor))
    }
    private static func bin(_ name: String) -> BTHomeObjectInfo {
        BTHomeObjectInfo(name: name, length: 1, kind: .binary)
    }

    /// Indexed by object id; nil for ids the table does not define (an unknown id ends parsing).
    static let table: [BTHomeObjectInfo?] = {
        var t = [BTHomeObjectInfo?](repeating: nil, count: 256)
        t[0x00] = int("packet_id", 1)
        t[0x01] = int("battery_pct", 1)
        t[0x02] = dec("temperature_c", 2, 100, signed: true)
        t[0x03] = dec("humidity_pct", 2, 100)
        t[0x04] = int("pressure_pa", 3)  // 0.01 hPa = 1 Pa
        t[0x05] = dec("illuminance_lx", 3, 100)
        t[0x06] = dec("mass_kg", 2, 100)
        t[0x07] = dec("mass_lb", 2, 100)
        t[0x08] = dec("dew_point_c", 2, 100, signed: true)
        t[0x09] = int("count", 1)
        t[0x0A] = dec("energy_kwh", 3, 1000)
        t[0x0B] = dec("power_w", 3, 100)
        t[0x0C] = dec("voltage_v", 2, 1000)
        t[0x0D] = int("pm25_ug_m3", 2)
        t[0x0E] = int("pm10_ug_m3", 2)
        t[0x0F] = bin("generic")
        t[0x10] = bin("power")
        t[0x11] = bin("opening")
        t[0x12] = int("co2_ppm", 2)
        t[0x13] = int("voc_ug_m3", 2)
        t[0x14] = dec("moisture_pct", 2, 100)
        t[0x15] = bin("battery_low")
        t[0x16] = bin("battery_charging")
        t[0x17] = bin("carbon_monoxide")
        t[0x18] = bin("cold")
        t[0x19] = bin("connectivity")
        t[0x1A] = bin("door")
        t[0x1B] = bin("garage_door")
        t[0x1C] = bin("gas")
        t[0x1D] = bin("heat")
        t[0x1E] = bin("light")
        t[0x1F] = bin("lock")
        t[0x20] = bin("moisture")
        t[0x21] = bin("motion")
        t[0x22] = bin("moving")
        t[0x23] = bin("occupancy")
        t[0x24] = bin("plug")
        t[0x25] = bin("presence")
        t[0x26] = bin("problem")
        t[0x27] = bin("running")
        t[0x28] = bin("safety")
        t[0x29] = bin("smoke")
        t[0x2A] = bin("sound")
        t[0x2B] = bin("tamper")
        t[0x2C] = bin("vibration")
        t[0x2D] = bin("window")
        t[0x2E] = dec("humidity_pct", 1, 1)  // a double, like 0x03
        t[0x2F] = dec("moisture_pct", 1, 1)  // a double, like 0x14
        t[0x3A] = BTHomeObjectInfo(name: "button_event", length: 1, kind: .button)
        t[0x3B] = int("command", 1)
        t[0x3C] = BTHomeObjectInfo(name: "dimmer_event", length: 2, kind: .dimmer)
        t[0x3D] = int("count", 2)
        t[0x3E] = int("count", 4)
        t[0x3F] = dec("rotation_deg", 2, 10, signed: true)
        t[0x40] = int("distance_mm", 2)
        t[0x41] = dec("distance_m", 2, 10)
        t[0x42] = dec("duration_s", 3, 1000)
        t[0x43] = dec("current_a", 2, 1000)
        t[0x44] = dec("speed_m_s", 2, 100)
        t[0x45] = dec("temperature_c", 2, 10, signed: true)
        t[0x46] = dec("uv_index", 1, 10)
        t[0x47] = dec("volume_l", 2, 10)
        t[0x48] = int("volume_ml", 2)
        t[0x49] = dec("volume_flow_rate_m3_h", 2, 1000)
        t[0x4A] = dec("voltage_v", 2, 10)
        t[0x4B] = dec("gas_m3", 3, 1000)
        t[0x4C] = dec("gas_m3", 4, 1000)
        t[0x4D] = dec("energy_kwh", 4, 1000)
        t[0x4E] = dec("volume_l", 4, 1000)
        t[0x4F] = dec("water_l", 4, 1000)
        t[0x50] = BTHomeObjectInfo(name: "timestamp", length: 4, kind: .timestamp)
        t[0x51] = dec("acceleration_m_s2", 2, 1000)
        t[0x52] = dec("gyroscope_deg_s", 2, 1000)
        t[0x53] = BTHomeObjectInfo(name: "text", length: 0, kind: .text)
        t[0x54] = BTHomeObjectInfo(name: "raw_data", length: 0, kind: .raw)
        t[0x55] = dec("volume_storage_l", 4, 1000)
        t[0x56] = int("conductivity_us_cm", 2)
        t[0x57] = dec("temperature_c", 1, 1, signed: true)
        t[0x58] = BTHomeObjectInfo(name: "temperature_c", length: 1, kind: .timesPoint35)
        t[0x59] = int("count", 1, signed: true)
        t[0x5A] = int("count", 2, signed: true)
        t[0x5B] = int("count", 4, signed: true)
        t[0x5C] = dec("power_w", 4, 100, signed: true)
        t[0x5D] = dec("current_a", 2, 1000, signed: true)
        t[0x5E] = dec("direction_deg", 2, 100)
        t[0x5F] = dec("precipitation_mm", 2, 10)
        t[0x60] = int("channel", 1)
        t[0x61] = int("rotational_speed_rpm", 2)
        t[0x62] = dec("speed_m_s", 4, 1_000_000, signed: true)
        t[0x63] = dec("acceleration_m_s2", 4, 1_000_000, signed: true)
        t[0x64] = int("light_level", 1)
        t[0x65] = int("settings_revision", 1)
        t[0xF0] = int("device_type_id", 2)
        t[0xF1] = BTHomeObjectInfo(name: "firmware_version", length: 4, kind: .firmwareVersion)
        t[0xF2] = BTHomeObjectInfo(name: "firmware_version", length: 3, kind: .firmwareVersion)
        var indices: [String: Int] = [:]
        for id in 0..<256 {
            guard let name = t[id]?.name else { continue }
            if indices[name] == nil { indices[name] = indices.count }
            t[id]?.nameIndex = indices[name] ?? 0
        }
        return t
    }()

    /// The published fields: `mac`, then the table's names in object-id order (first occurrence), each with its unit
    /// and Home Assistant classes as bthome-ble publishes them.
    static let fields: [GATTFieldDescriptor] = {
        let micro = GATTHomeAssistant.microSign
        let declared: [GATTFieldDescriptor] = [
            .plain("packet_id"), .measurement("battery_pct", "%", "battery"),
            .measurement("temperature_c", "°C", "temperature"), .measurement("humidity_pct", "%", "humidity"),
            .measurement("pressure_pa", "Pa", "pressure"), .measurement("illuminance_lx", "lx", "illuminance"),
            .measurement("mass_kg", "kg", "weight"), .measurement("mass_lb", "lb", "weight"),
            .measurement("dew_point_c", "°C", "temperature"), .plain("count"),
            .increasing("energy_kwh", "kWh", "energy"), .measurement("power_w", "W", "power"),
            .measurement("voltage_v", "V", "voltage"), .measurement("pm25_ug_m3", "\(micro)g/m³", "pm25"),
            .measurement("pm10_ug_m3", "\(micro)g/m³", "pm10"), .boolean("generic"), .boolean("power"),
            .boolean("opening"), .measurement("co2_ppm", "ppm", "carbon_dioxide"),
            .measurement("voc_ug_m3", "\(micro)g/m³", "volatile_organic_compounds"),
            .measurement("moisture_pct", "%", "moisture"), .boolean("battery_low"), .boolean("battery_charging"),
            .boolean("carbon_monoxide"), .boolean("cold"), .boolean("connectivity"), .boolean("door"),
            .boolean("garage_door"), .boolean("gas"), .boolean("heat"), .boolean("light"), .boolean("lock"),
            .boolean("moisture"), .boolean("motion"), .boolean("moving"), .boolean("occupancy"), .boolean("plug"),
            .boolean("presence"), .boolean("problem"), .boolean("running"), .boolean("safety"), .boolean("smoke"),
            .boolean("sound"), .boolean("tamper"), .boolean("vibration"), .boolean("window"),
            .text("button_event"), .plain("command"), .text("dimmer_event"), .plain("dimmer_steps"),
            .measurement("rotation_deg", "°"), .measurement("distance_mm", "mm", "distance"),
            .measurement("distance_m", "m", "distance"), .measurement("duration_s", "s", "duration"),
            .measurement("current_a", "A", "current"), .measurement("speed_m_s", "m/s", "speed"),
            .measurement("uv_index", "UV index"),
            GATTFieldDescriptor("volume_l", unit: "L", deviceClass: "volume", stateClass: "total"),
            GATTFieldDescriptor("volume_ml", unit: "mL", deviceClass: "volume", stateClass: "total"),
            .measurement("volume_flow_rate_m3_h", "m³/h", "volume_flow_rate"), .increasing("gas_m3", "m³", "gas"),
            .increasing("water_l", "L", "water"), .text("timestamp"), .measurement("acceleration_m_s2", "m/s²"),
            .measurement("gyroscope_deg_s", "°/s"), .text("text"), .text("raw_data"),
            .measurement("volume_storage_l", "L", "volume_storage"),
            .measurement("conductivity_us_cm", "\(micro)S/cm", "conductivity"), .measurement("direction_deg", "°"),
            .measurement("precipitation_mm", "mm", "precipitation"), .plain("channel"),
            .measurement("rotational_speed_rpm", "rpm"), .plain("light_level", stateClass: "measurement"),
            .plain("settings_revision"), .plain("device_type_id"), .text("firmware_version"),
        ]
        let byName = Dictionary(declared.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
        var fields: [GATTFieldDescriptor] = [.text("mac")]
        var seen: Set<String> = ["mac"]
        for id in 0..<256 {
            guard let object = table[id] else { continue }
            var names = [object.name]
            if case .dimmer = object.kind { names.append("dimmer_steps") }
            for name in names where seen.insert(name).inserted {
                // Every table name is in `declared` (a test checks); the fallback keeps a new row published.
                fields.append(byName[name] ?? .inferred(fromName: name))
            }
        }
        return fields
    }()

    /// Every defined object id, ascending.
    static let definedIDs: [UInt8] = (0...255).compactMap { table[$0] == nil ? nil : UInt8($0) }

    /// 0x3A button events (bthome-ble `BUTTON_EVENTS`, SPEC.md §4.1).
    static func buttonEventName(_ raw: UInt8) -> String? {
        switch raw {
        case 0x00: return "none"
        case 0x01: return "press"
        case 0x02: return "double_press"
        case 0x03: return "triple_press"
        case 0x04: return "long_press"
        case 0x05: return "long_double_press"
        case 0x06: return "long_triple_press"
        case 0x80: return "hold_press"
        default: return nil
        }
    }

    static func buttonEventCode(_ name: String) -> UInt8? {
        for raw in [0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x80] as [UInt8] where buttonEventName(raw) == name {
            return raw
        }
        return nil
    }

    /// 0x3C dimmer events (bthome-ble `DIMMER_EVENTS`).
    static func dimmerEventName(_ raw: UInt8) -> String? {
        switch raw {
        case 0x00: return "none"
        case 0x01: return "rotate_left"
        case 0x02: return "rotate_right"
        default: return nil
        }
    }

    /// The object id the encoder uses for a field name: the widest or finest of the ids sharing it.
    static let preferredID: [String: UInt8] = {
        var map: [String: UInt8] = [:]
        for id in definedIDs {
            guard let info = table[Int(id)], map[info.name] == nil else { continue }
            map[info.name] = id
        }
        map["count"] = 0x3E  // uint32 rather than uint8
        map["timestamp"] = 0x50
        map["firmware_version"] = 0xF1
        return map
    }()
}

/// Decodes BTHome v2 service data (UUID 0xFCD2), plain or encrypted (SPEC.md §4.1).
///
/// Repeated fields get `_1`, `_2`, … suffixes (all occurrences, in order). The complete objects before a truncated
/// one are kept; an unknown object id ends parsing. A payload that yields no object at all is rejected, and so is
/// an unencrypted packet from a device with a configured bind key (bthome-ble's downgrade rule). Replay (counters
/// going backwards) is the caller's job: this parser is stateless.
public struct BTHomeV2Parser: AdvertisementParser {
    /// Where this format is found: service data UUID 0xFCD2.
    public let sources: [AdvertisementSource] = [.serviceData(BluetoothUUID(UInt16(0xFCD2)))]
    /// `bthome_v2`: the parser name in logs and on the command line.
    public let name = "bthome_v2"
    static let format = "BTHome v2"

    /// `mac` (when the packet embeds it), then every field of the object table (SPEC.md §4.1) in object-id order,
    /// `dimmer_steps` after `dimmer_event`. A packet carries only some of them. A field that occurs more than once in
    /// one packet is published as `<name>_1`, `<name>_2`, …; each has the descriptor of `<name>`.
    public var fields: [GATTFieldDescriptor] { BTHomeObjects.fields }

    /// Creates the parser. It holds no state.
    public init() {}

    /// Decodes one payload; throws a `GATTParseError` naming the format when it must be rejected.
    public func decode(_ payload: [UInt8], from source: AdvertisementSource, context: AdvertisementContext)
        throws(GATTParseError) -> GATTReading
    {
        guard let info = payload.first else {
            throw .invalidLength(expected: "BTHome v2: device information octet and objects", actual: 0)
        }
        let version = info >> 5
        guard version == 2 else {
            throw .invalidValue(
                field: "BTHome v2 device information", offset: 0, reason: "version \(version), expected 2")
        }
        var start = 1
        var includedMAC: AdvertisementMAC? = nil
        if info & 0x02 != 0 {
            guard payload.count >= 7 else {
                throw .invalidLength(expected: "BTHome v2 with MAC: at least 7 octets", actual: payload.count)
            }
            includedMAC = AdvertisementMAC(payload, at: 1, reversed: true)
            start = 7
        }
        guard info & 0x01 != 0 else {
            if context.bindKey != nil {
                throw .decryptionFailed(
                    "BTHome v2: unencrypted packet from a device with a bind key (possible downgrade; ignored)")
            }
            return try Self.decodeObjects(payload, from: start, mac: includedMAC, encrypted: false)
        }
        let end = payload.count - 8
        guard end > start else {
            throw .invalidLength(
                expected: "BTHome v2 encrypted: device info, ciphertext (1+), counter (4), MIC (4)",
                actual: payload.count)
        }
        let (key, cipher) = try context.requireKey(Self.format)
        let address: AdvertisementMAC
        if let includedMAC { address = includedMAC } else { address = try context.requireMAC(Self.format) }
        var nonce = address.array
        nonce.reserveCapacity(13)
        nonce.append(0xD2)
        nonce.append(0xFC)
        nonce.append(info)
        nonce.append(contentsOf: payload[end..<(end + 4)])
        let plaintext: [UInt8]
        do {
            plaintext = try cipher.decrypt(
                key: key, nonce: nonce, ciphertext: Array(payload[start..<end]),
                tag: Array(payload[(end + 4)...]), aad: [])
        } catch {
            throw cipherFailure(error, format: Self.format)
        }
        return try Self.decodeObjects(plaintext, from: 0, mac: includedMAC, encrypted: true)
    }

    /// Decodes the object sequence in `bytes[start...]`.
    static func decodeObjects(_ bytes: [UInt8], from start: Int, mac: AdvertisementMAC?, encrypted: Bool)
        throws(GATTParseError) -> GATTReading
    {
        let table = BTHomeObjects.table
        var reading = GATTReading(capacity: mac == nil ? 4 : 5)
        if let mac { reading.append("mac", .string(mac.string)) }
        let headerFields = reading.fields.count
        // Why parsing stopped early, turned into an error only when nothing was decoded.
        var stop: (offset: Int, id: UInt8, needed: Int, available: Int)? = nil
        var seen: (UInt64, UInt64) = (0, 0)
        var needsSuffixes = false
        var i = start
        let count = bytes.count
        while i < count {
            let id = bytes[i]
            guard let object = table[Int(id)] else {
                stop = (i, id, -1, 0)
                break
            }
            var dataStart = i + 1
            var length = object.length
            if length == 0 {
                guard dataStart < count else {
                    stop = (i, id, 1, 0)
                    break
                }
                length = Int(bytes[dataStart])
                dataStart += 1
            }
            guard dataStart + length <= count else {
                stop = (i, id, length, count - dataStart)
                break
            }
            i = dataStart + length
            let before = reading.fields.count
            append(object, bytes, dataStart, length, to: &reading)
            if reading.fields.count > before {
                let bit = UInt64(1) << UInt64(object.nameIndex & 63)
                if object.nameIndex < 64 {
                    if seen.0 & bit != 0 { needsSuffixes = true }
                    seen.0 |= bit
                } else {
                    if seen.1 & bit != 0 { needsSuffixes = true }
                    seen.1 |= bit
                }
            }
        }
        guard reading.fields.count > headerFields else {
            let label = encrypted ? "decrypted offset" : "offset"
            guard let stop else {
                throw .invalidValue(field: "BTHome v2 objects", offset: start, reason: "the packet carries no objects")
            }
            let idText = "0x\(hex(UInt64(stop.id), 2).uppercased())"
            if stop.needed < 0 {
                throw .invalidValue(
                    field: "BTHome v2 object id", offset: stop.offset,
                    reason: "unknown object id \(idText) at \(label) \(stop.offset): "
                        + "length unknown, rest of packet unparseable")
            }
            throw .invalidValue(
                field: encrypted ? "BTHome v2 decrypted object \(idText)" : "BTHome v2 object \(idText)",
                offset: stop.offset,
                reason: "truncated: needs \(stop.needed) octet(s), \(stop.available) available")
        }
        if needsSuffixes { addSuffixes(&reading, from: headerFields) }
        return reading
    }

    @inline(__always)
    private static func littleEndian(_ bytes: [UInt8], _ start: Int, _ length: Int) -> UInt64 {
        var v: UInt64 = 0
        var k = length - 1
        while k >= 0 {
            v = v << 8 | UInt64(bytes[start + k])
            k -= 1
        }
        return v
    }

    @inline(__always)
    private static func append(
        _ object: BTHomeObjectInfo, _ bytes: [UInt8], _ start: Int, _ length: Int, to reading: inout GATTReading
    ) {
        switch object.kind {
        case .integer(let signed):
            let raw = littleEndian(bytes, start, length)
            let value = signed ? signExtend(raw, bits: length * 8) : Int64(bitPattern: raw)
            reading.append(object.name, .int(value))
        case .decimal(let signed, let divisor):
            let raw = littleEndian(bytes, start, length)
            let value = signed ? signExtend(raw, bits: length * 8) : Int64(bitPattern: raw)
            reading.append(object.name, .double(Double(value) / divisor))
        case .timesPoint35:
            // raw × 0.35 rounded to 0.1 = round(raw × 3.5) / 10, exact in binary for every sint8.
            let tenths = advRounded(Double(Int8(bitPattern: bytes[start])) * 3.5) ?? 0
            reading.append(object.name, .double(Double(tenths) / 10))
        case .binary:
            reading.append(object.name, .bool(bytes[start] != 0))
        case .button:
            let name = BTHomeObjects.buttonEventName(bytes[start])
            reading.append(object.name, name.map { .string($0) } ?? .null)
        case .dimmer:
            let name = BTHomeObjects.dimmerEventName(bytes[start])
            reading.append(object.name, name.map { .string($0) } ?? .null)
            reading.append("dimmer_steps", .int(Int64(bytes[start + 1])))
        case .timestamp:
            reading.append(object.name, .string(advISOTimestamp(epochSeconds: Int64(littleEndian(bytes, start, 4)))))
        case .text:
            // bthome-ble skips empty and non-UTF-8 text.
            guard length > 0, let text = String(validating: bytes[start..<(start + length)], as: UTF8.self) else {
                return
            }
            reading.append(object.name, .string(text))
        case .raw:
            guard length > 0 else { return }
            reading.append(object.name, .string(hexString(bytes[start..<(start + length)])))
        case .firmwareVersion:
            var parts: [String] = []
            var k = length - 1
            while k >= 0 {
                parts.append(String(bytes[start + k]))
                k -= 1
            }
            reading.append(object.name, .string(parts.joined(separator: ".")))
        }
    }

    /// Renames every field whose name occurs more than once to `name_1`, `name_2`, … in order.
    private static func addSuffixes(_ reading: inout GATTReading, from first: Int) {
        var totals: [String: Int] = [:]
        for field in reading.fields[first...] { totals[field.name, default: 0] += 1 }
        var seen: [String: Int] = [:]
        for k in first..<reading.fields.count {
            let name = reading.fields[k].name
            guard let total = totals[name], total > 1 else { continue }
            let n = seen[name, default: 0] + 1
            seen[name] = n
            reading.fields[k].name = "\(name)_\(n)"
        }
    }
}

/// One BTHome v2 object to encode: an object id and its value in the decoded field's unit.
public struct BTHomeObject: Sendable, Equatable {
    /// The object id (SPEC.md §4.1 table).
    public var id: UInt8
    /// The value as the decoder publishes it: a number in the field's unit, a bool for binary sensors, a name for
    /// button events (or the raw code), epoch seconds for 0x50, text for 0x53, hex for 0x54, `"a.b.c.d"` for 0xF1/0xF2.
    /// For the dimmer (0x3C) give `.array([event name or code, steps])`.
    public var value: GATTValue

    /// Creates an object.
    public init(id: UInt8, _ value: GATTValue) {
        self.id = id
        self.value = value
    }

    /// 0x02 temperature, 0.01 °C.
    public static func temperature(_ celsius: Double) -> BTHomeObject { BTHomeObject(id: 0x02, .double(celsius)) }
    /// 0x03 humidity, 0.01 %.
    public static func humidity(_ percent: Double) -> BTHomeObject { BTHomeObject(id: 0x03, .double(percent)) }
    /// 0x01 battery, %.
    public static func battery(_ percent: Int) -> BTHomeObject { BTHomeObject(id: 0x01, .int(Int64(percent))) }
    /// 0x00 packet id.
    public static func packetID(_ id: UInt8) -> BTHomeObject { BTHomeObject(id: 0x00, .int(Int64(id))) }
}

/// Builds BTHome v2 service data (UUID 0xFCD2), plain or encrypted, for the simulator and for tests.
public enum BTHomeEncoder {
    /// Encodes `objects` in the given order into an unencrypted packet.
    ///
    /// - Parameters:
    ///   - triggerBased: sets device-information bit 2 (an irregularly advertising device).
    ///   - includedMAC: when given, sets bit 1 and embeds this address (stored reversed, as older devices do).
    /// - Throws: `notEncodable` naming the object when a value is missing, of the wrong type or out of range.
    public static func encode(_ objects: [BTHomeObject], triggerBased: Bool = false, includedMAC: String? = nil)
        throws(GATTParseError) -> [UInt8]
    {
        var out: [UInt8] = [try deviceInfo(encrypted: false, triggerBased: triggerBased, mac: includedMAC != nil)]
        if let includedMAC { out.append(contentsOf: try parseMAC(includedMAC).reversedArray) }
        out.append(contentsOf: try objectBytes(objects))
        return out
    }

    /// Encodes a reading with SPEC.md field names (as `BTHomeV2Parser` produces them, without `_1` suffixes)
    /// into an unencrypted packet, objects in ascending id order. A `mac` field is embedded (bit 1).
    ///
    /// - Throws: `notEncodable` for a field with no BTHome object or a value out of the object's range.
    public static func encode(_ reading: GATTReading, triggerBased: Bool = false) throws(GATTParseError) -> [UInt8] {
        var mac: String? = nil
        var objects: [BTHomeObject] = []
        var k = 0
        while k < reading.fields.count {
            let field = reading.fields[k]
            k += 1
            if field.name == "mac", case .string(let text) = field.value {
                mac = text
                continue
            }
            if field.name == "dimmer_event" {
                var steps = GATTValue.int(0)
                if k < reading.fields.count, reading.fields[k].name == "dimmer_steps" {
                    steps = reading.fields[k].value
                    k += 1
                }
                objects.append(BTHomeObject(id: 0x3C, .array([field.value, steps])))
                continue
            }
            if field.name == "firmware_version", case .string(let text) = field.value {
                objects.append(BTHomeObject(id: text.split(separator: ".").count == 3 ? 0xF2 : 0xF1, field.value))
                continue
            }
            guard let id = BTHomeObjects.preferredID[field.name] else {
                throw .notEncodable("BTHome v2: no object for field '\(field.name)'")
            }
            objects.append(BTHomeObject(id: id, field.value))
        }
        let sorted = objects.enumerated().sorted { ($0.element.id, $0.offset) < ($1.element.id, $1.offset) }
        return try encode(sorted.map(\.element), triggerBased: triggerBased, includedMAC: mac)
    }

    /// The object id the encoder uses for `field` (a decoded field name such as `temperature_c`), for fields of
    /// fixed size that a broadcaster can send from a number or a bool; nil for others (text, raw data, events).
    public static func objectID(forField field: String) -> UInt8? {
        guard let id = BTHomeObjects.preferredID[field], let info = BTHomeObjects.table[Int(id)] else { return nil }
        switch info.kind {
        case .text, .raw, .button, .dimmer, .firmwareVersion, .timestamp: return nil
        default: return id
        }
    }

    /// A value of `field` that encodes (zero, or false), for working out a packet's size ahead of data.
    public static func placeholder(forField field: String) -> GATTValue {
        guard let id = objectID(forField: field), let info = BTHomeObjects.table[Int(id)] else { return .null }
        if case .binary = info.kind { return .bool(false) }
        return .int(0)
    }

    /// The objects `encode(_ reading:)` would send for `reading`, in ascending id order, for `encodeEncrypted`.
    ///
    /// - Throws: `notEncodable` for a field with no fixed-size BTHome object.
    public static func objects(for reading: GATTReading) throws(GATTParseError) -> [BTHomeObject] {
        var objects: [BTHomeObject] = []
        for field in reading.fields {
            guard let id = objectID(forField: field.name) ?? (field.name == "packet_id" ? 0 : nil) else {
                throw .notEncodable("BTHome v2: no object for field '\(field.name)'")
            }
            objects.append(BTHomeObject(id: id, field.value))
        }
        let sorted = objects.enumerated().sorted { ($0.element.id, $0.offset) < ($1.element.id, $1.offset) }
        return sorted.map(\.element)
    }

    /// Encodes `objects` into an encrypted packet: `device_info | [MAC] | ciphertext | counter (4, LE) | MIC (4)`.
    ///
    /// - Parameters:
    ///   - key: the 16-octet bind key.
    ///   - mac: the advertiser address (part of the nonce).
    ///   - counter: the encryption counter; a real device increases it with every packet.
    ///   - includeMAC: embeds `mac` in the packet (bit 1).
    /// - Throws: `notEncodable` for a bad value or address, `decryptionFailed` from the cipher (bad key size).
    public static func encodeEncrypted(
        _ objects: [BTHomeObject], key: [UInt8], mac: String, counter: UInt32, cipher: any AESCCMCipher,
        triggerBased: Bool = false, includeMAC: Bool = false
    ) throws(GATTParseError) -> [UInt8] {
        let address = try parseMAC(mac)
        let info = try deviceInfo(encrypted: true, triggerBased: triggerBased, mac: includeMAC)
        let counterBytes: [UInt8] = [
            UInt8(truncatingIfNeeded: counter), UInt8(truncatingIfNeeded: counter >> 8),
            UInt8(truncatingIfNeeded: counter >> 16), UInt8(truncatingIfNeeded: counter >> 24),
        ]
        let nonce = address.array + [0xD2, 0xFC, info] + counterBytes
        let sealed = try cipher.encrypt(
            key: key, nonce: nonce, plaintext: try objectBytes(objects), aad: [], tagLength: 4)
        var out: [UInt8] = [info]
        if includeMAC { out.append(contentsOf: address.reversedArray) }
        out.append(contentsOf: sealed.ciphertext)
        out.append(contentsOf: counterBytes)
        out.append(contentsOf: sealed.tag)
        return out
    }

    private static func deviceInfo(encrypted: Bool, triggerBased: Bool, mac: Bool) throws(GATTParseError) -> UInt8 {
        var info: UInt8 = 2 << 5
        if encrypted { info |= 0x01 }
        if mac { info |= 0x02 }
        if triggerBased { info |= 0x04 }
        return info
    }

    private static func parseMAC(_ text: String) throws(GATTParseError) -> AdvertisementMAC {
        guard let mac = AdvertisementMAC(text) else { throw .notEncodable("BTHome v2: '\(text)' is not a MAC address") }
        return mac
    }

    static func objectBytes(_ objects: [BTHomeObject]) throws(GATTParseError) -> [UInt8] {
        var out: [UInt8] = []
        out.reserveCapacity(objects.count * 4)
        for object in objects {
            guard let info = BTHomeObjects.table[Int(object.id)] else {
                throw .notEncodable("BTHome v2: unknown object id 0x\(hex(UInt64(object.id), 2).uppercased())")
            }
            out.append(object.id)
            out.append(contentsOf: try valueBytes(info, object))
        }
        return out
    }

    private static func number(_ value: GATTValue) -> Double? {
        switch value {
        case .int(let v): return Double(v)
        case .double(let v): return v
        case .bool(let b): return b ? 1 : 0
        default: return nil
        }
    }

    private static func integerBytes(_ raw: Double, _ info: BTHomeObjectInfo, signed: Bool, id: UInt8)
        throws(GATTParseError) -> [UInt8]
    {
        let bits = Double(info.length * 8)
        let (low, high): (Double, Double) =
            signed ? (-pow2(bits - 1), pow2(bits - 1) - 1) : (0, pow2(bits) - 1)
        guard let integer = advRounded(raw), Double(integer) >= low, Double(integer) <= high else {
            throw .notEncodable(
                "BTHome v2: \(info.name) (object 0x\(hex(UInt64(id), 2).uppercased())) raw value \(raw) out of range")
        }
        let pattern = UInt64(bitPattern: integer)
        return (0..<info.length).map { UInt8(truncatingIfNeeded: pattern >> (8 * UInt64($0))) }
    }

    private static func pow2(_ e: Double) -> Double {
        var v = 1.0
        var k = 0.0
        while k < e {
            v *= 2
            k += 1
        }
        return v
    }

    private static func valueBytes(_ info: BTHomeObjectInfo, _ object: BTHomeObject) throws(GATTParseError) -> [UInt8] {
        let id = object.id
        func wrongType() -> GATTParseError {
            .notEncodable(
                "BTHome v2: \(info.name) (object 0x\(hex(UInt64(id), 2).uppercased())) cannot take \(object.value)")
        }
        switch info.kind {
        case .integer(let signed):
            guard let v = number(object.value) else { throw wrongType() }
            return try integerBytes(v, info, signed: signed, id: id)
        case .decimal(let signed, let divisor):
            guard let v = number(object.value) else { throw wrongType() }
            return try integerBytes(v * divisor, info, signed: signed, id: id)
        case .timesPoint35:
            guard let v = number(object.value) else { throw wrongType() }
            return try integerBytes(v / 0.35, info, signed: true, id: id)
        case .binary:
            guard let v = number(object.value) else { throw wrongType() }
            return [v != 0 ? 1 : 0]
        case .button:
            if case .string(let name) = object.value {
                guard let code = BTHomeObjects.buttonEventCode(name) else { throw wrongType() }
                return [code]
            }
            guard let v = number(object.value) else { throw wrongType() }
            return try integerBytes(v, info, signed: false, id: id)
        case .dimmer:
            guard case .array(let parts) = object.value, parts.count == 2, let steps = number(parts[1]),
                steps >= 0, steps <= 255
            else { throw wrongType() }
            var event: UInt8
            switch parts[0] {
            case .string("none"): event = 0
            case .string("rotate_left"): event = 1
            case .string("rotate_right"): event = 2
            default:
                guard let v = number(parts[0]), v >= 0, v <= 255 else { throw wrongType() }
                event = UInt8(v)
            }
            return [event, UInt8(steps)]
        case .timestamp:
            if case .string(let text) = object.value {
                guard let seconds = advEpochSeconds(iso: text) else { throw wrongType() }
                return try integerBytes(Double(seconds), info, signed: false, id: id)
            }
            guard let v = number(object.value) else { throw wrongType() }
            return try integerBytes(
                v, BTHomeObjectInfo(name: info.name, length: 4, kind: info.kind), signed: false, id: id)
        case .text:
            guard case .string(let text) = object.value, text.utf8.count <= 255 else { throw wrongType() }
            return [UInt8(text.utf8.count)] + Array(text.utf8)
        case .raw:
            guard case .string(let text) = object.value, let bytes = bytesFromHex(text), bytes.count <= 255 else {
                throw wrongType()
            }
            return [UInt8(bytes.count)] + bytes
        case .firmwareVersion:
            guard case .string(let text) = object.value else { throw wrongType() }
            let parts = text.split(separator: ".").compactMap { UInt8($0) }
            guard parts.count == info.length, text.split(separator: ".").count == info.length else {
                throw wrongType()
            }
            return parts.reversed()
        }
    }
}
