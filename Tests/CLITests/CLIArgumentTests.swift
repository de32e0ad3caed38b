// Command-line arguments are outside input: a duration option far beyond `Duration`'s range used to pass the
// option check and trap later in the Double -> Int64 conversion. Such values are now rejected as usage errors,
// before any bus is opened.
import Foundation
import TestSupport
import Testing

@Suite struct CLIArgumentTests {
    /// A bus address that cannot be reached, so an option that slips through fails differently from a usage error.
    private let noBus = ["DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent/audit-no-bus"]

    @Test(arguments: [
        ["scan", "--duration", "1e300"],
        ["scan", "--duration", "inf"],
        ["scan", "--duration", "-1"],
        ["read", "AA:BB:CC:DD:EE:FF", "2A19", "--timeout", "1e300"],
        ["read", "AA:BB:CC:DD:EE:FF", "2A19", "--scan-timeout", "1e19"],
        ["write", "AA:BB:CC:DD:EE:FF", "2A06", "01", "--timeout", "9e18"],
    ])
    func hugeDurationsAreUsageErrors(_ arguments: [String]) async throws {
        let result = try await runCommand(
            Fixtures.executable("blebridge"), arguments, environment: noBus, timeout: 30)
        #expect(result.status == 64, "exit \(result.status), stderr: \(result.stderr)")
        #expect(result.stderr.contains("is not a number of seconds between 0 and 31536000"), "\(result.stderr)")
    }

    @Test func fullwidthHexIsNotAnAddress() async throws {
        let result = try await runCommand(
            Fixtures.executable("blebridge"), ["read", "\u{FF21}A:BB:CC:DD:EE:FF", "2A19"], environment: noBus,
            timeout: 30)
        #expect(result.status == 64, "exit \(result.status), stderr: \(result.stderr)")
        #expect(result.stderr.contains("is not a Bluetooth address"), "\(result.stderr)")
    }
}
