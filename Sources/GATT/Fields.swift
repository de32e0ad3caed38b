// What a parser publishes, known before any data arrives: field names with their kind, unit, and Home Assistant
// device and state class, so that the bridge can publish MQTT discovery before the first reading. Pure Swift.

/// What kind of value a field holds (decides the Home Assistant platform: sensor, binary_sensor, or none).
public enum GATTFieldKind: String, Sendable, Hashable {
    /// An integer or a number with a fraction (a `sensor`). IEEE 11073 medical floats may also publish their special
    /// values as strings (`"NaN"`, `"NRes"`, `"+INF"`, `"-INF"`, `"RFU"`) in a number field.
    case number
    /// `true` or `false` (a `binary_sensor`).
    case boolean
    /// A string: names, hex, ISO timestamps (a `sensor` without unit or state class).
    case text
    /// An array or an object (`rr_intervals_s`, `timestamp_fields`): published in the JSON, not an entity.
    case structured
}

/// What a published field means, known before any data arrives.
public struct GATTFieldDescriptor: Sendable, Hashable, CustomStringConvertible {
    /// The published field name, e.g. `"temperature_c"`.
    public var name: String
    /// The kind of value the field holds.
    public var kind: GATTFieldKind
    /// Home Assistant `unit_of_measurement`, exactly as Home Assistant spells it (`"°C"`, `"%"`, `"hPa"`, `"bpm"`).
    public var unit: String?
    /// A Home Assistant sensor or binary_sensor `device_class` valid for `unit` (see `GATTHomeAssistant`), or nil.
    public var deviceClass: String?
    /// `"measurement"`, `"total"`, `"total_increasing"`, or nil.
    public var stateClass: String?

    /// A descriptor for the field `name`.
    public init(
        _ name: String, kind: GATTFieldKind = .number, unit: String? = nil, deviceClass: String? = nil,
        stateClass: String? = nil
    ) {
        self.name = name
        self.kind = kind
        self.unit = unit
        self.deviceClass = deviceClass
        self.stateClass = stateClass
    }

    /// `temperature_c (number, °C, temperature, measurement)`.
    public var description: String {
        let parts = [kind.rawValue, unit, deviceClass, stateClass].compactMap { $0 }
        return "\(name) (\(parts.joined(separator: ", ")))"
    }

    /// A descriptor inferred from the field-name conventions of the decoding spec (snake_case, the unit as a suffix):
    /// `_c` → °C, temperature, measurement; `_pct` → % (battery, humidity or moisture by the stem); `_hpa`/`_pa` →
    /// pressure; `_bpm`; `_v`/`_mv` → voltage; `_lx`/`_lux` → illuminance; `_kj`/`_kwh` → energy, total_increasing; ...
    /// `mac`, `timestamp` and `*_name` are `.text`; anything else is a `.number` without unit or classes.
    ///
    /// Used for declarative parsers and as a fallback. The result always passes `GATTHomeAssistant.validate(_:)`.
    public static func inferred(fromName name: String) -> GATTFieldDescriptor {
        if name == "mac" || name == "timestamp" || name.hasSuffix("_name") || name.hasSuffix("_timestamp") {
            return GATTFieldDescriptor(name, kind: .text)
        }
        if name == "uv_index" || name.hasSuffix("_uv_index") {
            return GATTFieldDescriptor(name, unit: "UV index", stateClass: "measurement")
        }
        for rule in unitSuffixRules where name.hasSuffix(rule.suffix) && name.count > rule.suffix.count {
            let stem = name.dropLast(rule.suffix.count).split(separator: "_").map(String.init)
            let (deviceClass, stateClass) = rule.classes(stem)
            return GATTFieldDescriptor(name, unit: rule.unit, deviceClass: deviceClass, stateClass: stateClass)
        }
        return GATTFieldDescriptor(name)
    }
}

/// One name suffix and what it says: the unit and the usual device and state class.
private struct UnitSuffixRule: Sendable {
    let suffix: String
    let unit: String
    let deviceClass: String?
    let stateClass: String?

    init(_ suffix: String, _ unit: String, _ deviceClass: String?, _ stateClass: String? = "measurement") {
        self.suffix = "_" + suffix
        self.unit = unit
        self.deviceClass = deviceClass
        self.stateClass = stateClass
    }

