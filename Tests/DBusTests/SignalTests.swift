import DBus
import Foundation
import Synchronization
import TestSupport
import Testing

/// Collects the members of a stream's signals until one named `End`.
func members(until stream: DBusSignalStream) async -> [String] {
    var names: [String] = []
    for await message in stream {
        guard let member = message.member else { continue }
        if member == "End" { break }
        names.append(member)
    }
    return names
}

@Suite struct SignalTests {
    @Test func matchRulesFilterByPathNamespaceAndArguments() async throws {
        let fixture = try await BusFixture()
        let emitter = try fixture.connect()
        let listener = try fixture.connect()
        let byNamespace = try await listener.signals(
            matching: DBusMatchRule(interface: "org.example.Sig", pathNamespace: "/ns"))
        let byArg0 = try await listener.signals(
            matching: DBusMatchRule(interface: "org.example.Sig", arguments: [0: "match"]))
        let byArg0Path = try await listener.signals(
            matching: DBusMatchRule(interface: "org.example.Sig", argumentPaths: [0: "/p/"]))
        let bySender = try await listener.signals(
            matching: DBusMatchRule(sender: emitter.uniqueName, interface: "org.example.Sig", member: "End"))
        func emit(_ path: DBusObjectPath, _ member: String, _ arg: DBusValue) throws {
            try emitter.emitSignal(path: path, interface: "org.example.Sig", name: member, arguments: [arg])
        }
        try emit("/ns/a", "NsChild", .string("x"))
        try emit("/nsx", "NsSibling", .string("x"))
        try emit("/other", "Other", .string("x"))
        try emit("/ns", "NsItself", .string("x"))
        try emit("/zzz", "ArgMatch", .string("match"))
        try emit("/zzz", "ArgNoMatch", .string("matches"))
        try emit("/zzz", "ArgIsPath", .objectPath("/zzz"))
        try emit("/zzz", "PathBelow", .string("/p/x"))
        try emit("/zzz", "PathSame", .string("/p/"))
        try emit("/zzz", "PathShort", .string("/p"))
        try emit("/zzz", "PathRoot", .objectPath("/"))
        try emit("/zzz", "PathOther", .string("/q/x"))
        try emit("/ns/end", "End", .string("x"))
        try emit("/zzz", "End", .string("match"))
        try emit("/zzz", "End", .string("/p/end"))
        #expect(await members(until: byNamespace) == ["NsChild", "NsItself"])
        #expect(await members(until: byArg0) == ["ArgMatch"])
        #expect(await members(until: byArg0Path) == ["PathBelow", "PathSame", "PathRoot"])
        var senderIterator = bySender.makeAsyncIterator()
        #expect(await senderIterator.next()?.sender == emitter.uniqueName)
    }

    /// The bus's own count of this connection's match rules (dbus-daemon's Debug.Stats interface).
    func matchRuleCount(_ connection: DBusConnection) async throws -> UInt32? {
        let stats = try await connection.call(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus",
            interface: "org.freedesktop.DBus.Debug.Stats", method: "GetConnectionStats",
            arguments: [.string(connection.uniqueName)])
        return stats.first?.stringVariantDictionary?["MatchRules"]?.uint32
    }

    @Test func droppedStreamsRemoveTheirMatchRules() async throws {
        let fixture = try await BusFixture()
        let connection = try fixture.connect()
        let before = try #require(try await matchRuleCount(connection))
        do {
            let unused = try await connection.signals(matching: DBusMatchRule(interface: "org.example.Unused"))
            _ = unused
            #expect(try await matchRuleCount(connection) == before + 1)
        }
        #expect(try await matchRuleCount(connection) == before)
        do {
            let iterated = try await connection.signals(matching: DBusMatchRule(interface: "org.example.Iterated"))
            try connection.emitSignal(path: "/i", interface: "org.example.Iterated", name: "S")
            var iterator = iterated.makeAsyncIterator()
            #expect(await iterator.next()?.member == "S")
            #expect(try await matchRuleCount(connection) == before + 1)
        }
        #expect(try await matchRuleCount(connection) == before)
        // The stream's first value (the current owner, none) comes after its AddMatch: the rule is in place then.
        let (started, start) = AsyncStream<Void>.makeStream()
        let task = Task {
            let owners = try await connection.nameOwnerChanges("org.example.Watched")
            for await _ in owners { start.yield() }
        }
        try await within(10, "the name owner stream's first value") { for await _ in started { break } }
        #expect(try await matchRuleCount(connection) == before + 1)
        task.cancel()
        _ = await task.result
        #expect(try await matchRuleCount(connection) == before)
    }

