// The peripheral role against a tiny in-test bluetoothd on a private bus: it owns org.bluez, exports an adapter
// with GattManager1 and LEAdvertisingManager1 that record calls, and calls our application the way
// src/gatt-database.c and src/advertising.c do (GetManagedObjects, ReadValue, WriteValue, AcquireNotify, Release...).
import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

@testable import BlueZ

/// A value behind a lock that closures can capture.
final class Locked<Value: Sendable>: Sendable {
    private let mutex: Mutex<Value>
    init(_ value: Value) { mutex = Mutex(value) }
    func withLock<R: Sendable>(_ body: (inout Value) -> R) -> R { mutex.withLock { body(&$0) } }
}

/// A bluetoothd stand-in: the adapter object, the two managers, and a Device1 for the central.
final class FakeBluetoothd: Sendable {
    struct Call: Sendable, Hashable {
        var method: String
        var sender: String
        var path: String
    }

    static let adapterPath: DBusObjectPath = "/org/bluez/hci0"
    static let centralPath: DBusObjectPath = "/org/bluez/hci0/dev_11_22_33_44_55_66"

    let connection: DBusConnection
    let server: DBusObjectServer
    let calls = Locked<[Call]>([])
    /// Registrations to refuse with org.bluez.Error.Failed before accepting again.
    let refuse = Locked(0)
    /// When set, registrations get no answer (their replies are kept here).
    let hold = Locked(false)
    let held = Locked<[DBusPendingReply]>([])

    init(address: String) async throws {
        connection = try await DBusConnection.open(.address(address))
        server = DBusObjectServer(connection: connection, objectManagerPath: "/", propertyErrors: .bluez)
        let calls = self.calls
        let refuse = self.refuse
        let hold = self.hold
        let held = self.held
        func recorder(_ name: String, _ signature: DBusSignature, registration: Bool) -> DBusMethodSpec {
            DBusMethodSpec(name, in: signature) { call in
                calls.withLock {
                    $0.append(Call(method: name, sender: call.sender, path: call.arguments.first?.string ?? ""))
                }
                let refused = refuse.withLock { remaining -> Bool in
                    guard registration, remaining > 0 else { return false }
                    remaining -= 1
                    return true
                }
                if registration, hold.withLock({ $0 }) {
                    held.withLock { $0.append(call.reply) }
                    return .deferred
                }
                if refused {
                    return .error(DBusError(name: "org.bluez.Error.Failed", message: "refused by the test"))
                }
                return .reply([])
            }
        }
        let adapter = DBusInterfaceSpec(
            "org.bluez.Adapter1",
            properties: [
                DBusPropertySpec("Address", "s"), DBusPropertySpec("Powered", "b"),
                DBusPropertySpec("Discovering", "b"),
                DBusPropertySpec("Roles", "as"),
            ])
        let gatt = DBusInterfaceSpec(
            "org.bluez.GattManager1",
            methods: [
                recorder("RegisterApplication", "oa{sv}", registration: true),
                recorder("UnregisterApplication", "o", registration: false),
            ])
        let advertising = DBusInterfaceSpec(
            "org.bluez.LEAdvertisingManager1",
            methods: [
                recorder("RegisterAdvertisement", "oa{sv}", registration: true),
                recorder("UnregisterAdvertisement", "o", registration: false),
            ])
        server.addInterfaces(
            at: Self.adapterPath,
            [
                (
                    adapter,
                    [
                        "Address": .string("00:1A:7D:DA:71:10"), "Powered": .boolean(true),
                        "Discovering": .boolean(false), "Roles": .stringArray(["central", "peripheral"]),
                    ]
                ), (gatt, [:]), (advertising, [:]),
            ])
        let device = DBusInterfaceSpec(
            "org.bluez.Device1",
            properties: [
                DBusPropertySpec("Address", "s"), DBusPropertySpec("Adapter", "o"), DBusPropertySpec("Connected", "b"),
            ])
        server.addInterfaces(
            at: Self.centralPath,
            [
                (
                    device,
                    [
                        "Address": .string("11:22:33:44:55:66"), "Adapter": .objectPath(Self.adapterPath),
                        "Connected": .boolean(true),
                    ]
                )
            ])
        server.flush()
        _ = try await connection.requestName("org.bluez")
    }

    func calls(_ method: String) -> [Call] { calls.withLock { $0.filter { $0.method == method } } }

    /// Waits until `method` was called `count` times and returns the last call.
    func waitForCall(_ method: String, count: Int = 1, seconds: Double = 10) async throws -> Call {
        try await eventually(seconds, "\(count) call(s) of \(method)") { calls(method).count >= count }
        return calls(method)[count - 1]
    }

    /// Calls our application (like bluetoothd, from its own connection).
    func call(
        _ target: Call, _ path: String, _ interface: String, _ method: String, _ arguments: [DBusValue] = []
    ) async throws(DBusError) -> [DBusValue] {
        try await connection.call(
            destination: target.sender, path: DBusObjectPath(stringLiteral: path), interface: interface,
            method: method, arguments: arguments, timeout: .seconds(5))
    }

    /// The D-Bus error name a call ends with (nil when it succeeds).
    func errorName(
        _ target: Call, _ path: String, _ interface: String, _ method: String, _ arguments: [DBusValue] = []
    ) async -> String? {
        do {
            _ = try await call(target, path, interface, method, arguments)
            return nil
        } catch {
            return error.name
        }
    }

