/// The built-in advertisement parsers (SPEC.md §4), as a literal list.
public enum BuiltInAdvertisementParsers {
    public static let all: [any AdvertisementParser] = []
}
