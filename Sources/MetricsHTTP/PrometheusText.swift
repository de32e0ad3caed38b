// Prometheus' text exposition format, version 0.0.4 (prometheus.io/docs/instrumenting/exposition_formats/): each
// family once, as `# HELP`, `# TYPE` and then all of its samples together.

/// Why a sample could not be added to a ``PrometheusText``.
public enum PrometheusTextError: Error, Equatable, CustomStringConvertible {
    /// A metric name outside `[a-zA-Z_:][a-zA-Z0-9_:]*`.
    case invalidMetricName(String)
    /// A label name outside `[a-zA-Z_][a-zA-Z0-9_]*`, or starting with the reserved `__`.
    case invalidLabelName(metric: String, label: String)
    /// The family was added before as another type.
    case typeConflict(metric: String, existing: String, requested: String)
    /// The family was added before with another help text.
    case helpConflict(metric: String)
    /// A sample with this name and these labels is already there.
    case duplicateSample(metric: String, labels: [String: String])
    /// Counters only go up from zero.
    case negativeCounter(metric: String, value: Double)

    /// The text people read: which metric, and what is wrong with it.
    public var description: String {
        switch self {
        case .invalidMetricName(let name):
            return "metric name \"\(name)\" is not valid (letters, digits, '_' and ':', not starting with a digit)"
        case .invalidLabelName(let metric, let label):
            return
                "metric \(metric): label name \"\(label)\" is not valid (letters, digits and '_', not starting with a "
                + "digit or \"__\")"
        case .typeConflict(let metric, let existing, let requested):
            return "metric \(metric) is already a \(existing); it cannot also be a \(requested)"
        case .helpConflict(let metric):
            return "metric \(metric) was already added with another help text"
        case .duplicateSample(let metric, let labels):
            let pairs = labels.keys.sorted().map { "\($0)=\"\(labels[$0] ?? "")\"" }.joined(separator: ",")
            return "metric \(metric){\(pairs)} was added twice"
        case .negativeCounter(let metric, let value):
            return "counter \(metric) cannot be \(PrometheusText.format(value)); counters are never negative"
        }
    }
}

/// Builds one scrape's worth of metrics in Prometheus' text format.
///
/// Samples of one family may be added in any order, interleaved with others: the output groups them under one
/// `# HELP` and `# TYPE`, families in the order they were first added, label pairs sorted by name.
public struct PrometheusText: Sendable {
    /// The `Content-Type` to serve ``bytes`` with.
    public static let contentType = "text/plain; version=0.0.4; charset=utf-8"

    private struct Family: Sendable {
        var name: String
        var type: String
        var help: String
        var samples: [(labels: [String: String], value: Double)]
    }

    private var families: [Family] = []
    private var index: [String: Int] = [:]

    /// An empty exposition.
    public init() {}

    /// Adds a counter sample.
    ///
    /// - Parameters:
    ///   - name: the family name, conventionally ending in `_total`.
    ///   - help: what it counts (one line; backslashes and newlines are escaped).
    ///   - labels: label names and values; values may hold any text.
    ///   - value: the count, zero or more.
    /// - Throws: ``PrometheusTextError`` for invalid names, a negative value, or a clash with an earlier sample.
    public mutating func counter(name: String, help: String, labels: [String: String] = [:], value: Double)
        throws(PrometheusTextError)
    {
        if value < 0 { throw .negativeCounter(metric: name, value: value) }
        try add(type: "counter", name: name, help: help, labels: labels, value: value)
    }

    /// Adds a gauge sample.
    ///
    /// - Parameters:
    ///   - name: the family name, with its unit (`_bytes`, `_seconds`).
    ///   - help: what it measures (one line; backslashes and newlines are escaped).
    ///   - labels: label names and values; values may hold any text.
    ///   - value: the current value; NaN and infinities are written as Prometheus writes them.
    /// - Throws: ``PrometheusTextError`` for invalid names or a clash with an earlier sample.
    public mutating func gauge(name: String, help: String, labels: [String: String] = [:], value: Double)
        throws(PrometheusTextError)
    {
        try add(type: "gauge", name: name, help: help, labels: labels, value: value)
    }

