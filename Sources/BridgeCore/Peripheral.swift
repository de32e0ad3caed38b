// The peripheral role (MQTT → BLE): values from MQTT topics are encoded by the parser registry into the served
// characteristics (read, notified, indicated), a central's writes are decoded and published on the sink topic, and
// values can be broadcast as BTHome v2 service data. Bad input from either side gets a specific message and is
// dropped; the last good value stays.
import GATT
import Logging
import Synchronization

/// Serves the `peripheral:` section over a `BLEPeripheralHost`, fed by MQTT messages handed to `handle(_:)`.
public final class PeripheralService: Sendable {
    let config: PeripheralConfig
    let registry: GATTParserRegistry
    let host: any BLEPeripheralHost
    let send: @Sendable (BridgeOutgoingMessage) -> Void
    let eventTopic: String
    let qos: Int
    let maxPayload: Int
    let clock: any BridgeClock
    let logger: Logger
    let status: @Sendable () -> Bridge.Status?
    let changed: @Sendable () -> Void
    let bindings: [String: [Binding]]
    let characteristics: [String: PeripheralCharacteristicConfig]
    /// Each characteristic's parser, resolved once (nil: raw bytes).
    let parsers: [String: any GATTCharacteristicParser]
    let serviceOf: [String: BluetoothUUID]
    let state: Mutex<State>
    let wake: AsyncStream<Void>.Continuation
    let wakes: AsyncStream<Void>
    let server: (any LocalGATTServer)?

    enum Binding: Sendable {
        case characteristic(PeripheralCharacteristicConfig)
        case broadcast(BroadcastValueConfig)

        var source: PeripheralSource {
            switch self {
            case .characteristic(let c): return c.source ?? PeripheralSource(topic: "")
            case .broadcast(let b): return b.source
            }
        }
        var label: String {
            switch self {
            case .characteristic(let c): return "\(c.path) (\(c.uuid))"
            case .broadcast(let b): return "peripheral.broadcast \(b.field)"
            }
        }
    }

    struct State {
        var values: [String: [UInt8]] = [:]
        var registeredOn: String?
        var advertising = false
        var broadcasting = false
        var centrals: [BLEAddress] = []
        var subscribed: Set<String> = []
        var broadcastValues: [String: GATTValue] = [:]
        var broadcastDirty = false
        var packetID: UInt8 = 0
        var counter: UInt32 = 0
        var lastError: [String: (reason: String, at: Duration)] = [:]
        var lastRegistrationFailure: String?
        var counters = Counters()
    }

    /// Counters for `bridge/info`, health and tests.
    public struct Counters: Sendable, Equatable {
        /// Source messages taken.
        public var sourceMessages = 0
        /// Values encoded into a characteristic.
        public var valuesSet = 0
        /// Source values that could not be encoded (dropped).
        public var encodeErrors = 0
        /// Central writes published on a sink.
        public var writes = 0
        /// Central writes refused.
        public var writeErrors = 0
        /// Broadcast data updates.
        public var broadcasts = 0
    }

