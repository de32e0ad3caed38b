// The simulator over a real bus: a private dbus-daemon, the bluez-sim binary, and a libdbus client (our DBus target).
import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

/// Records every signal matching a rule, with the time it was received, for order and rhythm checks.
final class SignalRecorder: Sendable {
    final class Store: Sendable {
        let messages = Mutex<[(message: DBusMessage, received: ContinuousClock.Instant)]>([])
        /// The waits in progress, each woken after every recorded signal.
        let watchers = Mutex<(next: Int, all: [Int: AsyncStream<Void>.Continuation])>((0, [:]))
    }
    let store = Store()
    private let task: Task<Void, Never>

    init(_ connection: DBusConnection, _ rule: DBusMatchRule = DBusMatchRule(type: .signal, sender: "org.bluez"))
        async throws
    {
        let stream = try await connection.signals(matching: rule)
        let store = self.store
        task = Task {
            for await m in stream {
                store.messages.withLock { $0.append((m, ContinuousClock.now)) }
                for watcher in store.watchers.withLock({ Array($0.all.values) }) { watcher.yield() }
            }
        }
    }

    var all: [DBusMessage] { store.messages.withLock { $0.map(\.message) } }

    /// Every recorded signal with the time it was received.
    var timed: [(message: DBusMessage, received: ContinuousClock.Instant)] { store.messages.withLock { $0 } }

    /// Waits until `predicate` holds over the recorded signals: it is checked now and after each new signal.
    func wait(timeout: Double = 15, _ what: String = "", _ predicate: ([DBusMessage]) -> Bool) async throws {
        let start = ContinuousClock.now
        let (changes, continuation) = AsyncStream<Void>.makeStream(bufferingPolicy: .bufferingNewest(1))
        let id = store.watchers.withLock { watchers in
            watchers.next += 1
            watchers.all[watchers.next] = continuation
            return watchers.next
        }
        defer { _ = store.watchers.withLock { $0.all.removeValue(forKey: id) } }
        // The deadline ends the wait by finishing the stream of changes.
        let deadline = Task {
            try? await Task.sleep(for: .seconds(timeout))
            continuation.finish()
        }
        defer { deadline.cancel() }
        if predicate(all) { return }
        for await _ in changes where predicate(all) {
            let waited = ContinuousClock.now - start
            if waited > .seconds(2) { print("SignalRecorder: waited \(waited) for \(what)") }
            return
        }
        Issue.record("timed out waiting for \(what); got \(all.map(Self.describe))")
        throw HarnessError("timeout: \(what)")
    }

    deinit { task.cancel() }

    /// A compact description: "IA /path", "IR /path", "PC /path {a,b} [inv]", "SIG member".
    static func describe(_ m: DBusMessage) -> String {
        switch m.member {
        case "InterfacesAdded": return "IA \(m.body.first?.string ?? "")"
        case "InterfacesRemoved": return "IR \(m.body.first?.string ?? "")"
        case "PropertiesChanged":
            let keys = m.body.count > 1 ? (m.body[1].dictionaryEntries ?? []).compactMap(\.key.string).sorted() : []
            let inv = m.body.count > 2 ? (m.body[2].arrayElements ?? []).compactMap(\.string) : []
            return "PC \(m.path?.rawValue ?? "") {\(keys.joined(separator: ","))}"
                + (inv.isEmpty ? "" : " [\(inv.joined(separator: ","))]")
        default: return "SIG \(m.member ?? "")"
        }
    }
}

let hr = "A0:9E:1A:4F:2C:11"
let hrPath: DBusObjectPath = "/org/bluez/hci0/dev_A0_9E_1A_4F_2C_11"
let echo = "F1:E2:D3:C4:B5:A6"
let echoPath: DBusObjectPath = "/org/bluez/hci0/dev_F1_E2_D3_C4_B5_A6"

/// A connection to the fixture's bus with helpers for org.bluez calls.
struct Client {
    let connection: DBusConnection

    init(_ sim: SimulatorFixture) throws { connection = try DBusConnection(.address(sim.address)) }

    @discardableResult
    func call(
        _ path: DBusObjectPath, _ interface: String, _ method: String, _ args: [DBusValue] = [],
        timeout: Duration = .seconds(10)
    ) async throws(DBusError) -> [DBusValue] {
        try await connection.call(
            destination: "org.bluez", path: path, interface: interface, method: method,
            arguments: args, timeout: timeout)
    }

    func error(
        _ path: DBusObjectPath, _ interface: String, _ method: String, _ args: [DBusValue] = [],
        timeout: Duration = .seconds(10)
    ) async -> DBusError? {
        do {
            try await call(path, interface, method, args, timeout: timeout)
            return nil
        } catch { return error }
    }

    func property(_ path: DBusObjectPath, _ interface: String, _ name: String) async -> DBusValue? {
        try? await call(path, "org.freedesktop.DBus.Properties", "Get", [.string(interface), .string(name)]).first?
            .variantValue
    }

    @discardableResult
    func control(_ method: String, _ args: [DBusValue] = []) async throws(DBusError) -> [DBusValue] {
        try await call("/org/bluez/sim", "io.blebridge.Simulator1", method, args)
    }

    func managedPaths() async throws -> Set<String> {
        let objects = try await call("/", "org.freedesktop.DBus.ObjectManager", "GetManagedObjects")
        return Set((objects.first?.dictionaryEntries ?? []).compactMap(\.key.string))
    }

