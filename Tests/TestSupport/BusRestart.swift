// Restarting the private bus under its clients: a new dbus-daemon on the same socket after `killDaemon()`, and a new
// `bluez-sim` on it, as when the system bus and bluetoothd come back after a crash.
import Foundation

extension PrivateBus {
    /// The address without its `guid=` part, as a system bus address is written: a client given it can reconnect
    /// to a daemon relaunched on the same socket (libdbus refuses a server whose guid differs from the address).
    public var stableAddress: String {
        address.split(separator: ",").filter { !$0.hasPrefix("guid=") }.joined(separator: ",")
    }

    /// Starts a new `dbus-daemon` listening on this bus's socket (after `killDaemon()`), with the same
    /// configuration, and returns once it has printed its address. The caller owns the returned process.
    public func relaunchDaemon() async throws -> ChildProcess {
        guard let dbusDaemon = which("dbus-daemon") else {
            throw HarnessError("dbus-daemon not found; run scripts/install-deps.sh")
        }
        let configURL = directory.url.appendingPathComponent("bus.conf")
        let daemon = try ChildProcess(
            name: "dbus-daemon", executable: dbusDaemon,
            arguments: ["--config-file=\(configURL.path)", "--nofork", "--nopidfile", "--print-address=1"])
        _ = try await daemon.waitForOutput(timeout: 10) { $0.contains("\n") }
        return daemon
    }
}

extension SimulatorFixture {
    /// Starts another `bluez-sim` with the same scenario on this fixture's bus address (for example on a bus
    /// relaunched with `PrivateBus.relaunchDaemon()`), and returns once it is ready. The caller owns the process.
    public func launchAnotherSimulator() async throws -> ChildProcess {
        let process = try ChildProcess(
            executable: Fixtures.executable("bluez-sim"), arguments: ["--scenario", scenarioFile.path],
            environment: ["DBUS_SYSTEM_BUS_ADDRESS": bus.stableAddress, "DBUS_SESSION_BUS_ADDRESS": bus.stableAddress])
        _ = try await process.waitForOutput(timeout: 20) { $0.contains("bluez-sim: ready") }
        return process
    }
}
