// Fixed-size single-value characteristics: Body Sensor Location, Temperature Type, Battery Level, the Environmental
// Sensing scalars (SPEC.md §3.2, 3.4, 3.5, 3.6), the ESS SFLOAT concentrations, and the GAP Appearance.

/// A characteristic whose value is one integer of fixed width, scaled by a power of ten. The length is strict
/// (SPEC.md §5.3): anything but exactly `width` octets is rejected.
public struct ScalarCharacteristicParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids: [BluetoothUUID]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name: String
    /// The published field (`temperature_c`).
    public let field: String
    /// Octets (1...4), little-endian.
    public let width: Int
    /// Two's complement when true.
    public let signed: Bool
    /// value = raw × 10^decimalExponent; 0 publishes an integer.
    public let decimalExponent: Int
    /// The raw "not known" sentinel, published as `null`.
    public let notKnown: Int64?
    /// Raw values outside this range are rejected (Battery Level's 101...255 are RFU).
    public let validRange: ClosedRange<Int64>?
    /// The raw value that means "this value or more"; adds `<field>_saturated`.
    public let saturatedAt: Int64?
    /// Names for enumerations; adds `<field>_name`.
    let names: EnumNames?
    /// The value field's unit and Home Assistant classes.
    let declared: GATTFieldDescriptor

    init(
        uuid: UInt16, name: String, field: String, width: Int, signed: Bool = false, decimalExponent: Int = 0,
        notKnown: Int64? = nil, validRange: ClosedRange<Int64>? = nil, saturatedAt: Int64? = nil,
        names: EnumNames? = nil, unit: String? = nil, deviceClass: String? = nil, stateClass: String? = nil
    ) {
        uuids = [BluetoothUUID(uuid)]
        self.name = name
        self.field = field
        self.width = width
        self.signed = signed
        self.decimalExponent = decimalExponent
        self.notKnown = notKnown
        self.validRange = validRange
        self.saturatedAt = saturatedAt
        self.names = names
        declared = GATTFieldDescriptor(field, unit: unit, deviceClass: deviceClass, stateClass: stateClass)
    }

    /// The value field, then `<field>_saturated` and `<field>_name` where the characteristic has them.
    public var fields: [GATTFieldDescriptor] {
        var fields = [declared]
        if saturatedAt != nil { fields.append(.boolean("\(field)_saturated")) }
        if names != nil { fields.append(.text("\(field)_name")) }
        return fields
    }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        guard bytes.count == width else {
            if bytes.count < width {
                throw .truncated(offset: 0, needed: width, available: bytes.count)
            }
            throw .invalidLength(expected: "\(width) octet(s)", actual: bytes.count)
        }
        var cursor = ByteCursor(bytes)
        let raw = signed ? try cursor.sintLE(width) : Int64(try cursor.uintLE(width))
        if let validRange, !validRange.contains(raw) {
            throw .invalidValue(field: field, offset: 0, reason: "\(raw) is reserved (valid: \(validRange))")
        }
        var reading = GATTReading(capacity: 2)
        if raw == notKnown {
            reading.append(field, .null)
        } else {
            reading.append(
                field, decimalExponent == 0 ? .int(raw) : .double(scaledDecimal(raw, exponent: decimalExponent)))
        }
        if let saturatedAt { reading.append("\(field)_saturated", .bool(raw == saturatedAt)) }
        if let names { reading.append("\(field)_name", names(Int(raw))) }
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var writer = ByteWriter(capacity: width)
        var fieldValue = value[field] ?? .null
        if case .string(let text) = fieldValue, let names, let index = names.value(named: text) {
            fieldValue = .int(Int64(index))
        }
        if fieldValue == .null {
            guard let notKnown else { throw .notEncodable("\(name): field \(field) is missing") }
            writer.uintLE(UInt64(bitPattern: notKnown), width)
            return writer.bytes
        }
        if let validRange, let number = fieldValue.numberValue {
            // Compared as Doubles: a value from outside (1e300, NaN) must be rejected, not trap in Int64(_:).
            let raw = (number * powerOfTen(-decimalExponent)).rounded()
            guard raw >= Double(validRange.lowerBound), raw <= Double(validRange.upperBound) else {
                throw .notEncodable("\(name): \(field) \(number) is outside \(validRange)")
            }
        }
        try writer.scaled(
            fieldValue,
            multiplier: decimalExponent <= 0 ? powerOfTen(-decimalExponent) : 1 / powerOfTen(decimalExponent),
            width: width, signed: signed, field: field)
        return writer.bytes
    }
}