    /// The device and state class for a name whose other components are `stem` (`humidity_pct` → humidity).
    func classes(_ stem: [String]) -> (String?, String?) {
        func has(_ component: String) -> Bool { stem.contains(component) }
        switch suffix {
        case "_pct":
            for deviceClass in ["battery", "humidity", "moisture"] where has(deviceClass) {
                return (deviceClass, "measurement")
            }
        case "_ppm":
            if has("co2") { return ("carbon_dioxide", "measurement") }
            if has("co") { return ("carbon_monoxide", "measurement") }
            if has("voc") { return ("volatile_organic_compounds_parts", "measurement") }
        case "_ppb":
            if has("voc") { return ("volatile_organic_compounds_parts", "measurement") }
        case "_ug_m3":
            let gases: [(String, String)] = [
                ("pm25", "pm25"), ("pm10", "pm10"), ("pm1", "pm1"), ("voc", "volatile_organic_compounds"),
                ("nmvoc", "volatile_organic_compounds"), ("no2", "nitrogen_dioxide"), ("o3", "ozone"),
                ("ozone", "ozone"), ("so2", "sulphur_dioxide"), ("n2o", "nitrous_oxide"),
            ]
            for (component, deviceClass) in gases where has(component) { return (deviceClass, "measurement") }
        case "_mm":
            if has("precipitation") || has("rain") { return ("precipitation", "measurement") }
        case "_m_s", "_km_h":
            if has("wind") { return ("wind_speed", "measurement") }
        case "_deg":
            // Home Assistant's wind_direction takes no state class.
            if has("wind") && has("direction") { return ("wind_direction", nil) }
        case "_l":
            if has("water") { return ("water", "total_increasing") }
            if has("storage") { return ("volume_storage", "measurement") }
        case "_m3":
            if has("gas") { return ("gas", "total_increasing") }
            if has("water") { return ("water", "total_increasing") }
        default:
            break
        }
        return (deviceClass, stateClass)
    }
}