    /// Scans until `path` exists.
    func discover(_ path: DBusObjectPath) async throws {
        try await call("/org/bluez/hci0", "org.bluez.Adapter1", "StartDiscovery")
        try await waitUntil(timeout: 3) { await property(path, "org.bluez.Device1", "Address") != nil }
        #expect(await property(path, "org.bluez.Device1", "Address") != nil)
    }

    func waitResolved(_ path: DBusObjectPath) async throws {
        try await waitUntil(timeout: 3) { await property(path, "org.bluez.Device1", "ServicesResolved")?.bool == true }
    }
}

func demoFixture(_ extra: String = "") async throws -> SimulatorFixture {
    var text = try String(contentsOf: Fixtures.config("demo-scenario.yaml"), encoding: .utf8)
    if !extra.isEmpty { text = text.replacingOccurrences(of: "temporary_timeout: 30", with: extra) }
    return try await SimulatorFixture.start(scenario: text)
}

@Suite(.serialized) struct SimulatorBusTests {
    @Test func exportsTheAdapterAndManagersLikeBlueZ() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        let paths = try await c.managedPaths()
        #expect(paths == ["/org/bluez", "/org/bluez/hci0"])
        #expect(await c.property("/org/bluez/hci0", "org.bluez.Adapter1", "Powered")?.bool == true)
        let roles = await c.property("/org/bluez/hci0", "org.bluez.Adapter1", "Roles")?.arrayElements?.compactMap(
            \.string)
        #expect(roles?.contains("central") == true)
        #expect(await c.property("/org/bluez/hci0", "org.bluez.Adapter1", "Discovering")?.bool == false)
        try await c.call(
            "/org/bluez", "org.bluez.AgentManager1", "RegisterAgent",
            [.objectPath("/agent"), .string("NoInputNoOutput")])
    }

    @Test func discoveryStopRemovesNonConnectableAndInvalidatesRSSI() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        let rec = try await SignalRecorder(c.connection)
        try await c.discover(hrPath)
        let bthome = "/org/bluez/hci0/dev_A4_C1_38_8F_80_A5"
        try await rec.wait("BTHome device") { $0.contains { SignalRecorder.describe($0) == "IA \(bthome)" } }
        #expect(
            await c.error("/org/bluez/hci0", "org.bluez.Adapter1", "StartDiscovery")?.name
                == "org.bluez.Error.InProgress")
        try await c.call("/org/bluez/hci0", "org.bluez.Adapter1", "StopDiscovery")
        try await rec.wait("removal") { $0.contains { SignalRecorder.describe($0) == "IR \(bthome)" } }
        try await rec.wait("RSSI invalidated") {
            $0.contains { SignalRecorder.describe($0).hasPrefix("PC \(hrPath.rawValue) {} [RSSI") }
        }
        let paths = try await c.managedPaths()
        #expect(paths.contains(hrPath.rawValue))
        #expect(!paths.contains(bthome))
        #expect(await c.property(hrPath, "org.bluez.Device1", "RSSI") == nil)
        let stop = await c.error("/org/bluez/hci0", "org.bluez.Adapter1", "StopDiscovery")
        #expect(stop == DBusError(name: "org.bluez.Error.Failed", message: "No discovery started"))
    }

    @Test func temporaryDevicesExpire() async throws {
        let sim = try await demoFixture("temporary_timeout: 1.5")
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.discover(hrPath)
        try await c.call("/org/bluez/hci0", "org.bluez.Adapter1", "StopDiscovery")
        #expect(try await c.managedPaths().contains(hrPath.rawValue))
        let stopped = Date()
        #expect(try await waitUntil(timeout: 5) { !(try await c.managedPaths().contains(hrPath.rawValue)) })
        #expect(Date().timeIntervalSince(stopped) > 1.0)  // not before TemporaryTimeout
    }

    /// bluetoothd 5.66 (Debian 12): no Device1.Disconnected signal, and after a start the adapter is exported
    /// before AutoEnable powers it (both seen on the real-BlueZ rig, docs/REAL-BLUEZ.md).
    @Test func bluez566SettingsDropTheDisconnectedSignalAndPowerTheAdapterLate() async throws {
        let sim = try await demoFixture("temporary_timeout: 30\n  disconnected_signal: false\n  auto_enable_delay: 3")
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        let rec = try await SignalRecorder(c.connection)
        // Exported at once, powered 3 s later (the fixture is up well within that).
        #expect(await c.property("/org/bluez/hci0", "org.bluez.Adapter1", "Powered") == .boolean(false))
        try await rec.wait("powered by AutoEnable") {
            $0.contains {
                let d = SignalRecorder.describe($0)
                return d.hasPrefix("PC /org/bluez/hci0 {") && d.contains("Powered")
            }
        }
        #expect(await c.property("/org/bluez/hci0", "org.bluez.Adapter1", "Powered") == .boolean(true))
        try await c.discover(hrPath)
        try await c.call("/org/bluez/hci0", "org.bluez.Adapter1", "StopDiscovery")
        let mark = rec.all.count
        try await c.call(hrPath, "org.bluez.Device1", "Connect")
        try await rec.wait("resolved") {
            $0.dropFirst(mark).contains { SignalRecorder.describe($0).contains("ServicesResolved") }
        }
        let before = rec.all.count
        try await c.call(hrPath, "org.bluez.Device1", "Disconnect")
        try await rec.wait("disconnected") {
            $0.dropFirst(before).contains { SignalRecorder.describe($0) == "PC \(hrPath.rawValue) {Connected}" }
        }
        #expect(
            rec.all.dropFirst(before).map(SignalRecorder.describe) == [
                "PC \(hrPath.rawValue) {ServicesResolved}", "PC \(hrPath.rawValue) {Connected}",
            ])
    }

    @Test func connectAndDisconnectSignalOrder() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.discover(hrPath)
        try await c.call("/org/bluez/hci0", "org.bluez.Adapter1", "StopDiscovery")
        let rec = try await SignalRecorder(c.connection)
        let reply = try await c.connection.call(
            .methodCall(destination: "org.bluez", path: hrPath, interface: "org.bluez.Device1", method: "Connect"))
        try await rec.wait("resolved") { $0.contains { SignalRecorder.describe($0).contains("ServicesResolved") } }
        // The simulator's serials give its send order: Connected=true, then the reply, then the objects.
        let connectedSignal = try #require(
            rec.all.first { SignalRecorder.describe($0) == "PC \(hrPath.rawValue) {Connected}" })
        let firstAdded = try #require(
            rec.all.first { SignalRecorder.describe($0).hasPrefix("IA \(hrPath.rawValue)/") })
        #expect(connectedSignal.serial < reply.serial)
        #expect(reply.serial < firstAdded.serial)
        let order = rec.all.map(SignalRecorder.describe)
        let resolved = try #require(order.firstIndex(of: "PC \(hrPath.rawValue) {ServicesResolved,UUIDs}"))
        let added = order.enumerated().filter { $0.element.hasPrefix("IA \(hrPath.rawValue)/") }
        #expect(added.count == 4 + 8 + 3)  // services, characteristics, descriptors (2 CCCDs, one 2904)
        #expect(added.allSatisfy { $0.offset < resolved })
        #expect(added.first?.element == "IA \(hrPath.rawValue)/service0001")
        #expect(order.contains("IA \(hrPath.rawValue)/service000d/char000e/desc0010"))
        #expect(
            await c.property(hrPath.appending("service000d/char000e"), "org.bluez.GattCharacteristic1", "Handle")
                == .uint16(0x0e))

        let before = rec.all.count
        let disconnectReply = try await c.connection.call(
            .methodCall(destination: "org.bluez", path: hrPath, interface: "org.bluez.Device1", method: "Disconnect"))
        try await rec.wait("disconnected") {
            $0.dropFirst(before).contains { SignalRecorder.describe($0) == "PC \(hrPath.rawValue) {Connected}" }
        }
        let afterDisconnect = rec.all.dropFirst(before).map(SignalRecorder.describe)
        // Disconnect replies after Connected=false.
        #expect(rec.all.dropFirst(before).allSatisfy { $0.serial < disconnectReply.serial })
        #expect(
            afterDisconnect == [
                "PC \(hrPath.rawValue) {ServicesResolved}", "SIG Disconnected", "PC \(hrPath.rawValue) {Connected}",
            ])
        let reason = rec.all.first { $0.member == "Disconnected" }?.body.compactMap(\.string)
        #expect(reason == ["org.bluez.Reason.Local", "Connection terminated by local host"])

        // GATT cache: the objects stay, and a reconnect only shows Connected, then ServicesResolved.
        #expect(try await c.managedPaths().contains(hrPath.rawValue + "/service000d/char000e"))
        let mark = rec.all.count
        try await c.call(hrPath, "org.bluez.Device1", "Connect")
        try await rec.wait("resolved again") {
            $0.dropFirst(mark).contains { SignalRecorder.describe($0).contains("ServicesResolved") }
        }
        #expect(!rec.all.dropFirst(mark).contains { $0.member == "InterfacesAdded" })
    }

    @Test(arguments: ["after-reply", "with-connected", "before-reply", "kept"])
    func servicesResolvedOrderOnACachedReconnect(order: String) async throws {
        let sim = try await SimulatorFixture.start(
            scenario: """
                peripherals:
                  - address: "C0:FF:EE:00:00:09"
                    services_resolved: \(order)
                    delays: {connect: 0.01, services: 0.05, disconnect: 0.01}
                    gatt:
                      - uuid: "180D"
                        characteristics:
                          - {uuid: "2A38", flags: [read], value: "01"}
                """)
        defer { sim.stopInBackground() }
        let path: DBusObjectPath = "/org/bluez/hci0/dev_C0_FF_EE_00_00_09"
        let c = try Client(sim)
        try await c.discover(path)
        try await c.call("/org/bluez/hci0", "org.bluez.Adapter1", "StopDiscovery")
        try await c.call(path, "org.bluez.Device1", "Connect")
        try await c.waitResolved(path)
        let rec = try await SignalRecorder(c.connection)
        try await c.call(path, "org.bluez.Device1", "Disconnect")
        try await rec.wait("disconnected") {
            $0.contains { SignalRecorder.describe($0) == "PC \(path.rawValue) {Connected}" }
        }
        let mark = rec.all.count
        let reply = try await c.connection.call(
            .methodCall(destination: "org.bluez", path: path, interface: "org.bluez.Device1", method: "Connect"))
        try await rec.wait("connected again") {
            $0.dropFirst(mark).contains {
                SignalRecorder.describe($0).hasPrefix("PC \(path.rawValue) {")
                    && SignalRecorder.describe($0).contains("Connected")
            }
        }
        if order == "after-reply" {
            // The recorder's own connection sees the signal; a Get on another connection may answer before it.
            try await rec.wait("resolved again") {
                $0.dropFirst(mark).contains { SignalRecorder.describe($0).contains("ServicesResolved") }
            }
        }
        let device = rec.all.filter { $0.path == path && $0.member == "PropertiesChanged" }
        let keys = { (m: DBusMessage) -> Set<String> in
            Set((m.body.count > 1 ? m.body[1].dictionaryEntries ?? [] : []).compactMap(\.key.string))
        }
        let before = device.filter { $0.serial < rec.all[mark].serial }
        let after = device.filter { $0.serial >= rec.all[mark].serial }
        let connected = try #require(after.first { keys($0).contains("Connected") })
        let resolved = after.first { keys($0).contains("ServicesResolved") }
        switch order {
        case "after-reply":
            #expect(connected.serial < reply.serial)
            #expect(try #require(resolved).serial > reply.serial)
        case "with-connected":
            #expect(resolved?.serial == connected.serial)
            #expect(connected.serial < reply.serial)
        case "before-reply":
            #expect(connected.serial < (resolved?.serial ?? 0))
            #expect((resolved?.serial ?? .max) < reply.serial)
        default:  // kept: ServicesResolved stays true, only Connected toggles
            #expect(!before.contains { keys($0).contains("ServicesResolved") })
            #expect(resolved == nil)
            #expect(await c.property(path, "org.bluez.Device1", "ServicesResolved")?.bool == true)
        }
    }

    @Test func removedAdapterTakesItsDevicesAlongAndComesBackUnderANewName() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.discover(hrPath)
        try await c.call(hrPath, "org.bluez.Device1", "Connect")
        try await c.waitResolved(hrPath)
        let rec = try await SignalRecorder(c.connection)
        try await c.control("RemoveAdapter", [.string("hci0")])
        try await rec.wait("adapter removed") { $0.contains { SignalRecorder.describe($0) == "IR /org/bluez/hci0" } }
        let removed = rec.all.map(SignalRecorder.describe).filter { $0.hasPrefix("IR ") }
        // Children first: GATT objects, then the device, then the adapter last.
        #expect(removed.last == "IR /org/bluez/hci0")
        let device = try #require(removed.firstIndex(of: "IR \(hrPath.rawValue)"))
        #expect(removed[..<device].allSatisfy { $0.hasPrefix("IR \(hrPath.rawValue)/") })
        #expect(!(try await c.managedPaths()).contains { $0.hasPrefix("/org/bluez/hci0") })
        #expect(await c.error("/org/bluez/hci0", "org.bluez.Adapter1", "StartDiscovery")?.name != nil)
        let added = try await c.control("AddAdapter", [.string("{id: hci1, address: \"00:1A:7D:DA:71:13\"}")])
        #expect(added.first?.objectPath == "/org/bluez/hci1")
        #expect(
            await c.error(
                "/org/bluez/sim", "io.blebridge.Simulator1", "AddAdapter",
                [.string("{id: hci1, address: \"00:1A:7D:DA:71:14\"}")])?.name == "org.bluez.Error.AlreadyExists")
        // The peripherals moved to hci1 with the controller.
        let moved: DBusObjectPath = "/org/bluez/hci1/dev_A0_9E_1A_4F_2C_11"
        try await c.call("/org/bluez/hci1", "org.bluez.Adapter1", "StartDiscovery")
        try await waitUntil(timeout: 3) { await c.property(moved, "org.bluez.Device1", "Address") != nil }
        #expect(await c.property(moved, "org.bluez.Device1", "Adapter") == .objectPath("/org/bluez/hci1"))
        let counters = try await c.control("GetCounters").first?.stringVariantDictionary ?? [:]
        #expect(counters["adapters_removed"]?.int64 == 1)
        #expect(counters["adapters_added"]?.int64 == 1)
    }

    @Test func notifySessionsArePerSenderAndDroppedWhenTheSenderLeaves() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let a = try Client(sim)
        let b = try Client(sim)
        try await a.discover(hrPath)
        try await a.call(hrPath, "org.bluez.Device1", "Connect")
        try await a.waitResolved(hrPath)
        let char = hrPath.appending("service000d/char000e")
        let iface = "org.bluez.GattCharacteristic1"
        try await a.call(char, iface, "StartNotify")
        try await a.call(char, iface, "StartNotify")  // already registered: success
        try await b.call(char, iface, "StartNotify")
        #expect(await a.property(char, iface, "Notifying")?.bool == true)
        #expect(
            await a.error(char, iface, "AcquireNotify", [.stringVariantDictionary([])])?.name
                == "org.bluez.Error.InProgress")
        try await a.call(char, iface, "StopNotify")
        #expect(
            await a.error(char, iface, "StopNotify")
                == DBusError(name: "org.bluez.Error.Failed", message: "No notify session started"))
        #expect(await a.property(char, iface, "Notifying")?.bool == true)
        b.connection.close()
        try await waitUntil(timeout: 2) { await a.property(char, iface, "Notifying")?.bool == false }
        #expect(await a.property(char, iface, "Notifying")?.bool == false)
    }

    @Test func acquireWriteCarriesDatagramsAndLocksWriteValue() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.discover(echoPath)
        try await c.call(echoPath, "org.bluez.Device1", "Connect")
        try await c.waitResolved(echoPath)
        let rx = echoPath.appending("service000d/char000e")
        let iface = "org.bluez.GattCharacteristic1"
        #expect(await c.property(rx, iface, "WriteAcquired")?.bool == false)
        let reply = try await c.call(rx, iface, "AcquireWrite", [.stringVariantDictionary([])])
        #expect(reply.count == 2)
        #expect(reply.last == .uint16(247))
        let fd = try #require(reply.first?.fileDescriptor).take()
        defer { close(fd) }
        for text in ["one", "two"] {
            let bytes = Array(text.utf8)
            #expect(bytes.withUnsafeBytes { send(fd, $0.baseAddress, $0.count, 0) } == bytes.count)
        }
        #expect(await c.property(rx, iface, "WriteAcquired")?.bool == true)
        let locked = await c.error(rx, iface, "WriteValue", [.bytes([1]), .stringVariantDictionary([])])
        #expect(locked == DBusError(name: "org.bluez.Error.NotPermitted", message: "Write acquired"))
        // The socket writes reach the simulator after send() returns: wait until it has recorded both.
        var writes: [DBusValue] = []
        try await eventually(5, "both socket writes recorded") {
            writes = try await c.control("GetWrites", [.string(echo)]).first?.arrayElements ?? []
            return writes.count >= 2
        }
        #expect(
            writes == [
                .structure([
                    .string("6e400002-b5a3-f393-e0a9-e50e24dcca9e"), .bytes(Array("one".utf8)), .string("command"),
                ]),
                .structure([
                    .string("6e400002-b5a3-f393-e0a9-e50e24dcca9e"), .bytes(Array("two".utf8)), .string("command"),
                ]),
            ])
        close(fd)
        try await waitUntil(timeout: 2) { await c.property(rx, iface, "WriteAcquired")?.bool == false }
        #expect(await c.property(rx, iface, "WriteAcquired")?.bool == false)
    }

    @Test func injectedFaults() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.discover(hrPath)
        try await c.control("InjectFault", [.string(hr), .string("in-progress"), .string("{}")])
        #expect(
            await c.error(hrPath, "org.bluez.Device1", "Connect")
                == DBusError(name: "org.bluez.Error.InProgress", message: "In Progress"))
        try await c.control(
            "InjectFault",
            [
                .string(hr), .string("connect-failed"),
                .string("{message: le-connection-timeout}"),
            ])
        #expect(
            await c.error(hrPath, "org.bluez.Device1", "Connect")
                == DBusError(name: "org.bluez.Error.Failed", message: "le-connection-timeout"))
        let rec = try await SignalRecorder(c.connection)
        try await c.control("InjectFault", [.string(hr), .string("le-connection-abort-by-local"), .string("{}")])
        #expect(
            await c.error(hrPath, "org.bluez.Device1", "Connect")
                == DBusError(name: "org.bluez.Error.Failed", message: "le-connection-abort-by-local"))
        try await rec.wait("Connected false") {
            $0.filter { SignalRecorder.describe($0) == "PC \(hrPath.rawValue) {Connected}" }.count == 2
        }
        let connected = rec.all.filter { $0.member == "PropertiesChanged" && $0.path == hrPath }
            .compactMap { $0.body[1].stringVariantDictionary?["Connected"]?.bool }
        #expect(connected == [true, false])

        // A connect that never answers; Disconnect cancels it.
        try await c.control("InjectFault", [.string(hr), .string("connect-no-reply"), .string("{}")])
        func connectCalls() async throws -> Int64? {
            try await c.control("GetCounters").first?.stringVariantDictionary?["connect_calls"]?.int64
        }
        let callsBefore = try await connectCalls() ?? 0
        async let pending = c.error(hrPath, "org.bluez.Device1", "Connect", timeout: .seconds(10))
        // Until the simulator holds the Connect.
        try await waitUntil(timeout: 5) { try await connectCalls() != callsBefore }
        try await c.call(hrPath, "org.bluez.Device1", "Disconnect")
        let canceled = await pending
        #expect(canceled == DBusError(name: "org.bluez.Error.Failed", message: "br-connection-canceled"))

        // ATT errors on reads and writes.
        try await c.call(hrPath, "org.bluez.Device1", "Connect")
        try await c.waitResolved(hrPath)
        let location = hrPath.appending("service000d/char0011")
        try await c.control("InjectFault", [.string(hr), .string("read-error"), .string("{uuid: 2A38, att: 0x80}")])
        #expect(
            await c.error(location, "org.bluez.GattCharacteristic1", "ReadValue", [.stringVariantDictionary([])])
                == DBusError(name: "org.bluez.Error.Failed", message: "Operation failed with ATT error: 0x80"))
        #expect(
            try await c.call(location, "org.bluez.GattCharacteristic1", "ReadValue", [.stringVariantDictionary([])])
                == [.bytes([1])])
        let counters = try await c.control("GetCounters").first?.stringVariantDictionary
        #expect(counters?["faults_fired"]?.int64 == 5)
    }

    @Test func servicesResolvedBeforeObjectsFault() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.discover(hrPath)
        try await c.control("InjectFault", [.string(hr), .string("services-resolved-early"), .string("{}")])
        let rec = try await SignalRecorder(c.connection)
        try await c.call(hrPath, "org.bluez.Device1", "Connect")
        try await rec.wait("objects") {
            $0.filter { SignalRecorder.describe($0).hasPrefix("IA \(hrPath.rawValue)/") }.count == 15
        }
        let order = rec.all.map(SignalRecorder.describe)
        let resolved = try #require(order.firstIndex { $0.contains("ServicesResolved") })
        let firstAdded = try #require(order.firstIndex { $0.hasPrefix("IA \(hrPath.rawValue)/") })
        #expect(resolved < firstAdded)
    }

    @Test func controlChangesTheWorld() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        let rec = try await SignalRecorder(c.connection)
        let path = try await c.control(
            "AddPeripheral",
            [
                .string(
                    #"{address: "11:22:33:44:55:66", name: Added, manufacturer_data: [{company: 0x004C, value: "02 15"}]}"#
                )
            ])
        #expect(path == [.objectPath("/org/bluez/hci0/dev_11_22_33_44_55_66")])
        let added: DBusObjectPath = "/org/bluez/hci0/dev_11_22_33_44_55_66"
        try await c.discover(added)
        #expect(await c.property(added, "org.bluez.Device1", "Name") == .string("Added"))
        try await c.control(
            "SetAdvertisement",
            [
                .string("11:22:33:44:55:66"),
                .string(#"{manufacturer_data: [{company: 0x004C, value: "02 16"}]}"#),
            ])
        try await rec.wait("data change") {
            $0.contains { SignalRecorder.describe($0) == "PC \(added.rawValue) {ManufacturerData}" }
        }
        let data = await c.property(added, "org.bluez.Device1", "ManufacturerData")?.dictionaryEntries
        #expect(data?.first?.value.bytes == [0x02, 0x16])
        let bad = await c.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "AddPeripheral",
            [.string(#"{address: "11:22:33:44:55:67", gatt: [{uuid: "2A3"}]}"#)])
        #expect(bad?.message == #"peripheral.gatt[0].uuid: "2A3" is not a UUID"#)
        try await c.control("RemovePeripheral", [.string("11:22:33:44:55:66")])
        try await rec.wait("removed") { $0.contains { SignalRecorder.describe($0) == "IR \(added.rawValue)" } }
    }

    @Test func pushedAndGeneratedNotifications() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.discover(hrPath)
        try await c.call(hrPath, "org.bluez.Device1", "Connect")
        try await c.waitResolved(hrPath)
        let char = hrPath.appending("service000d/char000e")
        let rec = try await SignalRecorder(
            c.connection, DBusMatchRule(type: .signal, sender: "org.bluez", member: "PropertiesChanged", path: char))
        try await c.control("SetNotificationRate", [.string(hr), .string("2A37"), .double(50)])
        try await c.call(char, "org.bluez.GattCharacteristic1", "StartNotify")
        try await c.control("PushNotification", [.string(hr), .string("2A37"), .bytes([0x00, 0x99])])
        try await rec.wait("pushed") {
            $0.contains { $0.body[1].stringVariantDictionary?["Value"]?.bytes == [0x00, 0x99] }
        }
        // The generator's rhythm: the spacing of the next generated values as received. The median ignores the odd
        // late or bunched delivery on a busy machine; 50 Hz is 20 ms apart.
        func generated() -> [(value: [UInt8], received: ContinuousClock.Instant)] {
            let timed = rec.timed.compactMap { entry in
                entry.message.body[1].stringVariantDictionary?["Value"]?.bytes.map { ($0, entry.received) }
            }
            guard let pushed = timed.firstIndex(where: { $0.0 == [0x00, 0x99] }) else { return [] }
            return Array(timed[(pushed + 1)...])
        }
        let count = 21
        try await rec.wait("\(count) generated values") { _ in generated().count >= count }
        let values = generated().prefix(count)
        let spacings = zip(values.dropFirst(), values).map { $0.received - $1.received }.sorted()
        let median = spacings[spacings.count / 2]
        #expect(median >= .milliseconds(14) && median <= .milliseconds(26), "median spacing \(median) of \(spacings)")
        #expect(values.contains { $0.value == [0x1E, 0x48, 0x10, 0x00, 0x55, 0x03] })
    }

    @Test func restartDaemonDropsEverythingAndComesBack() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        let owners = try await c.connection.nameOwnerChanges("org.bluez")
        try await c.discover(hrPath)
        try await c.control("RestartDaemon", [.double(0.3)])
        var seen: [String?] = []
        for await owner in owners {
            seen.append(owner)
            if seen.count == 3 { break }
        }
        #expect(seen[0] != nil)
        #expect(seen[1] == nil)
        #expect(seen[2] != nil && seen[2] != seen[0])
        try await sim.waitForBlueZ()
        #expect(try await c.managedPaths() == ["/org/bluez", "/org/bluez/hci0"])
        #expect(try await c.control("GetCounters").first?.stringVariantDictionary?["restarts"]?.int64 == 1)
    }

    @Test func harnessControlViaDBusSend() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let out = try await sim.control("GetCounters")
        #expect(out.contains("devices_exported"))
        await #expect(throws: HarnessError.self) {
            try await sim.control("InjectFault", ["string:\(hr)", "string:nope", "string:{}"])
        }
    }
}

