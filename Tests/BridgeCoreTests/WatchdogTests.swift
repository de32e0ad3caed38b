// The service manager's watchdog is fed only while the bridge's main loop runs.
import BridgeCore
import Testing

@Suite struct WatchdogTests {
    @Test func aStalledMainLoopClosesTheWatchdogGate() async throws {
        try await withBridge("mqtt: {url: mqtt://127.0.0.1:1883}\nhealth: {interval: 0}") { h in
            // The ticker has run once the clock moved past its first second.
            try await eventually("the first tick") {
                h.clock.advance(by: .milliseconds(500))
                return h.bridge.status.allowsWatchdog(now: .now, limit: .seconds(1))
            }
            // Nothing moves the test clock now: the loop does not run (as if stalled), and its heartbeat ages in real
            // time until the gate closes.
            try await eventually("the gate closes", within: 5) {
                !h.bridge.status.allowsWatchdog(now: .now, limit: .milliseconds(300))
            }
            // The loop runs again (time moves): the gate opens.
            try await eventually("the gate opens again") {
                h.clock.advance(by: .milliseconds(500))
                return h.bridge.status.allowsWatchdog(now: .now, limit: .milliseconds(300))
            }
        }
    }
}
