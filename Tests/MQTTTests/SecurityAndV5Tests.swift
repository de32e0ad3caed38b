import Foundation
import TestSupport
import Testing

@testable import MQTT

@Suite struct TLSTests {
    /// A broker with a TLS listener using `certificates`; `requireClientCertificate` turns on mutual TLS.
    static func tlsBroker(_ certificates: TestCertificates, requireClientCertificate: Bool = false) async throws
        -> MosquittoBroker
    {
        let port = try freeLoopbackPort()
        return try await MosquittoBroker.start(
            extraConfig: """
                listener \(port) 127.0.0.1
                allow_anonymous true
                cafile \(certificates.caCertificate)
                certfile \(certificates.serverCertificate)
                keyfile \(certificates.serverKey)
                require_certificate \(requireClientCertificate)

                """, defaultListener: false, port: port)
    }

    static func tlsSettings(_ broker: MosquittoBroker, _ tls: MQTTTLSConfiguration) -> MQTTConfiguration {
        MQTTConfiguration(broker: MQTTBrokerURL(host: "127.0.0.1", port: broker.port, usesTLS: true), tls: tls)
    }

    @Test func verifiedConnectionRoundTrip() async throws {
        let certificates = try await TestCertificates(serverNames: ["IP:127.0.0.1", "DNS:localhost"])
        let broker = try await Self.tlsBroker(certificates)
        let client = try await connectedClient(
            Self.tlsSettings(broker, MQTTTLSConfiguration(caFile: certificates.caCertificate)))
        let messages = client.messages()
        try await client.subscribe(to: "tls/+")
        try await client.publish(to: "tls/a", payload: Array("secret".utf8), qos: .atLeastOnce)
        #expect(try await messages.first(1).map(\.payloadString) == ["secret"])
        await client.disconnect()
    }

    /// libmosquitto's own TLS loop (`mosquitto_loop`) watches the socket with select(2) and fails with
    /// MOSQ_ERR_INVAL ("Invalid function arguments provided") once the socket is numbered 1,024 or more: in a process
    /// holding that many descriptors (the parallel test run reached it) a TLS client never connected. The client
    /// polls instead; a child process that holds 1,100 descriptors first must still make its round trip.
    @Test func aClientWhoseSocketsAreNumberedPast1023StillWorks() async throws {
        let certificates = try await TestCertificates(serverNames: ["IP:127.0.0.1"])
        let broker = try await Self.tlsBroker(certificates)
        let child = try ChildProcess(
            executable: Fixtures.executable("bench-mqtt"),
            arguments: [
                "tls-roundtrip", "--port", "\(broker.port)", "--cafile", certificates.caCertificate,
                "--hold-descriptors", "1100",
            ])
        let status = try await child.waitForExit(timeout: 30)
        let output = child.stdout + child.stderr
        #expect(status == 0, "\(output)")
        // The sockets really were past select's limit, so the round trip went through the poll loop.
        let lowest = output.split(separator: "\n").first { $0.hasPrefix("sockets from ") }
            .flatMap { Int($0.dropFirst("sockets from ".count)) }
        #expect((lowest ?? 0) >= 1024, "\(output)")
        #expect(output.contains("round trip ok"), "\(output)")
    }

