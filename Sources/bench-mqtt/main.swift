// bench-mqtt: publish throughput of the MQTT target against a local broker (bench/mqtt.sh starts one).
//
//   bench-mqtt --port P [--count N] [--payload BYTES] [--qos 0,1] [--inflight WINDOW]
//       For each QoS: a subscriber client and a publisher client (both in this process) on one topic; the publisher
//       sends N messages as fast as the client takes them, the subscriber counts them. Prints messages per second
//       (first send to last receipt) and the process CPU time per message (getrusage: both clients together).
//   bench-mqtt will-child --port P --topic T
//       Test helper: connects with a last will on T, prints "connected" and waits to be killed.
//   bench-mqtt echo --port P
//       Test helper (MQTT 5 interop): answers each message on echo/request on its response topic, with the same
//       payload, correlation data and content type, the user properties plus ("echoed-by", "blebridge").
//   bench-mqtt burst --port P [--count N] [--payload BYTES] [--qos Q]
//       Test helper (a broker that drops us mid-write): prints "SIGPIPE: ignored" (or "SIGPIPE: default") as the
//       process starts, before any client exists; connects, prints "connected", publishes N messages of BYTES
//       at QoS Q as fast as the client takes them, prints "lost connection: <error>" when the connection goes and
//       "reconnecting (attempt A)" at the next attempt, then disconnects, prints "stopped" and exits 0. Exits 1 when
//       the connection is not lost within 20 s.
//   bench-mqtt tls-roundtrip --port P --cafile FILE [--hold-descriptors N]
//       Test helper (a process with many descriptors): opens N descriptors on /dev/null first, so that every socket
//       the client makes is numbered N or more; connects over TLS (mqtts, the broker's certificate checked against
//       FILE), subscribes, publishes at QoS 1 and waits for its own message. Prints "sockets from D" (the lowest
//       socket descriptor the client made), then "round trip ok", and exits 0; exits 1 with the error otherwise.
//
// Like every program that uses the MQTT client, it ignores SIGPIPE first (MQTTProcess.ignoreBrokenPipe()).
import MQTT

#if canImport(Glibc)
    import Glibc
#elseif canImport(Musl)
    import Musl
#endif

func argument(_ name: String, default value: String) -> String {
    let arguments = CommandLine.arguments
    guard let index = arguments.firstIndex(of: name), index + 1 < arguments.count else { return value }
    return arguments[index + 1]
}

func fail(_ message: String) -> Never {
    let line = "bench-mqtt: \(message)\n"
    _ = line.withCString { write(2, $0, strlen($0)) }
    exit(1)
}

func cpuSeconds() -> Double {
    var usage = rusage()
    getrusage(RUSAGE_SELF.rawValue, &usage)
    return Double(usage.ru_utime.tv_sec) + Double(usage.ru_utime.tv_usec) / 1e6 + Double(usage.ru_stime.tv_sec)
        + Double(usage.ru_stime.tv_usec) / 1e6
}

func format(_ value: Double, _ digits: Int) -> String {
    let scaled = (value * pow(10, Double(digits))).rounded()
    guard scaled.isFinite, scaled.magnitude < 1e15 else { return String(value) }
    var text = String(Int(scaled))
    guard digits > 0 else { return text }
    while text.count <= digits { text = "0" + text }
    text.insert(".", at: text.index(text.endIndex, offsetBy: -digits))
    return text
}

MQTTProcess.ignoreBrokenPipe()

/// Writes `line` and a newline to stdout at once (unbuffered: the tests read it while the process runs).
func say(_ line: String) {
    _ = "\(line)\n".withCString { write(1, $0, strlen($0)) }
}

guard let port = UInt16(argument("--port", default: "")) else { fail("--port is required") }
let broker = MQTTBrokerURL(host: "127.0.0.1", port: port)

if CommandLine.arguments.dropFirst().first == "will-child" {
    let topic = argument("--topic", default: "will/child")
    let configuration = MQTTConfiguration(
        broker: broker, clientID: "will-child-\(getpid())", protocolVersion: .v5, keepAlive: .seconds(5),
        will: MQTTWill(topic: topic, payload: Array("child \(getpid()) died".utf8), qos: .atLeastOnce))
    do {
        let client = try MQTTClient(configuration: configuration)
        try await client.connect()
        say("connected")
        while true { try await Task.sleep(for: .seconds(3600)) }
    } catch {
        fail("\(error)")
    }
}

