// The simulator's peripheral side over a real bus: a GATT application and an advertisement exported by this test
// process with the DBus target's DBusObjectServer, registered on bluez-sim, and driven by its remote central.
import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

/// A GATT server application on the test's own connection, recording what bluetoothd (the simulator) calls.
final class TestGattApp: Sendable {
    let connection: DBusConnection
    let server: DBusObjectServer
    let root: DBusObjectPath
    /// "Method path" per call, in order, plus the options of the last call per path.
    let calls = Mutex<[String]>([])
    let options = Mutex<[String: [String: DBusValue]]>([:])
    let values = Mutex<[String: [UInt8]]>([:])
    /// An error to answer per path (for the next calls, until cleared).
    let errors = Mutex<[String: DBusError]>([:])

    init(_ sim: SimulatorFixture, root: DBusObjectPath = "/app", objectManager: Bool = true) throws {
        connection = try DBusConnection(.address(sim.address))
        self.root = root
        server = DBusObjectServer(connection: connection, objectManagerPath: objectManager ? root : "/elsewhere")
    }

    func count(_ method: String, _ path: DBusObjectPath) -> Int {
        calls.withLock { $0.filter { $0 == "\(method) \(path.rawValue)" }.count }
    }

    private func record(_ call: DBusMethodCall, options index: Int?) {
        calls.withLock { $0.append("\(call.member) \(call.path.rawValue)") }
        if let index, call.arguments.count > index, let o = call.arguments[index].stringVariantDictionary {
            options.withLock { $0[call.path.rawValue] = o }
        }
    }

    private func readHandler() -> DBusMethodHandler {
        { [self] call in
            record(call, options: 0)
            if let e = errors.withLock({ $0[call.path.rawValue] }) { return .error(e) }
            let value = values.withLock { $0[call.path.rawValue] } ?? []
            let offset = Int(call.arguments.first?.stringVariantDictionary?["offset"]?.uint16 ?? 0)
            guard offset <= value.count else {
                return .error(DBusError(name: "org.bluez.Error.InvalidOffset", message: "Invalid offset"))
            }
            return .reply([.bytes(Array(value[offset...]))])
        }
    }

    private func writeHandler() -> DBusMethodHandler {
        { [self] call in
            record(call, options: 1)
            if let e = errors.withLock({ $0[call.path.rawValue] }) { return .error(e) }
            values.withLock { $0[call.path.rawValue] = call.arguments.first?.bytes ?? [] }
            return .reply([])
        }
    }

    func service(_ path: DBusObjectPath, uuid: String, primary: Bool = true) {
        server.addInterfaces(
            at: path,
            [
                (
                    DBusInterfaceSpec(
                        "org.bluez.GattService1",
                        properties: [
                            DBusPropertySpec("UUID", "s"), DBusPropertySpec("Primary", "b"),
                            DBusPropertySpec("Includes", "ao"),
                        ]),
                    ["UUID": .string(uuid), "Primary": .boolean(primary), "Includes": .objectPathArray([])]
                )
            ])
    }

    func characteristic(
        _ path: DBusObjectPath, service: DBusObjectPath, uuid: String, flags: [String], value: [UInt8] = [],
        extra: [String: DBusValue] = [:], acquire: Bool = false
    ) {
        values.withLock { $0[path.rawValue] = value }
        var methods = [
            DBusMethodSpec("ReadValue", in: "a{sv}", out: "ay", handler: readHandler()),
            DBusMethodSpec("WriteValue", in: "aya{sv}", handler: writeHandler()),
            DBusMethodSpec("StartNotify") { [self] call in
                record(call, options: nil)
                return .reply([])
            },
            DBusMethodSpec("StopNotify") { [self] call in
                record(call, options: nil)
                return .reply([])
            },
            DBusMethodSpec("Confirm") { [self] call in
                record(call, options: nil)
                return .reply([])
            },
        ]
        if acquire {
            methods.append(
                DBusMethodSpec("AcquireNotify", in: "a{sv}", out: "hq") { [self] call in
                    record(call, options: 0)
                    return acquiredSocket(path, key: "notify")
                })
            methods.append(
                DBusMethodSpec("AcquireWrite", in: "a{sv}", out: "hq") { [self] call in
                    record(call, options: 0)
                    return acquiredSocket(path, key: "write")
                })
        }
        var props: [String: DBusValue] = [
            "UUID": .string(uuid), "Service": .objectPath(service), "Flags": .stringArray(flags),
        ]
        var specs = [
            DBusPropertySpec("UUID", "s"), DBusPropertySpec("Service", "o"), DBusPropertySpec("Flags", "as"),
            DBusPropertySpec("Value", "ay"),
        ]
        for (k, v) in extra {
            props[k] = v
            specs.append(DBusPropertySpec(k, v.signature, access: k == "Handle" ? .readWrite : .read))
        }
        server.addInterfaces(
            at: path,
            [(DBusInterfaceSpec("org.bluez.GattCharacteristic1", methods: methods, properties: specs), props)])
    }

