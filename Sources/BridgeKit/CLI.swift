// The `blebridge` command line plumbing: exit codes, the subcommand protocol, output helpers and the dispatcher.
#if canImport(Glibc)
    import Glibc
#endif

/// Exit codes the tools use (sysexits.h where one fits).
public enum ExitCode {
    /// The command did what was asked.
    public static let success: Int32 = 0
    /// Bad command-line usage.
    public static let usage: Int32 = 64
    /// Input data was rejected (a payload that fails to decode).
    public static let dataError: Int32 = 65
    /// The adapter, device or characteristic is not available.
    public static let unavailable: Int32 = 69
    /// The adapter or device refused the operation (BlueZ NotPermitted / NotAuthorized).
    public static let notPermitted: Int32 = 77
    /// Any other failure.
    public static let failure: Int32 = 1
    /// The configuration file is invalid (sysexits.h EX_CONFIG).
    public static let configError: Int32 = 78
}

/// One `blebridge` subcommand.
public protocol CLICommand: Sendable {
    /// The word on the command line (`decode`).
    static var name: String { get }
    /// One line for `blebridge --help`.
    static var summary: String { get }
    /// Usage text for `blebridge NAME --help`.
    static var usage: String { get }
    /// Runs with the arguments after the subcommand's name; returns the exit code.
    static func run(_ arguments: [String]) async -> Int32
}

/// Writes a line to stdout (flushed, so pipes see it at once).
public func writeOut(_ line: String) {
    var text = line
    text.append("\n")
    _ = text.withCString { write(1, $0, strlen($0)) }
}

/// Writes a line to stderr.
public func writeErr(_ line: String) {
    var text = line
    text.append("\n")
    _ = text.withCString { write(2, $0, strlen($0)) }
}

/// Dispatches `blebridge SUBCOMMAND ...` over a table of subcommands (the executable supplies the table, so neither
/// the tools nor the daemon import each other's commands).
public struct CommandLineDispatcher: Sendable {
    /// Every subcommand, in the order `--help` lists them.
    public let commands: [any CLICommand.Type]

    /// The version `--version` prints.
    public let version: String

    /// A dispatcher over `commands`.
    public init(commands: [any CLICommand.Type], version: String) {
        self.commands = commands
        self.version = version
    }

    /// Runs the command line (without the program name) and returns the exit code.
    public func main(_ arguments: [String]) async -> Int32 {
        guard let first = arguments.first, first != "--help", first != "-h", first != "help" else {
            writeOut(helpText)
            return arguments.isEmpty ? ExitCode.usage : ExitCode.success
        }
        if first == "--version" || first == "version" {
            writeOut("blebridge \(version)")
            return ExitCode.success
        }
        guard let command = commands.first(where: { $0.name == first }) else {
            writeErr("blebridge: unknown command '\(first)'\n\n\(helpText)")
            return ExitCode.usage
        }
        let rest = Array(arguments.dropFirst())
        if rest.contains("--help") || rest.contains("-h") {
            writeOut(command.usage)
            return ExitCode.success
        }
        return await command.run(rest)
    }

    var helpText: String {
        var text = "usage: blebridge COMMAND [OPTIONS]\n\ncommands:\n"
        for command in commands {
            let pad = String(repeating: " ", count: max(1, 13 - command.name.count))
            text += "  \(command.name)\(pad)\(command.summary)\n"
        }
        text += "\nRun 'blebridge COMMAND --help' for a command's options; 'blebridge --version' for the version."
        return text
    }
}