    /// A service for `config`.
    ///
    /// - Parameters:
    ///   - publish: sends a message to the broker (sink topics, `bridge/event`).
    ///   - status: the bridge's status, for the `bridge_status` preset (nil: not running a bridge).
    ///   - changed: called when what `info` says changes (registration, advertising, centrals, subscriptions).
    public init(
        config: PeripheralConfig, registry: GATTParserRegistry, host: any BLEPeripheralHost, topics: BridgeTopics,
        qos: Int, maxPayload: Int, clock: any BridgeClock, logger: Logger,
        status: @escaping @Sendable () -> Bridge.Status? = { nil }, changed: @escaping @Sendable () -> Void = {},
        publish: @escaping @Sendable (BridgeOutgoingMessage) -> Void
    ) {
        self.config = config
        self.registry = registry
        self.host = host
        self.send = publish
        self.eventTopic = topics.bridgeEvent
        self.qos = qos
        self.maxPayload = maxPayload
        self.clock = clock
        self.logger = logger.labelled(component: "peripheral")
        self.status = status
        self.changed = changed
        var bindings: [String: [Binding]] = [:]
        var characteristics: [String: PeripheralCharacteristicConfig] = [:]
        var serviceOf: [String: BluetoothUUID] = [:]
        var initial = State()
        for service in config.services {
            for c in service.characteristics {
                characteristics[c.id] = c
                serviceOf[c.id] = service.uuid
                initial.values[c.id] = c.initialValue
                if let s = c.source { bindings[s.topic, default: []].append(.characteristic(c)) }
            }
        }
        for v in config.broadcast?.values ?? [] { bindings[v.source.topic, default: []].append(.broadcast(v)) }
        self.bindings = bindings
        self.characteristics = characteristics
        parsers = characteristics.compactMapValues { c in c.parserName.flatMap { registry.parser(named: $0) } }
        self.serviceOf = serviceOf
        state = Mutex(initial)
        (wakes, wake) = AsyncStream<Void>.makeStream(bufferingPolicy: .bufferingNewest(1))
        if config.services.isEmpty {
            server = nil
        } else {
            let specs = config.services.map { service in
                LocalServiceSpec(
                    uuid: service.uuid,
                    characteristics: service.characteristics.map { c in
                        LocalCharacteristicSpec(
                            id: c.id, uuid: c.uuid, flags: c.flags, value: c.initialValue,
                            descriptors: c.userDescription.map {
                                [LocalDescriptorSpec(uuid: BluetoothUUID(UInt16(0x2901)), value: Array($0.utf8))]
                            } ?? [])
                    })
            }
            let events = EventSink()
            server = host.makeServer(
                services: specs, adapter: config.adapter, onWrite: { [events] in await events.write($0) },
                events: { [events] in events.event($0) })
            events.target.withLock { $0 = self }
        }
    }

    /// Forwards host callbacks to the service without a retain cycle (host → closure → service → server → host).
    final class EventSink: Sendable {
        let target = Mutex<PeripheralService?>(nil)
        func write(_ w: LocalWrite) async -> LocalWriteError? {
            guard let s = target.withLock({ $0 }) else { return .notPermitted("the bridge is shutting down") }
            return await s.handleWrite(w)
        }
        func event(_ e: LocalPeripheralEvent) { target.withLock { $0 }?.handleEvent(e) }
    }

    /// The topics to subscribe to.
    public var sourceTopics: [String] { config.sourceTopics }

    /// The counters so far.
    public var counters: Counters { state.withLock { $0.counters } }

    /// The value a characteristic holds now (by id).
    public func value(of characteristic: String) -> [UInt8]? { state.withLock { $0.values[characteristic] } }

    // MARK: Running

    /// Serves, advertises and broadcasts until cancelled; then unregisters everything and returns.
    public func run() async {
        await withTaskGroup(of: Void.self) { group in
            if let server {
                group.addTask { await server.run() }
                if config.advertise {
                    let advertiser = host.makeAdvertiser(
                        connectableAdvertisement, adapter: config.adapter,
                        events: { [weak self] in self?.handleEvent($0) })
                    group.addTask { await advertiser.run() }
                }
                if config.characteristics.contains(where: { $0.internalValue != nil }) {
                    group.addTask { await self.runStatus() }
                }
            }
            if config.broadcast != nil { group.addTask { await self.runBroadcast() } }
            await withTaskCancellationHandler {
                await waitForever()
            } onCancel: {
            }
            group.cancelAll()
        }
        wake.finish()
    }

    /// The connectable advertisement: the local name and as many service UUIDs as fit in 31 octets.
    var connectableAdvertisement: LocalAdvertisementSpec {
        var room = 31 - 3 - (2 + config.name.utf8.count)
        var short: [BluetoothUUID] = []
        var long: [BluetoothUUID] = []
        for u in config.advertisedServiceUUIDs {
            if u.shortValue != nil {
                let cost = short.isEmpty ? 4 : 2
                if cost <= room {
                    short.append(u)
                    room -= cost
                }
            }
        }
        for u in config.advertisedServiceUUIDs where u.shortValue == nil {
            let cost = long.isEmpty ? 18 : 16
            if cost <= room {
                long.append(u)
                room -= cost
            }
        }
        return LocalAdvertisementSpec(connectable: true, localName: config.name, serviceUUIDs: short + long)
    }