    /// Our ends of AcquireNotify/AcquireWrite socketpairs, by "path key".
    let sockets = Mutex<[String: Int32]>([:])

    private func acquiredSocket(_ path: DBusObjectPath, key: String) -> DBusMethodOutcome {
        var fds: [Int32] = [-1, -1]
        guard socketpair(AF_UNIX, Int32(SOCK_SEQPACKET.rawValue), 0, &fds) == 0 else {
            return .error(DBusError(name: "org.bluez.Error.Failed", message: "socketpair"))
        }
        sockets.withLock { $0[path.rawValue + " " + key] = fds[0] }
        return .reply([.unixFD(DBusFileDescriptor(owning: fds[1])), .uint16(517)])
    }

    func descriptor(_ path: DBusObjectPath, characteristic: DBusObjectPath, uuid: String, flags: [String]) {
        server.addInterfaces(
            at: path,
            [
                (
                    DBusInterfaceSpec(
                        "org.bluez.GattDescriptor1",
                        methods: [
                            DBusMethodSpec("ReadValue", in: "a{sv}", out: "ay", handler: readHandler()),
                            DBusMethodSpec("WriteValue", in: "aya{sv}", handler: writeHandler()),
                        ],
                        properties: [
                            DBusPropertySpec("UUID", "s"), DBusPropertySpec("Characteristic", "o"),
                            DBusPropertySpec("Flags", "as"),
                        ]),
                    [
                        "UUID": .string(uuid), "Characteristic": .objectPath(characteristic),
                        "Flags": .stringArray(flags),
                    ]
                )
            ])
    }

    /// Sends a new Value (one PropertiesChanged each, as an app notifying does).
    func notify(_ path: DBusObjectPath, _ value: [UInt8]) {
        server.setProperty(at: path, interface: "org.bluez.GattCharacteristic1", "Value", .bytes(value), flush: true)
    }

    func register(adapter: DBusObjectPath = "/org/bluez/hci0") async throws(DBusError) {
        server.flush()
        _ = try await connection.call(
            destination: "org.bluez", path: adapter, interface: "org.bluez.GattManager1",
            method: "RegisterApplication", arguments: [.objectPath(root), .stringVariantDictionary([])])
    }

    func registerError(adapter: DBusObjectPath = "/org/bluez/hci0") async -> DBusError? {
        do {
            try await register(adapter: adapter)
            return nil
        } catch { return error }
    }
}

/// The standard test app: Battery (read+notify), a read/write characteristic with a descriptor, a read-only one,
/// a write-without-response one and an indicate one.
let batteryPath: DBusObjectPath = "/app/service0/char0"
let rwPath: DBusObjectPath = "/app/service1/char0"
let rwDescriptorPath: DBusObjectPath = "/app/service1/char0/desc0"
let roPath: DBusObjectPath = "/app/service1/char1"
let wwrPath: DBusObjectPath = "/app/service1/char2"
let indicatePath: DBusObjectPath = "/app/service1/char3"
let rwUUID = "12345678-1234-5678-1234-56789abcdef1"
let central = "5C:F3:70:00:00:01"
let centralPath: DBusObjectPath = "/org/bluez/hci0/dev_5C_F3_70_00_00_01"

func standardApp(_ sim: SimulatorFixture) throws -> TestGattApp {
    let app = try TestGattApp(sim)
    app.service("/app/service0", uuid: "180f")
    app.characteristic(
        batteryPath, service: "/app/service0", uuid: "2a19", flags: ["read", "notify"], value: [87],
        extra: ["Handle": .uint16(0)])
    app.service("/app/service1", uuid: "12345678-1234-5678-1234-56789abcdef0")
    app.characteristic(rwPath, service: "/app/service1", uuid: rwUUID, flags: ["read", "write"], value: [1, 2, 3, 4])
    app.descriptor(rwDescriptorPath, characteristic: rwPath, uuid: "2901", flags: ["read"])
    app.values.withLock { $0[rwDescriptorPath.rawValue] = Array("rw".utf8) }
    app.characteristic(
        roPath, service: "/app/service1", uuid: "12345678-1234-5678-1234-56789abcdef2", flags: ["read"], value: [9])
    app.characteristic(
        wwrPath, service: "/app/service1", uuid: "12345678-1234-5678-1234-56789abcdef3",
        flags: ["write-without-response"])
    app.characteristic(
        indicatePath, service: "/app/service1", uuid: "12345678-1234-5678-1234-56789abcdef4", flags: ["indicate"])
    return app
}

func peripheralFixture() async throws -> SimulatorFixture {
    try await SimulatorFixture.start(scenario: "settings: {local_gatt_timeout: 1}\n")
}

func attMessage(_ error: DBusError?) -> String {
    guard let error, error.name == "io.blebridge.Simulator1.Error.ATT" else {
        return "no ATT error: \(String(describing: error))"
    }
    return error.message
}