if CommandLine.arguments.dropFirst().first == "tls-roundtrip" {
    let hold = Int(argument("--hold-descriptors", default: "0")) ?? 0
    var held: [Int32] = []
    while held.count < hold {
        let fd = open("/dev/null", O_RDONLY)
        guard fd >= 0 else { fail("cannot hold \(hold) descriptors: \(String(cString: strerror(errno)))") }
        held.append(fd)
    }
    let configuration = MQTTConfiguration(
        broker: MQTTBrokerURL(host: "127.0.0.1", port: port, usesTLS: true),
        tls: MQTTTLSConfiguration(caFile: argument("--cafile", default: "")))
    /// The socket descriptors the process holds (some may be inherited).
    func sockets() -> Set<Int32> {
        var out: Set<Int32> = []
        for fd in Int32(0)..<Int32(hold + 256) {
            var status = stat()
            if fstat(fd, &status) == 0 && (status.st_mode & S_IFMT) == S_IFSOCK { out.insert(fd) }
        }
        return out
    }
    let before = sockets()
    do {
        let client = try MQTTClient(configuration: configuration)
        try await client.connect()
        // The lowest-numbered socket the client made (the broker connection, libmosquitto's wake-up pair).
        say("sockets from \(sockets().subtracting(before).min() ?? -1)")
        let messages = client.messages()
        try await client.subscribe(to: "fd/+", qos: .atLeastOnce)
        try await client.publish(to: "fd/a", payload: Array("high".utf8), qos: .atLeastOnce)
        for await message in messages where message.payload == Array("high".utf8) { break }
        await client.disconnect()
        say("round trip ok")
        exit(0)
    } catch {
        fail("\(error)")
    }
}

if CommandLine.arguments.dropFirst().first == "echo" {
    do {
        let client = try MQTTClient(configuration: MQTTConfiguration(broker: broker, protocolVersion: .v5))
        try await client.connect()
        let requests = client.messages()
        try await client.subscribe(to: "echo/request", qos: .atLeastOnce)
        say("ready")
        for await request in requests {
            guard let responseTopic = request.properties.responseTopic else { continue }
            var properties = MQTTPublishProperties(
                contentType: request.properties.contentType, correlationData: request.properties.correlationData,
                userProperties: request.properties.userProperties)
            properties.userProperties.append(MQTTUserProperty("echoed-by", "blebridge"))
            try await client.publish(
                to: responseTopic, payload: request.payload, qos: .atLeastOnce, properties: properties)
        }
        exit(0)
    } catch {
        fail("\(error)")
    }
}

if CommandLine.arguments.dropFirst().first == "burst" {
    // Asked before any client exists: libmosquitto 2.0.11 also ignores SIGPIPE in mosquitto_new, 2.0.15 and later
    // do not, so only this shows that the process does it itself.
    var disposition = sigaction()
    sigaction(SIGPIPE, nil, &disposition)
    let ignored = disposition.__sigaction_handler.sa_handler.map { unsafeBitCast($0, to: Int.self) == 1 } ?? false
    say("SIGPIPE: \(ignored ? "ignored" : "default")")  // SIG_IGN is the handler 1
    let count = integerArgument("--count", default: 2000, in: 1...1_000_000)
    let payloadSize = integerArgument("--payload", default: 32_768, in: 0...(16 * 1024 * 1024))
    guard let qos = MQTTQoS(rawValue: integerArgument("--qos", default: 0, in: 0...2)) else { fail("--qos: 0, 1 or 2") }
    var configuration = MQTTConfiguration(
        broker: broker, clientID: "burst-\(getpid())", protocolVersion: .v5, offlineQueueCapacity: count)
    configuration.reconnect = MQTTReconnectPolicy(initialDelay: .milliseconds(50), maximumDelay: .milliseconds(200))
    do {
        let client = try MQTTClient(configuration: configuration)
        let states = client.connectionStates()
        try await client.connect()
        say("connected")
        let timeout = Task {
            try await Task.sleep(for: .seconds(20))
            fail("the connection was not lost within 20 s")
        }
        let message = MQTTOutgoingMessage(
            topic: "burst", payload: [UInt8](repeating: 0x42, count: payloadSize), qos: qos)
        let publisher = Task {
            for index in 0..<count {
                if Task.isCancelled { break }
                _ = try? client.send(message)
                if index % 16 == 15 { await Task.yield() }
            }
        }
        var lost = false
        watch: for await state in states {
            switch state {
            case .waitingToReconnect(_, _, let error) where !lost:
                say("lost connection: \(error)")
                lost = true
            case .connecting(let attempt) where lost:
                say("reconnecting (attempt \(attempt))")
                break watch
            default:
                continue
            }
        }
        publisher.cancel()
        timeout.cancel()
        await client.disconnect()
        say("stopped")
        exit(0)
    } catch {
        fail("\(error)")
    }
}

