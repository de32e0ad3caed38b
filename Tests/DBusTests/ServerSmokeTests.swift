import DBus
import Foundation
import TestSupport
import Testing

@Suite struct ServerSmokeTests {
    @Test func methodPropertiesAndSignals() async throws {
        let fixture = try await BusFixture()
        let server = try fixture.connect()
        let client = try fixture.connect()
        #expect(try await server.requestName("org.example.Smoke") == .primaryOwner)
        let objects = DBusObjectServer(connection: server)
        let spec = DBusInterfaceSpec(
            "org.example.Thing",
            methods: [
                DBusMethodSpec("Add", in: "ii", out: "i") { call in
                    guard let a = call.arguments[0].int32, let b = call.arguments[1].int32 else {
                        return .error(DBusError(name: DBusError.invalidArgs, message: "bad"))
                    }
                    return .reply([.int32(a &+ b)])
                }
            ],
            properties: [DBusPropertySpec("Name", "s", access: .readWrite), DBusPropertySpec("Count", "u")])
        objects.addInterfaces(at: "/thing", [(spec, ["Name": .string("one"), "Count": .uint32(1)])])

        let sum = try await client.call(
            destination: "org.example.Smoke", path: "/thing", interface: "org.example.Thing", method: "Add",
            arguments: [.int32(2), .int32(40)])
        #expect(sum == [.int32(42)])

        let changes = try await client.signals(
            matching: DBusMatchRule(
                sender: "org.example.Smoke", interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged",
                path: "/thing"))
        objects.setProperty(at: "/thing", interface: "org.example.Thing", "Count", .uint32(2))
        var iterator = changes.makeAsyncIterator()
        let signal = await iterator.next()
        #expect(signal?.body.first == .string("org.example.Thing"))
        #expect(signal?.body[1].stringVariantDictionary?["Count"] == .uint32(2))

        let value = try await client.call(
            destination: "org.example.Smoke", path: "/thing", interface: "org.freedesktop.DBus.Properties",
            method: "Get", arguments: [.string("org.example.Thing"), .string("Name")])
        #expect(value == [.variant(.string("one"))])
    }
}
