// The DBus tests' bus fixture, on TestSupport's PrivateBus.
import DBus
import Foundation
import TestSupport

/// A private bus for one test; the daemon is stopped when the fixture goes away.
final class BusFixture: @unchecked Sendable {
    let bus: PrivateBus
    /// Starts a private bus without holding a cooperative thread.
    init() async throws { bus = try await PrivateBus.start() }
    /// The bus address.
    var address: String { bus.address }
    /// A new private connection to this bus.
    func connect() throws -> DBusConnection { try DBusConnection(.address(address)) }
    /// Kills the daemon at once (the bus "going away").
    func killDaemon() { bus.killDaemon() }
}