    func close() { connection.close() }
}

/// A private bus, the fake bluetoothd on it and a started client.
final class PeripheralFixture: Sendable {
    let bus: PrivateBus
    let fake: FakeBluetoothd
    let client: BlueZClient

    /// - Parameter stableAddress: point the client at the bus address without its guid, so that it can reconnect
    ///   to a dbus-daemon relaunched on the same socket.
    init(stableAddress: Bool = false) async throws {
        bus = try await PrivateBus.start()
        fake = try await FakeBluetoothd(address: bus.address)
        client = try await BlueZClient.open(
            bus: .address(stableAddress ? bus.stableAddress : bus.address),
            logger: BlueZLogger(handler: TestLogHandler(), level: .debug))
        try await client.start(timeout: .seconds(10))
        _ = try await client.waitForAdapter(.name("hci0"), timeout: .seconds(5))
    }

    deinit {
        client.close()
        fake.close()
        bus.daemon.stopInBackground()
    }
}

/// Collects an application's or advertisement's events in the background.
final class Recorder<Event: Sendable>: Sendable {
    let events = Locked<[Event]>([])
    let ended = Locked(false)
    private let task = Locked<Task<Void, Never>?>(nil)

    init<S: AsyncSequence & Sendable>(_ sequence: S) where S.Element == Event {
        let events = self.events
        let ended = self.ended
        task.withLock {
            $0 = Task {
                do {
                    for try await event in sequence { events.withLock { $0.append(event) } }
                } catch {}
                ended.withLock { $0 = true }
            }
        }
    }

    deinit { task.withLock { $0?.cancel() } }

    var all: [Event] { events.withLock { $0 } }
    func count(_ match: (Event) -> Bool) -> Int { all.filter(match).count }
}

let batteryService = LocalGATTService(
    uuid: "180F",
    characteristics: [
        LocalGATTCharacteristic(
            uuid: "2A19", id: "level", flags: [.read, .notify, .indicate], initialValue: [0x10, 0x20, 0x30, 0x40],
            descriptors: [.userDescription("Battery"), .presentationFormat(format: 0x04, unit: 0x27AD)]),
        LocalGATTCharacteristic(uuid: "12345678-1234-5678-1234-56789abcdef1", id: "command", flags: [.write]),
        LocalGATTCharacteristic(
            uuid: "12345678-1234-5678-1234-56789abcdef2", id: "stream", flags: [.read, .writeWithoutResponse],
            initialValue: [0]),
        LocalGATTCharacteristic(uuid: "2A00", id: "name", flags: [.read], initialValue: Array("blebridge".utf8)),
        LocalGATTCharacteristic(uuid: "2A2B", id: "control", flags: [.write, .notify], acquire: []),
    ])

let levelPath = "/service0/char0"
let commandPath = "/service0/char1"
let streamPath = "/service0/char2"
let namePath = "/service0/char3"
let controlPath = "/service0/char4"
let characteristicInterface = "org.bluez.GattCharacteristic1"

/// The write handler the tests use: refuses some byte patterns with each error kind, records the rest.
final class WriteLog: Sendable {
    let writes = Locked<[LocalGATTWrite]>([])

    var handler: LocalGATTWriteHandler {
        { [writes] write in
            writes.withLock { $0.append(write) }
            switch write.bytes.first {
            case 0xE1?: return .reject(.invalidValueLength)
            case 0xE2?: return .reject(.notAuthorized)
            case 0xE3?: return .reject(.application(code: 0x85))
            case 0xE4?: return .reject(.failed("busy"))
            default: return .accept
            }
        }
    }
}

/// A running application with its fixture.
final class RunningApplication: Sendable {
    let fixture: PeripheralFixture
    let app: BlueZGATTApplication
    let log = WriteLog()
    let events: Recorder<LocalGATTEvent>
    let task: Task<Void, Never>
    let registration: FakeBluetoothd.Call

    init(fixture: PeripheralFixture? = nil) async throws {
        let fixture = try await Self.fixture(fixture)
        self.fixture = fixture
        app = try BlueZGATTApplication(
            client: fixture.client, services: [batteryService], adapter: .name("hci0"), writeHandler: log.handler)
        events = Recorder(app.events)
        let app = self.app
        task = Task { try? await app.run() }
        registration = try await fixture.fake.waitForCall("RegisterApplication")
    }

    deinit { task.cancel() }

    private static func fixture(_ given: PeripheralFixture?) async throws -> PeripheralFixture {
        if let given { return given }
        return try await PeripheralFixture()
    }

    var fake: FakeBluetoothd { fixture.fake }

    func call(_ path: String, _ method: String, _ arguments: [DBusValue] = []) async throws(DBusError)
        -> [DBusValue]
    {
        try await fake.call(registration, app.path + path, characteristicInterface, method, arguments)
    }

    func errorName(_ path: String, _ method: String, _ arguments: [DBusValue] = []) async -> String? {
        await fake.errorName(registration, app.path + path, characteristicInterface, method, arguments)
    }
}

func options(_ entries: [(String, DBusValue)] = []) -> DBusValue { .stringVariantDictionary(entries) }

