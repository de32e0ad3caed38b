// Multi-gateway mode (`gateway:`): which gateway serves each connected, poll or on-demand device, agreed through
// retained MQTT messages only (docs/MULTI-GATEWAY.md). `OwnershipRules` decide; this keeps what the broker said,
// publishes this gateway's sightings and claims, and tells the device sessions whether they may connect.
import Synchronization

/// What the coordination asks the bridge to do.
enum GatewayEffect: Sendable, Equatable {
    /// Publish (retained, QoS 1).
    case publish(topic: String, payload: [UInt8])
    /// Another gateway serves the device now: disconnect it (intentionally) without marking it offline.
    case handOver(device: String, to: String)
    /// The device's ownership changed: wake its session (it may connect now, or must wait).
    case wake(device: String)
    /// Another gateway went offline: the Home Assistant discovery of passive devices, which every gateway publishes
    /// naming itself (availability included), may name that one; publish it again naming this one.
    case gatewayLeft(String)
}

/// One gateway's view of the others and of the claims, and its own sightings and claims.
final class GatewayCoordination: Sendable {
    let rules: OwnershipRules
    let topics: BridgeTopics
    var me: String { rules.me }

    struct DeviceState {
        /// The retained claim as the broker last delivered it.
        var claim: DeviceClaim?
        /// Our claim as last published (nil: we do not claim the device).
        var ours: DeviceClaim?
        /// Our claim came back from the broker unchallenged: the session may connect.
        var stood = false
        /// Smoothed once a second from the latest RSSI: BlueZ signals RSSI only when it changes, so samples per
        /// advertisement event would weigh a moving device by how often it changes.
        var smoothed = SmoothedRSSI()
        var lastRSSI: Double?
        var heardAt: Double?
        var betterSince: Double?
        /// Other gateways' sightings, by gateway.
        var sightings: [String: Sighting] = [:]
        /// We claimed or gave the device up in this run: a retained claim naming us is then a stale echo, not
        /// ours from before a restart.
        var touched = false
        /// A passive device: no claims; heard when it last advertised.
        var passive = false
        /// No free connection slot for it here (published in the sightings).
        var full = false
        /// When this gateway first heard it in this run.
        var firstHeard: Double?
    }

    struct State {
        var devices: [String: DeviceState] = [:]
        /// Gateways whose `bridge/<id>/state` is online (this one always counts).
        var online: Set<String> = []
        var lastSightings: Double = -1_000_000
        var publishedRSSI: [String: Double] = [:]
        var publishedFull: Set<String> = []
        /// The coordination topics are subscribed: claims may be made (their echo would be missed before).
        var subscribed = false
    }

    let state = Mutex(State())

    init(settings: GatewaySettings, topics: BridgeTopics) {
        rules = OwnershipRules(me: settings.id, settings: settings.ownership)
        self.topics = topics
    }

    // MARK: What this gateway hears

    /// An advertisement of `device` at `rssi` dBm.
    func heard(_ device: String, rssi: Int, wall: Double, passive: Bool = false) {
        state.withLock { s in
            var d = s.devices[device, default: DeviceState()]
            d.passive = passive
            if d.smoothed.value == nil { d.smoothed.add(Double(rssi)) }
            d.lastRSSI = Double(rssi)
            d.heardAt = wall
            if d.firstHeard == nil { d.firstHeard = wall }
            s.devices[device] = d
        }
    }

    /// The coordination topics are subscribed (the retained claims and states arrive from now on).
    func subscribed() { state.withLock { $0.subscribed = true } }

    /// Whether they are (the retained claims have come).
    var isSubscribed: Bool { state.withLock { $0.subscribed } }

    /// BlueZ forgot the device (it stopped advertising for BlueZ's TemporaryTimeout) or bluetoothd went away: this
    /// gateway no longer hears it.
    func forget(_ device: String) {
        state.withLock { s in
            s.devices[device]?.lastRSSI = nil
            s.devices[device]?.heardAt = nil
        }
    }

    // MARK: What the broker says

