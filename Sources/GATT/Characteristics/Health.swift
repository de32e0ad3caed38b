// Weight Measurement (SPEC.md §3.10), Blood Pressure / Intermediate Cuff Pressure (§3.11), PLX spot-check and
// continuous (§3.12), Glucose Measurement (§3.13).

/// Weight Measurement 0x2A9D: `weight_kg` or `weight_lb` (null for 0xFFFF "measurement unsuccessful"),
/// `timestamp`, `user_id`, `bmi_kg_m2`, `height_m` or `height_in`.
public struct WeightMeasurementParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A9D))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "weight_measurement"

    /// `weight_kg` or `weight_lb`, `timestamp` (+ `timestamp_fields`), `user_id`, `bmi_kg_m2`, `height_m` or
    /// `height_in`.
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("weight_kg", "kg", "weight"), .measurement("weight_lb", "lb", "weight"), .text("timestamp"),
            .structured("timestamp_fields"), .plain("user_id"), .measurement("bmi_kg_m2", "kg/m²"),
            .measurement("height_m", "m", "distance"), .measurement("height_in", "in", "distance"),
        ]
    }

    /// Creates the parser.
    public init() {}

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u8()
        let imperial = flags & 0x01 != 0
        var reading = GATTReading(capacity: 5)
        let weight = try cursor.u16()
        let weightValue: GATTValue =
            weight == 0xFFFF
            ? .null
            : .double(
                imperial ? scaledDecimal(Int64(weight), exponent: -2) : scaledDecimal(Int64(weight) * 5, exponent: -3))
        reading.append(imperial ? "weight_lb" : "weight_kg", weightValue)
        if flags & 0x02 != 0 {
            try GATTDateTime.read(&cursor).append(to: &reading)
        } else {
            reading.append("timestamp", .null)
        }
        if flags & 0x04 != 0 {
            let user = try cursor.u8()
            reading.append("user_id", user == 0xFF ? .null : .int(Int64(user)))
        } else {
            reading.append("user_id", .null)
        }
        if flags & 0x08 != 0 {
            reading.append("bmi_kg_m2", .double(scaledDecimal(Int64(try cursor.u16()), exponent: -1)))
            let height = Int64(try cursor.u16())
            if imperial {
                reading.append("height_in", .double(scaledDecimal(height, exponent: -1)))
            } else {
                reading.append("height_m", .double(scaledDecimal(height, exponent: -3)))
            }
        } else {
            reading.append("bmi_kg_m2", .null)
        }
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var flags: UInt8 = 0
        var body = ByteWriter()
        let imperial = value["weight_lb"] != nil && value["weight_kg"] == nil
        if imperial { flags |= 0x01 }
        let weightField = imperial ? "weight_lb" : "weight_kg"
        let weight = value[weightField] ?? .null
        if weight == .null {
            body.u16(0xFFFF)
        } else {
            try body.scaled(weight, multiplier: imperial ? 100 : 200, width: 2, signed: false, field: weightField)
        }
        if value.has("timestamp") || value.has("timestamp_fields") {
            flags |= 0x02
            try GATTDateTime.from(value).write(to: &body, field: "timestamp")
        }
        if value.has("user_id") {
            flags |= 0x04
            try body.scaled(value["user_id"] ?? .null, multiplier: 1, width: 1, signed: false, field: "user_id")
        }
        if value.has("bmi_kg_m2") {
            flags |= 0x08
            try body.scaled(value["bmi_kg_m2"] ?? .null, multiplier: 10, width: 2, signed: false, field: "bmi_kg_m2")
            let heightField = imperial ? "height_in" : "height_m"
            try body.scaled(
                try value.required(heightField, in: name), multiplier: imperial ? 10 : 1000, width: 2, signed: false,
                field: heightField)
        }
        return [flags] + body.bytes
    }
}

