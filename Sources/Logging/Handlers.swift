// Handlers for programs and tests: stderr as text (journald-friendly) or JSON lines, and memory.
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Writes each line to stderr in one `write(2)`, so lines from several threads never interleave.
///
/// Text lines look like `info  bridge [kitchen]: connected`; under journald (`JOURNAL_STREAM` set) each line starts
/// with the `<N>` priority prefix journald understands, and colours are used only when stderr is a terminal.
/// JSON lines are one object per line: `{"level":"info","component":"bridge","device":"kitchen","message":"..."}`.
public struct StandardErrorLogHandler: LogHandler {
    /// Output format.
    public enum Format: String, Sendable {
        /// Human-readable text.
        case text
        /// One JSON object per line.
        case json
    }

    let format: Format
    let colours: Bool
    let journald: Bool

    /// A handler in `format`; colours and journald prefixes are detected from the environment.
    public init(format: Format = .text) {
        self.format = format
        colours = isatty(2) != 0 && getenv("NO_COLOR") == nil
        journald = getenv("JOURNAL_STREAM") != nil
    }

    /// Writes the line.
    public func log(level: LogLevel, message: String, metadata: [String: String]) {
        var line = format == .json ? jsonLine(level, message, metadata) : textLine(level, message, metadata)
        line.append("\n")
        _ = line.withCString { write(2, $0, strlen($0)) }
    }

    func textLine(_ level: LogLevel, _ message: String, _ metadata: [String: String]) -> String {
        var line = journald ? "<\(level.syslogPriority)>" : ""
        let name = level.description
        let padded = name + String(repeating: " ", count: max(1, 8 - name.count))
        if colours {
            let code: String
            switch level {
            case .trace, .debug: code = "2"
            case .info: code = "0"
            case .warning: code = "33"
            case .error: code = "31"
            }
            line += "\u{1B}[\(code)m\(padded)\u{1B}[0m"
        } else {
            line += padded
        }
        if let component = metadata["component"] { line += component }
        if let device = metadata["device"] { line += " [\(device)]" }
        if metadata["component"] != nil || metadata["device"] != nil { line += ": " }
        line += message
        return line
    }

    func jsonLine(_ level: LogLevel, _ message: String, _ metadata: [String: String]) -> String {
        var out = "{\"level\":"
        appendQuoted(level.description, to: &out)
        for key in metadata.keys.sorted() {
            out += ","
            appendQuoted(key, to: &out)
            out += ":"
            appendQuoted(metadata[key] ?? "", to: &out)
        }
        out += ",\"message\":"
        appendQuoted(message, to: &out)
        out += "}"
        return out
    }
}

/// Appends `text` as a JSON string literal.
public func appendQuoted(_ text: String, to out: inout String) {
    out += "\""
    for scalar in text.unicodeScalars {
        switch scalar {
        case "\"": out += "\\\""
        case "\\": out += "\\\\"
        case "\n": out += "\\n"
        case "\r": out += "\\r"
        case "\t": out += "\\t"
        default:
            if scalar.value < 0x20 {
                let h = String(scalar.value, radix: 16)
                out += "\\u" + String(repeating: "0", count: 4 - h.count) + h
            } else {
                out.unicodeScalars.append(scalar)
            }
        }
    }
    out += "\""
}

/// Keeps lines in memory (tests).
public final class MemoryLogHandler: LogHandler {
    /// One recorded line.
    public struct Entry: Sendable, Hashable {
        /// Its level.
        public var level: LogLevel
        /// Its text.
        public var message: String
        /// Its metadata.
        public var metadata: [String: String]
    }

    let storage = Mutex<[Entry]>([])

    /// An empty log.
    public init() {}

    /// Records the line.
    public func log(level: LogLevel, message: String, metadata: [String: String]) {
        storage.withLock { $0.append(Entry(level: level, message: message, metadata: metadata)) }
    }

    /// Every line so far.
    public var entries: [Entry] { storage.withLock { $0 } }
}