    /// Takes a coordination message (another gateway's state or sightings, a claim); false for anything else.
    func handle(_ message: BridgeIncomingMessage, wall: Double) -> (handled: Bool, effects: [GatewayEffect]) {
        let prefix = topics.base + "/bridge/"
        guard message.topic.hasPrefix(prefix) else { return (false, []) }
        let rest = message.topic.dropFirst(prefix.count).split(separator: "/", omittingEmptySubsequences: false)
        guard rest.count == 2 else { return (false, []) }
        let (first, second) = (String(rest[0]), String(rest[1]))
        let json = message.payload.isEmpty ? nil : try? JSONReader.parse(message.payload)
        if first == "claims" {
            return (true, receiveClaim(second, json.flatMap(Self.claim), wall: wall))
        }
        switch second {
        case "state":
            let online = json?["state"]?.string == "online"
            // An owner going away lets the others claim at the next evaluation (each tick).
            let left = state.withLock { s -> Bool in
                if online {
                    s.online.insert(first)
                    return false
                }
                return s.online.remove(first) != nil
            }
            return (true, left && first != me ? [.gatewayLeft(first)] : [])
        case "sightings":
            guard first != me else { return (true, []) }
            state.withLock { s in
                for key in s.devices.keys { s.devices[key]?.sightings[first] = nil }
                guard case .object(let entries)? = json else { return }
                for (key, value) in entries {
                    guard let rssi = value["rssi"]?.number, let at = value["at"]?.number else { continue }
                    let full = value["full"] == .bool(true)
                    s.devices[key, default: DeviceState()].sightings[first] = Sighting(
                        gateway: first, rssi: rssi, at: at, full: full)
                }
            }
            return (true, [])
        default:
            return (false, [])
        }
    }

    func receiveClaim(_ device: String, _ claim: DeviceClaim?, wall: Double) -> [GatewayEffect] {
        state.withLock { s -> [GatewayEffect] in
            var d = s.devices[device, default: DeviceState()]
            defer { s.devices[device] = d }
            d.claim = claim
            guard let ours = d.ours else { return [] }
            if let claim, claim.owner == me {
                // Our own claim back from the broker (or a later renewal of it): it stands.
                if claim == ours, !d.stood {
                    d.stood = true
                    return [.wake(device: device)]
                }
                return []
            }
            let online = s.online.union([me])
            if let claim, rules.mustYield(mine: ours, to: claim, now: wall, online: online) {
                d.touched = true
                let wasServing = d.stood
                d.ours = nil
                d.stood = false
                return wasServing ? [.handOver(device: device, to: claim.owner)] : [.wake(device: device)]
            }
            // We win (a race the broker resolved the other way, or the claim was removed): claim again.
            return [.publish(topic: topics.claim(device), payload: Self.payload(ours))]
        }
    }

    // MARK: Decisions

    /// Whether the session of `device` may connect now: our claim stands.
    func mayConnect(_ device: String) -> Bool {
        state.withLock { s in
            guard let d = s.devices[device], let ours = d.ours, d.stood else { return false }
            return d.claim?.owner == me && ours.owner == me
        }
    }

    /// The gateway that serves `device` now, as far as this one knows (nil: none).
    func owner(of device: String, wall: Double) -> String? {
        state.withLock { s in
            guard let claim = s.devices[device]?.claim,
                rules.isValid(claim, now: wall, online: s.online.union([me]))
            else { return nil }
            return claim.owner
        }
    }

    /// How many gateways hear passive `device` better than this one (0: this one publishes its readings at once).
    /// Equal RSSI: the smaller gateway id is better.
    func passiveRank(_ device: String, wall: Double) -> Int {
        state.withLock { s in
            guard let d = s.devices[device] else { return 0 }
            let online = s.online
            let mine = d.heardAt != nil ? d.smoothed.value : nil
            return d.sightings.values.filter { o in
                guard online.contains(o.gateway), wall - o.at <= Self.passiveFresh else { return false }
                guard let mine else { return true }
                return o.rssi > mine || (o.rssi == mine && o.gateway < me)
            }.count
        }
    }

    /// How long after first hearing a device that nobody claims this gateway waits before it may claim it.
    static let firstClaimDelay: Double = 1.5

