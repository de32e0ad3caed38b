import Foundation
import TestSupport
import Testing

@testable import MQTT

/// Round trips against a real mosquitto started per test.
@Suite struct BrokerTests {
    @Test(arguments: [MQTTProtocolVersion.v311, .v5])
    func roundTripAtEachQoS(version: MQTTProtocolVersion) async throws {
        let broker = try await MosquittoBroker.start()
        let subscriber = try await connectedClient(configuration(broker, version: version))
        let publisher = try await connectedClient(configuration(broker, version: version))
        let messages = subscriber.messages(matching: "rt/#")
        #expect(try await subscriber.subscribe(to: "rt/#", qos: .exactlyOnce) == .exactlyOnce)
        for qos in MQTTQoS.allCases {
            try await publisher.publish(to: "rt/qos\(qos.rawValue)", payload: [UInt8(qos.rawValue), 0xFF, 0], qos: qos)
        }
        let received = try await messages.first(3)
        #expect(received.map(\.topic) == ["rt/qos0", "rt/qos1", "rt/qos2"])
        #expect(received.map(\.qos) == [.atMostOnce, .atLeastOnce, .exactlyOnce])
        #expect(received.map(\.payload) == [[0, 0xFF, 0], [1, 0xFF, 0], [2, 0xFF, 0]])
        #expect(received.allSatisfy { !$0.retain })
        let stats = publisher.statistics
        #expect(stats.published == 3 && stats.acknowledged == 2 && stats.connections == 1)
        #expect(subscriber.statistics.received == 3)
        await publisher.disconnect()
        await subscriber.disconnect()
        #expect(publisher.connectionState == .stopped)
    }

    /// What is published between holdWrites() and releaseWrites() (the socket corked, each packet written by the
    /// publishing thread itself) all arrives, in order per QoS, and every QoS 1 message is acknowledged.
    @Test(arguments: [MQTTProtocolVersion.v311, .v5])
    func heldWritesAllArriveInOrder(version: MQTTProtocolVersion) async throws {
        let broker = try await MosquittoBroker.start()
        let subscriber = try await connectedClient(configuration(broker, version: version))
        let publisher = try await connectedClient(configuration(broker, version: version))
        let messages = subscriber.messages(matching: "held/#")
        _ = try await subscriber.subscribe(to: "held/#", qos: .atLeastOnce)
        var deliveries: [MQTTDelivery] = []
        for round in 0..<5 {
            publisher.holdWrites()
            for index in 0..<20 {
                let n = UInt8(round * 20 + index)
                deliveries.append(
                    try publisher.send(
                        MQTTOutgoingMessage(
                            topic: "held/\(n)", payload: [n], qos: index % 2 == 0 ? .atLeastOnce : .atMostOnce)))
            }
            publisher.releaseWrites()
        }
        // MQTT orders messages per QoS (the broker's in-flight window for the subscriber holds QoS 1 back while
        // QoS 0 goes on), so each QoS is checked on its own.
        let received = try await messages.first(100).map { Int($0.payload[0]) }
        #expect(received.filter { $0 % 2 == 0 } == Array(stride(from: 0, to: 100, by: 2)))
        #expect(received.filter { $0 % 2 == 1 } == Array(stride(from: 1, to: 100, by: 2)))
        for delivery in deliveries { try await within(10, "acknowledged") { try await delivery.acknowledged() } }
        #expect(publisher.statistics.acknowledged == 50)
        await publisher.disconnect()
        await subscriber.disconnect()
    }

