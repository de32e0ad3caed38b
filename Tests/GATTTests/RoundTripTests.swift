// Round trips for every encoder: decode(encode(reading)) gives the reading back, for readings decoded from the
// vectors and for constructed ones that cover every optional field; canonical payloads come back byte for byte.
import GATT
import TestSupport
import Testing

/// Compares two readings field by field, numbers to a relative 1e-12 (SFLOAT/FLOAT re-encoding may pick another
/// exponent for the same decimal value), and nulls equal to absent fields.
func sameReading(_ a: GATTReading, _ b: GATTReading) -> String? {
    let names = Set(a.fields.map(\.name)).union(b.fields.map(\.name))
    for name in names.sorted() {
        let x = a[name] ?? .null
        let y = b[name] ?? .null
        if !sameValue(x, y) { return "\(name): \(x) vs \(y)" }
    }
    return nil
}

func sameValue(_ x: GATTValue, _ y: GATTValue) -> Bool {
    switch (x, y) {
    case (.array(let p), .array(let q)): return p.count == q.count && zip(p, q).allSatisfy(sameValue)
    case (.object(let p), .object(let q)): return sameReading(p, q) == nil
    default:
        if let p = x.numberValue, let q = y.numberValue { return abs(p - q) <= 1e-12 * max(1, abs(p)) }
        return x == y
    }
}

/// The built-in parsers that must encode (SPEC says: every simple fixed layout, plus HRM and HTM).
let parsersThatEncode: Set<String> = [
    "heart_rate_measurement", "temperature_measurement", "intermediate_temperature", "csc_measurement",
    "rsc_measurement", "cycling_power_measurement", "weight_measurement", "blood_pressure_measurement",
    "intermediate_cuff_pressure", "date_time", "current_time", "pnp_id", "appearance",
    "characteristic_presentation_format", "body_sensor_location", "temperature_type", "battery_level",
    "temperature", "humidity", "pressure", "elevation", "uv_index", "illuminance", "co2_concentration",
    "pm25_concentration", "pm1_concentration", "pm10_concentration", "device_name", "manufacturer_name",
    "model_number", "firmware_revision",
]

@Suite struct RoundTripTests {
    @Test func everyListedParserHasAnEncoder() throws {
        for name in parsersThatEncode {
            let parser = try #require(sharedRegistry.parser(named: name), "\(name) is not registered")
            do {
                _ = try parser.encode(GATTReading())
            } catch {
                // An empty reading is missing fields, but the message must not be the "no encoder" default.
                #expect(!error.description.contains("has no encoder"), "\(name): \(error)")
            }
        }
    }

    @Test(arguments: GATTVectors.gatt.filter { !$0.mustReject })
    func vectorReadingsRoundTrip(_ vector: GATTVector) throws {
        let uuid = try #require(BluetoothUUID(vector.uuid))
        let parser = try #require(sharedRegistry.parser(for: uuid))
        let payload = try #require(bytesFromHex(vector.payloadHex))
        let reading = try parser.decode(payload, context: GATTDecodeContext())
        let encoded: [UInt8]
        do {
            encoded = try parser.encode(reading)
        } catch {
            #expect(!parsersThatEncode.contains(parser.name), "\(vector.id): \(error)")
            return
        }
        let again = try parser.decode(encoded, context: GATTDecodeContext())
        let difference = sameReading(reading, again)
        #expect(difference == nil, "\(vector.id): \(difference ?? "")")
    }