    private mutating func add(type: String, name: String, help: String, labels: [String: String], value: Double)
        throws(PrometheusTextError)
    {
        guard Self.isValidMetricName(name) else { throw .invalidMetricName(name) }
        for label in labels.keys where !Self.isValidLabelName(label) {
            throw .invalidLabelName(metric: name, label: label)
        }
        if let position = index[name] {
            let family = families[position]
            guard family.type == type else {
                throw .typeConflict(metric: name, existing: family.type, requested: type)
            }
            guard family.help == help else { throw .helpConflict(metric: name) }
            if family.samples.contains(where: { $0.labels == labels }) {
                throw .duplicateSample(metric: name, labels: labels)
            }
            families[position].samples.append((labels, value))
        } else {
            index[name] = families.count
            families.append(Family(name: name, type: type, help: help, samples: [(labels, value)]))
        }
    }

    /// The exposition text: every family, each line ending in a newline.
    public var text: String {
        var out = ""
        for family in families {
            out += "# HELP \(family.name) \(Self.escapeHelp(family.help))\n"
            out += "# TYPE \(family.name) \(family.type)\n"
            for sample in family.samples {
                out += family.name
                if !sample.labels.isEmpty {
                    let pairs = sample.labels.keys.sorted().map {
                        "\($0)=\"\(Self.escapeLabelValue(sample.labels[$0] ?? ""))\""
                    }
                    out += "{" + pairs.joined(separator: ",") + "}"
                }
                out += " \(Self.format(sample.value))\n"
            }
        }
        return out
    }

    /// ``text`` as UTF-8, ready to serve with ``contentType``.
    public var bytes: [UInt8] { Array(text.utf8) }

    /// A sample value as Prometheus writes it: `+Inf`, `-Inf`, `NaN`, whole numbers without a fraction, others in
    /// the shortest form that reads back as the same `Double`.
    public static func format(_ value: Double) -> String {
        if value.isNaN { return "NaN" }
        if value.isInfinite { return value < 0 ? "-Inf" : "+Inf" }
        // Whole numbers below 2^53 are exact as integers, which is how counters usually look.
        if value == value.rounded(), abs(value) < 9_007_199_254_740_992 {
            return String(Int64(value))
        }
        return value.description
    }

    /// Escapes a label value: backslash, double quote and newline.
    public static func escapeLabelValue(_ value: String) -> String {
        var out = ""
        for character in value.unicodeScalars {
            switch character {
            case "\\": out += "\\\\"
            case "\"": out += "\\\""
            case "\n": out += "\\n"
            default: out.unicodeScalars.append(character)
            }
        }
        return out
    }

    /// Escapes a help text: backslash and newline.
    public static func escapeHelp(_ help: String) -> String {
        var out = ""
        for character in help.unicodeScalars {
            switch character {
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            default: out.unicodeScalars.append(character)
            }
        }
        return out
    }

    /// Whether `name` matches `[a-zA-Z_:][a-zA-Z0-9_:]*`.
    public static func isValidMetricName(_ name: String) -> Bool {
        isValidName(name, allowColon: true)
    }

    /// Whether `name` matches `[a-zA-Z_][a-zA-Z0-9_]*` and does not start with the reserved `__`.
    public static func isValidLabelName(_ name: String) -> Bool {
        isValidName(name, allowColon: false) && !name.hasPrefix("__")
    }

    private static func isValidName(_ name: String, allowColon: Bool) -> Bool {
        guard let first = name.utf8.first else { return false }
        func isLetter(_ byte: UInt8) -> Bool {
            (byte >= 0x41 && byte <= 0x5A) || (byte >= 0x61 && byte <= 0x7A) || byte == 0x5F
                || (allowColon && byte == 0x3A)
        }
        guard isLetter(first) else { return false }
        return name.utf8.allSatisfy { isLetter($0) || ($0 >= 0x30 && $0 <= 0x39) }
    }
}
