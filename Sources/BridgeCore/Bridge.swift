// The bridge: BLE devices in, MQTT out, commands back. It owns its device sessions and returns from `run()` only
// after shutting them down in order. All I/O goes through the ports in Ports.swift.
import GATT
import Logging
import Synchronization

/// The bridge engine.
///
/// Make it with a configuration and the ports, then `await run()`; cancel the task to shut down (devices are
/// disconnected on purpose, availability goes offline, `bridge/state` goes offline). Safe to use from any task.
public final class Bridge: Sendable {
    let central: any BLECentral
    let mqtt: any MQTTTransport
    let clock: any BridgeClock
    let logger: Logger
    let gatewayName: String
    let engine: Mutex<EngineState>
    let started: Duration
    let processStatistics: @Sendable () -> [(String, JSONValue)]
    let configSource: (@Sendable () async -> Result<BridgeConfig, ConfigErrors>)?
    let store: (any BridgeStateStore)?
    /// The peripheral role, when the configuration has a `peripheral:` section and a host was given.
    public let peripheral: PeripheralService?
    /// Multi-gateway mode's coordination (nil: a single gateway).
    let coordination: GatewayCoordination?
    /// Multi-gateway mode: what has been published for passive devices lately (nil: a single gateway).
    let passiveReadings: PassiveReadings?

    struct EngineState {
        var config: BridgeConfig
        var topics: BridgeTopics
        var devices: [String: DeviceRecord] = [:]
        var byAddress: [BLEAddress: DeviceRecord] = [:]
        var order: [String] = []
        var slots: [String: Int] = [:]
        /// Connects in progress, by adapter (`Bridge.connectsPerAdapter`).
        var connectPermits: [String: AsyncPermits] = [:]
        var adapters: [BLEAdapterInfo] = []
        var mqttConnected = false
        var bluetoothdRunning = false
        var scans: [UInt64: ScanCollector] = [:]
        var nextScanID: UInt64 = 0
        var shuttingDown = false
        var counters = BridgeCounters()

        /// The powered adapters `bluetooth.adapters` allows.
        var usableAdapters: [BLEAdapterInfo] { Bridge.usable(adapters, allowed: config.bluetooth.adapters) }
        var requestTail: Task<Void, Never>?
        var heartbeat = ContinuousClock.now
        var lastMQTTFailure: String?
        var scanning: Set<String> = []
        /// The command topics (and the rest of `subscribeCommands`) are subscribed: until then `bridge/state`
        /// online waits, so that a client that acts on it is heard (`subscribeCommands` says it when connected).
        var commandsSubscribed = false
        /// The device states to publish again after Home Assistant's birth (`resendStatesLater`).
        var stateResend: Task<Void, Never>?
    }

    /// Counters for `bridge/health` and metrics.
    public struct BridgeCounters: Sendable, Equatable {
        /// Notifications received.
        public var notifications = 0
        /// Advertisements received.
        public var advertisements = 0
        /// Values decoded.
        public var decoded = 0
        /// Values a parser rejected.
        public var decodeErrors = 0
        /// State messages published.
        public var statePublishes = 0
        /// Multi-gateway mode: passive readings another gateway had published already (not published again).
        public var duplicatesSuppressed = 0
        /// Commands handled.
        public var commands = 0
        /// Reconnects by error name.
        public var reconnects: [String: Int] = [:]
    }

    /// A bridge over `central` and `mqtt` with `config`.
    ///
    /// - Parameters:
    ///   - gatewayName: names this bridge in Home Assistant (`via_device`) and `bridge/info` (the host name).
    public init(
        config: BridgeConfig, central: any BLECentral, mqtt: any MQTTTransport, clock: any BridgeClock,
        logger: Logger, gatewayName: String = "blebridge",
        processStatistics: @escaping @Sendable () -> [(String, JSONValue)] = { [] },
        configSource: (@Sendable () async -> Result<BridgeConfig, ConfigErrors>)? = nil,
        store: (any BridgeStateStore)? = nil, peripheralHost: (any BLEPeripheralHost)? = nil
    ) {
        self.store = store
        self.processStatistics = processStatistics
        self.configSource = configSource
        self.central = central
        self.mqtt = mqtt
        self.clock = clock
        self.logger = Bridge.forwarding(logger, to: mqtt, config: config).labelled(component: "bridge")
        self.gatewayName = gatewayName
        let topics = config.topics
        var state = EngineState(config: config, topics: topics)
        for device in config.devices {
            let record = DeviceRecord(id: device.id, config: device, address: device.match.address)
            state.devices[device.id] = record
            state.order.append(device.id)
            if let a = device.match.address { state.byAddress[a] = record }
        }
        engine = Mutex(state)
        started = clock.now
        coordination = config.gateway.map { GatewayCoordination(settings: $0, topics: topics) }
        passiveReadings = config.gateway.map { PassiveReadings(window: $0.dedupWindow, delay: $0.passiveDelay) }
        if let p = config.peripheral, let peripheralHost {
            let box = WeakBridge()
            let mqtt = mqtt
            peripheral = PeripheralService(
                config: p, registry: config.registry, host: peripheralHost, topics: topics, qos: config.mqtt.qos,
                maxPayload: config.mqtt.maxPayload, clock: clock, logger: self.logger,
                status: { box.bridge.withLock { $0 }?.status }, changed: { box.bridge.withLock { $0 }?.publishInfo() },
                publish: { try? mqtt.publish($0) })
            box.bridge.withLock { $0 = self }
        } else {
            peripheral = nil
        }
    }

