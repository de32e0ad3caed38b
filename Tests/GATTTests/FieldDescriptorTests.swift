// Parsers declare their fields ahead of data: every field a vector decodes to is declared with a matching kind,
// every declaration is valid by Home Assistant's tables, and declarative parsers take, infer and check metadata.
import Foundation
import GATTCrypto
import TestSupport
import Testing

@testable import GATT

/// The IEEE 11073 special values, which a number field may carry as strings.
let medicalFloatSpecials: Set<String> = ["NaN", "NRes", "+INF", "-INF", "RFU"]

/// Nil when `value` fits `kind` (null fits every kind), else what is wrong.
func kindMismatch(_ value: GATTValue, _ kind: GATTFieldKind) -> String? {
    switch (kind, value) {
    case (_, .null): return nil
    case (.number, .int), (.number, .double): return nil
    case (.number, .string(let text)) where medicalFloatSpecials.contains(text): return nil
    case (.boolean, .bool): return nil
    case (.text, .string): return nil
    case (.structured, .array), (.structured, .object): return nil
    default: return "\(value) is not \(kind.rawValue)"
    }
}

/// Checks every top-level field of `reading` against `declared`; `suffixed` accepts `<name>_<n>` for a declared
/// `<name>` (BTHome's repeated objects). Returns the problems.
func undeclaredFields(_ reading: GATTReading, _ declared: [GATTFieldDescriptor], suffixed: Bool = false) -> [String] {
    let byName = Dictionary(declared.map { ($0.name, $0) }, uniquingKeysWith: { first, _ in first })
    var problems: [String] = []
    for field in reading.fields {
        var descriptor = byName[field.name]
        if descriptor == nil, suffixed, let underscore = field.name.lastIndex(of: "_"),
            field.name[field.name.index(after: underscore)...].allSatisfy(\.isNumber)
        {
            descriptor = byName[String(field.name[..<underscore])]
        }
        guard let descriptor else {
            problems.append("\(field.name) is not declared")
            continue
        }
        if let mismatch = kindMismatch(field.value, descriptor.kind) { problems.append("\(field.name): \(mismatch)") }
    }
    return problems
}

/// Every declaration of every built-in parser, named `parser.field`.
func allBuiltInDeclarations() -> [(parser: String, fields: [GATTFieldDescriptor])] {
    BuiltInCharacteristicParsers.all.map { ($0.name, $0.fields) }
        + BuiltInAdvertisementParsers.all.map {
            ($0.name, $0.fields)
        }
}

@Suite struct FieldDescriptorVectorTests {
    @Test(arguments: GATTVectors.gatt.filter { !$0.mustReject })
    func gattVectorFieldsAreDeclared(_ vector: GATTVector) throws {
        let uuid = try #require(BluetoothUUID(vector.uuid))
        let payload = try #require(bytesFromHex(vector.payloadHex))
        let reading = try sharedRegistry.decode(uuid, payload)
        let declared = sharedRegistry.fields(for: uuid)
        #expect(!declared.isEmpty, "\(vector.id): \(vector.uuid) declares nothing")
        let problems = undeclaredFields(reading, declared)
        #expect(problems.isEmpty, "\(vector.id): \(problems) in \(reading.jsonString)")

        // A 0x2904 vector's value, decoded by the descriptor, publishes what `fields(forPresentationFormat:)` says.
        if let valueHex = vector.param("value_hex") {
            let value = try #require(bytesFromHex(valueHex))
            let decoded = try sharedRegistry.decode(
                vendorUUID, value, context: GATTDecodeContext(presentationFormat: payload))
            let formatFields = sharedRegistry.fields(forPresentationFormat: payload)
            #expect(formatFields.map(\.name) == decoded.fields.map(\.name), "\(vector.id): \(decoded.jsonString)")
            let problems = undeclaredFields(decoded, formatFields)
            #expect(problems.isEmpty, "\(vector.id): \(problems) in \(decoded.jsonString)")
        }
    }

    @Test(arguments: AdvVector.all.filter { $0.error == nil })
    func advertisementVectorFieldsAreDeclared(_ vector: AdvVector) throws {
        let registry = try advRegistry()
        let reading = try registry.decode(vector.source, vector.payload, context: vector.context)
        let declared = registry.fields(for: vector.source)
        #expect(!declared.isEmpty, "\(vector.id): \(vector.source) declares nothing")
        let bthome = vector.source == .serviceData(BluetoothUUID(UInt16(0xFCD2)))
        let problems = undeclaredFields(reading, declared, suffixed: bthome)
        #expect(problems.isEmpty, "\(vector.id): \(problems) in \(reading.jsonString)")
    }