/// An ESS concentration sent as SFLOAT in kg/m³ (SPEC.md §3.6): publishes `<base>_kg_m3` and `<base>_ug_m3`.
public struct ConcentrationCharacteristicParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids: [BluetoothUUID]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name: String
    /// The field stem (`pm25`).
    public let base: String
    /// The Home Assistant device class of `<base>_ug_m3`, when Home Assistant has one for the gas.
    let deviceClass: String?

    init(uuid: UInt16, name: String, base: String, deviceClass: String? = nil) {
        uuids = [BluetoothUUID(uuid)]
        self.name = name
        self.base = base
        self.deviceClass = deviceClass
    }

    /// `<base>_kg_m3` (SI) and `<base>_ug_m3` (µg/m³, with the gas's device class).
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("\(base)_kg_m3", "kg/m³"),
            .measurement("\(base)_ug_m3", "\(GATTHomeAssistant.microSign)g/m³", deviceClass),
        ]
    }

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        try checkLength(bytes, 2)
        var cursor = ByteCursor(bytes)
        let raw = try cursor.u16()
        var reading = GATTReading(capacity: 2)
        reading.append("\(base)_kg_m3", MedicalFloat.decodeSFLOAT(raw))
        // µg/m³ from the mantissa and exponent, so that 15e-8 kg/m³ is exactly 150 µg/m³.
        reading.append("\(base)_ug_m3", MedicalFloat.decodeSFLOAT(raw, scale: 9))
        return reading
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        let field = "\(base)_kg_m3"
        var writer = ByteWriter(capacity: 2)
        if let kg = value[field], kg != .null {
            writer.u16(try MedicalFloat.encodeSFLOAT(kg, field: field))
        } else if let ug = value["\(base)_ug_m3"], ug != .null {
            let kg: GATTValue = ug.numberValue.map { .double($0 / 1e9) } ?? ug
            writer.u16(try MedicalFloat.encodeSFLOAT(kg, field: "\(base)_ug_m3"))
        } else {
            throw .notEncodable("\(name): field \(field) is missing")
        }
        return writer.bytes
    }
}

/// GAP Appearance 0x2A01: `appearance` plus its `appearance_category` (bits 6-15) and `appearance_subcategory`.
public struct AppearanceParser: GATTCharacteristicParser {
    /// The characteristic UUIDs this parser handles.
    public let uuids = [BluetoothUUID(UInt16(0x2A01))]
    /// The parser's snake_case name, usable on the command line in place of the UUID.
    public let name = "appearance"

    /// `appearance`, `appearance_category`, `appearance_subcategory`: codes.
    public var fields: [GATTFieldDescriptor] {
        [.plain("appearance"), .plain("appearance_category"), .plain("appearance_subcategory")]
    }

    /// Creates the parser.
    public init() {}

    /// Decodes one value; throws on a payload that must be rejected (SPEC.md §5).
    public func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
        try checkLength(bytes, 2)
        var cursor = ByteCursor(bytes)
        let raw = try cursor.u16()
        return GATTReading([
            GATTField("appearance", .int(Int64(raw))),
            GATTField("appearance_category", .int(Int64(raw >> 6))),
            GATTField("appearance_subcategory", .int(Int64(raw & 0x3F))),
        ])
    }

    /// Encodes a reading for a write; throws `notEncodable` when a field is missing or out of range.
    public func encode(_ value: GATTReading) throws(GATTParseError) -> [UInt8] {
        var writer = ByteWriter(capacity: 2)
        if value.has("appearance") {
            try writer.scaled(value["appearance"] ?? .null, multiplier: 1, width: 2, signed: false, field: "appearance")
        } else {
            let category = try value.required("appearance_category", in: name)
            let sub = value["appearance_subcategory"]?.integerValue ?? 0
            guard let c = category.integerValue, (0...0x3FF).contains(c), (0...0x3F).contains(sub) else {
                throw .notEncodable("\(name): category or subcategory out of range")
            }
            writer.u16(UInt16(c << 6 | sub))
        }
        return writer.bytes
    }
}

/// Body Sensor Location names (0x2A38), index = value.
let bodySensorLocationNames = EnumNames(["other", "chest", "wrist", "finger", "hand", "ear_lobe", "foot"])

/// Barometric Pressure Trend names (0x2AA3), index = value.
let barometricPressureTrendNames = EnumNames([
    "unknown", "continuously_falling", "continuously_rising", "falling_then_steady", "rising_then_steady",
    "falling_before_a_lesser_rise", "falling_before_a_greater_rise", "rising_before_a_greater_fall",
    "rising_before_a_lesser_fall", "steady",
])