@Suite struct LocalGATTApplicationTests {
    @Test func registersTheWholeTreeWithItsProperties() async throws {
        let t = try await RunningApplication()
        #expect(t.registration.path == t.app.path)
        try await eventually(5, "the registered event") {
            t.events.count { if case .registered(let a) = $0 { return a.name == "hci0" } else { return false } } == 1
        }
        let reply = try await t.fake.call(
            t.registration, t.app.path, "org.freedesktop.DBus.ObjectManager", "GetManagedObjects")
        var tree: [String: [String: [String: DBusValue]]] = [:]
        for entry in reply.first?.dictionaryEntries ?? [] {
            guard let path = entry.key.string else { continue }
            var interfaces: [String: [String: DBusValue]] = [:]
            for i in entry.value.dictionaryEntries ?? [] {
                if let name = i.key.string { interfaces[name] = i.value.stringVariantDictionary ?? [:] }
            }
            tree[path] = interfaces
        }
        let root = t.app.path
        #expect(
            Set(tree.keys) == [
                root + "/service0", root + levelPath, root + commandPath, root + streamPath, root + namePath,
                root + controlPath,
                root + levelPath + "/desc0", root + levelPath + "/desc1",
            ])
        let service = try #require(tree[root + "/service0"]?["org.bluez.GattService1"])
        #expect(service["UUID"]?.string == "0000180f-0000-1000-8000-00805f9b34fb")
        #expect(service["Primary"]?.bool == true)
        let level = try #require(tree[root + levelPath]?[characteristicInterface])
        #expect(level["UUID"]?.string == "00002a19-0000-1000-8000-00805f9b34fb")
        #expect(level["Service"]?.string == root + "/service0")
        #expect(level["Flags"]?.arrayElements?.compactMap(\.string) == ["read", "notify", "indicate"])
        #expect(level["Value"]?.bytes == [0x10, 0x20, 0x30, 0x40])
        #expect(level["Notifying"]?.bool == false)
        #expect(level["NotifyAcquired"]?.bool == false)
        #expect(level["WriteAcquired"] == nil)
        let stream = try #require(tree[root + streamPath]?[characteristicInterface])
        #expect(stream["WriteAcquired"]?.bool == false)
        #expect(stream["Notifying"] == nil)
        let command = try #require(tree[root + commandPath]?[characteristicInterface])
        #expect(command["Flags"]?.arrayElements?.compactMap(\.string) == ["write"])
        let description = try #require(tree[root + levelPath + "/desc0"]?["org.bluez.GattDescriptor1"])
        #expect(description["UUID"]?.string == "00002901-0000-1000-8000-00805f9b34fb")
        #expect(description["Characteristic"]?.string == root + levelPath)
        #expect(description["Flags"]?.arrayElements?.compactMap(\.string) == ["read"])
        #expect(description["Value"]?.bytes == Array("Battery".utf8))
        let format = try #require(tree[root + levelPath + "/desc1"]?["org.bluez.GattDescriptor1"])
        #expect(format["Value"]?.bytes == [0x04, 0x00, 0xAD, 0x27, 0x01, 0x00, 0x00])
    }

    @Test func readsWithOffsetsAndRefusesWhatTheFlagsDoNotAllow() async throws {
        let t = try await RunningApplication()
        let device = DBusValue.objectPath(FakeBluetoothd.centralPath)
        #expect(try await t.call(levelPath, "ReadValue", [options()]).first?.bytes == [0x10, 0x20, 0x30, 0x40])
        let tail = try await t.call(
            levelPath, "ReadValue",
            [options([("offset", .uint16(2)), ("device", device), ("mtu", .uint16(185)), ("x-unknown", .string("y"))])])
        #expect(tail.first?.bytes == [0x30, 0x40])
        #expect(try await t.call(levelPath, "ReadValue", [options([("offset", .uint16(4))])]).first?.bytes == [])
        #expect(
            await t.errorName(levelPath, "ReadValue", [options([("offset", .uint16(5))])])
                == "org.bluez.Error.InvalidOffset")
        #expect(await t.errorName(commandPath, "ReadValue", [options()]) == "org.bluez.Error.NotPermitted")
        // Descriptors read the same way.
        let description = try await t.fake.call(
            t.registration, t.app.path + levelPath + "/desc0", "org.bluez.GattDescriptor1", "ReadValue",
            [options([("offset", .uint16(3))])])
        #expect(description.first?.bytes == Array("tery".utf8))
        try await eventually(5, "the read event with the device") {
            t.events.all.contains(
                .read(device: FakeBluetoothd.centralPath.rawValue, characteristicID: "level", descriptorUUID: nil))
        }
        // The device named in the options counts as a connected central.
        try await eventually(5, "centralConnected") {
            t.events.all.contains(
                .centralConnected(address: "11:22:33:44:55:66", device: FakeBluetoothd.centralPath.rawValue))
        }
    }

    @Test func malformedCallsGetInvalidArgumentsAndTheApplicationStaysUp() async throws {
        let t = try await RunningApplication()
        let invalid = "org.bluez.Error.InvalidArguments"
        #expect(await t.errorName(levelPath, "ReadValue", [.string("offset")]) == invalid)
        #expect(await t.errorName(levelPath, "ReadValue") == invalid)
        #expect(await t.errorName(levelPath, "ReadValue", [options(), options()]) == invalid)
        #expect(await t.errorName(commandPath, "WriteValue", [.bytes([1])]) == invalid)
        #expect(await t.errorName(commandPath, "WriteValue", [.string("x"), options()]) == invalid)
        #expect(
            await t.errorName(commandPath, "WriteValue", [.bytes([1]), .dictionary(key: "s", value: "s", [])])
                == invalid)
        #expect(await t.errorName(levelPath, "StartNotify", [.uint32(1)]) == invalid)
        #expect(await t.errorName(levelPath, "AcquireNotify", [.bytes([])]) == invalid)
        // Options of the wrong type are ignored, as unknown ones are.
        #expect(
            try await t.call(levelPath, "ReadValue", [options([("offset", .string("2"))])]).first?.bytes
                == [0x10, 0x20, 0x30, 0x40])
        #expect(try await t.call(namePath, "ReadValue", [options()]).first?.bytes == Array("blebridge".utf8))
    }

    @Test func writesReachTheHandlerAndItsErrorsReachBluetoothd() async throws {
        let t = try await RunningApplication()
        let device = DBusValue.objectPath(FakeBluetoothd.centralPath)
        _ = try await t.call(
            commandPath, "WriteValue",
            [.bytes([1, 2, 3]), options([("type", .string("request")), ("device", device), ("mtu", .uint16(64))])])
        let first = try #require(t.log.writes.withLock { $0.first })
        #expect(first.characteristicID == "command")
        #expect(first.characteristicUUID == "12345678-1234-5678-1234-56789abcdef1")
        #expect(first.bytes == [1, 2, 3])
        #expect(first.type == .request)
        #expect(first.device == FakeBluetoothd.centralPath.rawValue)
        #expect(first.mtu == 64)
        #expect(t.app.value(for: "command") == [1, 2, 3])
        // A long write continues at its offset.
        _ = try await t.call(commandPath, "WriteValue", [.bytes([9, 9]), options([("offset", .uint16(2))])])
        #expect(t.app.value(for: "command") == [1, 2, 9, 9])
        #expect(
            await t.errorName(commandPath, "WriteValue", [.bytes([7]), options([("offset", .uint16(5))])])
                == "org.bluez.Error.InvalidOffset")
        // A prepared write that bluetoothd only asks to authorize reaches the handler but is not stored.
        _ = try await t.call(
            commandPath, "WriteValue",
            [.bytes([5]), options([("type", .string("reliable")), ("prepare-authorize", .boolean(true))])])
        let prepared = try #require(t.log.writes.withLock { $0.last })
        #expect(prepared.prepareAuthorize)
        #expect(prepared.type == .reliable)
        #expect(t.app.value(for: "command") == [1, 2, 9, 9])
        // Each refusal keeps the stored value and names bluetoothd's error.
        #expect(
            await t.errorName(commandPath, "WriteValue", [.bytes([0xE1]), options()])
                == "org.bluez.Error.InvalidValueLength")
        #expect(
            await t.errorName(commandPath, "WriteValue", [.bytes([0xE2]), options()]) == "org.bluez.Error.NotAuthorized"
        )
        do {
            _ = try await t.call(commandPath, "WriteValue", [.bytes([0xE3]), options()])
            Issue.record("the application error was accepted")
        } catch {
            #expect(error.name == "org.bluez.Error.Failed")
            #expect(error.message == "0x85")
        }
        #expect(await t.errorName(commandPath, "WriteValue", [.bytes([0xE4]), options()]) == "org.bluez.Error.Failed")
        #expect(t.app.value(for: "command") == [1, 2, 9, 9])
        // Flags are checked before the handler.
        let before = t.log.writes.withLock { $0.count }
        #expect(await t.errorName(namePath, "WriteValue", [.bytes([1]), options()]) == "org.bluez.Error.NotPermitted")
        #expect(t.log.writes.withLock { $0.count } == before)
        #expect(t.app.value(for: "name") == Array("blebridge".utf8))
        try await eventually(5, "the write events") {
            t.events.count { if case .write(_, "command", nil, _, _) = $0 { return true } else { return false } } == 2
        }
    }

    @Test func aCentralsOwnWriteIsNotEchoedAsANotification() async throws {
        let t = try await RunningApplication()
        let control = try #require(
            try await t.fake.call(
                t.registration, t.app.path + controlPath, "org.freedesktop.DBus.Properties", "GetAll",
                [.string(characteristicInterface)]
            ).first?.stringVariantDictionary)
        #expect(control["NotifyAcquired"] == nil)
        #expect(control["Notifying"]?.bool == false)
        let signals = try await t.fake.connection.signals(
            matching: DBusMatchRule(
                sender: t.registration.sender, interface: "org.freedesktop.DBus.Properties",
                member: "PropertiesChanged", path: DBusObjectPath(stringLiteral: t.app.path + controlPath)))
        _ = try await t.call(controlPath, "StartNotify")
        _ = try await t.call(controlPath, "WriteValue", [.bytes([1]), options([("type", .string("request"))])])
        #expect(t.app.value(for: "control") == [1])
        try t.app.setValue([2], for: "control")
        let first = try await within(5, "the first Value signal") {
            for await message in signals {
                if let value = message.body.dropFirst().first?.stringVariantDictionary?["Value"]?.bytes { return value }
            }
            throw TimeoutError("the signal stream ended")
        }
        #expect(first == [2])
    }

    @Test func startNotifyDeliversRapidValuesInOrderAsPropertiesChanged() async throws {
        let t = try await RunningApplication()
        let signals = try await t.fake.connection.signals(
            matching: DBusMatchRule(
                sender: t.registration.sender, interface: "org.freedesktop.DBus.Properties",
                member: "PropertiesChanged", path: DBusObjectPath(stringLiteral: t.app.path + levelPath)))
        #expect(await t.errorName(namePath, "StartNotify") == "org.bluez.Error.NotSupported")
        _ = try await t.call(levelPath, "StartNotify")
        #expect(t.app.isNotifying("level"))
        #expect(await t.errorName(levelPath, "AcquireNotify", [options()]) == "org.bluez.Error.NotPermitted")
        let count = 500
        let collected = Task {
            var values: [[UInt8]] = []
            var notifying: Bool?
            for await message in signals {
                guard let changed = message.body.dropFirst().first?.stringVariantDictionary else { continue }
                if let n = changed["Notifying"]?.bool { notifying = n }
                if let value = changed["Value"]?.bytes { values.append(value) }
                if values.count == count { break }
            }
            return (values, notifying)
        }
        for value in sequence(count) { try t.app.setValue(value, for: "level") }
        let (values, notifying) = try await within(10, "500 notifications") {
            await withTaskCancellationHandler {
                await collected.value
            } onCancel: {
                collected.cancel()
            }
        }
        #expect(values == sequence(count))
        #expect(notifying == true)
        _ = try await t.call(levelPath, "StopNotify")
        #expect(!t.app.isNotifying("level"))
        _ = try await t.call(levelPath, "Confirm")
        try await eventually(5, "subscribe, confirm and unsubscribe events") {
            t.events.all.contains(.subscribed(characteristicID: "level", via: .startNotify, device: nil))
                && t.events.all.contains(.unsubscribed(characteristicID: "level", via: .startNotify))
                && t.events.all.contains(.confirmed(characteristicID: "level"))
        }
        #expect(t.app.confirmationCount(for: "level") == 1)
    }

    @Test func acquireNotifySendsEachValueAsADatagramInOrder() async throws {
        let t = try await RunningApplication()
        let reply = try await t.call(
            levelPath, "AcquireNotify",
            [options([("device", .objectPath(FakeBluetoothd.centralPath)), ("mtu", .uint16(100))])])
        let fd = try #require(reply.first?.fileDescriptor)
        #expect(reply.dropFirst().first?.uint16 == 100)
        #expect(await t.errorName(levelPath, "StartNotify") == "org.bluez.Error.NotPermitted")
        try await eventually(5, "NotifyAcquired") {
            let reply = try await t.fake.call(
                t.registration, t.app.path + levelPath, "org.freedesktop.DBus.Properties", "Get",
                [.string(characteristicInterface), .string("NotifyAcquired")])
            return reply.first?.bool == true
        }
        let count = 500
        let raw = fd.rawValue
        let received = ReceivedCount()
        let reader = Task { try await offPool { try readDatagrams(raw, count: count, progress: received) } }
        // In bursts of 100 (what a socket buffer holds with room to spare), each sent as fast as setValue goes: a
        // reader thread that the machine's load keeps off the CPU for a second must not turn into a lost value
        // (setValue gives up on a socket that takes nothing for a second, as bluetoothd would have hung).
        for (i, value) in sequence(count).enumerated() {
            if i > 0, i % 100 == 0 {
                try await eventually(10, "the reader to take \(i) datagrams") {
                    received.value.load(ordering: .relaxed) == i
                }
            }
            try t.app.setValue(value, for: "level")
        }
        let values = try await within(10, "500 datagrams") { try await reader.value }
        #expect(values == sequence(count))
        // bluetoothd writes 0x01 for each confirmation of an indication.
        var one: UInt8 = 1
        #expect(send(raw, &one, 1, 0) == 1)
        try await eventually(5, "the confirmation") { t.app.confirmationCount(for: "level") == 1 }
        // Closing bluetoothd's end ends the subscription.
        _ = close(fd.take())
        try await eventually(5, "the unsubscribed event") {
            t.events.all.contains(.unsubscribed(characteristicID: "level", via: .acquireNotify))
        }
        #expect(!t.app.isNotifying("level"))
        #expect(
            t.events.all.contains(
                .subscribed(
                    characteristicID: "level", via: .acquireNotify, device: FakeBluetoothd.centralPath.rawValue)))
    }

    @Test func acquireWriteDeliversDatagramsToTheHandlerAsCommands() async throws {
        let t = try await RunningApplication()
        #expect(
            await t.errorName(commandPath, "AcquireWrite", [options()]) == "org.freedesktop.DBus.Error.UnknownMethod")
        let reply = try await t.call(streamPath, "AcquireWrite", [options([("mtu", .uint16(64))])])
        let fd = try #require(reply.first?.fileDescriptor)
        #expect(reply.dropFirst().first?.uint16 == 64)
        for i in 1...3 {
            var bytes: [UInt8] = [UInt8(i), 0xAA]
            #expect(send(fd.rawValue, &bytes, bytes.count, 0) == 2)
        }
        try await eventually(5, "three writes from the socket") { t.log.writes.withLock { $0.count } == 3 }
        let writes = t.log.writes.withLock { $0 }
        #expect(writes.map(\.bytes) == [[1, 0xAA], [2, 0xAA], [3, 0xAA]])
        #expect(writes.allSatisfy { $0.type == .command && $0.characteristicID == "stream" })
        #expect(t.app.value(for: "stream") == [3, 0xAA])
        // A write command through WriteValue (no reply expected, no type option) is a command too.
        var message = DBusMessage.methodCall(
            destination: t.registration.sender, path: DBusObjectPath(stringLiteral: t.app.path + streamPath),
            interface: characteristicInterface, method: "WriteValue", body: [.bytes([4]), options()])
        message.noReplyExpected = true
        try t.fake.connection.send(message)
        try await eventually(5, "the fourth write") { t.log.writes.withLock { $0.count } == 4 }
        #expect(t.log.writes.withLock { $0.last?.type } == .command)
    }

    @Test func centralDisconnectIsReported() async throws {
        let t = try await RunningApplication()
        _ = try await t.call(levelPath, "ReadValue", [options([("device", .objectPath(FakeBluetoothd.centralPath))])])
        try await eventually(5, "centralConnected") {
            t.events.all.contains(
                .centralConnected(address: "11:22:33:44:55:66", device: FakeBluetoothd.centralPath.rawValue))
        }
        t.fake.server.setProperty(
            at: FakeBluetoothd.centralPath, interface: "org.bluez.Device1", "Connected", .boolean(false))
        try await eventually(5, "centralDisconnected") {
            t.events.all.contains(
                .centralDisconnected(address: "11:22:33:44:55:66", device: FakeBluetoothd.centralPath.rawValue))
        }
    }

    @Test func registersAgainAfterRefusalsAndAfterBluetoothdComesBack() async throws {
        let fixture = try await PeripheralFixture()
        fixture.fake.refuse.withLock { $0 = 2 }
        let t = try await RunningApplication(fixture: fixture)
        _ = try await t.fake.waitForCall("RegisterApplication", count: 3)
        try await eventually(5, "two failures, then registered") {
            t.events.count { if case .registrationFailed = $0 { return true } else { return false } } == 2
                && t.events.count { if case .registered = $0 { return true } else { return false } } == 1
        }
        _ = try await t.call(levelPath, "StartNotify")
        // bluetoothd leaves the bus: the registration and the subscription are gone.
        try await t.fake.connection.releaseName("org.bluez")
        try await eventually(5, "unregistered: bluetoothd stopped") {
            t.events.all.contains(.unregistered(reason: .bluetoothdStopped))
        }
        #expect(!t.app.isNotifying("level"))
        // It comes back: the application registers again with the new daemon.
        _ = try await t.fake.connection.requestName("org.bluez")
        let again = try await t.fake.waitForCall("RegisterApplication", count: 4)
        #expect(again.path == t.app.path)
        try await eventually(5, "registered again") {
            t.events.count { if case .registered = $0 { return true } else { return false } } == 2
        }
        #expect(try await t.call(namePath, "ReadValue", [options()]).first?.bytes == Array("blebridge".utf8))
    }

    @Test func cancellingUnregistersAndRemovesTheObjects() async throws {
        let t = try await RunningApplication()
        let sender = t.registration.sender
        try await eventually(5, "registered") {
            t.events.count { if case .registered = $0 { return true } else { return false } } == 1
        }
        t.task.cancel()
        let unregister = try await t.fake.waitForCall("UnregisterApplication")
        #expect(unregister.path == t.app.path)
        #expect(unregister.sender == sender)
        _ = await t.task.value
        try await eventually(5, "the event stream ended") { t.events.ended.withLock { $0 } }
        #expect(t.events.all.last == .unregistered(reason: .cancelled))
        // The connection that exported the objects is gone with them.
        let error = await t.fake.errorName(
            t.registration, t.app.path, "org.freedesktop.DBus.ObjectManager", "GetManagedObjects")
        #expect(error != nil)
        #expect(t.app.driver.withLock { $0 } == nil)
    }

    @Test func registersAgainWhenTheAdapterComesBack() async throws {
        let t = try await RunningApplication()
        let adapter = t.fake.server.property(
            at: FakeBluetoothd.adapterPath, interface: "org.bluez.Adapter1", "Address")
        #expect(adapter?.string == "00:1A:7D:DA:71:10")
        t.fake.server.removeInterfaces(at: FakeBluetoothd.adapterPath, ["org.bluez.Adapter1"])
        try await eventually(5, "unregistered: adapter removed") {
            t.events.all.contains(.unregistered(reason: .adapterRemoved(adapter: "hci0")))
        }
        #expect(t.fake.calls("RegisterApplication").count == 1)
        t.fake.server.addInterfaces(
            at: FakeBluetoothd.adapterPath,
            [
                (
                    DBusInterfaceSpec(
                        "org.bluez.Adapter1",
                        properties: [DBusPropertySpec("Address", "s"), DBusPropertySpec("Powered", "b")]),
                    ["Address": .string("00:1A:7D:DA:71:10"), "Powered": .boolean(true)]
                )
            ])
        _ = try await t.fake.waitForCall("RegisterApplication", count: 2)
        try await eventually(5, "registered again") {
            t.events.count { if case .registered = $0 { return true } else { return false } } == 2
        }
    }

    @Test func registersAgainAfterTheBusComesBack() async throws {
        let fixture = try await PeripheralFixture(stableAddress: true)
        let t = try await RunningApplication(fixture: fixture)
        try await eventually(5, "registered") {
            t.events.count { if case .registered = $0 { return true } else { return false } } == 1
        }
        fixture.bus.killDaemon()
        try await eventually(10, "unregistered: bus lost") { t.events.all.contains(.unregistered(reason: .busLost)) }
        let daemon = try await fixture.bus.relaunchDaemon()
        defer { daemon.stop() }
        let fake = try await FakeBluetoothd(address: fixture.bus.stableAddress)
        defer { fake.close() }
        let call = try await fake.waitForCall("RegisterApplication", seconds: 15)
        #expect(call.path == t.app.path)
        let value = try await fake.call(call, t.app.path + namePath, characteristicInterface, "ReadValue", [options()])
        #expect(value.first?.bytes == Array("blebridge".utf8))
        try await eventually(5, "registered again") {
            t.events.count { if case .registered = $0 { return true } else { return false } } == 2
        }
    }

    @Test func cancellingWhileRegistrationIsUnansweredStillUnregisters() async throws {
        let fixture = try await PeripheralFixture()
        fixture.fake.hold.withLock { $0 = true }
        let t = try await RunningApplication(fixture: fixture)
        t.task.cancel()
        let unregister = try await t.fake.waitForCall("UnregisterApplication")
        #expect(unregister.path == t.app.path)
        _ = await t.task.value
        #expect(!t.events.all.contains { if case .registered = $0 { return true } else { return false } })
        fixture.fake.held.withLock { $0 = [] }
    }

    @Test func rejectsDuplicateIDsAndBadUUIDs() async throws {
        let fixture = try await PeripheralFixture()
        let twice = LocalGATTService(
            uuid: "180F",
            characteristics: [
                LocalGATTCharacteristic(uuid: "2A19", flags: [.read]),
                LocalGATTCharacteristic(uuid: "2A19", flags: [.read]),
            ])
        #expect(throws: BlueZError.self) { try BlueZGATTApplication(client: fixture.client, services: [twice]) }
        let bad = LocalGATTService(uuid: "nope", characteristics: [])
        #expect(throws: BlueZError.self) { try BlueZGATTApplication(client: fixture.client, services: [bad]) }
        #expect(
            try LocalGATTFlags(bluezStrings: ["read", "secure-write", "authorize"]) == [
                .read, .secureWrite, .authorize,
            ])
        #expect(throws: BlueZError.self) { try LocalGATTFlags(bluezStrings: ["reed"]) }
        #expect(LocalGATTFlags.bluezNames.count == 23)
    }
}