@Suite(.serialized) struct SimulatorBusEdgeTests {
    @Test func withoutGATTCacheTheObjectsGoAwayOnDisconnect() async throws {
        let sim = try await demoFixture("temporary_timeout: 30\n  gatt_cache: false")
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.discover(hrPath)
        try await c.call(hrPath, "org.bluez.Device1", "Connect")
        try await c.waitResolved(hrPath)
        #expect(try await c.managedPaths().contains(hrPath.rawValue + "/service000d/char000e/desc0010"))
        let rec = try await SignalRecorder(c.connection)
        try await c.call(hrPath, "org.bluez.Device1", "Disconnect")
        try await rec.wait("removals") { $0.filter { $0.member == "InterfacesRemoved" }.count == 15 }
        let removed = rec.all.filter { $0.member == "InterfacesRemoved" }.map(SignalRecorder.describe)
        #expect(removed.first == "IR \(hrPath.rawValue)/service000d/char000e/desc0010")  // children first
        #expect(removed.last == "IR \(hrPath.rawValue)/service0001")
        #expect(!(try await c.managedPaths().contains { $0.hasPrefix(hrPath.rawValue + "/") }))
    }

    @Test func duplicateDataResignalsEveryAdvertisement() async throws {
        let sim = try await SimulatorFixture.start(
            scenario: """
                peripherals:
                  - address: "C0:FF:EE:00:00:01"
                    advertising_interval: 0.05
                    rssi: -60
                    rssi_jitter: 30
                    manufacturer_data: [{company: 0x004C, value: "02 15"}]
                """)
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        let device: DBusObjectPath = "/org/bluez/hci0/dev_C0_FF_EE_00_00_01"
        let rec = try await SignalRecorder(c.connection)
        try await c.discover(device)
        // Static payload, DuplicateData=false (the default): nothing after the first sighting. The jittering RSSI
        // is signalled (a change of 8 dBm or more), so each RSSI change shows that a later advertisement was
        // handled; after several of them, the data was never signalled again.
        try await rec.wait("five later advertisements") {
            $0.filter { SignalRecorder.describe($0).hasPrefix("PC \(device.rawValue) {") }.count >= 5
        }
        #expect(!rec.all.contains { SignalRecorder.describe($0).contains("ManufacturerData") })
        try await c.call("/org/bluez/hci0", "org.bluez.Adapter1", "StopDiscovery")
        try await c.call(
            "/org/bluez/hci0", "org.bluez.Adapter1", "SetDiscoveryFilter",
            [
                .stringVariantDictionary([("DuplicateData", .boolean(true))])
            ])
        try await c.call("/org/bluez/hci0", "org.bluez.Adapter1", "StartDiscovery")
        try await rec.wait("repeated data") {
            $0.filter { SignalRecorder.describe($0).contains("ManufacturerData") }.count >= 4
        }
    }

