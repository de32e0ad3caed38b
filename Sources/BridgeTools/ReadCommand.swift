import BlueZ
// `blebridge read`: read one characteristic and print it decoded.
import BridgeKit
import GATT

/// Reads a characteristic and prints its value as JSON (decoded where a parser exists, `{"raw": ...}` otherwise).
public enum ReadCommand: CLICommand {
    /// The subcommand's name on the command line.
    public static let name = "read"
    /// One line for `blebridge --help`.
    public static let summary = "read a characteristic and print it decoded"
    /// The subcommand's help text.
    public static let usage = """
        usage: blebridge read ADDRESS CHAR [--hex]

        CHAR is a UUID (2A19, 0x2a19, or 128-bit) or a parser name (battery_level).
        Prints the value as one JSON line, decoded where a parser exists ({"raw": "<hex>"} otherwise).
          --hex               print the raw value as hex instead
        \(BLECommon.usage)
        """

    /// Runs the subcommand with its arguments (after the name) and returns the exit code.
    public static func run(_ arguments: [String]) async -> Int32 {
        await runBLE(name) { () async throws(BLEFailure) -> Int32 in
            let args = try BLEArguments(arguments, valued: BLECommon.valued, flags: BLECommon.flags.union(["--hex"]))
            guard args.positional.count == 2 else { throw .usage("expected ADDRESS CHAR\n\n\(usage)") }
            let address = try parseAddress(args.positional[0])
            let registry = bleRegistry()
            if BluetoothUUID(args.positional[1]) == nil, registry.parser(named: args.positional[1]) == nil {
                _ = try resolveName(args.positional[1], registry: registry)
            }
            let session = try await BLESession.open(args)
            defer { session.client.close() }
            let peripheral = try await session.connect(address, args: args)
            let c: BlueZCharacteristic
            let bytes: [UInt8]
            do {
                c = try resolveCharacteristic(args.positional[1], on: peripheral, registry: registry)
                bytes = try await peripheral.read(c)
            } catch {
                await peripheral.disconnect()
                throw BLEFailure(error)
            }
            await peripheral.disconnect()
            if args.flags.contains("--hex") {
                writeOut(hexBytes(bytes))
                return ExitCode.success
            }
            let (reading, error) = decodeValue(c.uuid, bytes, registry: registry)
            if let reading {
                writeOut(readingJSON(reading))
                return ExitCode.success
            }
            writeOut(BLEJSON.object([("raw", .string(hexBytes(bytes)))]).text)
            writeErr("blebridge read: \(displayUUID(c.uuid)): cannot decode \(hexBytes(bytes)): \(error ?? "")")
            return ExitCode.dataError
        }
    }

    /// Fails with the list of names when `spec` is neither a UUID nor a known name.
    static func resolveName(_ spec: String, registry: GATTParserRegistry) throws(BLEFailure) -> [BluetoothUUID] {
        if let uuid = BluetoothUUID(spec) { return [uuid] }
        if let p = registry.parser(named: spec) { return p.uuids }
        let names = registry.characteristicParsers.map(\.name)
        let hint = names.isEmpty ? "" : " (known names: \(names.joined(separator: ", ")))"
        throw .usage("'\(spec)' is neither a UUID nor a characteristic name\(hint)")
    }
}
