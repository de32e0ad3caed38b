/// Decoding by the 0x2904 Characteristic Presentation Format descriptor.
public enum PresentationFormat {
    /// Decodes `bytes` as the 7-octet descriptor `descriptor` describes.
    public static func decode(_ bytes: [UInt8], descriptor: [UInt8]) throws(GATTParseError) -> GATTReading {
        throw .unsupported("0x2904 presentation format decoding is not built yet")
    }
}