/// The name-suffix conventions, longest suffix first (`_m_s` before `_s`).
private let unitSuffixRules: [UnitSuffixRule] = {
    let micro = "\u{00B5}"  // see GATTHomeAssistant.microSign
    var rules: [UnitSuffixRule] = []
    // Temperature.
    rules += [UnitSuffixRule("c", "°C", "temperature"), UnitSuffixRule("f", "°F", "temperature")]
    rules += [UnitSuffixRule("k", "K", "temperature")]
    // Ratios and concentrations (the stem picks the device class, see `classes`).
    rules += [UnitSuffixRule("pct", "%", nil), UnitSuffixRule("ppm", "ppm", nil), UnitSuffixRule("ppb", "ppb", nil)]
    rules += [UnitSuffixRule("ug_m3", "\(micro)g/m³", nil), UnitSuffixRule("kg_m3", "kg/m³", nil)]
    rules += [UnitSuffixRule("per_m3", "p/m³", nil), UnitSuffixRule("mol_l", "mol/L", nil)]
    rules += [UnitSuffixRule("kg_l", "kg/L", nil), UnitSuffixRule("us_cm", "\(micro)S/cm", "conductivity")]
    // Pressure.
    rules += [UnitSuffixRule("pa", "Pa", "pressure"), UnitSuffixRule("hpa", "hPa", "pressure")]
    rules += [UnitSuffixRule("kpa", "kPa", "pressure"), UnitSuffixRule("mbar", "mbar", "pressure")]
    rules += [UnitSuffixRule("bar", "bar", "pressure"), UnitSuffixRule("mmhg", "mmHg", "pressure")]
    // Electricity and energy.
    rules += [UnitSuffixRule("v", "V", "voltage"), UnitSuffixRule("mv", "mV", "voltage")]
    rules += [UnitSuffixRule("a", "A", "current"), UnitSuffixRule("ma", "mA", "current")]
    rules += [UnitSuffixRule("w", "W", "power"), UnitSuffixRule("kw", "kW", "power")]
    rules += [UnitSuffixRule("j", "J", "energy", "total_increasing")]
    rules += [UnitSuffixRule("kj", "kJ", "energy", "total_increasing")]
    rules += [UnitSuffixRule("wh", "Wh", "energy", "total_increasing")]
    rules += [UnitSuffixRule("kwh", "kWh", "energy", "total_increasing")]
    rules += [UnitSuffixRule("kcal", "kcal", "energy", "total_increasing"), UnitSuffixRule("ah", "Ah", nil)]
    // Light, sound, radio, rates.
    rules += [UnitSuffixRule("lx", "lx", "illuminance"), UnitSuffixRule("lux", "lx", "illuminance")]
    rules += [UnitSuffixRule("w_m2", "W/m²", "irradiance"), UnitSuffixRule("db", "dB", "sound_pressure")]
    rules += [UnitSuffixRule("dbm", "dBm", "signal_strength"), UnitSuffixRule("hz", "Hz", "frequency")]
    rules += [UnitSuffixRule("bpm", "bpm", nil), UnitSuffixRule("rpm", "rpm", nil)]
    // Length, speed, acceleration, angles.
    rules += [UnitSuffixRule("mm", "mm", "distance"), UnitSuffixRule("cm", "cm", "distance")]
    rules += [UnitSuffixRule("m", "m", "distance"), UnitSuffixRule("km", "km", "distance")]
    rules += [UnitSuffixRule("in", "in", "distance"), UnitSuffixRule("ft", "ft", "distance")]
    rules += [UnitSuffixRule("m_s", "m/s", "speed"), UnitSuffixRule("km_h", "km/h", "speed")]
    rules += [UnitSuffixRule("m_s2", "m/s²", nil), UnitSuffixRule("deg_s", "°/s", nil)]
    rules += [UnitSuffixRule("deg", "°", nil)]
    // Time.
    rules += [UnitSuffixRule("s", "s", "duration"), UnitSuffixRule("ms", "ms", "duration")]
    rules += [UnitSuffixRule("min", "min", "duration"), UnitSuffixRule("h", "h", "duration")]
    rules += [UnitSuffixRule("d", "d", "duration")]
    // Mass, force, torque.
    rules += [UnitSuffixRule("g", "g", "weight"), UnitSuffixRule("kg", "kg", "weight")]
    rules += [UnitSuffixRule("lb", "lb", "weight"), UnitSuffixRule("kg_m2", "kg/m²", nil)]
    rules += [UnitSuffixRule("n", "N", nil), UnitSuffixRule("nm", "N·m", nil)]
    // Volume and flow.
    rules += [UnitSuffixRule("l", "L", "volume", "total"), UnitSuffixRule("ml", "mL", "volume", "total")]
    rules += [UnitSuffixRule("m3", "m³", "volume", "total"), UnitSuffixRule("m3_h", "m³/h", "volume_flow_rate")]
    rules += [UnitSuffixRule("l_min", "L/min", "volume_flow_rate")]
    return rules.sorted { $0.suffix.count > $1.suffix.count }
}()

/// Why a field descriptor would be rejected by Home Assistant: the offending key (`unit`, `device_class` or
/// `state_class`, as in MQTT discovery and the declarative parser configuration) and the reason.
public struct GATTFieldMetadataError: Error, Sendable, Equatable, CustomStringConvertible {
    /// `unit`, `device_class` or `state_class`.
    public let key: String
    /// What is wrong (`"hPa" is not a unit of device class temperature (°C, °F, K)`).
    public let reason: String

    /// An error about `key`.
    public init(key: String, reason: String) {
        self.key = key
        self.reason = reason
    }

    /// The text people read in logs and error output.
    public var description: String { "\(key): \(reason)" }
}

/// Home Assistant's validity tables for sensor and binary_sensor metadata, from Home Assistant's own source:
/// `homeassistant/components/sensor/const.py` (`DEVICE_CLASS_UNITS`, `DEVICE_CLASS_STATE_CLASSES`,
/// `SensorStateClass`), the unit constants of `homeassistant/const.py`, and
/// `homeassistant/components/binary_sensor/__init__.py` (`BinarySensorDeviceClass`), as of Home Assistant 2025.x.
public enum GATTHomeAssistant {
    /// The micro prefix as these tables spell it: U+00B5 MICRO SIGN (`µg/m³`, `µS/cm`, `µV`, `µg`).
    ///
    /// Home Assistant spelled micro with U+00B5 until 2025.8 and rejects U+03BC GREEK SMALL LETTER MU in MQTT discovery
    /// there (home-assistant/core#148061); from 2025.9 it spells it U+03BC and its MQTT integration translates the
    /// legacy U+00B5 spelling (home-assistant/core#144853). U+00B5 is the spelling every version accepts.
    public static let microSign = "\u{00B5}"