/// Blood Pressure Measurement 0x2A35 and Intermediate Cuff Pressure 0x2A36 (the same layout): systolic, diastolic
/// and mean arterial pressure in mmHg or kPa (SFLOAT; NaN where not available), `timestamp`, `pulse_rate_bpm`,
/// `user_id`, `measurement_status`.
public struct BloodPressureParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids: [BluetoothUUID]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name: String

    /// Blood Pressure Measurement (0x2A35).
    public static let measurement = BloodPressureParser(uuid: 0x2A35, name: "blood_pressure_measurement")
    /// Intermediate Cuff Pressure (0x2A36).
    public static let intermediateCuffPressure = BloodPressureParser(
        uuid: 0x2A36, name: "intermediate_cuff_pressure")

    init(uuid: UInt16, name: String) {
        uuids = [BluetoothUUID(uuid)]
        self.name = name
    }

    /// The three pressures in mmHg or kPa (the flags choose), `timestamp` (+ `timestamp_fields`), `pulse_rate_bpm`,
    /// `user_id`, `measurement_status`.
    public var fields: [GATTFieldDescriptor] {
        var fields: [GATTFieldDescriptor] = []
        for stem in ["systolic", "diastolic", "mean_arterial_pressure"] {
            fields += [
                .measurement(stem + "_mmhg", "mmHg", "pressure"), .measurement(stem + "_kpa", "kPa", "pressure"),
            ]
        }
        return fields + [
            .text("timestamp"), .structured("timestamp_fields"), .measurement("pulse_rate_bpm", "bpm"),
            .plain("user_id"), .plain("measurement_status"),
        ]
    }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u8()
        let kpa = flags & 0x01 != 0
        var reading = GATTReading(capacity: 8)
        reading.append(kpa ? "systolic_kpa" : "systolic_mmhg", MedicalFloat.decodeSFLOAT(try cursor.u16()))
        reading.append(kpa ? "diastolic_kpa" : "diastolic_mmhg", MedicalFloat.decodeSFLOAT(try cursor.u16()))
        reading.append(
            kpa ? "mean_arterial_pressure_kpa" : "mean_arterial_pressure_mmhg",
            MedicalFloat.decodeSFLOAT(try cursor.u16()))
        if flags & 0x02 != 0 {
            try GATTDateTime.read(&cursor).append(to: &reading)
        } else {
            reading.append("timestamp", .null)
        }
        reading.append("pulse_rate_bpm", flags & 0x04 != 0 ? MedicalFloat.decodeSFLOAT(try cursor.u16()) : .null)
        if flags & 0x08 != 0 {
            let user = try cursor.u8()
            reading.append("user_id", user == 0xFF ? .null : .int(Int64(user)))
        } else {
            reading.append("user_id", .null)
        }
        reading.append("measurement_status", flags & 0x10 != 0 ? .int(Int64(try cursor.u16())) : .null)
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        let kpa = value["systolic_kpa"] != nil
        var flags: UInt8 = kpa ? 0x01 : 0
        var body = ByteWriter()
        for stem in ["systolic", "diastolic", "mean_arterial_pressure"] {
            let field = stem + (kpa ? "_kpa" : "_mmhg")
            let component = value[field] ?? .null
            body.u16(component == .null ? 0x07FF : try MedicalFloat.encodeSFLOAT(component, field: field))
        }
        if value.has("timestamp") || value.has("timestamp_fields") {
            flags |= 0x02
            try GATTDateTime.from(value).write(to: &body, field: "timestamp")
        }
        if let pulse = value["pulse_rate_bpm"], pulse != .null {
            flags |= 0x04
            body.u16(try MedicalFloat.encodeSFLOAT(pulse, field: "pulse_rate_bpm"))
        }
        if value.has("user_id") {
            flags |= 0x08
            try body.scaled(value["user_id"] ?? .null, multiplier: 1, width: 1, signed: false, field: "user_id")
        }
        if value.has("measurement_status") {
            flags |= 0x10
            try body.scaled(
                value["measurement_status"] ?? .null, multiplier: 1, width: 2, signed: false,
                field: "measurement_status")
        }
        return [flags] + body.bytes
    }
}

