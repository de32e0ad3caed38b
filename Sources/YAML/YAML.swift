// YAML: libyaml's event parser turned into a plain value tree. Parses YAML 1.1 documents and JSON (a flow subset).
// Scalars keep their text and whether they were quoted, so callers decide what a plain `true` or `0x10` means.
internal import CYAML

/// A parsed YAML node with the position it came from (1-based line and column).
public struct YAMLNode: Sendable, Equatable {
    /// The node's content.
    public indirect enum Value: Sendable, Equatable {
        /// A scalar; `quoted` is true for single- or double-quoted and block scalars (never a number or a bool).
        case scalar(String, quoted: Bool)
        /// A mapping, in document order (duplicate keys are rejected at parse time).
        case mapping([(key: String, value: YAMLNode)])
        /// A sequence.
        case sequence([YAMLNode])

        /// Structural equality (mapping order matters).
        public static func == (lhs: Value, rhs: Value) -> Bool {
            switch (lhs, rhs) {
            case (.scalar(let a, let qa), .scalar(let b, let qb)): return a == b && qa == qb
            case (.sequence(let a), .sequence(let b)): return a == b
            case (.mapping(let a), .mapping(let b)):
                return a.count == b.count && zip(a, b).allSatisfy { $0.key == $1.key && $0.value == $1.value }
            default: return false
            }
        }
    }

    /// The content.
    public var value: Value
    /// 1-based line of the node's start (0 when built in code).
    public var line: Int
    /// 1-based column of the node's start (0 when built in code).
    public var column: Int

    /// Creates a node (tests and callers that build trees).
    public init(_ value: Value, line: Int = 0, column: Int = 0) {
        self.value = value
        self.line = line
        self.column = column
    }

    /// True for a plain `~`, `null`, `Null`, `NULL` or an empty plain scalar.
    public var isNull: Bool {
        if case .scalar(let text, false) = value { return ["", "~", "null", "Null", "NULL"].contains(text) }
        return false
    }

    /// The text of a scalar (nil for mappings and sequences).
    public var scalar: String? {
        if case .scalar(let text, _) = value { return text }
        return nil
    }

    /// The entries of a mapping (nil otherwise).
    public var mapping: [(key: String, value: YAMLNode)]? {
        if case .mapping(let entries) = value { return entries }
        return nil
    }

    /// The items of a sequence (nil otherwise).
    public var sequence: [YAMLNode]? {
        if case .sequence(let items) = value { return items }
        return nil
    }

    /// The value for `key` in a mapping.
    public subscript(key: String) -> YAMLNode? {
        mapping?.first { $0.key == key }?.value
    }

    /// A plain boolean scalar (`true/false/yes/no/on/off`, any case); nil for anything else.
    public var bool: Bool? {
        guard case .scalar(let text, false) = value else { return nil }
        switch text.lowercased() {
        case "true", "yes", "on": return true
        case "false", "no", "off": return false
        default: return nil
        }
    }

    /// A plain integer scalar: decimal, `0x` hex, `0o` octal or `0b` binary, optional sign and `_` separators.
    public var integer: Int? {
        guard case .scalar(let raw, false) = value else { return nil }
        var text = String(raw.filter { $0 != "_" })
        var negative = false
        if text.hasPrefix("-") {
            negative = true
            text.removeFirst()
        } else if text.hasPrefix("+") {
            text.removeFirst()
        }
        var radix = 10
        for (prefix, r) in [("0x", 16), ("0X", 16), ("0o", 8), ("0b", 2)] where text.hasPrefix(prefix) {
            radix = r
            text.removeFirst(2)
        }
        // One sign only: Int(_:radix:) would accept a second one ("--5", "0x-5").
        guard let first = text.first, first != "-", first != "+", let magnitude = Int(text, radix: radix) else {
            return nil
        }
        return negative ? -magnitude : magnitude
    }

    /// A plain number scalar (integer or floating point, `.inf`/`.nan` included).
    public var double: Double? {
        if let integer { return Double(integer) }
        guard case .scalar(let text, false) = value else { return nil }
        switch text.lowercased() {
        case ".inf", "+.inf": return .infinity
        case "-.inf": return -.infinity
        case ".nan": return .nan
        default: return Double(text)
        }
    }

    /// A short description of the node's kind for error messages ("a mapping", "a sequence", `"abc"`).
    public var kindDescription: String {
        switch value {
        case .scalar(let text, _): return "\"\(text)\""
        case .mapping: return "a mapping"
        case .sequence: return "a sequence"
        }
    }
}

/// A YAML syntax error with libyaml's problem text and position.
public struct YAMLError: Error, Sendable, Equatable, CustomStringConvertible {
    /// libyaml's problem text (with its context), or the reason the tree was rejected.
    public var message: String
    /// 1-based line of the problem.
    public var line: Int
    /// 1-based column of the problem.
    public var column: Int
    /// Creates an error at a position.
    public init(message: String, line: Int, column: Int) {
        self.message = message
        self.line = line
        self.column = column
    }
    /// `line L, column C: message`.
    public var description: String { "line \(line), column \(column): \(message)" }
}

/// Parses YAML (or JSON) text with libyaml.
public enum YAMLParser {
    /// The deepest nesting of mappings and sequences a document may have; deeper documents are rejected.
    public static let maximumDepth = 256

