// Xiaomi-sensor formats: ATC1441/pvvx custom firmware (0x181A) and Xiaomi MiBeacon (0xFE95) (SPEC.md §4.3, §4.4).

/// ATC1441 and pvvx custom-firmware service data (UUID 0x181A), chosen by length: 13 atc1441, 15 pvvx custom,
/// 11 pvvx encrypted, 8 atc1441 encrypted. A MAC inside the payload must match the advertiser address when that
/// is known (atc-ble drops the packet otherwise). The encrypted forms need the advertiser address and a bind key.
public struct ATCParser: AdvertisementParser {
    /// Where this format is found: service data UUID 0x181A.
    public let sources: [AdvertisementSource] = [.serviceData(BluetoothUUID(UInt16(0x181A)))]
    /// `atc_pvvx`: the parser name in logs and on the command line.
    public let name = "atc_pvvx"

    /// Every layout's fields; the encrypted ones carry no `mac` and no `battery_voltage_v`.
    public var fields: [GATTFieldDescriptor] {
        [
            .text("mac"), .measurement("temperature_c", "°C", "temperature"),
            .measurement("humidity_pct", "%", "humidity"), .measurement("battery_pct", "%", "battery"),
            .measurement("battery_voltage_v", "V", "voltage"), .plain("packet_counter"), .plain("flags"),
        ]
    }

    /// Creates the parser. It holds no state.
    public init() {}

    /// Decodes one payload; throws a `GATTParseError` naming the format when it must be rejected.
    public func decode(_ p: [UInt8], from source: AdvertisementSource, context: AdvertisementContext)
        throws(GATTParseError) -> GATTReading
    {
        var r = GATTReading(capacity: 7)
        switch p.count {
        case 13:
            let mac = try checkedMAC(p, reversed: false, context: context, format: "ATC1441")
            r.append("mac", .string(mac.string))
            r.append("temperature_c", .double(Double(Int16(truncatingIfNeeded: advBigEndian(p, 6, 2))) / 10))
            r.append("humidity_pct", .int(Int64(p[8])))
            r.append("battery_pct", .int(Int64(p[9])))
            r.append("battery_voltage_v", .double(Double(advBigEndian(p, 10, 2)) / 1000))
            r.append("packet_counter", .int(Int64(p[12])))
        case 15:
            let mac = try checkedMAC(p, reversed: true, context: context, format: "ATC pvvx custom")
            r.append("mac", .string(mac.string))
            r.append("temperature_c", .double(Double(Int16(truncatingIfNeeded: le(p, 6, 2))) / 100))
            r.append("humidity_pct", .double(Double(le(p, 8, 2)) / 100))
            r.append("battery_voltage_v", .double(Double(le(p, 10, 2)) / 1000))
            r.append("battery_pct", .int(Int64(p[12])))
            r.append("packet_counter", .int(Int64(p[13])))
            r.append("flags", .int(Int64(p[14])))
        case 11:
            let plain = try decrypt(p, context: context, format: "ATC pvvx encrypted")
            r.append("temperature_c", .double(Double(Int16(truncatingIfNeeded: le(plain, 0, 2))) / 100))
            r.append("humidity_pct", .double(Double(le(plain, 2, 2)) / 100))
            r.append("battery_pct", .int(Int64(plain[4])))
            r.append("packet_counter", .int(Int64(p[0])))
            r.append("flags", .int(Int64(plain[5])))
        case 8:
            let plain = try decrypt(p, context: context, format: "ATC1441 encrypted")
            r.append("temperature_c", .double(Double(plain[0]) / 2 - 40))
            r.append("humidity_pct", .double(Double(plain[1]) / 2))
            r.append("battery_pct", .int(Int64(min(plain[2] & 0x7F, 100))))
            r.append("packet_counter", .int(Int64(p[0])))
            r.append("flags", .int(Int64(plain[2] >> 7)))
        default:
            throw .invalidLength(
                expected:
                    "ATC/pvvx: 13 (atc1441), 15 (pvvx custom), 11 (pvvx encrypted) or 8 (atc1441 encrypted) octets",
                actual: p.count)
        }
        return r
    }

