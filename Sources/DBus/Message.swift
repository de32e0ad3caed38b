// D-Bus messages and match rules as Swift values.

/// A D-Bus message (header fields and body) as a Swift value.
public struct DBusMessage: Sendable {
    /// The four message types.
    public enum MessageType: Sendable, Hashable {
        case methodCall, methodReturn, error, signal

        /// The name used in match rules (`method_call`, `signal`...).
        public var ruleName: String {
            switch self {
            case .methodCall: return "method_call"
            case .methodReturn: return "method_return"
            case .error: return "error"
            case .signal: return "signal"
            }
        }
    }

    /// The message type.
    public var type: MessageType
    /// The serial (assigned when sent; 0 on a message built here).
    public var serial: UInt32
    /// The serial of the call this message answers.
    public var replySerial: UInt32?
    /// The object path (method calls and signals).
    public var path: DBusObjectPath?
    /// The interface (method calls and signals).
    public var interface: String?
    /// The method or signal name.
    public var member: String?
    /// The error name (error messages).
    public var errorName: String?
    /// The destination bus name.
    public var destination: String?
    /// The sender's unique name (set by the bus).
    public var sender: String?
    /// The arguments.
    public var body: [DBusValue]
    /// For method calls: the caller does not want a reply.
    public var noReplyExpected: Bool = false

    /// Creates a message from its parts.
    public init(
        type: MessageType, serial: UInt32 = 0, replySerial: UInt32? = nil, path: DBusObjectPath? = nil,
        interface: String? = nil, member: String? = nil, errorName: String? = nil, destination: String? = nil,
        sender: String? = nil, body: [DBusValue] = []
    ) {
        self.type = type
        self.serial = serial
        self.replySerial = replySerial
        self.path = path
        self.interface = interface
        self.member = member
        self.errorName = errorName
        self.destination = destination
        self.sender = sender
        self.body = body
    }

    /// The signature of the body.
    public var signature: DBusSignature { DBusSignature(unchecked: body.map(\.signatureText).joined()) }

    /// A method call.
    public static func methodCall(
        destination: String?, path: DBusObjectPath, interface: String?, method: String, body: [DBusValue] = []
    ) -> DBusMessage {
        DBusMessage(
            type: .methodCall, path: path, interface: interface, member: method, destination: destination, body: body)
    }

    /// A signal.
    public static func signal(path: DBusObjectPath, interface: String, name: String, body: [DBusValue] = [])
        -> DBusMessage
    {
        DBusMessage(type: .signal, path: path, interface: interface, member: name, body: body)
    }

    /// For an error message: the error it carries (the first string argument is the message).
    public var error: DBusError? {
        guard type == .error else { return nil }
        return DBusError(name: errorName ?? DBusError.failed, message: body.first?.string ?? "")
    }
}

/// A match rule for `AddMatch` and for routing received signals locally.
public struct DBusMatchRule: Hashable, Sendable {
    /// The message type (`signal` by default).
    public var type: DBusMessage.MessageType? = .signal
    /// The sender (unique or well-known name).
    public var sender: String?
    /// The interface.
    public var interface: String?
    /// The member.
    public var member: String?
    /// The exact object path.
    public var path: DBusObjectPath?
    /// The path and everything below it.
    public var pathNamespace: DBusObjectPath?
    /// The destination.
    public var destination: String?
    /// `argN='...'`: string argument N equals the value.
    public var arguments: [Int: String] = [:]
    /// `argNpath='...'`: argument N equals the value, or one is a `/`-terminated prefix of the other.
    public var argumentPaths: [Int: String] = [:]

    /// Creates a rule; every part is optional.
    public init(
        type: DBusMessage.MessageType? = .signal, sender: String? = nil, interface: String? = nil,
        member: String? = nil, path: DBusObjectPath? = nil, pathNamespace: DBusObjectPath? = nil,
        arguments: [Int: String] = [:], argumentPaths: [Int: String] = [:], destination: String? = nil
    ) {
        self.type = type
        self.sender = sender
        self.interface = interface
        self.member = member
        self.path = path
        self.pathNamespace = pathNamespace
        self.arguments = arguments
        self.argumentPaths = argumentPaths
        self.destination = destination
    }

    /// The rule text given to `AddMatch`, with values quoted and `'` escaped.
    public var rule: String {
        var parts: [String] = []
        func add(_ key: String, _ value: String?) {
            guard let value else { return }
            parts.append("\(key)=\(DBusMatchRule.quote(value))")
        }
        add("type", type?.ruleName)
        add("sender", sender)
        add("interface", interface)
        add("member", member)
        add("path", path?.rawValue)
        add("path_namespace", pathNamespace?.rawValue)
        add("destination", destination)
        for (index, value) in arguments.sorted(by: { $0.key < $1.key }) { add("arg\(index)", value) }
        for (index, value) in argumentPaths.sorted(by: { $0.key < $1.key }) { add("arg\(index)path", value) }
        return parts.joined(separator: ",")
    }

    static func quote(_ value: String) -> String {
        var out = "'"
        for character in value {
            if character == "'" { out += "'\\''" } else { out.append(character) }
        }
        return out + "'"
    }

    /// True when `message` satisfies this rule, as the bus would decide.
    ///
    /// A well-known `sender` cannot be checked locally (messages carry the unique name) and is assumed to match;
    /// the bus already filtered by it.
    public func matches(_ message: DBusMessage) -> Bool {
        if let type, type != message.type { return false }
        if let sender, sender.hasPrefix(":") || sender == "org.freedesktop.DBus", sender != message.sender {
            return false
        }
        if let interface, interface != message.interface { return false }
        if let member, member != message.member { return false }
        if let path, path != message.path { return false }
        if let pathNamespace {
            guard let messagePath = message.path, messagePath.isDescendant(ofOrEqualTo: pathNamespace) else {
                return false
            }
        }
        if let destination, let target = message.destination, destination != target { return false }
        for (index, value) in arguments {
            guard index >= 0, index < message.body.count, case .string(let s) = message.body[index], s == value
            else { return false }
        }
        for (index, value) in argumentPaths {
            guard index >= 0, index < message.body.count else { return false }
            let argument: String
            switch message.body[index] {
            case .string(let s): argument = s
            case .objectPath(let p): argument = p.rawValue
            default: return false
            }
            if argument == value { continue }
            if value.hasSuffix("/") && argument.hasPrefix(value) { continue }
            if argument.hasSuffix("/") && value.hasPrefix(argument) { continue }
            return false
        }
        return true
    }
}