/// How many datagrams a reader thread has taken so far.
final class ReceivedCount: Sendable {
    let value = Atomic<Int>(0)
}

/// The values 0..<count as two big-endian bytes each.
func sequence(_ count: Int) -> [[UInt8]] {
    (0..<count).map { (i: Int) -> [UInt8] in [UInt8(truncatingIfNeeded: i >> 8), UInt8(truncatingIfNeeded: i)] }
}

/// Reads `datagrams` datagrams from a blocking socket on a thread of its own; `progress` counts them as they come.
func readDatagrams(_ fd: Int32, count datagrams: Int, progress: ReceivedCount? = nil) throws -> [[UInt8]] {
    var out: [[UInt8]] = []
    var buffer = [UInt8](repeating: 0, count: 512)
    var timeout = timeval(tv_sec: 5, tv_usec: 0)
    _ = setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
    while out.count < datagrams {
        let n = buffer.withUnsafeMutableBytes { recv(fd, $0.baseAddress, $0.count, 0) }
        guard n > 0 else { throw HarnessError("recv ended after \(out.count) datagrams (errno \(errno))") }
        out.append(Array(buffer[0..<n]))
        progress?.value.store(out.count, ordering: .relaxed)
    }
    return out
}

let sample = LocalAdvertisementData(
    type: .peripheral, serviceUUIDs: ["180F"], manufacturerData: [0x004C: [1, 2, 3, 4]],
    serviceData: ["180F": [0x57]], localName: "blebridge", appearance: 0x0340, includes: ["tx-power"],
    discoverable: true, minInterval: .milliseconds(100), maxInterval: .milliseconds(200), txPower: 4)