/// PLX Spot-check Measurement 0x2A5E: `spo2_pct`, `pulse_rate_bpm`, then the optional fields in flag order.
public struct PLXSpotCheckParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A5E))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "plx_spot_check_measurement"

    /// `spo2_pct`, `pulse_rate_bpm`, `timestamp` (+ `timestamp_fields`), the status bit fields,
    /// `pulse_amplitude_index_pct`, `device_clock_not_set`.
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("spo2_pct", "%"), .measurement("pulse_rate_bpm", "bpm"), .text("timestamp"),
            .structured("timestamp_fields"), .plain("measurement_status"), .plain("device_and_sensor_status"),
            .measurement("pulse_amplitude_index_pct", "%"), .boolean("device_clock_not_set"),
        ]
    }

    /// Creates the parser.
    public init() {}

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u8()
        var reading = GATTReading(capacity: 7)
        reading.append("spo2_pct", MedicalFloat.decodeSFLOAT(try cursor.u16()))
        reading.append("pulse_rate_bpm", MedicalFloat.decodeSFLOAT(try cursor.u16()))
        if flags & 0x01 != 0 {
            try GATTDateTime.read(&cursor).append(to: &reading)
        } else {
            reading.append("timestamp", .null)
        }
        reading.append("measurement_status", flags & 0x02 != 0 ? .int(Int64(try cursor.u16())) : .null)
        reading.append("device_and_sensor_status", flags & 0x04 != 0 ? .int(Int64(try cursor.u24())) : .null)
        reading.append(
            "pulse_amplitude_index_pct", flags & 0x08 != 0 ? MedicalFloat.decodeSFLOAT(try cursor.u16()) : .null)
        reading.append("device_clock_not_set", .bool(flags & 0x10 != 0))
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var flags: UInt8 = 0
        var body = ByteWriter()
        try writeSFLOAT(value, "spo2_pct", in: name, to: &body)
        try writeSFLOAT(value, "pulse_rate_bpm", in: name, to: &body)
        if value.has("timestamp") || value.has("timestamp_fields") {
            flags |= 0x01
            try GATTDateTime.from(value).write(to: &body, field: "timestamp")
        }
        if value.has("measurement_status") {
            flags |= 0x02
            try body.scaled(
                value["measurement_status"] ?? .null, multiplier: 1, width: 2, signed: false,
                field: "measurement_status")
        }
        if value.has("device_and_sensor_status") {
            flags |= 0x04
            try body.scaled(
                value["device_and_sensor_status"] ?? .null, multiplier: 1, width: 3, signed: false,
                field: "device_and_sensor_status")
        }
        if value.has("pulse_amplitude_index_pct") {
            flags |= 0x08
            try writeSFLOAT(value, "pulse_amplitude_index_pct", in: name, to: &body)
        }
        if value["device_clock_not_set"]?.boolValue == true { flags |= 0x10 }
        return [flags] + body.bytes
    }
}

/// Writes the SFLOAT field `field` (a number or a special-value string; null is sent as NaN).
func writeSFLOAT(_ value: GATTReading, _ field: String, in parser: String, to writer: inout ByteWriter)
    throws(GATTParseError)
{
    guard let fieldValue = value[field] else { throw .notEncodable("\(parser): field \(field) is missing") }
    writer.u16(fieldValue == .null ? 0x07FF : try MedicalFloat.encodeSFLOAT(fieldValue, field: field))
}

