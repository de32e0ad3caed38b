// The daemon's subcommands: `run` (the bridge) and `check-config`.
import BlueZ
import BridgeAdapters
import BridgeCore
import BridgeKit
import GATTCrypto
import Logging

#if canImport(Glibc)
    import Glibc
#endif

/// The daemon's subcommands.
public enum BridgeDaemonCommands {
    /// run, serve, check-config.
    public static let all: [any CLICommand.Type] = [RunCommand.self, ServeCommand.self, CheckConfigCommand.self]
}

/// Reads and checks a configuration file, or says exactly why not.
func loadConfig(_ path: String) -> Result<BridgeConfig, ConfigErrors> {
    guard let fd = fopen(path, "r") else {
        let why = String(cString: strerror(errno))
        return .failure(ConfigErrors([ConfigError(path: "", reason: "cannot read \(path): \(why)")]))
    }
    defer { fclose(fd) }
    var bytes: [UInt8] = []
    var buffer = [UInt8](repeating: 0, count: 65536)
    while true {
        let n = fread(&buffer, 1, buffer.count, fd)
        if n <= 0 { break }
        bytes += buffer[0..<n]
        if bytes.count > 16 << 20 {
            return .failure(ConfigErrors([ConfigError(path: "", reason: "\(path) is larger than 16 MiB")]))
        }
    }
    guard let text = String(validating: bytes, as: UTF8.self) else {
        return .failure(ConfigErrors([ConfigError(path: "", reason: "\(path) is not UTF-8 text")]))
    }
    do {
        return .success(try BridgeConfig.load(text: text))
    } catch {
        return .failure(error)
    }
}

/// `blebridge check-config FILE`.
public enum CheckConfigCommand: CLICommand {
    /// The subcommand's name.
    public static let name = "check-config"
    /// One line for `--help`.
    public static let summary = "validate a configuration file and print the effective configuration"
    /// Usage.
    public static let usage = """
        usage: blebridge check-config FILE

        Checks FILE (YAML or JSON, see config/README.md) and prints the effective configuration as JSON with
        secrets masked. Every problem is printed as `path: reason`. Exit status 0 when valid, 78 when not.
        """

    /// Runs it.
    public static func run(_ arguments: [String]) async -> Int32 {
        guard arguments.count == 1 else {
            writeErr("blebridge check-config: expected one FILE\n\n\(usage)")
            return ExitCode.usage
        }
        switch loadConfig(arguments[0]) {
        case .failure(let errors):
            for e in errors.errors { writeErr("\(arguments[0]): \(e)") }
            writeErr("blebridge check-config: \(errors.errors.count) problem\(errors.errors.count == 1 ? "" : "s")")
            return ExitCode.configError
        case .success(let config):
            // The broker settings are checked the way `run` checks them (URL form, TLS files, client options).
            do {
                _ = try MQTTBrokerTransport(
                    settings: config.mqtt, defaultClientID: "blebridge-check", gateway: config.gateway?.id)
            } catch {
                writeErr("\(arguments[0]): \(error)")
                writeErr("blebridge check-config: 1 problem")
                return ExitCode.configError
            }
            writeOut(EffectiveConfig.json(config).text)
            return ExitCode.success
        }
    }
}

/// What `run` and `serve` read from their command line: the arguments, the checked configuration and the logger
/// (`--log-level`, `--log-json`, or the configuration's `logging`).
struct DaemonStart {
    let args: BLEArguments
    let path: String
    let config: BridgeConfig
    let logger: Logger