    /// post(_:) (publish with no delivery to wait for) sends at once when connected, queues while the broker is away,
    /// and counts like send(_:): every QoS 1 message arrives once, in order, and is acknowledged.
    @Test func postedMessagesAreQueuedSentOnceAndAcknowledged() async throws {
        let broker = try await MosquittoBroker.start()
        let subscriber = try await connectedClient(configuration(broker))
        let messages = subscriber.messages(matching: "post/#")
        _ = try await subscriber.subscribe(to: "post/#", qos: .atLeastOnce)
        var settings = configuration(broker)
        settings.reconnect = MQTTReconnectPolicy(initialDelay: .milliseconds(20), maximumDelay: .milliseconds(100))
        let publisher = try await connectedClient(settings)
        for index in 0..<10 {
            try publisher.post(MQTTOutgoingMessage(topic: "post/a", payload: [UInt8(index)], qos: .atLeastOnce))
        }
        #expect(try await messages.first(10).map { Int($0.payload[0]) } == Array(0..<10))
        try await within(10, "the first ten acknowledged") {
            while publisher.statistics.acknowledged < 10 { try await Task.sleep(for: .milliseconds(10)) }
        }

        await broker.stop()
        try await publisher.waitForState("publisher lost the broker") {
            if case .waitingToReconnect = $0 { return true } else { return false }
        }
        for index in 10..<20 {
            try publisher.post(MQTTOutgoingMessage(topic: "post/a", payload: [UInt8(index)], qos: .atLeastOnce))
        }
        #expect(publisher.statistics.queued == 10)
        try await broker.restart()
        try await subscriber.waitForState("subscriber back") { $0.isConnected }
        _ = try await subscriber.subscribe(to: "post/#", qos: .atLeastOnce)
        try await within(10, "the queued ten acknowledged") {
            while publisher.statistics.acknowledged < 20 { try await Task.sleep(for: .milliseconds(10)) }
        }
        let stats = publisher.statistics
        #expect(stats.published == 20 && stats.acknowledged == 20 && stats.queued == 0)
        await publisher.disconnect()
        await subscriber.disconnect()
    }

    @Test func subscriptionGrantsAndFiltersStreams() async throws {
        let broker = try await MosquittoBroker.start()
        let client = try await connectedClient(configuration(broker))
        let all = client.messages()
        let onlyB = client.messages(matching: "x/b/+")
        #expect(try await client.subscribe(to: "x/#", qos: .atMostOnce) == .atMostOnce)
        try await client.publish(to: "x/a/1", payload: Array("a".utf8))
        try await client.publish(to: "x/b/1", payload: Array("b".utf8))
        #expect(try await all.first(2).map(\.topic) == ["x/a/1", "x/b/1"])
        #expect(try await onlyB.first(1).map(\.payloadString) == ["b"])
        try await client.unsubscribe(from: "x/#")
        try await client.publish(to: "x/a/2", payload: [1], qos: .atLeastOnce)
        try await client.subscribe(to: "x/c")
        try await client.publish(to: "x/c", payload: [2], qos: .atLeastOnce)
        // After the unsubscribe only x/c arrives: x/a/2 would otherwise have come first.
        #expect(try await all.first(1).map(\.topic) == ["x/c"])
        await #expect(throws: MQTTError.self) { try await client.subscribe(to: "x/#/y") }
        await client.disconnect()
    }

    @Test func retainedMessageReachesLaterSubscribers() async throws {
        let broker = try await MosquittoBroker.start()
        let publisher = try await connectedClient(configuration(broker))
        try await publisher.publish(to: "home/status", payload: Array("online".utf8), qos: .atLeastOnce, retain: true)
        let late = try await connectedClient(configuration(broker))
        let messages = late.messages()
        try await late.subscribe(to: "home/+")
        let first = try #require(try await messages.first(1).first)
        #expect(first.topic == "home/status" && first.payloadString == "online" && first.retain)
        // A live message is not flagged retained, even when published with retain.
        try await publisher.publish(to: "home/status", payload: Array("busy".utf8), qos: .atLeastOnce, retain: true)
        let live = try #require(try await messages.first(1).first)
        #expect(live.payloadString == "busy" && !live.retain)
        await publisher.disconnect()
        await late.disconnect()
    }

    @Test func willIsPublishedWhenTheClientDies() async throws {
        let broker = try await MosquittoBroker.start()
        let watcher = try await connectedClient(configuration(broker))
        let messages = watcher.messages()
        try await watcher.subscribe(to: "will/#")
        let child = try ChildProcess(
            executable: Fixtures.executable("bench-mqtt"),
            arguments: ["will-child", "--port", "\(broker.port)", "--topic", "will/child"])
        try await child.waitForOutput(timeout: 10) { $0.contains("connected") }
        child.signal(SIGKILL)
        let will = try #require(try await messages.first(1).first)
        #expect(will.topic == "will/child")
        #expect(will.payloadString == "child \(child.pid) died")
        #expect(will.qos == .atLeastOnce)
        await watcher.disconnect()
    }