/// PLX Continuous Measurement 0x2A5F: SpO2/PR normal, fast and slow, status, device status, PAI.
public struct PLXContinuousParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A5F))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "plx_continuous_measurement"

    /// SpO2 and pulse rate (normal, fast, slow), the status bit fields, `pulse_amplitude_index_pct`.
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("spo2_pct", "%"), .measurement("pulse_rate_bpm", "bpm"), .measurement("spo2_fast_pct", "%"),
            .measurement("pulse_rate_fast_bpm", "bpm"), .measurement("spo2_slow_pct", "%"),
            .measurement("pulse_rate_slow_bpm", "bpm"), .plain("measurement_status"),
            .plain("device_and_sensor_status"), .measurement("pulse_amplitude_index_pct", "%"),
        ]
    }

    /// Creates the parser.
    public init() {}

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u8()
        var reading = GATTReading(capacity: 9)
        reading.append("spo2_pct", MedicalFloat.decodeSFLOAT(try cursor.u16()))
        reading.append("pulse_rate_bpm", MedicalFloat.decodeSFLOAT(try cursor.u16()))
        if flags & 0x01 != 0 {
            reading.append("spo2_fast_pct", MedicalFloat.decodeSFLOAT(try cursor.u16()))
            reading.append("pulse_rate_fast_bpm", MedicalFloat.decodeSFLOAT(try cursor.u16()))
        }
        if flags & 0x02 != 0 {
            reading.append("spo2_slow_pct", MedicalFloat.decodeSFLOAT(try cursor.u16()))
            reading.append("pulse_rate_slow_bpm", MedicalFloat.decodeSFLOAT(try cursor.u16()))
        }
        reading.append("measurement_status", flags & 0x04 != 0 ? .int(Int64(try cursor.u16())) : .null)
        reading.append("device_and_sensor_status", flags & 0x08 != 0 ? .int(Int64(try cursor.u24())) : .null)
        reading.append(
            "pulse_amplitude_index_pct", flags & 0x10 != 0 ? MedicalFloat.decodeSFLOAT(try cursor.u16()) : .null)
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var flags: UInt8 = 0
        var body = ByteWriter()
        try writeSFLOAT(value, "spo2_pct", in: name, to: &body)
        try writeSFLOAT(value, "pulse_rate_bpm", in: name, to: &body)
        if value["spo2_fast_pct"] != nil {
            flags |= 0x01
            try writeSFLOAT(value, "spo2_fast_pct", in: name, to: &body)
            try writeSFLOAT(value, "pulse_rate_fast_bpm", in: name, to: &body)
        }
        if value["spo2_slow_pct"] != nil {
            flags |= 0x02
            try writeSFLOAT(value, "spo2_slow_pct", in: name, to: &body)
            try writeSFLOAT(value, "pulse_rate_slow_bpm", in: name, to: &body)
        }
        if value.has("measurement_status") {
            flags |= 0x04
            try body.scaled(
                value["measurement_status"] ?? .null, multiplier: 1, width: 2, signed: false,
                field: "measurement_status")
        }
        if value.has("device_and_sensor_status") {
            flags |= 0x08
            try body.scaled(
                value["device_and_sensor_status"] ?? .null, multiplier: 1, width: 3, signed: false,
                field: "device_and_sensor_status")
        }
        if value.has("pulse_amplitude_index_pct") {
            flags |= 0x10
            try writeSFLOAT(value, "pulse_amplitude_index_pct", in: name, to: &body)
        }
        return [flags] + body.bytes
    }
}