    /// Lets the peripheral role ask the bridge for its status without keeping it alive.
    final class WeakBridge: Sendable {
        let bridge = Mutex<Bridge?>(nil)
    }

    /// `logger`, plus warnings and errors (`logging.mqtt_level`) published on `bridge/logging`.
    static func forwarding(_ logger: Logger, to mqtt: any MQTTTransport, config: BridgeConfig) -> Logger {
        guard let minimum = LogLevel(name: config.logging.mqttLevel) else { return logger }
        let topic = config.topics.bridgeLogging
        let forward = ClosureLogHandler(minimum: minimum) { level, message, metadata in
            var fields: [(String, JSONValue)] = [("level", .string(level.description)), ("message", .string(message))]
            if let device = metadata["device"] { fields.append(("device", .string(device))) }
            if let component = metadata["component"] { fields.append(("component", .string(component))) }
            try? mqtt.publish(BridgeOutgoingMessage(topic: topic, payload: JSONValue.object(fields).bytes, qos: 0))
        }
        var copy = logger
        var handlers: [any LogHandler] = [forward]
        if let inner = logger.handler {
            let level = logger.level
            handlers.insert(
                ClosureLogHandler(minimum: level) { inner.log(level: $0, message: $1, metadata: $2) }, at: 0)
        }
        copy.handler = FanOutLogHandler(handlers)
        copy.level = min(logger.level, minimum)
        return copy
    }

    var config: BridgeConfig { engine.withLock { $0.config } }
    var topics: BridgeTopics { engine.withLock { $0.topics } }

    /// The counters so far.
    public var counters: BridgeCounters { hot.adding(to: engine.withLock { $0.counters }) }

    /// The counters of every message (notifications, advertisements, decoded values, state publishes): atomics,
    /// so that counting is not a trip to the engine's lock per message.
    let hot = HotCounters()
    final class HotCounters: Sendable {
        let notifications = Atomic<Int>(0)
        let advertisements = Atomic<Int>(0)
        let decoded = Atomic<Int>(0)
        let statePublishes = Atomic<Int>(0)
        /// `counters` with these added.
        func adding(to counters: BridgeCounters) -> BridgeCounters {
            var c = counters
            c.notifications += notifications.load(ordering: .relaxed)
            c.advertisements += advertisements.load(ordering: .relaxed)
            c.decoded += decoded.load(ordering: .relaxed)
            c.statePublishes += statePublishes.load(ordering: .relaxed)
            return c
        }
    }

    /// What the bridge is doing, for the service manager (`READY=1`, `STATUS=`, the watchdog).
    public struct Status: Sendable, Equatable {
        /// Connected to the broker.
        public var mqttConnected: Bool
        /// bluetoothd on the bus.
        public var bluetoothdRunning: Bool
        /// Adapters available.
        public var adapters: Int
        /// Devices streaming (connected and subscribed) or online.
        public var devicesOnline: Int
        /// Devices known.
        public var devicesKnown: Int
        /// When the bridge's main loop last ran (real time: a stalled loop stops moving it).
        public var heartbeat: ContinuousClock.Instant

        /// `MQTT connected, 3/6 devices online, 1 adapter`.
        public var text: String {
            "MQTT \(mqttConnected ? "connected" : "disconnected"), \(devicesOnline)/\(devicesKnown) devices online, "
                + (bluetoothdRunning ? "\(adapters) adapter\(adapters == 1 ? "" : "s")" : "bluetoothd not running")
        }

        /// Ready: connected to the broker, with an adapter.
        public var isReady: Bool { mqttConnected && adapters > 0 }

        /// True while the main loop's heartbeat is younger than `limit`: the service manager's watchdog is fed only
        /// then, so a stalled loop gets the process restarted.
        public func allowsWatchdog(now: ContinuousClock.Instant, limit: Duration) -> Bool { now - heartbeat < limit }
    }

    /// One device as the metrics show it.
    public struct DeviceMetrics: Sendable, Equatable {
        /// Its id.
        public var id: String
        /// Connected and streaming.
        public var connected: Bool
        /// Availability online.
        public var online: Bool
        /// Last seen, seconds since 1970.
        public var lastSeen: Double?
        /// Messages received.
        public var messages: Int
    }