    @Test func vectorsCoverEveryDeclaringParser() {
        #expect(GATTVectors.gatt.filter { !$0.mustReject }.count >= 60)
        #expect(AdvVector.all.filter { $0.error == nil }.count >= 30)
    }

    /// The kind check itself: a mismatch is reported, null is accepted everywhere.
    @Test func kindCheckCanFail() {
        #expect(kindMismatch(.string("x"), .number) != nil)
        #expect(kindMismatch(.int(1), .boolean) != nil)
        #expect(kindMismatch(.bool(true), .text) != nil)
        #expect(kindMismatch(.array([]), .number) != nil)
        #expect(kindMismatch(.string("NaN"), .number) == nil)
        for kind in [GATTFieldKind.number, .boolean, .text, .structured] { #expect(kindMismatch(.null, kind) == nil) }
        let reading = GATTReading([GATTField("a", .int(1)), GATTField("b_2", .int(2))])
        #expect(undeclaredFields(reading, [.plain("a")]) == ["b_2 is not declared"])
        #expect(undeclaredFields(reading, [.plain("a"), .plain("b")], suffixed: true).isEmpty)
    }

    /// Every BTHome object (each id of the table, encoded and decoded) publishes declared fields.
    @Test func everyBTHomeObjectIsDeclared() throws {
        let declared = BTHomeV2Parser().fields
        for id in BTHomeObjects.definedIDs {
            guard let object = BTHomeObjects.table[Int(id)] else { continue }
            let value: GATTValue
            switch object.kind {
            case .integer, .decimal, .timesPoint35, .binary: value = .int(1)
            case .button: value = .string("press")
            case .dimmer: value = .array([.string("rotate_left"), .int(3)])
            case .timestamp: value = .int(1_700_000_000)
            case .text: value = .string("hi")
            case .raw: value = .string("beef")
            case .firmwareVersion: value = .string(object.length == 4 ? "1.2.3.4" : "1.2.3")
            }
            let packet = try BTHomeEncoder.encode([BTHomeObject(id: id, value)], includedMAC: "A4:C1:38:00:11:22")
            let reading = try BTHomeV2Parser().decode(
                packet, from: .serviceData(BluetoothUUID(UInt16(0xFCD2))), context: AdvertisementContext())
            #expect(!reading.fields.isEmpty)
            let problems = undeclaredFields(reading, declared)
            #expect(problems.isEmpty, "object 0x\(String(id, radix: 16)): \(problems) in \(reading.jsonString)")
        }
    }
}

@Suite struct FieldDescriptorDeclarationTests {
    @Test func everyBuiltInParserDeclaresFields() {
        for (parser, fields) in allBuiltInDeclarations() {
            #expect(!fields.isEmpty, "\(parser) declares nothing")
            let names = fields.map(\.name)
            #expect(Set(names).count == names.count, "\(parser) declares a name twice: \(names)")
            for field in fields { #expect(isSnakeCase(field.name), "\(parser).\(field.name)") }
        }
    }

    @Test func everyDeclarationIsValidForHomeAssistant() {
        for (parser, fields) in allBuiltInDeclarations() {
            for field in fields {
                #expect(throws: Never.self, "\(parser): \(field)") { try GATTHomeAssistant.validate(field) }
                if field.kind != .number {
                    #expect(field.stateClass == nil, "\(parser): \(field)")
                }
                if let unit = field.unit { #expect(!unit.isEmpty && !unit.contains("\u{03BC}"), "\(parser): \(field)") }
            }
        }
    }

    /// The BTHome list names every field of the object table, and nothing else.
    @Test func bthomeDeclaresExactlyTheTable() {
        var names: Set<String> = ["mac", "dimmer_steps"]
        for id in BTHomeObjects.definedIDs {
            if let object = BTHomeObjects.table[Int(id)] { names.insert(object.name) }
        }
        #expect(Set(BTHomeV2Parser().fields.map(\.name)) == names)
        // Binary objects are true/false, the others numbers or text; inference is never what fills a row.
        for id in BTHomeObjects.definedIDs {
            guard let object = BTHomeObjects.table[Int(id)],
                let field = BTHomeV2Parser().fields.first(where: { $0.name == object.name })
            else { continue }
            if case .binary = object.kind { #expect(field.kind == .boolean, "\(field)") }
        }
    }

    /// Fixed examples, as Home Assistant shows them.
    @Test func wellKnownFieldsHaveTheirHomeAssistantMetadata() throws {
        func field(_ uuid: UInt16, _ name: String) -> GATTFieldDescriptor? {
            sharedRegistry.fields(for: BluetoothUUID(uuid)).first { $0.name == name }
        }
        #expect(
            field(0x2A6E, "temperature_c")
                == GATTFieldDescriptor(
                    "temperature_c", unit: "°C", deviceClass: "temperature", stateClass: "measurement"))
        #expect(
            field(0x2A19, "battery_pct")
                == GATTFieldDescriptor("battery_pct", unit: "%", deviceClass: "battery", stateClass: "measurement"))
        #expect(field(0x2A37, "heart_rate_bpm")?.unit == "bpm")
        #expect(field(0x2A37, "energy_expended_kj")?.stateClass == "total_increasing")
        #expect(field(0x2A37, "rr_intervals_s")?.kind == .structured)
        #expect(field(0x2A37, "sensor_contact")?.kind == .boolean)
        #expect(field(0x2A71, "true_wind_direction_deg")?.stateClass == nil)
        #expect(field(0x2A38, "body_sensor_location_name")?.kind == .text)
        #expect(field(0x2A29, "manufacturer_name")?.kind == .text)
        #expect(field(0x2BD6, "pm25_ug_m3")?.unit == "\u{00B5}g/m³")
        let ruuvi = try advRegistry().fields(for: .manufacturer(0x0499))
        #expect(ruuvi.first { $0.name == "tx_power_dbm" }?.deviceClass == "signal_strength")
        #expect(ruuvi.first { $0.name == "mac" }?.kind == .text)
        let bthome = try advRegistry().fields(for: .serviceData(BluetoothUUID(UInt16(0xFCD2))))
        #expect(
            bthome.first { $0.name == "motion" } == GATTFieldDescriptor("motion", kind: .boolean, deviceClass: "motion")
        )
        #expect(bthome.first { $0.name == "battery_low" }?.deviceClass == "battery")
        #expect(bthome.first { $0.name == "generic" }?.deviceClass == nil)
    }
}

@Suite struct FieldLookupTests {
    /// A conformer written before `fields` existed still compiles and declares nothing.
    struct LegacyParser: GATTCharacteristicParser {
        let uuids = [BluetoothUUID(UInt16(0xFFF7))]
        let name = "legacy"
        func decode(_ bytes: [UInt8], context: GATTDecodeContext) throws(GATTParseError) -> GATTReading {
            .raw(bytes)
        }
    }

