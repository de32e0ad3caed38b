// Connection settings. Plain values, validated by `MQTTConfiguration.validate()` and again when a client starts;
// config/MQTT.md documents each field for the bridge's config file.

/// Where the broker is: `mqtt://host[:port]` (plain TCP, port 1883) or `mqtts://host[:port]` (TLS, port 8883).
public struct MQTTBrokerURL: Sendable, Hashable, CustomStringConvertible {
    /// Host name or IP address (IPv6 without brackets).
    public var host: String
    /// TCP port.
    public var port: UInt16
    /// True for `mqtts://`.
    public var usesTLS: Bool

    /// Creates a URL from its parts.
    public init(host: String, port: UInt16? = nil, usesTLS: Bool = false) {
        self.host = host
        self.port = port ?? (usesTLS ? 8883 : 1883)
        self.usesTLS = usesTLS
    }

    /// Parses `mqtt://host[:port]` or `mqtts://host[:port]`; an IPv6 host goes in brackets (`mqtt://[::1]:1883`).
    ///
    /// - Throws: `MQTTError` with code `.invalidURL` naming what is wrong (scheme, host, port, user info, path).
    public init(parsing text: String) throws(MQTTError) {
        func fail(_ why: String) -> MQTTError {
            MQTTError(.invalidURL, operation: "parse broker URL \"\(text)\"", detail: why)
        }
        let trimmed = text.trimmingWhitespace()
        // (hasPrefix over the indices rather than firstRange(of:), which would link the regex engine: 0.8 MB.)
        guard let schemeStart = trimmed.indices.first(where: { trimmed[$0...].hasPrefix("://") }) else {
            throw fail("expected mqtt://host[:port] or mqtts://host[:port]")
        }
        let schemeEnd = schemeStart..<trimmed.index(schemeStart, offsetBy: 3)
        let scheme = trimmed[..<schemeEnd.lowerBound].lowercased()
        let tls: Bool
        switch scheme {
        case "mqtt", "tcp": tls = false
        case "mqtts", "ssl": tls = true
        default: throw fail("unsupported scheme \"\(scheme)\" (use mqtt:// or mqtts://)")
        }
        var authority = Substring(trimmed[schemeEnd.upperBound...])
        if let slash = authority.firstIndex(of: "/") {
            guard authority[slash...] == "/" else { throw fail("a broker URL has no path") }
            authority = authority[..<slash]
        }
        guard !authority.contains("@") else {
            throw fail("user name and password go in the username/password settings, not in the URL")
        }
        guard !authority.contains(where: { $0 == "?" || $0 == "#" || $0.isWhitespace }) else {
            throw fail("unexpected character in host")
        }
        var host: Substring
        var portText: Substring?
        if authority.hasPrefix("[") {
            guard let close = authority.firstIndex(of: "]") else { throw fail("unterminated [IPv6] host") }
            host = authority[authority.index(after: authority.startIndex)..<close]
            let rest = authority[authority.index(after: close)...]
            if !rest.isEmpty {
                guard rest.hasPrefix(":") else { throw fail("expected :port after ]") }
                portText = rest.dropFirst()
            }
        } else {
            let parts = authority.split(separator: ":", omittingEmptySubsequences: false)
            guard parts.count <= 2 else { throw fail("IPv6 hosts go in brackets, e.g. mqtt://[::1]:1883") }
            host = parts[0]
            if parts.count == 2 { portText = parts[1] }
        }
        guard !host.isEmpty else { throw fail("missing host") }
        var port: UInt16? = nil
        if let portText {
            guard let value = UInt16(portText), value > 0 else {
                throw fail("port \"\(portText)\" is not a number from 1 to 65535")
            }
            port = value
        }
        self.init(host: String(host), port: port, usesTLS: tls)
    }

    /// The URL with its port, e.g. `mqtt://broker.lan:1883`.
    public var description: String {
        let shownHost = host.contains(":") ? "[\(host)]" : host
        return "\(usesTLS ? "mqtts" : "mqtt")://\(shownHost):\(port)"
    }
}

/// The MQTT protocol revision the client speaks.
public enum MQTTProtocolVersion: String, Sendable, Hashable {
    /// MQTT 3.1.1 (protocol level 4).
    case v311 = "3.1.1"
    /// MQTT 5.0: reason codes, properties, session expiry.
    case v5 = "5"
}

/// TLS settings for `mqtts://` brokers.
public struct MQTTTLSConfiguration: Sendable, Hashable {
    /// A PEM file of trusted CA certificates.
    public var caFile: String?
    /// A directory of trusted CA certificates (hashed names, as `c_rehash` makes). Default when neither is
    /// given: `/etc/ssl/certs`.
    public var caDirectory: String?
    /// A PEM client certificate, for brokers that require one (`require_certificate true`).
    public var certificateFile: String?
    /// The PEM private key of `certificateFile` (unencrypted).
    public var privateKeyFile: String?
    /// Check that the broker's certificate names the host we connect to. Turn off only for test setups:
    /// the connection is then open to a man in the middle.
    public var verifyHostname: Bool

