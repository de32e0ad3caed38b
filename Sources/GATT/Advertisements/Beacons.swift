// Fixed-layout advertisement formats: Ruuvi RAWv2, iBeacon, Eddystone, Govee H5072/H5075 (SPEC.md §4.2, §4.5-4.7).

/// Reads a big-endian unsigned integer; the caller has checked the bounds.
@inline(__always)
func advBigEndian(_ bytes: [UInt8], _ offset: Int, _ length: Int) -> UInt64 {
    var v: UInt64 = 0
    for k in 0..<length { v = v << 8 | UInt64(bytes[offset + k]) }
    return v
}

/// Ruuvi RAWv2 (data format 5), manufacturer data of company 0x0499: exactly 24 octets, big-endian.
/// Every "not available" sentinel becomes `null` (SPEC.md §4.2).
public struct RuuviRAWv2Parser: AdvertisementParser {
    /// Where this format is found: manufacturer data of company 0x0499.
    public let sources: [AdvertisementSource] = [.manufacturer(0x0499)]
    /// `ruuvi_rawv2`: the parser name in logs and on the command line.
    public let name = "ruuvi_rawv2"

    /// Climate, acceleration (milli-g, as Ruuvi publishes it), battery voltage, transmit power, counters, `mac`.
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("temperature_c", "°C", "temperature"), .measurement("humidity_pct", "%", "humidity"),
            .measurement("pressure_pa", "Pa", "pressure"), .measurement("acceleration_x_mg", "mG"),
            .measurement("acceleration_y_mg", "mG"), .measurement("acceleration_z_mg", "mG"),
            .measurement("battery_voltage_v", "V", "voltage"), .measurement("tx_power_dbm", "dBm", "signal_strength"),
            .plain("movement_counter"), .plain("measurement_sequence"), .text("mac"),
        ]
    }

    /// Creates the parser. It holds no state.
    public init() {}

    private static let axes = ["acceleration_x_mg", "acceleration_y_mg", "acceleration_z_mg"]

    /// Decodes one payload; throws a `GATTParseError` naming the format when it must be rejected.
    public func decode(_ p: [UInt8], from source: AdvertisementSource, context: AdvertisementContext)
        throws(GATTParseError) -> GATTReading
    {
        guard let format = p.first else {
            throw .invalidLength(expected: "Ruuvi RAWv2: 24 octets", actual: 0)
        }
        guard format == 0x05 else {
            throw .unsupported(
                "Ruuvi data format \(format) at offset 0 (only RAWv2, data format 5, is supported)")
        }
        guard p.count == 24 else {
            throw .invalidLength(expected: "Ruuvi RAWv2: 24 octets", actual: p.count)
        }
        var r = GATTReading(capacity: 11)
        let temperature = Int16(truncatingIfNeeded: advBigEndian(p, 1, 2))
        r.append("temperature_c", temperature == Int16.min ? .null : .double(Double(temperature) * 0.005))
        let humidity = advBigEndian(p, 3, 2)
        r.append("humidity_pct", humidity == 0xFFFF ? .null : .double(Double(humidity) * 0.0025))
        let pressure = advBigEndian(p, 5, 2)
        r.append("pressure_pa", pressure == 0xFFFF ? .null : .int(Int64(pressure) + 50_000))
        for (k, axis) in Self.axes.enumerated() {
            let a = Int16(truncatingIfNeeded: advBigEndian(p, 7 + 2 * k, 2))
            r.append(axis, a == Int16.min ? .null : .int(Int64(a)))
        }
        let power = advBigEndian(p, 13, 2)
        let battery = power >> 5
        let tx = power & 0x1F
        r.append("battery_voltage_v", battery == 2047 ? .null : .double(Double(battery + 1600) / 1000))
        r.append("tx_power_dbm", tx == 31 ? .null : .int(Int64(tx) * 2 - 40))
        r.append("movement_counter", p[15] == 0xFF ? .null : .int(Int64(p[15])))
        let sequence = advBigEndian(p, 16, 2)
        r.append("measurement_sequence", sequence == 0xFFFF ? .null : .int(Int64(sequence)))
        let mac = AdvertisementMAC(p, at: 18, reversed: false)
        r.append("mac", mac.isAllOnes ? .null : .string(mac.string))
        return r
    }
}

/// Apple iBeacon, manufacturer data of company 0x004C: `02 15 | UUID (16) | major BE | minor BE | power sint8`.
/// Any other Apple payload (Nearby 0x10, ...) is rejected as not an iBeacon.
public struct IBeaconParser: AdvertisementParser {
    /// Where this format is found: manufacturer data of company 0x004C.
    public let sources: [AdvertisementSource] = [.manufacturer(0x004C)]
    /// `ibeacon`: the parser name in logs and on the command line.
    public let name = "ibeacon"