    struct LegacyAdvertisementParser: AdvertisementParser {
        let sources: [AdvertisementSource] = [.manufacturer(0xFFF7)]
        let name = "legacy_adv"
        func decode(_ payload: [UInt8], from source: AdvertisementSource, context: AdvertisementContext)
            throws(GATTParseError) -> GATTReading
        { .raw(payload) }
    }

    @Test func defaultsAndUnknownsAreEmpty() throws {
        var registry = try GATTParserRegistry.builtIn()
        try registry.register(LegacyParser())
        try registry.register(LegacyAdvertisementParser())
        #expect(registry.fields(for: BluetoothUUID(UInt16(0xFFF7))).isEmpty)
        #expect(registry.fields(for: .manufacturer(0xFFF7)).isEmpty)
        #expect(registry.fields(for: vendorUUID).isEmpty)
        #expect(registry.fields(for: .manufacturer(0x1234)).isEmpty)
        #expect(!registry.fields(for: BluetoothUUID(UInt16(0x2A37))).isEmpty)
        // Any UUID form finds the parser.
        #expect(
            registry.fields(for: try #require(BluetoothUUID("00002a37-0000-1000-8000-00805f9b34fb")))
                == registry.fields(for: BluetoothUUID(UInt16(0x2A37))))
    }

