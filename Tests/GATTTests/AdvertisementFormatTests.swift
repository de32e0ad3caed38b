// Behaviour of each advertisement format beyond the shared vectors: SPEC.md §4/§5 policies, encoders, errors.
import Foundation
import GATT
import GATTCrypto
import Testing

private func hx(_ s: String) -> [UInt8] { bytesFromHex(s) ?? [] }
private let bthome = AdvertisementSource.serviceData(BluetoothUUID(UInt16(0xFCD2)))
private let atc = AdvertisementSource.serviceData(BluetoothUUID(UInt16(0x181A)))
private let mibeacon = AdvertisementSource.serviceData(BluetoothUUID(UInt16(0xFE95)))
private let eddystone = AdvertisementSource.serviceData(BluetoothUUID(UInt16(0xFEAA)))

private func decode(_ source: AdvertisementSource, _ hex: String, _ context: AdvertisementContext = .init())
    throws(GATTParseError) -> GATTReading
{
    var registry = GATTParserRegistry()
    for parser in BuiltInAdvertisementParsers.all { try? registry.register(parser) }
    return try registry.decode(source, hx(hex), context: context)
}

private func thrown(_ body: () throws(GATTParseError) -> GATTReading) -> GATTParseError? {
    do {
        _ = try body()
        return nil
    } catch {
        return error
    }
}

@Suite struct BTHomeTests {
    let key = hx("231d39c1d7cc1ab1aee224cd096db932")
    let mac = "54:48:E6:8F:80:A5"

    @Test func registryRejectsDuplicateSources() throws {
        var registry = GATTParserRegistry()
        for parser in BuiltInAdvertisementParsers.all { try registry.register(parser) }
        #expect(throws: GATTRegistryError.self) { try registry.register(BTHomeV2Parser()) }
    }

    @Test func repeatedObjectsGetSuffixes() throws {
        // Two temperatures (0x02 and 0x45 share the field name), one humidity, two binary "door" objects.
        let r = try decode(bthome, "4002CA0903BF13451101 1A01 1A00".replacingOccurrences(of: " ", with: ""))
        #expect(r.fields.map(\.name) == ["temperature_c_1", "humidity_pct", "temperature_c_2", "door_1", "door_2"])
        #expect(r["temperature_c_1"] == .double(25.06))
        #expect(r["temperature_c_2"] == .double(27.3))
        #expect(r["door_1"] == .bool(true))
        #expect(r["door_2"] == .bool(false))
    }