/// Glucose Measurement 0x2A18: sequence number, base time and offset (`timestamp` = base + offset), concentration
/// in kg/L or mol/L, type and sample location (low and high nibble), sensor status annunciation.
public struct GlucoseMeasurementParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A18))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "glucose_measurement"

    static let typeNames = EnumNames([
        nil, "capillary_whole_blood", "capillary_plasma", "venous_whole_blood", "venous_plasma",
        "arterial_whole_blood", "arterial_plasma", "undetermined_whole_blood", "undetermined_plasma",
        "interstitial_fluid", "control_solution",
    ])
    static let locationNames = EnumNames([
        nil, "finger", "alternate_site_test", "earlobe", "control_solution", nil, nil, nil, nil, nil, nil, nil, nil,
        nil, nil, "not_available",
    ])

    /// Creates the parser.
    public init() {}

    /// `sequence_number`, `base_time` (+ `base_time_fields`), `time_offset_min`, `timestamp`, the concentration in
    /// kg/L or mol/L, `glucose_type` and `sample_location` (+ `_name`), `sensor_status_annunciation`,
    /// `context_information_follows`.
    public var fields: [GATTFieldDescriptor] {
        [
            .plain("sequence_number"), .text("base_time"), .structured("base_time_fields"),
            GATTFieldDescriptor("time_offset_min", unit: "min", deviceClass: "duration"), .text("timestamp"),
            .measurement("glucose_concentration_kg_l", "kg/L"), .measurement("glucose_concentration_mol_l", "mol/L"),
            .plain("glucose_type"), .text("glucose_type_name"), .plain("sample_location"),
            .text("sample_location_name"), .plain("sensor_status_annunciation"),
            .boolean("context_information_follows"),
        ]
    }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        var cursor = ByteCursor(bytes)
        let flags = try cursor.u8()
        var reading = GATTReading(capacity: 12)
        reading.append("sequence_number", .int(Int64(try cursor.u16())))
        let base = try GATTDateTime.read(&cursor)
        base.append(to: &reading, name: "base_time")
        var offset = 0
        if flags & 0x01 != 0 {
            offset = Int(try cursor.s16())
            reading.append("time_offset_min", .int(Int64(offset)))
        } else {
            reading.append("time_offset_min", .null)
        }
        reading.append("timestamp", base.adding(minutes: offset)?.isoString.map { .string($0) } ?? .null)
        if flags & 0x02 != 0 {
            let concentration = MedicalFloat.decodeSFLOAT(try cursor.u16())
            reading.append(
                flags & 0x04 != 0 ? "glucose_concentration_mol_l" : "glucose_concentration_kg_l", concentration)
            let typeAndLocation = try cursor.u8()
            let type = Int(typeAndLocation & 0x0F)
            let location = Int(typeAndLocation >> 4)
            reading.append("glucose_type", .int(Int64(type)))
            reading.append("glucose_type_name", Self.typeNames(type))
            reading.append("sample_location", .int(Int64(location)))
            reading.append("sample_location_name", Self.locationNames(location))
        }
        reading.append("sensor_status_annunciation", flags & 0x08 != 0 ? .int(Int64(try cursor.u16())) : .null)
        reading.append("context_information_follows", .bool(flags & 0x10 != 0))
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var flags: UInt8 = 0
        var body = ByteWriter()
        try body.scaled(
            try value.required("sequence_number", in: name), multiplier: 1, width: 2, signed: false,
            field: "sequence_number")
        try GATTDateTime.from(value, name: "base_time").write(to: &body, field: "base_time")
        if value.has("time_offset_min") {
            flags |= 0x01
            try body.scaled(
                value["time_offset_min"] ?? .null, multiplier: 1, width: 2, signed: true, field: "time_offset_min")
        }
        let molar = value["glucose_concentration_mol_l"] != nil
        let concentrationField = molar ? "glucose_concentration_mol_l" : "glucose_concentration_kg_l"
        if value[concentrationField] != nil {
            flags |= molar ? 0x06 : 0x02
            try writeSFLOAT(value, concentrationField, in: name, to: &body)
            var type = value["glucose_type"]?.integerValue
            if type == nil, let text = value["glucose_type_name"]?.stringValue {
                type = Self.typeNames.value(named: text).map(Int64.init)
            }
            let location = value["sample_location"]?.integerValue ?? 0x0F
            guard let type, (0...15).contains(type), (0...15).contains(location) else {
                throw .notEncodable("\(name): glucose_type and sample_location must be 0...15")
            }
            body.u8(UInt8(location << 4 | type))
        }
        if value.has("sensor_status_annunciation") {
            flags |= 0x08
            try body.scaled(
                value["sensor_status_annunciation"] ?? .null, multiplier: 1, width: 2, signed: false,
                field: "sensor_status_annunciation")
        }
        if value["context_information_follows"]?.boolValue == true { flags |= 0x10 }
        return [flags] + body.bytes
    }
}
