// Every topic the bridge publishes or subscribes to, in one place (config/README.md lists them).

/// The bridge's topic layout under a base topic (`blebridge` by default).
public struct BridgeTopics: Sendable, Hashable {
    /// The base topic.
    public let base: String
    /// Home Assistant's discovery prefix.
    public let discoveryPrefix: String

    /// Topics under `base`.
    public init(base: String, discoveryPrefix: String = "homeassistant") {
        self.base = base
        self.discoveryPrefix = discoveryPrefix
    }

    /// `blebridge/<device>`: the JSON state.
    public func state(_ device: String) -> String { "\(base)/\(device)" }
    /// `blebridge/<device>/<field>`: one plain value.
    public func attribute(_ device: String, _ field: String) -> String { "\(base)/\(device)/\(field)" }
    /// `blebridge/<device>/availability`.
    public func availability(_ device: String) -> String { "\(base)/\(device)/availability" }
    /// `blebridge/<device>/set` (and `/set/<name>`).
    public func set(_ device: String) -> String { "\(base)/\(device)/set" }
    /// `blebridge/<device>/get`.
    public func get(_ device: String) -> String { "\(base)/\(device)/get" }
    /// `blebridge/bridge/state`.
    public var bridgeState: String { "\(base)/bridge/state" }
    /// `blebridge/bridge/info`.
    public var bridgeInfo: String { "\(base)/bridge/info" }
    /// `blebridge/bridge/devices`.
    public var bridgeDevices: String { "\(base)/bridge/devices" }
    /// `blebridge/bridge/event`.
    public var bridgeEvent: String { "\(base)/bridge/event" }
    /// `blebridge/bridge/logging`.
    public var bridgeLogging: String { "\(base)/bridge/logging" }
    /// `blebridge/bridge/health`.
    public var bridgeHealth: String { "\(base)/bridge/health" }
    /// `blebridge/bridge/request/<op>`.
    public func request(_ op: String) -> String { "\(base)/bridge/request/\(op)" }
    /// `blebridge/bridge/response/<op>`.
    public func response(_ op: String) -> String { "\(base)/bridge/response/\(op)" }
    /// `homeassistant/device/<id>/config`.
    public func discovery(_ objectID: String) -> String { "\(discoveryPrefix)/device/\(objectID)/config" }

    /// The filters the bridge subscribes to.
    public var subscriptions: [String] {
        ["\(base)/+/set", "\(base)/+/set/+", "\(base)/+/get", "\(base)/+/get/+", "\(base)/bridge/request/#"]
    }

    /// What an incoming topic asks for.
    public enum Command: Sendable, Equatable {
        /// `/set` with a JSON object, or `/set/<name>` with a plain value.
        case set(device: String, name: String?)
        /// `/get` with a JSON object, or `/get/<name>`.
        case get(device: String, name: String?)
        /// `bridge/request/<op>`.
        case request(op: String)
    }

    /// Classifies an incoming topic; nil for anything else (including our own result topics).
    public func command(for topic: String) -> Command? {
        let prefix = base + "/"
        guard topic.hasPrefix(prefix) else { return nil }
        let rest = topic.dropFirst(prefix.count).split(separator: "/", omittingEmptySubsequences: false).map(
            String.init)
        if rest.count >= 3, rest[0] == "bridge", rest[1] == "request" {
            return .request(op: rest[2...].joined(separator: "/"))
        }
        guard rest.count == 2 || rest.count == 3, rest[0] != "bridge" else { return nil }
        let name = rest.count == 3 ? rest[2] : nil
        if name == "result" { return nil }
        switch rest[1] {
        case "set": return .set(device: rest[0], name: name)
        case "get": return .get(device: rest[0], name: name)
        default: return nil
        }
    }
}