    /// A passive device's sighting counts for ranking while this recent (seconds).
    static let passiveFresh: Double = 30

    /// Whether another online gateway heard `device` within `seconds` (its sightings say when it last did).
    func othersHear(_ device: String, within seconds: Double, wall: Double) -> Bool {
        state.withLock { s in
            guard let d = s.devices[device] else { return false }
            return d.sightings.values.contains { s.online.contains($0.gateway) && wall - $0.at <= seconds }
        }
    }

    /// Each gateway's smoothed RSSI for `device` (this one's included), best first.
    func rssiByGateway(_ device: String, wall: Double) -> [(String, Double)] {
        state.withLock { s in
            guard let d = s.devices[device] else { return [] }
            var out = d.sightings.values.filter { s.online.contains($0.gateway) && wall - $0.at <= Self.passiveFresh }
                .map { ($0.gateway, $0.rssi) }
            if let at = d.heardAt, wall - at <= Self.passiveFresh, let mine = d.smoothed.value {
                out.append((me, mine))
            }
            return out.map { ($0.0, ($0.1 * 10).rounded() / 10) }
                .sorted { $0.1 > $1.1 || ($0.1 == $1.1 && $0.0 < $1.0) }
        }
    }

    /// One round for the non-passive devices (`linkUp`: this gateway's link to it is up or being made), the
    /// smoothing of the passive ones, and the sightings message when due.
    ///
    /// `canServe`: this gateway holds a connection slot for the device or has a free one (else it is no candidate,
    /// and its sightings say so).
    func evaluate(
        _ devices: [(id: String, linkUp: Bool, canServe: Bool)], passive: [String] = [], wall: Double
    ) -> [GatewayEffect] {
        state.withLock { s -> [GatewayEffect] in
            var effects: [GatewayEffect] = []
            guard s.subscribed else { return [] }
            for id in passive {
                guard var d = s.devices[id] else { continue }
                // Heard when it last advertised (BlueZ signals each advertisement whose data changed).
                if let rssi = d.lastRSSI, let at = d.heardAt, wall - at <= Self.passiveFresh { d.smoothed.add(rssi) }
                s.devices[id] = d
            }
            let online = s.online.union([me])
            for (id, linkUp, canServe) in devices {
                var d = s.devices[id, default: DeviceState()]
                defer { s.devices[id] = d }
                d.full = !canServe
                // BlueZ signals an advertiser only when something changes (RSSI by 8 dB or more, data), and forgets
                // it after its TemporaryTimeout without advertisements (forget(_:)): until then it is heard.
                if let rssi = d.lastRSSI, d.heardAt != nil {
                    d.heardAt = wall
                    d.smoothed.add(rssi)
                }
                var sightings = Array(d.sightings.values)
                if let at = d.heardAt, let rssi = d.smoothed.value {
                    sightings.append(Sighting(gateway: me, rssi: rssi, at: at, full: d.full))
                }
                // Waiting for our claim to come back: do not claim again for a few seconds.
                if let ours = d.ours, !d.stood, wall - ours.since < 5 { continue }
                // A device nobody claims yet, just heard: first let the others' sightings of it arrive (each
                // gateway publishes a newly heard device within a second), or the first to hear it would claim it
                // before the one that hears it best has said so.
                if d.claim == nil, let first = d.firstHeard, wall - first < Self.firstClaimDelay { continue }
                if let claim = d.claim, claim.owner != me,
                    rules.hearsBetter(claim: claim, sightings: sightings, now: wall)
                {
                    if d.betterSince == nil { d.betterSince = wall }
                } else {
                    d.betterSince = nil
                }
                switch rules.decide(
                    claim: d.claim, sightings: sightings, online: online, now: wall, betterSince: d.betterSince,
                    linkUp: linkUp)
                {
                case .claim(let made):
                    let c = Self.normalized(made)
                    d.touched = true
                    d.ours = c
                    d.stood = false
                    d.betterSince = nil
                    effects.append(.publish(topic: topics.claim(id), payload: Self.payload(c)))
                case .serve(let renew):
                    if d.ours == nil {
                        // Our claim from before a restart, still retained, is ours again; one we gave up in this
                        // run is a stale echo (the winner's claim follows).
                        guard !d.touched, let claim = d.claim else { continue }
                        d.touched = true
                        d.ours = claim
                        d.stood = true
                        effects.append(.wake(device: id))
                    }
                    if let made = renew {
                        let renew = Self.normalized(made)
                        d.ours = renew
                        effects.append(.publish(topic: topics.claim(id), payload: Self.payload(renew)))
                    }
                case .yield(let to):
                    if d.ours != nil {
                        d.touched = true
                        let wasServing = d.stood
                        d.ours = nil
                        d.stood = false
                        effects.append(wasServing ? .handOver(device: id, to: to) : .wake(device: id))
                    }
                case .stayAway:
                    if d.ours != nil, d.claim?.owner != me {
                        d.touched = true
                        let wasServing = d.stood
                        d.ours = nil
                        d.stood = false
                        effects.append(
                            wasServing ? .handOver(device: id, to: d.claim?.owner ?? "") : .wake(device: id))
                    }
                }
            }
            effects += sightingsIfDue(&s, wall: wall)
            return effects
        }
    }

