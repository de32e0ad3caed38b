/// The built-in characteristic parsers (SPEC.md §3), as a literal list.
public enum BuiltInCharacteristicParsers {
    public static let all: [any GATTCharacteristicParser] = []
}