    @Test func aWellKnownSenderRuleOnlyGetsTheOwnersSignals() async throws {
        let fixture = try await BusFixture()
        let listener = try fixture.connect()
        let owner = try fixture.connect()
        let other = try fixture.connect()
        #expect(try await owner.requestName("org.example.Named") == .primaryOwner)
        let named = try await listener.signals(
            matching: DBusMatchRule(sender: "org.example.Named", interface: "org.example.Sig"))
        let everyone = try await listener.signals(matching: DBusMatchRule(interface: "org.example.Sig"))
        var everyoneIterator = everyone.makeAsyncIterator()
        try other.emitSignal(path: "/s", interface: "org.example.Sig", name: "FromOther")
        #expect(await everyoneIterator.next()?.member == "FromOther")
        try owner.emitSignal(path: "/s", interface: "org.example.Sig", name: "FromOwner")
        try owner.emitSignal(path: "/s", interface: "org.example.Sig", name: "End")
        #expect(await members(until: named) == ["FromOwner"])
        #expect(await everyoneIterator.next()?.member == "FromOwner")
    }

    @Test func aSignalMatchedTwiceReachesBothStreams() async throws {
        let fixture = try await BusFixture()
        let connection = try fixture.connect()
        let a = try await connection.signals(matching: DBusMatchRule(interface: "org.example.Twice"))
        let b = try await connection.signals(matching: DBusMatchRule(member: "Once"))
        try connection.emitSignal(path: "/t", interface: "org.example.Twice", name: "Once")
        var ia = a.makeAsyncIterator()
        var ib = b.makeAsyncIterator()
        #expect(await ia.next()?.member == "Once")
        #expect(await ib.next()?.member == "Once")
    }

    @Test func nameOwnerChangesFollowOwnersAndClosedConnections() async throws {
        let fixture = try await BusFixture()
        let watcher = try fixture.connect()
        let changes = try await watcher.nameOwnerChanges("org.example.Owned")
        var iterator = changes.makeAsyncIterator()
        #expect(await iterator.next() == .some(nil))
        #expect(try await watcher.nameOwner("org.example.Owned") == nil)

        var owner: DBusConnection? = try fixture.connect()
        let ownerName = owner!.uniqueName
        #expect(try await owner!.requestName("org.example.Owned") == .primaryOwner)
        #expect(await iterator.next() == .some(ownerName))
        #expect(try await watcher.nameOwner("org.example.Owned") == ownerName)

        let rival = try fixture.connect()
        #expect(try await rival.requestName("org.example.Owned") == .exists)
        #expect(try await rival.requestName("org.example.Owned", flags: []) == .inQueue)
        #expect(try await owner!.requestName("org.example.Owned") == .alreadyOwner)

        owner = nil  // deinit closes the connection; the queued rival takes over
        #expect(await iterator.next() == .some(rival.uniqueName))
        try await rival.releaseName("org.example.Owned")
        #expect(await iterator.next() == .some(nil))

        // A name that already has an owner starts with that owner.
        let late = try await watcher.nameOwnerChanges("org.freedesktop.DBus")
        var lateIterator = late.makeAsyncIterator()
        #expect(await lateIterator.next() == .some("org.freedesktop.DBus"))
    }

