// The real clock, and ISO-8601 text for `last_seen`.
#if canImport(Glibc)
    import Glibc
#endif

/// The system clock: monotonic `now` from `ContinuousClock`, wall time from `clock_gettime(CLOCK_REALTIME)` (no
/// Foundation in the daemon: it would add its code and start-up work to every process for one call).
public struct SystemBridgeClock: BridgeClock {
    let origin = ContinuousClock.now

    /// A clock starting now.
    public init() {}

    /// Time since the clock was made.
    public var now: Duration { ContinuousClock.now - origin }

    /// Seconds since 1970.
    public var wallClock: Double {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        return Double(now.tv_sec) + Double(now.tv_nsec) / 1_000_000_000
    }

    /// Sleeps until `deadline`.
    public func sleep(until deadline: Duration) async throws {
        try await Task.sleep(until: origin + deadline, clock: .continuous)
    }
}

/// `2026-12-01T21:12:51.123Z` for seconds since 1970 (UTC, milliseconds). One implementation with the hot path's
/// `appendISO8601(_:to:)`, so the two texts cannot drift apart.
public func iso8601(_ seconds: Double) -> String {
    var out: [UInt8] = []
    out.reserveCapacity(24)
    appendISO8601(seconds, to: &out)
    return String(decoding: out, as: UTF8.self)
}

extension Duration {
    /// The duration in seconds, as a Double.
    public var seconds: Double {
        let c = components
        return Double(c.seconds) + Double(c.attoseconds) / 1e18
    }
}
