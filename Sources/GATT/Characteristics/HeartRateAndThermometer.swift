// Heart Rate Measurement (SPEC.md §3.1) and Temperature Measurement / Intermediate Temperature (§3.3).

/// Heart Rate Measurement, 0x2A37: `heart_rate_bpm`, `sensor_contact`, `energy_expended_kj`, `rr_intervals_s`.
///
/// The hot path of the bridge: decoding allocates the field array (and the RR array when RR values are present),
/// nothing else.
public struct HeartRateMeasurementParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A37))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "heart_rate_measurement"

    /// Creates the parser.
    public init() {}

    /// `heart_rate_bpm`, `sensor_contact`, `energy_expended_kj` (a running total the sensor resets), `rr_intervals_s`.
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("heart_rate_bpm", "bpm"), .boolean("sensor_contact"),
            .increasing("energy_expended_kj", "kJ", "energy"), .structured("rr_intervals_s", unit: "s"),
        ]
    }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u8()
        let heartRate = flags & 0x01 != 0 ? Int64(try cursor.u16()) : Int64(try cursor.u8())
        var reading = GATTReading(capacity: 4)
        reading.append("heart_rate_bpm", .int(heartRate))
        // Bit 1 (contact detected) means nothing unless bit 2 (contact supported) is set.
        reading.append("sensor_contact", flags & 0x04 == 0 ? .null : .bool(flags & 0x02 != 0))
        reading.append("energy_expended_kj", flags & 0x08 != 0 ? .int(Int64(try cursor.u16())) : .null)
        if flags & 0x10 != 0 {
            // The flag announces at least one RR value; a dangling odd octet after them is dropped.
            let count = cursor.remaining / 2
            guard count > 0 else { throw .truncated(offset: cursor.offset, needed: 2, available: cursor.remaining) }
            var intervals: [GATTValue] = []
            intervals.reserveCapacity(count)
            for _ in 0..<count { intervals.append(.double(Double(try cursor.u16()) / 1024)) }
            reading.append("rr_intervals_s", .array(intervals))
        } else {
            reading.append("rr_intervals_s", .array([]))
        }
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var flags: UInt8 = 0
        var body = ByteWriter()
        let heartRate = try value.required("heart_rate_bpm", in: name)
        guard let bpm = heartRate.integerValue, bpm >= 0, bpm <= 0xFFFF else {
            throw .notEncodable("\(name): heart_rate_bpm \(heartRate) is not 0...65535")
        }
        if bpm > 0xFF {
            flags |= 0x01
            body.u16(UInt16(bpm))
        } else {
            body.u8(UInt8(bpm))
        }
        if case .bool(let contact)? = value["sensor_contact"] { flags |= contact ? 0x06 : 0x04 }
        if value.has("energy_expended_kj") {
            flags |= 0x08
            try body.scaled(
                value["energy_expended_kj"] ?? .null, multiplier: 1, width: 2, signed: false,
                field: "energy_expended_kj")
        }
        if case .array(let intervals)? = value["rr_intervals_s"], !intervals.isEmpty {
            flags |= 0x10
            for interval in intervals {
                try body.scaled(interval, multiplier: 1024, width: 2, signed: false, field: "rr_intervals_s")
            }
        }
        return [flags] + body.bytes
    }
}

/// Temperature Type names (0x2A1D and the HTM type field), index = value.
let temperatureTypeNames = EnumNames([
    nil, "armpit", "body", "ear", "finger", "gastrointestinal_tract", "mouth", "rectum", "toe", "tympanum",
])

/// Temperature Measurement 0x2A1C and Intermediate Temperature 0x2A1E: `temperature_c` (or `temperature_f` plus the
/// converted `temperature_c`), `timestamp`, `temperature_type` (+ `_name`).
public struct TemperatureMeasurementParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids: [BluetoothUUID]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name: String

    /// Temperature Measurement (0x2A1C).
    public static let measurement = TemperatureMeasurementParser(
        uuid: 0x2A1C, name: "temperature_measurement")
    /// Intermediate Temperature (0x2A1E), the same layout.
    public static let intermediate = TemperatureMeasurementParser(
        uuid: 0x2A1E, name: "intermediate_temperature")

    init(uuid: UInt16, name: String) {
        uuids = [BluetoothUUID(uuid)]
        self.name = name
    }

    /// `temperature_f` (Fahrenheit devices only), `temperature_c`, `timestamp` (+ `timestamp_fields` when a part is
    /// not known), `temperature_type` (+ `_name`).
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("temperature_f", "°F", "temperature"), .measurement("temperature_c", "°C", "temperature"),
            .text("timestamp"), .structured("timestamp_fields"), .plain("temperature_type"),
            .text("temperature_type_name"),
        ]
    }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u8()
        let temperature = MedicalFloat.decodeFLOAT(try cursor.u32())
        var reading = GATTReading(capacity: 5)
        if flags & 0x01 != 0 {
            reading.append("temperature_f", temperature)
            if case .double(let f) = temperature {
                reading.append("temperature_c", .double((f - 32) * 5 / 9))
            } else {
                reading.append("temperature_c", temperature)
            }
        } else {
            reading.append("temperature_c", temperature)
        }
        if flags & 0x02 != 0 {
            try GATTDateTime.read(&cursor).append(to: &reading)
        } else {
            reading.append("timestamp", .null)
        }
        if flags & 0x04 != 0 {
            let type = Int(try cursor.u8())
            reading.append("temperature_type", .int(Int64(type)))
            reading.append("temperature_type_name", temperatureTypeNames(type))
        } else {
            reading.append("temperature_type", .null)
        }
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var flags: UInt8 = 0
        var body = ByteWriter()
        if let fahrenheit = value["temperature_f"], fahrenheit != .null {
            flags |= 0x01
            body.u32(try MedicalFloat.encodeFLOAT(fahrenheit, field: "temperature_f"))
        } else {
            body.u32(
                try MedicalFloat.encodeFLOAT(try value.required("temperature_c", in: name), field: "temperature_c"))
        }
        if value.has("timestamp") || value.has("timestamp_fields") {
            flags |= 0x02
            try GATTDateTime.from(value).write(to: &body, field: "timestamp")
        }
        if let type = value["temperature_type"], type != .null {
            guard let raw = type.integerValue, (0...255).contains(raw) else {
                throw .notEncodable("\(name): temperature_type \(type) is not 0...255")
            }
            flags |= 0x04
            body.u8(UInt8(raw))
        }
        return [flags] + body.bytes
    }
}