func jsonArray(_ values: [DBusValue]) throws -> [[String: Any]] {
    let text = values.first?.string ?? ""
    return try JSONSerialization.jsonObject(with: Data(text.utf8)) as? [[String: Any]] ?? []
}

@Suite("Simulator peripheral side: GattManager1, the remote central, LEAdvertisingManager1", .serialized)
struct LocalGattTests {
    @Test("a registered application is visible in GetLocalGatt and served to a remote central")
    func registerReadWrite() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        let client = try Client(sim)
        let app = try standardApp(sim)
        try await app.register()

        let apps = try jsonArray(try await client.control("GetLocalGatt", [.string("")]))
        #expect(apps.count == 1)
        #expect(apps.first?["owner"] as? String == app.connection.uniqueName)
        let services = apps.first?["services"] as? [[String: Any]] ?? []
        #expect(
            services.map { $0["uuid"] as? String } == [
                "0000180f-0000-1000-8000-00805f9b34fb", "12345678-1234-5678-1234-56789abcdef0",
            ])
        let chars = services.last?["characteristics"] as? [[String: Any]] ?? []
        #expect(chars.first?["flags"] as? [String] == ["read", "write"])
        #expect(
            (chars.first?["descriptors"] as? [[String: Any]])?.first?["uuid"] as? String
                == "00002901-0000-1000-8000-00805f9b34fb")

        // Handles as gatt_db assigns them after bluetoothd's own services (0x0001-0x0014): service, declaration,
        // value, CCC; the app's Handle property is set to the value handle.
        #expect(services.map { $0["handle"] as? Int } == [0x15, 0x19])
        #expect(chars.map { $0["handle"] as? Int } == [0x1b, 0x1e, 0x20, 0x22])
        #expect((chars.first?["descriptors"] as? [[String: Any]])?.first?["handle"] as? Int == 0x1c)
        try await eventually(3, "Handle written back") {
            app.server.property(at: batteryPath, interface: "org.bluez.GattCharacteristic1", "Handle")?.uint16 == 0x17
        }

        let device = try await client.control("CentralConnect", [.string("hci0"), .string(central)])
        #expect(device.first?.objectPath == centralPath)
        #expect(await client.property(centralPath, "org.bluez.Device1", "Connected")?.bool == true)

        // Read (16-bit form), then Read Blob: the options carry device, offset, link and mtu.
        #expect(
            try await client.control("CentralRead", [.string(central), .string("2A19"), .uint32(0)]).first?.bytes == [
                87
            ])
        let o = app.options.withLock { $0[batteryPath.rawValue] } ?? [:]
        #expect(o["device"]?.objectPath == centralPath && o["link"]?.string == "LE" && o["mtu"]?.uint16 == 517)
        #expect(o["offset"] == nil)
        #expect(
            try await client.control("CentralRead", [.string(central), .string(rwUUID), .uint32(2)]).first?.bytes == [
                3, 4,
            ])
        #expect(app.options.withLock { $0[rwPath.rawValue] }?["offset"]?.uint16 == 2)
        #expect(
            try await client.control("CentralRead", [.string(central), .string("2901"), .uint32(0)]).first?.bytes
                == Array("rw".utf8))

        // Write request, then read back; a write to a read-only characteristic never reaches the app.
        try await client.control(
            "CentralWrite", [.string(central), .string(rwUUID), .bytes([7, 7]), .string("request")])
        #expect(app.values.withLock { $0[rwPath.rawValue] } == [7, 7])
        let before = app.calls.withLock { $0.count }
        let readOnly = await client.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "CentralWrite",
            [.string(central), .string("12345678-1234-5678-1234-56789abcdef2"), .bytes([1]), .string("request")])
        #expect(attMessage(readOnly).hasPrefix("0x03 Write Not Permitted"))
        #expect(app.calls.withLock { $0.count } == before)
        // A write-only characteristic refuses reads the same way, and a descriptor without write refuses writes.
        let writeOnly = await client.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "CentralRead",
            [.string(central), .string("12345678-1234-5678-1234-56789abcdef3"), .uint32(0)])
        #expect(attMessage(writeOnly).hasPrefix("0x02 Read Not Permitted"))
        // Write command: acknowledged at once (write-without-response), the value still reaches the app.
        try await client.control(
            "CentralWrite",
            [.string(central), .string("12345678-1234-5678-1234-56789abcdef3"), .bytes([5]), .string("command")])
        try await eventually(3, "WriteValue of the command") { app.values.withLock { $0[wwrPath.rawValue] } == [5] }
        // No reliable-write flag: a reliable write is refused.
        let reliable = await client.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "CentralWrite",
            [.string(central), .string(rwUUID), .bytes([1]), .string("reliable")])
        #expect(attMessage(reliable).hasPrefix("0x06"))
        let counters = try await client.control("GetCounters").first?.stringVariantDictionary ?? [:]
        #expect(counters["local_apps"]?.int64 == 1 && counters["local_reads"]?.int64 == 4)
    }

    @Test(
        "the app's D-Bus errors become the ATT codes bluetoothd answers",
        arguments: [
            ("org.bluez.Error.InvalidOffset", "", "0x07 Invalid Offset"),
            ("org.bluez.Error.NotPermitted", "", "0x02 Read Not Permitted"),
            ("org.bluez.Error.InvalidValueLength", "", "0x0d Invalid Attribute Value Length"),
            ("org.bluez.Error.NotAuthorized", "", "0x08 Insufficient Authorization"),
            ("org.bluez.Error.NotSupported", "", "0x06 Request Not Supported"),
            ("org.bluez.Error.Failed", "0x81", "0x81 Application Error"),
            ("org.bluez.Error.Failed", "broken", "0x80 Application Error"),
            ("org.bluez.Error.Failed", "0x20", "0x0e Unlikely Error"),
            ("com.example.Error.Whatever", "x", "0x0e Unlikely Error"),
        ])
    func errorMapping(name: String, message: String, expected: String) async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        let client = try Client(sim)
        let app = try standardApp(sim)
        try await app.register()
        try await client.control("CentralConnect", [.string(""), .string(central)])
        app.errors.withLock { $0[batteryPath.rawValue] = DBusError(name: name, message: message) }
        let e = await client.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "CentralRead", [.string(central), .string("2a19"), .uint32(0)])
        #expect(attMessage(e).hasPrefix(expected))
        // The same error on a write: NotPermitted is then Write Not Permitted.
        app.errors.withLock { $0[rwPath.rawValue] = DBusError(name: name, message: message) }
        let w = await client.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "CentralWrite",
            [.string(central), .string(rwUUID), .bytes([1]), .string("request")])
        #expect(attMessage(w).hasPrefix(expected.replacingOccurrences(of: "0x02 Read", with: "0x03 Write")))
    }

    @Test("an app that does not answer in time is an ATT Unlikely Error")
    func appTimeout() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        let client = try Client(sim)
        let app = try TestGattApp(sim)
        // The replies are held, never sent: bluetoothd's call times out (settings.local_gatt_timeout, 1 s here).
        let held = Mutex<[DBusPendingReply]>([])
        app.service("/app/s", uuid: "180f")
        app.server.addInterfaces(
            at: "/app/s/c",
            [
                (
                    DBusInterfaceSpec(
                        "org.bluez.GattCharacteristic1",
                        methods: [
                            DBusMethodSpec("ReadValue", in: "a{sv}", out: "ay") { call in
                                held.withLock { $0.append(call.reply) }
                                return .deferred
                            }
                        ],
                        properties: [
                            DBusPropertySpec("UUID", "s"), DBusPropertySpec("Service", "o"),
                            DBusPropertySpec("Flags", "as"),
                        ]),
                    ["UUID": .string("2a19"), "Service": .objectPath("/app/s"), "Flags": .stringArray(["read"])]
                )
            ])
        try await app.register()
        try await client.control("CentralConnect", [.string(""), .string(central)])
        let e = await client.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "CentralRead", [.string(central), .string("2a19"), .uint32(0)])
        #expect(attMessage(e).hasPrefix("0x0e Unlikely Error: org.freedesktop.DBus.Error.NoReply"))
        #expect(held.withLock { $0.count } == 1)
    }

    @Test("registrations bluetoothd refuses, with its error names")
    func rejected() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        // No ObjectManager at the application path.
        let noManager = try TestGattApp(sim, objectManager: false)
        noManager.service("/app/s", uuid: "180f")
        let e1 = await noManager.registerError()
        #expect(e1?.name == "org.bluez.Error.Failed" && e1?.message == "No object received")
        // An unknown characteristic flag.
        let badFlag = try TestGattApp(sim, root: "/bad")
        badFlag.service("/bad/s", uuid: "180f")
        badFlag.characteristic("/bad/s/c", service: "/bad/s", uuid: "2a19", flags: ["read", "sing"])
        let e2 = await badFlag.registerError()
        #expect(e2?.name == "org.bluez.Error.Failed" && e2?.message == "No valid service object found")
        // A bad UUID, and a characteristic whose service is not the app's.
        let badUUID = try TestGattApp(sim, root: "/uuid")
        badUUID.service("/uuid/s", uuid: "not-a-uuid")
        let e3 = await badUUID.registerError()
        #expect(e3?.name == "org.bluez.Error.Failed")
        let orphan = try TestGattApp(sim, root: "/orphan")
        orphan.service("/orphan/s", uuid: "180f")
        orphan.characteristic("/orphan/s/c", service: "/nowhere", uuid: "2a19", flags: ["read"])
        #expect(await orphan.registerError()?.message == "No valid service object found")
        // The GATT service is bluetoothd's own.
        let gatt = try TestGattApp(sim, root: "/gatt")
        gatt.service("/gatt/s", uuid: "1801")
        #expect(await gatt.registerError()?.name == "org.bluez.Error.Failed")
        // Twice the same path from the same sender; unregistering what was never registered.
        let app = try standardApp(sim)
        try await app.register()
        #expect(await app.registerError()?.name == "org.bluez.Error.AlreadyExists")
        let client = try Client(sim)
        let e4 = await client.error(
            "/org/bluez/hci0", "org.bluez.GattManager1", "UnregisterApplication", [.objectPath("/app")])
        #expect(e4?.name == "org.bluez.Error.DoesNotExist")
        let apps = try jsonArray(try await client.control("GetLocalGatt", [.string("hci0")]))
        #expect(apps.count == 1)
        _ = try await app.connection.call(
            destination: "org.bluez", path: "/org/bluez/hci0", interface: "org.bluez.GattManager1",
            method: "UnregisterApplication", arguments: [.objectPath("/app")])
        #expect(try jsonArray(try await client.control("GetLocalGatt", [.string("hci0")])).isEmpty)
    }

    @Test("subscribing calls StartNotify; 200 values arrive in order; the last unsubscribe calls StopNotify")
    func notifications() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        let client = try Client(sim)
        let app = try standardApp(sim)
        try await app.register()
        let other = "5C:F3:70:00:00:02"
        try await client.control("CentralConnect", [.string(""), .string(central)])
        try await client.control("CentralConnect", [.string(""), .string(other)])
        try await client.control("CentralSubscribe", [.string(central), .string("2a19"), .boolean(true)])
        try await client.control("CentralSubscribe", [.string(other), .string("2a19"), .boolean(true)])
        try await eventually(3, "StartNotify") { app.count("StartNotify", batteryPath) == 1 }
        for i in 0..<200 { app.notify(batteryPath, [UInt8(i & 0xff), UInt8(i >> 8)]) }
        var received: [[UInt8]] = []
        try await eventually(5, "200 notifications") {
            received +=
                try await client.control("CentralNotifications", [.string(central), .string("2a19")]).first?
                .arrayElements?.compactMap(\.bytes) ?? []
            return received.count >= 200
        }
        let expected: [[UInt8]] = (0..<200).map { (i: Int) -> [UInt8] in [UInt8(i & 0xff), UInt8(i >> 8)] }
        #expect(received == expected)
        let second =
            try await client.control("CentralNotifications", [.string(other), .string("2a19")]).first?
            .arrayElements?.count ?? 0
        #expect(second == 200)
        // No notify flag: the CCC write is refused.
        let refused = await client.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "CentralSubscribe",
            [.string(central), .string(rwUUID), .boolean(true)])
        #expect(attMessage(refused).hasPrefix("0xfd"))
        // The first unsubscribe leaves the other central subscribed; its disconnect is the last one.
        try await client.control("CentralSubscribe", [.string(central), .string("2a19"), .boolean(false)])
        #expect(app.count("StopNotify", batteryPath) == 0)
        try await client.control("CentralDisconnect", [.string(other)])
        try await eventually(3, "StopNotify") { app.count("StopNotify", batteryPath) == 1 }
        #expect(
            await client.property("/org/bluez/hci0/dev_5C_F3_70_00_00_02", "org.bluez.Device1", "Connected")?.bool
                == false)
        // A value sent now reaches nobody.
        app.notify(batteryPath, [1])
        try await client.control(
            "CentralSubscribe", [.string(central), .string("12345678-1234-5678-1234-56789abcdef4"), .boolean(true)])
        app.notify(indicatePath, [42])
        try await eventually(3, "Confirm after the indication") { app.count("Confirm", indicatePath) == 1 }
        #expect(
            try await client.control(
                "CentralNotifications", [.string(central), .string("12345678-1234-5678-1234-56789abcdef4")]
            ).first?
            .arrayElements?.compactMap(\.bytes) == [[42]])
        #expect(
            try await client.control("CentralNotifications", [.string(central), .string("2a19")]).first?.arrayElements?
                .isEmpty == true)
    }

    @Test("the local side drops a central with Device1.Disconnect and forgets it with RemoveDevice")
    func localDisconnect() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        let client = try Client(sim)
        let app = try standardApp(sim)
        try await app.register()
        let signals = try await SignalRecorder(
            client.connection, DBusMatchRule(type: .signal, sender: "org.bluez", path: centralPath))
        try await client.control("CentralConnect", [.string("hci0"), .string(central)])
        try await client.control("CentralSubscribe", [.string(central), .string("2a19"), .boolean(true)])
        try await eventually(3, "StartNotify") { app.count("StartNotify", batteryPath) == 1 }
        try await client.call(centralPath, "org.bluez.Device1", "Disconnect")
        try await eventually(3, "StopNotify") { app.count("StopNotify", batteryPath) == 1 }
        try await signals.wait(timeout: 3, "Disconnected then Connected=false") { all in
            let names = all.map { $0.member == "Disconnected" ? "D" : SignalRecorder.describe($0) }
            guard let d = names.firstIndex(of: "D") else { return false }
            return names[(d + 1)...].contains { $0.hasPrefix("PC") && $0.contains("Connected") }
        }
        let reason = signals.all.first { $0.member == "Disconnected" }?.body.first?.string
        #expect(reason == "org.bluez.Reason.Local")
        // A read now is misuse: the central is not connected.
        let e = await client.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "CentralRead", [.string(central), .string("2a19"), .uint32(0)])
        #expect(e?.name == "io.blebridge.Simulator1.Error.NotConnected")
        // It connects again on the same object, then the adapter forgets it.
        #expect(
            try await client.control("CentralConnect", [.string(""), .string(central)]).first?.objectPath == centralPath
        )
        try await client.call("/org/bluez/hci0", "org.bluez.Adapter1", "RemoveDevice", [.objectPath(centralPath)])
        #expect(try await client.managedPaths().contains(centralPath.rawValue) == false)
    }

    @Test("NotifyAcquired and WriteAcquired: bluetoothd uses AcquireNotify and AcquireWrite sockets")
    func acquiredSockets() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        let client = try Client(sim)
        let app = try TestGattApp(sim)
        let path: DBusObjectPath = "/app/s/c"
        app.service("/app/s", uuid: "6e400001-b5a3-f393-e0a9-e50e24dcca9e")
        app.characteristic(
            path, service: "/app/s", uuid: "6e400003-b5a3-f393-e0a9-e50e24dcca9e",
            flags: ["notify", "write-without-response"],
            extra: ["NotifyAcquired": .boolean(false), "WriteAcquired": .boolean(false)], acquire: true)
        try await app.register()
        try await client.control("CentralConnect", [.string(""), .string(central)])
        try await client.control(
            "CentralSubscribe", [.string(central), .string("6e400003-b5a3-f393-e0a9-e50e24dcca9e"), .boolean(true)])
        try await eventually(3, "AcquireNotify") { app.sockets.withLock { $0[path.rawValue + " notify"] } != nil }
        let notifyFD = app.sockets.withLock { $0[path.rawValue + " notify"] } ?? -1
        for i in 0..<50 { _ = [UInt8(i)].withUnsafeBytes { send(notifyFD, $0.baseAddress, 1, 0) } }
        var received: [[UInt8]] = []
        try await eventually(5, "50 datagrams as notifications") {
            received +=
                try await client.control(
                    "CentralNotifications", [.string(central), .string("6e400003-b5a3-f393-e0a9-e50e24dcca9e")]
                )
                .first?.arrayElements?.compactMap(\.bytes) ?? []
            return received.count >= 50
        }
        #expect(received == (0..<50).map { [UInt8($0)] })
        #expect(app.count("StartNotify", path) == 0)
        // Write commands go through the AcquireWrite socket, in order.
        for i in 0..<3 {
            try await client.control(
                "CentralWrite",
                [
                    .string(central), .string("6e400003-b5a3-f393-e0a9-e50e24dcca9e"), .bytes([UInt8(i)]),
                    .string("command"),
                ])
        }
        try await eventually(3, "AcquireWrite") { app.sockets.withLock { $0[path.rawValue + " write"] } != nil }
        let writeFD = app.sockets.withLock { $0[path.rawValue + " write"] } ?? -1
        var got: [UInt8] = []
        try await eventually(3, "three datagrams on the write socket") {
            var b: UInt8 = 0
            if recv(writeFD, &b, 1, Int32(MSG_DONTWAIT)) == 1 { got.append(b) }
            return got.count >= 3
        }
        #expect(got == [0, 1, 2])
        #expect(app.count("WriteValue", path) == 0)
        // Unsubscribing closes the notify socket: our end reads end of file.
        try await client.control(
            "CentralSubscribe", [.string(central), .string("6e400003-b5a3-f393-e0a9-e50e24dcca9e"), .boolean(false)])
        try await eventually(3, "end of file on the notify socket") {
            var b: UInt8 = 0
            return recv(notifyFD, &b, 1, Int32(MSG_DONTWAIT)) == 0
        }
        #expect(app.count("StopNotify", path) == 0)
    }

    @Test("the owner leaving the bus, RestartDaemon and RemoveAdapter drop the applications")
    func lifecycle() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        let client = try Client(sim)
        let app = try standardApp(sim)
        try await app.register()
        #expect(try jsonArray(try await client.control("GetLocalGatt", [.string("")])).count == 1)
        // The app removes a service object: bluetoothd's proxy_removed_cb takes the service out of the database.
        for path in [roPath, rwDescriptorPath, rwPath, wwrPath, indicatePath] { app.server.removeObject(at: path) }
        app.server.removeObject(at: "/app/service1")
        try await eventually(3, "one service left") {
            let services = try jsonArray(try await client.control("GetLocalGatt", [.string("")])).first?["services"]
            return (services as? [[String: Any]])?.count == 1
        }
        try await client.control("CentralConnect", [.string(""), .string(central)])
        let gone = await client.error(
            "/org/bluez/sim", "io.blebridge.Simulator1", "CentralRead", [.string(central), .string(rwUUID), .uint32(0)])
        #expect(gone?.name == "io.blebridge.Simulator1.Error.DoesNotExist")
        #expect(gone?.message.hasPrefix("No local characteristic or descriptor") == true)
        #expect(
            try await client.control("CentralRead", [.string(central), .string("2a19"), .uint32(0)]).first?.bytes == [
                87
            ])
        app.connection.close()
        try await eventually(3, "the app gone with its owner") {
            try jsonArray(try await client.control("GetLocalGatt", [.string("")])).isEmpty
        }
        let again = try standardApp(sim)
        try await again.register()
        #expect(try jsonArray(try await client.control("GetLocalGatt", [.string("")])).count == 1)
        let before = try await client.connection.nameOwner("org.bluez")
        try await client.control("RestartDaemon", [.double(0)])
        try await eventually(5, "the restarted daemon") {
            let now = try? await client.connection.nameOwner("org.bluez")
            return now != nil && now != before
        }
        try await sim.waitForBlueZ()
        #expect(try jsonArray(try await client.control("GetLocalGatt", [.string("")])).isEmpty)
        // After the restart the app registers again, then the adapter goes.
        try await again.register()
        let fresh = try Client(sim)
        try await fresh.control("RemoveAdapter", [.string("hci0")])
        try await fresh.control("AddAdapter", [.string("{id: hci0, address: '00:1A:7D:DA:71:10'}")])
        #expect(try jsonArray(try await fresh.control("GetLocalGatt", [.string("")])).isEmpty)
    }
}

