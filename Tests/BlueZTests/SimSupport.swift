// Helpers for the BlueZ client tests: a scenario with every kind of characteristic, a started client on a private
// bus with bluez-sim, and the simulator's control interface over our own DBus connection.
import DBus
import Foundation
import TestSupport
import Testing

@testable import BlueZ

let strap = "C0:FF:EE:00:00:01"
let beacon = "C0:FF:EE:00:00:02"
let ghost = "C0:FF:EE:00:00:03"

/// The scenario most tests use. Short delays and timeouts keep the suite fast.
let testScenario = """
    settings:
      temporary_timeout: 30
      mtu: 247
    adapters:
      - id: hci0
        address: "00:1A:7D:DA:71:10"
    peripherals:
      - address: "\(strap)"
        name: Strap
        rssi: -55
        tx_power: 4
        advertising_interval: 0.05
        service_uuids: ["180D"]
        manufacturer_data:
          - company: 0x004C
            value: "02 15"
        service_data:
          - uuid: "180D"
            value: "01"
        delays: {connect: 0.02, services: 0.02, disconnect: 0.02}
        gatt:
          - uuid: "180D"
            characteristics:
              - uuid: "2A37"
                flags: [notify]
                notify: {rate: 0, sequence: ["00 48", "00 49"]}
              - uuid: "2A38"
                flags: [read]
                value: "01"
              - uuid: "2A39"
                flags: [write]
          - uuid: "180F"
            characteristics:
              - uuid: "2A19"
                flags: [read, notify]
                value: "57"
          - uuid: "12345678-1234-5678-1234-56789abcdef0"
            characteristics:
              - uuid: "12345678-1234-5678-1234-56789abcdef1"
                flags: [read, write-without-response, indicate]
                value: "aa"
                descriptors:
                  - uuid: "2901"
                    value: {text: "Custom"}
      - address: "\(beacon)"
        name: Beacon
        rssi: -70
        advertising_interval: 0.05
        connectable: false
        service_uuids: ["FEAA"]
    """

/// A simulator plus a started client on its bus.
final class SimClient: @unchecked Sendable {
    let sim: SimulatorFixture
    let client: BlueZClient
    let control: DBusConnection

    /// - Parameter stableAddress: point the client at the bus address without its guid, so that it can reconnect
    ///   to a dbus-daemon relaunched on the same socket.
    init(_ scenario: String = testScenario, stableAddress: Bool = false) async throws {
        sim = try await SimulatorFixture.start(scenario: scenario)
        client = try BlueZClient(
            bus: .address(stableAddress ? sim.bus.stableAddress : sim.address),
            logger: BlueZLogger(handler: TestLogHandler(), level: .debug))
        try await client.start(timeout: .seconds(10))
        control = try DBusConnection(.address(sim.address))
    }

    deinit {
        client.close()
        control.close()
        sim.stopInBackground()
    }

    /// Calls `io.blebridge.Simulator1.method` on the simulator.
    @discardableResult
    func simulator(_ method: String, _ arguments: [DBusValue] = []) async throws -> [DBusValue] {
        try await control.call(
            destination: "org.bluez", path: "/org/bluez/sim", interface: "io.blebridge.Simulator1", method: method,
            arguments: arguments, timeout: .seconds(10))
    }

    func counter(_ name: String) async throws -> Int64 {
        let reply = try await simulator("GetCounters")
        return reply.first?.stringVariantDictionary?[name]?.int64 ?? 0
    }

    func fault(_ address: String, _ name: String, _ options: String = "{}") async throws {
        try await simulator("InjectFault", [.string(address), .string(name), .string(options)])
    }

    var adapter: BlueZAdapter {
        get async throws { try await client.waitForAdapter(.name("hci0"), timeout: .seconds(5)) }
    }

    /// Scans until `address` is known, then stops the scan.
    func discover(_ address: String) async throws -> BlueZDevice {
        let discovery = try await client.startDiscovery(on: try await adapter)
        defer { Task { await discovery.stop() } }
        let device = try await firstEvent(discovery, timeout: 10) { event in
            if case .appeared(let d) = event, d.address == address { return d }
            return nil
        }
        await discovery.stop()
        return device
    }

    func connect(_ address: String = strap, timeout: Duration = .seconds(5)) async throws -> BlueZPeripheral {
        let device = try await discover(address)
        return try await client.connect(device, options: BlueZConnectOptions(timeout: timeout))
    }
}

extension BlueZClient {
    /// How many handlers are subscribed to the mirror (a wait counts once it is subscribed), so that a test can
    /// act only after a wait has started.
    var subscriberCount: Int { core.withLock { $0.subscribers.count } }
}

/// Collects log lines (tests print them on failure through Issue comments when useful).
struct TestLogHandler: BlueZLogHandler {
    func log(level: BlueZLogLevel, message: String, metadata: [String: String]) {
        if ProcessInfo.processInfo.environment["BLUEZ_TEST_LOG"] != nil {
            FileHandle.standardError.write(
                Data(
                    "\(String(format: "%.3f", Date().timeIntervalSince1970.truncatingRemainder(dividingBy: 100))) [\(level)] \(message)\n"
                        .utf8))
        }
    }
}

/// The first discovery event for which `pick` returns a value.
func firstEvent<T: Sendable>(
    _ discovery: BlueZDiscovery, timeout: Double, _ pick: @escaping @Sendable (BlueZDiscoveryEvent) -> T?
) async throws -> T {
    try await within(timeout, "a discovery event") {
        for await event in discovery.events {
            if let value = pick(event) { return value }
        }
        throw TimeoutError("a discovery event (the stream ended)")
    }
}
