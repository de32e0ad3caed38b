// What the command-line tools and the daemon share: argument parsing, opening the client and adapter, finding the
// device (scanning for it when BlueZ does not know it), resolving CHAR, decoding, JSON, signal handling.
import BlueZ
import Dispatch
import GATT
import Logging
import Signals

#if canImport(Glibc)
    import Glibc
#endif

/// A failure that ends a command: the message for stderr and the exit code.
public struct BLEFailure: Error {
    public var message: String
    public var code: Int32

    public init(_ message: String, code: Int32) {
        self.message = message
        self.code = code
    }

    public init(_ error: BlueZError) {
        message = error.description
        switch error {
        case .notPermitted: code = ExitCode.notPermitted
        case .notSupported: code = ExitCode.failure
        case .invalidArgument: code = ExitCode.usage
        default: code = ExitCode.unavailable
        }
    }

    /// Any error: a `BlueZError` or `BLEFailure` keeps its meaning, anything else is a plain failure.
    public init(_ error: any Error) {
        if let e = error as? BLEFailure {
            self = e
        } else if let e = error as? BlueZError {
            self.init(e)
        } else {
            self.init("\(error)", code: ExitCode.failure)
        }
    }

    public static func usage(_ message: String) -> BLEFailure { BLEFailure(message, code: ExitCode.usage) }
}

/// Parsed command-line arguments: positionals, options with values, and flags.
public struct BLEArguments {
    public var positional: [String] = []
    public var values: [String: [String]] = [:]
    public var flags: Set<String> = []

    /// Parses `arguments`; `valued` options take the next argument (or `--opt=value`), `flags` take none.
    public init(_ arguments: [String], valued: Set<String>, flags allowedFlags: Set<String>) throws(BLEFailure) {
        var i = 0
        while i < arguments.count {
            let arg = arguments[i]
            i += 1
            if arg == "--" {
                positional.append(contentsOf: arguments[i...])
                break
            }
            guard arg.hasPrefix("--"), arg.count > 2 else {
                positional.append(arg)
                continue
            }
            var name = arg
            var inline: String?
            if let eq = arg.firstIndex(of: "=") {
                name = String(arg[..<eq])
                inline = String(arg[arg.index(after: eq)...])
            }
            if valued.contains(name) {
                if let inline {
                    values[name, default: []].append(inline)
                } else {
                    guard i < arguments.count else { throw .usage("option \(name) needs a value") }
                    values[name, default: []].append(arguments[i])
                    i += 1
                }
            } else if allowedFlags.contains(name), inline == nil {
                flags.insert(name)
            } else {
                throw .usage("unknown option '\(arg)'")
            }
        }
        // Durations are checked here, before any bus is opened, so that a bad value is a usage error whichever
        // step would have read it first.
        for name in Self.durationOptions where values[name] != nil { _ = try seconds(name, default: 0) }
    }

    /// The options that take seconds.
    public static let durationOptions = ["--timeout", "--scan-timeout", "--duration"]

    public func value(_ name: String) -> String? { values[name]?.last }

    /// The longest duration an option accepts: a year, far beyond any scan or connect, and well inside `Duration`.
    public static let maximumSeconds: Double = 31_536_000

    public func seconds(_ name: String, default fallback: Double) throws(BLEFailure) -> Double {
        guard let text = value(name) else { return fallback }
        guard let v = Double(text), v >= 0, v <= Self.maximumSeconds else {
            throw .usage(
                "option \(name): '\(text)' is not a number of seconds between 0 and \(Int(Self.maximumSeconds))")
        }
        return v
    }

    public func count(_ name: String) throws(BLEFailure) -> Int? {
        guard let text = value(name) else { return nil }
        guard let v = Int(text), v > 0 else { throw .usage("option \(name): '\(text)' is not a positive count") }
        return v
    }
}

/// Options every BLE subcommand accepts.
public enum BLECommon {
    public static let valued: Set<String> = ["--adapter", "--timeout", "--scan-timeout"]
    public static let flags: Set<String> = ["--verbose"]
    public static let usage = """
          --adapter hciN      adapter name or address (default: the first one)
          --timeout S         connect timeout in seconds (default 20)
          --scan-timeout S    how long to scan for a device BlueZ does not know yet (default 10)
          --verbose           log BlueZ decisions to stderr
        """
}

/// Log lines to stderr.
public struct StderrLogHandler: BlueZLogHandler {
    /// A handler.
    public init() {}
    /// Writes the line.
    public func log(level: BlueZLogLevel, message: String, metadata: [String: String]) {
        writeErr("[\(level)] \(message)")
    }
}