/// An LEAdvertisement1 object on the test's own connection.
final class TestAdvertisement: Sendable {
    let connection: DBusConnection
    let server: DBusObjectServer
    let path: DBusObjectPath
    let releases = Mutex(0)

    init(_ sim: SimulatorFixture, path: DBusObjectPath = "/ad0", properties: [String: DBusValue]) throws {
        connection = try DBusConnection(.address(sim.address))
        self.path = path
        server = DBusObjectServer(connection: connection, objectManagerPath: "/")
        let specs = properties.map { DBusPropertySpec($0.key, $0.value.signature) }
        server.addInterfaces(
            at: path,
            [
                (
                    DBusInterfaceSpec(
                        "org.bluez.LEAdvertisement1",
                        methods: [
                            DBusMethodSpec("Release") { [self] _ in
                                self.releases.withLock { $0 += 1 }
                                return .reply([])
                            }
                        ], properties: specs),
                    properties
                )
            ])
    }

    func register() async throws(DBusError) {
        server.flush()
        _ = try await connection.call(
            destination: "org.bluez", path: "/org/bluez/hci0", interface: "org.bluez.LEAdvertisingManager1",
            method: "RegisterAdvertisement", arguments: [.objectPath(path), .stringVariantDictionary([])])
    }
}

@Suite("Simulator LEAdvertisingManager1", .serialized)
struct LocalAdvertisingTests {
    static let base: [String: DBusValue] = [
        "Type": .string("peripheral"), "ServiceUUIDs": .stringArray(["180D"]), "LocalName": .string("Sensor"),
        "ManufacturerData": .dictionary(
            key: "q", value: "v", [DBusDictEntry(key: .uint16(0xffff), value: .variant(.bytes([1, 2])))]),
        "Includes": .stringArray(["tx-power"]),
    ]

