// When to send the MQTT writes held over rounds of D-Bus signals: at once after a quiet spell, otherwise at most a
// window after the last send (the daemon's SignalRoundBatcher applies it on the D-Bus I/O thread).

/// The policy of holding the publishes of signal rounds (advertisements) for up to `window` milliseconds after the
/// last send, so that a stream of rounds leaves with one write per window instead of one per round. Pure: the caller
/// brings the clock, holds and sends, and arranges to call `end` again (an empty round) when told to wait.
public struct RoundBatchPolicy: Sendable {
    /// What the caller does after a round.
    public enum Next: Sendable, Equatable {
        /// Nothing was held.
        case nothing
        /// Send what is held now.
        case release
        /// Keep holding; call `end` again (after an empty round) in this many milliseconds.
        case wait(milliseconds: Int64)
    }

    /// The longest a held publish waits (ms).
    public let window: Int64
    private var holding = false
    private var lastRelease: Int64?

    /// A policy with `window` milliseconds.
    public init(window: Int64) { self.window = window }

    /// A round begins; true when the caller must start holding (it is not holding already).
    public mutating func begin() -> Bool {
        defer { holding = true }
        return !holding
    }

    /// A round (or an empty round) ended at `now` (monotonic ms). An `urgent` round (one that carried more than
    /// advertisements: a characteristic's value, a connection's change) sends what is held at once.
    public mutating func end(now: Int64, urgent: Bool = false) -> Next {
        guard holding else { return .nothing }
        if !urgent, let last = lastRelease, now - last < window { return .wait(milliseconds: window - (now - last)) }
        holding = false
        lastRelease = now
        return .release
    }

    /// The observer is going away: true when something is held and must be sent.
    public mutating func finish() -> Bool {
        defer { holding = false }
        return holding
    }
}