    /// Creates TLS settings.
    public init(
        caFile: String? = nil, caDirectory: String? = nil, certificateFile: String? = nil,
        privateKeyFile: String? = nil, verifyHostname: Bool = true
    ) {
        self.caFile = caFile
        self.caDirectory = caDirectory
        self.certificateFile = certificateFile
        self.privateKeyFile = privateKeyFile
        self.verifyHostname = verifyHostname
    }
}

/// User name and password for the broker.
public struct MQTTCredentials: Sendable, Hashable {
    /// Where the password comes from.
    public enum Password: Sendable, Hashable {
        /// The password itself.
        case literal(String)
        /// A file whose content (one trailing newline removed) is the password; read when the client starts,
        /// so the secret never sits in the main config.
        case file(String)
    }

    /// The user name.
    public var username: String
    /// The password, if any.
    public var password: Password?

    /// Creates credentials.
    public init(username: String, password: Password? = nil) {
        self.username = username
        self.password = password
    }
}

/// The message the broker publishes for us when we vanish without a clean DISCONNECT: an ordinary outgoing
/// message (topic without wildcards, payload, QoS, retain, MQTT 5 properties) set before connecting.
public typealias MQTTWill = MQTTOutgoingMessage

/// How the client retries after the connection is lost or cannot be made.
public struct MQTTReconnectPolicy: Sendable, Hashable {
    /// The wait before the first retry.
    public var initialDelay: Duration
    /// The longest wait between retries; the delay doubles after each failed attempt until it reaches this.
    public var maximumDelay: Duration

    /// Creates a policy. Delays are clamped to at least 10 ms.
    public init(initialDelay: Duration = .seconds(1), maximumDelay: Duration = .seconds(60)) {
        self.initialDelay = initialDelay
        self.maximumDelay = maximumDelay
    }

    /// The delay before retry number `attempt` (1-based): initial * 2^(attempt-1), capped.
    public func delay(forAttempt attempt: Int) -> Duration {
        let floor = Duration.milliseconds(10)
        let initial = max(initialDelay, floor)
        let cap = max(maximumDelay, initial)
        var delay = initial
        var step = 1
        while step < attempt && delay < cap {
            delay = delay * 2
            step += 1
        }
        return min(delay, cap)
    }
}

/// Everything needed to connect to one broker.
public struct MQTTConfiguration: Sendable {
    /// The broker.
    public var broker: MQTTBrokerURL
    /// The client identifier. Required for persistent sessions; when nil the broker assigns one (MQTT 5) or
    /// libmosquitto makes a random one.
    public var clientID: String?
    /// Protocol revision. Default MQTT 5.
    public var protocolVersion: MQTTProtocolVersion
    /// Start with a clean session (true) or resume the broker-side session of `clientID` (false).
    public var cleanSession: Bool
    /// MQTT 5 session expiry for persistent sessions: how long the broker keeps the session after we go away.
    public var sessionExpiry: Duration
    /// Keepalive interval (the broker drops us after 1.5 times this without traffic). At least 5 s.
    public var keepAlive: Duration
    /// User name and password.
    public var credentials: MQTTCredentials?
    /// TLS settings; used (and only allowed) with `mqtts://`. Nil there means the system CA directory.
    public var tls: MQTTTLSConfiguration?
    /// The last will.
    public var will: MQTTWill?
    /// Reconnect backoff.
    public var reconnect: MQTTReconnectPolicy
    /// How many publishes the client holds while disconnected (or while the in-flight window is full) before
    /// it drops: first the oldest QoS 0 message, then the oldest message of any QoS.
    public var offlineQueueCapacity: Int
    /// How many QoS 1/2 publishes may be awaiting the broker's acknowledgement at once (also sent to the broker
    /// as our receive maximum under MQTT 5). 1...32768.
    public var maxInflightMessages: Int
    /// How many received messages each message stream buffers for a slow reader before it drops new ones
    /// (counted in `MQTTClientStatistics.receiveDropped`).
    public var receiveBufferCapacity: Int
    /// The largest MQTT packet, in bytes (fixed header included), the client takes from the broker. Under MQTT 5 it
    /// is sent as the CONNECT's Maximum Packet Size, so the broker drops larger messages instead of forwarding them;
    /// under MQTT 3.1.1 the client drops received messages whose PUBLISH is larger (counted in
    /// `MQTTClientStatistics.receiveOversizeDropped`). 256 bytes to 268,435,460 (the MQTT maximum); default 1 MiB.
    public var maximumIncomingPacketSize: Int
    /// How many bytes (payload plus topic) of received messages each message stream buffers for a slow reader before
    /// it drops new ones, as `receiveBufferCapacity` does for their number (counted in
    /// `MQTTClientStatistics.receiveDropped`). At least `maximumIncomingPacketSize`; default 16 MiB.
    public var receiveBufferBytes: Int

