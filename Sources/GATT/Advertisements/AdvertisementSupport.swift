// Helpers shared by the advertisement parsers: MAC addresses, bind keys, ciphers, field names, timestamps.

/// A cipher that can also run CCM's counter-mode keystream without checking a tag.
///
/// Legacy Xiaomi MiBeacon v2/v3 frames carry no usable MIC, so they can only be decrypted this way; wrong-key
/// detection then rests on whether the objects parse. `GATTCrypto.OpenSSLAESCCM` conforms.
public protocol AESCCMKeystreamCipher: AESCCMCipher {
    /// Applies the CCM payload keystream (counter blocks A1, A2, ... for `nonce`) to `ciphertext`.
    func decryptUnauthenticated(key: [UInt8], nonce: [UInt8], ciphertext: [UInt8])
        throws(GATTParseError) -> [UInt8]
}

/// A 6-octet Bluetooth device address in printed order (`A4:C1:38:00:11:22` → `A4 C1 38 00 11 22`).
struct AdvertisementMAC: Equatable, Sendable {
    var octets: (UInt8, UInt8, UInt8, UInt8, UInt8, UInt8)

    init(_ a: UInt8, _ b: UInt8, _ c: UInt8, _ d: UInt8, _ e: UInt8, _ f: UInt8) {
        octets = (a, b, c, d, e, f)
    }

    /// Reads 6 octets at `offset`, `reversed` when the payload stores them least significant first.
    init(_ bytes: [UInt8], at offset: Int, reversed: Bool) {
        if reversed {
            self.init(
                bytes[offset + 5], bytes[offset + 4], bytes[offset + 3], bytes[offset + 2], bytes[offset + 1],
                bytes[offset])
        } else {
            self.init(
                bytes[offset], bytes[offset + 1], bytes[offset + 2], bytes[offset + 3], bytes[offset + 4],
                bytes[offset + 5])
        }
    }

    /// Parses `AA:BB:CC:DD:EE:FF` (also with `-` or no separators, any case). Nil when invalid.
    init?(_ text: String) {
        guard let b = bytesFromHex(text), b.count == 6 else { return nil }
        self.init(b, at: 0, reversed: false)
    }

    var array: [UInt8] { [octets.0, octets.1, octets.2, octets.3, octets.4, octets.5] }
    var reversedArray: [UInt8] { [octets.5, octets.4, octets.3, octets.2, octets.1, octets.0] }

    /// Upper-case `AA:BB:CC:DD:EE:FF`, as BlueZ prints it (written straight into the string's storage).
    var string: String {
        let bytes = octets
        return String(unsafeUninitializedCapacity: 17) { out in
            withUnsafeBytes(of: bytes) { octet in
                for i in 0..<6 {
                    let b = octet[i]
                    if i > 0 { out[3 * i - 1] = UInt8(ascii: ":") }
                    out[3 * i] = Self.hexDigit(b >> 4)
                    out[3 * i + 1] = Self.hexDigit(b & 0x0F)
                }
            }
            return 17
        }
    }

    private static func hexDigit(_ nibble: UInt8) -> UInt8 {
        nibble < 10 ? UInt8(ascii: "0") + nibble : UInt8(ascii: "A") + nibble - 10
    }

    var isAllOnes: Bool { withUnsafeBytes(of: octets) { $0.allSatisfy { $0 == 0xFF } } }

    static func == (lhs: AdvertisementMAC, rhs: AdvertisementMAC) -> Bool { lhs.array == rhs.array }
}

extension AdvertisementContext {
    /// The advertiser address, or an error naming `format` when it is missing or malformed.
    func requireMAC(_ format: String) throws(GATTParseError) -> AdvertisementMAC {
        guard let text = mac else {
            throw .decryptionFailed("\(format): the advertiser address (MAC) is needed to build the nonce")
        }
        guard let mac = AdvertisementMAC(text) else {
            throw .decryptionFailed("\(format): advertiser address '\(text)' is not a MAC address")
        }
        return mac
    }

    /// The advertiser address when it is given and well-formed.
    var parsedMAC: AdvertisementMAC? { mac.flatMap { AdvertisementMAC($0) } }