    @Test func cancellingACallFailsItPromptly() async throws {
        let fixture = try await BusFixture()
        let server = try fixture.connect()
        let client = try fixture.connect()
        let objects = DBusObjectServer(connection: server)
        let held = PendingReplies()
        let (arrivals, arrival) = AsyncStream<Void>.makeStream()
        objects.addInterfaces(
            at: "/hold",
            [
                (
                    DBusInterfaceSpec(
                        "org.example.Hold",
                        methods: [
                            DBusMethodSpec("Hold") { call in
                                held.add(call.reply)
                                arrival.yield()
                                return .deferred
                            }
                        ]), [:]
                )
            ])
        let serverName = server.uniqueName
        let task = Task { () async throws(DBusError) -> [DBusValue] in
            try await client.call(
                destination: serverName, path: "/hold", interface: "org.example.Hold", method: "Hold",
                timeout: .seconds(60))
        }
        // The server holds the call: it is in flight when it is cancelled.
        try await within(10, "the server to hold the call") { for await _ in arrivals { break } }
        let start = ContinuousClock.now
        task.cancel()
        let result = await task.result
        #expect(ContinuousClock.now - start < .seconds(10), "the call would otherwise wait out its 60 s timeout")
        guard case .failure(let error) = result else {
            Issue.record("expected a failure")
            return
        }
        #expect((error as? DBusError)?.name == DBusError.cancelled)
        // The connection is still fine, and a late reply is harmless.
        held.all().first?.succeed([])
        try await client.ping(serverName)
    }