    @Test func rssiFilterKeepsWeakDevicesOut() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.call(
            "/org/bluez/hci0", "org.bluez.Adapter1", "SetDiscoveryFilter",
            [
                .stringVariantDictionary([("RSSI", .int16(-65)), ("Transport", .string("le"))])
            ])
        let rec = try await SignalRecorder(c.connection)
        try await c.discover(hrPath)  // -58 ± 3
        // Every device advertises first within 55 ms of StartDiscovery; the heart-rate strap advertises every 100 ms,
        // and with an RSSI filter each RSSI change is signalled. A change of its RSSI therefore comes from a later
        // advertisement than every device's first one, and a weak device let through would be in the signals
        // before it.
        try await rec.wait("a later advertisement of the strap") {
            $0.contains { SignalRecorder.describe($0).hasPrefix("PC \(hrPath.rawValue) {") }
        }
        let exported = rec.all.filter { $0.member == "InterfacesAdded" }.map(SignalRecorder.describe)
        #expect(!exported.contains("IA /org/bluez/hci0/dev_CB_B8_33_4C_88_4F"))
        #expect(!exported.contains("IA /org/bluez/hci0/dev_A4_C1_38_8F_80_A5"))
        let paths = try await c.managedPaths()
        #expect(!paths.contains("/org/bluez/hci0/dev_CB_B8_33_4C_88_4F"))  // Ruuvi at -80
        #expect(!paths.contains("/org/bluez/hci0/dev_A4_C1_38_8F_80_A5"))  // BTHome at -75
    }

    @Test func optionalPropertiesAreAbsentAndRemoveDeviceDisconnectsFirst() async throws {
        let sim = try await SimulatorFixture.start(
            scenario: """
                peripherals:
                  - address: "C0:FF:EE:00:00:02"
                    gatt: [{uuid: "180F", characteristics: [{uuid: "2A19", flags: [read], value: "64"}]}]
                """)
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        let device: DBusObjectPath = "/org/bluez/hci0/dev_C0_FF_EE_00_00_02"
        try await c.discover(device)
        let all =
            try await c.call(device, "org.freedesktop.DBus.Properties", "GetAll", [.string("org.bluez.Device1")])
            .first?.stringVariantDictionary ?? [:]
        for absent in ["Name", "TxPower", "ManufacturerData", "ServiceData", "Appearance", "Icon", "Class"] {
            #expect(all[absent] == nil, "\(absent) should be absent")
        }
        #expect(all["Alias"] == .string("C0-FF-EE-00-00-02"))
        #expect(all["RSSI"] == .int16(-60))
        #expect(all["AddressType"] == .string("public"))
        #expect(all["Adapter"] == .objectPath("/org/bluez/hci0"))
        try await c.call(device, "org.bluez.Device1", "Connect")
        try await c.waitResolved(device)
        try await c.call("/org/bluez/hci0", "org.bluez.Adapter1", "StopDiscovery")  // else it would be found again
        let rec = try await SignalRecorder(c.connection)
        try await c.call("/org/bluez/hci0", "org.bluez.Adapter1", "RemoveDevice", [.objectPath(device)])
        try await rec.wait("device removed") { $0.contains { SignalRecorder.describe($0) == "IR \(device.rawValue)" } }
        let order = rec.all.map(SignalRecorder.describe)
        let disconnected = try #require(order.firstIndex(of: "PC \(device.rawValue) {Connected}"))
        let removed = try #require(order.firstIndex(of: "IR \(device.rawValue)"))
        #expect(disconnected < removed)
        #expect(
            await c.error("/org/bluez/hci0", "org.bluez.Adapter1", "RemoveDevice", [.objectPath(device)])
                == DBusError(name: "org.bluez.Error.DoesNotExist", message: "Does Not Exist"))
    }

    @Test func pairedDevicesExistAtStartWithoutRSSI() async throws {
        let sim = try await SimulatorFixture.start(
            scenario: """
                peripherals:
                  - {address: "C0:FF:EE:00:00:03", name: Known, paired: true, tx_power: 4}
                  - {address: "C0:FF:EE:00:00:04", name: Stranger}
                """)
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        let known: DBusObjectPath = "/org/bluez/hci0/dev_C0_FF_EE_00_00_03"
        #expect(try await c.managedPaths() == ["/org/bluez", "/org/bluez/hci0", known.rawValue])
        #expect(await c.property(known, "org.bluez.Device1", "Paired") == .boolean(true))
        #expect(await c.property(known, "org.bluez.Device1", "Name") == .string("Known"))
        #expect(await c.property(known, "org.bluez.Device1", "RSSI") == nil)
        try await c.discover(known)
        try await waitUntil(timeout: 2) { await c.property(known, "org.bluez.Device1", "RSSI") != nil }
        #expect(await c.property(known, "org.bluez.Device1", "RSSI") == .int16(-60))
        #expect(await c.property(known, "org.bluez.Device1", "TxPower") == .int16(4))
    }

    @Test func hostileCallsNeverCrashTheSimulator() async throws {
        let sim = try await demoFixture()
        defer { sim.stopInBackground() }
        let c = try Client(sim)
        try await c.discover(hrPath)
        try await c.call(hrPath, "org.bluez.Device1", "Connect")
        try await c.waitResolved(hrPath)
        let targets: [(DBusObjectPath, String, [String])] = [
            (
                "/org/bluez/hci0", "org.bluez.Adapter1",
                ["StartDiscovery", "StopDiscovery", "SetDiscoveryFilter", "RemoveDevice", "GetDiscoveryFilters"]
            ),
            ("/org/bluez/hci0", "org.bluez.AdvertisementMonitorManager1", ["RegisterMonitor", "UnregisterMonitor"]),
            (hrPath, "org.bluez.Device1", ["Pair", "ConnectProfile", "CancelPairing"]),
            (
                hrPath.appending("service000d/char000e"), "org.bluez.GattCharacteristic1",
                ["ReadValue", "WriteValue", "AcquireWrite", "AcquireNotify", "StartNotify", "StopNotify"]
            ),
            (
                hrPath.appending("service000d/char000e/desc0010"), "org.bluez.GattDescriptor1",
                ["ReadValue", "WriteValue"]
            ),
            (
                "/org/bluez/sim", "io.blebridge.Simulator1",
                [
                    "AddPeripheral", "SetAdvertisement", "PushNotification", "SetNotificationRate", "InjectFault",
                    "Disconnect", "GetWrites", "Burst", "RemovePeripheral",
                ]
            ),
        ]
        let argumentSets: [[DBusValue]] = [
            [], [.string("")], [.string("\u{1}\u{7f}ÿ")], [.uint32(.max)], [.objectPath("/")],
            [.stringVariantDictionary([("offset", .string("x")), ("type", .uint32(1))])],
            [.bytes(Array(repeating: 0xFF, count: 4096)), .stringVariantDictionary([("offset", .uint16(.max))])],
            [.string("A0:9E:1A:4F:2C:11"), .string("2A37"), .bytes([])],
            [.string("A0:9E:1A:4F:2C:11"), .string("[[[[{"), .string("{count: -1}")],
            [.string("A0:9E:1A:4F:2C:11"), .string("2A37"), .double(.infinity)],
            [.string("A0:9E:1A:4F:2C:11"), .string("2A37"), .uint32(10_000_001)],
            [.stringVariantDictionary([("UUIDs", .array("s", [.string("nope")])), ("RSSI", .int16(.min))])],
        ]
        var answered = 0
        for (path, interface, methods) in targets {
            for method in methods {
                for args in argumentSets {
                    _ = await c.error(path, interface, method, args, timeout: .seconds(5))
                    answered += 1
                }
            }
        }
        #expect(answered == 27 * argumentSets.count)
        #expect(sim.process.isRunning)
        try await c.connection.ping("org.bluez")
        #expect(await c.property("/org/bluez/hci0", "org.bluez.Adapter1", "Powered")?.bool == true)
    }
}