    /// Every device, for the metrics endpoint.
    public var deviceMetrics: [DeviceMetrics] {
        records.map { r in
            r.data.withLock { d in
                DeviceMetrics(
                    id: r.id, connected: d.session == .streaming, online: d.online == true, lastSeen: d.lastSeenWall,
                    messages: d.messages)
            }
        }
    }

    /// The MQTT counters.
    public var transportStatistics: BridgeTransportStatistics { mqtt.statistics }

    /// The status now.
    public var status: Status {
        let all = records
        let online = all.filter { $0.data.withLock { $0.online == true } }.count
        return engine.withLock { s in
            Status(
                mqttConnected: s.mqttConnected, bluetoothdRunning: s.bluetoothdRunning, adapters: s.adapters.count,
                devicesOnline: online, devicesKnown: all.count, heartbeat: s.heartbeat)
        }
    }

    /// Loads the configuration again (from the source given at creation) and applies it; an invalid one is rejected
    /// with its errors on `bridge/logging` and the old one stays in force.
    public func reloadFromSource() async -> Result<ReloadSummary, ConfigErrors> {
        guard let configSource else {
            return .failure(ConfigErrors([ConfigError(path: "", reason: "this bridge has no configuration file")]))
        }
        switch await configSource() {
        case .failure(let errors):
            for e in errors.errors { logger.error("configuration not reloaded: \(e)") }
            return .failure(errors)
        case .success(let new):
            return .success(await reload(new))
        }
    }

    func record(_ id: String) -> DeviceRecord? { engine.withLock { $0.devices[id] } }
    var records: [DeviceRecord] { engine.withLock { s in s.order.compactMap { s.devices[$0] } } }

    // MARK: Running