    @Test func truncatedObjectKeepsEarlierOnes() throws {
        let r = try decode(bthome, "4002CA0903BF")
        #expect(r.fields.map(\.name) == ["temperature_c"])
        // Nothing complete at all: rejected, naming the object and the offset.
        let error = thrown { () throws(GATTParseError) in try decode(bthome, "4002CA") }
        #expect(
            error
                == .invalidValue(
                    field: "BTHome v2 object 0x02", offset: 1, reason: "truncated: needs 2 octet(s), 1 available"))
    }

    @Test func unknownObjectEndsParsing() throws {
        let r = try decode(bthome, "4002CA09FE0103BF13")
        #expect(r.fields.map(\.name) == ["temperature_c"])
        let error = thrown { () throws(GATTParseError) in try decode(bthome, "40FECA09") }
        guard case .invalidValue(_, let offset, let reason)? = error else {
            Issue.record("expected invalidValue, got \(String(describing: error))")
            return
        }
        #expect(offset == 1)
        #expect(reason.contains("0xFE"))
    }

    @Test func headerChecks() {
        #expect(thrown { () throws(GATTParseError) in try decode(bthome, "") } != nil)
        #expect(thrown { () throws(GATTParseError) in try decode(bthome, "40") } != nil)  // no objects
        #expect(thrown { () throws(GATTParseError) in try decode(bthome, "2002CA09") } != nil)  // version 1
        #expect(thrown { () throws(GATTParseError) in try decode(bthome, "42A5808F") } != nil)  // short MAC
    }

    @Test func textRawTimestampFirmwareAndEvents() throws {
        // 0x50 timestamp 1700000000, 0x53 "hi", 0x54 raw 01ff, 0x3A double press, 0x3C rotate right 3, 0xF1 1.2.3.4
        let r = try decode(
            bthome, "40 3A02 3C0203 5000F15365 53026869 540201FF F104030201".replacingOccurrences(of: " ", with: ""))
        #expect(r["button_event"] == .string("double_press"))
        #expect(r["dimmer_event"] == .string("rotate_right"))
        #expect(r["dimmer_steps"] == .int(3))
        #expect(r["timestamp"] == .string("2023-11-14T22:13:20"))
        #expect(r["text"] == .string("hi"))
        #expect(r["raw_data"] == .string("01ff"))
        #expect(r["firmware_version"] == .string("1.2.3.4"))
    }

    @Test func timestampsRoundTrip() throws {
        let cases: [(UInt32, String)] = [
            (0, "1970-01-01T00:00:00"), (951_782_400, "2000-02-29T00:00:00"), (1_700_000_000, "2023-11-14T22:13:20"),
            (4_102_444_799, "2099-12-31T23:59:59"), (UInt32.max, "2106-02-07T06:28:15"),
        ]
        for (seconds, text) in cases {
            let payload = try BTHomeEncoder.encode([BTHomeObject(id: 0x50, .int(Int64(seconds)))])
            #expect(try decode(bthome, hexString(payload))["timestamp"] == .string(text))
            #expect(try BTHomeEncoder.encode([BTHomeObject(id: 0x50, .string(text))]) == payload)
        }
        #expect(throws: GATTParseError.self) {
            try BTHomeEncoder.encode([BTHomeObject(id: 0x50, .string("2023-13-01T00:00:00"))])
        }
    }

    @Test func signedAndScaledObjects() throws {
        let r = try decode(bthome, "40 58F0 57F6 5C0000FFFF 62FFFFFFFF".replacingOccurrences(of: " ", with: ""))
        #expect(r["temperature_c_1"] == .double(-5.6))  // -16 × 0.35
        #expect(r["temperature_c_2"] == .double(-10))
        #expect(r["power_w"] == .double(-655.36))
        #expect(r["speed_m_s"] == .double(-0.000001))
    }

    /// The encoder reproduces the shared `bthome_encrypted` vector byte for byte (same key, MAC and counter).
    @Test func encryptedEncoderMatchesVector() throws {
        let payload = try BTHomeEncoder.encodeEncrypted(
            [.temperature(25.06), .humidity(50.55)], key: key, mac: mac, counter: 0x3322_1100, cipher: OpenSSLAESCCM())
        #expect(hexString(payload) == "41a47266c95f730011223378237214")
        let withMAC = try BTHomeEncoder.encodeEncrypted(
            [.temperature(25.06), .humidity(50.55)], key: key, mac: mac, counter: 0x3322_1100, cipher: OpenSSLAESCCM(),
            includeMAC: true)
        #expect(hexString(withMAC) == "43a5808fe64854f196c06ffb4900112233f08ecbde")
    }

    @Test func encryptedRoundTripAndFailures() throws {
        let payload = try BTHomeEncoder.encodeEncrypted(
            [.packetID(9), .battery(77), .temperature(-12.5)], key: key, mac: mac, counter: 42, cipher: OpenSSLAESCCM(),
            triggerBased: true)
        let context = AdvertisementContext(mac: mac, bindKey: key, cipher: OpenSSLAESCCM())
        let r = try decode(bthome, hexString(payload), context)
        #expect(
            r
                == GATTReading([
                    .init("packet_id", .int(9)), .init("battery_pct", .int(77)), .init("temperature_c", .double(-12.5)),
                ]))

        var wrongKey = key
        wrongKey[5] ^= 0x80
        #expect(
            thrown { () throws(GATTParseError) in
                try decode(
                    bthome, hexString(payload),
                    AdvertisementContext(mac: mac, bindKey: wrongKey, cipher: OpenSSLAESCCM()))
            } == .decryptionFailed("BTHome v2: MIC mismatch (wrong bind key?)"))
        // The nonce holds the advertiser address: another address fails the MIC too.
        #expect(
            thrown { () throws(GATTParseError) in
                try decode(
                    bthome, hexString(payload),
                    AdvertisementContext(mac: "54:48:E6:8F:80:A6", bindKey: key, cipher: OpenSSLAESCCM()))
            } == .decryptionFailed("BTHome v2: MIC mismatch (wrong bind key?)"))
        // No key, no address, no cipher, bad key size: clear errors.
        for context in [
            AdvertisementContext(mac: mac, cipher: OpenSSLAESCCM()),
            AdvertisementContext(bindKey: key, cipher: OpenSSLAESCCM()),
            AdvertisementContext(mac: mac, bindKey: key),
            AdvertisementContext(mac: mac, bindKey: Array(key.prefix(12)), cipher: OpenSSLAESCCM()),
        ] {
            let error = thrown { () throws(GATTParseError) in try decode(bthome, hexString(payload), context) }
            guard case .decryptionFailed(let reason)? = error else {
                Issue.record("expected decryptionFailed, got \(String(describing: error))")
                continue
            }
            #expect(reason.hasPrefix("BTHome v2: "))
        }
        // A plaintext packet from a device with a bind key is a downgrade: rejected.
        #expect(thrown { () throws(GATTParseError) in try decode(bthome, "4002CA09", context) } != nil)
    }

    /// Every object id in the table round-trips through the encoder and the decoder.
    @Test func everyObjectRoundTrips() throws {
        let samples: [UInt8: GATTValue] = [
            0x3A: .string("long_press"), 0x3C: .array([.string("rotate_left"), .int(4)]), 0x50: .int(1_700_000_000),
            0x53: .string("héllo"), 0x54: .string("00ff10"), 0xF1: .string("1.2.3.4"), 0xF2: .string("4.5.6"),
        ]
        var ids: [UInt8] = [0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x0E]
        ids += Array(0x0F...0x2F) + Array(0x3A...0x65) + [0xF0, 0xF1, 0xF2]
        for id in ids {
            let value = samples[id] ?? .int(1)
            let payload = try BTHomeEncoder.encode([BTHomeObject(id: id, value)])
            let r = try decode(bthome, hexString(payload))
            #expect(!r.fields.isEmpty, "object 0x\(String(id, radix: 16))")
            let reencoded = try BTHomeEncoder.encode(r)
            #expect(try decode(bthome, hexString(reencoded)) == r, "object 0x\(String(id, radix: 16))")
        }
    }

    @Test func readingEncoderRoundTripsWithMAC() throws {
        let reading = GATTReading([
            .init("mac", .string("A4:C1:38:8D:18:B2")), .init("battery_pct", .int(93)),
            .init("temperature_c", .double(21.37)), .init("humidity_pct", .double(40.5)),
            .init("pressure_pa", .int(101_325)), .init("co2_ppm", .int(612)), .init("motion", .bool(true)),
            .init("count", .int(123_456)),
        ])
        let payload = try BTHomeEncoder.encode(reading)
        #expect(payload[0] == 0x42)
        #expect(try decode(bthome, hexString(payload)) == reading)
    }

    @Test func encoderRejectsBadValues() {
        #expect(throws: GATTParseError.self) { try BTHomeEncoder.encode([.temperature(400)]) }
        #expect(throws: GATTParseError.self) { try BTHomeEncoder.encode([.humidity(-1)]) }
        #expect(throws: GATTParseError.self) { try BTHomeEncoder.encode([BTHomeObject(id: 0xFE, .int(1))]) }
        #expect(throws: GATTParseError.self) { try BTHomeEncoder.encode([BTHomeObject(id: 0x02, .string("x"))]) }
        #expect(throws: GATTParseError.self) { try BTHomeEncoder.encode([.temperature(.nan)]) }
        #expect(throws: GATTParseError.self) {
            try BTHomeEncoder.encode(GATTReading([.init("no_such_field", .int(1))]))
        }
    }
}