    @Test func hostnameMismatchFailsUnlessVerificationIsOff() async throws {
        let certificates = try await TestCertificates(serverNames: ["DNS:broker.example"])
        let broker = try await Self.tlsBroker(certificates)
        let strict = try MQTTClient(
            configuration: Self.tlsSettings(broker, MQTTTLSConfiguration(caFile: certificates.caCertificate)))
        await #expect {
            try await within(10, "strict connect") { try await strict.connect() }
        } throws: { error in
            guard let error = error as? MQTTError else { return false }
            return error.code == .library(8)  // MOSQ_ERR_TLS
                && error.description.contains("mqtts://127.0.0.1:\(broker.port)")
                && error.detail.contains("certificate verify failed")  // OpenSSL's words, from libmosquitto's log
        }
        #expect(strict.connectionState == .stopped)
        let relaxed = try await connectedClient(
            Self.tlsSettings(
                broker, MQTTTLSConfiguration(caFile: certificates.caCertificate, verifyHostname: false)))
        try await relaxed.publish(to: "tls/x", payload: [1], qos: .atLeastOnce)
        await relaxed.disconnect()
    }

    @Test func unknownCAIsRejected() async throws {
        let certificates = try await TestCertificates(serverNames: ["IP:127.0.0.1"])
        let other = try await TestCertificates(serverNames: ["IP:127.0.0.1"])
        let broker = try await Self.tlsBroker(certificates)
        let client = try MQTTClient(
            configuration: Self.tlsSettings(broker, MQTTTLSConfiguration(caFile: other.caCertificate)))
        await #expect(throws: MQTTError.self) {
            try await within(10, "connect with the wrong CA") { try await client.connect() }
        }
    }

    @Test func clientCertificateWhenTheBrokerRequiresOne() async throws {
        let certificates = try await TestCertificates(serverNames: ["IP:127.0.0.1"])
        let broker = try await Self.tlsBroker(certificates, requireClientCertificate: true)
        let withCertificate = try await connectedClient(
            Self.tlsSettings(
                broker,
                MQTTTLSConfiguration(
                    caFile: certificates.caCertificate, certificateFile: certificates.clientCertificate,
                    privateKeyFile: certificates.clientKey)))
        try await withCertificate.publish(to: "tls/mutual", payload: [1], qos: .atLeastOnce)
        await withCertificate.disconnect()
        let without = try MQTTClient(
            configuration: Self.tlsSettings(broker, MQTTTLSConfiguration(caFile: certificates.caCertificate)))
        await #expect(throws: MQTTError.self) {
            try await within(10, "connect without a client certificate") { try await without.connect() }
        }
    }

    @Test func missingCAFileIsAClearError() throws {
        let settings = MQTTConfiguration(
            broker: MQTTBrokerURL(host: "127.0.0.1", port: 1, usesTLS: true),
            tls: MQTTTLSConfiguration(caFile: "/nonexistent/ca.crt"))
        let client = try MQTTClient(configuration: settings)
        #expect {
            try client.start()
        } throws: { error in
            (error as? MQTTError)?.description.contains("/nonexistent/ca.crt") == true
        }
    }
}

@Suite struct AuthenticationTests {
    static func authBroker(_ directory: TemporaryDirectory) async throws -> MosquittoBroker {
        let passwords = try await makeMosquittoPasswordFile(in: directory, user: "bridge", password: "s3cret pass")
        let port = try freeLoopbackPort()
        return try await MosquittoBroker.start(
            extraConfig: """
                listener \(port) 127.0.0.1
                allow_anonymous false
                password_file \(passwords)

                """, defaultListener: false, port: port)
    }

    @Test(arguments: [MQTTProtocolVersion.v311, .v5])
    func passwordAcceptedFromConfigAndFile(version: MQTTProtocolVersion) async throws {
        let directory = try TemporaryDirectory(prefix: "blebridge-auth")
        let broker = try await Self.authBroker(directory)
        var settings = configuration(broker, version: version)
        settings.credentials = MQTTCredentials(username: "bridge", password: .literal("s3cret pass"))
        let literal = try await connectedClient(settings)
        try await literal.publish(to: "auth/ok", payload: [1], qos: .atLeastOnce)
        await literal.disconnect()

        let secretFile = directory.url.appendingPathComponent("mqtt-password")
        try "s3cret pass\n".write(to: secretFile, atomically: true, encoding: .utf8)
        settings.credentials = MQTTCredentials(username: "bridge", password: .file(secretFile.path))
        let fromFile = try await connectedClient(settings)
        try await fromFile.publish(to: "auth/ok", payload: [2], qos: .atLeastOnce)
        await fromFile.disconnect()
    }