    @Test func cleanDisconnectDoesNotPublishTheWill() async throws {
        let broker = try await MosquittoBroker.start()
        let watcher = try await connectedClient(configuration(broker))
        let messages = watcher.messages()
        try await watcher.subscribe(to: "will/#")
        var settings = configuration(broker)
        settings.will = MQTTWill(
            topic: "will/clean", payload: Array("gone".utf8),
            properties: MQTTPublishProperties(contentType: "text/plain"))
        let leaving = try await connectedClient(settings)
        await leaving.disconnect()
        // A marker published after the disconnect arrives first: no will was published in between.
        try await watcher.publish(to: "will/marker", payload: [], qos: .atLeastOnce)
        #expect(try await messages.first(1).map(\.topic) == ["will/marker"])
        await watcher.disconnect()
    }

    /// A disconnect while writes are held (the bridge's batching of a round's publishes, left on by a round that
    /// never ended) sends what was published first, then DISCONNECT: nothing is dropped with the socket, and the
    /// broker sees a clean disconnect, not the will.
    @Test func disconnectDuringAHoldSendsWhatWasHeldAndNoWill() async throws {
        let broker = try await MosquittoBroker.start()
        let watcher = try await connectedClient(configuration(broker))
        let messages = watcher.messages()
        try await watcher.subscribe(to: "hold/#", qos: .atLeastOnce)
        var settings = configuration(broker)
        settings.will = MQTTWill(topic: "hold/will", payload: Array("gone".utf8))
        let leaving = try await connectedClient(settings)
        leaving.holdWrites()
        try leaving.post(MQTTOutgoingMessage(topic: "hold/last", payload: [1], qos: .atLeastOnce))
        await leaving.disconnect()
        // A marker published after the disconnect comes after the held message, with no will in between.
        try await watcher.publish(to: "hold/marker", payload: [], qos: .atLeastOnce)
        let topics = try await messages.first(2).map(\.topic)
        #expect(topics == ["hold/last", "hold/marker"], "\(topics)")
        await watcher.disconnect()
    }

    @Test func persistentSessionResumesAndForgetsOfflineUnsubscribes() async throws {
        let state = try TemporaryDirectory(prefix: "blebridge-mqtt-db")
        try FileManager.default.setAttributes([.posixPermissions: 0o777], ofItemAtPath: state.url.path)
        let broker = try await MosquittoBroker.start(extraConfig: Self.persistence(state))
        var settings = configuration(broker, version: .v311, clientID: "persistent-311")
        settings.cleanSession = false
        let client = try await connectedClient(settings)
        let messages = client.messages()
        try await client.subscribe(to: "keep/#", qos: .atLeastOnce)
        try await client.subscribe(to: "drop/#", qos: .atLeastOnce)
        await broker.stop()
        try await client.waitForState("lost the broker") {
            if case .waitingToReconnect = $0 { return true } else { return false }
        }
        try await client.unsubscribe(from: "drop/#")  // offline: remembered, sent once the session is back
        try await broker.restart()
        try await client.waitForState("back with its session") { $0 == .connected(sessionPresent: true) }
        let publisher = try await connectedClient(configuration(broker))
        try await publisher.publish(to: "drop/x", payload: [1], qos: .atLeastOnce)
        try await publisher.publish(to: "keep/x", payload: [2], qos: .atLeastOnce)
        // keep/# came back with the session without a new SUBSCRIBE; drop/# was unsubscribed before drop/x.
        #expect(try await messages.first(1).map(\.topic) == ["keep/x"])
        await publisher.disconnect()
        await client.disconnect()
    }

    @Test func mqtt5PersistentSessionSurvivesRepeatedConnectionLoss() async throws {
        // The session expiry goes with every CONNECT, reconnects included: were it missing (0) on the first
        // reconnect, the broker would end the session at the second loss and report it absent.
        let broker = try await MosquittoBroker.start()
        var settings = configuration(broker, clientID: "persistent-v5")
        settings.cleanSession = false
        settings.sessionExpiry = .seconds(600)
        let client = try await connectedClient(settings)
        let messages = client.messages()
        try await client.subscribe(to: "session/#", qos: .atLeastOnce)
        for round in 1...2 {
            let states = client.connectionStates()
            client.core.breakConnectionForTesting()
            let resumed = try await within(10, "reconnect \(round)") { () -> Bool? in
                var lost = false
                for await state in states {
                    if case .waitingToReconnect = state { lost = true }
                    if lost, case .connected(let sessionPresent) = state { return sessionPresent }
                }
                return nil
            }
            #expect(resumed == true, "round \(round)")
        }
        let publisher = try await connectedClient(configuration(broker))
        try await publisher.publish(to: "session/x", payload: [1], qos: .atLeastOnce)
        #expect(try await messages.first(1).map(\.topic) == ["session/x"])
        await publisher.disconnect()
        await client.disconnect()
    }