extension ScalarCharacteristicParser {
    /// The built-in fixed-size single-value characteristics.
    static let builtIn: [ScalarCharacteristicParser] = [
        ScalarCharacteristicParser(
            uuid: 0x2A38, name: "body_sensor_location", field: "body_sensor_location", width: 1,
            names: bodySensorLocationNames),
        ScalarCharacteristicParser(
            uuid: 0x2A1D, name: "temperature_type", field: "temperature_type", width: 1,
            names: temperatureTypeNames),
        ScalarCharacteristicParser(
            uuid: 0x2A19, name: "battery_level", field: "battery_pct", width: 1, validRange: 0...100, unit: "%",
            deviceClass: "battery", stateClass: "measurement"),
        // Environmental Sensing (GSS: M = 1, d = the decimal exponent).
        ScalarCharacteristicParser(
            uuid: 0x2A6E, name: "temperature", field: "temperature_c", width: 2, signed: true, decimalExponent: -2,
            notKnown: -0x8000, unit: "°C", deviceClass: "temperature", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A6F, name: "humidity", field: "humidity_pct", width: 2, decimalExponent: -2, notKnown: 0xFFFF,
            unit: "%", deviceClass: "humidity", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A6D, name: "pressure", field: "pressure_pa", width: 4, decimalExponent: -1, unit: "Pa",
            deviceClass: "pressure", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A6C, name: "elevation", field: "elevation_m", width: 3, signed: true, decimalExponent: -2,
            unit: "m", deviceClass: "distance", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A76, name: "uv_index", field: "uv_index", width: 1, unit: "UV index", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2AFB, name: "illuminance", field: "illuminance_lx", width: 3, decimalExponent: -2,
            notKnown: 0xFF_FFFF, unit: "lx", deviceClass: "illuminance", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2B8C, name: "co2_concentration", field: "co2_ppm", width: 2, notKnown: 0xFFFF,
            saturatedAt: 0xFFFE, unit: "ppm", deviceClass: "carbon_dioxide", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2BE7, name: "voc_concentration", field: "voc_ppb", width: 2, notKnown: 0xFFFF,
            saturatedAt: 0xFFFE, unit: "ppb", deviceClass: "volatile_organic_compounds_parts", stateClass: "measurement"
        ),
        ScalarCharacteristicParser(
            uuid: 0x2A7B, name: "dew_point", field: "dew_point_c", width: 1, signed: true, unit: "°C",
            deviceClass: "temperature", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A7A, name: "heat_index", field: "heat_index_c", width: 1, signed: true, unit: "°C",
            deviceClass: "temperature", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A79, name: "wind_chill", field: "wind_chill_c", width: 1, signed: true, unit: "°C",
            deviceClass: "temperature", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A70, name: "true_wind_speed", field: "true_wind_speed_m_s", width: 2, decimalExponent: -2,
            unit: "m/s", deviceClass: "wind_speed", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A71, name: "true_wind_direction", field: "true_wind_direction_deg", width: 2,
            decimalExponent: -2, unit: "°", deviceClass: "wind_direction"),
        ScalarCharacteristicParser(
            uuid: 0x2A72, name: "apparent_wind_speed", field: "apparent_wind_speed_m_s", width: 2,
            decimalExponent: -2, unit: "m/s", deviceClass: "wind_speed", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A73, name: "apparent_wind_direction", field: "apparent_wind_direction_deg", width: 2,
            decimalExponent: -2, unit: "°", deviceClass: "wind_direction"),
        ScalarCharacteristicParser(
            uuid: 0x2A74, name: "gust_factor", field: "gust_factor", width: 1, decimalExponent: -1,
            stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A75, name: "pollen_concentration", field: "pollen_concentration_per_m3", width: 3, unit: "p/m³",
            stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A77, name: "irradiance", field: "irradiance_w_m2", width: 2, decimalExponent: -1, unit: "W/m²",
            deviceClass: "irradiance", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A78, name: "rainfall", field: "rainfall_m", width: 2, decimalExponent: -3, unit: "m",
            deviceClass: "distance", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2A2C, name: "magnetic_declination", field: "magnetic_declination_deg", width: 2,
            decimalExponent: -2, unit: "°", stateClass: "measurement"),
        ScalarCharacteristicParser(
            uuid: 0x2AA3, name: "barometric_pressure_trend", field: "barometric_pressure_trend", width: 1,
            names: barometricPressureTrendNames),
    ]
}

extension ConcentrationCharacteristicParser {
    /// The ESS concentrations sent as SFLOAT kg/m³.
    static let builtIn: [ConcentrationCharacteristicParser] = [
        ConcentrationCharacteristicParser(uuid: 0x2BCF, name: "ammonia_concentration", base: "ammonia"),
        ConcentrationCharacteristicParser(uuid: 0x2BD0, name: "carbon_monoxide_concentration", base: "co"),
        ConcentrationCharacteristicParser(uuid: 0x2BD1, name: "methane_concentration", base: "methane"),
        ConcentrationCharacteristicParser(
            uuid: 0x2BD2, name: "nitrogen_dioxide_concentration", base: "no2", deviceClass: "nitrogen_dioxide"),
        ConcentrationCharacteristicParser(
            uuid: 0x2BD3, name: "nmvoc_concentration", base: "nmvoc", deviceClass: "volatile_organic_compounds"),
        ConcentrationCharacteristicParser(uuid: 0x2BD4, name: "ozone_concentration", base: "o3", deviceClass: "ozone"),
        ConcentrationCharacteristicParser(uuid: 0x2BD5, name: "pm1_concentration", base: "pm1", deviceClass: "pm1"),
        ConcentrationCharacteristicParser(uuid: 0x2BD6, name: "pm25_concentration", base: "pm25", deviceClass: "pm25"),
        ConcentrationCharacteristicParser(uuid: 0x2BD7, name: "pm10_concentration", base: "pm10", deviceClass: "pm10"),
        ConcentrationCharacteristicParser(
            uuid: 0x2BD8, name: "sulfur_dioxide_concentration", base: "so2", deviceClass: "sulphur_dioxide"),
    ]
}