    @Test func theBusGoingAwayIsReportedWithoutCrashing() async throws {
        let fixture = try await BusFixture()
        let server = try fixture.connect()
        let client = try fixture.connect()
        let objects = DBusObjectServer(connection: server)
        let (arrivals, arrival) = AsyncStream<Void>.makeStream()
        objects.addInterfaces(
            at: "/hold",
            [
                (
                    DBusInterfaceSpec(
                        "org.example.Hold",
                        methods: [
                            DBusMethodSpec("Hold") { _ in
                                arrival.yield()
                                return .deferred
                            }
                        ]), [:]
                )
            ])
        let signals = try await client.signals(matching: DBusMatchRule(interface: "org.example.Never"))
        let serverName = server.uniqueName
        let pending = Task { () async throws(DBusError) -> [DBusValue] in
            try await client.call(
                destination: serverName, path: "/hold", interface: "org.example.Hold", method: "Hold",
                timeout: .seconds(60))
        }
        let waiter = Task { await client.waitUntilDisconnected() }
        // The server holds the call, so the daemon goes away with a call in flight.
        try await within(10, "the server to hold the call") { for await _ in arrivals { break } }
        fixture.killDaemon()
        await waiter.value
        #expect(!client.isConnected)
        await server.waitUntilDisconnected()
        #expect(!server.isConnected)
        guard case .failure(let error) = await pending.result else {
            Issue.record("expected the call to fail")
            return
        }
        #expect([DBusError.disconnected, DBusError.noReply].contains((error as? DBusError)?.name ?? ""))
        var iterator = signals.makeAsyncIterator()
        #expect(await iterator.next() == nil)  // the stream ended
        #expect(throws: DBusError.self) {
            try client.emitSignal(path: "/x", interface: "org.example.X", name: "Y")
        }
        await expectError(DBusError.disconnected) { try await client.ping("org.freedesktop.DBus") }
        await expectError(DBusError.disconnected) {
            _ = try await client.signals(matching: DBusMatchRule(interface: "org.example.X"))
        }
        // Server side keeps working locally and does not crash.
        objects.setProperty(at: "/hold", interface: "org.example.Hold", "X", .int32(1))
        objects.flush()
        client.close()
        server.close()
    }

    @Test func closeWritesOutWhatWasQueued() async throws {
        let fixture = try await BusFixture()
        let listener = try fixture.connect()
        let stream = try await listener.signals(matching: DBusMatchRule(interface: "org.example.Last"))
        let sender = try fixture.connect()
        for index in 0..<100 {
            try sender.emitSignal(
                path: "/l", interface: "org.example.Last", name: "Word", arguments: [.int32(Int32(index))])
        }
        sender.close()
        var received: [Int32] = []
        for await message in stream {
            received.append(message.body.first?.int32 ?? -1)
            if received.count == 100 { break }
        }
        #expect(received == Array(0..<100))
    }

    @Test func connectingToNothingFails() {
        #expect(throws: DBusError.self) { try DBusConnection(.address("unix:path=/nonexistent/socket")) }
        #expect(throws: DBusError.self) { try DBusConnection(.address("nonsense")) }
        #expect(throws: DBusError.self) { try DBusConnection(.address("")) }
    }

    @Test func systemAndSessionBusesHonourTheEnvironment() async throws {
        let fixture = try await BusFixture()
        // This affects the whole test process; the value only matters to .system connections. (Not `setenv`: it can
        // crash a concurrent `getenv` on another thread.)
        try setEnvironmentVariable("DBUS_SYSTEM_BUS_ADDRESS", fixture.address)
        let connection = try DBusConnection(.system)
        let owner = try await connection.nameOwner("org.freedesktop.DBus")
        #expect(owner == "org.freedesktop.DBus")
        let names = try await connection.call(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            method: "ListNames")
        #expect(names.first?.arrayElements?.contains(.string(connection.uniqueName)) == true)
        try setEnvironmentVariable("DBUS_SESSION_BUS_ADDRESS", fixture.address)
        let session = try DBusConnection(.session)
        try await session.ping(connection.uniqueName)  // libdbus answers Peer.Ping for every connection
        #expect(try await session.nameOwner("org.freedesktop.DBus") == "org.freedesktop.DBus")
    }

    @Test func closeIsIdempotentAndFailsLaterCalls() async throws {
        let fixture = try await BusFixture()
        let connection = try fixture.connect()
        connection.close()
        connection.close()
        #expect(!connection.isConnected)
        await connection.waitUntilDisconnected()
        await expectError(DBusError.disconnected) { try await connection.ping("org.freedesktop.DBus") }
        for _ in 0..<20 {
            let short = try fixture.connect()
            try await short.ping("org.freedesktop.DBus")
        }
    }

    @Test func concurrentCallsFromManyTasksAllGetTheirOwnReplies() async throws {
        let fixture = try await BusFixture()
        let server = try fixture.connect()
        let client = try fixture.connect()
        let objects = DBusObjectServer(connection: server)
        objects.addInterfaces(
            at: "/echo",
            [
                (
                    DBusInterfaceSpec(
                        "org.example.Echo",
                        methods: [
                            DBusMethodSpec("Echo", in: "ui", out: "ui") { call in .reply(call.arguments) },
                            DBusMethodSpec("Later", in: "u", out: "u") { call in
                                let reply = call.reply
                                let value = call.arguments
                                Task.detached { reply.succeed(value) }
                                return .deferred
                            },
                        ]), [:]
                )
            ])
        let serverName = server.uniqueName
        let mismatches = try await withThrowingTaskGroup(of: Int.self) { group in
            for worker in 0..<8 {
                group.addTask {
                    var wrong = 0
                    for index in 0..<150 {
                        let tag = UInt32(worker * 1000 + index)
                        if index % 3 == 0 {
                            let reply = try await client.call(
                                destination: serverName, path: "/echo", interface: "org.example.Echo",
                                method: "Later", arguments: [.uint32(tag)])
                            if reply != [.uint32(tag)] { wrong += 1 }
                        } else {
                            let reply = try await client.call(
                                destination: serverName, path: "/echo", interface: "org.example.Echo",
                                method: "Echo", arguments: [.uint32(tag), .int32(-Int32(index))])
                            if reply != [.uint32(tag), .int32(-Int32(index))] { wrong += 1 }
                        }
                    }
                    return wrong
                }
            }
            return try await group.reduce(0, +)
        }
        #expect(mismatches == 0)
    }

    @Test func burstOfPropertyChangesArrivesComplete() async throws {
        let fixture = try await BusFixture()
        let server = try fixture.connect()
        let client = try fixture.connect()
        let objects = DBusObjectServer(connection: server)
        let spec = DBusInterfaceSpec(
            "org.bluez.GattCharacteristic1", properties: [DBusPropertySpec("Value", "ay")])
        objects.addInterfaces(at: "/org/bluez/hci0/dev_X/service0001/char0002", [(spec, ["Value": .bytes([])])])
        objects.flush()
        let stream = try await client.signals(
            matching: DBusMatchRule(
                sender: server.uniqueName, interface: "org.freedesktop.DBus.Properties", member: "PropertiesChanged",
                arguments: [0: "org.bluez.GattCharacteristic1"]))
        let count = 20_000
        let start = ContinuousClock.now
        let emitter = Task.detached {
            for index in 0..<count {
                let value = UInt32(index)
                objects.setProperty(
                    at: "/org/bluez/hci0/dev_X/service0001/char0002", interface: "org.bluez.GattCharacteristic1",
                    "Value", .bytes(withUnsafeBytes(of: value.littleEndian) { Array($0) }), flush: true)
            }
            return ContinuousClock.now
        }
        var received = 0
        var inOrder = true
        for await message in stream {
            guard let bytes = message.body[1].stringVariantDictionary?["Value"]?.bytes, bytes.count == 4 else {
                continue
            }
            let value = bytes.withUnsafeBytes { $0.loadUnaligned(as: UInt32.self) }
            if value != UInt32(received) { inOrder = false }
            received += 1
            if received == count { break }
        }
        let sent = await emitter.value
        let elapsed = ContinuousClock.now - start
        let seconds = Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
        let sendSeconds =
            Double((sent - start).components.seconds) + Double((sent - start).components.attoseconds) / 1e18
        print(
            "burst: \(count) PropertiesChanged in \(seconds) s = \(Int(Double(count) / seconds))/s received; emitted at \(Int(Double(count) / sendSeconds))/s"
        )
        #expect(received == count)
        #expect(inOrder)
    }
}