    /// Sensor device class → the units Home Assistant allows with it (`DEVICE_CLASS_UNITS`). An empty set means the
    /// class takes no unit (`aqi`, `ph`, and the non-numeric `date`, `enum`, `timestamp`). `monetary` (an ISO 4217
    /// currency code as unit) is left out: no Bluetooth format publishes money.
    public static let sensorDeviceClasses: [String: Set<String>] = {
        let micro = microSign
        let pressure: Set<String> = ["Pa", "hPa", "kPa", "bar", "cbar", "mbar", "mmHg", "inHg", "psi"]
        let energy: Set<String> = [
            "J", "kJ", "MJ", "GJ", "mWh", "Wh", "kWh", "MWh", "GWh", "TWh", "cal", "kcal", "Mcal", "Gcal",
        ]
        let volume: Set<String> = ["ft³", "CCF", "m³", "L", "mL", "gal", "fl. oz."]
        let speed: Set<String> = ["Beaufort", "ft/s", "in/s", "m/s", "km/h", "kn", "mph", "mm/s"]
        let volumetricFlux: Set<String> = ["in/d", "in/h", "mm/d", "mm/h"]
        let microgramsPerCubicMetre: Set<String> = ["\(micro)g/m³"]
        return [
            "date": [], "enum": [], "timestamp": [],
            "apparent_power": ["VA"],
            "aqi": [],
            "area": ["m²", "cm²", "km²", "mm²", "in²", "ft²", "yd²", "mi²", "ac", "ha"],
            "atmospheric_pressure": pressure,
            "battery": ["%"],
            "blood_glucose_concentration": ["mg/dL", "mmol/L"],
            "carbon_monoxide": ["ppm"],
            "carbon_dioxide": ["ppm"],
            "conductivity": ["S/cm", "\(micro)S/cm", "mS/cm"],
            "current": ["mA", "A"],
            "data_rate": [
                "bit/s", "kbit/s", "Mbit/s", "Gbit/s", "B/s", "kB/s", "MB/s", "GB/s", "KiB/s", "MiB/s", "GiB/s",
            ],
            "data_size": [
                "bit", "kbit", "Mbit", "Gbit", "B", "kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB", "KiB", "MiB",
                "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB",
            ],
            "distance": ["mm", "cm", "m", "km", "in", "ft", "yd", "mi", "nmi"],
            "duration": ["d", "h", "min", "s", "ms"],
            "energy": energy,
            "energy_distance": ["kWh/100km", "mi/kWh", "km/kWh"],
            "energy_storage": energy,
            "frequency": ["Hz", "kHz", "MHz", "GHz"],
            "gas": ["CCF", "ft³", "m³"],
            "humidity": ["%"],
            "illuminance": ["lx"],
            "irradiance": ["W/m²", "BTU/(h⋅ft²)"],
            "moisture": ["%"],
            "nitrogen_dioxide": microgramsPerCubicMetre,
            "nitrogen_monoxide": microgramsPerCubicMetre,
            "nitrous_oxide": microgramsPerCubicMetre,
            "ozone": microgramsPerCubicMetre,
            "ph": [],
            "pm1": microgramsPerCubicMetre,
            "pm10": microgramsPerCubicMetre,
            "pm25": microgramsPerCubicMetre,
            "power_factor": ["%"],
            "power": ["W", "kW", "MW", "GW", "TW"],
            "precipitation": ["in", "mm", "cm"],
            "precipitation_intensity": volumetricFlux,
            "pressure": pressure,
            "reactive_power": ["var"],
            "signal_strength": ["dB", "dBm"],
            "sound_pressure": ["dB", "dBA"],
            "speed": speed.union(volumetricFlux),
            "sulphur_dioxide": microgramsPerCubicMetre,
            "temperature": ["°C", "°F", "K"],
            "temperature_delta": ["°C", "°F", "K"],
            "volatile_organic_compounds": microgramsPerCubicMetre,
            "volatile_organic_compounds_parts": ["ppb", "ppm"],
            "voltage": ["\(micro)V", "mV", "V", "kV", "MV"],
            "volume": volume,
            "volume_flow_rate": ["m³/h", "m³/s", "ft³/min", "L/h", "L/min", "L/s", "gal/min", "mL/s"],
            "volume_storage": volume,
            "water": ["CCF", "ft³", "m³", "gal", "L"],
            "weight": ["g", "kg", "mg", "\(micro)g", "oz", "lb", "st"],
            "wind_direction": ["°"],
            "wind_speed": speed,
        ]
    }()