    /// `.connected` is said after the subscriptions of a reconnection went out: a message published on hearing it
    /// (the bridge's birth, or a client's own echo) comes after them on the connection, so the broker applies them
    /// first. A clean session: the broker forgot the subscription with each connection, as after a broker restart.
    @Test func aPublishOnHearingConnectedFollowsTheRestoredSubscriptions() async throws {
        let broker = try await MosquittoBroker.start()
        let client = try await connectedClient(configuration(broker, version: .v311))
        let messages = client.messages()
        try await client.subscribe(to: "echo/#", qos: .atLeastOnce)
        for round in 1...10 {
            let states = client.connectionStates()
            client.core.breakConnectionForTesting()
            let reconnected = try await within(10, "reconnect \(round)") { () -> Bool in
                var lost = false
                for await state in states {
                    if case .waitingToReconnect = state { lost = true }
                    if lost, case .connected = state {
                        try client.post(
                            MQTTOutgoingMessage(topic: "echo/\(round)", payload: [UInt8(round)], qos: .atLeastOnce))
                        return true
                    }
                }
                return false
            }
            #expect(reconnected, "round \(round): the states ended before the client was connected again")
            // QoS 1 is at least once: an earlier round's echo may come again (resent after the break).
            let arrived = try await within(5, "echo/\(round) comes back") { () -> Bool in
                for await m in messages {
                    if m.topic == "echo/\(round)" { return true }
                    #expect(m.topic.hasPrefix("echo/") && Int(m.topic.dropFirst(5)) ?? 0 < round, "\(m.topic)")
                }
                return false
            }
            #expect(arrived, "round \(round)")
        }
        await client.disconnect()
    }

    @Test func runUntilCancelledThenDisconnectsCleanly() async throws {
        let broker = try await MosquittoBroker.start()
        let watcher = try await connectedClient(configuration(broker))
        let messages = watcher.messages()
        try await watcher.subscribe(to: "run/#")
        var settings = configuration(broker)
        settings.will = MQTTWill(topic: "run/will", payload: Array("unclean".utf8), qos: .atLeastOnce)
        let client = try MQTTClient(configuration: settings)
        let running = Task { try await client.run() }
        try await client.waitForState("running client connects") { $0.isConnected }
        try await client.publish(to: "run/hello", payload: [1], qos: .atLeastOnce)
        running.cancel()
        try await within(5, "run() returns after cancellation") { try await running.value }
        #expect(client.connectionState == .stopped)
        // No will: the marker published afterwards is the next message after hello.
        try await watcher.publish(to: "run/marker", payload: [], qos: .atLeastOnce)
        #expect(try await messages.first(2).map(\.topic) == ["run/hello", "run/marker"])
        await watcher.disconnect()
    }

    @Test func reconnectsResubscribesAndDrainsTheQueueInOrder() async throws {
        // The broker keeps persistent sessions across its restart (saved after every change), so a second, persistent
        // subscriber sees every queued message whichever client comes back first; the first subscriber has a clean
        // session, which the restart loses, so it must resubscribe by itself.
        let state = try TemporaryDirectory(prefix: "blebridge-mqtt-db")
        try FileManager.default.setAttributes([.posixPermissions: 0o777], ofItemAtPath: state.url.path)
        let broker = try await MosquittoBroker.start(extraConfig: Self.persistence(state))
        var cleanSettings = configuration(broker)
        cleanSettings.reconnect = MQTTReconnectPolicy(initialDelay: .milliseconds(20), maximumDelay: .milliseconds(100))
        let clean = try await connectedClient(cleanSettings)
        let cleanMessages = clean.messages(matching: "queue/#")
        try await clean.subscribe(to: "queue/#", qos: .atLeastOnce)
        var persistentSettings = configuration(broker, clientID: "restart-persistent")
        persistentSettings.cleanSession = false
        let persistent = try await connectedClient(persistentSettings)
        let persistentMessages = persistent.messages(matching: "queue/item")
        try await persistent.subscribe(to: "queue/item", qos: .atLeastOnce)
        let publisher = try await connectedClient(configuration(broker))
        let publisherStates = publisher.connectionStates()

        await broker.stop()
        try await publisher.waitForState("publisher lost the broker") {
            if case .waitingToReconnect = $0 { return true } else { return false }
        }
        let deliveries = try (0..<50).map { index in
            try publisher.send(
                MQTTOutgoingMessage(topic: "queue/item", payload: Array("\(index)".utf8), qos: .atLeastOnce))
        }
        #expect(publisher.statistics.queued == 50)
        #expect(deliveries.allSatisfy { !$0.isFinished })
        try await broker.restart()
        for delivery in deliveries { try await within(10, "acknowledgement") { try await delivery.acknowledged() } }
        let received = try await persistentMessages.first(50)
        #expect(received.map(\.payloadString) == (0..<50).map { "\($0)" })
        #expect(persistent.connectionState == .connected(sessionPresent: true))

        try await clean.waitForState("clean subscriber back") { $0.isConnected }
        #expect(clean.connectionState == .connected(sessionPresent: false))
        try await clean.publish(to: "queue/probe", payload: [], qos: .atLeastOnce)
        let heard = try await within(10, "the clean subscriber hears its probe") {
            for await message in cleanMessages where message.topic == "queue/probe" { return true }
            return false
        }
        #expect(heard)

        let stats = publisher.statistics
        #expect(stats.queued == 0 && stats.acknowledged == 50 && stats.connections == 2)
        // The publisher's states: connected, lost (retrying), connecting, connected.
        var seen: [String] = []
        for await state in publisherStates {
            switch state {
            case .connected: seen.append("connected")
            case .waitingToReconnect: seen.append("waiting")
            case .connecting: seen.append("connecting")
            default: seen.append("\(state)")
            }
            if seen.count >= 2 && seen.last == "connected" { break }
        }
        #expect(seen.first == "connected" && seen.contains("waiting") && seen.last == "connected")
        await publisher.disconnect()
        await persistent.disconnect()
        await clean.disconnect()
    }

