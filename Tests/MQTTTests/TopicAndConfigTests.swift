import Testing

@testable import MQTT

@Suite struct TopicTests {
    static let matchCases: [(filter: String, topic: String, matches: Bool)] = [
        ("a/b/c", "a/b/c", true),
        ("a/b/c", "a/b", false),
        ("a/b", "a/b/c", false),
        ("a/+/c", "a/b/c", true),
        ("a/+/c", "a//c", true),
        ("a/+", "a/", true),
        ("a/+", "a", false),
        ("+", "a", true),
        ("+", "", true),
        ("+", "/a", false),
        ("+/+", "/a", true),
        ("/+", "/a", true),
        ("a/#", "a", true),
        ("a/#", "a/b/c/d", true),
        ("a/#", "a/", true),
        ("a/#", "ab", false),
        ("#", "a/b/c", true),
        ("#", "/", true),
        ("#", "$SYS/broker/uptime", false),
        ("+/broker/uptime", "$SYS/broker/uptime", false),
        ("$SYS/#", "$SYS/broker/uptime", true),
        ("$SYS/+/uptime", "$SYS/broker/uptime", true),
        ("a/$SYS", "a/$SYS", true),
        ("+/$x", "a/$x", true),
        ("a/b/#", "a/b", true),
        ("a/+/#", "a/b", true),
        ("a/+/#", "a", false),
        ("A/b", "a/b", false),
        ("sport/tennis/+", "sport/tennis/player1", true),
        ("sport/tennis/+", "sport/tennis/player1/ranking", false),
        ("sport/+", "sport", false),
    ]

    @Test func matchingFollowsTheSpecification() {
        for item in Self.matchCases {
            #expect(
                MQTTTopic.matches(filter: item.filter, topic: item.topic) == item.matches,
                "\(item.filter) vs \(item.topic)")
        }
    }

    @Test func matchingAgreesWithLibmosquitto() {
        let filters = Self.matchCases.map(\.filter) + ["#", "+/+/+", "a/+/+", "+/b/#", "$SYS/+", "/#", "//", "+//+"]
        let topics = Self.matchCases.map(\.topic) + ["", "/", "//", "a//b", "$SYS", "$other/a/b", "a/b/c/"]
        var compared = 0
        for filter in filters {
            for topic in topics where !topic.isEmpty {
                guard let library = Mosquitto.topicMatches(filter: filter, topic: topic) else { continue }
                #expect(MQTTTopic.matches(filter: filter, topic: topic) == library, "\(filter) vs \(topic)")
                compared += 1
            }
        }
        #expect(compared > 300)
    }

    @Test func filterValidationAgreesWithLibmosquitto() {
        let filters = [
            "a", "a/b", "+", "#", "a/+", "a/#", "+/+", "/#", "a/+/b", "", "a#", "a/#/b", "#/a", "a+", "a/b+", "+a",
            "a/+b/c", "##", "++", "a//b", "/", "$SYS/#", "a/b/#/", "sport/tennis#",
        ]
        // The one deliberate difference: libmosquitto's check accepts "", the specification (4.7.3) does not.
        #expect(throws: MQTTError.self) { try MQTTTopic.validateFilter("") }
        for filter in filters where !filter.isEmpty {
            var ours = true
            do { try MQTTTopic.validateFilter(filter) } catch { ours = false }
            #expect(ours == Mosquitto.isValidFilter(filter), "filter \"\(filter)\"")
        }
        for name in ["a", "a/b", "/", "a/+", "a/#", "+", "#", "$SYS/x", "a b"] {
            var ours = true
            do { try MQTTTopic.validateName(name) } catch { ours = false }
            #expect(ours == Mosquitto.isValidTopicName(name), "topic \"\(name)\"")
        }
    }

    @Test func invalidFilterErrorNamesTheFilter() {
        #expect {
            try MQTTTopic.validateFilter("a/#/b")
        } throws: { error in
            guard let error = error as? MQTTError else { return false }
            return error.code == .invalidTopic && error.description.contains("a/#/b")
        }
    }
}

@Suite struct ConfigurationTests {
    @Test func parsesBrokerURLs() throws {
        let plain = try MQTTBrokerURL(parsing: "mqtt://broker.local")
        #expect(plain == MQTTBrokerURL(host: "broker.local", port: 1883, usesTLS: false))
        let tls = try MQTTBrokerURL(parsing: "mqtts://10.0.0.2:9883/")
        #expect(tls == MQTTBrokerURL(host: "10.0.0.2", port: 9883, usesTLS: true))
        #expect(try MQTTBrokerURL(parsing: "MQTTS://h").port == 8883)
        let v6 = try MQTTBrokerURL(parsing: "mqtt://[::1]:1884")
        #expect(v6.host == "::1" && v6.port == 1884)
        #expect(v6.description == "mqtt://[::1]:1884")
    }

