import DBus
import Foundation
import FoundationXML
import TestSupport
import Testing

/// A server connection owning `org.example.Sim` with one object, and a client connection.
final class ServerFixture: @unchecked Sendable {
    static let name = "org.example.Sim"
    static let interface = "org.example.Thing"
    let bus: BusFixture
    let server: DBusConnection
    let client: DBusConnection
    let objects: DBusObjectServer
    let setLog = NSLock()
    var sets: [(String, DBusValue, String)] = []

    init() async throws {
        bus = try await BusFixture()
        server = try bus.connect()
        client = try bus.connect()
        #expect(try await server.requestName(ServerFixture.name) == .primaryOwner)
        objects = DBusObjectServer(connection: server)
    }

    func thingSpec(methods: [DBusMethodSpec] = []) -> DBusInterfaceSpec {
        DBusInterfaceSpec(
            ServerFixture.interface,
            methods: [
                DBusMethodSpec("Add", in: "ii", out: "i", argumentNames: ["a", "b"], resultNames: ["sum"]) { call in
                    .reply([.int32((call.arguments[0].int32 ?? 0) &+ (call.arguments[1].int32 ?? 0))])
                }
            ] + methods,
            properties: [
                DBusPropertySpec("Name", "s", access: .readWrite), DBusPropertySpec("Count", "u"),
                DBusPropertySpec("Secret", "s", access: .write), DBusPropertySpec("Level", "y", access: .readWrite),
                DBusPropertySpec("Optional", "as"),
            ],
            signals: [DBusSignalSpec("Ping", "s", argumentNames: ["text"])],
            setHandler: { [weak self] property, value, sender in
                if property == "Level", let level = value.uint8, level > 100 {
                    return DBusError(name: "org.bluez.Error.InvalidArguments", message: "level above 100")
                }
                self?.setLog.withLock { self?.sets.append((property, value, sender)) }
                return nil
            })
    }

    func addThing(at path: DBusObjectPath = "/org/example/thing", methods: [DBusMethodSpec] = []) {
        objects.addInterfaces(
            at: path,
            [
                (
                    thingSpec(methods: methods),
                    ["Name": .string("one"), "Count": .uint32(1), "Level": .byte(5), "Secret": .string("s")]
                )
            ])
    }

    func call(
        _ path: DBusObjectPath = "/org/example/thing", _ interface: String, _ method: String,
        _ arguments: [DBusValue] = []
    ) async throws(DBusError) -> [DBusValue] {
        try await client.call(
            destination: ServerFixture.name, path: path, interface: interface, method: method, arguments: arguments,
            timeout: .seconds(5))
    }

    func get(_ name: String, interface: String = ServerFixture.interface) async throws(DBusError) -> DBusValue? {
        try await call(
            "/org/example/thing", "org.freedesktop.DBus.Properties", "Get", [.string(interface), .string(name)]
        )
        .first
    }

    func set(_ name: String, _ value: DBusValue, interface: String = ServerFixture.interface) async throws(DBusError) {
        _ = try await call(
            "/org/example/thing", "org.freedesktop.DBus.Properties", "Set",
            [.string(interface), .string(name), .variant(value)])
    }

    func propertiesChanged(path: DBusObjectPath = "/org/example/thing") async throws -> DBusSignalStream {
        try await client.signals(
            matching: DBusMatchRule(
                sender: ServerFixture.name, interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged",
                path: path))
    }
}

