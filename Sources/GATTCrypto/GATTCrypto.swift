// GATTCrypto: AES-128-CCM (and its counter-mode keystream) from OpenSSL's libcrypto, injected into GATT's
// advertisement parsers through `AdvertisementContext.cipher`. This is the only file that touches libcrypto.
internal import CCrypto
import GATT

/// AES-128-CCM over libcrypto's `EVP_aes_128_ccm` (no hand-written cipher).
///
/// Stateless and `Sendable`: every call creates and frees its own `EVP_CIPHER_CTX`, so one value can be
/// shared by any number of threads.
public struct OpenSSLAESCCM: AESCCMCipher, AESCCMKeystreamCipher {
    /// Creates the cipher. It holds no state.
    public init() {}

    /// Decrypts `ciphertext` and checks its `tag` (the MIC).
    ///
    /// - Parameters:
    ///   - key: the 16-octet AES key.
    ///   - nonce: 7 to 13 octets.
    ///   - tag: 4, 6, 8, 10, 12, 14 or 16 octets.
    ///   - aad: additional authenticated data (may be empty).
    /// - Throws: `decryptionFailed` when the key, nonce or tag has the wrong size, or the tag does not match
    ///   (which usually means a wrong key).
    public func decrypt(key: [UInt8], nonce: [UInt8], ciphertext: [UInt8], tag: [UInt8], aad: [UInt8])
        throws(GATTParseError) -> [UInt8]
    {
        try Self.check(key: key, nonce: nonce, tagLength: tag.count)
        return try withCipherContext { (ctx) throws(GATTParseError) in
            try call("EVP_DecryptInit_ex", EVP_DecryptInit_ex(ctx, EVP_aes_128_ccm(), nil, nil, nil))
            try call("set nonce length", EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_CCM_SET_IVLEN, Int32(nonce.count), nil))
            var tagCopy = tag
            try call(
                "set tag",
                tagCopy.withUnsafeMutableBytes {
                    EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_CCM_SET_TAG, Int32(tag.count), $0.baseAddress)
                })
            try call("EVP_DecryptInit_ex (key)", EVP_DecryptInit_ex(ctx, nil, nil, key, nonce))
            var outLength: Int32 = 0
            // CCM needs the total length before any AAD.
            try call("set length", EVP_DecryptUpdate(ctx, nil, &outLength, nil, Int32(ciphertext.count)))
            if !aad.isEmpty {
                try call("AAD", EVP_DecryptUpdate(ctx, nil, &outLength, aad, Int32(aad.count)))
            }
            var plaintext = [UInt8](repeating: 0, count: max(ciphertext.count, 1))
            let input = ciphertext.isEmpty ? [UInt8](repeating: 0, count: 1) : ciphertext
            let ok = plaintext.withUnsafeMutableBufferPointer { out in
                EVP_DecryptUpdate(ctx, out.baseAddress, &outLength, input, Int32(ciphertext.count))
            }
            // In CCM mode the last update both decrypts and verifies; a non-positive result is a MIC mismatch.
            guard ok > 0 else { throw .decryptionFailed("MIC mismatch") }
            plaintext.removeLast(plaintext.count - ciphertext.count)
            return plaintext
        }
    }

    /// Encrypts `plaintext` and returns the ciphertext with a tag of `tagLength` octets.
    ///
    /// - Throws: `decryptionFailed` when the key, nonce or tag length is invalid or libcrypto fails.
    public func encrypt(key: [UInt8], nonce: [UInt8], plaintext: [UInt8], aad: [UInt8], tagLength: Int)
        throws(GATTParseError) -> (ciphertext: [UInt8], tag: [UInt8])
    {
        try Self.check(key: key, nonce: nonce, tagLength: tagLength)
        return try withCipherContext { (ctx) throws(GATTParseError) in
            try call("EVP_EncryptInit_ex", EVP_EncryptInit_ex(ctx, EVP_aes_128_ccm(), nil, nil, nil))
            try call("set nonce length", EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_CCM_SET_IVLEN, Int32(nonce.count), nil))
            try call("set tag length", EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_CCM_SET_TAG, Int32(tagLength), nil))
            try call("EVP_EncryptInit_ex (key)", EVP_EncryptInit_ex(ctx, nil, nil, key, nonce))
            var outLength: Int32 = 0
            try call("set length", EVP_EncryptUpdate(ctx, nil, &outLength, nil, Int32(plaintext.count)))
            if !aad.isEmpty {
                try call("AAD", EVP_EncryptUpdate(ctx, nil, &outLength, aad, Int32(aad.count)))
            }
            var ciphertext = [UInt8](repeating: 0, count: plaintext.count + 16)
            let input = plaintext.isEmpty ? [UInt8](repeating: 0, count: 1) : plaintext
            var written: Int32 = 0
            var finalLength: Int32 = 0
            let updated = ciphertext.withUnsafeMutableBufferPointer { out in
                EVP_EncryptUpdate(ctx, out.baseAddress, &written, input, Int32(plaintext.count))
            }
            try call("EVP_EncryptUpdate", updated)
            let finished = ciphertext.withUnsafeMutableBufferPointer { out in
                EVP_EncryptFinal_ex(ctx, out.baseAddress.map { $0 + Int(written) }, &finalLength)
            }
            try call("EVP_EncryptFinal_ex", finished)
            ciphertext.removeLast(ciphertext.count - Int(written + finalLength))
            var tag = [UInt8](repeating: 0, count: tagLength)
            let got = tag.withUnsafeMutableBytes {
                EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_CCM_GET_TAG, Int32(tagLength), $0.baseAddress)
            }
            try call("get tag", got)
            return (ciphertext, tag)
        }
    }

    /// CCM's counter-mode keystream applied to `ciphertext`, without checking any tag: what legacy formats
    /// with no usable MIC need (Xiaomi MiBeacon v2/v3). Runs libcrypto's `EVP_aes_128_ctr` from counter block
    /// A1 = `flags(L-1) | nonce | 1`, exactly the blocks CCM uses for the payload (RFC 3610 §2.3).
    ///
    /// - Throws: `decryptionFailed` when the key or nonce has the wrong size.
    public func decryptUnauthenticated(key: [UInt8], nonce: [UInt8], ciphertext: [UInt8])
        throws(GATTParseError) -> [UInt8]
    {
        try Self.check(key: key, nonce: nonce, tagLength: 4)
        let lengthFieldSize = 15 - nonce.count
        var counterBlock = [UInt8](repeating: 0, count: 16)
        counterBlock[0] = UInt8(lengthFieldSize - 1)
        for (i, b) in nonce.enumerated() { counterBlock[1 + i] = b }
        counterBlock[15] = 1
        return try withCipherContext { (ctx) throws(GATTParseError) in
            try call("EVP_DecryptInit_ex (ctr)", EVP_DecryptInit_ex(ctx, EVP_aes_128_ctr(), nil, key, counterBlock))
            guard !ciphertext.isEmpty else { return [] }
            var plaintext = [UInt8](repeating: 0, count: ciphertext.count + 16)
            var written: Int32 = 0
            let ok = plaintext.withUnsafeMutableBufferPointer { out in
                EVP_DecryptUpdate(ctx, out.baseAddress, &written, ciphertext, Int32(ciphertext.count))
            }
            try call("EVP_DecryptUpdate (ctr)", ok)
            plaintext.removeLast(plaintext.count - Int(written))
            return plaintext
        }
    }

    private static func check(key: [UInt8], nonce: [UInt8], tagLength: Int) throws(GATTParseError) {
        guard key.count == 16 else {
            throw .decryptionFailed("AES-128-CCM key must be 16 octets, got \(key.count)")
        }
        guard (7...13).contains(nonce.count) else {
            throw .decryptionFailed("AES-CCM nonce must be 7 to 13 octets, got \(nonce.count)")
        }
        guard (4...16).contains(tagLength), tagLength % 2 == 0 else {
            throw .decryptionFailed("AES-CCM tag must be 4, 6, ..., 16 octets, got \(tagLength)")
        }
    }
}

/// Runs `body` with a fresh `EVP_CIPHER_CTX` and frees it afterwards, also when `body` throws.
private func withCipherContext<R>(_ body: (OpaquePointer) throws(GATTParseError) -> R) throws(GATTParseError) -> R {
    guard let ctx = EVP_CIPHER_CTX_new() else { throw .decryptionFailed("EVP_CIPHER_CTX_new failed") }
    defer { EVP_CIPHER_CTX_free(ctx) }
    return try body(ctx)
}

/// Turns a libcrypto return code (1 = success) into a typed error naming the step.
private func call(_ step: String, _ result: Int32) throws(GATTParseError) {
    guard result > 0 else { throw .decryptionFailed("libcrypto \(step) failed") }
}
