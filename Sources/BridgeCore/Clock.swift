// The real clock, and ISO-8601 text for `last_seen`.
import FoundationEssentials

/// The system clock: monotonic `now` from `ContinuousClock`, wall time from `Date`.
public struct SystemBridgeClock: BridgeClock {
    let origin = ContinuousClock.now

    /// A clock starting now.
    public init() {}

    /// Time since the clock was made.
    public var now: Duration { ContinuousClock.now - origin }

    /// Seconds since 1970.
    public var wallClock: Double { Date().timeIntervalSince1970 }

    /// Sleeps until `deadline`.
    public func sleep(until deadline: Duration) async throws {
        try await Task.sleep(until: origin + deadline, clock: .continuous)
    }
}

/// `2026-12-01T21:12:51.123Z` for seconds since 1970 (UTC, milliseconds).
public func iso8601(_ seconds: Double) -> String {
    guard seconds.isFinite, seconds > -1e12, seconds < 1e12 else { return "1970-01-01T00:00:00.000Z" }
    let totalMillis = Int64((seconds * 1000).rounded(.down))
    var days = totalMillis / 86_400_000
    var rest = totalMillis % 86_400_000
    if rest < 0 {
        rest += 86_400_000
        days -= 1
    }
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468
    let era = (z >= 0 ? z : z - 146_096) / 146_097
    let doe = z - era * 146_097
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365
    var year = yoe + era * 400
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100)
    let mp = (5 * doy + 2) / 153
    let day = doy - (153 * mp + 2) / 5 + 1
    let month = mp < 10 ? mp + 3 : mp - 9
    if month <= 2 { year += 1 }
    func pad(_ v: Int64, _ n: Int) -> String {
        let s = String(v)
        return String(repeating: "0", count: max(0, n - s.count)) + s
    }
    let h = rest / 3_600_000
    let m = rest / 60_000 % 60
    let s = rest / 1000 % 60
    let ms = rest % 1000
    return "\(pad(year, 4))-\(pad(month, 2))-\(pad(day, 2))T\(pad(h, 2)):\(pad(m, 2)):\(pad(s, 2)).\(pad(ms, 3))Z"
}

extension Duration {
    /// The duration in seconds, as a Double.
    public var seconds: Double {
        let c = components
        return Double(c.seconds) + Double(c.attoseconds) / 1e18
    }
}
