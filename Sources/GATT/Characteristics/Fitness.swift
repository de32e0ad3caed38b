// Cycling Speed and Cadence (SPEC.md §3.7), Running Speed and Cadence (§3.8), Cycling Power Measurement (§3.9).

/// CSC Measurement 0x2A5B: wheel and crank revolution counters and their last event times.
public struct CSCMeasurementParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A5B))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "csc_measurement"

    /// Creates the parser.
    public init() {}

    /// The revolution counters (running totals that wrap) and their last event times (a 64 s clock, no statistics).
    public var fields: [GATTFieldDescriptor] {
        [
            .increasing("cumulative_wheel_revolutions", nil), eventTime("last_wheel_event_time_s"),
            .increasing("cumulative_crank_revolutions", nil), eventTime("last_crank_event_time_s"),
        ]
    }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u8()
        var reading = GATTReading(capacity: 4)
        if flags & 0x01 != 0 {
            reading.append("cumulative_wheel_revolutions", .int(Int64(try cursor.u32())))
            reading.append("last_wheel_event_time_s", .double(Double(try cursor.u16()) / 1024))
        } else {
            reading.append("cumulative_wheel_revolutions", .null)
            reading.append("last_wheel_event_time_s", .null)
        }
        if flags & 0x02 != 0 {
            reading.append("cumulative_crank_revolutions", .int(Int64(try cursor.u16())))
            reading.append("last_crank_event_time_s", .double(Double(try cursor.u16()) / 1024))
        } else {
            reading.append("cumulative_crank_revolutions", .null)
            reading.append("last_crank_event_time_s", .null)
        }
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var flags: UInt8 = 0
        var body = ByteWriter()
        if value.has("cumulative_wheel_revolutions") {
            flags |= 0x01
            try body.scaled(
                try value.required("cumulative_wheel_revolutions", in: name), multiplier: 1, width: 4, signed: false,
                field: "cumulative_wheel_revolutions")
            try body.scaled(
                try value.required("last_wheel_event_time_s", in: name), multiplier: 1024, width: 2, signed: false,
                field: "last_wheel_event_time_s")
        }
        if value.has("cumulative_crank_revolutions") {
            flags |= 0x02
            try body.scaled(
                try value.required("cumulative_crank_revolutions", in: name), multiplier: 1, width: 2, signed: false,
                field: "cumulative_crank_revolutions")
            try body.scaled(
                try value.required("last_crank_event_time_s", in: name), multiplier: 1024, width: 2, signed: false,
                field: "last_crank_event_time_s")
        }
        return [flags] + body.bytes
    }
}

/// RSC Measurement 0x2A53: speed, cadence, optional stride length and total distance, walking or running.
public struct RSCMeasurementParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A53))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "rsc_measurement"

    /// `speed_m_s`, `cadence_rpm`, `stride_length_m`, `total_distance_m`, `is_running`.
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("speed_m_s", "m/s", "speed"), .measurement("cadence_rpm", "rpm"),
            .measurement("stride_length_m", "m", "distance"), .increasing("total_distance_m", "m", "distance"),
            .boolean("is_running"),
        ]
    }

    /// Creates the parser.
    public init() {}

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u8()
        var reading = GATTReading(capacity: 5)
        reading.append("speed_m_s", .double(Double(try cursor.u16()) / 256))
        reading.append("cadence_rpm", .int(Int64(try cursor.u8())))
        reading.append(
            "stride_length_m",
            flags & 0x01 != 0 ? .double(scaledDecimal(Int64(try cursor.u16()), exponent: -2)) : .null)
        reading.append(
            "total_distance_m",
            flags & 0x02 != 0 ? .double(scaledDecimal(Int64(try cursor.u32()), exponent: -1)) : .null)
        reading.append("is_running", .bool(flags & 0x04 != 0))
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var flags: UInt8 = 0
        var body = ByteWriter()
        try body.scaled(
            try value.required("speed_m_s", in: name), multiplier: 256, width: 2, signed: false, field: "speed_m_s")
        try body.scaled(
            try value.required("cadence_rpm", in: name), multiplier: 1, width: 1, signed: false, field: "cadence_rpm")
        if value.has("stride_length_m") {
            flags |= 0x01
            try body.scaled(
                value["stride_length_m"] ?? .null, multiplier: 100, width: 2, signed: false, field: "stride_length_m")
        }
        if value.has("total_distance_m") {
            flags |= 0x02
            try body.scaled(
                value["total_distance_m"] ?? .null, multiplier: 10, width: 4, signed: false, field: "total_distance_m")
        }
        if value["is_running"]?.boolValue == true { flags |= 0x04 }
        return [flags] + body.bytes
    }
}