    /// Runs until cancelled, then shuts down in order and returns.
    public func run() async {
        let log = logger
        loadState()
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.runStateSaver() }
            group.addTask { await self.consumeMQTTStates() }
            let incoming = self.mqtt.incoming()
            group.addTask { await self.consumeCommands(incoming) }
            group.addTask { await self.subscribeCommands() }
            group.addTask { await self.runBLE() }
            group.addTask { await self.runTicker() }
            group.addTask { await self.runHealth() }
            if let peripheral = self.peripheral { group.addTask { await peripheral.run() } }
            // Wait for cancellation of the bridge's task.
            await withTaskCancellationHandler {
                await waitForever()
            } onCancel: {
            }
            log.info("shutting down")
            group.cancelAll()
        }
        await shutdown()
    }

    func shutdown() async {
        engine.withLock {
            $0.shuttingDown = true
            $0.stateResend?.cancel()
            $0.stateResend = nil
        }
        let all = records
        var tasks: [Task<Void, Never>] = []
        for r in all {
            if let t = r.data.withLock({ $0.sessionTask }) {
                t.cancel()
                tasks.append(t)
            }
        }
        // Sessions disconnect on purpose; a device that does not answer gets at most 5 s.
        let (done, doneContinuation) = AsyncStream<Void>.makeStream()
        let waiter = Task {
            for t in tasks { await t.value }
            doneContinuation.yield()
        }
        let timer = Task {
            try? await Task.sleep(for: .seconds(5))
            doneContinuation.yield()
        }
        for await _ in done { break }
        waiter.cancel()
        timer.cancel()
        for r in all where r.data.withLock({ $0.online != nil }) { setAvailability(r, online: false, force: true) }
        await uncancelled { await self.central.stopScanning() }
        publish(topics.bridgeState, JSONValue.object([("state", .string("offline"))]).bytes, qos: 1, retain: true)
        saveState()
        logger.info("stopped: \(all.count) devices disconnected, bridge offline")
    }

    // MARK: BLE side

    func runBLE() async {
        let events = central.events()
        // Advertisements straight from the central's thread: handle() is safe from any thread (the notification
        // path runs on the BLE reader thread too), and a passive device costs no task hop per advertisement.
        central.deliverScanResults { [weak self] event in self?.handle(event) }
        do {
            let adapters = try await central.start()
            engine.withLock {
                $0.adapters = adapters
                $0.bluetoothdRunning = true
            }
            logStartup(adapters)
            await startScanning()
            adoptConnected()
        } catch {
            logger.error("BLE: \(error.message); waiting for bluetoothd")
        }
        // Poll devices start now; connected ones when they are first seen advertising.
        for r in records where r.config.mode == .poll { ensureSession(r) }
        publishDevices()
        for await event in events {
            if Task.isCancelled { break }
            handle(event)
        }
    }

    /// A link held here by no session gets this RSSI when BlueZ has none (several gateways: it is heard here, once
    /// no other gateway's claim holds; the tick says so).
    static let heldLinkRSSI = -50

    /// Devices an earlier run left connected (bluetoothd keeps a link when the process that made it dies, so such a
    /// device does not advertise and would never be seen again): a `connected` one is taken over at once; with
    /// several gateways it counts as heard here when no other gateway serves it (else it is disconnected: see
    /// `waitForOwnership`), since it cannot be heard anywhere else.
    func adoptConnected() {
        let now = clock.now
        for adv in central.connectedDevices() {
            guard let r = resolveDevice(for: adv), r.config.mode == .connected else { continue }
            logger.info(
                "connected on \(adv.adapter) by an earlier run (bluetoothd kept the link): taking it over",
                ["device": r.id])
            let rssi = adv.rssi ?? Self.heldLinkRSSI
            r.data.withLock { d in
                if d.address == nil { d.address = adv.address }
                if let name = adv.name { d.advertisedName = name }
                d.rssiByAdapter[adv.adapter] = (rssi, now)
                d.leftConnectedOn = adv.adapter
                d.lastSeen = now
                if d.session == .idle { d.session = .discovered }
            }
            ensureSession(r)
        }
    }

    func logStartup(_ adapters: [BLEAdapterInfo]) {
        let c = config
        let modes = Dictionary(grouping: c.devices, by: \.mode).map { "\($0.value.count) \($0.key.rawValue)" }
            .sorted().joined(separator: ", ")
        logger.info(
            "blebridge \(gatewayName): \(c.devices.count) devices configured (\(modes.isEmpty ? "none" : modes)); "
                + "adapters: \(adapters.map { "\($0.name) (\($0.address)\($0.powered ? "" : ", off"))" }.joined(separator: ", ")); "
                + "MQTT \(c.mqtt.url) base topic '\(c.mqtt.baseTopic)'; Home Assistant discovery "
                + (c.homeAssistant.enabled ? "on (\(c.homeAssistant.prefix))" : "off"))
    }

    /// The powered adapters among `adapters` that `allowed` (names or addresses; empty: any) lets the bridge use.
    static func usable(_ adapters: [BLEAdapterInfo], allowed: [String]) -> [BLEAdapterInfo] {
        adapters.filter { a in
            a.powered && (allowed.isEmpty || allowed.contains(a.name) || allowed.contains(a.address.uppercased()))
        }
    }

    func startScanning() async {
        let c = config
        let request = BLEScanRequest(
            serviceUUIDs: c.scanServiceUUIDs, passive: c.bluetooth.passive, duplicateData: c.bluetooth.duplicateData,
            adapters: c.bluetooth.adapters)
        do {
            try await central.startScanning(request)
            let names = Self.usable(central.adapters(), allowed: request.adapters).map(\.name)
            engine.withLock { $0.scanning = Set(names) }
            logger.info(
                "scanning"
                    + (request.serviceUUIDs.isEmpty
                        ? " for every advertiser"
                        : " for \(request.serviceUUIDs.map(\.description).joined(separator: ", "))")
                    + (request.passive ? " (passive)" : ""))
        } catch {
            logger.error("cannot scan: \(error.message); retrying when the adapter comes back")
        }
    }

    func handle(_ event: BLECentralEvent) {
        switch event {
        case .advertisement(let adv):
            handleAdvertisement(adv)
        case .deviceRemoved(let address, _):
            guard let r = engine.withLock({ $0.byAddress[address] }) else { return }
            logger.debug("BlueZ forgot \(address)", ["device": r.id])
            coordination?.forget(r.id)
        case .adapterAdded(let a):
            engine.withLock { s in
                s.adapters.removeAll { $0.name == a.name }
                s.adapters.append(a)
            }
            logger.info("adapter \(a.name) (\(a.address)) available")
            Task { await self.startScanning() }
            for r in records { r.wakeSession() }
            publishInfo()
        case .adapterRemoved(let name):
            engine.withLock {
                $0.adapters.removeAll { $0.name == name }
                $0.scanning.remove(name)
            }
            logger.warning("adapter \(name) went away; its devices reconnect when it (or another) is back")
            publishInfo()
        case .bluetoothdStarted:
            engine.withLock { $0.bluetoothdRunning = true }
            logger.info("bluetoothd is back; scanning again and reconnecting devices")
            Task {
                let adapters = self.central.adapters()
                self.engine.withLock { $0.adapters = adapters }
                await self.startScanning()
                for r in self.records { r.wakeSession() }
            }
        case .bluetoothdStopped:
            for r in records { coordination?.forget(r.id) }
            engine.withLock {
                $0.bluetoothdRunning = false
                $0.adapters = []
                $0.scanning = []
            }
            logger.warning("bluetoothd left the bus; devices reconnect when it is back")
        }
    }

    func handleAdvertisement(_ adv: BLEAdvertisement) {
        let now = clock.now
        let wall = clock.wallClock
        hot.advertisements.add(1, ordering: .relaxed)
        engine.withLock { s in
            for collector in s.scans.values { collector.add(adv) }
        }
        guard let r = resolveDevice(for: adv) else { return }
        let c = r.config
        if let g = coordination, let rssi = adv.rssi {
            g.heard(r.id, rssi: rssi, wall: wall, passive: c.mode == .passive)
        }
        var appeared = false
        let (changed, wasOnline) = r.data.withLock { d -> ([(AdvertisementSource, [UInt8])], Bool?) in
            if d.address == nil { d.address = adv.address }
            if let name = adv.name { d.advertisedName = name }
            if let rssi = adv.rssi {
                d.rssi = rssi
                d.rssiByAdapter[adv.adapter] = (rssi, now)
            }
            if let last = d.lastAdvert {
                let gap = (now - last).seconds
                if gap > 0.005 {
                    d.advertInterval = d.advertInterval.map { $0 * 0.8 + gap * 0.2 } ?? gap
                }
            }
            d.lastAdvert = now
            d.lastSeen = now
            d.lastSeenWall = wall
            if d.session == .idle {
                d.session = .discovered
                appeared = true
            }
            var changed: [(AdvertisementSource, [UInt8])] = []
            for (uuid, payload) in adv.serviceData where d.lastPayloads[.serviceData(uuid)] != payload {
                changed.append((.serviceData(uuid), payload))
                d.lastPayloads[.serviceData(uuid)] = payload
            }
            for (company, payload) in adv.manufacturerData where d.lastPayloads[.manufacturer(company)] != payload {
                changed.append((.manufacturer(company), payload))
                d.lastPayloads[.manufacturer(company)] = payload
            }
            return (changed, d.online)
        }
        if appeared {
            logger.info(
                "appeared: \(adv.address)\(adv.name.map { " \"\($0)\"" } ?? "") on \(adv.adapter)", ["device": r.id])
            publishEvent("appeared", r)
            if coordination != nil, c.mode == .passive, c.index < 0 {
                // An auto device: what the other gateways publish for it, as for configured ones (subscribeCommands).
                let topic = topics.state(r.id)
                Task { try? await self.mqtt.subscribe(topic) }
            }
        }
        // Advertisement data is decoded for every device: passive ones live on it, others may carry a battery level.
        var decodedAny = false
        let registry = changed.isEmpty ? GATTParserRegistry() : engine.withLock { $0.config.registry }
        for (source, payload) in changed {
            guard let parser = registry.parser(for: source) else { continue }
            let context = AdvertisementContext(
                mac: adv.address.text, bindKey: c.bindKey, localName: adv.name, cipher: advertisementCipher)
            do {
                let reading = try registry.decode(source, payload, context: context)
                hot.decoded.add(1, ordering: .relaxed)
                if let passiveReadings, let g = coordination, c.mode == .passive {
                    offerPassive(r, reading, parser: parser, readings: passiveReadings, coordination: g)
                    continue
                }
                r.merge(reading, now: now, wall: wall)
                noteAdvertisementFields(r, parser, reading)
                decodedAny = true
            } catch {
                engine.withLock { $0.counters.decodeErrors += 1 }
                reportError(
                    "\(parser.name) cannot decode \(source) \(hexString(payload)) from \(adv.address): \(error)",
                    device: r.id)
            }
        }
        // Passive and on-demand devices are available while they advertise (an on-demand device is reachable then).
        if c.mode == .passive || c.mode == .onDemand {
            if wasOnline != true { setAvailability(r, online: true) }
        }
        if decodedAny { requestStatePublish(r) }
        if c.mode == .connected {
            ensureSession(r)
            // A device that was not found (or whose adapter was gone) is retried as soon as it advertises; other
            // failures wait out their backoff, or every advertisement would cut it short.
            let wake = r.data.withLock { d in
                d.session == .backingOff && (d.lastFailure == .notFound || d.lastFailure == .adapterUnavailable)
            }
            if wake { r.wakeSession() }
        }
    }

    /// Multi-gateway mode: a passive reading is published unless a gateway published it already; the k-th best
    /// hearing gateway waits k × `passive_delay` first (docs/MULTI-GATEWAY.md#passive-devices).
    func offerPassive(
        _ r: DeviceRecord, _ reading: GATTReading, parser: any AdvertisementParser, readings: PassiveReadings,
        coordination g: GatewayCoordination
    ) {
        let wall = clock.wallClock
        if readings.isDuplicate(r.id, reading, wall: wall) {
            takePassive(r, reading, parser: parser, publish: false)
            return
        }
        let rank = g.passiveRank(r.id, wall: wall)
        if rank == 0 {
            readings.notePublished(r.id, reading, wall: wall)
            takePassive(r, reading, parser: parser, publish: true)
            return
        }
        let delay = Duration.milliseconds(Int64(Double(rank) * readings.delay * 1000))
        Task {
            do { try await self.clock.sleep(until: self.clock.now + delay) } catch { return }
            let wall = self.clock.wallClock
            let duplicate = readings.isDuplicate(r.id, reading, wall: wall)
            if !duplicate { readings.notePublished(r.id, reading, wall: wall) }
            self.takePassive(r, reading, parser: parser, publish: !duplicate)
        }
    }

    /// Merges a passive reading into the state; publishes it, or counts it as another gateway's duplicate.
    func takePassive(_ r: DeviceRecord, _ reading: GATTReading, parser: any AdvertisementParser, publish: Bool) {
        r.merge(reading, now: clock.now, wall: clock.wallClock)
        noteAdvertisementFields(r, parser, reading)
        if publish {
            if let g = coordination {
                let byGateway = g.rssiByGateway(r.id, wall: clock.wallClock)
                r.data.withLock { $0.rssiByGateway = byGateway }
            }
            requestStatePublish(r)
        } else {
            engine.withLock { $0.counters.duplicatesSuppressed += 1 }
        }
    }

    /// The cipher for encrypted advertisements, injected by the program (GATTCrypto); nil: none.
    nonisolated(unsafe) public static var cipher: (any AESCCMCipher)?
    var advertisementCipher: (any AESCCMCipher)? { Bridge.cipher }

    /// The device an advertisement belongs to: known by address, matched by a configured device, or an auto device.
    func resolveDevice(for adv: BLEAdvertisement) -> DeviceRecord? {
        if let r = engine.withLock({ $0.byAddress[adv.address] }) { return r }
        return engine.withLock { s -> DeviceRecord? in
            if let r = s.byAddress[adv.address] { return r }
            let c = s.config
            for device in c.devices where device.match.address == nil && device.match.matches(adv) {
                guard let primary = s.devices[device.id] else { continue }
                if primary.address == nil {
                    primary.data.withLock { $0.address = adv.address }
                    s.byAddress[adv.address] = primary
                    return primary
                }
                // A second device matching the same entry gets an id of its own.
                let id = "\(device.id)_\(adv.address.compact)"
                var copy = device
                copy.id = id
                let r = DeviceRecord(id: id, config: copy, address: adv.address)
                s.devices[id] = r
                s.order.append(id)
                s.byAddress[adv.address] = r
                return r
            }
            let auto = c.autoDevices
            guard auto.enabled, !auto.deny.contains(adv.address), auto.allow.isEmpty || auto.allow.contains(adv.address)
            else { return nil }
            if let min = auto.minimumRSSI, (adv.rssi ?? -127) < min { return nil }
            // Only advertisers a parser really decodes: a phone's Apple data selects the iBeacon parser but is no
            // iBeacon, and must not become a device.
            let context = AdvertisementContext(mac: adv.address.text, localName: adv.name, cipher: Bridge.cipher)
            let decodable =
                adv.serviceData.contains { uuid, payload in
                    c.registry.parser(for: .serviceData(uuid)) != nil
                        && (try? c.registry.decode(.serviceData(uuid), payload, context: context)) != nil
                }
                || adv.manufacturerData.contains { company, payload in
                    c.registry.parser(for: .manufacturer(company)) != nil
                        && (try? c.registry.decode(.manufacturer(company), payload, context: context)) != nil
                }
            guard decodable else { return nil }
            let id = adv.address.compact
            let config = DeviceConfig(
                id: id, friendlyName: nil, match: DeviceMatch(address: adv.address), mode: .passive, subscribe: [],
                poll: [], pollInterval: .seconds(300), writable: [], debounce: nil, throttle: nil, retain: nil,
                qos: -1, output: .json, bindKey: nil, availabilityTimeout: nil, index: -1)
            let r = DeviceRecord(id: id, config: config, address: adv.address)
            s.devices[id] = r
            s.order.append(id)
            s.byAddress[adv.address] = r
            return r
        }
    }

    func noteAdvertisementFields(_ r: DeviceRecord, _ parser: any AdvertisementParser, _ reading: GATTReading) {
        let changed = r.data.withLock { d -> Bool in
            var changed = false
            // The parser's declared fields are asked for only when a field is new (a parser may build them per call).
            var declared: [GATTFieldDescriptor]?
            // A parser gives its fields in the same order every time: the k-th is looked at first.
            for (k, field) in reading.fields.enumerated()
            where !(k < d.advertFields.count && d.advertFields[k].name == field.name)
                && !d.advertFields.contains(where: { $0.name == field.name })
            {
                if declared == nil { declared = parser.fields }
                let descriptor =
                    declared?.first { $0.name == field.name } ?? GATTFieldDescriptor.inferred(fromName: field.name)
                d.advertFields.append(descriptor)
                changed = true
            }
            return changed
        }
        if changed { publishDiscovery(r) }
    }

    // MARK: Health

    func runHealth() async {
        let interval = config.healthInterval
        guard interval > .zero else { return }
        while !Task.isCancelled {
            do { try await clock.sleep(for: interval) } catch { return }
            publish(topics.bridgeHealth, JSONValue.object(healthFields()).bytes, qos: 0, retain: true)
        }
    }

    // MARK: Ticker: availability of passive devices, silent subscriptions

    func runTicker() async {
        while !Task.isCancelled {
            do { try await clock.sleep(for: .seconds(1)) } catch { return }
            tick()
        }
    }

    /// Once a second: gateway coordination, streams to end (handed over, silent), passive devices gone offline.
    /// One pass over the devices with one lock each: with 500 passive advertisers, a pass per check (and the device
    /// list made for each) was most of what the process did besides the advertisements themselves.
    func tick() {
        let now = clock.now
        engine.withLock { $0.heartbeat = ContinuousClock.now }
        let c = config
        let all = records
        if let g = coordination {
            let wall = clock.wallClock
            // An earlier run's link that no other gateway's claim holds: only this radio can hear the device.
            if g.isSubscribed {
                for r in all {
                    guard let adapter = r.data.withLock({ $0.leftConnectedOn }), g.owner(of: r.id, wall: wall) == nil
                    else { continue }
                    let rssi = r.data.withLock { $0.rssiByAdapter[adapter]?.rssi } ?? Self.heldLinkRSSI
                    g.heard(r.id, rssi: rssi, wall: wall)
                }
            }
            let free = hasFreeSlot
            let holding: Set<SessionState> = [.connecting, .resolving, .subscribing, .streaming, .polling]
            let served = all.filter { $0.config.mode != .passive }.map { r in
                let session = r.data.withLock { $0.session }
                return (id: r.id, linkUp: session != .backingOff, canServe: free || holding.contains(session))
            }
            let passive = all.filter { $0.config.mode == .passive }.map(\.id)
            apply(g.evaluate(served, passive: passive, wall: clock.wallClock))
        }
        for r in all {
            let mode = r.config.mode
            let (end, online, lastAdvert, interval) = r.data.withLock { d in
                (Self.streamToEnd(&d, now: now), d.online, d.lastAdvert, d.advertInterval)
            }
            if let (watch, reason) = end { watch.ends.yield(reason) }
            if mode == .passive || mode == .onDemand, online == true, let lastAdvert {
                let timeout = passiveTimeout(r.config, interval: interval, settings: c.availability)
                if now - lastAdvert > timeout {
                    // Several gateways: offline only when none hears it (their sightings come every 10 s).
                    if mode == .passive, let g = coordination,
                        g.othersHear(r.id, within: timeout.seconds + 12, wall: clock.wallClock)
                    {
                        continue
                    }
                    logger.info(
                        "no advertisement for \(Int((now - lastAdvert).seconds)) s: offline", ["device": r.id])
                    setAvailability(r, online: false)
                }
            }
        }
    }

    /// When a passive device counts as gone: its own setting, else `passive_intervals` × its advertising interval,
    /// never less than `passive_timeout`.
    func passiveTimeout(_ device: DeviceConfig, interval: Double?, settings: AvailabilitySettings) -> Duration {
        if let t = device.availabilityTimeout { return t }
        let learned = (interval ?? 0) * settings.passiveIntervals
        return max(settings.passiveMinimumTimeout, .milliseconds(Int64(min(learned, 1e9) * 1000)))
    }

    // MARK: Publishing

    func publish(_ topic: String, _ payload: [UInt8], qos: Int, retain: Bool, correlation: [UInt8]? = nil) {
        do {
            try mqtt.publish(
                BridgeOutgoingMessage(
                    topic: topic, payload: payload, qos: qos, retain: retain, correlationData: correlation))
        } catch {
            logger.warning("cannot publish to \(topic): \(error)")
        }
    }

    func stateQoS(_ r: DeviceRecord) -> Int { r.config.qos >= 0 ? r.config.qos : config.mqtt.qos }

    /// Publishes the state now, or later when `debounce`/`throttle` say so.
    func requestStatePublish(_ r: DeviceRecord) {
        let now = clock.now
        let debounce = r.config.debounce
        let throttle = r.config.throttle
        if debounce == nil && throttle == nil {
            publishState(r)
            return
        }
        let schedule = r.data.withLock { d -> Duration? in
            d.publishPending = true
            var due = now
            if let debounce {
                d.debounceDeadline = now + debounce
                due = now + debounce
            }
            if throttle != nil { due = max(due, d.nextPublishAllowed) }
            if due <= now { return .zero }
            if d.flushScheduled { return nil }
            d.flushScheduled = true
            return due
        }
        guard let due = schedule else { return }
        if due == .zero {
            publishState(r)
            return
        }
        Task {
            var deadline = due
            while true {
                do { try await self.clock.sleep(until: deadline) } catch { return }
                let next = r.data.withLock { d -> Duration? in
                    var due = self.clock.now
                    if let dl = d.debounceDeadline { due = max(due, dl) }
                    if throttle != nil { due = max(due, d.nextPublishAllowed) }
                    if due > self.clock.now { return due }
                    d.flushScheduled = false
                    return nil
                }
                guard let next else { break }
                deadline = next
            }
            self.publishState(r)
        }
    }

    func publishState(_ r: DeviceRecord) {
        let now = clock.now
        let shouldPublish = r.data.withLock { d -> Bool in
            d.publishPending = false
            d.debounceDeadline = nil
            if let t = r.config.throttle { d.nextPublishAllowed = now + t }
            return true
        }
        guard shouldPublish else { return }
        // One trip to the engine for what this needs (not a copy of the whole configuration per message).
        let (t, defaultRetain, defaultQoS) = engine.withLock { ($0.topics, $0.config.mqtt.retain, $0.config.mqtt.qos) }
        let retain = r.config.retain ?? defaultRetain
        let qos = r.config.qos >= 0 ? r.config.qos : defaultQoS
        if r.config.output != .attribute {
            publish(r.stateTopic(t), r.stateJSON(), qos: qos, retain: retain)
        }
        if r.config.output != .json {
            let fields = r.data.withLock { $0.fields }
            for (name, value) in fields {
                let payload: [UInt8]
                if case .string(let s) = value { payload = Array(s.utf8) } else { payload = value.bytes }
                publish(t.attribute(r.id, name), payload, qos: qos, retain: retain)
            }
        }
        hot.statePublishes.add(1, ordering: .relaxed)
    }

    func setAvailability(_ r: DeviceRecord, online: Bool, force: Bool = false) {
        let changed = r.data.withLock { d -> Bool in
            if d.online == online && !force { return false }
            d.online = online
            return true
        }
        guard changed else { return }
        publish(
            topics.availability(r.id), JSONValue.object([("state", .string(online ? "online" : "offline"))]).bytes,
            qos: config.mqtt.qos, retain: true)
    }

    func publishEvent(_ type: String, _ r: DeviceRecord, _ extra: [(String, JSONValue)] = []) {
        var data: [(String, JSONValue)] = [("id", .string(r.id))]
        if let a = r.address { data.append(("address", .string(a.text))) }
        data += extra
        publish(
            topics.bridgeEvent, JSONValue.object([("type", .string(type)), ("data", .object(data))]).bytes, qos: 0,
            retain: false)
    }

    /// Carries out what the multi-gateway coordination asks for.
    func apply(_ effects: [GatewayEffect]) {
        for effect in effects {
            switch effect {
            case .publish(let topic, let payload):
                publish(topic, payload, qos: 1, retain: true)
            case .handOver(let device, let to):
                guard let r = record(device) else { continue }
                logger.info("gateway \(to.isEmpty ? "(none)" : to) serves it now; disconnecting", ["device": r.id])
                r.data.withLock { $0.handOverTo = to }
                r.wakeSession()
            case .wake(let device):
                guard let r = record(device) else { continue }
                if coordination?.mayConnect(device) == true {
                    logger.info("this gateway serves it", ["device": r.id])
                    publishDiscovery(r, force: true)
                }
                r.wakeSession()
            case .gatewayLeft(let gateway):
                let passive = records.filter { $0.config.mode == .passive }
                guard config.homeAssistant.enabled, !passive.isEmpty else { continue }
                logger.info(
                    "gateway \(gateway) went offline: publishing the discovery of \(passive.count) passive device(s)"
                        + " again, naming this gateway")
                for r in passive { publishDiscovery(r, force: true) }
            }
        }
    }

    /// Logs a warning and forwards it to `bridge/logging`.
    func reportError(_ message: String, device: String? = nil, level: LogLevel = .warning) {
        var extra: [String: String] = [:]
        if let device { extra["device"] = device }
        logger.log(level, message, extra)
    }
}

/// Suspends until the task is cancelled.
func waitForever() async {
    let stream = AsyncStream<Void> { _ in }
    for await _ in stream {}
}

/// Runs clean-up work to the end even when the calling task is cancelled (a D-Bus call made from a cancelled task
/// is cancelled before it is sent, so a `Disconnect` at shutdown would never reach bluetoothd).
func uncancelled(_ body: @escaping @Sendable () async -> Void) async {
    await Task { await body() }.value
}

/// Runs `body` in a child task of its own (cancelled with the caller) and returns what it returns.
///
/// For the deep calls of a long-lived task (connecting, subscribing): a task keeps the memory its deepest chain of
/// awaits needed until the task ends (Swift's task allocator keeps its slabs), so a device's session task, which
/// lives as long as the device is streaming, would hold on to the ~10 KB of frames that connecting and subscribing
/// once needed. In a child task that memory goes when the call returns.
func inChildTask<T: Sendable, E: Error>(_ body: @escaping @Sendable () async throws(E) -> T) async throws(E) -> T {
    // `async let` rethrows untyped: the error travels as a value.
    async let result: Result<T, E> = {
        do throws(E) { return .success(try await body()) } catch { return .failure(error) }
    }()
    return try await result.get()
}