    @Test(arguments: [
        (MQTTProtocolVersion.v311, MQTTReasonCode(rawValue: 5)),  // CONNACK "not authorised"
        (MQTTProtocolVersion.v5, MQTTReasonCode.notAuthorized),
    ])
    func wrongPasswordIsRefused(version: MQTTProtocolVersion, expected: MQTTReasonCode) async throws {
        let directory = try TemporaryDirectory(prefix: "blebridge-auth")
        let broker = try await Self.authBroker(directory)
        var settings = configuration(broker, version: version)
        settings.credentials = MQTTCredentials(username: "bridge", password: .literal("wrong"))
        let client = try MQTTClient(configuration: settings)
        do {
            try await within(10, "connect with a wrong password") { try await client.connect() }
            Issue.record("connected with a wrong password")
        } catch let error as MQTTError {
            #expect(error.code == .connectionRefused(expected), "\(error)")
            #expect(error.description.contains("connect to MQTT broker mqtt://127.0.0.1:\(broker.port)"))
            #expect(error.detail.lowercased().contains("authori"), "\(error)")
        }
        #expect(client.connectionState == .stopped)
    }

    @Test func unreadablePasswordFileIsAClearError() throws {
        var settings = MQTTConfiguration(broker: MQTTBrokerURL(host: "127.0.0.1", port: 1))
        settings.credentials = MQTTCredentials(username: "u", password: .file("/nonexistent/secret"))
        let client = try MQTTClient(configuration: settings)
        #expect {
            try client.start()
        } throws: { error in
            guard let error = error as? MQTTError else { return false }
            return error.code == .invalidConfiguration && error.description.contains("/nonexistent/secret")
                && error.detail.contains("No such file")
        }
    }
}

@Suite struct MQTT5Tests {
    @Test func requestResponseWithProperties() async throws {
        let broker = try await MosquittoBroker.start()
        let requester = try await connectedClient(configuration(broker))
        let responder = try await connectedClient(configuration(broker))
        let requests = responder.messages()
        let responses = requester.messages()
        try await responder.subscribe(to: "svc/request", qos: .atLeastOnce)
        try await requester.subscribe(to: "svc/response/+", qos: .atLeastOnce)

        let correlation: [UInt8] = [0, 1, 2, 0xFE, 0xFF]
        let properties = MQTTPublishProperties(
            payloadIsUTF8: true, messageExpiry: .seconds(120), contentType: "application/json",
            responseTopic: "svc/response/r1", correlationData: correlation,
            userProperties: [MQTTUserProperty("unit", "°C"), MQTTUserProperty("unit", "K"), MQTTUserProperty("", "")])
        try await requester.publish(
            to: "svc/request", payload: Array(#"{"q":1}"#.utf8), qos: .atLeastOnce, properties: properties)

        let request = try #require(try await requests.first(1).first)
        #expect(request.properties.contentType == "application/json")
        #expect(request.properties.responseTopic == "svc/response/r1")
        #expect(request.properties.correlationData == correlation)
        #expect(request.properties.userProperties == properties.userProperties)
        #expect(request.properties.payloadIsUTF8 == true)
        let expiry = try #require(request.properties.messageExpiry)
        #expect(expiry <= .seconds(120) && expiry >= .seconds(110))

        let responseTopic = try #require(request.properties.responseTopic)
        try await responder.publish(
            to: responseTopic, payload: Array(#"{"a":2}"#.utf8), qos: .atLeastOnce,
            properties: MQTTPublishProperties(correlationData: request.properties.correlationData))
        let response = try #require(try await responses.first(1).first)
        #expect(response.topic == "svc/response/r1" && response.payloadString == #"{"a":2}"#)
        #expect(response.properties.correlationData == correlation)
        #expect(response.properties.contentType == nil && response.properties.userProperties.isEmpty)
        await requester.disconnect()
        await responder.disconnect()
    }

    @Test func propertiesUnderMQTT311AreRejected() async throws {
        let broker = try await MosquittoBroker.start()
        let client = try await connectedClient(configuration(broker, version: .v311))
        await #expect {
            try await client.publish(
                to: "a", payload: [], properties: MQTTPublishProperties(contentType: "text/plain"))
        } throws: { error in
            (error as? MQTTError)?.detail == "properties need MQTT 5"
        }
        await client.disconnect()
    }

    @Test func brokerRejectionCarriesTheReasonCode() async throws {
        // An ACL that lets the client publish nowhere: MQTT 5 PUBACK says "Not authorized".
        let directory = try TemporaryDirectory(prefix: "blebridge-acl")
        let acl = directory.url.appendingPathComponent("acl")
        try "topic read #\n".write(to: acl, atomically: true, encoding: .utf8)
        let broker = try await MosquittoBroker.start(extraConfig: "acl_file \(acl.path)\n")
        let client = try await connectedClient(configuration(broker))
        await #expect {
            try await client.publish(to: "forbidden/topic", payload: [1], qos: .atLeastOnce)
        } throws: { error in
            guard let error = error as? MQTTError else { return false }
            return error.code == .rejected(.notAuthorized) && error.description.contains("forbidden/topic")
                && error.description.contains("Not authorized")
        }
        await client.disconnect()
    }
}

@Suite struct PacketSizeTests {
    // With max_packet_size 1000 and topic "big" (3 bytes), a QoS 1 PUBLISH under MQTT 5 is
    // 1 (type) + 2 (remaining length) + 2+3 (topic) + 2 (packet id) + 1 (no properties) + payload = 11 + payload.
    // (libmosquitto 2.0.11 and the broker leave the first byte out and would pass 990; libmosquitto then aborts the
    // process on 991 with a failed assert, which is why the client checks the exact size itself first.)
    static let limit = 1000
    static let largestPayload = limit - 11

