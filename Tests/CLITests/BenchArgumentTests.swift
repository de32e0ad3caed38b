// The benchmarks take command-line arguments too: a negative count or payload size used to reach a trapping
// conversion (UInt32(-5), [UInt8](repeating:count: -1)); now it is a one-line usage error and exit 1.
import Foundation
import TestSupport
import Testing

@Suite struct BenchArgumentTests {
    @Test(arguments: [
        (["--port", "1", "--payload", "-1"], "--payload: '-1' is not a whole number from 0 to"),
        (["--port", "1", "--count", "0"], "--count: '0' is not a whole number from 1 to"),
        (["--port", "1", "--inflight", "x"], "--inflight: 'x' is not a whole number from 1 to 32768"),
    ])
    func benchMQTTRejectsBadNumbers(_ arguments: [String], _ message: String) async throws {
        let result = try await runCommand(Fixtures.executable("bench-mqtt"), arguments, timeout: 30)
        #expect(result.status == 1, "exit \(result.status), stderr: \(result.stderr)")
        #expect(result.stderr.contains(message), "\(result.stderr)")
    }

    @Test(arguments: [
        (["--count", "-5"], "--count: '-5' is not a positive count"),
        (["--sim-pid", "abc"], "--sim-pid: 'abc' is not a process id"),
    ])
    func benchNotifyRejectsBadNumbers(_ arguments: [String], _ message: String) async throws {
        let result = try await runCommand(
            Fixtures.executable("bench-notify"), arguments,
            environment: ["DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/nonexistent/audit-no-bus"], timeout: 30)
        #expect(result.status == 1, "exit \(result.status), stderr: \(result.stderr)")
        #expect(result.stderr.contains(message), "\(result.stderr)")
    }
}