/// Cycling Power Measurement 0x2A63 (flags uint16, signed instantaneous power, twelve optional fields).
public struct CyclingPowerMeasurementParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A63))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "cycling_power_measurement"

    /// Instantaneous power, then the optional fields in flag order, then `offset_compensation_indicator`.
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("instantaneous_power_w", "W", "power"), .measurement("pedal_power_balance_pct", "%"),
            .text("pedal_power_balance_reference"), .increasing("accumulated_torque_nm", "N·m"),
            .text("accumulated_torque_source"), .increasing("cumulative_wheel_revolutions", nil),
            eventTime("last_wheel_event_time_s"), .increasing("cumulative_crank_revolutions", nil),
            eventTime("last_crank_event_time_s"), .measurement("maximum_force_n", "N"),
            .measurement("minimum_force_n", "N"), .measurement("maximum_torque_nm", "N·m"),
            .measurement("minimum_torque_nm", "N·m"), .measurement("maximum_angle_deg", "°"),
            .measurement("minimum_angle_deg", "°"), .measurement("top_dead_spot_angle_deg", "°"),
            .measurement("bottom_dead_spot_angle_deg", "°"), .increasing("accumulated_energy_kj", "kJ", "energy"),
            .boolean("offset_compensation_indicator"),
        ]
    }

    /// Creates the parser.
    public init() {}

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u16()
        var reading = GATTReading(capacity: 8)
        reading.append("instantaneous_power_w", .int(Int64(try cursor.s16())))
        if flags & 0x0001 != 0 {
            reading.append("pedal_power_balance_pct", .double(Double(try cursor.u8()) / 2))
            reading.append("pedal_power_balance_reference", .string(flags & 0x0002 != 0 ? "left" : "unknown"))
        }
        if flags & 0x0004 != 0 {
            reading.append("accumulated_torque_nm", .double(Double(try cursor.u16()) / 32))
            reading.append("accumulated_torque_source", .string(flags & 0x0008 != 0 ? "crank" : "wheel"))
        }
        if flags & 0x0010 != 0 {
            reading.append("cumulative_wheel_revolutions", .int(Int64(try cursor.u32())))
            reading.append("last_wheel_event_time_s", .double(Double(try cursor.u16()) / 2048))
        }
        if flags & 0x0020 != 0 {
            reading.append("cumulative_crank_revolutions", .int(Int64(try cursor.u16())))
            reading.append("last_crank_event_time_s", .double(Double(try cursor.u16()) / 1024))
        }
        if flags & 0x0040 != 0 {
            reading.append("maximum_force_n", .int(Int64(try cursor.s16())))
            reading.append("minimum_force_n", .int(Int64(try cursor.s16())))
        }
        if flags & 0x0080 != 0 {
            reading.append("maximum_torque_nm", .double(Double(try cursor.s16()) / 32))
            reading.append("minimum_torque_nm", .double(Double(try cursor.s16()) / 32))
        }
        if flags & 0x0100 != 0 {
            // Two uint12 in three octets: max in the low 12 bits, min in the high 12 bits.
            let packed = try cursor.u24()
            reading.append("maximum_angle_deg", .int(Int64(packed & 0x0FFF)))
            reading.append("minimum_angle_deg", .int(Int64(packed >> 12)))
        }
        if flags & 0x0200 != 0 { reading.append("top_dead_spot_angle_deg", .int(Int64(try cursor.u16()))) }
        if flags & 0x0400 != 0 { reading.append("bottom_dead_spot_angle_deg", .int(Int64(try cursor.u16()))) }
        if flags & 0x0800 != 0 { reading.append("accumulated_energy_kj", .int(Int64(try cursor.u16()))) }
        reading.append("offset_compensation_indicator", .bool(flags & 0x1000 != 0))
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var flags: UInt16 = 0
        var body = ByteWriter()
        func put(_ field: String, _ multiplier: Double, _ width: Int, _ signed: Bool) throws(GATTParseError) {
            try body.scaled(
                try value.required(field, in: name), multiplier: multiplier, width: width, signed: signed, field: field)
        }
        try put("instantaneous_power_w", 1, 2, true)
        if value.has("pedal_power_balance_pct") {
            flags |= 0x0001
            if value["pedal_power_balance_reference"]?.stringValue == "left" { flags |= 0x0002 }
            try put("pedal_power_balance_pct", 2, 1, false)
        }
        if value.has("accumulated_torque_nm") {
            flags |= 0x0004
            if value["accumulated_torque_source"]?.stringValue == "crank" { flags |= 0x0008 }
            try put("accumulated_torque_nm", 32, 2, false)
        }
        if value.has("cumulative_wheel_revolutions") {
            flags |= 0x0010
            try put("cumulative_wheel_revolutions", 1, 4, false)
            try put("last_wheel_event_time_s", 2048, 2, false)
        }
        if value.has("cumulative_crank_revolutions") {
            flags |= 0x0020
            try put("cumulative_crank_revolutions", 1, 2, false)
            try put("last_crank_event_time_s", 1024, 2, false)
        }
        if value.has("maximum_force_n") {
            flags |= 0x0040
            try put("maximum_force_n", 1, 2, true)
            try put("minimum_force_n", 1, 2, true)
        }
        if value.has("maximum_torque_nm") {
            flags |= 0x0080
            try put("maximum_torque_nm", 32, 2, true)
            try put("minimum_torque_nm", 32, 2, true)
        }
        if value.has("maximum_angle_deg") {
            flags |= 0x0100
            let maxAngle = try value.required("maximum_angle_deg", in: name).integerValue ?? -1
            let minAngle = try value.required("minimum_angle_deg", in: name).integerValue ?? -1
            guard (0...0xFFF).contains(maxAngle), (0...0xFFF).contains(minAngle) else {
                throw .notEncodable("\(name): extreme angles must be 0...4095")
            }
            body.u24(UInt32(maxAngle) | UInt32(minAngle) << 12)
        }
        if value.has("top_dead_spot_angle_deg") {
            flags |= 0x0200
            try put("top_dead_spot_angle_deg", 1, 2, false)
        }
        if value.has("bottom_dead_spot_angle_deg") {
            flags |= 0x0400
            try put("bottom_dead_spot_angle_deg", 1, 2, false)
        }
        if value.has("accumulated_energy_kj") {
            flags |= 0x0800
            try put("accumulated_energy_kj", 1, 2, false)
        }
        if value["offset_compensation_indicator"]?.boolValue == true { flags |= 0x1000 }
        var out = ByteWriter()
        out.u16(flags)
        return out.bytes + body.bytes
    }
}

/// A "last event time" field: seconds on a clock that wraps (64 s or 32 s), so a duration without statistics.
private func eventTime(_ name: String) -> GATTFieldDescriptor {
    GATTFieldDescriptor(name, unit: "s", deviceClass: "duration")
}
