// Ownership of connected devices among several gateways (issue #12, the decision core; not yet wired into the
// bridge). Every gateway runs the same rules on the same retained MQTT messages (claims, sightings, gateway
// states), so they agree on one owner per device without any side channel. The rules and the tie-break are in
// docs/MULTI-GATEWAY.md; this type is pure (no I/O, time passed in) so every case is tested deterministically.

/// A gateway's claim of a device, as carried by the retained `<base>/bridge/claims/<device>` message.
public struct DeviceClaim: Sendable, Equatable {
    /// Why the claim was made or what the owner reports.
    public enum State: String, Sendable, Equatable {
        /// The owner serves (or is connecting to) the device.
        case serving
        /// The owner lost the link and is trying to get it back (since `since`).
        case linkLost = "link_lost"
        /// The owner gave the device up.
        case released
    }

    /// The owning gateway's id.
    public var owner: String
    /// The owner's smoothed RSSI of the device when it claimed or renewed, in dBm.
    public var rssi: Double
    /// When the claim lapses unless renewed (wall clock, seconds since 1970).
    public var expires: Double
    /// Its state.
    public var state: State
    /// When the state began (wall clock).
    public var since: Double

    /// A claim.
    public init(owner: String, rssi: Double, expires: Double, state: State = .serving, since: Double) {
        self.owner = owner
        self.rssi = rssi
        self.expires = expires
        self.state = state
        self.since = since
    }
}

/// How a gateway heard a device, as carried by its retained sightings message.
public struct Sighting: Sendable, Equatable {
    /// The gateway.
    public var gateway: String
    /// Smoothed RSSI in dBm.
    public var rssi: Double
    /// When it was last heard (wall clock).
    public var at: Double
    /// The gateway has no free connection slot for it: it hears the device but cannot serve it.
    public var full: Bool

    /// A sighting.
    public init(gateway: String, rssi: Double, at: Double, full: Bool = false) {
        self.gateway = gateway
        self.rssi = rssi
        self.at = at
        self.full = full
    }
}

/// The timing and margins of the ownership rules.
public struct OwnershipSettings: Sendable, Equatable {
    /// How long a claim lasts without renewal; the owner renews at a third of it.
    public var lease: Double = 30
    /// A challenger must hear the device this many dB better than the owner ...
    public var handoverMargin: Double = 8
    /// ... for this long before it takes over (hysteresis).
    public var handoverAfter: Double = 60
    /// An owner that lost the link and has not got it back after this long lets others take over.
    public var linkLostGrace: Double = 30
    /// A sighting older than this does not count.
    public var sightingMaxAge: Double = 60

    /// The defaults.
    public init() {}
}

/// What a gateway should do about one device now.
public enum OwnershipAction: Sendable, Equatable {
    /// Nothing: someone else owns it (do not connect), or nobody hears it.
    case stayAway
    /// Claim it (publish a claim naming this gateway), then connect once the claim stands.
    case claim(DeviceClaim)
    /// Keep serving; renew the claim (publish it again) when `renew` is non-nil.
    case serve(renew: DeviceClaim?)
    /// Another gateway owns it now: disconnect if connected.
    case yield(to: String)
}

/// Exponentially smoothed RSSI, so one strong or weak advertisement does not move ownership.
public struct SmoothedRSSI: Sendable, Equatable {
    /// The smoothed value, nil before the first sample.
    public private(set) var value: Double?
    /// Weight of a new sample (0...1).
    public let alpha: Double

    /// A smoother.
    public init(alpha: Double = 0.2) { self.alpha = alpha }

    /// Adds a sample.
    public mutating func add(_ rssi: Double) {
        value = value.map { $0 + alpha * (rssi - $0) } ?? rssi
    }
}

/// The ownership rules for one gateway (`me`).
public struct OwnershipRules: Sendable {
    /// This gateway's id.
    public let me: String
    /// Timing and margins.
    public let settings: OwnershipSettings

    /// Rules for gateway `me`.
    public init(me: String, settings: OwnershipSettings = OwnershipSettings()) {
        self.me = me
        self.settings = settings
    }

    /// The deterministic order of candidates: stronger RSSI first; equal RSSI (to 0.1 dB): smaller gateway id.
    public static func better(_ a: (gateway: String, rssi: Double), than b: (gateway: String, rssi: Double)) -> Bool {
        let ra = (a.rssi * 10).rounded()
        let rb = (b.rssi * 10).rounded()
        if ra != rb { return ra > rb }
        return a.gateway < b.gateway
    }