    /// Broker settings that keep sessions across a restart. Saved after every change, so what is on disk does not
    /// depend on how the broker ends (SIGTERM, or SIGKILL once the harness's grace period is over).
    static func persistence(_ directory: TemporaryDirectory) -> String {
        """
        persistence true
        persistence_location \(directory.url.path)/
        autosave_on_changes true
        autosave_interval 1

        """
    }

    @Test func brokerDisconnectReasonReachesTheStateStream() async throws {
        // mosquitto 2.0.11 closes connections without a DISCONNECT (takeover, shutdown), so a scripted peer plays
        // an MQTT 5 broker that accepts us and then sends DISCONNECT "Session taken over" with a reason string.
        let reasonString = Array("another client took client id twin".utf8)
        var disconnect: [UInt8] = [0xE0, UInt8(1 + 1 + 3 + reasonString.count), 0x8E, UInt8(3 + reasonString.count)]
        disconnect += [0x1F, 0x00, UInt8(reasonString.count)] + reasonString
        let peer = try ScriptedPeer(replies: [[0x20, 0x03, 0x00, 0x00, 0x00], disconnect])
        var settings = MQTTConfiguration(broker: MQTTBrokerURL(host: "127.0.0.1", port: peer.port), clientID: "twin")
        settings.reconnect = MQTTReconnectPolicy(initialDelay: .seconds(30))
        let client = try MQTTClient(configuration: settings)
        let states = client.connectionStates()
        try client.start()
        let error = try await within(10, "the client is told why") { () -> MQTTError? in
            for await state in states {
                if case .waitingToReconnect(_, _, let error) = state { return error }
            }
            return nil
        }
        #expect(error?.code == .disconnectedByBroker(.sessionTakenOver))
        // libmosquitto 2.0.11 does not pass the DISCONNECT's properties on (its callback gets NULL), so the
        // reason string only shows with a later libmosquitto.
        #expect(error?.detail.hasPrefix("the broker disconnected us: Session taken over (0x8E)") == true)
        await client.disconnect()
    }