func expectError(
    _ name: String, _ message: String? = nil, sourceLocation: SourceLocation = #_sourceLocation,
    _ body: () async throws -> Void
) async {
    do {
        try await body()
        Issue.record("expected \(name)", sourceLocation: sourceLocation)
    } catch let error as DBusError {
        #expect(error.name == name, sourceLocation: sourceLocation)
        if let message { #expect(error.message == message, sourceLocation: sourceLocation) }
    } catch {
        Issue.record("unexpected \(error)", sourceLocation: sourceLocation)
    }
}

@Suite struct ObjectServerTests {
    @Test func propertiesGetGetAllSetAndTheirErrors() async throws {
        let f = try await ServerFixture()
        f.addThing()
        #expect(try await f.get("Name") == .variant(.string("one")))
        #expect(try await f.get("Count") == .variant(.uint32(1)))
        await expectError(DBusError.unknownInterface, "No such interface 'org.example.Nope'") {
            _ = try await f.get("Name", interface: "org.example.Nope")
        }
        await expectError(DBusError.unknownProperty, "No such property 'Nope'") { _ = try await f.get("Nope") }
        await expectError(DBusError.unknownProperty) { _ = try await f.get("Optional") }  // declared, no value
        await expectError(DBusError.accessDenied) { _ = try await f.get("Secret") }

        let all = try await f.call(
            "/org/example/thing",
            "org.freedesktop.DBus.Properties", "GetAll", [.string(ServerFixture.interface)])
        #expect(all.count == 1)
        #expect(all.first?.signature == "a{sv}")
        #expect(all.first?.dictionaryEntries?.compactMap(\.key.string) == ["Name", "Count", "Level"])
        await expectError(DBusError.unknownInterface) {
            _ = try await f.call(
                "/org/example/thing", "org.freedesktop.DBus.Properties", "GetAll", [.string("org.x.Y")])
        }

        await expectError(DBusError.propertyReadOnly, "Property 'Count' is not writable") {
            try await f.set("Count", .uint32(9))
        }
        await expectError(DBusError.invalidArgs) { try await f.set("Name", .int32(3)) }
        await expectError(DBusError.unknownProperty) { try await f.set("Nope", .int32(3)) }
        await expectError(DBusError.unknownInterface) { try await f.set("Name", .string("x"), interface: "org.x.Y") }
        await expectError("org.bluez.Error.InvalidArguments", "level above 100") {
            try await f.set("Level", .byte(200))
        }
        #expect(f.objects.property(at: "/org/example/thing", interface: ServerFixture.interface, "Level") == .byte(5))

        let changes = try await f.propertiesChanged()
        try await f.set("Name", .string("two"))
        #expect(try await f.get("Name") == .variant(.string("two")))
        #expect(
            f.objects.property(at: "/org/example/thing", interface: ServerFixture.interface, "Name") == .string("two"))
        let logged = f.setLog.withLock { f.sets }
        #expect(logged.count == 1)
        #expect(logged.first?.0 == "Name" && logged.first?.2 == f.client.uniqueName)
        var iterator = changes.makeAsyncIterator()
        let signal = try #require(await iterator.next())
        #expect(
            signal.body == [
                .string(ServerFixture.interface), .stringVariantDictionary([("Name", .string("two"))]),
                .stringArray([]),
            ])
        // Wrong signatures on the Properties methods are UnknownMethod, with libdbus's text.
        await expectError(
            DBusError.unknownMethod,
            "Method \"Get\" with signature \"s\" on interface \"org.freedesktop.DBus.Properties\" doesn't exist\n"
        ) {
            _ = try await f.call("/org/example/thing", "org.freedesktop.DBus.Properties", "Get", [.string("x")])
        }
    }

    @Test func bluezStylePropertyErrors() async throws {
        let bus = try await BusFixture()
        let server = try bus.connect()
        let client = try bus.connect()
        let objects = DBusObjectServer(connection: server, propertyErrors: .bluez)
        objects.addInterfaces(
            at: "/org/bluez/hci0",
            [
                (
                    DBusInterfaceSpec(
                        "org.bluez.Adapter1",
                        properties: [
                            DBusPropertySpec("Address", "s"), DBusPropertySpec("Alias", "s", access: .readWrite),
                            DBusPropertySpec("Modalias", "s", access: .readWrite),
                            DBusPropertySpec("Key", "s", access: .write),
                        ]), ["Address": .string("00:11:22:33:44:55"), "Alias": .string("a"), "Key": .string("k")]
                )
            ])
        func properties(_ method: String, _ arguments: [DBusValue]) async throws -> [DBusValue] {
            try await client.call(
                destination: server.uniqueName, path: "/org/bluez/hci0", interface: "org.freedesktop.DBus.Properties",
                method: method, arguments: arguments)
        }
        await expectError(DBusError.invalidArgs, "No such property 'Colour'") {
            _ = try await properties("Get", [.string("org.bluez.Adapter1"), .string("Colour")])
        }
        await expectError(DBusError.invalidArgs, "No such property 'Modalias'") {  // declared, absent
            _ = try await properties("Get", [.string("org.bluez.Adapter1"), .string("Modalias")])
        }
        await expectError(DBusError.invalidArgs, "Property 'Key' is not readable") {
            _ = try await properties("Get", [.string("org.bluez.Adapter1"), .string("Key")])
        }
        await expectError(DBusError.invalidArgs, "No such interface 'org.bluez.Nope'") {
            _ = try await properties("Get", [.string("org.bluez.Nope"), .string("Address")])
        }
        await expectError(DBusError.invalidArgs, "No such interface 'org.bluez.Nope'") {
            _ = try await properties("GetAll", [.string("org.bluez.Nope")])
        }
        await expectError(DBusError.invalidArgs, "No such interface 'org.bluez.Nope'") {
            _ = try await properties("Set", [.string("org.bluez.Nope"), .string("Alias"), .variant(.string("x"))])
        }
        await expectError(DBusError.unknownProperty, "No such property 'Colour'") {
            _ = try await properties("Set", [.string("org.bluez.Adapter1"), .string("Colour"), .variant(.string("x"))])
        }
        await expectError(DBusError.unknownProperty, "No such property 'Modalias'") {
            _ = try await properties(
                "Set", [.string("org.bluez.Adapter1"), .string("Modalias"), .variant(.string("x"))])
        }
        await expectError(DBusError.propertyReadOnly, "Property 'Address' is not writable") {
            _ = try await properties(
                "Set", [.string("org.bluez.Adapter1"), .string("Address"), .variant(.string("x"))])
        }
        await expectError(DBusError.invalidSignature, "Invalid signature for 'Alias'") {
            _ = try await properties("Set", [.string("org.bluez.Adapter1"), .string("Alias"), .variant(.int32(1))])
        }
        _ = try await properties("Set", [.string("org.bluez.Adapter1"), .string("Alias"), .variant(.string("b"))])
        #expect(
            try await properties("Get", [.string("org.bluez.Adapter1"), .string("Alias")]) == [.variant(.string("b"))])
    }

    @Test func methodCallsRepliesAndUnknownTexts() async throws {
        let f = try await ServerFixture()
        f.addThing()
        #expect(
            try await f.call("/org/example/thing", ServerFixture.interface, "Add", [.int32(2), .int32(40)]) == [
                .int32(42)
            ])
        // No interface given: found by member and signature.
        let reply = try await f.client.call(
            DBusMessage.methodCall(
                destination: ServerFixture.name, path: "/org/example/thing", interface: nil, method: "Add",
                body: [.int32(1), .int32(1)]))
        #expect(reply.body == [.int32(2)])
        #expect(reply.type == .methodReturn)
        await expectError(
            DBusError.unknownMethod,
            "Method \"Connect\" with signature \"\" on interface \"org.example.Thing\" doesn't exist\n"
        ) { _ = try await f.call("/org/example/thing", ServerFixture.interface, "Connect") }
        await expectError(
            DBusError.unknownMethod,
            "Method \"Add\" with signature \"i\" on interface \"org.example.Thing\" doesn't exist\n"
        ) { _ = try await f.call("/org/example/thing", ServerFixture.interface, "Add", [.int32(1)]) }
        await expectError(DBusError.unknownMethod) {
            _ = try await f.call("/org/example/thing", "org.example.Other", "Add", [.int32(1), .int32(2)])
        }
        await expectError(
            DBusError.unknownObject,
            "Method \"Add\" with signature \"ii\" on interface \"org.example.Thing\" doesn't exist\n"
        ) { _ = try await f.call("/org/example/nothing", ServerFixture.interface, "Add", [.int32(1), .int32(2)]) }
        await expectError(DBusError.unknownObject) {
            _ = try await f.call("/elsewhere", ServerFixture.interface, "Add")
        }
        // Peer is answered (by libdbus).
        try await f.client.ping(ServerFixture.name)
        let machine = try await f.call("/", "org.freedesktop.DBus.Peer", "GetMachineId")
        #expect((machine.first?.string?.count ?? 0) == 32)
    }

    @Test func deferredAndDroppedReplies() async throws {
        let f = try await ServerFixture()
        f.addThing(methods: [
            DBusMethodSpec("Later", out: "s") { call in
                let reply = call.reply
                DispatchQueue.global().asyncAfter(deadline: .now() + 0.05) {
                    reply.succeed([.string("done")])
                    reply.succeed([.string("twice")])  // ignored
                    reply.fail(DBusError(name: DBusError.failed, message: "ignored"))
                }
                return .deferred
            },
            DBusMethodSpec("Forget") { _ in .deferred },
            DBusMethodSpec("Fail") { _ in
                .error(DBusError(name: "org.bluez.Error.Failed", message: "le-connection-abort-by-local"))
            },
        ])
        #expect(try await f.call("/org/example/thing", ServerFixture.interface, "Later") == [.string("done")])
        await expectError(DBusError.noReply) {
            _ = try await f.call("/org/example/thing", ServerFixture.interface, "Forget")
        }
        await expectError("org.bluez.Error.Failed", "le-connection-abort-by-local") {
            _ = try await f.call("/org/example/thing", ServerFixture.interface, "Fail")
        }
    }

    @Test func handlersRunOnOneThreadInArrivalOrder() async throws {
        let f = try await ServerFixture()
        let log = Log<(Int32, UInt)>()
        f.addThing(methods: [
            DBusMethodSpec("Note", in: "i") { call in
                log.append(
                    (
                        call.arguments[0].int32 ?? -1,
                        UInt(bitPattern: Int(bitPattern: UnsafeRawPointer(bitPattern: UInt(pthread_self()))))
                    ))
                return .reply([])
            }
        ])
        try await withThrowingTaskGroup(of: Void.self) { group in
            for index in 0..<50 {
                // Sent in order from one connection (each send is queued before the next task starts).
                let message = DBusMessage.methodCall(
                    destination: ServerFixture.name, path: "/org/example/thing", interface: ServerFixture.interface,
                    method: "Note", body: [.int32(Int32(index))])
                try f.client.send(message)
            }
            group.addTask { _ = try await f.call("/org/example/thing", ServerFixture.interface, "Note", [.int32(50)]) }
            try await group.waitForAll()
        }
        let entries = log.all()
        #expect(entries.map(\.0) == Array(0...50).map(Int32.init))
        #expect(Set(entries.map(\.1)).count == 1)
    }

    @Test func changesInOneTurnAreCoalesced() async throws {
        let f = try await ServerFixture()
        f.addThing()
        let changes = try await f.propertiesChanged()
        let objects = f.objects
        objects.perform {
            objects.setProperty(at: "/org/example/thing", interface: ServerFixture.interface, "Name", .string("a"))
            objects.setProperty(at: "/org/example/thing", interface: ServerFixture.interface, "Count", .uint32(2))
            objects.setProperty(at: "/org/example/thing", interface: ServerFixture.interface, "Name", .string("b"))
            objects.invalidateProperty(at: "/org/example/thing", interface: ServerFixture.interface, "Level")
        }
        var iterator = changes.makeAsyncIterator()
        let first = try #require(await iterator.next())
        objects.perform {
            objects.setProperty(at: "/org/example/thing", interface: ServerFixture.interface, "Count", .uint32(3))
        }
        #expect(first.body.count == 3)
        #expect(first.body[1].dictionaryEntries?.compactMap(\.key.string) == ["Name", "Count"])
        #expect(first.body[1].stringVariantDictionary == ["Name": .string("b"), "Count": .uint32(2)])
        #expect(first.body[2] == .stringArray(["Level"]))
        let second = try #require(await iterator.next())
        #expect(second.body[1].stringVariantDictionary == ["Count": .uint32(3)])
        #expect(f.objects.property(at: "/org/example/thing", interface: ServerFixture.interface, "Level") == nil)
    }

    @Test func pendingChangesAreFlushedBeforeAMethodReply() async throws {
        let f = try await ServerFixture()
        let objects = f.objects
        f.addThing(methods: [
            DBusMethodSpec("Bump", out: "u") { _ in
                objects.setProperty(at: "/org/example/thing", interface: ServerFixture.interface, "Count", .uint32(7))
                return .reply([.uint32(7)])
            }
        ])
        let changes = try await f.propertiesChanged()
        let reply = try await f.client.call(
            DBusMessage.methodCall(
                destination: ServerFixture.name, path: "/org/example/thing", interface: ServerFixture.interface,
                method: "Bump"))
        var iterator = changes.makeAsyncIterator()
        let signal = try #require(await iterator.next())
        #expect(signal.body[1].stringVariantDictionary == ["Count": .uint32(7)])
        #expect(signal.serial < reply.serial)  // sent first
    }

    @Test func flushTrueSendsOneSignalPerCall() async throws {
        let f = try await ServerFixture()
        f.addThing()
        let changes = try await f.propertiesChanged()
        let objects = f.objects
        objects.perform {
            objects.setProperty(at: "/org/example/thing", interface: ServerFixture.interface, "Name", .string("held"))
            for _ in 0..<3 {
                objects.setProperty(
                    at: "/org/example/thing", interface: ServerFixture.interface, "Count", .uint32(9), flush: true)
            }
        }
        var iterator = changes.makeAsyncIterator()
        let held = try #require(await iterator.next())
        #expect(held.body[1].stringVariantDictionary == ["Name": .string("held")])
        for _ in 0..<3 {
            let signal = try #require(await iterator.next())
            #expect(signal.body[1].stringVariantDictionary == ["Count": .uint32(9)])
        }
    }

    @Test func objectManagerShapes() async throws {
        let f = try await ServerFixture()
        let added = try await f.client.signals(
            matching: DBusMatchRule(
                sender: ServerFixture.name, interface: "org.freedesktop.DBus.ObjectManager", path: "/"))
        let objects = f.objects
        let spec = f.thingSpec()
        let battery = DBusInterfaceSpec("org.bluez.Battery1", properties: [DBusPropertySpec("Percentage", "y")])
        objects.perform {
            objects.addInterfaces(at: "/org/example/thing", [(spec, ["Name": .string("one")])])
            // Same turn: lands inside InterfacesAdded, no PropertiesChanged.
            objects.setProperty(at: "/org/example/thing", interface: ServerFixture.interface, "Count", .uint32(4))
        }
        var iterator = added.makeAsyncIterator()
        let first = try #require(await iterator.next())
        #expect(first.member == "InterfacesAdded")
        #expect(first.signature == "oa{sa{sv}}")
        #expect(first.body[0] == .objectPath("/org/example/thing"))
        let interfaces = try #require(first.body[1].dictionaryEntries)
        #expect(
            interfaces.compactMap(\.key.string) == [
                "org.freedesktop.DBus.Introspectable", ServerFixture.interface, "org.freedesktop.DBus.Properties",
            ])  // gdbus's order
        #expect(interfaces[0].value == .dictionary(key: "s", value: "v", []))
        #expect(interfaces[2].value == .dictionary(key: "s", value: "v", []))
        #expect(interfaces[1].value.stringVariantDictionary == ["Name": .string("one"), "Count": .uint32(4)])

        objects.addInterfaces(at: "/org/example/thing", [(battery, ["Percentage": .byte(80)])])
        let second = try #require(await iterator.next())
        #expect(second.member == "InterfacesAdded")
        #expect(second.body[1].dictionaryEntries?.compactMap(\.key.string) == ["org.bluez.Battery1"])

        let managed = try await f.call("/", "org.freedesktop.DBus.ObjectManager", "GetManagedObjects")
        #expect(managed.first?.signature == "a{oa{sa{sv}}}")
        let entry = try #require(managed.first?.dictionaryEntries?.first)
        #expect(entry.key == .objectPath("/org/example/thing"))
        #expect(
            entry.value.dictionaryEntries?.compactMap(\.key.string) == [
                "org.freedesktop.DBus.Introspectable", ServerFixture.interface, "org.freedesktop.DBus.Properties",
                "org.bluez.Battery1",
            ])

        objects.removeInterfaces(at: "/org/example/thing", ["org.bluez.Battery1"])
        let third = try #require(await iterator.next())
        #expect(third.member == "InterfacesRemoved")
        #expect(third.body == [.objectPath("/org/example/thing"), .stringArray(["org.bluez.Battery1"])])
        #expect(f.objects.hasObject(at: "/org/example/thing"))

        objects.removeObject(at: "/org/example/thing")
        let fourth = try #require(await iterator.next())
        #expect(
            fourth.body == [
                .objectPath("/org/example/thing"),
                .stringArray([
                    "org.freedesktop.DBus.Properties", "org.freedesktop.DBus.Introspectable", ServerFixture.interface,
                ]),
            ])
        #expect(!f.objects.hasObject(at: "/org/example/thing"))
        await expectError(DBusError.unknownObject) { _ = try await f.get("Name") }
        let empty = try await f.call("/", "org.freedesktop.DBus.ObjectManager", "GetManagedObjects")
        #expect(empty == [.dictionary(key: "o", value: "a{sa{sv}}", [])])
    }

    @Test func objectAdditionsKeepTheirPlaceAmongPropertyChanges() async throws {
        let f = try await ServerFixture()
        f.addThing()
        // The reply goes out after the held-back InterfacesAdded, so that one is not seen by the rule below.
        _ = try await f.get("Name")
        let all = try await f.client.signals(matching: DBusMatchRule(sender: ServerFixture.name))
        let objects = f.objects
        let service = DBusInterfaceSpec("org.bluez.GattService1", properties: [DBusPropertySpec("UUID", "s")])
        objects.perform {
            objects.setProperty(at: "/org/example/thing", interface: ServerFixture.interface, "Count", .uint32(1))
            objects.addInterfaces(at: "/org/example/thing/service0001", [(service, ["UUID": .string("180f")])])
            // Must not merge into the Count change above, which went out before the service was added.
            objects.setProperty(
                at: "/org/example/thing", interface: ServerFixture.interface, "Name", .string("resolved"))
        }
        var iterator = all.makeAsyncIterator()
        let first = try #require(await iterator.next())
        let second = try #require(await iterator.next())
        let third = try #require(await iterator.next())
        #expect(first.member == "PropertiesChanged")
        #expect(first.body[1].stringVariantDictionary == ["Count": .uint32(1)])
        #expect(second.member == "InterfacesAdded")
        #expect(second.body.first == .objectPath("/org/example/thing/service0001"))
        #expect(third.member == "PropertiesChanged")
        #expect(third.body[1].stringVariantDictionary == ["Name": .string("resolved")])
    }

    @Test func badLocalValuesAreDroppedNotFatal() async throws {
        let f = try await ServerFixture()
        f.addThing()
        let path: DBusObjectPath = "/org/example/thing"
        f.objects.setProperty(at: path, interface: ServerFixture.interface, "Count", .int32(-1))  // declared "u"
        f.objects.setProperty(at: path, interface: ServerFixture.interface, "Extra", .array("s", [.int32(1)]))
        f.objects.setProperty(at: "/nowhere", interface: ServerFixture.interface, "Count", .uint32(1))
        f.objects.addInterfaces(at: "bad path", [(f.thingSpec(), [:])])
        f.objects.emitSignal(path: path, interface: "bad", name: "X")
        #expect(f.objects.property(at: path, interface: ServerFixture.interface, "Count") == .uint32(1))
        #expect(f.objects.property(at: path, interface: ServerFixture.interface, "Extra") == nil)
        #expect(!f.objects.hasObject(at: "/nowhere"))
        // Undeclared but well-formed values are kept and served.
        f.objects.setProperty(at: path, interface: ServerFixture.interface, "Extra", .string("x"))
        #expect(try await f.get("Extra") == .variant(.string("x")))
        #expect(f.objects.objectPaths == [path])
    }

    @Test func aHandlerMayCloseItsOwnConnection() async throws {
        let f = try await ServerFixture()
        let server = f.server
        f.addThing(methods: [
            DBusMethodSpec("Quit") { _ in
                server.close()  // on the I/O thread: must not join itself
                return .reply([])
            }
        ])
        await expectError(DBusError.noReply) {
            _ = try await f.call("/org/example/thing", ServerFixture.interface, "Quit")
        }
        await server.waitUntilDisconnected()
        #expect(!server.isConnected)
        try await f.client.ping("org.freedesktop.DBus")
    }

    @Test func introspectionIsValidXMLWithChildren() async throws {
        let f = try await ServerFixture()
        f.addThing(at: "/org/example/thing")
        f.addThing(at: "/org/example/thing/child1")
        f.addThing(at: "/org/example/other")
        func introspect(_ path: DBusObjectPath) async throws -> IntrospectionSummary {
            let xml = try #require(
                try await f.call(path, "org.freedesktop.DBus.Introspectable", "Introspect").first?.string)
            return try IntrospectionSummary(xml)
        }
        let root = try await introspect("/")
        #expect(root.children == ["org"])
        #expect(root.interfaces.contains("org.freedesktop.DBus.ObjectManager"))
        let middle = try await introspect("/org/example")
        #expect(middle.children == ["other", "thing"])
        let thing = try await introspect("/org/example/thing")
        #expect(thing.children == ["child1"])
        #expect(thing.interfaces.contains(ServerFixture.interface))
        #expect(thing.interfaces.contains("org.freedesktop.DBus.Properties"))
        #expect(thing.methods.contains("Add"))
        #expect(thing.properties["Name"] == "readwrite")
        #expect(thing.properties["Count"] == "read")
        #expect(thing.properties["Secret"] == "write")
        #expect(thing.signals.contains("Ping"))
        #expect(thing.args.contains("sum:i:out") && thing.args.contains("a:i:in"))
        let leaf = try await introspect("/org/example/thing/child1")
        #expect(leaf.children.isEmpty)
    }

    @Test func gdbusAndBusctlUnderstandTheIntrospection() async throws {
        let f = try await ServerFixture()
        f.addThing(at: "/org/example/thing")
        f.addThing(at: "/org/example/thing/child1")
        let address = f.bus.address
        if let gdbus = which("gdbus") {
            let result = try await runCommand(
                gdbus,
                [
                    "introspect", "--address", address, "--dest", ServerFixture.name, "--object-path", "/",
                    "--recurse", "--only-properties",
                ])
            #expect(result.status == 0, "\(result.stderr)")
            #expect(result.stdout.contains("node /org/example/thing/child1"))
            #expect(result.stdout.contains("readwrite s Name = 'one';"))
            #expect(result.stdout.contains("readonly u Count = 1;"))
        } else {
            Issue.record("gdbus is not installed")
        }
        if let busctl = which("busctl") {
            let tree = try await runCommand(busctl, ["--address=\(address)", "tree", "--list", ServerFixture.name])
            #expect(tree.status == 0, "\(tree.stderr)")
            #expect(tree.stdout.contains("/org/example/thing/child1"))
            let property = try await runCommand(
                busctl,
                [
                    "--address=\(address)", "get-property", ServerFixture.name, "/org/example/thing",
                    ServerFixture.interface, "Name",
                ])
            #expect(property.status == 0, "\(property.stderr)")
            #expect(property.stdout.trimmingCharacters(in: .whitespacesAndNewlines) == "s \"one\"")
        } else {
            Issue.record("busctl is not installed")
        }
    }

    @Test func dbusSendReadsPropertiesAndCallsMethods() async throws {
        let f = try await ServerFixture()
        f.addThing()
        guard let dbusSend = which("dbus-send") else {
            Issue.record("dbus-send is not installed")
            return
        }
        let address = f.bus.address
        let get = try await runCommand(
            dbusSend,
            [
                "--bus=\(address)", "--print-reply", "--dest=\(ServerFixture.name)", "/org/example/thing",
                "org.freedesktop.DBus.Properties.Get", "string:\(ServerFixture.interface)", "string:Name",
            ])
        #expect(get.status == 0, "\(get.stderr)")
        #expect(get.stdout.contains("variant       string \"one\"") || get.stdout.contains("variant string \"one\""))
        let add = try await runCommand(
            dbusSend,
            [
                "--bus=\(address)", "--print-reply", "--dest=\(ServerFixture.name)", "/org/example/thing",
                "\(ServerFixture.interface).Add", "int32:2", "int32:40",
            ])
        #expect(add.status == 0, "\(add.stderr)")
        #expect(add.stdout.contains("int32 42"))
        let set = try await runCommand(
            dbusSend,
            [
                "--bus=\(address)", "--print-reply", "--dest=\(ServerFixture.name)", "/org/example/thing",
                "org.freedesktop.DBus.Properties.Set", "string:\(ServerFixture.interface)", "string:Name",
                "variant:string:from-dbus-send",
            ])
        #expect(set.status == 0, "\(set.stderr)")
        #expect(
            f.objects.property(at: "/org/example/thing", interface: ServerFixture.interface, "Name")
                == .string("from-dbus-send"))
        let unknown = try await runCommand(
            dbusSend,
            [
                "--bus=\(address)", "--print-reply", "--dest=\(ServerFixture.name)", "/org/example/thing",
                "\(ServerFixture.interface).Nope",
            ])
        #expect(unknown.status != 0)
        #expect(unknown.stderr.contains("org.freedesktop.DBus.Error.UnknownMethod"))
    }
}