@Suite struct ATCAndMiBeaconTests {
    let key = hx("b9ea895fac7eea6d30532432a516f3a3")
    let mac = "A4:C1:38:8D:18:B2"

    @Test func macMismatchIsRejected() {
        let error = thrown { () throws(GATTParseError) in
            try decode(atc, "A4C1388D18B201122F640CA025", AdvertisementContext(mac: "A4:C1:38:8D:18:B3"))
        }
        guard case .invalidValue(let field, 0, _)? = error else {
            Issue.record("expected invalidValue at offset 0, got \(String(describing: error))")
            return
        }
        #expect(field == "ATC1441 MAC")
        // Without an advertiser address (macOS), the payload MAC is taken as is.
        #expect((try? decode(atc, "A4C1388D18B201122F640CA025")) != nil)
    }

    /// Encrypted pvvx and atc1441 frames built with the cipher decode back, and need key and address.
    @Test func encryptedFramesRoundTrip() throws {
        let cipher = OpenSSLAESCCM()
        let reversedMAC = hx("B2188D38C1A4")
        // pvvx: temp 23.45, hum 41.73, battery 61, trigger 1; counter 0x11.
        let pvvxPlain = hx("29094D103D01")
        let pvvxNonce = reversedMAC + [14, 0x16, 0x1A, 0x18, 0x11]
        let pvvx = try cipher.encrypt(key: key, nonce: pvvxNonce, plaintext: pvvxPlain, aad: [0x11], tagLength: 4)
        let pvvxFrame = [0x11] + pvvx.ciphertext + pvvx.tag
        let context = AdvertisementContext(mac: mac, bindKey: key, cipher: cipher)
        let r = try decode(atc, hexString(pvvxFrame), context)
        #expect(r["temperature_c"] == .double(23.45))
        #expect(r["humidity_pct"] == .double(41.73))
        #expect(r["battery_pct"] == .int(61))
        #expect(r["flags"] == .int(1))
        #expect(r["packet_counter"] == .int(0x11))

        // atc1441: temp (b0/2 − 40) 26.5 → 133, hum 47.0 → 94, battery 100 with trigger bit; counter 0x58.
        let atcNonce = reversedMAC + [11, 0x16, 0x1A, 0x18, 0x58]
        let sealed = try cipher.encrypt(
            key: key, nonce: atcNonce, plaintext: [133, 94, 0xE4], aad: [0x11], tagLength: 4)
        let atcFrame = [0x58] + sealed.ciphertext + sealed.tag
        let a = try decode(atc, hexString(atcFrame), context)
        #expect(a["temperature_c"] == .double(26.5))
        #expect(a["humidity_pct"] == .double(47))
        #expect(a["battery_pct"] == .int(100))  // 0x64, capped at 100
        #expect(a["flags"] == .int(1))

        for bad in [
            AdvertisementContext(bindKey: key, cipher: cipher),  // no address: no nonce
            AdvertisementContext(mac: mac, cipher: cipher),  // no key
            AdvertisementContext(mac: "A4:C1:38:8D:18:B3", bindKey: key, cipher: cipher),  // other device
        ] {
            guard
                case .decryptionFailed(let reason)? = thrown({ () throws(GATTParseError) in
                    try decode(atc, hexString(atcFrame), bad)
                })
            else {
                Issue.record("expected decryptionFailed")
                continue
            }
            #expect(reason.hasPrefix("ATC1441 encrypted: "))
        }
    }

