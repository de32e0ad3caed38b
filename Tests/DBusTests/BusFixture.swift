// The DBus tests' bus fixture, on TestSupport's PrivateDBusDaemon (no readabilityHandler; see DBusHarness.swift).
import DBus
import Foundation
import TestSupport

/// A private bus for one test; the daemon is killed when the fixture goes away.
final class BusFixture: @unchecked Sendable {
    let daemon: PrivateDBusDaemon
    init() throws { daemon = try PrivateDBusDaemon() }
    /// The bus address.
    var address: String { daemon.address }
    /// A new private connection to this bus.
    func connect() throws -> DBusConnection { try DBusConnection(.address(address)) }
    /// Kills the daemon at once (the bus "going away").
    func killDaemon() { daemon.killDaemon() }
}
