// Every topic the bridge publishes or subscribes to, in one place (config/README.md lists them).

/// The bridge's topic layout under a base topic (`blebridge` by default).
public struct BridgeTopics: Sendable, Hashable {
    /// The base topic.
    public let base: String
    /// Home Assistant's discovery prefix.
    public let discoveryPrefix: String
    /// The gateway id in multi-gateway mode (`gateway.id`); nil: a single gateway.
    public let gateway: String?
    /// Where this bridge's own topics live: `blebridge/bridge`, or `blebridge/bridge/<gateway>` with several.
    public let bridgeRoot: String

    /// Topics under `base`.
    public init(base: String, discoveryPrefix: String = "homeassistant", gateway: String? = nil) {
        self.base = base
        self.discoveryPrefix = discoveryPrefix
        self.gateway = gateway
        bridgeRoot = gateway.map { "\(base)/bridge/\($0)" } ?? "\(base)/bridge"
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
    public var bridgeState: String { "\(bridgeRoot)/state" }
    /// `blebridge/bridge/info`.
    public var bridgeInfo: String { "\(bridgeRoot)/info" }
    /// `blebridge/bridge/devices`.
    public var bridgeDevices: String { "\(bridgeRoot)/devices" }
    /// `blebridge/bridge/event`.
    public var bridgeEvent: String { "\(bridgeRoot)/event" }
    /// `blebridge/bridge/logging`.
    public var bridgeLogging: String { "\(bridgeRoot)/logging" }
    /// `blebridge/bridge/health`.
    public var bridgeHealth: String { "\(bridgeRoot)/health" }
    /// `blebridge/bridge/request/<op>`.
    public func request(_ op: String) -> String { "\(bridgeRoot)/request/\(op)" }
    /// `blebridge/bridge/response/<op>`.
    public func response(_ op: String) -> String { "\(bridgeRoot)/response/\(op)" }
    /// `blebridge/bridge/claims/<device>`: who serves a device (multi-gateway mode).
    public func claim(_ device: String) -> String { "\(base)/bridge/claims/\(device)" }
    /// `blebridge/bridge/<gateway>/sightings`: how this gateway hears the devices (multi-gateway mode).
    public var sightings: String { "\(bridgeRoot)/sightings" }
    /// What the gateways' coordination subscribes to: every gateway's state and sightings, and the claims.
    public var coordinationSubscriptions: [String] {
        ["\(base)/bridge/+/state", "\(base)/bridge/+/sightings", "\(base)/bridge/claims/+"]
    }

    /// `homeassistant/device/<id>/config`.
    public func discovery(_ objectID: String) -> String { "\(discoveryPrefix)/device/\(objectID)/config" }

    /// The filters the bridge subscribes to.
    public var subscriptions: [String] {
        ["\(base)/+/set", "\(base)/+/set/+", "\(base)/+/get", "\(base)/+/get/+", "\(bridgeRoot)/request/#"]
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
        if let gateway {
            if rest.count >= 4, rest[0] == "bridge", rest[1] == gateway, rest[2] == "request" {
                return .request(op: rest[3...].joined(separator: "/"))
            }
        } else if rest.count >= 3, rest[0] == "bridge", rest[1] == "request" {
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
