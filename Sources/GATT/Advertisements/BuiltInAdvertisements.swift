/// The built-in advertisement parsers (SPEC.md §4), as a literal list. Each handles distinct sources.
public enum BuiltInAdvertisementParsers {
    /// BTHome v2, Ruuvi RAWv2, ATC1441/pvvx, Xiaomi MiBeacon, iBeacon, Eddystone, Govee H5072/H5075.
    public static let all: [any AdvertisementParser] = [
        BTHomeV2Parser(),
        RuuviRAWv2Parser(),
        ATCParser(),
        MiBeaconParser(),
        IBeaconParser(),
        EddystoneParser(),
        GoveeH5075Parser(),
    ]
}