    /// Parses the first document of `text`. An empty document is an empty mapping.
    /// - Throws: `YAMLError` with the position of a syntax error, a duplicate key, an alias (unsupported) or
    ///   a non-scalar mapping key.
    public static func parse(_ text: String) throws(YAMLError) -> YAMLNode {
        var parser = yaml_parser_t()
        guard yaml_parser_initialize(&parser) == 1 else {
            throw YAMLError(message: "out of memory", line: 0, column: 0)
        }
        defer { yaml_parser_delete(&parser) }
        let bytes = Array(text.utf8)
        return try bytes.withUnsafeBufferPointer { (buffer) throws(YAMLError) -> YAMLNode in
            yaml_parser_set_input_string(&parser, buffer.baseAddress, buffer.count)
            var builder = Builder()
            while true {
                var event = yaml_event_t()
                guard yaml_parser_parse(&parser, &event) == 1 else {
                    let problem = parser.problem.map { String(cString: $0) } ?? "syntax error"
                    let context = parser.context.map { String(cString: $0) + ": " } ?? ""
                    throw YAMLError(
                        message: context + problem, line: Int(parser.problem_mark.line) + 1,
                        column: Int(parser.problem_mark.column) + 1)
                }
                defer { yaml_event_delete(&event) }
                if event.type == YAML_STREAM_END_EVENT || event.type == YAML_DOCUMENT_END_EVENT {
                    return builder.root ?? YAMLNode(.mapping([]), line: 1, column: 1)
                }
                try builder.handle(event)
                if let root = builder.root, builder.stack.isEmpty { return root }
            }
        }
    }

    private struct Builder {
        /// An open mapping or sequence. A class, so that appending to the innermost one mutates it in place: with
        /// enum payloads each append copied the whole array (quadratic on large mappings and sequences).
        final class Frame {
            let isMapping: Bool
            let line: Int
            let column: Int
            var items: [YAMLNode] = []
            var entries: [(key: String, value: YAMLNode)] = []
            /// The entries' keys, so that the duplicate check is O(1) per key.
            var keys: Set<String> = []
            var pendingKey: String?

            init(isMapping: Bool, line: Int, column: Int) {
                self.isMapping = isMapping
                self.line = line
                self.column = column
            }

            var node: YAMLNode {
                YAMLNode(isMapping ? .mapping(entries) : .sequence(items), line: line, column: column)
            }
        }
        var stack: [Frame] = []
        var root: YAMLNode?

        mutating func handle(_ event: yaml_event_t) throws(YAMLError) {
            let line = Int(event.start_mark.line) + 1
            let column = Int(event.start_mark.column) + 1
            switch event.type {
            case YAML_ALIAS_EVENT:
                throw YAMLError(message: "aliases are not supported", line: line, column: column)
            case YAML_SCALAR_EVENT:
                let scalar = event.data.scalar
                let text: String
                if let value = scalar.value {
                    text = String(decoding: UnsafeBufferPointer(start: value, count: Int(scalar.length)), as: UTF8.self)
                } else {
                    text = ""
                }
                let quoted = scalar.style != YAML_PLAIN_SCALAR_STYLE
                try add(YAMLNode(.scalar(text, quoted: quoted), line: line, column: column), line: line, column: column)
            case YAML_SEQUENCE_START_EVENT, YAML_MAPPING_START_EVENT:
                try checkNotKey(line: line, column: column)
                try checkDepth(line: line, column: column)
                stack.append(Frame(isMapping: event.type == YAML_MAPPING_START_EVENT, line: line, column: column))
            case YAML_SEQUENCE_END_EVENT, YAML_MAPPING_END_EVENT:
                guard let frame = stack.popLast() else { return }
                let node = frame.node
                try add(node, line: node.line, column: node.column)
            default:
                break
            }
        }

        /// Rejects nesting deeper than `YAMLParser.maximumDepth`: the value tree is recursive, so freeing or
        /// comparing a tree thousands of levels deep would overflow the stack.
        func checkDepth(line: Int, column: Int) throws(YAMLError) {
            guard stack.count < YAMLParser.maximumDepth else {
                throw YAMLError(
                    message: "nesting deeper than \(YAMLParser.maximumDepth) levels is not supported", line: line,
                    column: column)
            }
        }

        /// A mapping or sequence cannot be a mapping key here.
        func checkNotKey(line: Int, column: Int) throws(YAMLError) {
            if let top = stack.last, top.isMapping, top.pendingKey == nil {
                throw YAMLError(message: "mapping keys must be scalars", line: line, column: column)
            }
        }

        mutating func add(_ node: YAMLNode, line: Int, column: Int) throws(YAMLError) {
            guard let top = stack.last else {
                root = node
                return
            }
            guard top.isMapping else {
                top.items.append(node)
                return
            }
            if let key = top.pendingKey {
                top.entries.append((key, node))
                top.pendingKey = nil
                return
            }
            guard let key = node.scalar else {
                throw YAMLError(message: "mapping keys must be scalars", line: line, column: column)
            }
            guard top.keys.insert(key).inserted else {
                throw YAMLError(message: "duplicate key \"\(key)\"", line: line, column: column)
            }
            top.pendingKey = key
        }
    }
}
