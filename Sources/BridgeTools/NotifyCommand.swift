import BlueZ
// `blebridge notify`: subscribe and print each notification decoded as it arrives.
import BridgeKit
import GATT

/// Subscribes to a characteristic and prints each value as it arrives.
public enum NotifyCommand: CLICommand {
    /// The subcommand's name on the command line.
    public static let name = "notify"
    /// One line for `blebridge --help`.
    public static let summary = "print a characteristic's notifications, decoded, as they arrive"
    /// The subcommand's help text.
    public static let usage = """
        usage: blebridge notify ADDRESS CHAR [--count N] [--hex] [--start-notify]

        Prints one line per notification or indication: JSON, decoded where a parser exists.
          --count N           stop after N values (default: until interrupted or disconnected)
          --hex               print raw hex instead
          --start-notify      use StartNotify even when AcquireNotify is available
        \(BLECommon.usage)
        """

    /// Runs the subcommand with its arguments (after the name) and returns the exit code.
    public static func run(_ arguments: [String]) async -> Int32 {
        await runBLE(name) { () async throws(BLEFailure) -> Int32 in
            let args = try BLEArguments(
                arguments, valued: BLECommon.valued.union(["--count"]),
                flags: BLECommon.flags.union(["--hex", "--start-notify"]))
            guard args.positional.count == 2 else { throw .usage("expected ADDRESS CHAR\n\n\(usage)") }
            let address = try parseAddress(args.positional[0])
            let count = try args.count("--count")
            let registry = bleRegistry()
            _ = try ReadCommand.resolveName(args.positional[1], registry: registry)
            let session = try await BLESession.open(args)
            defer { session.client.close() }
            let peripheral = try await session.connect(address, args: args)
            let c: BlueZCharacteristic
            let values: BlueZNotifications
            do {
                c = try resolveCharacteristic(args.positional[1], on: peripheral, registry: registry)
                values = try await peripheral.notifications(
                    for: c, preferAcquire: !args.flags.contains("--start-notify"))
            } catch {
                await peripheral.disconnect()
                throw BLEFailure(error)
            }
            let hex = args.flags.contains("--hex")
            // Until --count values, a disconnect, or Ctrl-C (which cancels the loop; we still disconnect below).
            let failure: BLEFailure? = await cancellingOnInterrupt {
                var received = 0
                do {
                    for try await value in values {
                        if hex {
                            writeOut(hexBytes(value))
                        } else {
                            let (reading, error) = decodeValue(c.uuid, value, registry: registry)
                            if let reading {
                                writeOut(readingJSON(reading))
                            } else {
                                writeOut(
                                    BLEJSON.object([("raw", .string(hexBytes(value))), ("error", .string(error ?? ""))])
                                        .text)
                            }
                        }
                        received += 1
                        if let count, received >= count { break }
                    }
                    return nil
                } catch {
                    return BLEFailure(error)
                }
            }
            await peripheral.disconnect()
            if let failure { throw failure }
            return ExitCode.success
        }
    }
}