/// What an introspection document declares.
struct IntrospectionSummary {
    var children: [String] = []
    var interfaces: [String] = []
    var methods: [String] = []
    var signals: [String] = []
    var properties: [String: String] = [:]
    var args: [String] = []

    init(_ xml: String) throws {
        let delegate = Delegate()
        let parser = XMLParser(data: Data(xml.utf8))
        parser.delegate = delegate
        guard parser.parse() else {
            throw HarnessError("invalid introspection XML: \(parser.parserError.map { "\($0)" } ?? "")\n\(xml)")
        }
        self = delegate.summary
    }

    private final class Delegate: NSObject, XMLParserDelegate {
        var summary = IntrospectionSummary(empty: ())
        var depth = 0
        func parser(
            _ parser: XMLParser, didStartElement name: String, namespaceURI: String?, qualifiedName: String?,
            attributes: [String: String] = [:]
        ) {
            depth += 1
            switch name {
            case "node" where depth == 2: summary.children.append(attributes["name"] ?? "")
            case "interface": summary.interfaces.append(attributes["name"] ?? "")
            case "method": summary.methods.append(attributes["name"] ?? "")
            case "signal": summary.signals.append(attributes["name"] ?? "")
            case "property": summary.properties[attributes["name"] ?? ""] = attributes["access"]
            case "arg":
                summary.args.append(
                    "\(attributes["name"] ?? ""):\(attributes["type"] ?? ""):\(attributes["direction"] ?? "")")
            default: break
            }
        }
        func parser(_ parser: XMLParser, didEndElement name: String, namespaceURI: String?, qualifiedName: String?) {
            depth -= 1
        }
    }

    private init(empty: Void) {}
}

/// A thread-safe append-only log.
final class Log<T>: @unchecked Sendable {
    private let lock = NSLock()
    private var items: [T] = []
    func append(_ item: T) { lock.withLock { items.append(item) } }
    func all() -> [T] { lock.withLock { items } }
}
