// The explicit parser registry: built-in parsers, then parsers declared in the config.

/// A duplicate or otherwise invalid registration; raised at start-up.
public struct GATTRegistryError: Error, Sendable, Equatable, CustomStringConvertible {
    /// What is wrong, naming the parser or UUID.
    public let description: String
    /// Creates an error with its message.
    public init(_ description: String) { self.description = description }
}

/// A characteristic value that its parser rejected, naming the parser and the UUID (`heart_rate_measurement (2A37):
/// truncated at offset 3: needed 2 octet(s), 0 available`).
public struct GATTDecodeError: Error, Sendable, Equatable, CustomStringConvertible {
    /// The parser's name, or `characteristic_presentation_format` when the 0x2904 descriptor did the decoding.
    public let characteristic: String
    /// The characteristic's UUID.
    public let uuid: BluetoothUUID
    /// What was wrong, with the offset.
    public let reason: GATTParseError

    /// An error for `characteristic` (a parser name) at `uuid`.
    public init(characteristic: String, uuid: BluetoothUUID, reason: GATTParseError) {
        self.characteristic = characteristic
        self.uuid = uuid
        self.reason = reason
    }

    /// The text people read in logs and error output.
    public var description: String { "\(characteristic) (\(uuid)): \(reason)" }
}

/// Looks up characteristic and advertisement parsers by UUID (any of the 16-, 32- or 128-bit forms) or name.
public struct GATTParserRegistry: Sendable {
    private var byUUID: [BluetoothUUID: any GATTCharacteristicParser] = [:]
    private var byName: [String: any GATTCharacteristicParser] = [:]
    private var advertisementsBySource: [AdvertisementSource: any AdvertisementParser] = [:]

    /// An empty registry.
    public init() {}

    /// The built-in characteristic and advertisement parsers.
    public static func builtIn() throws(GATTRegistryError) -> GATTParserRegistry {
        var registry = GATTParserRegistry()
        for parser in BuiltInCharacteristicParsers.all { try registry.register(parser) }
        for parser in BuiltInAdvertisementParsers.all { try registry.register(parser) }
        return registry
    }

    /// The built-in parsers, then the parsers declared in the configuration, in order.
    ///
    /// - Throws: `GATTRegistryError` naming the path of an invalid declaration
    ///   (`parsers[0].fields[2].type: "u17" is not a field type`) or both parsers of a duplicate UUID.
    public static func builtIn(declaring specs: [DeclarativeParserSpec], path: String = "parsers")
        throws(GATTRegistryError) -> GATTParserRegistry
    {
        var registry = try builtIn()
        for (index, spec) in specs.enumerated() {
            let itemPath = "\(path)[\(index)]"
            let parser: DeclarativeParser
            do {
                parser = try DeclarativeParser(spec, path: itemPath)
            } catch {
                throw GATTRegistryError(error.description)
            }
            do {
                try registry.register(parser)
            } catch {
                throw GATTRegistryError("\(itemPath): \(error.description)")
            }
        }
        return registry
    }

    /// Adds a characteristic parser. Throws when one of its UUIDs or its name is already taken, naming both.
    public mutating func register(_ parser: any GATTCharacteristicParser) throws(GATTRegistryError) {
        for uuid in parser.uuids {
            if let existing = byUUID[uuid] {
                throw GATTRegistryError(
                    "duplicate parser for characteristic \(uuid): '\(parser.name)' and '\(existing.name)'")
            }
        }
        if let existing = byName[parser.name], existing.uuids != parser.uuids {
            throw GATTRegistryError("duplicate parser name '\(parser.name)' (\(existing.uuids) and \(parser.uuids))")
        }
        for uuid in parser.uuids { byUUID[uuid] = parser }
        byName[parser.name] = parser
    }

    /// Adds an advertisement parser. Throws when one of its sources is already taken, naming both.
    public mutating func register(_ parser: any AdvertisementParser) throws(GATTRegistryError) {
        for source in parser.sources {
            if let existing = advertisementsBySource[source] {
                throw GATTRegistryError("duplicate parser for \(source): '\(parser.name)' and '\(existing.name)'")
            }
        }
        for source in parser.sources { advertisementsBySource[source] = parser }
    }

    /// The characteristic parser for `uuid`, if any.
    public func parser(for uuid: BluetoothUUID) -> (any GATTCharacteristicParser)? { byUUID[uuid] }

    /// The characteristic parser called `name` (`heart_rate_measurement`), if any.
    public func parser(named name: String) -> (any GATTCharacteristicParser)? { byName[name] }

    /// The advertisement parser for `source`, if any.
    public func parser(for source: AdvertisementSource) -> (any AdvertisementParser)? {
        advertisementsBySource[source]
    }

    /// The fields the parser for `uuid` declares (see `GATTCharacteristicParser.fields`); empty when no parser
    /// handles `uuid`. A characteristic without a parser but with a 0x2904 descriptor: `fields(forPresentationFormat:)`.
    public func fields(for uuid: BluetoothUUID) -> [GATTFieldDescriptor] { byUUID[uuid]?.fields ?? [] }

    /// The fields the advertisement parser for `source` declares; empty when no parser handles `source`.
    public func fields(for source: AdvertisementSource) -> [GATTFieldDescriptor] {
        advertisementsBySource[source]?.fields ?? []
    }

    /// The fields `decode` publishes for a characteristic that has no parser but this 0x2904 Characteristic
    /// Presentation Format descriptor value: `value_<unit suffix>` (or `value`) with the unit, then `unit` or
    /// `unit_uuid` (see `PresentationFormat.fields`). Empty when the descriptor is malformed or its format reserved.
    public func fields(forPresentationFormat descriptor: [UInt8]) -> [GATTFieldDescriptor] {
        guard let format = try? PresentationFormat(descriptor: descriptor) else { return [] }
        return format.fields
    }

    /// Every registered characteristic parser, once each, sorted by name.
    public var characteristicParsers: [any GATTCharacteristicParser] {
        byName.values.sorted { $0.name < $1.name }
    }

    /// Decodes a characteristic value: its parser, else the 0x2904 presentation format when given,
    /// else `{"raw": "<hex>"}`.
    ///
    /// - Throws: `GATTDecodeError` naming the parser, the UUID and the offset, for a payload that must be rejected
    ///   (SPEC.md §5) or a malformed presentation format.
    public func decode(_ uuid: BluetoothUUID, _ bytes: [UInt8], context: GATTDecodeContext = GATTDecodeContext())
        throws(GATTDecodeError) -> GATTReading
    {
        if let parser = byUUID[uuid] {
            do {
                return try parser.decode(bytes, context: context)
            } catch {
                throw GATTDecodeError(characteristic: parser.name, uuid: uuid, reason: error)
            }
        }
        if let format = context.presentationFormat {
            do {
                return try PresentationFormat.decode(bytes, descriptor: format)
            } catch {
                throw GATTDecodeError(characteristic: "characteristic_presentation_format", uuid: uuid, reason: error)
            }
        }
        return .raw(bytes)
    }

    /// Decodes an advertisement payload, or returns `{"raw": "<hex>"}` when no parser handles `source`.
    public func decode(_ source: AdvertisementSource, _ payload: [UInt8], context: AdvertisementContext)
        throws(GATTParseError) -> GATTReading
    {
        guard let parser = advertisementsBySource[source] else { return .raw(payload) }
        return try parser.decode(payload, from: source, context: context)
    }
}