    @Test func inflightMessagesSurviveABrokenConnection() async throws {
        let broker = try await MosquittoBroker.start()
        let subscriber = try await connectedClient(configuration(broker))
        let messages = subscriber.messages()
        try await subscriber.subscribe(to: "burst", qos: .atLeastOnce)
        var settings = configuration(broker)
        settings.maxInflightMessages = 50
        let publisher = try await connectedClient(settings)
        let states = publisher.connectionStates()
        let deliveries = try (0..<2000).map { index in
            try publisher.send(MQTTOutgoingMessage(topic: "burst", payload: Array("\(index)".utf8), qos: .atLeastOnce))
        }
        // Cut the TCP connection while messages are in flight and queued behind the window.
        publisher.core.breakConnectionForTesting()
        for delivery in deliveries { try await within(15, "acknowledgement") { try await delivery.acknowledged() } }
        let seen = try await within(10, "reconnect seen in the state stream") {
            var sawReconnect = false
            var connectedCount = 0
            for await state in states {
                if case .waitingToReconnect = state { sawReconnect = true }
                if state.isConnected { connectedCount += 1 }
                if sawReconnect && connectedCount >= 2 { return true }
            }
            return false
        }
        #expect(seen)
        // At-least-once: every message arrives, resent ones possibly twice.
        let received = try await messages.first(2000, timeout: 15)
        var distinct = Set(received.map(\.payloadString))
        while distinct.count < 2000 {
            let more = try await messages.first(1)
            distinct.formUnion(more.map(\.payloadString))
        }
        #expect(distinct.count == 2000)
        #expect(publisher.statistics.connections == 2)
        await publisher.disconnect()
        await subscriber.disconnect()
    }

    @Test func offlineQueueIsBoundedAndDropsOldestQoS0First() async throws {
        // A subscriber with a persistent session is registered on a broker whose state survives a restart, so the
        // order of what the publisher sends later can be checked no matter when each client (re)connects.
        let state = try TemporaryDirectory(prefix: "blebridge-mqtt-db")
        // Writable for the `mosquitto` user the broker drops to when started as root.
        try FileManager.default.setAttributes([.posixPermissions: 0o777], ofItemAtPath: state.url.path)
        let port = try freeLoopbackPort()
        let persistence = Self.persistence(state)
        var subscriberSettings = MQTTConfiguration(
            broker: MQTTBrokerURL(host: "127.0.0.1", port: port), clientID: "queue-subscriber", cleanSession: false)
        subscriberSettings.reconnect = MQTTReconnectPolicy(initialDelay: .milliseconds(50))
        do {
            let first = try await MosquittoBroker.start(extraConfig: persistence, port: port)
            let subscriber = try await connectedClient(subscriberSettings)
            try await subscriber.subscribe(to: "q/#", qos: .exactlyOnce)
            await subscriber.disconnect()
            await first.stop()
        }

        var settings = MQTTConfiguration(broker: MQTTBrokerURL(host: "127.0.0.1", port: port))
        settings.offlineQueueCapacity = 4
        settings.reconnect = MQTTReconnectPolicy(initialDelay: .milliseconds(50), maximumDelay: .milliseconds(100))
        let client = try MQTTClient(configuration: settings)
        try client.start()  // nothing listens now: everything queues
        func send(_ name: String, _ qos: MQTTQoS) throws -> MQTTDelivery {
            try client.send(MQTTOutgoingMessage(topic: "q/\(name)", payload: Array(name.utf8), qos: qos))
        }
        let a1 = try send("a1", .atLeastOnce)
        let b0 = try send("b0", .atMostOnce)
        let c1 = try send("c1", .atLeastOnce)
        let d0 = try send("d0", .atMostOnce)
        let e1 = try send("e1", .atLeastOnce)  // full: drops b0
        let f1 = try send("f1", .atLeastOnce)  // drops d0
        let g2 = try send("g2", .exactlyOnce)  // no QoS 0 left: drops the oldest, a1
        for dropped in [b0, d0, a1] {
            await #expect {
                try await dropped.acknowledged()
            } throws: { error in
                (error as? MQTTError)?.code == .dropped
            }
        }
        var stats = client.statistics
        #expect(stats.droppedQoS0 == 2 && stats.droppedQoS1Or2 == 1 && stats.queued == 4)

        // The broker comes back with the subscriber's session; the survivors go out in order.
        let broker = try await MosquittoBroker.start(extraConfig: persistence, port: port)
        for delivery in [c1, e1, f1, g2] { try await within(10, "ack") { try await delivery.acknowledged() } }
        stats = client.statistics
        #expect(stats.queued == 0 && stats.acknowledged == 4)
        let subscriber = try MQTTClient(configuration: subscriberSettings)
        let messages = subscriber.messages()
        try await within(10, "subscriber reconnects") { try await subscriber.connect() }
        #expect(subscriber.connectionState == .connected(sessionPresent: true))
        let received = try await messages.first(4)
        #expect(received.map(\.topic) == ["q/c1", "q/e1", "q/f1", "q/g2"])
        #expect(received.map(\.qos) == [.atLeastOnce, .atLeastOnce, .atLeastOnce, .exactlyOnce])
        await subscriber.disconnect()
        await client.disconnect()
        _ = broker
    }
}