/// The value of `name` as an integer in `range`; exits with a usage message otherwise.
func integerArgument(_ name: String, default value: Int, in range: ClosedRange<Int>) -> Int {
    let text = argument(name, default: String(value))
    guard let n = Int(text), range.contains(n) else {
        fail("\(name): '\(text)' is not a whole number from \(range.lowerBound) to \(range.upperBound)")
    }
    return n
}

let count = integerArgument("--count", default: 200_000, in: 1...100_000_000)
let payloadSize = integerArgument("--payload", default: 100, in: 0...(256 * 1024 * 1024))
let inflight = integerArgument("--inflight", default: 100, in: 1...32_768)
let levels = argument("--qos", default: "0,1").split(separator: ",").compactMap { Int($0) }.compactMap(MQTTQoS.init)

func run(qos: MQTTQoS) async throws {
    let topic = "bench/qos\(qos.rawValue)"
    // The subscriber takes the benchmark's packets, and buffers all of them if its reader falls behind.
    let packetLimit = min(268_435_460, max(1_048_576, payloadSize + 1024))
    func configuration(_ name: String) -> MQTTConfiguration {
        MQTTConfiguration(
            broker: broker, clientID: "bench-\(name)-\(getpid())", protocolVersion: .v5,
            offlineQueueCapacity: count, maxInflightMessages: inflight, receiveBufferCapacity: count,
            maximumIncomingPacketSize: packetLimit,
            receiveBufferBytes: max(packetLimit, count * (payloadSize + topic.utf8.count)))
    }
    let subscriber = try MQTTClient(configuration: configuration("sub\(qos.rawValue)"))
    let publisher = try MQTTClient(configuration: configuration("pub\(qos.rawValue)"))
    try await subscriber.connect()
    try await publisher.connect()
    let messages = subscriber.messages()
    try await subscriber.subscribe(to: topic, qos: qos)

    let payload = [UInt8](repeating: 0x5A, count: payloadSize)
    let message = MQTTOutgoingMessage(topic: topic, payload: payload, qos: qos)
    let clock = ContinuousClock()
    let cpuBefore = cpuSeconds()
    let start = clock.now
    let receiver = Task {
        var received = 0
        for await _ in messages {
            received += 1
            if received == count { break }
        }
        return (received, clock.now)
    }
    var deliveries: [MQTTDelivery] = []
    deliveries.reserveCapacity(qos == .atMostOnce ? 0 : count)
    for _ in 0..<count {
        let delivery = try publisher.send(message)
        if qos != .atMostOnce { deliveries.append(delivery) }
    }
    let sent = clock.now
    for delivery in deliveries { try await delivery.acknowledged() }
    let acknowledged = clock.now

    let timeout = Task {
        try await Task.sleep(for: .seconds(60))
        await subscriber.disconnect()
    }
    let (received, lastReceipt) = await receiver.value
    timeout.cancel()
    let cpu = cpuSeconds() - cpuBefore
    let elapsed = lastReceipt - start
    let seconds = Double(elapsed.components.seconds) + Double(elapsed.components.attoseconds) / 1e18
    let sendSeconds = (sent - start) / .seconds(1)
    let ackSeconds = (acknowledged - start) / .seconds(1)
    let stats = publisher.statistics
    print(
        "QoS \(qos.rawValue): \(count) x \(payloadSize) B: \(format(Double(received) / seconds, 0)) msgs/s "
            + "(received \(received)/\(count) in \(format(seconds, 3)) s; send loop \(format(sendSeconds, 3)) s"
            + (qos == .atMostOnce ? "" : "; all acknowledged at \(format(ackSeconds, 3)) s")
            + "); client CPU \(format(cpu / Double(count) * 1e6, 2)) us/msg (publisher + subscriber, "
            + "process total \(format(cpu, 2)) s); dropped \(stats.droppedQoS0 + stats.droppedQoS1Or2), "
            + "receive dropped \(subscriber.statistics.receiveDropped)")
    await publisher.disconnect()
    await subscriber.disconnect()
    if received != count { fail("subscriber received \(received) of \(count)") }
}

do {
    for qos in levels { try await run(qos: qos) }
} catch {
    fail("\(error)")
}
