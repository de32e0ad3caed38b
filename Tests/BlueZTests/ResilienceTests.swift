// The client in a daemon that runs for months: discovery restarts that must not make devices flap, adapters that
// go away and come back, the system bus dying under the client, and values dropped without being stopped.
import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

@testable import BlueZ

/// Collects a discovery's events in the background: from its `events` stream, or, for a discovery started with a
/// consumer (the bridge's way), from `consumer` as they are delivered on the D-Bus I/O thread.
final class EventLog: Sendable {
    final class Store: Sendable {
        let events = Mutex<[BlueZDiscoveryEvent]>([])
        let ended = Mutex(false)
    }
    private let store = Store()
    private let task = Mutex<Task<Void, Never>?>(nil)

    /// A log of `discovery.events`.
    convenience init(_ discovery: BlueZDiscovery) {
        self.init()
        follow(discovery, recording: true)
    }

    /// A log for a direct consumer: pass `consumer` to `startDiscovery`, then `follow` the discovery.
    init() {}

    /// Records each event delivered to it.
    var consumer: @Sendable (BlueZDiscoveryEvent) -> Void {
        let store = self.store
        return { e in store.events.withLock { $0.append(e) } }
    }

    /// Watches `discovery` (its events when `recording`, else only its end).
    func follow(_ discovery: BlueZDiscovery, recording: Bool = false) {
        let store = self.store
        task.withLock {
            $0 = Task {
                for await e in discovery.events where recording { store.events.withLock { $0.append(e) } }
                store.ended.withLock { $0 = true }
            }
        }
    }

    /// Starts a discovery on `t`'s adapter whose events this log records: through a consumer when `direct`.
    static func start(
        _ t: SimClient, direct: Bool, filter: BlueZDiscoveryFilter
    ) async throws -> (BlueZDiscovery, EventLog) {
        let log = EventLog()
        let adapter = try await t.adapter
        let discovery = try await t.client.startDiscovery(
            on: adapter, filter: filter, consumer: direct ? log.consumer : nil)
        log.follow(discovery, recording: !direct)
        return (discovery, log)
    }

    deinit { task.withLock { $0?.cancel() } }

    var all: [BlueZDiscoveryEvent] { store.events.withLock { $0 } }
    var isEnded: Bool { store.ended.withLock { $0 } }

    /// "appeared"/"updated"/"lost" for `address`, in order, with repeats of "updated" collapsed.
    func story(_ address: String) -> [String] {
        var out: [String] = []
        for e in all where e.device.address == address {
            let word: String
            switch e {
            case .appeared: word = "appeared"
            case .updated: word = "updated"
            case .lost: word = "lost"
            }
            if word == "updated", out.last == "updated" { continue }
            out.append(word)
        }
        return out
    }
}

@Suite struct DiscoveryRestartTests {
    /// `direct`: the events go to a consumer on the I/O thread (the bridge's way) instead of the `events` stream.
    @Test(arguments: [false, true]) func staticBeaconWithoutDuplicateDataIsNeitherRestartedNorLost(direct: Bool)
        async throws
    {
        let t = try await SimClient()
        let (discovery, log) = try await EventLog.start(
            t, direct: direct,
            filter: BlueZDiscoveryFilter(serviceUUIDs: ["FEAA"], watchdogInterval: .milliseconds(200)))
        try await eventually(10, "the beacon") { log.story(beacon).first == "appeared" }
        // BlueZ signals nothing for an advertisement that does not change: that silence is normal. A second
        // discovery with the same filter and watchdog but DuplicateData on takes the same silence for a stuck scan
        // and restarts; its restarts show that the silence lasted several watchdog intervals. (Its stops do not
        // end discovery in BlueZ: this discovery's session stays.)
        let control = try await t.client.startDiscovery(
            on: try await t.adapter,
            filter: BlueZDiscoveryFilter(
                serviceUUIDs: ["FEAA"], duplicateData: true, watchdogInterval: .milliseconds(200)))
        try await eventually(10, "three restarts of the DuplicateData discovery") { control.restartCount >= 3 }
        // No restart, and the beacon is never reported lost.
        #expect(discovery.restartCount == 0)
        #expect(!log.story(beacon).contains("lost"))
        await control.stop()
        #expect(discovery.restartCount == 0)
        await discovery.stop()
    }