    /// Keeps the `bridge_status` characteristics current (every 5 s).
    func runStatus() async {
        while !Task.isCancelled {
            let s = status()
            for c in config.characteristics {
                guard let kind = c.internalValue else { continue }
                let bytes: [UInt8]
                switch kind {
                case "devices_online":
                    let n = UInt16(clamping: s?.devicesOnline ?? 0)
                    bytes = [UInt8(truncatingIfNeeded: n), UInt8(truncatingIfNeeded: n >> 8)]
                case "mqtt_connected": bytes = [(s?.mqttConnected ?? true) ? 1 : 0]
                default: bytes = Array((s?.text ?? "MQTT connected, peripheral only").utf8.prefix(512))
                }
                if state.withLock({ $0.values[c.id] }) != bytes { setValue(bytes, c) }
            }
            do { try await clock.sleep(until: clock.now + .seconds(5)) } catch { return }
        }
    }

    // MARK: MQTT → BLE

    /// Takes a message if it is on a source topic (true), encoding it into the characteristics and broadcast values
    /// bound to that topic.
    public func handle(_ message: BridgeIncomingMessage) -> Bool {
        guard let targets = bindings[message.topic] else { return false }
        state.withLock { $0.counters.sourceMessages += 1 }
        guard message.payload.count <= maxPayload else {
            for t in targets {
                fail(t, "payload of \(message.payload.count) bytes on \(message.topic) is over mqtt.max_payload")
            }
            return true
        }
        let json: JSONValue
        if let parsed = try? JSONReader.parse(message.payload) {
            json = parsed
        } else {
            json = .string(message.text.trimmingSpaces)
        }
        // Every broadcast value of one message goes into the next advertisement together (never half of them).
        var broadcastValues: [(String, GATTValue)] = []
        for target in targets {
            var value = json
            if let field = target.source.field {
                guard let v = lookup(json, field) else {
                    fail(target, "the message on \(message.topic) has no field '\(field)'")
                    continue
                }
                value = v
            }
            switch target {
            case .characteristic(let c):
                let parser = parsers[c.id]
                if parser == nil, target.source.field == nil {
                    // Raw bytes come as hex text; "12345678" or "0e00" must not be taken for a JSON number.
                    switch value {
                    case .int, .double: value = .string(message.text.trimmingSpaces)
                    default: break
                    }
                }
                switch encodePeripheralValue(value, parser: parser) {
                case .success(let bytes): setValue(bytes, c)
                case .failure(let e):
                    fail(target, "value from \(message.topic) not served: \(e.reason)")
                }
            case .broadcast(let b):
                var v = value
                if case .string(let s) = value {
                    if let d = Double(s) {
                        v = .double(d)
                    } else if ["on", "true"].contains(s.lowercased()) {
                        v = .bool(true)
                    } else if ["off", "false"].contains(s.lowercased()) {
                        v = .bool(false)
                    }
                }
                // Checked now, so a bad value never reaches (and never blocks) the broadcast.
                var probe = GATTReading()
                probe.append(b.field, v.gattValue)
                do {
                    _ = try BTHomeEncoder.encode(probe)
                } catch {
                    fail(target, "value from \(message.topic) not broadcast: \(error)")
                    continue
                }
                broadcastValues.append((b.field, v.gattValue))
            }
        }
        if !broadcastValues.isEmpty {
            state.withLock {
                for (field, value) in broadcastValues { $0.broadcastValues[field] = value }
                $0.broadcastDirty = true
            }
            wake.yield()
        }
        return true
    }

    /// `a.b.c` in nested objects.
    func lookup(_ value: JSONValue, _ path: String) -> JSONValue? {
        var current = value
        for key in path.split(separator: ".") {
            guard case .object(let fields) = current, let next = fields.first(where: { $0.0 == key })?.1 else {
                return nil
            }
            current = next
        }
        return current
    }

    func setValue(_ bytes: [UInt8], _ c: PeripheralCharacteristicConfig) {
        state.withLock {
            $0.values[c.id] = bytes
            $0.counters.valuesSet += 1
        }
        server?.setValue(bytes, characteristic: c.id)
    }