    @Test(arguments: [
        ("http://host", "scheme"), ("host:1883", "expected"), ("mqtt://", "missing host"),
        ("mqtt://host:0", "port"), ("mqtt://host:70000", "port"), ("mqtt://host:abc", "port"),
        ("mqtt://user:pw@host", "user name"), ("mqtt://host/path", "path"), ("mqtt://::1", "IPv6"),
        ("mqtt://[::1", "IPv6"), ("mqtt://ho st", "character"),
    ])
    func rejectsBadBrokerURLs(text: String, mentions: String) {
        #expect {
            try MQTTBrokerURL(parsing: text)
        } throws: { error in
            guard let error = error as? MQTTError else { return false }
            return error.code == .invalidURL && error.description.contains(mentions)
                && error.description.contains(text)
        }
    }

    @Test func validationNamesTheField() {
        let broker = MQTTBrokerURL(host: "h")
        let cases: [(MQTTConfiguration, String)] = [
            (MQTTConfiguration(broker: broker, cleanSession: false), "cleanSession"),
            (MQTTConfiguration(broker: broker, clientID: ""), "clientID"),
            (MQTTConfiguration(broker: broker, keepAlive: .seconds(1)), "keepAlive"),
            (MQTTConfiguration(broker: broker, offlineQueueCapacity: 0), "offlineQueueCapacity"),
            (
                MQTTConfiguration(broker: broker, reconnect: MQTTReconnectPolicy(maximumDelay: .seconds(Int64.max))),
                "reconnect"
            ),
            (MQTTConfiguration(broker: broker, maxInflightMessages: 0), "maxInflightMessages"),
            (MQTTConfiguration(broker: broker, tls: MQTTTLSConfiguration(caFile: "/x")), "tls"),
            (
                MQTTConfiguration(broker: broker, will: MQTTWill(topic: "a/+", payload: [])),
                "will.topic"
            ),
            (
                MQTTConfiguration(
                    broker: broker, protocolVersion: .v311,
                    will: MQTTWill(topic: "a", payload: [], properties: .init(contentType: "text/plain"))),
                "will.properties"
            ),
        ]
        for (configuration, field) in cases {
            #expect(throws: MQTTError.self) { try configuration.validate() }
            do {
                try configuration.validate()
            } catch {
                #expect(error.detail.hasPrefix(field), "\(error)")
            }
        }
        #expect(throws: Never.self) { try MQTTConfiguration(broker: broker).validate() }
    }

    @Test func reconnectDelayDoublesUpToTheCap() {
        let policy = MQTTReconnectPolicy(initialDelay: .milliseconds(100), maximumDelay: .seconds(1))
        let delays = (1...7).map { policy.delay(forAttempt: $0) }
        #expect(
            delays == [
                .milliseconds(100), .milliseconds(200), .milliseconds(400), .milliseconds(800), .seconds(1),
                .seconds(1), .seconds(1),
            ])
    }

    @Test func offlineQueueDropsOldestQoS0First() {
        var queue = OutgoingQueue()
        func item(_ topic: String, _ qos: MQTTQoS) -> QueuedPublish {
            QueuedPublish(message: MQTTOutgoingMessage(topic: topic, payload: [], qos: qos), completion: Completion())
        }
        queue.append(item("q1-a", .atLeastOnce))
        queue.append(item("q0-a", .atMostOnce))
        queue.append(item("q0-b", .atMostOnce))
        queue.append(item("q1-b", .atLeastOnce))
        #expect(queue.removeOldestQoS0()?.message.topic == "q0-a")
        #expect(queue.count == 3)
        #expect(queue.removeFirst()?.message.topic == "q1-a")
        queue.prepend([item("front", .exactlyOnce)])
        #expect(queue.removeAll().map(\.message.topic) == ["front", "q0-b", "q1-b"])
        #expect(queue.isEmpty)
    }

    @Test func offlineQueueMatchesAPlainArrayUnderEveryOperation() {
        // The queue keeps a cursor and a count to stay O(1) per operation; a plain array is the model it must match.
        var queue = OutgoingQueue()
        var model: [QueuedPublish] = []
        var generator = SystemRandomNumberGenerator()
        var serial = 0
        func item(_ qos: MQTTQoS) -> QueuedPublish {
            serial += 1
            return QueuedPublish(
                message: MQTTOutgoingMessage(topic: "t/\(serial)", payload: [], qos: qos), completion: Completion())
        }
        for step in 0..<20_000 {
            switch Int.random(in: 0..<10, using: &generator) {
            case 0..<5:
                // Long runs of QoS 1 (a full window), with some QoS 0 between them.
                let next = item(Int.random(in: 0..<4, using: &generator) == 0 ? .atMostOnce : .atLeastOnce)
                queue.append(next)
                model.append(next)
            case 5:
                let expected = model.firstIndex { $0.message.qos == .atMostOnce }.map { model.remove(at: $0) }
                #expect(queue.removeOldestQoS0()?.message.topic == expected?.message.topic, "step \(step)")
            case 6, 7, 8:
                // Often enough that the queue compacts its storage (after 4,096 removals from the front).
                let expected = model.isEmpty ? nil : model.removeFirst()
                #expect(queue.removeFirst()?.message.topic == expected?.message.topic, "step \(step)")
            default:
                if Int.random(in: 0..<50, using: &generator) == 0 {
                    let front = [item(.atMostOnce), item(.atLeastOnce)]
                    queue.prepend(front)
                    model.insert(contentsOf: front, at: 0)
                }
            }
            #expect(queue.count == model.count)
        }
        #expect(queue.removeAll().map(\.message.topic) == model.map(\.message.topic))
    }

    @Test func reasonCodesUseLibmosquittoText() {
        #expect(MQTTReasonCode.badUserNameOrPassword.description == "Bad User Name or Password (0x86)")
        #expect(!MQTTReasonCode.notAuthorized.isSuccess)
        #expect(MQTTReasonCode.noMatchingSubscribers.isSuccess)
    }
}