/// Checks `ADDRESS` (six hex octets separated by ':').
public func parseAddress(_ text: String) throws(BLEFailure) -> String {
    let parts = text.split(separator: ":", omittingEmptySubsequences: false)
    // ASCII only: Character.isHexDigit also accepts fullwidth forms, which no device address contains.
    guard parts.count == 6, parts.allSatisfy({ $0.count == 2 && $0.allSatisfy { $0.isASCII && $0.isHexDigit } })
    else {
        throw .usage("'\(text)' is not a Bluetooth address (expected AA:BB:CC:DD:EE:FF)")
    }
    return text.uppercased()
}

/// `value` seconds as a Duration, saturating instead of trapping on values no option accepts.
public func seconds(_ value: Double) -> Duration {
    guard value.isFinite else { return value > 0 ? .seconds(Int64.max / 2) : .zero }
    return .milliseconds(Int64(max(-9e15, min(9e15, (value * 1000).rounded()))))
}

/// An open client and the adapter the command uses.
public struct BLESession {
    public let client: BlueZClient
    public let adapter: BlueZAdapter

    /// Connects to bluetoothd and picks a powered adapter (`--adapter`), or fails with a clear message.
    public static func open(_ args: BLEArguments) async throws(BLEFailure) -> BLESession {
        let logger =
            args.flags.contains("--verbose")
            ? BlueZLogger(handler: StderrLogHandler(), level: .debug)
            : BlueZLogger(handler: StderrLogHandler(), level: .warning)
        do {
            let client = try BlueZClient(bus: .system, logger: logger)
            try await client.start()
            if !client.isBluetoothdRunning {
                throw BLEFailure(
                    "bluetoothd (org.bluez) is not running on the system bus; start bluetooth.service",
                    code: ExitCode.unavailable)
            }
            let adapter = try await client.waitForAdapter(BlueZAdapterSelector(args.value("--adapter")))
            return BLESession(client: client, adapter: adapter)
        } catch let error as BLEFailure {
            throw error
        } catch let error as BlueZError {
            throw BLEFailure(error)
        } catch {
            throw BLEFailure("\(error)", code: ExitCode.failure)
        }
    }

    /// Scans until `address` advertises, then stops scanning and returns the device as BlueZ then has it.
    public func scan(for address: String, args: BLEArguments) async throws(BLEFailure) -> BlueZDevice {
        let limit = try args.seconds("--scan-timeout", default: 10)
        do {
            let discovery = try await client.startDiscovery(
                on: adapter, filter: BlueZDiscoveryFilter(watchdogInterval: nil))
            let found = await withTaskGroup(of: BlueZDevice?.self) { group in
                group.addTask {
                    for await event in discovery.events {
                        if case .appeared(let d) = event, d.address == address { return d }
                        if case .updated(let d) = event, d.address == address { return d }
                    }
                    return nil
                }
                group.addTask {
                    try? await Task.sleep(for: seconds(limit))
                    return nil
                }
                let first = await group.next() ?? nil
                group.cancelAll()
                return first
            }
            await discovery.stop()
            if let found {
                if let current = client.device(atPath: found.path) { return current }
                // BlueZ removes temporary devices that are not connectable as soon as scanning stops.
                throw droppedAfterScan(found)
            }
        } catch {
            throw BLEFailure(error)
        }
        throw BLEFailure(
            "device \(address): not found on \(adapter.name) (not advertising within \(formatSeconds(limit)) s, "
                + "or out of range)", code: ExitCode.unavailable)
    }

    /// Connects to the device with `address`. When BlueZ forgot a device it knew a moment ago (expired from its
    /// cache), scans for it once and tries again.
    public func connect(_ address: String, args: BLEArguments) async throws(BLEFailure) -> BlueZPeripheral {
        let known = client.device(address: address, on: adapter)
        let device: BlueZDevice
        if let known {
            device = known
        } else {
            device = try await scan(for: address, args: args)
        }
        let timeout = try args.seconds("--timeout", default: 20)
        let options = BlueZConnectOptions(timeout: seconds(timeout))
        do {
            return try await client.connect(device, options: options)
        } catch {
            guard case .deviceNotFound = error else { throw BLEFailure(error) }
            if known == nil {
                // This scan just saw it, and BlueZ has removed it since: BlueZ drops temporary devices that are not
                // connectable when scanning stops (our mirror may apply that removal a moment after the stop).
                throw droppedAfterScan(device)
            }
        }
        let fresh = try await scan(for: address, args: args)
        do {
            return try await client.connect(fresh, options: options)
        } catch {
            throw BLEFailure(error)
        }
    }
}

/// The failure for a device a scan saw that BlueZ dropped when the scan stopped (it is not connectable).
public func droppedAfterScan(_ device: BlueZDevice) -> BLEFailure {
    BLEFailure(
        "device \(device.label): BlueZ dropped it when scanning stopped, so it is not connectable "
            + "(it only broadcasts; 'blebridge scan' shows its advertisements)", code: ExitCode.unavailable)
}

public func formatSeconds(_ value: Double) -> String {
    value == value.rounded() && abs(value) < 1e15 ? String(Int64(value)) : String(value)
}