    /// The bind key and cipher, or an error naming `format` and the `bindkey` setting.
    func requireKey(_ format: String, length: Int = 16) throws(GATTParseError) -> (
        key: [UInt8], cipher: any AESCCMCipher
    ) {
        guard let key = bindKey else {
            throw .decryptionFailed(
                "\(format): the payload is encrypted and no bind key is configured (set the device's bindkey)")
        }
        guard key.count == length else {
            throw .decryptionFailed(
                "\(format): bind key must be \(length) octets (\(length * 2) hex digits), got \(key.count)")
        }
        guard let cipher else {
            throw .decryptionFailed("\(format): no AES-CCM cipher available to decrypt the payload")
        }
        return (key, cipher)
    }
}

/// A cipher failure as a `decryptionFailed` naming the format; a tag mismatch suggests a wrong bind key.
func cipherFailure(_ error: GATTParseError, format: String) -> GATTParseError {
    switch error {
    case .decryptionFailed("MIC mismatch"): return .decryptionFailed("\(format): MIC mismatch (wrong bind key?)")
    case .decryptionFailed(let reason): return .decryptionFailed("\(format): \(reason)")
    default: return .decryptionFailed("\(format): \(error)")
    }
}

/// Rounds half away from zero without libm (GATT links no C library): nil when not finite or beyond ±2^62.
@inline(__always)
func advRounded(_ x: Double) -> Int64? {
    guard x.isFinite, x > -4.6e18, x < 4.6e18 else { return nil }
    let t = Int64(x)  // truncates toward zero
    let rest = x - Double(t)
    if rest >= 0.5 { return t + 1 }
    if rest <= -0.5 { return t - 1 }
    return t
}

/// `YYYY-MM-DDTHH:MM:SS` (UTC) for seconds since the Unix epoch (SPEC.md §0 timestamp form).
func advISOTimestamp(epochSeconds: Int64) -> String {
    let days = epochSeconds >= 0 ? epochSeconds / 86_400 : (epochSeconds - 86_399) / 86_400
    let secondsOfDay = epochSeconds - days * 86_400
    // Civil-from-days (proleptic Gregorian), after H. Hinnant's algorithm.
    let z = days + 719_468
    let era = (z >= 0 ? z : z - 146_096) / 146_097
    let doe = z - era * 146_097
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100)
    let mp = (5 * doy + 2) / 153
    let day = doy - (153 * mp + 2) / 5 + 1
    let month = mp < 10 ? mp + 3 : mp - 9
    let year = yoe + era * 400 + (month <= 2 ? 1 : 0)
    func two(_ v: Int64) -> String { v < 10 ? "0\(v)" : "\(v)" }
    let yearText = String(year)
    let paddedYear = String(repeating: "0", count: max(0, 4 - yearText.count)) + yearText
    let time = "\(two(secondsOfDay / 3600)):\(two(secondsOfDay / 60 % 60)):\(two(secondsOfDay % 60))"
    return "\(paddedYear)-\(two(month))-\(two(day))T\(time)"
}

/// Seconds since the Unix epoch for `YYYY-MM-DDTHH:MM:SS` (UTC), the inverse of `advISOTimestamp`. Nil when malformed.
func advEpochSeconds(iso text: String) -> Int64? {
    let u = Array(text.utf8)
    guard u.count == 19, u[4] == UInt8(ascii: "-"), u[7] == UInt8(ascii: "-"), u[10] == UInt8(ascii: "T"),
        u[13] == UInt8(ascii: ":"), u[16] == UInt8(ascii: ":")
    else { return nil }
    func number(_ range: Range<Int>) -> Int64? {
        var v: Int64 = 0
        for k in range {
            guard u[k] >= UInt8(ascii: "0"), u[k] <= UInt8(ascii: "9") else { return nil }
            v = v * 10 + Int64(u[k] - UInt8(ascii: "0"))
        }
        return v
    }
    guard let y = number(0..<4), let m = number(5..<7), let d = number(8..<10), let hh = number(11..<13),
        let mm = number(14..<16), let ss = number(17..<19), (1...12).contains(m), (1...31).contains(d), hh < 24,
        mm < 60, ss < 60
    else { return nil }
    // Days-from-civil (proleptic Gregorian), the inverse of the algorithm in `advISOTimestamp`.
    let yy = m <= 2 ? y - 1 : y
    let era = (yy >= 0 ? yy : yy - 399) / 400
    let yoe = yy - era * 400
    let doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy
    let days = era * 146_097 + doe - 719_468
    return days * 86_400 + hh * 3600 + mm * 60 + ss
}