    /// This gateway's sightings, every 10 s and when a smoothed RSSI moved by 3 dB (at most once a second).
    func sightingsIfDue(_ s: inout State, wall: Double) -> [GatewayEffect] {
        var fresh: [(String, Double, Double, Bool)] = []
        var moved = false
        for (id, d) in s.devices {
            guard let at = d.heardAt, let rssi = d.smoothed.value, wall - at <= rules.settings.sightingMaxAge else {
                continue
            }
            fresh.append((id, rssi, at, d.full))
            if d.full != s.publishedFull.contains(id) { moved = true }
            // A passive device's RSSI moving does not hurry the message (there may be hundreds), its first does.
            if let published = s.publishedRSSI[id] {
                if !d.passive, abs(published - rssi) >= 3 { moved = true }
            } else {
                moved = true
            }
        }
        let since = wall - s.lastSightings
        guard since >= 10 || (moved && since >= 1) else { return [] }
        s.lastSightings = wall
        s.publishedRSSI = [:]
        s.publishedFull = []
        var entries: [(String, JSONValue)] = []
        for (id, rssi, at, full) in fresh.sorted(by: { $0.0 < $1.0 }) {
            let rounded = (rssi * 10).rounded() / 10
            s.publishedRSSI[id] = rounded
            var entry: [(String, JSONValue)] = [("rssi", .double(rounded)), ("at", .double((at * 10).rounded() / 10))]
            if full {
                s.publishedFull.insert(id)
                entry.append(("full", .bool(true)))
            }
            entries.append((id, .object(entry)))
        }
        return [.publish(topic: topics.sightings, payload: JSONValue.object(entries).bytes)]
    }

    // MARK: Claim messages

    /// The claim as its message carries it (RSSI to 0.1 dB, times to the millisecond), so our own claim compares
    /// equal to its echo from the broker.
    static func normalized(_ c: DeviceClaim) -> DeviceClaim {
        DeviceClaim(
            owner: c.owner, rssi: (c.rssi * 10).rounded() / 10, expires: (c.expires * 1000).rounded() / 1000,
            state: c.state, since: (c.since * 1000).rounded() / 1000)
    }

    static func payload(_ c: DeviceClaim) -> [UInt8] {
        let c = normalized(c)
        return JSONValue.object([
            ("owner", .string(c.owner)), ("rssi", .double(c.rssi)), ("expires", .double(c.expires)),
            ("state", .string(c.state.rawValue)), ("since", .double(c.since)),
        ]).bytes
    }

    static func claim(_ v: JSONValue) -> DeviceClaim? {
        guard let owner = v["owner"]?.string, let rssi = v["rssi"]?.number, let expires = v["expires"]?.number,
            let since = v["since"]?.number, let state = v["state"]?.string.flatMap(DeviceClaim.State.init(rawValue:))
        else { return nil }
        return DeviceClaim(owner: owner, rssi: rssi, expires: expires, state: state, since: since)
    }
}