    private func le(_ b: [UInt8], _ offset: Int, _ length: Int) -> UInt64 {
        var v: UInt64 = 0
        for k in stride(from: length - 1, through: 0, by: -1) { v = v << 8 | UInt64(b[offset + k]) }
        return v
    }

    private func checkedMAC(_ p: [UInt8], reversed: Bool, context: AdvertisementContext, format: String)
        throws(GATTParseError) -> AdvertisementMAC
    {
        let mac = AdvertisementMAC(p, at: 0, reversed: reversed)
        if let advertiser = context.parsedMAC, advertiser != mac {
            throw .invalidValue(
                field: "\(format) MAC", offset: 0,
                reason: "\(mac.string) does not match the advertiser address \(advertiser.string)")
        }
        return mac
    }

    /// `counter | ciphertext | MIC (4)`; nonce = MAC reversed + (len+3) + `16 1A 18` + counter, AAD 0x11.
    private func decrypt(_ p: [UInt8], context: AdvertisementContext, format: String) throws(GATTParseError)
        -> [UInt8]
    {
        let (key, cipher) = try context.requireKey(format)
        let mac = try context.requireMAC(format)
        let nonce = mac.reversedArray + [UInt8(p.count + 3), 0x16, 0x1A, 0x18, p[0]]
        let plain: [UInt8]
        do {
            plain = try cipher.decrypt(
                key: key, nonce: nonce, ciphertext: Array(p[1..<(p.count - 4)]), tag: Array(p[(p.count - 4)...]),
                aad: [0x11])
        } catch {
            throw cipherFailure(error, format: format)
        }
        // The injected cipher is outside this module: never index past what it returned.
        guard plain.count == p.count - 5 else {
            throw .decryptionFailed("\(format): the cipher returned \(plain.count) octets, expected \(p.count - 5)")
        }
        return plain
    }
}

/// Xiaomi MiBeacon service data (UUID 0xFE95), frame versions 2 to 5: plain objects, v4/v5 AES-CCM with a
/// 16-octet bind key, and legacy v2/v3 encryption with a 12-octet key (SPEC.md §4.4).
///
/// Publishes `frame_version`, `product_id`, `frame_counter`, `mac` (when the frame carries it) and the decoded
/// objects. Unknown object ids are skipped (their length is known); a truncated object ends parsing.
public struct MiBeaconParser: AdvertisementParser {
    /// Where this format is found: service data UUID 0xFE95.
    public let sources: [AdvertisementSource] = [.serviceData(BluetoothUUID(UInt16(0xFE95)))]
    /// `xiaomi_mibeacon`: the parser name in logs and on the command line.
    public let name = "xiaomi_mibeacon"

    /// The frame header fields, `mac`, then every object the parser decodes.
    public var fields: [GATTFieldDescriptor] {
        [
            .plain("frame_version"), .plain("product_id"), .plain("frame_counter"), .text("mac"),
            .measurement("temperature_c", "°C", "temperature"), .measurement("humidity_pct", "%", "humidity"),
            .measurement("illuminance_lx", "lx", "illuminance"), .measurement("moisture_pct", "%", "moisture"),
            .measurement("conductivity_us_cm", "\(GATTHomeAssistant.microSign)S/cm", "conductivity"),
            .measurement("battery_pct", "%", "battery"),
        ]
    }

    /// Creates the parser. It holds no state.
    public init() {}