    @Test func presentationFormatFields() throws {
        // sint16, exponent -2, degree Celsius.
        let celsius = sharedRegistry.fields(forPresentationFormat: [0x0E, 0xFE, 0x2F, 0x27, 0x01, 0x00, 0x00])
        #expect(
            celsius == [
                GATTFieldDescriptor("value_c", unit: "°C", deviceClass: "temperature", stateClass: "measurement"),
                GATTFieldDescriptor("unit", kind: .text),
            ])
        // uint8 percentage; boolean; utf8s; a unit not in the table; unitless.
        #expect(sharedRegistry.fields(forPresentationFormat: [0x04, 0, 0xAD, 0x27, 1, 0, 0]).first?.unit == "%")
        #expect(sharedRegistry.fields(forPresentationFormat: [0x01, 0, 0x00, 0x27, 1, 0, 0]).first?.kind == .boolean)
        #expect(sharedRegistry.fields(forPresentationFormat: [0x19, 0, 0x00, 0x27, 1, 0, 0]).first?.kind == .text)
        #expect(
            sharedRegistry.fields(forPresentationFormat: [0x06, 0, 0x99, 0x27, 1, 0, 0]).map(\.name) == [
                "value", "unit_uuid",
            ])
        #expect(
            sharedRegistry.fields(forPresentationFormat: [0x06, 0, 0x00, 0x27, 1, 0, 0]).map(\.name).first == "value")
        // Malformed or reserved: nothing.
        #expect(sharedRegistry.fields(forPresentationFormat: [0x06, 0]).isEmpty)
        #expect(sharedRegistry.fields(forPresentationFormat: [0xEE, 0, 0x2F, 0x27, 1, 0, 0]).isEmpty)
    }

    /// Every unit of the presentation-format table, with every format: the declared value field matches what
    /// `decodeValue` publishes for a zero value, and its metadata is valid.
    @Test func presentationFormatFieldsMatchDecodingForEveryUnit() throws {
        for (unit, _) in PresentationFormat.units {
            for (code, info) in PresentationFormat.formats {
                let format = PresentationFormat(format: UInt8(code), exponent: 0, unit: unit)
                let declared = format.fields
                for field in declared {
                    #expect(throws: Never.self, "\(field)") { try GATTHomeAssistant.validate(field) }
                }
                let value = [UInt8](repeating: 0, count: info.size ?? 2)
                let reading = try format.decodeValue(value)
                #expect(declared.map(\.name) == reading.fields.map(\.name), "\(code) \(unit)")
                #expect(undeclaredFields(reading, declared).isEmpty, "\(code) \(unit): \(reading.jsonString)")
            }
        }
    }
}