@Suite struct LocalAdvertisementTests {

    @Test func exportsTheProperties() async throws {
        let fixture = try await PeripheralFixture()
        let advertisement = try BlueZAdvertisement(client: fixture.client, data: sample, adapter: .name("hci0"))
        let events = Recorder(advertisement.events)
        let task = Task { try? await advertisement.run() }
        defer { task.cancel() }
        let call = try await fixture.fake.waitForCall("RegisterAdvertisement")
        #expect(call.path == advertisement.path)
        let all = try await fixture.fake.call(
            call, advertisement.path, "org.freedesktop.DBus.Properties", "GetAll",
            [.string("org.bluez.LEAdvertisement1")])
        let p = try #require(all.first?.stringVariantDictionary)
        #expect(p["Type"]?.string == "peripheral")
        #expect(p["ServiceUUIDs"]?.arrayElements?.compactMap(\.string) == ["0000180f-0000-1000-8000-00805f9b34fb"])
        let manufacturer = try #require(p["ManufacturerData"]?.dictionaryEntries?.first)
        #expect(manufacturer.key.uint16 == 0x004C)
        #expect(manufacturer.value.variantValue?.bytes == [1, 2, 3, 4])
        let service = try #require(p["ServiceData"]?.stringVariantDictionary)
        #expect(service["0000180f-0000-1000-8000-00805f9b34fb"]?.bytes == [0x57])
        #expect(p["LocalName"]?.string == "blebridge")
        #expect(p["Appearance"]?.uint16 == 0x0340)
        #expect(p["Includes"]?.arrayElements?.compactMap(\.string) == ["tx-power"])
        #expect(p["Discoverable"]?.bool == true)
        #expect(p["MinInterval"]?.uint32 == 100)
        #expect(p["MaxInterval"]?.uint32 == 200)
        #expect(p["TxPower"]?.int16 == 4)
        try await eventually(5, "registered") {
            events.count { if case .registered = $0 { return true } else { return false } } == 1
        }
    }