    /// Logs a dropped value when its reason is new for that binding, and again at most once a minute (not once per
    /// message at 100 Hz); every one is counted.
    func fail(_ target: Binding, _ reason: String) {
        let key: String
        switch target {
        case .characteristic(let c): key = c.id
        case .broadcast(let b): key = "broadcast.\(b.field)"
        }
        let now = clock.now
        let dropped = state.withLock { s -> Int? in
            s.counters.encodeErrors += 1
            if let last = s.lastError[key], last.reason == reason, now - last.at < .seconds(60) { return nil }
            s.lastError[key] = (reason, now)
            return s.counters.encodeErrors
        }
        if let dropped {
            logger.warning("\(target.label): \(reason); the last good value stays (\(dropped) dropped so far)")
        }
    }

    // MARK: BLE → MQTT

    func handleWrite(_ w: LocalWrite) async -> LocalWriteError? {
        guard let c = characteristics[w.characteristic] else {
            return .notPermitted("no characteristic \(w.characteristic)")
        }
        guard let sink = c.sink else { return .notPermitted("\(c.path) is not writable") }
        let stored = state.withLock { $0.values[c.id] ?? [] }
        guard w.offset <= stored.count else {
            return reject(c, .invalidOffset("offset \(w.offset) is past the end (\(stored.count) octets)"))
        }
        let bytes = w.offset == 0 ? w.value : Array(stored.prefix(w.offset)) + w.value
        let decoded: JSONValue
        if let parser = parsers[c.id] {
            do {
                decoded = JSONValue(.object(try parser.decode(bytes, context: GATTDecodeContext())))
            } catch {
                switch error {
                case .truncated, .invalidLength:
                    return reject(c, .invalidLength("\(parser.name): \(error)"))
                default:
                    return reject(c, .valueNotAllowed("\(parser.name): \(error)"))
                }
            }
        } else {
            decoded = .object([("raw", .string(hexString(bytes)))])
        }
        state.withLock {
            $0.values[c.id] = bytes
            $0.counters.writes += 1
        }
        send(BridgeOutgoingMessage(topic: sink, payload: decoded.bytes, qos: qos, retain: false))
        logger.debug("\(c.path): a central wrote \(hexString(bytes)); published on \(sink)")
        return nil
    }

    func reject(_ c: PeripheralCharacteristicConfig, _ error: LocalWriteError) -> LocalWriteError {
        state.withLock { $0.counters.writeErrors += 1 }
        logger.warning("\(c.path) (\(c.uuid)): a central's write was refused: \(error); nothing published")
        return error
    }

    func handleEvent(_ e: LocalPeripheralEvent) {
        var data: [(String, JSONValue)] = []
        let type: String
        switch e {
        case .registered(let adapter):
            state.withLock {
                $0.registeredOn = adapter
                $0.lastRegistrationFailure = nil
            }
            logger.info("GATT application registered on \(adapter)")
            type = "peripheral_registered"
            data = [("adapter", .string(adapter))]
        case .unregistered(let reason):
            state.withLock {
                $0.registeredOn = nil
                $0.centrals = []
                $0.subscribed = []
            }
            logger.info("GATT application not registered: \(reason)")
            type = "peripheral_unregistered"
            data = [("reason", .string(reason))]
        case .registrationFailed(let reason):
            // Retried with backoff for as long as it fails: said once per distinct reason, then at debug level.
            let key =
                reason.indices.first(where: { reason[$0...].hasPrefix("; retrying") }).map { String(reason[..<$0]) }
                ?? reason
            let repeated = state.withLock { s -> Bool in
                defer { s.lastRegistrationFailure = key }
                return s.lastRegistrationFailure == key
            }
            if repeated {
                logger.debug("GATT application registration failed again: \(reason)")
            } else {
                logger.warning("GATT application registration failed: \(reason); retrying until it succeeds")
            }
            return
        case .advertising(let broadcast):
            state.withLock { if broadcast { $0.broadcasting = true } else { $0.advertising = true } }
            logger.info(broadcast ? "broadcasting BTHome data" : "advertising as '\(config.name)'")
            changed()
            return
        case .advertisingStopped(let broadcast, let reason):
            state.withLock { if broadcast { $0.broadcasting = false } else { $0.advertising = false } }
            logger.info("\(broadcast ? "broadcast" : "advertisement") stopped: \(reason)")
            changed()
            return
        case .centralConnected(let a):
            let new = state.withLock { s -> Bool in
                if s.centrals.contains(a) { return false }
                s.centrals.append(a)
                return true
            }
            guard new else { return }
            logger.info("central \(a) connected")
            type = "central_connected"
            data = [("address", .string(a.text))]
        case .centralDisconnected(let a):
            let known = state.withLock { s -> Bool in
                guard let i = s.centrals.firstIndex(of: a) else { return false }
                s.centrals.remove(at: i)
                return true
            }
            guard known else { return }
            logger.info("central \(a) disconnected")
            type = "central_disconnected"
            data = [("address", .string(a.text))]
        case .subscribed(let id, let central):
            state.withLock { _ = $0.subscribed.insert(id) }
            type = "central_subscribed"
            if let central { data.append(("address", .string(central.text))) }
            data += characteristicFields(id)
        case .unsubscribed(let id):
            state.withLock { _ = $0.subscribed.remove(id) }
            type = "central_unsubscribed"
            data = characteristicFields(id)
        }
        changed()
        send(
            BridgeOutgoingMessage(
                topic: eventTopic, payload: JSONValue.object([("type", .string(type)), ("data", .object(data))]).bytes,
                qos: 0))
    }