    @Test func payloadAtTheBrokerMaximumAndOneOver() async throws {
        let broker = try await MosquittoBroker.start(extraConfig: "max_packet_size \(Self.limit)\n")
        let client = try await connectedClient(configuration(broker))
        let messages = client.messages()
        try await client.subscribe(to: "big", qos: .atLeastOnce)
        let largest = [UInt8](repeating: 0xAB, count: Self.largestPayload)
        try await client.publish(to: "big", payload: largest, qos: .atLeastOnce)
        #expect(try await messages.first(1).first?.payload == largest)
        // One byte more, and 50 more: the client knows the broker's maximum from the CONNACK and refuses to send.
        for extra in [1, 50] {
            let message = MQTTOutgoingMessage(
                topic: "big", payload: largest + [UInt8](repeating: 0, count: extra), qos: .atLeastOnce)
            #expect {
                try client.send(message)
            } throws: { error in
                guard let error = error as? MQTTError else { return false }
                return error.code == .library(25)  // MOSQ_ERR_OVERSIZE_PACKET
                    && error.detail.contains("Packet larger than supported by the server")
                    && error.detail.contains("a \(1000 + extra)-byte packet; the broker accepts at most 1000 bytes")
            }
        }
        // The same limit with properties counted in.
        let withProperties = MQTTOutgoingMessage(
            topic: "big", payload: [UInt8](repeating: 1, count: Self.largestPayload - 19), qos: .atLeastOnce,
            properties: MQTTPublishProperties(contentType: "text/plain", userProperties: [MQTTUserProperty("k", "v")]))
        #expect(withProperties.packetSize(isV5: true) == 1 + 2 + 5 + 2 + (1 + 13 + 7) + Self.largestPayload - 19)
        #expect(throws: MQTTError.self) { try client.send(withProperties) }
        #expect(client.connectionState.isConnected)
        await client.disconnect()
    }

    @Test func mqtt311OversizeIsDroppedByTheBroker() async throws {
        // Documented mosquitto behaviour: with message_size_limit, a 3.1.1 client's oversized PUBLISH is
        // acknowledged and silently dropped (MQTT 3.1.1 has no way to say no).
        let broker = try await MosquittoBroker.start(extraConfig: "message_size_limit 500\n")
        let client = try await connectedClient(configuration(broker, version: .v311))
        let messages = client.messages()
        try await client.subscribe(to: "big", qos: .atLeastOnce)
        try await client.publish(to: "big", payload: [UInt8](repeating: 1, count: 501), qos: .atLeastOnce)
        try await client.publish(to: "big", payload: [UInt8](repeating: 2, count: 500), qos: .atLeastOnce)
        let received = try await messages.first(1)
        #expect(received.first?.payload.count == 500)
        await client.disconnect()
    }
}
