// A small value-type logger in the swift-log shape: the library takes a logger, never configures logging globally.

/// How much a log line matters.
public enum BlueZLogLevel: Int, Sendable, Comparable, CustomStringConvertible {
    /// Bytes and every signal.
    case trace
    /// Decisions (retries, fallbacks).
    case debug
    /// What an operator wants in the journal.
    case info
    /// Something went wrong and was handled.
    case warning
    /// Something went wrong and was not.
    case error

    /// Orders levels by severity (trace lowest).
    public static func < (lhs: BlueZLogLevel, rhs: BlueZLogLevel) -> Bool { lhs.rawValue < rhs.rawValue }

    /// The text people read in logs and error output.
    public var description: String {
        switch self {
        case .trace: return "trace"
        case .debug: return "debug"
        case .info: return "info"
        case .warning: return "warning"
        case .error: return "error"
        }
    }
}

/// Where log lines go. Called from any thread; implementations must be thread-safe.
public protocol BlueZLogHandler: Sendable {
    /// Records one line. `metadata` uses stable keys (`ble.address`, `ble.adapter`, `gatt.uuid`).
    func log(level: BlueZLogLevel, message: String, metadata: [String: String])
}

/// A logger: a handler, a minimum level and metadata added to every line.
public struct BlueZLogger: Sendable {
    /// The handler, or nil to drop everything.
    public var handler: (any BlueZLogHandler)?
    /// Lines below this level are not built.
    public var level: BlueZLogLevel
    /// Added to every line.
    public var metadata: [String: String]

    /// A logger writing to `handler` at `level` and above.
    public init(handler: (any BlueZLogHandler)?, level: BlueZLogLevel = .info, metadata: [String: String] = [:]) {
        self.handler = handler
        self.level = level
        self.metadata = metadata
    }

    /// A logger that drops everything.
    public static let disabled = BlueZLogger(handler: nil)

    /// This logger with more metadata.
    public func with(_ extra: [String: String]) -> BlueZLogger {
        var copy = self
        copy.metadata.merge(extra) { $1 }
        return copy
    }

    /// Logs `message` at `level`; the message is only built when the level is enabled.
    public func log(_ level: BlueZLogLevel, _ message: @autoclosure () -> String, _ extra: [String: String] = [:]) {
        guard let handler, level >= self.level else { return }
        handler.log(
            level: level, message: message(), metadata: extra.isEmpty ? metadata : metadata.merging(extra) { $1 })
    }

    /// Logs `message` at trace level.
    public func trace(_ message: @autoclosure () -> String, _ extra: [String: String] = [:]) {
        log(.trace, message(), extra)
    }
    /// Logs `message` at debug level.
    public func debug(_ message: @autoclosure () -> String, _ extra: [String: String] = [:]) {
        log(.debug, message(), extra)
    }
    /// Logs `message` at info level.
    public func info(_ message: @autoclosure () -> String, _ extra: [String: String] = [:]) {
        log(.info, message(), extra)
    }
    /// Logs `message` at warning level.
    public func warning(_ message: @autoclosure () -> String, _ extra: [String: String] = [:]) {
        log(.warning, message(), extra)
    }
    /// Logs `message` at error level.
    public func error(_ message: @autoclosure () -> String, _ extra: [String: String] = [:]) {
        log(.error, message(), extra)
    }
}