    /// Whether `claim` still binds everyone at `now`: not expired, not released, its owner online, and not a link
    /// loss older than the grace.
    public func isValid(_ claim: DeviceClaim, now: Double, online: Set<String>) -> Bool {
        guard online.contains(claim.owner), now < claim.expires else { return false }
        switch claim.state {
        case .serving: return true
        case .released: return false
        case .linkLost: return now - claim.since < settings.linkLostGrace
        }
    }

    /// Decides for one device.
    ///
    /// - Parameters:
    ///   - claim: the retained claim (nil: none).
    ///   - sightings: every gateway's sighting of the device (this gateway's included).
    ///   - online: the gateways whose `bridge/<id>/state` is online (this one included).
    ///   - betterSince: since when this gateway has heard the device better than the owner by the margin (nil: it
    ///     does not); the caller keeps this per device.
    ///   - linkUp: this gateway's link to the device is up (only meaningful when it is the owner).
    public func decide(
        claim: DeviceClaim?, sightings: [Sighting], online: Set<String>, now: Double, betterSince: Double?,
        linkUp: Bool
    ) -> OwnershipAction {
        let fresh = sightings.filter { now - $0.at <= settings.sightingMaxAge && online.contains($0.gateway) }
        let mine = fresh.first { $0.gateway == me }
        if let claim, isValid(claim, now: now, online: online) {
            if claim.owner == me {
                // Renew at a third of the lease; report a lost link (others may take over after the grace).
                let state: DeviceClaim.State = linkUp ? .serving : .linkLost
                let since = state == claim.state ? claim.since : now
                let due = claim.expires - now <= settings.lease * 2 / 3 || state != claim.state
                let renewed = DeviceClaim(
                    owner: me, rssi: mine?.rssi ?? claim.rssi, expires: now + settings.lease, state: state,
                    since: since)
                return .serve(renew: due ? renewed : nil)
            }
            // Someone else owns it: take over only after hearing it better by the margin for long enough (and with
            // a free connection slot).
            if let mine, !mine.full, let betterSince, now - betterSince >= settings.handoverAfter,
                mine.rssi >= ownerRSSI(claim, fresh) + settings.handoverMargin
            {
                return .claim(DeviceClaim(owner: me, rssi: mine.rssi, expires: now + settings.lease, since: now))
            }
            return .stayAway
        }
        // No binding claim: the best fresh candidate claims; the others wait for its claim. An owner whose lease
        // lapsed without renewal is not reaching us (cut off behind a broker bridge, say), whatever its retained
        // state and sightings say: it is no candidate.
        // A gateway without a free connection slot cannot serve it: no candidate.
        var candidates = fresh.filter { !$0.full }
        if let claim, claim.owner != me, claim.state != .released, now >= claim.expires {
            candidates.removeAll { $0.gateway == claim.owner }
        }
        guard let best = candidates.min(by: { Self.better(($0.gateway, $0.rssi), than: ($1.gateway, $1.rssi)) }) else {
            return claim?.owner == me ? .yield(to: "") : .stayAway
        }
        if best.gateway == me {
            return .claim(DeviceClaim(owner: me, rssi: best.rssi, expires: now + settings.lease, since: now))
        }
        return claim?.owner == me ? .yield(to: best.gateway) : .stayAway
    }

    /// Two claims made in the same round (each gateway saw the other's after its own): the one that wins the
    /// candidate order stands, whatever order the broker delivered them in.
    public func winner(_ a: DeviceClaim, _ b: DeviceClaim) -> DeviceClaim {
        Self.better((a.owner, a.rssi), than: (b.owner, b.rssi)) ? a : b
    }

    /// Whether this gateway, having claimed (`mine`), must give way to a claim it then received (`other`).
    public func mustYield(mine: DeviceClaim, to other: DeviceClaim, now: Double, online: Set<String>) -> Bool {
        guard other.owner != me, isValid(other, now: now, online: online) else { return false }
        // A takeover by hysteresis (the other claimed later than an established claim of ours) is not a race; nor
        // is an older claim (its owner was cut off while we took over, and its renewals reach us late): it yields.
        if other.since > mine.since + 1 { return true }
        if other.since < mine.since - 1 { return false }
        return winner(mine, other).owner != me
    }

    func ownerRSSI(_ claim: DeviceClaim, _ sightings: [Sighting]) -> Double {
        sightings.first { $0.gateway == claim.owner }?.rssi ?? claim.rssi
    }

    /// Whether this gateway hears the device better than the owner by the margin now (the caller starts or clears
    /// its `betterSince` timer with this).
    public func hearsBetter(claim: DeviceClaim, sightings: [Sighting], now: Double) -> Bool {
        guard claim.owner != me, let mine = sightings.first(where: { $0.gateway == me }),
            now - mine.at <= settings.sightingMaxAge
        else { return false }
        return mine.rssi >= ownerRSSI(claim, sightings) + settings.handoverMargin
    }
}