    /// Payloads whose encoding is canonical come back byte for byte.
    @Test(arguments: [
        ("2A37", "0055"), ("2A37", "1F0101320101000201FFFF"), ("2A37", "04FF"), ("2A37", "012C01"),
        ("2A1C", "006C0100FF"), ("2A1C", "046C0100FF01"), ("2A1E", "026D0100FFE7070C190E1E2D"),
        ("2A38", "01"), ("2A1D", "09"), ("2A19", "0F"), ("2A6E", "C409"), ("2A6E", "0080"), ("2A6F", "FFFF"),
        ("2A6D", "10270000"), ("2A6C", "393000"), ("2AFB", "FFFFFF"), ("2B8C", "FEFF"), ("2BD6", "0F80"),
        ("2BD6", "FF07"), ("2A5B", "0339300000E8035901D007"), ("2A53", "070003125600010000F0"),
        ("2A63", "2000700190010004"), ("2A63", "0000F6FF"), ("2A63", "FF1FF6FF64400039300000000890010004"
            + "0A00F6FF40001000BC010205000A001E00"), ("2A9D", "0E803EE5070C190E1E2D01FA000807"), ("2A9D", "00FFFF"),
        ("2A35", "1E8A00580078000000041114293B3C00012700"), ("2A35", "0078005000FF07"), ("2A08", "E20704110F3300"),
        ("2A2B", "E907010F0E1E2D032101"), ("2A29", "536F6369C3A974C3A9"), ("2A00", "53656E736F72"),
        ("2A01", "4103"), ("2A50", "015900341201FF"), ("2904", "16002F27010D01"),
    ])
    func canonicalPayloadsRoundTripExactly(uuid: String, hex: String) throws {
        let parser = try #require(sharedRegistry.parser(for: BluetoothUUID(uuid)!))
        let payload = try #require(bytesFromHex(hex))
        let reading = try parser.decode(payload, context: GATTDecodeContext())
        #expect(hexString(try parser.encode(reading)) == hexString(payload), "\(parser.name): \(reading.jsonString)")
    }

    @Test func heartRateEncoderChoosesFlags() throws {
        let parser = HeartRateMeasurementParser()
        let reading = GATTReading([
            GATTField("heart_rate_bpm", .int(300)), GATTField("sensor_contact", .bool(false)),
            GATTField("energy_expended_kj", .int(65535)), GATTField("rr_intervals_s", .array([.double(0.5)])),
        ])
        #expect(try parser.encode(reading) == [0x1D, 0x2C, 0x01, 0xFF, 0xFF, 0x00, 0x02])
        #expect(throws: GATTParseError.self) {
            try parser.encode(GATTReading([GATTField("heart_rate_bpm", .int(70_000))]))
        }
        #expect(throws: GATTParseError.self) { try parser.encode(GATTReading()) }
    }

    @Test func temperatureEncoderWritesFahrenheitTimestampAndType() throws {
        let parser = TemperatureMeasurementParser.measurement
        let reading = GATTReading([
            GATTField("temperature_f", .double(98.6)), GATTField("timestamp", .string("2024-02-29T23:59:59")),
            GATTField("temperature_type", .int(6)),
        ])
        let bytes = try parser.encode(reading)
        #expect(hexString(bytes) == "07da0300ffe807021d173b3b06")
        let decoded = try parser.decode(bytes, context: GATTDecodeContext())
        #expect(decoded["temperature_type_name"] == .string("mouth"))
        #expect(decoded["timestamp"] == .string("2024-02-29T23:59:59"))
        // Special values encode too.
        let nan = try parser.encode(GATTReading([GATTField("temperature_c", .string("NaN"))]))
        #expect(hexString(nan) == "00ffff7f00")
    }

    @Test func timestampWithUnknownPartsRoundTrips() throws {
        let parser = DateTimeParser()
        let reading = try parser.decode(bytesFromHex("00000411141E2D")!, context: GATTDecodeContext())
        #expect(reading["timestamp"] == .null)
        #expect(try parser.encode(reading) == bytesFromHex("00000411141E2D"))
    }

    @Test func scalarEncodersCheckRanges() throws {
        let battery = try #require(sharedRegistry.parser(named: "battery_level"))
        #expect(try battery.encode(GATTReading([GATTField("battery_pct", .int(100))])) == [100])
        #expect(throws: GATTParseError.self) { try battery.encode(GATTReading([GATTField("battery_pct", .int(101))])) }
        let location = try #require(sharedRegistry.parser(named: "body_sensor_location"))
        #expect(try location.encode(GATTReading([GATTField("body_sensor_location", .string("ear_lobe"))])) == [5])
        let temperature = try #require(sharedRegistry.parser(named: "temperature"))
        #expect(try temperature.encode(GATTReading([GATTField("temperature_c", .double(-273.15))])) == [0x4D, 0x95])
        #expect(throws: GATTParseError.self) {
            try temperature.encode(GATTReading([GATTField("temperature_c", .double(400))]))
        }
        #expect(try temperature.encode(GATTReading([GATTField("temperature_c", .null)])) == [0x00, 0x80])
    }
}