@Suite struct HomeAssistantTableTests {
    @Test func tablesFollowHomeAssistantRules() throws {
        let units = GATTHomeAssistant.sensorDeviceClasses
        #expect(units["temperature"] == ["°C", "°F", "K"])
        #expect(units["battery"] == ["%"])
        #expect(units["humidity"] == ["%"])
        #expect(units["signal_strength"] == ["dB", "dBm"])
        #expect(units["illuminance"] == ["lx"])
        #expect(try #require(units["pressure"]).isSuperset(of: ["Pa", "hPa", "kPa", "mbar", "mmHg"]))
        #expect(units["pm25"] == ["\u{00B5}g/m³"])
        #expect(units["enum"] == [])
        #expect(GATTHomeAssistant.sensorDeviceClassStateClasses["enum"] == [])
        #expect(GATTHomeAssistant.sensorDeviceClassStateClasses["energy"] == ["total", "total_increasing"])
        #expect(GATTHomeAssistant.stateClasses == ["measurement", "total", "total_increasing"])
        #expect(Set(GATTHomeAssistant.sensorDeviceClassStateClasses.keys) == Set(units.keys))
        for (deviceClass, stateClasses) in GATTHomeAssistant.sensorDeviceClassStateClasses {
            #expect(stateClasses.isSubset(of: GATTHomeAssistant.stateClasses), "\(deviceClass)")
        }
        for deviceClass in GATTHomeAssistant.nonNumericSensorDeviceClasses { #expect(units[deviceClass] == []) }
        #expect(GATTHomeAssistant.binarySensorDeviceClasses.count == 28)
        #expect(GATTHomeAssistant.binarySensorDeviceClasses.isSuperset(of: ["door", "motion", "battery", "window"]))
    }

    @Test(
        arguments: [
            (GATTFieldDescriptor("t", unit: "°C", deviceClass: "temperature", stateClass: "measurement"), nil),
            (GATTFieldDescriptor("t", unit: "hPa", deviceClass: "temperature"), "unit"),
            (GATTFieldDescriptor("t", deviceClass: "temperature"), "unit"),
            (GATTFieldDescriptor("b", unit: "V", deviceClass: "battery"), "unit"),
            (GATTFieldDescriptor("r", unit: "dBm", deviceClass: "signal_strength"), nil),
            (GATTFieldDescriptor("r", unit: "mW", deviceClass: "signal_strength"), "unit"),
            (GATTFieldDescriptor("x", deviceClass: "flux_capacitance"), "device_class"),
            (GATTFieldDescriptor("x", stateClass: "sometimes"), "state_class"),
            (GATTFieldDescriptor("e", unit: "kWh", deviceClass: "energy", stateClass: "measurement"), "state_class"),
            (GATTFieldDescriptor("e", unit: "kWh", deviceClass: "energy", stateClass: "total_increasing"), nil),
            (
                GATTFieldDescriptor("w", unit: "°", deviceClass: "wind_direction", stateClass: "measurement"),
                "state_class"
            ),
            (GATTFieldDescriptor("q", deviceClass: "aqi", stateClass: "measurement"), nil),
            (GATTFieldDescriptor("q", unit: "%", deviceClass: "aqi"), "unit"),
            (GATTFieldDescriptor("f", deviceClass: "power_factor"), nil),
            (GATTFieldDescriptor("n", deviceClass: "enum"), "device_class"),
            (GATTFieldDescriptor("s", kind: .text, deviceClass: "enum"), nil),
            (GATTFieldDescriptor("s", kind: .text, stateClass: "measurement"), "state_class"),
            (GATTFieldDescriptor("s", kind: .text, unit: "°C"), "unit"),
            (GATTFieldDescriptor("s", kind: .text, deviceClass: "temperature"), "device_class"),
            (GATTFieldDescriptor("d", kind: .boolean, deviceClass: "door"), nil),
            (GATTFieldDescriptor("d", kind: .boolean, deviceClass: "temperature"), "device_class"),
            (GATTFieldDescriptor("d", kind: .boolean, stateClass: "measurement"), "state_class"),
            (GATTFieldDescriptor("a", kind: .structured, unit: "s"), nil),
            (GATTFieldDescriptor("a", kind: .structured, deviceClass: "duration"), "device_class"),
            (GATTFieldDescriptor("a", kind: .structured, stateClass: "measurement"), "state_class"),
            (GATTFieldDescriptor("u", unit: "bpm", stateClass: "measurement"), nil),
        ] as [(GATTFieldDescriptor, String?)])
    func validation(_ field: GATTFieldDescriptor, _ key: String?) {
        do {
            try GATTHomeAssistant.validate(field)
            #expect(key == nil, "\(field) accepted")
        } catch {
            #expect(error.key == key, "\(field): \(error)")
            #expect(!error.reason.isEmpty)
        }
    }
}

@Suite struct FieldInferenceTests {
    @Test(
        arguments: [
            ("temperature_c", "°C", "temperature", "measurement"),
            ("temperature_f", "°F", "temperature", "measurement"),
            ("humidity_pct", "%", "humidity", "measurement"), ("battery_pct", "%", "battery", "measurement"),
            ("moisture_pct", "%", "moisture", "measurement"), ("spo2_pct", "%", nil, "measurement"),
            ("pressure_hpa", "hPa", "pressure", "measurement"), ("pressure_pa", "Pa", "pressure", "measurement"),
            ("heart_rate_bpm", "bpm", nil, "measurement"), ("battery_voltage_v", "V", "voltage", "measurement"),
            ("cell_mv", "mV", "voltage", "measurement"), ("illuminance_lux", "lx", "illuminance", "measurement"),
            ("illuminance_lx", "lx", "illuminance", "measurement"), ("energy_kj", "kJ", "energy", "total_increasing"),
            ("energy_kwh", "kWh", "energy", "total_increasing"), ("rssi_dbm", "dBm", "signal_strength", "measurement"),
            ("co2_ppm", "ppm", "carbon_dioxide", "measurement"), ("pm25_ug_m3", "\u{00B5}g/m³", "pm25", "measurement"),
            ("wind_speed_m_s", "m/s", "wind_speed", "measurement"), ("speed_m_s", "m/s", "speed", "measurement"),
            ("uptime_s", "s", "duration", "measurement"), ("wind_direction_deg", "°", "wind_direction", nil),
            ("weight_kg", "kg", "weight", "measurement"), ("water_l", "L", "water", "total_increasing"),
            ("gas_m3", "m³", "gas", "total_increasing"), ("uv_index", "UV index", nil, "measurement"),
        ] as [(String, String?, String?, String?)])
    func unitSuffixes(_ name: String, _ unit: String?, _ deviceClass: String?, _ stateClass: String?) throws {
        let inferred = GATTFieldDescriptor.inferred(fromName: name)
        #expect(
            inferred == GATTFieldDescriptor(name, unit: unit, deviceClass: deviceClass, stateClass: stateClass),
            "\(inferred)")
        try GATTHomeAssistant.validate(inferred)
    }