    @Test func updatesInPlaceAndRegistersAgainAfterRelease() async throws {
        let fixture = try await PeripheralFixture()
        let advertisement = try BlueZAdvertisement(client: fixture.client, data: sample, adapter: .name("hci0"))
        let events = Recorder(advertisement.events)
        let task = Task { try? await advertisement.run() }
        let call = try await fixture.fake.waitForCall("RegisterAdvertisement")
        let signals = try await fixture.fake.connection.signals(
            matching: DBusMatchRule(
                sender: call.sender, interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged",
                path: DBusObjectPath(stringLiteral: advertisement.path)))
        var changed = sample
        changed.localName = "bridge-2"
        changed.manufacturerData = [:]
        try advertisement.update(changed)
        let message = try await within(5, "PropertiesChanged") {
            for await message in signals { return message }
            throw TimeoutError("the signal stream ended")
        }
        #expect(message.body.first?.string == "org.bluez.LEAdvertisement1")
        let values = try #require(message.body.dropFirst().first?.stringVariantDictionary)
        #expect(Set(values.keys) == ["LocalName"])
        #expect(values["LocalName"]?.string == "bridge-2")
        #expect(message.body.last?.arrayElements?.compactMap(\.string) == ["ManufacturerData"])
        #expect(fixture.fake.calls("RegisterAdvertisement").count == 1)
        // bluetoothd releases it (Release is [noreply]): it counts as unregistered and registers again.
        var release = DBusMessage.methodCall(
            destination: call.sender, path: DBusObjectPath(stringLiteral: advertisement.path),
            interface: "org.bluez.LEAdvertisement1", method: "Release")
        release.noReplyExpected = true
        try fixture.fake.connection.send(release)
        _ = try await fixture.fake.waitForCall("RegisterAdvertisement", count: 2)
        #expect(advertisement.releaseCount == 1)
        try await eventually(5, "released, then registered again") {
            events.all.contains(.unregistered(reason: .released))
                && events.count { if case .registered = $0 { return true } else { return false } } == 2
        }
        // Still the updated data.
        let name = try await fixture.fake.call(
            call, advertisement.path, "org.freedesktop.DBus.Properties", "Get",
            [.string("org.bluez.LEAdvertisement1"), .string("LocalName")])
        #expect(name.first?.string == "bridge-2")
        task.cancel()
        let unregister = try await fixture.fake.waitForCall("UnregisterAdvertisement")
        #expect(unregister.path == advertisement.path)
        _ = await task.value
        #expect(events.all.last == .unregistered(reason: .cancelled))
    }