    /// `ibeacon_uuid`, `major`, `minor`, `tx_power_dbm` (the calibrated power at 1 m).
    public var fields: [GATTFieldDescriptor] {
        [
            .text("ibeacon_uuid"), .plain("major"), .plain("minor"),
            .measurement("tx_power_dbm", "dBm", "signal_strength"),
        ]
    }

    /// Creates the parser. It holds no state.
    public init() {}

    /// Decodes one payload; throws a `GATTParseError` naming the format when it must be rejected.
    public func decode(_ p: [UInt8], from source: AdvertisementSource, context: AdvertisementContext)
        throws(GATTParseError) -> GATTReading
    {
        guard let type = p.first else { throw .invalidLength(expected: "iBeacon: 23 octets", actual: 0) }
        guard type == 0x02 else {
            throw .unsupported(
                "Apple type 0x\(hex(UInt64(type), 2).uppercased()) at offset 0 is not an iBeacon (0x02)")
        }
        guard p.count >= 23 else { throw .invalidLength(expected: "iBeacon: 23 octets", actual: p.count) }
        guard p[1] == 0x15 else {
            throw .invalidValue(
                field: "iBeacon length", offset: 1, reason: "0x\(hex(UInt64(p[1]), 2).uppercased()), expected 0x15")
        }
        var r = GATTReading(capacity: 4)
        let h = hexString(p[2..<18])
        let u = Array(h.utf8)
        let uuid =
            String(decoding: u[0..<8], as: UTF8.self) + "-" + String(decoding: u[8..<12], as: UTF8.self) + "-"
            + String(decoding: u[12..<16], as: UTF8.self) + "-" + String(decoding: u[16..<20], as: UTF8.self) + "-"
            + String(decoding: u[20..<32], as: UTF8.self)
        r.append("ibeacon_uuid", .string(uuid))
        r.append("major", .int(Int64(advBigEndian(p, 18, 2))))
        r.append("minor", .int(Int64(advBigEndian(p, 20, 2))))
        r.append("tx_power_dbm", .int(Int64(Int8(bitPattern: p[22]))))
        return r
    }
}

/// Eddystone, service data 0xFEAA (UID, URL, TLM, EID), big-endian (SPEC.md §4.6).
public struct EddystoneParser: AdvertisementParser {
    /// Where this format is found: service data UUID 0xFEAA.
    public let sources: [AdvertisementSource] = [.serviceData(BluetoothUUID(UInt16(0xFEAA)))]
    /// `eddystone`: the parser name in logs and on the command line.
    public let name = "eddystone"

    /// Every frame type's fields (UID, URL, TLM, EID); `frame_type` says which a payload carried.
    public var fields: [GATTFieldDescriptor] {
        [
            .text("frame_type"), .measurement("tx_power_dbm", "dBm", "signal_strength"), .text("namespace"),
            .text("instance"), .text("url"), .measurement("battery_voltage_v", "V", "voltage"),
            .measurement("temperature_c", "°C", "temperature"), .increasing("adv_count", nil),
            .increasing("uptime_s", "s", "duration"), .text("eid"),
        ]
    }

    /// Creates the parser. It holds no state.
    public init() {}

    static let schemes = ["http://www.", "https://www.", "http://", "https://"]
    static let expansions = [
        ".com/", ".org/", ".edu/", ".net/", ".info/", ".biz/", ".gov/", ".com", ".org", ".edu", ".net", ".info",
        ".biz", ".gov",
    ]