    @Test func miBeaconMissingKeyAndMAC() {
        let frame = "5858480B685F12342D585A0B1841E2AA000E00A4964FB5"
        guard
            case .decryptionFailed(let reason)? = thrown({ () throws(GATTParseError) in
                try decode(mibeacon, frame, AdvertisementContext(mac: "5A:58:2D:34:12:5F", cipher: OpenSSLAESCCM()))
            })
        else {
            Issue.record("expected decryptionFailed")
            return
        }
        #expect(reason.contains("no bind key"))
        // The frame carries its MAC; a different advertiser address is rejected.
        #expect(
            thrown { () throws(GATTParseError) in
                try decode(mibeacon, frame, AdvertisementContext(mac: "5A:58:2D:34:12:50"))
            } != nil)
        // Mesh frames and version 1 are unsupported.
        #expect(thrown { () throws(GATTParseError) in try decode(mibeacon, "D0200000010D1004C400") } != nil)
        #expect(thrown { () throws(GATTParseError) in try decode(mibeacon, "50100000010D1004C400") } != nil)
    }

    @Test func miBeaconPlainObjects() throws {
        // v3, no MAC: illuminance (0x1007), moisture (0x1008), conductivity (0x1009), an unknown object, battery.
        let r = try decode(
            mibeacon,
            "40300000 07 0710 03 102700 0810 01 2A 0910 02 F401 9999 01 00 0A10 01 50".replacingOccurrences(
                of: " ", with: ""))
        #expect(r["frame_version"] == .int(3))
        #expect(r["illuminance_lx"] == .int(10000))
        #expect(r["moisture_pct"] == .int(42))
        #expect(r["conductivity_us_cm"] == .int(500))
        #expect(r["battery_pct"] == .int(80))
        #expect(r["mac"] == nil)
    }

    /// Legacy v2/v3 encryption: a 12-octet key expanded with 8D 3D 3C 97, nonce from the frame start, the
    /// extended counter and the reversed MAC; no MIC, so a wrong key shows as objects that do not parse.
    @Test func miBeaconLegacyEncrypted() throws {
        let cipher = OpenSSLAESCCM()
        let key12 = hx("e9ea895fac7cca6d30532432")
        let key16 = Array(key12[0..<6]) + [0x8D, 0x3D, 0x3C, 0x97] + Array(key12[6...])
        let macText = "A4:C1:38:02:83:F4"
        let header = hx("5830 5B05 50 F4830238C1A4".replacingOccurrences(of: " ", with: ""))  // v3, encrypted, MAC
        let extCounter = hx("010203")
        let nonce = Array(header[0..<5]) + extCounter + hx("F4830238C1")
        // Humidity 46.7 and battery 95.
        let objects = hx("0610 02 D301 0A10 01 5F".replacingOccurrences(of: " ", with: ""))
        let sealed = try cipher.encrypt(key: key16, nonce: nonce, plaintext: objects, aad: [0x11], tagLength: 4)
        let frame = header + sealed.ciphertext + extCounter + [sealed.tag[0]]
        let context = AdvertisementContext(mac: macText, bindKey: key12, cipher: cipher)
        let r = try decode(mibeacon, hexString(frame), context)
        #expect(r["frame_version"] == .int(3))
        #expect(r["humidity_pct"] == .double(46.7))
        #expect(r["battery_pct"] == .int(95))
        #expect(r["mac"] == .string(macText))
        var wrong = key12
        wrong[0] ^= 0x55
        guard
            case .decryptionFailed(let reason)? = thrown({ () throws(GATTParseError) in
                try decode(
                    mibeacon, hexString(frame), AdvertisementContext(mac: macText, bindKey: wrong, cipher: cipher))
            })
        else {
            Issue.record("expected decryptionFailed for a wrong legacy key")
            return
        }
        #expect(reason.hasPrefix("Xiaomi MiBeacon v3: "))
    }
}

