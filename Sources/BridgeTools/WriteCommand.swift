import BlueZ
// `blebridge write`: write hex bytes to a characteristic.
import BridgeKit
import GATT

/// Writes a characteristic: a write request by default, a write command with `--without-response`.
public enum WriteCommand: CLICommand {
    /// The subcommand's name on the command line.
    public static let name = "write"
    /// One line for `blebridge --help`.
    public static let summary = "write hex bytes to a characteristic"
    /// The subcommand's help text.
    public static let usage = """
        usage: blebridge write ADDRESS CHAR HEX [--without-response]

        CHAR is a UUID or a parser name. HEX is the value ("0a1b", "0a:1b" or "0x0a1b").
          --without-response  write command (no acknowledgement) instead of a write request
        \(BLECommon.usage)
        """

    /// Runs the subcommand with its arguments (after the name) and returns the exit code.
    public static func run(_ arguments: [String]) async -> Int32 {
        await runBLE(name) { () async throws(BLEFailure) -> Int32 in
            let args = try BLEArguments(
                arguments, valued: BLECommon.valued, flags: BLECommon.flags.union(["--without-response"]))
            guard args.positional.count == 3 else { throw .usage("expected ADDRESS CHAR HEX\n\n\(usage)") }
            let address = try parseAddress(args.positional[0])
            let registry = bleRegistry()
            _ = try ReadCommand.resolveName(args.positional[1], registry: registry)
            guard let bytes = bytesFromHex(args.positional[2]) else {
                throw .usage("'\(args.positional[2])' is not hex bytes")
            }
            let type: BlueZWriteType = args.flags.contains("--without-response") ? .command : .request
            let session = try await BLESession.open(args)
            defer { session.client.close() }
            let peripheral = try await session.connect(address, args: args)
            let c: BlueZCharacteristic
            do {
                c = try resolveCharacteristic(args.positional[1], on: peripheral, registry: registry)
                do {
                    try await peripheral.write(c, bytes, type: type)
                } catch {
                    throw BLEFailure(error)
                }
            } catch {
                await peripheral.disconnect()
                throw BLEFailure(error)
            }
            await peripheral.disconnect()
            writeOut("wrote \(bytes.count) byte(s) to \(displayUUID(c.uuid)) (\(type.rawValue))")
            return ExitCode.success
        }
    }
}