    /// Decodes one payload; throws a `GATTParseError` naming the format when it must be rejected.
    public func decode(_ p: [UInt8], from source: AdvertisementSource, context: AdvertisementContext)
        throws(GATTParseError) -> GATTReading
    {
        guard let frame = p.first else { throw .invalidLength(expected: "Eddystone: a frame type octet", actual: 0) }
        var r = GATTReading(capacity: 5)
        switch frame {
        case 0x00:
            guard p.count == 18 || p.count == 20 else {
                throw .invalidLength(expected: "Eddystone UID: 18 (or 20) octets", actual: p.count)
            }
            r.append("frame_type", .string("uid"))
            r.append("tx_power_dbm", .int(Int64(Int8(bitPattern: p[1]))))
            r.append("namespace", .string(hexString(p[2..<12])))
            r.append("instance", .string(hexString(p[12..<18])))
        case 0x10:
            guard p.count >= 3 else {
                throw .invalidLength(expected: "Eddystone URL: at least 3 octets", actual: p.count)
            }
            guard Int(p[2]) < Self.schemes.count else {
                throw .invalidValue(
                    field: "Eddystone URL scheme", offset: 2,
                    reason: "0x\(hex(UInt64(p[2]), 2).uppercased()) is reserved")
            }
            var url = Self.schemes[Int(p[2])]
            for k in 3..<p.count {
                let c = p[k]
                if Int(c) < Self.expansions.count {
                    url += Self.expansions[Int(c)]
                } else if c > 0x20 && c < 0x7F {
                    url.unicodeScalars.append(Unicode.Scalar(c))
                } else {
                    throw .invalidValue(
                        field: "Eddystone URL", offset: k, reason: "0x\(hex(UInt64(c), 2).uppercased()) is reserved")
                }
            }
            r.append("frame_type", .string("url"))
            r.append("tx_power_dbm", .int(Int64(Int8(bitPattern: p[1]))))
            r.append("url", .string(url))
        case 0x20:
            guard p.count >= 2 else { throw .invalidLength(expected: "Eddystone TLM: 14 octets", actual: p.count) }
            guard p[1] == 0x00 else {
                throw .unsupported(
                    "Eddystone TLM version \(p[1]) at offset 1 (0x01 is encrypted TLM, which needs the beacon's EIK)")
            }
            guard p.count == 14 else { throw .invalidLength(expected: "Eddystone TLM: 14 octets", actual: p.count) }
            let mV = advBigEndian(p, 2, 2)
            let temp = advBigEndian(p, 4, 2)
            r.append("frame_type", .string("tlm"))
            r.append("battery_voltage_v", mV == 0 ? .null : .double(Double(mV) / 1000))
            r.append(
                "temperature_c", temp == 0x8000 ? .null : .double(Double(Int16(truncatingIfNeeded: temp)) / 256))
            r.append("adv_count", .int(Int64(advBigEndian(p, 6, 4))))
            r.append("uptime_s", .double(Double(advBigEndian(p, 10, 4)) / 10))
        case 0x30:
            guard p.count == 10 else { throw .invalidLength(expected: "Eddystone EID: 10 octets", actual: p.count) }
            r.append("frame_type", .string("eid"))
            r.append("tx_power_dbm", .int(Int64(Int8(bitPattern: p[1]))))
            r.append("eid", .string(hexString(p[2..<10])))
        default:
            throw .unsupported("Eddystone frame type 0x\(hex(UInt64(frame), 2).uppercased()) at offset 0")
        }
        return r
    }
}

/// Govee H5072/H5075, manufacturer data of company 0xEC88: `00 | v uint24 BE | battery | 00` (SPEC.md §4.7).
/// Bit 23 of v is the sign; battery bit 7 flags a sensor error. Out-of-range readings (govee-ble: outside
/// −40..100 °C, or the error bit) publish `null` temperature and humidity.
public struct GoveeH5075Parser: AdvertisementParser {
    /// Where this format is found: manufacturer data of company 0xEC88.
    public let sources: [AdvertisementSource] = [.manufacturer(0xEC88)]
    /// `govee_h5075`: the parser name in logs and on the command line.
    public let name = "govee_h5075"

    /// `temperature_c`, `humidity_pct`, `battery_pct`.
    public var fields: [GATTFieldDescriptor] {
        [
            .measurement("temperature_c", "°C", "temperature"), .measurement("humidity_pct", "%", "humidity"),
            .measurement("battery_pct", "%", "battery"),
        ]
    }

    /// Creates the parser. It holds no state.
    public init() {}

    /// Decodes one payload; throws a `GATTParseError` naming the format when it must be rejected.
    public func decode(_ p: [UInt8], from source: AdvertisementSource, context: AdvertisementContext)
        throws(GATTParseError) -> GATTReading
    {
        guard p.count == 6 else {
            throw .invalidLength(expected: "Govee H5072/H5075: 6 octets", actual: p.count)
        }
        let v = advBigEndian(p, 1, 3)
        let magnitude = v & 0x7F_FFFF
        let negative = v & 0x80_0000 != 0
        let tenths = Int64(magnitude / 1000)
        let temperature = Double(negative ? -tenths : tenths) / 10
        let humidity = Double(magnitude % 1000) / 10
        let error = p[4] & 0x80 != 0
        var r = GATTReading(capacity: 3)
        if error || temperature < -40 || temperature > 100 {
            r.append("temperature_c", .null)
            r.append("humidity_pct", .null)
        } else {
            r.append("temperature_c", .double(temperature))
            r.append("humidity_pct", .double(humidity))
        }
        r.append("battery_pct", .int(Int64(p[4] & 0x7F)))
        return r
    }
}