    /// Sensor device classes that also allow no unit besides their listed ones (`power_factor`: `%` or none).
    public static let sensorDeviceClassesWithOptionalUnit: Set<String> = ["power_factor"]

    /// The non-numeric sensor device classes (`NON_NUMERIC_DEVICE_CLASSES`): their state is text, never a number.
    public static let nonNumericSensorDeviceClasses: Set<String> = ["date", "enum", "timestamp"]

    /// Sensor device class → the state classes Home Assistant allows with it (`DEVICE_CLASS_STATE_CLASSES`).
    /// An empty set: no state class (`enum`, `date`, `timestamp`, `wind_direction`). No state class is always valid.
    public static let sensorDeviceClassStateClasses: [String: Set<String>] = {
        let measurement: Set<String> = ["measurement"]
        let totals: Set<String> = ["total", "total_increasing"]
        let all = stateClasses
        var table: [String: Set<String>] = [:]
        for deviceClass in sensorDeviceClasses.keys { table[deviceClass] = measurement }
        for deviceClass in ["date", "enum", "timestamp", "wind_direction"] { table[deviceClass] = [] }
        for deviceClass in ["area", "data_size", "distance", "duration", "precipitation"] { table[deviceClass] = all }
        for deviceClass in ["energy", "gas", "volume", "water"] { table[deviceClass] = totals }
        table["weight"] = all
        return table
    }()

    /// Home Assistant's binary_sensor device classes (`BinarySensorDeviceClass`).
    public static let binarySensorDeviceClasses: Set<String> = [
        "battery", "battery_charging", "carbon_monoxide", "cold", "connectivity", "door", "garage_door", "gas", "heat",
        "light", "lock", "moisture", "motion", "moving", "occupancy", "opening", "plug", "power", "presence",
        "problem", "running", "safety", "smoke", "sound", "tamper", "update", "vibration", "window",
    ]

    /// Home Assistant's sensor state classes (`SensorStateClass`).
    public static let stateClasses: Set<String> = ["measurement", "total", "total_increasing"]

    /// Checks a descriptor against Home Assistant's rules: a device class it knows for the kind (sensor classes for
    /// numbers and text, binary_sensor classes for booleans), a unit that device class allows (temperature needs °C,
    /// °F or K; battery needs %; signal_strength dB or dBm), a state class allowed with that device class, and no
    /// unit or state class on text, boolean and structured fields.
    ///
    /// - Throws: `GATTFieldMetadataError` naming the offending key.
    public static func validate(_ field: GATTFieldDescriptor) throws(GATTFieldMetadataError) {
        if let stateClass = field.stateClass, !stateClasses.contains(stateClass) {
            throw GATTFieldMetadataError(
                key: "state_class",
                reason: "\"\(stateClass)\" is not a state class (\(stateClasses.sorted().joined(separator: ", ")))")
        }
        switch field.kind {
        case .boolean:
            if let deviceClass = field.deviceClass, !binarySensorDeviceClasses.contains(deviceClass) {
                throw GATTFieldMetadataError(
                    key: "device_class", reason: "\"\(deviceClass)\" is not a binary_sensor device class")
            }
            try noUnitOrStateClass(field, "true/false fields")
            return
        case .structured:
            if let deviceClass = field.deviceClass {
                throw GATTFieldMetadataError(
                    key: "device_class",
                    reason: "\"\(deviceClass)\": arrays and objects are not entities and have no device class")
            }
            if field.stateClass != nil {
                throw GATTFieldMetadataError(key: "state_class", reason: "arrays and objects have no state class")
            }
            return
        case .text:
            if let deviceClass = field.deviceClass, !nonNumericSensorDeviceClasses.contains(deviceClass) {
                throw GATTFieldMetadataError(
                    key: "device_class",
                    reason: "\"\(deviceClass)\" is not a device class for text (date, enum, timestamp)")
            }
            try noUnitOrStateClass(field, "text fields")
            return
        case .number:
            break
        }
        guard let deviceClass = field.deviceClass else { return }
        guard let units = sensorDeviceClasses[deviceClass] else {
            throw GATTFieldMetadataError(key: "device_class", reason: "\"\(deviceClass)\" is not a sensor device class")
        }
        if nonNumericSensorDeviceClasses.contains(deviceClass) {
            throw GATTFieldMetadataError(
                key: "device_class", reason: "\"\(deviceClass)\" is for text, not for a number")
        }
        let listed = units.sorted().joined(separator: ", ")
        if let unit = field.unit {
            guard units.contains(unit) else {
                throw GATTFieldMetadataError(
                    key: "unit",
                    reason: units.isEmpty
                        ? "device class \(deviceClass) takes no unit, got \"\(unit)\""
                        : "\"\(unit)\" is not a unit of device class \(deviceClass) (\(listed))")
            }
        } else if !units.isEmpty && !sensorDeviceClassesWithOptionalUnit.contains(deviceClass) {
            throw GATTFieldMetadataError(key: "unit", reason: "device class \(deviceClass) needs a unit (\(listed))")
        }
        if let stateClass = field.stateClass, let allowed = sensorDeviceClassStateClasses[deviceClass],
            !allowed.contains(stateClass)
        {
            throw GATTFieldMetadataError(
                key: "state_class",
                reason: allowed.isEmpty
                    ? "device class \(deviceClass) takes no state class, got \"\(stateClass)\""
                    : "\"\(stateClass)\" is not a state class of device class \(deviceClass) "
                        + "(\(allowed.sorted().joined(separator: ", ")))")
        }
    }