    @Test func namesWithoutAUnit() {
        #expect(GATTFieldDescriptor.inferred(fromName: "mac") == GATTFieldDescriptor("mac", kind: .text))
        #expect(GATTFieldDescriptor.inferred(fromName: "mode_name").kind == .text)
        #expect(GATTFieldDescriptor.inferred(fromName: "timestamp").kind == .text)
        #expect(GATTFieldDescriptor.inferred(fromName: "packet_id") == GATTFieldDescriptor("packet_id"))
        #expect(GATTFieldDescriptor.inferred(fromName: "count") == GATTFieldDescriptor("count"))
        // A bare suffix is not a unit.
        #expect(GATTFieldDescriptor.inferred(fromName: "c") == GATTFieldDescriptor("c"))
    }

    /// Inference is a fallback for any name: whatever it returns passes Home Assistant's rules.
    @Test func inferenceIsAlwaysValid() throws {
        var names = allBuiltInDeclarations().flatMap { $0.fields.map(\.name) }
        for (_, info) in PresentationFormat.units where !info.suffix.isEmpty { names.append("value_\(info.suffix)") }
        for suffix in ["x", "us_cm", "kg_m3", "per_m3", "mol_l", "m3_h", "l_min", "w_m2", "deg_s", "nm", "ah", "d"] {
            names.append("thing_\(suffix)")
        }
        for name in names {
            let inferred = GATTFieldDescriptor.inferred(fromName: name)
            #expect(throws: Never.self, "\(inferred)") { try GATTHomeAssistant.validate(inferred) }
        }
    }
}

@Suite struct DeclarativeFieldMetadataTests {
    func parser(_ fields: [DeclarativeFieldSpec]) throws(DeclarativeParserError) -> DeclarativeParser {
        try DeclarativeParser(DeclarativeParserSpec(name: "vendor", uuid: "FFF1", fields: fields), path: "parsers[0]")
    }

    func rejection(_ field: DeclarativeFieldSpec) -> DeclarativeParserError? {
        do {
            _ = try parser([DeclarativeFieldSpec(name: "first", type: "u8", offset: 0), field])
            return nil
        } catch {
            return error
        }
    }