    @Test("an advertisement registers, updates in place, and is released when the adapter goes")
    func register() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        let client = try Client(sim)
        let ad = try TestAdvertisement(sim, properties: Self.base)
        try await ad.register()
        var ads = try jsonArray(try await client.control("GetAdvertisements", [.string("")]))
        #expect(ads.count == 1)
        #expect(ads.first?["local_name"] as? String == "Sensor")
        #expect(ads.first?["service_uuids"] as? [String] == ["0000180d-0000-1000-8000-00805f9b34fb"])
        #expect(ads.first?["manufacturer_data"] as? [String: String] == ["65535": "0102"])
        #expect(ads.first?["ad_length"] as? Int == 4 + 6)
        #expect(ads.first?["tx_power"] is NSNull)
        #expect(
            await client.property("/org/bluez/hci0", "org.bluez.LEAdvertisingManager1", "ActiveInstances")?.uint8 == 1)
        #expect(
            await client.property("/org/bluez/hci0", "org.bluez.LEAdvertisingManager1", "SupportedInstances")?.uint8
                == 4)

        // PropertiesChanged: the data changes in place.
        ad.server.setProperty(
            at: ad.path, interface: "org.bluez.LEAdvertisement1", "LocalName", .string("Renamed"), flush: true)
        try await eventually(3, "the new name") {
            (try jsonArray(try await client.control("GetAdvertisements", [.string("")]))).first?["local_name"]
                as? String == "Renamed"
        }
        ads = try jsonArray(try await client.control("GetAdvertisements", [.string("")]))
        #expect(ads.count == 1 && ads.first?["ad_length"] as? Int == 10)

        try await client.control("RemoveAdapter", [.string("hci0")])
        try await eventually(3, "Release") { ad.releases.withLock { $0 } == 1 }
    }

    @Test("Discoverable adds a Flags structure; Timeout ends with Release")
    func discoverableAndTimeout() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        let client = try Client(sim)
        var props = Self.base
        props["Discoverable"] = .boolean(true)
        props["Timeout"] = .uint16(1)
        let ad = try TestAdvertisement(sim, properties: props)
        try await ad.register()
        let ads = try jsonArray(try await client.control("GetAdvertisements", [.string("hci0")]))
        #expect(ads.first?["ad_length"] as? Int == 10 + 3)
        #expect(ads.first?["discoverable"] as? Bool == true && ads.first?["timeout"] as? Int == 1)
        try await eventually(4, "Release after the timeout") { ad.releases.withLock { $0 } == 1 }
        #expect(try jsonArray(try await client.control("GetAdvertisements", [.string("hci0")])).isEmpty)
    }

    @Test("too much data, bad values and a sixth advertisement are refused as bluetoothd refuses them")
    func rejected() async throws {
        let sim = try await peripheralFixture()
        defer { sim.stopInBackground() }
        var long = Self.base
        // UUIDs 4 + 18, manufacturer data 6, Data 4: 32 bytes, more than the 28 left once tx-power is reserved.
        long["ServiceUUIDs"] = .stringArray(["180D", "12345678-1234-5678-1234-56789abcdef0"])
        long["Data"] = .dictionary(
            key: "y", value: "v", [DBusDictEntry(key: .byte(0x26), value: .variant(.bytes([1, 2])))])
        let tooLong = try TestAdvertisement(sim, properties: long)
        do {
            try await tooLong.register()
            Issue.record("30 bytes of advertising data were accepted")
        } catch {
            #expect(error.name == "org.bluez.Error.Failed" && error.message == "Failed to parse advertisement.")
        }
        var both = Self.base
        both["Includes"] = .stringArray(["local-name"])
        let bothAd = try TestAdvertisement(sim, path: "/both", properties: both)
        do {
            try await bothAd.register()
            Issue.record("LocalName with Includes local-name was accepted")
        } catch { #expect(error.message == "Failed to parse advertisement.") }
        var broadcast = Self.base
        broadcast["Type"] = .string("broadcast")
        broadcast["Discoverable"] = .boolean(true)
        let broadcastAd = try TestAdvertisement(sim, path: "/broadcast", properties: broadcast)
        do {
            try await broadcastAd.register()
            Issue.record("a discoverable broadcast was accepted")
        } catch { #expect(error.message == "Failed to parse advertisement.") }
        var ads: [TestAdvertisement] = []
        for i in 0..<5 {
            let ad = try TestAdvertisement(sim, path: DBusObjectPath(stringLiteral: "/ok\(i)"), properties: Self.base)
            try await ad.register()
            ads.append(ad)
        }
        let sixth = try TestAdvertisement(sim, path: "/sixth", properties: Self.base)
        do {
            try await sixth.register()
            Issue.record("a sixth advertisement was accepted")
        } catch {
            #expect(error.name == "org.bluez.Error.NotPermitted" && error.message == "Maximum advertisements reached")
        }
        let client = try Client(sim)
        #expect(
            await client.property("/org/bluez/hci0", "org.bluez.LEAdvertisingManager1", "ActiveInstances")?.uint8 == 5)
        // Unregister (no Release), then the owner leaving the bus (no Release either).
        _ = try await ads[0].connection.call(
            destination: "org.bluez", path: "/org/bluez/hci0", interface: "org.bluez.LEAdvertisingManager1",
            method: "UnregisterAdvertisement", arguments: [.objectPath("/ok0")])
        ads[1].connection.close()
        try await eventually(3, "two advertisements gone") {
            await client.property("/org/bluez/hci0", "org.bluez.LEAdvertisingManager1", "ActiveInstances")?.uint8 == 3
        }
        #expect(ads[0].releases.withLock { $0 } == 0)
        // RestartDaemon releases the rest, before the daemon goes.
        #expect(ads[2...].allSatisfy { $0.releases.withLock { $0 } == 0 })
        try await client.control("RestartDaemon", [.double(0)])
        try await eventually(3, "Release on shutdown") { ads[2...].allSatisfy { $0.releases.withLock { $0 } == 1 } }
    }
}