@Suite struct SignalHandlerTests {
    @Test func handlersRunOnTheIOThreadInOrderAndAnOrderedReplyTakesItsPlaceAmongThem() async throws {
        let fixture = try await BusFixture()
        let server = try fixture.connect()
        let listener = try fixture.connect()
        // The method emits Before, replies, and emits After once the reply is out: on the wire the reply is
        // between the two signals.
        let objects = DBusObjectServer(connection: server)
        objects.addInterfaces(
            at: "/o",
            [
                (
                    DBusInterfaceSpec(
                        "org.example.Ordered",
                        methods: [
                            DBusMethodSpec("Snapshot", out: "s") { _ in
                                try? server.emitSignal(path: "/o", interface: "org.example.Ordered", name: "Before")
                                server.perform {
                                    try? server.emitSignal(path: "/o", interface: "org.example.Ordered", name: "After")
                                }
                                return .reply([.string("snapshot")])
                            }
                        ]), [:]
                )
            ])
        let seen = Mutex<[String]>([])
        let threads = Mutex<Set<String>>([])
        let subscription = try await listener.signals(
            matching: DBusMatchRule(sender: server.uniqueName, interface: "org.example.Ordered"),
            handler: { message in
                threads.withLock { _ = $0.insert(currentThreadName()) }
                seen.withLock { $0.append(message.member ?? "?") }
            })
        let call = DBusMessage.methodCall(
            destination: server.uniqueName, path: "/o", interface: "org.example.Ordered", method: "Snapshot",
            body: [])
        let reply = try await listener.call(
            call,
            inOrder: { reply in
                threads.withLock { _ = $0.insert(currentThreadName()) }
                seen.withLock { $0.append("reply:\(reply.body.first?.string ?? "")") }
            })
        #expect(reply.body.first?.string == "snapshot")
        try await eventually(10, "the After signal") { seen.withLock { $0.count } == 3 }
        // Handled in wire order on the I/O thread: a consumer that loads the snapshot in `inOrder` applies
        // exactly the signals that came after it.
        #expect(seen.withLock { $0 } == ["Before", "reply:snapshot", "After"])
        #expect(threads.withLock { $0 } == ["dbus-io"])
        // Cancelled: no more handler calls, and the bus forgets the rule.
        subscription.cancel()
        try server.emitSignal(path: "/o", interface: "org.example.Ordered", name: "Late")
        let marker = try await listener.signals(matching: DBusMatchRule(interface: "org.example.Marker"))
        try server.emitSignal(path: "/o", interface: "org.example.Marker", name: "End")
        #expect(await members(until: marker) == [])
        #expect(seen.withLock { $0.count } == 3)
    }

    @Test func anErrorReplyIsNotHandedToInOrder() async throws {
        let fixture = try await BusFixture()
        let listener = try fixture.connect()
        let handed = Mutex(0)
        let call = DBusMessage.methodCall(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            method: "GetNameOwner", body: [.string("org.example.Nobody")])
        await #expect(throws: DBusError.self) {
            _ = try await listener.call(call, inOrder: { _ in handed.withLock { $0 += 1 } })
        }
        #expect(handed.withLock { $0 } == 0)
    }
}