    @Test func explicitMetadataIsPublished() throws {
        let p = try parser([
            DeclarativeFieldSpec(
                name: "outside", type: "s16le", offset: 0, scale: 0.1, unit: "°F", deviceClass: "temperature",
                stateClass: "measurement"),
            DeclarativeFieldSpec(
                name: "meter_kwh", type: "u32le", offset: 2, scale: 0.001, stateClass: "total"),
            DeclarativeFieldSpec(name: "lid", type: "bool:bit0", offset: 6, deviceClass: "opening"),
            DeclarativeFieldSpec(name: "label", type: "utf8", offset: 7, length: 4, deviceClass: "enum"),
        ])
        #expect(
            p.fields == [
                GATTFieldDescriptor("outside", unit: "°F", deviceClass: "temperature", stateClass: "measurement"),
                GATTFieldDescriptor("meter_kwh", unit: "kWh", deviceClass: "energy", stateClass: "total"),
                GATTFieldDescriptor("lid", kind: .boolean, deviceClass: "opening"),
                GATTFieldDescriptor("label", kind: .text, deviceClass: "enum"),
            ])
        #expect(
            try GATTParserRegistry.builtIn(declaring: [
                DeclarativeParserSpec(
                    name: "vendor", uuid: "FFF1",
                    fields: [
                        DeclarativeFieldSpec(
                            name: "outside", type: "s16le", offset: 0, unit: "°F", deviceClass: "temperature")
                    ])
            ]).fields(for: BluetoothUUID(UInt16(0xFFF1))).first?.unit == "°F")
    }

    @Test func metadataIsInferredFromNamesAndTypes() throws {
        let p = try parser([
            DeclarativeFieldSpec(name: "temperature_c", type: "s16le", offset: 0, scale: 0.01),
            DeclarativeFieldSpec(name: "pressure_hpa", type: "u16le", offset: 2),
            DeclarativeFieldSpec(name: "door", type: "bool:bit0", offset: 4),
            DeclarativeFieldSpec(name: "battery_low", type: "bool:bit1", offset: 4),
            DeclarativeFieldSpec(name: "heater_on", type: "bool:bit2", offset: 4),
            DeclarativeFieldSpec(name: "mode", type: "u8", offset: 5, enumNames: [0: "off", 1: "eco"]),
            DeclarativeFieldSpec(name: "serial_hex", type: "hex", offset: 6, length: 2),
            DeclarativeFieldSpec(name: "note_c", type: "utf8", offset: 8),
        ])
        #expect(
            p.fields == [
                GATTFieldDescriptor("temperature_c", unit: "°C", deviceClass: "temperature", stateClass: "measurement"),
                GATTFieldDescriptor("pressure_hpa", unit: "hPa", deviceClass: "pressure", stateClass: "measurement"),
                GATTFieldDescriptor("door", kind: .boolean, deviceClass: "door"),
                GATTFieldDescriptor("battery_low", kind: .boolean, deviceClass: "battery"),
                GATTFieldDescriptor("heater_on", kind: .boolean),
                GATTFieldDescriptor("mode"), GATTFieldDescriptor("mode_name", kind: .text),
                GATTFieldDescriptor("serial_hex", kind: .text),
                // A text field never takes the unit its name suggests.
                GATTFieldDescriptor("note_c", kind: .text),
            ])
        // The declared fields are what decoding publishes.
        let reading = try p.decode(bytesFromHex("290901040301BEEF486921")!, context: GATTDecodeContext())
        #expect(reading.fields.map(\.name) == p.fields.map(\.name))
        #expect(undeclaredFields(reading, p.fields).isEmpty, "\(reading.jsonString)")
    }

    /// A declared unit or device class replaces the inferred pair; what still fits is kept.
    @Test func declaredValuesOverrideInference() throws {
        let p = try parser([
            // The unit differs from the inferred °C: the inferred temperature class and state class go with it.
            DeclarativeFieldSpec(name: "probe_c", type: "u8", offset: 0, unit: "mV"),
            // The device class allows the inferred unit: kept.
            DeclarativeFieldSpec(name: "inside_c", type: "u8", offset: 1, deviceClass: "temperature_delta"),
            // Only the state class: unit and device class inferred.
            DeclarativeFieldSpec(name: "energy_kwh", type: "u8", offset: 2, stateClass: "total"),
        ])
        #expect(
            p.fields == [
                GATTFieldDescriptor("probe_c", unit: "mV"),
                GATTFieldDescriptor("inside_c", unit: "°C", deviceClass: "temperature_delta"),
                GATTFieldDescriptor("energy_kwh", unit: "kWh", deviceClass: "energy", stateClass: "total"),
            ])
    }

    @Test(
        arguments: [
            (
                DeclarativeFieldSpec(name: "t", type: "s16le", offset: 1, deviceClass: "hotness"), "device_class",
                "hotness"
            ),
            (
                DeclarativeFieldSpec(name: "t", type: "s16le", offset: 1, stateClass: "sometimes"), "state_class",
                "sometimes"
            ),
            (
                DeclarativeFieldSpec(name: "t", type: "s16le", offset: 1, unit: "hPa", deviceClass: "temperature"),
                "unit",
                "hPa"
            ),
            (
                DeclarativeFieldSpec(name: "t", type: "s16le", offset: 1, deviceClass: "temperature"), "unit",
                "needs a unit"
            ),
            (DeclarativeFieldSpec(name: "level", type: "u8", offset: 1, deviceClass: "battery"), "unit", "%"),
            (
                DeclarativeFieldSpec(name: "rssi", type: "s8", offset: 1, unit: "mW", deviceClass: "signal_strength"),
                "unit", "dBm"
            ),
            (
                DeclarativeFieldSpec(name: "e_kwh", type: "u16le", offset: 1, stateClass: "measurement"), "state_class",
                "energy"
            ),
            (DeclarativeFieldSpec(name: "mode", type: "u8", offset: 1, deviceClass: "enum"), "device_class", "text"),
            (DeclarativeFieldSpec(name: "label", type: "utf8", offset: 1, unit: "°C"), "unit", "text"),
            (
                DeclarativeFieldSpec(name: "label", type: "utf8", offset: 1, stateClass: "measurement"), "state_class",
                "text"
            ),
            (
                DeclarativeFieldSpec(name: "label", type: "utf8", offset: 1, deviceClass: "temperature"),
                "device_class", "text"
            ),
            (
                DeclarativeFieldSpec(name: "open", type: "bool:bit0", offset: 1, deviceClass: "temperature"),
                "device_class", "binary_sensor"
            ),
            (DeclarativeFieldSpec(name: "open", type: "bool:bit0", offset: 1, unit: "%"), "unit", "true/false"),
            (
                DeclarativeFieldSpec(name: "open", type: "bool:bit0", offset: 1, stateClass: "measurement"),
                "state_class", "true/false"
            ),
            (
                DeclarativeFieldSpec(name: "mode", type: "u8", offset: 1, enumNames: [0: "off"], unit: "%"), "unit",
                "enum"
            ),
            (
                DeclarativeFieldSpec(
                    name: "mode", type: "u8", offset: 1, enumNames: [0: "off"], stateClass: "measurement"),
                "state_class", "enum"
            ),
            (
                DeclarativeFieldSpec(
                    name: "mode", type: "u8", offset: 1, enumNames: [0: "off"], deviceClass: "battery"),
                "device_class", "enum"
            ),
        ] as [(DeclarativeFieldSpec, String, String)])
    func invalidMetadataIsRejectedWithItsPath(_ field: DeclarativeFieldSpec, _ key: String, _ mention: String) throws {
        let error = try #require(rejection(field), "\(field) accepted")
        #expect(error.path == "parsers[0].fields[1].\(key)", "\(error)")
        #expect(error.reason.contains(mention), "\(error)")
    }

    @Test func enumFieldsPublishTheNameAsText() throws {
        let p = try parser([
            DeclarativeFieldSpec(name: "mode", type: "u8", offset: 0, enumNames: [0: "off"], deviceClass: "enum")
        ])
        #expect(
            p.fields == [
                GATTFieldDescriptor("mode"), GATTFieldDescriptor("mode_name", kind: .text, deviceClass: "enum"),
            ])
    }

    @Test func registryNamesThePathOfBadMetadata() {
        let spec = DeclarativeParserSpec(
            name: "vendor", uuid: "FFF1",
            fields: [
                DeclarativeFieldSpec(name: "a", type: "u8", offset: 0),
                DeclarativeFieldSpec(name: "b_c", type: "u8", offset: 1, unit: "%", deviceClass: "temperature"),
            ])
        do {
            _ = try GATTParserRegistry.builtIn(declaring: [spec])
            Issue.record("accepted")
        } catch {
            #expect(
                error.description
                    == #"parsers[0].fields[1].unit: "%" is not a unit of device class temperature (K, °C, °F)"#)
        }
    }
}

