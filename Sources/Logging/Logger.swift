// One logging facility for every layer, in the swift-log shape: a library takes a logger, never configures logging
// globally; the program picks the handler (stderr text, JSON lines, or memory in tests).

/// How much a log line matters.
public enum LogLevel: Int, Sendable, Comparable, CustomStringConvertible {
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
    public static func < (lhs: LogLevel, rhs: LogLevel) -> Bool { lhs.rawValue < rhs.rawValue }

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
public protocol LogHandler: Sendable {
    /// Records one line. `metadata` uses stable keys (`component`, `device`, `ble.address`, `gatt.uuid`, `mqtt.topic`).
    func log(level: LogLevel, message: String, metadata: [String: String])
}

/// A logger: a handler, a minimum level and metadata added to every line.
public struct Logger: Sendable {
    /// The handler, or nil to drop everything.
    public var handler: (any LogHandler)?
    /// Lines below this level are not built.
    public var level: LogLevel
    /// Added to every line.
    public var metadata: [String: String]

    /// A logger writing to `handler` at `level` and above.
    public init(handler: (any LogHandler)?, level: LogLevel = .info, metadata: [String: String] = [:]) {
        self.handler = handler
        self.level = level
        self.metadata = metadata
    }

    /// A logger that drops everything.
    public static let disabled = Logger(handler: nil)

    /// This logger with more metadata.
    public func with(_ extra: [String: String]) -> Logger {
        var copy = self
        copy.metadata.merge(extra) { $1 }
        return copy
    }

    /// Logs `message` at `level`; the message is only built when the level is enabled.
    public func log(_ level: LogLevel, _ message: @autoclosure () -> String, _ extra: [String: String] = [:]) {
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

extension Logger {
    /// This logger labelled with a component (`bridge`, `mqtt`, `bluez`) and, optionally, a device.
    public func labelled(component: String? = nil, device: String? = nil) -> Logger {
        var extra: [String: String] = [:]
        if let component { extra["component"] = component }
        if let device { extra["device"] = device }
        return with(extra)
    }
}

extension LogLevel {
    /// Parses `trace`, `debug`, `info`, `warning` (or `warn`), `error`; nil for anything else.
    public init?(name: String) {
        switch name.lowercased() {
        case "trace": self = .trace
        case "debug": self = .debug
        case "info": self = .info
        case "warning", "warn": self = .warning
        case "error": self = .error
        default: return nil
        }
    }

    /// The syslog priority journald reads from a `<N>` line prefix (sd-daemon(3)).
    public var syslogPriority: Int {
        switch self {
        case .trace, .debug: return 7
        case .info: return 6
        case .warning: return 4
        case .error: return 3
        }
    }
}

/// Several handlers behind one: each line goes to all of them.
public struct FanOutLogHandler: LogHandler {
    /// The handlers, in order.
    public var handlers: [any LogHandler]
    /// A handler that forwards to `handlers`.
    public init(_ handlers: [any LogHandler]) { self.handlers = handlers }
    /// Forwards the line to every handler.
    public func log(level: LogLevel, message: String, metadata: [String: String]) {
        for handler in handlers { handler.log(level: level, message: message, metadata: metadata) }
    }
}

/// A handler that calls a closure (for forwarding warnings to MQTT, counting errors...).
public struct ClosureLogHandler: LogHandler {
    let body: @Sendable (LogLevel, String, [String: String]) -> Void
    /// A handler that calls `body` for each line at `minimum` level and above.
    public init(minimum: LogLevel = .trace, _ body: @escaping @Sendable (LogLevel, String, [String: String]) -> Void) {
        self.body = { level, message, metadata in
            if level >= minimum { body(level, message, metadata) }
        }
    }
    /// Calls the closure.
    public func log(level: LogLevel, message: String, metadata: [String: String]) { body(level, message, metadata) }
}