    /// Decodes one payload; throws a `GATTParseError` naming the format when it must be rejected.
    public func decode(_ p: [UInt8], from source: AdvertisementSource, context: AdvertisementContext)
        throws(GATTParseError) -> GATTReading
    {
        guard p.count >= 5 else {
            throw .invalidLength(
                expected: "Xiaomi MiBeacon: at least 5 octets (frame control, product, counter)", actual: p.count)
        }
        let fc = UInt16(p[0]) | UInt16(p[1]) << 8
        let version = Int(fc >> 12)
        let encrypted = fc & 0x0008 != 0
        guard fc & 0x0080 == 0 else {
            throw .unsupported("Xiaomi MiBeacon: mesh frames (frame control bit 7, offset 0) are not supported")
        }
        guard version >= 2 else {
            throw .unsupported("Xiaomi MiBeacon: frame version \(version) at offset 1 (versions 2 to 5 are supported)")
        }
        var r = GATTReading(capacity: 8)
        r.append("frame_version", .int(Int64(version)))
        let productID = UInt16(p[2]) | UInt16(p[3]) << 8
        r.append("product_id", .int(Int64(productID)))
        r.append("frame_counter", .int(Int64(p[4])))
        var i = 5
        var mac: AdvertisementMAC? = nil
        if fc & 0x0010 != 0 {
            guard p.count >= i + 6 else {
                throw .invalidValue(field: "Xiaomi MiBeacon MAC", offset: i, reason: "truncated: needs 6 octets")
            }
            let m = AdvertisementMAC(p, at: i, reversed: true)
            if let advertiser = context.parsedMAC, advertiser != m {
                throw .invalidValue(
                    field: "Xiaomi MiBeacon MAC", offset: i,
                    reason: "\(m.string) does not match the advertiser address \(advertiser.string)")
            }
            mac = m
            r.append("mac", .string(m.string))
            i += 6
        }
        if fc & 0x0020 != 0 {
            guard p.count > i else {
                throw .invalidValue(field: "Xiaomi MiBeacon capability", offset: i, reason: "truncated")
            }
            let capability = p[i]
            i += 1
            if capability & 0x20 != 0 {
                guard p.count > i else {
                    throw .invalidValue(field: "Xiaomi MiBeacon I/O capability", offset: i, reason: "truncated")
                }
                i += 1
            }
        }
        guard fc & 0x0040 != 0 else { return r }

        if !encrypted {
            guard p.count >= i + 3 else {
                throw .invalidValue(
                    field: "Xiaomi MiBeacon objects", offset: i, reason: "object flag set but no object follows")
            }
            try Self.decodeObjects(p, from: i, into: &r, strict: false)
            return r
        }
        let format = "Xiaomi MiBeacon v\(version)"
        let address: AdvertisementMAC
        if let mac { address = mac } else { address = try context.requireMAC(format) }
        if version >= 4 {
            // objects | ext counter (3) | MIC (4)
            guard p.count >= i + 9 else {
                throw .invalidLength(
                    expected: "\(format) encrypted: objects (2+), ext counter (3), MIC (4) after offset \(i)",
                    actual: p.count)
            }
            let (key, cipher) = try context.requireKey(format)
            let n = p.count
            let nonce = address.reversedArray + Array(p[2..<5]) + Array(p[(n - 7)..<(n - 4)])
            let plain: [UInt8]
            do {
                plain = try cipher.decrypt(
                    key: key, nonce: nonce, ciphertext: Array(p[i..<(n - 7)]), tag: Array(p[(n - 4)...]), aad: [0x11])
            } catch {
                throw cipherFailure(error, format: format)
            }
            try Self.decodeObjects(plain, from: 0, into: &r, strict: false)
            return r
        }
        // Legacy v2/v3: objects | ext counter (3) | 1 octet; no usable MIC.
        guard p.count >= i + 7 else {
            throw .invalidLength(
                expected: "\(format) encrypted: objects (3+), ext counter (3), 1 octet", actual: p.count)
        }
        guard let key12 = context.bindKey else {
            throw .decryptionFailed(
                "\(format): the payload is encrypted and no bind key is configured (set the device's bindkey)")
        }
        let key: [UInt8]
        switch key12.count {
        case 12: key = Array(key12[0..<6]) + [0x8D, 0x3D, 0x3C, 0x97] + Array(key12[6...])
        case 16: key = key12
        default:
            throw .decryptionFailed("\(format): legacy bind key must be 12 octets (24 hex digits), got \(key12.count)")
        }
        guard let cipher = context.cipher as? any AESCCMKeystreamCipher else {
            throw .decryptionFailed("\(format): the configured cipher cannot decrypt legacy (MIC-less) frames")
        }
        let n = p.count
        let nonce = Array(p[0..<5]) + Array(p[(n - 4)..<(n - 1)]) + Array(address.reversedArray[0..<5])
        let plain: [UInt8]
        do {
            plain = try cipher.decryptUnauthenticated(key: key, nonce: nonce, ciphertext: Array(p[i..<(n - 4)]))
        } catch {
            throw cipherFailure(error, format: format)
        }
        do {
            try Self.decodeObjects(plain, from: 0, into: &r, strict: true)
        } catch {
            throw .decryptionFailed("\(format): decrypted objects do not parse (wrong bind key?): \(error)")
        }
        return r
    }