    @Test func registersAgainWhenBluetoothdReturns() async throws {
        let fixture = try await PeripheralFixture()
        let advertisement = try BlueZAdvertisement(client: fixture.client, data: sample, adapter: .name("hci0"))
        let events = Recorder(advertisement.events)
        let task = Task { try? await advertisement.run() }
        defer { task.cancel() }
        _ = try await fixture.fake.waitForCall("RegisterAdvertisement")
        try await fixture.fake.connection.releaseName("org.bluez")
        try await eventually(5, "unregistered") { events.all.contains(.unregistered(reason: .bluetoothdStopped)) }
        _ = try await fixture.fake.connection.requestName("org.bluez")
        _ = try await fixture.fake.waitForCall("RegisterAdvertisement", count: 2)
    }

    @Test func legacyPayloadLengths() throws {
        // Flags 3 + appearance 4 + tx-power 3 + one 16-bit UUID 4 + manufacturer 4+4 + service data 2+2+1 = 27.
        #expect(sample.legacyAdvertisingLength == 27)
        #expect(sample.legacyScanResponseLength == 2 + 9)
        try sample.checkLegacyLength()
        var broadcast = LocalAdvertisementData(type: .broadcast, manufacturerData: [0x0059: [0, 1]])
        #expect(broadcast.legacyAdvertisingLength == 6)
        broadcast.discoverable = true
        #expect(broadcast.legacyAdvertisingLength == 9)
        let long = LocalAdvertisementData(
            serviceUUIDs: ["12345678-1234-5678-1234-56789abcdef1", "12345678-1234-5678-1234-56789abcdef2"])
        #expect(long.legacyAdvertisingLength == 3 + 2 + 32)
        #expect(throws: BlueZError.self) { try long.checkLegacyLength() }
        let mixed = LocalAdvertisementData(serviceUUIDs: ["180F", "180A", "0x12345678"])
        #expect(mixed.legacyAdvertisingLength == 3 + (2 + 4) + (2 + 4))
        let name = LocalAdvertisementData(localName: String(repeating: "n", count: 30))
        #expect(throws: BlueZError.self) { try name.checkLegacyLength() }
    }
}