    @Test(arguments: [false, true]) func ownRestartNeverReportsADeviceLost(direct: Bool) async throws {
        let t = try await SimClient()
        let (discovery, log) = try await EventLog.start(
            t, direct: direct,
            filter: BlueZDiscoveryFilter(
                serviceUUIDs: ["FEAA"], duplicateData: true, watchdogInterval: .milliseconds(250)))
        try await eventually(10, "the beacon") { log.story(beacon).first == "appeared" }
        // The beacon carries no data to re-signal, so the watchdog restarts the silent scan; each StopDiscovery
        // drops the temporary, non-connectable beacon from BlueZ, and it comes back with its next advertisement.
        try await eventually(10, "two restarts") { discovery.restartCount >= 2 }
        try await eventually(10, "the beacon back after the restarts") {
            t.client.device(address: beacon) != nil && log.story(beacon).last == "updated"
        }
        #expect(try await t.counter("devices_removed") >= 1)
        #expect(log.story(beacon) == ["appeared", "updated"])
        await discovery.stop()
    }
}

@Suite struct AdapterRemovalTests {
    @Test func removedAdapterEndsPeripheralsAndFixedDiscoveries() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let acquired = try await p.notifications(for: try p.characteristic("2A37"))
        let started = try await p.notifications(for: try p.characteristic("2A19"), preferAcquire: false)
        let events = t.client.events()
        let discovery = try await t.client.startDiscovery(
            on: try await t.adapter, filter: BlueZDiscoveryFilter(watchdogInterval: nil))
        let log = EventLog(discovery)
        try await eventually(10, "the beacon") { log.story(beacon).first == "appeared" }
        try await t.simulator("RemoveAdapter", [.string("hci0")])
        let reason = try await within(5, "the peripheral to end") { await p.waitForDisconnection() }
        #expect(reason.kind == .adapterRemoved)
        #expect(reason.message == "adapter hci0 removed")
        #expect(reason.isLinkLoss)
        // Both notification streams end with the disconnection, not as a subscription BlueZ dropped.
        for stream in [acquired, started] {
            let ended = try await within(5, "a notification stream to end") { () async -> BlueZError? in
                var it = stream.makeAsyncIterator()
                return await streamEnd(&it)
            }
            guard case .disconnected(_, let r)? = ended else {
                Issue.record("expected disconnected, got \(String(describing: ended))")
                continue
            }
            #expect(r.kind == .adapterRemoved)
        }
        try await eventually(5, "the discovery to end") { log.isEnded }
        #expect(log.story(beacon).last == "lost")
        #expect(discovery.endReason == .adapterUnavailable(adapter: "hci0", reason: "adapter removed"))
        let removed = try await within(5, "adapterRemoved") { () async -> String? in
            for await e in events { if case .adapterRemoved(let a) = e { return a.name } }
            return nil
        }
        #expect(removed == "hci0")
    }

    @Test(arguments: [false, true]) func selectorDiscoveryRebindsWhenTheAdapterComesBackUnderANewName(direct: Bool)
        async throws
    {
        let t = try await SimClient()
        let log = EventLog()
        let discovery = try await t.client.startDiscovery(
            onAdapter: .address("00:1A:7D:DA:71:10"), filter: BlueZDiscoveryFilter(watchdogInterval: nil),
            consumer: direct ? log.consumer : nil)
        log.follow(discovery, recording: !direct)
        #expect(discovery.adapter.name == "hci0")
        try await eventually(10, "the beacon") { log.story(beacon).first == "appeared" }
        try await t.simulator("RemoveAdapter", [.string("hci0")])
        try await eventually(5, "the beacon lost") { log.story(beacon).last == "lost" }
        #expect(!log.isEnded)
        try await t.simulator("AddAdapter", [.string("{id: hci1, address: \"00:1A:7D:DA:71:10\"}")])
        do {
            try await eventually(10, "the beacon again on hci1") {
                log.story(beacon).filter { $0 != "updated" } == ["appeared", "lost", "appeared"]
            }
        } catch {
            Issue.record("story: \(log.story(beacon)); events: \(log.all)")
            throw error
        }
        #expect(discovery.adapter.name == "hci1")
        #expect(log.all.last?.device.adapterPath == "/org/bluez/hci1")
        #expect(discovery.endReason == nil)
        // The strap moved with the controller: it can be connected on hci1.
        try await eventually(10, "the strap on hci1") {
            t.client.device(address: strap)?.adapterPath == "/org/bluez/hci1"
        }
        let p = try await t.client.connect(address: strap, options: BlueZConnectOptions(timeout: .seconds(5)))
        #expect(p.adapterPath == "/org/bluez/hci1")
        await p.disconnect()
        await discovery.stop()
        try await eventually(10, "no session left") { try await t.counter("discovery_sessions") == 0 }
    }
}