    /// Decodes `id uint16 LE | len uint8 | data` objects. `strict` (legacy decryption) rejects a truncated or
    /// mis-sized object, the only sign of a wrong key there.
    static func decodeObjects(_ b: [UInt8], from start: Int, into r: inout GATTReading, strict: Bool)
        throws(GATTParseError)
    {
        var i = start
        var decoded = 0
        while b.count >= i + 3 {
            let id = UInt16(b[i]) | UInt16(b[i + 1]) << 8
            let length = Int(b[i + 2])
            let data = i + 3
            guard b.count >= data + length else {
                if strict || decoded == 0 {
                    throw .invalidValue(
                        field: "Xiaomi MiBeacon object 0x\(hex(UInt64(id), 4).uppercased())", offset: i,
                        reason: "truncated: needs \(length) octet(s), \(b.count - data) available")
                }
                return
            }
            i = data + length
            func le(_ o: Int, _ n: Int) -> UInt64 {
                var v: UInt64 = 0
                for k in stride(from: n - 1, through: 0, by: -1) { v = v << 8 | UInt64(b[data + o + k]) }
                return v
            }
            var matched = true
            switch (id, length) {
            case (0x1004, 2): r.append("temperature_c", .double(Double(Int16(truncatingIfNeeded: le(0, 2))) / 10))
            case (0x1006, 2): r.append("humidity_pct", .double(Double(le(0, 2)) / 10))
            case (0x1007, 3): r.append("illuminance_lx", .int(Int64(le(0, 3))))
            case (0x1008, 1): r.append("moisture_pct", .int(Int64(b[data])))
            case (0x1009, 2): r.append("conductivity_us_cm", .int(Int64(le(0, 2))))
            case (0x100A, 1): r.append("battery_pct", .int(Int64(b[data])))
            case (0x100D, 4):
                r.append("temperature_c", .double(Double(Int16(truncatingIfNeeded: le(0, 2))) / 10))
                r.append("humidity_pct", .double(Double(le(2, 2)) / 10))
            case (0x1004, _), (0x1006, _), (0x1007, _), (0x1008, _), (0x1009, _), (0x100A, _), (0x100D, _):
                if strict {
                    throw .invalidValue(
                        field: "Xiaomi MiBeacon object 0x\(hex(UInt64(id), 4).uppercased())", offset: data - 3,
                        reason: "unexpected length \(length)")
                }
                matched = false
            default:
                matched = false
            }
            if matched { decoded += 1 }
        }
        if strict && decoded == 0 {
            throw .invalidValue(field: "Xiaomi MiBeacon objects", offset: start, reason: "no known object")
        }
    }
}