    func characteristicFields(_ id: String) -> [(String, JSONValue)] {
        guard let c = characteristics[id] else { return [("characteristic", .string(id))] }
        var out: [(String, JSONValue)] = []
        if let s = serviceOf[id] { out.append(("service", .string(s.description))) }
        out.append(("characteristic", .string(c.uuid.description)))
        return out
    }

    // MARK: Broadcast

    func runBroadcast() async {
        guard let b = config.broadcast else { return }
        var advertiser: (any LocalAdvertiser)?
        var advertiserTask: Task<Void, Never>?
        var last: Duration?
        defer { advertiserTask?.cancel() }
        for await _ in wakes {
            if Task.isCancelled { break }
            if let last, clock.now - last < b.interval {
                do { try await clock.sleep(until: last + b.interval) } catch { break }
            }
            guard let spec = await broadcastAdvertisement(b) else { continue }
            last = clock.now
            if let advertiser {
                advertiser.update(spec)
            } else {
                let a = host.makeAdvertiser(
                    spec, adapter: config.adapter, events: { [weak self] in self?.handleEvent($0) })
                advertiser = a
                advertiserTask = Task { await a.run() }
            }
        }
        if let advertiserTask {
            advertiserTask.cancel()
            await advertiserTask.value
        }
    }

    /// The BTHome advertisement for the values now (nil when none has arrived, or encryption has no address yet).
    func broadcastAdvertisement(_ b: BroadcastConfig) async -> LocalAdvertisementSpec? {
        var mac: String?
        if b.bindKey != nil {
            mac = await host.adapterAddress(config.adapter)
            if mac == nil {
                logger.warning("broadcast: no adapter address yet for the encryption nonce; waiting")
                return nil
            }
        }
        let wall = clock.wallClock
        let taken = state.withLock { s -> (GATTReading, UInt8, UInt32)? in
            guard s.broadcastDirty else { return nil }
            s.broadcastDirty = false
            var reading = GATTReading()
            for v in b.values { if let value = s.broadcastValues[v.field] { reading.append(v.field, value) } }
            guard !reading.fields.isEmpty else { return nil }
            s.packetID &+= 1
            // The encryption counter only grows, across restarts too: it starts from the wall clock.
            s.counter = max(s.counter &+ 1, UInt32(clamping: Int64(max(0, wall))))
            s.counters.broadcasts += 1
            return (reading, s.packetID, s.counter)
        }
        guard let (reading, packetID, counter) = taken else { return nil }
        let payload: [UInt8]
        do {
            if let key = b.bindKey, let mac {
                guard let cipher = Bridge.cipher else {
                    logger.error("broadcast: no AES-CCM cipher in this build; nothing broadcast")
                    return nil
                }
                payload = try BTHomeEncoder.encodeEncrypted(
                    try BTHomeEncoder.objects(for: reading), key: key, mac: mac, counter: counter, cipher: cipher)
            } else {
                var withID = GATTReading()
                withID.append("packet_id", .int(Int64(packetID)))
                for f in reading.fields { withID.append(f.name, f.value) }
                payload = try BTHomeEncoder.encode(try BTHomeEncoder.objects(for: withID))
            }
        } catch {
            logger.warning("broadcast: cannot encode \(reading.fields.map(\.name)): \(error)")
            return nil
        }
        return LocalAdvertisementSpec(
            connectable: false, localName: b.name, serviceData: [BluetoothUUID(UInt16(0xFCD2)): payload])
    }

