// AES-CCM from libcrypto (GATTCrypto.OpenSSLAESCCM): known answers, tag checks, keystream.
import GATT
import GATTCrypto
import Testing

private func hx(_ s: String) -> [UInt8] { bytesFromHex(s) ?? [] }

@Suite struct AdvertisementCryptoTests {
    let cipher = OpenSSLAESCCM()

    /// NIST SP 800-38C Appendix C, Example 1: tag 4, nonce 7, AAD 8, payload 4.
    @Test func nistExample1() throws {
        let key = hx("404142434445464748494a4b4c4d4e4f")
        let nonce = hx("10111213141516")
        let aad = hx("0001020304050607")
        let sealed = try cipher.encrypt(key: key, nonce: nonce, plaintext: hx("20212223"), aad: aad, tagLength: 4)
        #expect(hexString(sealed.ciphertext) == "7162015b")
        #expect(hexString(sealed.tag) == "4dac255d")
        let opened = try cipher.decrypt(
            key: key, nonce: nonce, ciphertext: hx("7162015b"), tag: hx("4dac255d"), aad: aad)
        #expect(hexString(opened) == "20212223")
    }

    /// NIST SP 800-38C Appendix C, Example 2: tag 6, nonce 8, AAD 16, payload 16.
    @Test func nistExample2() throws {
        let key = hx("404142434445464748494a4b4c4d4e4f")
        let nonce = hx("1011121314151617")
        let aad = hx("000102030405060708090a0b0c0d0e0f")
        let plaintext = hx("202122232425262728292a2b2c2d2e2f")
        let sealed = try cipher.encrypt(key: key, nonce: nonce, plaintext: plaintext, aad: aad, tagLength: 6)
        #expect(hexString(sealed.ciphertext) == "d2a1f0e051ea5f62081a7792073d593d")
        #expect(hexString(sealed.tag) == "1fc64fbfaccd")
        #expect(
            try cipher.decrypt(key: key, nonce: nonce, ciphertext: sealed.ciphertext, tag: sealed.tag, aad: aad)
                == plaintext)
    }

    @Test func wrongTagKeyOrAADIsRejected() throws {
        let key = hx("404142434445464748494a4b4c4d4e4f")
        let nonce = hx("10111213141516")
        let aad = hx("0001020304050607")
        let ct = hx("7162015b")
        #expect(throws: GATTParseError.decryptionFailed("MIC mismatch")) {
            try cipher.decrypt(key: key, nonce: nonce, ciphertext: ct, tag: hx("4dac255e"), aad: aad)
        }
        var otherKey = key
        otherKey[0] ^= 1
        #expect(throws: GATTParseError.decryptionFailed("MIC mismatch")) {
            try cipher.decrypt(key: otherKey, nonce: nonce, ciphertext: ct, tag: hx("4dac255d"), aad: aad)
        }
        #expect(throws: GATTParseError.decryptionFailed("MIC mismatch")) {
            try cipher.decrypt(key: key, nonce: nonce, ciphertext: ct, tag: hx("4dac255d"), aad: [])
        }
    }

    @Test func badSizesAreErrorsNotTraps() {
        let key = [UInt8](repeating: 1, count: 16)
        #expect(throws: GATTParseError.self) {
            try cipher.decrypt(
                key: [1, 2, 3], nonce: Array(repeating: 0, count: 13), ciphertext: [1], tag: [1, 2, 3, 4], aad: [])
        }
        #expect(throws: GATTParseError.self) {
            try cipher.decrypt(key: key, nonce: [1, 2], ciphertext: [1], tag: [1, 2, 3, 4], aad: [])
        }
        #expect(throws: GATTParseError.self) {
            try cipher.decrypt(
                key: key, nonce: Array(repeating: 0, count: 13), ciphertext: [1], tag: [1, 2, 3], aad: [])
        }
        #expect(throws: GATTParseError.self) {
            try cipher.encrypt(key: key, nonce: Array(repeating: 0, count: 13), plaintext: [1], aad: [], tagLength: 5)
        }
    }

    @Test func emptyPlaintextRoundTrips() throws {
        let key = [UInt8](repeating: 7, count: 16)
        let nonce = [UInt8](repeating: 3, count: 13)
        let sealed = try cipher.encrypt(key: key, nonce: nonce, plaintext: [], aad: [0x11], tagLength: 4)
        #expect(sealed.ciphertext.isEmpty)
        #expect(sealed.tag.count == 4)
        #expect(try cipher.decrypt(key: key, nonce: nonce, ciphertext: [], tag: sealed.tag, aad: [0x11]) == [])
    }

    /// The unauthenticated keystream is exactly CCM's payload encryption (used for legacy MiBeacon).
    @Test func keystreamMatchesCCMCiphertext() throws {
        let key = hx("404142434445464748494a4b4c4d4e4f")
        for nonceLength in [7, 12, 13] {
            let nonce = (0..<nonceLength).map { UInt8($0 * 3) }
            let plaintext = (0..<37).map { UInt8($0) }
            let sealed = try cipher.encrypt(key: key, nonce: nonce, plaintext: plaintext, aad: [0x11], tagLength: 4)
            #expect(
                try cipher.decryptUnauthenticated(key: key, nonce: nonce, ciphertext: sealed.ciphertext) == plaintext)
        }
    }

    @Test func concurrentUseIsSafe() async throws {
        let key = hx("404142434445464748494a4b4c4d4e4f")
        let nonce = hx("10111213141516")
        let aad = hx("0001020304050607")
        try await withThrowingTaskGroup(of: Bool.self) { group in
            for _ in 0..<8 {
                group.addTask {
                    for _ in 0..<500 {
                        let c = OpenSSLAESCCM()
                        let p = try c.decrypt(
                            key: key, nonce: nonce, ciphertext: hx("7162015b"), tag: hx("4dac255d"), aad: aad)
                        if p != hx("20212223") { return false }
                    }
                    return true
                }
            }
            for try await ok in group { #expect(ok) }
        }
    }
}