    /// Creates a configuration with the defaults documented on each property.
    public init(
        broker: MQTTBrokerURL, clientID: String? = nil, protocolVersion: MQTTProtocolVersion = .v5,
        cleanSession: Bool = true, sessionExpiry: Duration = .seconds(86_400), keepAlive: Duration = .seconds(60),
        credentials: MQTTCredentials? = nil, tls: MQTTTLSConfiguration? = nil, will: MQTTWill? = nil,
        reconnect: MQTTReconnectPolicy = MQTTReconnectPolicy(), offlineQueueCapacity: Int = 10_000,
        maxInflightMessages: Int = 100, receiveBufferCapacity: Int = 100_000,
        maximumIncomingPacketSize: Int = 1_048_576, receiveBufferBytes: Int = 16_777_216
    ) {
        self.broker = broker
        self.clientID = clientID
        self.protocolVersion = protocolVersion
        self.cleanSession = cleanSession
        self.sessionExpiry = sessionExpiry
        self.keepAlive = keepAlive
        self.credentials = credentials
        self.tls = tls
        self.will = will
        self.reconnect = reconnect
        self.offlineQueueCapacity = offlineQueueCapacity
        self.maxInflightMessages = maxInflightMessages
        self.receiveBufferCapacity = receiveBufferCapacity
        self.maximumIncomingPacketSize = maximumIncomingPacketSize
        self.receiveBufferBytes = receiveBufferBytes
    }

    /// The largest packet MQTT can carry: a 268,435,455-byte remaining length, its 4-byte length field and the
    /// packet type byte.
    static let largestPacketSize = 268_435_460

    /// Checks the settings that can be checked without touching the network or the file system.
    ///
    /// - Throws: `MQTTError` with code `.invalidConfiguration` (or `.invalidTopic` for the will) naming the field.
    public func validate() throws(MQTTError) {
        func fail(_ field: String, _ why: String) -> MQTTError {
            MQTTError(.invalidConfiguration, operation: "check MQTT settings", detail: "\(field): \(why)")
        }
        if let clientID {
            guard !clientID.isEmpty else { throw fail("clientID", "must not be empty (leave it out instead)") }
            guard clientID.utf8.count <= 65_535 else { throw fail("clientID", "longer than 65535 bytes") }
        }
        if !cleanSession && clientID == nil {
            throw fail("cleanSession", "a persistent session (cleanSession false) needs a stable clientID")
        }
        guard keepAlive >= .seconds(5), keepAlive <= .seconds(65_535) else {
            throw fail("keepAlive", "must be between 5 s and 65535 s")
        }
        guard sessionExpiry >= .zero, sessionExpiry <= .seconds(Int64(UInt32.max)) else {
            throw fail("sessionExpiry", "must be between 0 and \(UInt32.max) s")
        }
        guard reconnect.initialDelay >= .zero, reconnect.maximumDelay <= .seconds(86_400) else {
            throw fail("reconnect", "delays must be between 0 and 1 day")
        }
        guard offlineQueueCapacity >= 1 else { throw fail("offlineQueueCapacity", "must be at least 1") }
        guard (1...32_768).contains(maxInflightMessages) else {
            throw fail("maxInflightMessages", "must be between 1 and 32768")
        }
        guard receiveBufferCapacity >= 1 else { throw fail("receiveBufferCapacity", "must be at least 1") }
        guard (256...MQTTConfiguration.largestPacketSize).contains(maximumIncomingPacketSize) else {
            throw fail(
                "maximumIncomingPacketSize",
                "must be between 256 and \(MQTTConfiguration.largestPacketSize) bytes (the largest MQTT packet)")
        }
        guard receiveBufferBytes >= maximumIncomingPacketSize else {
            throw fail(
                "receiveBufferBytes",
                "must be at least maximumIncomingPacketSize (\(maximumIncomingPacketSize)), or no message of that size "
                    + "could be buffered")
        }
        if tls != nil && !broker.usesTLS {
            throw fail("tls", "TLS settings given but the broker URL is \(broker) (use mqtts://)")
        }
        if let tls {
            if (tls.certificateFile == nil) != (tls.privateKeyFile == nil) {
                throw fail("tls", "a client certificate needs its private key and the other way round")
            }
        }
        if let credentials, credentials.username.isEmpty {
            throw fail("credentials.username", "must not be empty")
        }
        if let will {
            do {
                try MQTTTopic.validateName(will.topic)
            } catch {
                throw MQTTError(.invalidTopic, operation: "check MQTT settings", detail: "will.topic: \(error.detail)")
            }
            if protocolVersion == .v311 && !will.properties.isEmpty {
                throw fail("will.properties", "properties need MQTT 5")
            }
        }
    }
}

extension StringProtocol {
    func trimmingWhitespace() -> String {
        var slice = Substring(self)
        while let first = slice.first, first.isWhitespace { slice = slice.dropFirst() }
        while let last = slice.last, last.isWhitespace { slice = slice.dropLast() }
        return String(slice)
    }
}