/// The parser registry the tools decode with.
public func bleRegistry() -> GATTParserRegistry {
    (try? GATTParserRegistry.builtIn()) ?? GATTParserRegistry()
}

/// `2A37` for SIG 16-bit UUIDs, the full form otherwise.
public func displayUUID(_ uuid: String) -> String {
    BluetoothUUID(uuid)?.description ?? uuid
}

/// Resolves CHAR: a UUID (16-, 32- or 128-bit) or a parser name (`heart_rate_measurement`).
public func resolveCharacteristic(_ spec: String, on peripheral: BlueZPeripheral, registry: GATTParserRegistry)
    throws(BLEFailure) -> BlueZCharacteristic
{
    var candidates: [BluetoothUUID] = []
    if let uuid = BluetoothUUID(spec) {
        candidates = [uuid]
    } else if let parser = registry.parser(named: spec) {
        candidates = parser.uuids
    } else {
        let names = registry.characteristicParsers.map(\.name)
        let hint = names.isEmpty ? "" : " (known names: \(names.joined(separator: ", ")))"
        throw .usage("'\(spec)' is neither a UUID nor a characteristic name\(hint)")
    }
    for c in peripheral.characteristics() {
        if let uuid = BluetoothUUID(c.uuid), candidates.contains(uuid) { return c }
    }
    throw BLEFailure(
        BlueZError.attributeNotFound(device: peripheral.label, attribute: "characteristic \(spec)"))
}

/// Decodes a characteristic value with the registry; `{"raw": ...}` when no parser exists.
public func decodeValue(
    _ uuid: String, _ bytes: [UInt8], registry: GATTParserRegistry, presentationFormat: [UInt8]? = nil
)
    -> (reading: GATTReading?, error: String?)
{
    guard let id = BluetoothUUID(uuid) else { return (.raw(bytes), nil) }
    do {
        return (try registry.decode(id, bytes, context: GATTDecodeContext(presentationFormat: presentationFormat)), nil)
    } catch {
        return (nil, error.description)
    }
}

/// Lower-case hex.
public func hexBytes(_ bytes: [UInt8]) -> String { hexString(bytes) }

// MARK: JSON

/// A JSON value with ordered objects, written compactly.
public indirect enum BLEJSON {
    case null
    case bool(Bool)
    case int(Int64)
    case double(Double)
    case string(String)
    case array([BLEJSON])
    case object([(String, BLEJSON)])
    /// Already-serialised JSON (a reading from the GATT target's encoder).
    case raw(String)

    public var text: String {
        var out = ""
        write(into: &out)
        return out
    }

    public func write(into out: inout String) {
        switch self {
        case .null: out += "null"
        case .raw(let text): out += text
        case .bool(let b): out += b ? "true" : "false"
        case .int(let i): out += String(i)
        case .double(let d):
            if !d.isFinite {
                out += "null"
            } else if d == d.rounded(), abs(d) < 1e15 {
                out += String(Int64(d))
            } else {
                out += "\(d)"
            }
        case .string(let s): jsonQuote(s, into: &out)
        case .array(let items):
            out += "["
            for (i, item) in items.enumerated() {
                if i > 0 { out += "," }
                item.write(into: &out)
            }
            out += "]"
        case .object(let fields):
            out += "{"
            for (i, (key, value)) in fields.enumerated() {
                if i > 0 { out += "," }
                jsonQuote(key, into: &out)
                out += ":"
                value.write(into: &out)
            }
            out += "}"
        }
    }

    public init(_ reading: GATTReading) {
        self = .raw(reading.jsonString)
    }
}

/// Appends `s` as a JSON string literal (the one writer in `Logging`).
public func jsonQuote(_ s: String, into out: inout String) { appendQuoted(s, to: &out) }

/// A reading as one compact JSON line.
public func readingJSON(_ reading: GATTReading) -> String { reading.jsonString }

/// Runs a command body, printing its failure to stderr with the command's name.
public func runBLE(_ name: String, _ body: () async throws(BLEFailure) -> Int32) async -> Int32 {
    do {
        return try await body()
    } catch {
        writeErr("blebridge \(name): \(error.message)")
        return error.code
    }
}

/// Runs `body` as a child task that SIGINT or SIGTERM cancels, so a command can clean up (disconnect) before it
/// exits instead of dying with the BLE connection still up.
public func cancellingOnInterrupt<T: Sendable>(_ body: @escaping @Sendable () async -> T) async -> T {
    let task = Task { await body() }
    let tokens = [SIGINT, SIGTERM].map { sig in
        ProcessSignals.on(sig) { sig in
            // The first signal asks for a clean stop; a second one (the operator insisting) ends the process now.
            if task.isCancelled { exit(128 + sig) }
            task.cancel()
        }
    }
    let result = await task.value
    for token in tokens { token.cancel() }
    return result
}