    /// Parses `--config FILE [--log-level LEVEL] [--log-json]` plus `valued`, loads the file, or prints why not
    /// and gives the exit status (64 usage, 78 configuration).
    static func parse(_ arguments: [String], command: String, usage: String, valued: Set<String>)
        -> Result<DaemonStart, StartFailure>
    {
        let args: BLEArguments
        do {
            args = try BLEArguments(
                arguments, valued: Set(["--config", "--log-level"]).union(valued), flags: ["--log-json"])
        } catch {
            writeErr("blebridge \(command): \(error.message)")
            return .failure(StartFailure(code: ExitCode.usage))
        }
        guard let path = args.value("--config"), args.positional.isEmpty else {
            writeErr("blebridge \(command): --config FILE is required\n\n\(usage)")
            return .failure(StartFailure(code: ExitCode.usage))
        }
        let config: BridgeConfig
        switch loadConfig(path) {
        case .failure(let errors):
            for e in errors.errors { writeErr("blebridge \(command): \(path): \(e)") }
            return .failure(StartFailure(code: ExitCode.configError))
        case .success(let c): config = c
        }
        let levelName = args.value("--log-level") ?? config.logging.level
        guard let level = LogLevel(name: levelName) else {
            writeErr(
                "blebridge \(command): --log-level: '\(levelName)' is not one of trace, debug, info, warning, error")
            return .failure(StartFailure(code: ExitCode.usage))
        }
        let format: StandardErrorLogHandler.Format =
            args.flags.contains("--log-json") || config.logging.format == "json" ? .json : .text
        let logger = Logger(handler: StandardErrorLogHandler(format: format), level: level)
        return .success(DaemonStart(args: args, path: path, config: config, logger: logger))
    }
}

/// `blebridge serve --config FILE`.
public enum ServeCommand: CLICommand {
    /// The subcommand's name.
    public static let name = "serve"
    /// One line for `--help`.
    public static let summary = "run only the peripheral role: MQTT values served over GATT and broadcast"
    /// Usage.
    public static let usage = """
        usage: blebridge serve --config FILE [--log-level LEVEL] [--log-json]

        Runs only the configuration's `peripheral:` section (GATT services bound to MQTT topics, the connectable
        advertisement and the BTHome broadcast) until SIGTERM or SIGINT; the central role (devices) is not started.
        FILE is documented in config/README.md.
          --config FILE       the configuration (YAML or JSON) with a `peripheral:` section
          --log-level LEVEL   trace, debug, info, warning, error (overrides logging.level)
          --log-json          log JSON lines instead of text (overrides logging.format)
        """

    /// Runs it.
    public static func run(_ arguments: [String]) async -> Int32 {
        let start: DaemonStart
        switch DaemonStart.parse(arguments, command: name, usage: usage, valued: []) {
        case .failure(let exit): return exit.code
        case .success(let s): start = s
        }
        guard start.config.peripheral != nil else {
            writeErr("blebridge serve: \(start.path): no 'peripheral' section: nothing to serve (see config/README.md)")
            return ExitCode.configError
        }
        return await ServeDaemon(config: start.config, logger: start.logger).run()
    }
}

/// `blebridge run --config FILE`.
public enum RunCommand: CLICommand {
    /// The subcommand's name.
    public static let name = "run"
    /// One line for `--help`.
    public static let summary = "run the bridge: configured sensors to MQTT, and commands back"
    /// Usage.
    public static let usage = """
        usage: blebridge run --config FILE [--state-dir DIR] [--log-level LEVEL] [--log-json]

        Runs the bridge until SIGTERM or SIGINT. FILE is documented in config/README.md.
          --config FILE       the configuration (YAML or JSON)
          --log-level LEVEL   trace, debug, info, warning, error (overrides logging.level)
          --log-json          log JSON lines instead of text (overrides logging.format)
          --state-dir DIR     where the bridge keeps its state across restarts (default: $STATE_DIRECTORY, set by
                              systemd's StateDirectory=; without either, nothing is kept)
        The BlueZ system bus is the one in DBUS_SYSTEM_BUS_ADDRESS, or the system bus.
        """

    /// Runs it.
    public static func run(_ arguments: [String]) async -> Int32 {
        let start: DaemonStart
        switch DaemonStart.parse(arguments, command: name, usage: usage, valued: ["--state-dir"]) {
        case .failure(let exit): return exit.code
        case .success(let s): start = s
        }
        let (args, path, config, logger) = (start.args, start.path, start.config, start.logger)
        var stateDirectory = args.value("--state-dir") ?? currentEnvironment()["STATE_DIRECTORY"]
        // systemd may pass several directories separated by ':'; the first is ours.
        if let first = stateDirectory?.split(separator: ":").first { stateDirectory = String(first) }
        if config.mqtt.offlineQueueOnDisk, stateDirectory == nil {
            writeErr("blebridge run: mqtt.offline_queue: disk needs a state directory (--state-dir or StateDirectory=)")
            return ExitCode.configError
        }
        return await Daemon(config: config, configPath: path, stateDirectory: stateDirectory, logger: logger).run()
    }
}