@Suite struct BusLossTests {
    @Test func bluetoothdThatExportsItsObjectsLateIsStillFollowed() async throws {
        let t = try await SimClient()
        let events = t.client.events()
        // bluetoothd comes back after 0.2 s but answers GetManagedObjects with UnknownMethod for 3.5 s more (it
        // owns its name before it exports its objects): the client keeps trying with backoff.
        try await t.simulator("RestartDaemonSlowly", [.double(0.2), .double(3.5)])
        let sequence = try await within(15, "bluetoothd to be followed again") {
            var seen: [BlueZClientEvent] = []
            for await e in events {
                seen.append(e)
                if e == .bluetoothdStarted { break }
            }
            return seen
        }
        #expect(sequence.first == .bluetoothdStopped)
        #expect(t.client.isBluetoothdRunning)
        #expect(t.client.adapters.map(\.name) == ["hci0"])
    }

    @Test func lostSystemBusIsReportedAndRecovered() async throws {
        let t = try await SimClient(stableAddress: true)
        let p = try await t.connect()
        let discovery = try await t.client.startDiscovery(
            on: try await t.adapter, filter: BlueZDiscoveryFilter(watchdogInterval: nil))
        let log = EventLog(discovery)
        try await eventually(10, "the beacon") { log.story(beacon).first == "appeared" }
        let events = t.client.events()
        t.sim.bus.killDaemon()
        let reason = try await within(5, "the peripheral to end") { await p.waitForDisconnection() }
        #expect(reason.kind == .busLost)
        try await eventually(5, "the discovery to end") { log.isEnded }
        #expect(log.story(beacon).last == "lost")
        guard case .busUnavailable? = discovery.endReason else {
            Issue.record("expected busUnavailable, got \(String(describing: discovery.endReason))")
            return
        }
        #expect(!t.client.isBluetoothdRunning)
        #expect(!t.client.isBusConnected)
        #expect(t.client.adapters.isEmpty)
        // The bus and bluetoothd come back: the client reconnects on its own.
        let daemon = try await t.sim.bus.relaunchDaemon()
        defer { daemon.stop() }
        let sim = try await t.sim.launchAnotherSimulator()
        defer { sim.stop() }
        let sequence = try await within(15, "the bus and bluetoothd to come back") {
            var seen: [BlueZClientEvent] = []
            for await e in events {
                seen.append(e)
                if e == .bluetoothdStarted { break }
            }
            return seen
        }
        #expect(sequence.contains { if case .busLost = $0 { return true } else { return false } })
        #expect(sequence.contains(.busRestored))
        #expect(sequence.last == .bluetoothdStarted)
        #expect(t.client.isBluetoothdRunning)
        #expect(t.client.isBusConnected)
        let again = try await t.connect()
        #expect(again.isConnected)
        await again.disconnect()
    }
}

@Suite struct LifetimeTests {
    @Test func droppedDiscoveryIsFreedAndEndsItsSession() async throws {
        let t = try await SimClient()
        weak var weakDiscovery: BlueZDiscovery?
        do {
            let discovery = try await t.client.startDiscovery(
                on: try await t.adapter, filter: BlueZDiscoveryFilter(watchdogInterval: .milliseconds(100)))
            weakDiscovery = discovery
            try await eventually(10, "a session") { try await t.counter("discovery_sessions") == 1 }
        }
        try await eventually(5, "the discovery freed") { weakDiscovery == nil }
        try await eventually(10, "BlueZ's session gone") { try await t.counter("discovery_sessions") == 0 }
        #expect(t.client.core.withLock { $0.subscribers.count } == 0)
    }

    @Test func droppedPeripheralIsFreedAndItsConnectionClosed() async throws {
        let t = try await SimClient()
        weak var weakPeripheral: BlueZPeripheral?
        var batteryPath = ""
        do {
            let p = try await t.connect()
            let battery = try p.characteristic("2A19")
            batteryPath = battery.path
            let values = try await p.notifications(for: battery, preferAcquire: false)
            try await eventually(5, "Notifying") { p.refreshed(battery)?.notifying == true }
            weakPeripheral = p
            withExtendedLifetime(values) {}  // dropped with the peripheral, not before
        }
        try await eventually(5, "the peripheral freed") { weakPeripheral == nil }
        // Its D-Bus connection closed with it, so BlueZ dropped its notify session.
        let path = batteryPath
        try await eventually(5, "Notifying false") { t.client.tree.characteristic(at: path)?.notifying == false }
        // ...and the link it left up was disconnected.
        try await eventually(5, "disconnected") { t.client.device(address: strap)?.connected == false }
        #expect(t.client.core.withLock { $0.subscribers.count } == 0)
    }

    @Test func droppedClientIsFreed() async throws {
        let sim = try await SimulatorFixture.start(scenario: testScenario)
        defer { sim.stopInBackground() }
        weak var weakClient: BlueZClient?
        do {
            let client = try BlueZClient(bus: .address(sim.address))
            try await client.start(timeout: .seconds(10))
            #expect(client.isBluetoothdRunning)
            weakClient = client
        }
        try await eventually(5, "the client freed") { weakClient == nil }
    }
}