@Suite struct BeaconFormatTests {
    @Test func eddystoneURL() throws {
        let r = try decode(eddystone, "10EB03676F6F676C6507")  // https:// google .com
        #expect(r["frame_type"] == .string("url"))
        #expect(r["tx_power_dbm"] == .int(-21))
        #expect(r["url"] == .string("https://google.com"))
        #expect(thrown { () throws(GATTParseError) in try decode(eddystone, "10EB04676F") } != nil)  // scheme 4
        #expect(thrown { () throws(GATTParseError) in try decode(eddystone, "10EB01FF") } != nil)  // reserved char
    }

    @Test func eddystoneTLMSentinelsAndOtherFrames() throws {
        let r = try decode(eddystone, "20000000800000000001000000FF")
        #expect(r["battery_voltage_v"] == .null)
        #expect(r["temperature_c"] == .null)
        #expect(r["uptime_s"] == .double(25.5))
        // Encrypted TLM (version 1) needs the beacon's EIK.
        #expect(thrown { () throws(GATTParseError) in try decode(eddystone, "20010000800000000001000000FF") } != nil)
        #expect(thrown { () throws(GATTParseError) in try decode(eddystone, "40000000") } != nil)
        #expect(
            try decode(eddystone, "00E3123456789012346789010000000000010000")["namespace"]
                == .string("12345678901234678901"))
    }

    @Test func ruuviSentinelsAndOtherFormats() throws {
        #expect(
            thrown { () throws(GATTParseError) in try decode(.manufacturer(0x0499), "03291A1ECE1EFC18F94202CA0B53") }
                != nil)
        let r = try decode(.manufacturer(0x0499), "0512FC5394C37C0004FFFC040CAC364200CDCBB8334C884F")
        #expect(r["temperature_c"] == .double(24.3))
        #expect(r["pressure_pa"] == .int(100_044))
        #expect(r["battery_voltage_v"] == .double(2.977))
        #expect(r["tx_power_dbm"] == .int(4))
    }

    @Test func goveeErrorBitAndRange() throws {
        let r = try decode(.manufacturer(0xEC88), "000341C2E400")  // error bit set on battery octet
        #expect(r["temperature_c"] == .null)
        #expect(r["humidity_pct"] == .null)
        #expect(r["battery_pct"] == .int(100))
        let hot = try decode(.manufacturer(0xEC88), "000F42406400")  // 1000000 → 100.0 °C, in range
        #expect(hot["temperature_c"] == .double(100))
        let tooHot = try decode(.manufacturer(0xEC88), "001312D06400")  // 1250000 → 125.0 °C
        #expect(tooHot["temperature_c"] == .null)
        #expect(thrown { () throws(GATTParseError) in try decode(.manufacturer(0xEC88), "000341C26400FF") } != nil)
    }

    @Test func iBeaconAcceptsTrailingOctetsButChecksLength() throws {
        let base = "02154142434445464748494041424344454600010002F8"
        #expect(try decode(.manufacturer(0x004C), base + "00")["minor"] == .int(2))
        #expect(
            thrown { () throws(GATTParseError) in try decode(.manufacturer(0x004C), "0214" + base.dropFirst(4)) } != nil
        )
    }

    @Test func unknownSourcePassesThroughAsRaw() throws {
        let r = try decode(.manufacturer(0x1234), "0102")
        #expect(r == GATTReading.raw([1, 2]))
    }
}