    // MARK: Info

    /// What metrics and health show: registration, advertising, centrals, counters.
    public struct Snapshot: Sendable, Equatable {
        /// Registered with bluetoothd.
        public var registered: Bool
        /// The connectable advertisement is on the air.
        public var advertising: Bool
        /// The BTHome broadcast is on the air.
        public var broadcasting: Bool
        /// Centrals connected.
        public var centrals: Int
        /// Characteristics with notifications or indications on.
        public var notifying: Int
        /// The counters.
        public var counters: Counters
    }

    /// The state now.
    public var snapshot: Snapshot {
        state.withLock {
            Snapshot(
                registered: $0.registeredOn != nil, advertising: $0.advertising, broadcasting: $0.broadcasting,
                centrals: $0.centrals.count, notifying: $0.subscribed.count, counters: $0.counters)
        }
    }

    /// `bridge/health`'s `peripheral` object.
    var healthJSON: JSONValue {
        let s = snapshot
        return .object([
            ("registered", .bool(s.registered)), ("advertising", .bool(s.advertising)),
            ("broadcasting", .bool(s.broadcasting)), ("centrals", .int(Int64(s.centrals))),
            ("notifying", .int(Int64(s.notifying))), ("values_set", .int(Int64(s.counters.valuesSet))),
            ("encode_errors", .int(Int64(s.counters.encodeErrors))), ("writes", .int(Int64(s.counters.writes))),
            ("write_errors", .int(Int64(s.counters.writeErrors))), ("broadcasts", .int(Int64(s.counters.broadcasts))),
        ])
    }

    /// `bridge/info`'s `peripheral` object: services, centrals, advertising state, counters.
    public var info: JSONValue {
        let s = state.withLock { $0 }
        var fields: [(String, JSONValue)] = [
            ("adapter", s.registeredOn.map(JSONValue.string) ?? (config.adapter.map(JSONValue.string) ?? .null)),
            ("registered", .bool(s.registeredOn != nil)),
            ("advertising", .bool(s.advertising)),
            ("name", .string(config.name)),
        ]
        fields.append(
            (
                "services",
                .array(
                    config.services.map { service in
                        var f: [(String, JSONValue)] = [("uuid", .string(service.uuid.description))]
                        if let n = service.name { f.append(("name", .string(n))) }
                        f.append(
                            (
                                "characteristics",
                                .array(
                                    service.characteristics.map { c in
                                        var cf: [(String, JSONValue)] = [
                                            ("uuid", .string(c.uuid.description)),
                                            ("flags", .array(c.flags.map(JSONValue.string))),
                                        ]
                                        if let p = c.parserName { cf.append(("parser", .string(p))) }
                                        if let src = c.source { cf.append(("source", .string(src.description))) }
                                        if let sink = c.sink { cf.append(("sink", .string(sink))) }
                                        cf.append(("notifying", .bool(s.subscribed.contains(c.id))))
                                        return .object(cf)
                                    })
                            ))
                        return .object(f)
                    })
            ))
        fields.append(("centrals", .array(s.centrals.map { .string($0.text) })))
        if let b = config.broadcast {
            fields.append(
                (
                    "broadcast",
                    .object([
                        ("active", .bool(s.broadcasting)), ("encrypted", .bool(b.bindKey != nil)),
                        ("values", .array(b.values.map { .string($0.field) })),
                        ("payload_octets", .int(Int64(b.payloadLength))),
                    ])
                ))
        }
        fields.append(
            (
                "counters",
                .object([
                    ("source_messages", .int(Int64(s.counters.sourceMessages))),
                    ("values_set", .int(Int64(s.counters.valuesSet))),
                    ("encode_errors", .int(Int64(s.counters.encodeErrors))),
                    ("writes", .int(Int64(s.counters.writes))), ("write_errors", .int(Int64(s.counters.writeErrors))),
                    ("broadcasts", .int(Int64(s.counters.broadcasts))),
                ])
            ))
        return .object(fields)
    }
}