    private static func noUnitOrStateClass(_ field: GATTFieldDescriptor, _ what: String)
        throws(GATTFieldMetadataError)
    {
        if let unit = field.unit {
            throw GATTFieldMetadataError(key: "unit", reason: "\(what) have no unit, got \"\(unit)\"")
        }
        if let stateClass = field.stateClass {
            throw GATTFieldMetadataError(
                key: "state_class", reason: "\(what) have no state class, got \"\(stateClass)\"")
        }
    }

    /// The binary_sensor device class a true/false field's name implies: the name itself when it is one
    /// (`motion`, `door`), `battery` for `battery_low`, else nil.
    static func binarySensorDeviceClass(forName name: String) -> String? {
        if binarySensorDeviceClasses.contains(name) { return name }
        if name == "battery_low" { return "battery" }
        return nil
    }
}

extension GATTFieldDescriptor {
    /// A true/false field, with the binary_sensor device class its name implies (`motion`, `battery_low` → battery).
    static func boolean(_ name: String, deviceClass: String? = nil) -> GATTFieldDescriptor {
        GATTFieldDescriptor(
            name, kind: .boolean, deviceClass: deviceClass ?? GATTHomeAssistant.binarySensorDeviceClass(forName: name))
    }

    /// A text field (no unit, no state class).
    static func text(_ name: String) -> GATTFieldDescriptor { GATTFieldDescriptor(name, kind: .text) }

    /// An array or object field.
    static func structured(_ name: String, unit: String? = nil) -> GATTFieldDescriptor {
        GATTFieldDescriptor(name, kind: .structured, unit: unit)
    }

    /// A number without unit or classes (identifiers, counters, bit fields, raw enumeration values).
    static func plain(_ name: String, stateClass: String? = nil) -> GATTFieldDescriptor {
        GATTFieldDescriptor(name, stateClass: stateClass)
    }

    /// A number whose unit and classes follow the name conventions (`inferred(fromName:)`).
    static func number(_ name: String) -> GATTFieldDescriptor {
        var descriptor = inferred(fromName: name)
        descriptor.kind = .number
        return descriptor
    }

    /// A number in `unit` with state class `measurement`.
    static func measurement(_ name: String, _ unit: String?, _ deviceClass: String? = nil) -> GATTFieldDescriptor {
        GATTFieldDescriptor(name, unit: unit, deviceClass: deviceClass, stateClass: "measurement")
    }

    /// A running total in `unit` that only grows, apart from resets and wrap-arounds (`total_increasing`).
    static func increasing(_ name: String, _ unit: String?, _ deviceClass: String? = nil) -> GATTFieldDescriptor {
        GATTFieldDescriptor(name, unit: unit, deviceClass: deviceClass, stateClass: "total_increasing")
    }

    /// This descriptor with another state class.
    func stateClass(_ stateClass: String?) -> GATTFieldDescriptor {
        var copy = self
        copy.stateClass = stateClass
        return copy
    }
}