@Suite struct FieldMetadataDocumentationTests {
    func document() throws -> String {
        try String(contentsOf: Fixtures.config("PARSERS.md"), encoding: .utf8)
    }

    /// The example of config/PARSERS.md's "Units and Home Assistant classes" loads and declares what the text says.
    @Test func documentedExampleLoads() throws {
        let doc = try document()
        let start = try #require(doc.range(of: "```yaml\nparsers:\n  - name: acme_tank"))
        let end = try #require(doc.range(of: "```", range: start.upperBound..<doc.endIndex))
        let yaml = String(doc[doc.index(start.lowerBound, offsetBy: "```yaml\n".count)..<end.lowerBound])
        let declared = try specs(from: MiniYAML.parse(yaml))
        let registry = try GATTParserRegistry.builtIn(declaring: declared)
        let uuid = try #require(BluetoothUUID("6e400020-b5a3-f393-e0a9-e50e24dcca9e"))
        #expect(
            registry.fields(for: uuid) == [
                GATTFieldDescriptor(
                    "water_temperature", unit: "°F", deviceClass: "temperature", stateClass: "measurement"),
                GATTFieldDescriptor("pumped_l", unit: "L", deviceClass: "volume", stateClass: "total_increasing"),
                GATTFieldDescriptor("lid_open", kind: .boolean, deviceClass: "opening"),
                GATTFieldDescriptor("level", unit: "%"),
            ])
        for key in ["`fields[].unit`", "`fields[].device_class`", "`fields[].state_class`"] {
            #expect(doc.contains(key), "\(key) is not documented")
        }
    }

    /// The documented error lines are the ones the bridge prints.
    @Test func documentedErrorsAreReal() throws {
        let doc = try document()
        func error(_ fields: [DeclarativeFieldSpec]) -> String {
            do {
                _ = try GATTParserRegistry.builtIn(declaring: [
                    DeclarativeParserSpec(name: "vendor", uuid: "FFF1", fields: fields)
                ])
                return "accepted"
            } catch {
                return error.description
            }
        }
        let a = DeclarativeFieldSpec(name: "a", type: "u8", offset: 0)
        let b = DeclarativeFieldSpec(name: "b", type: "u8", offset: 1)
        let lines = [
            error([a, DeclarativeFieldSpec(name: "t", type: "u8", offset: 1, deviceClass: "hotness")]),
            error([DeclarativeFieldSpec(name: "t_c", type: "u8", offset: 0, unit: "hPa", deviceClass: "temperature")]),
            error([a, b, DeclarativeFieldSpec(name: "e_kwh", type: "u8", offset: 2, stateClass: "measurement")]),
        ]
        for line in lines { #expect(doc.contains(line), "not in PARSERS.md: \(line)") }
    }
}
