// Discovery sessions: active (SetDiscoveryFilter + StartDiscovery) or passive (an AdvertisementMonitor1 tree we
// export), each on its own D-Bus connection so its BlueZ session and filter die with it. Device events come from
// the client's mirror, re-filtered here because BlueZ merges every client's filter with OR.
import DBus
import Synchronization

/// The transport a discovery looks for.
public enum BlueZTransport: String, Sendable, Hashable {
    /// Both transports.
    case auto
    /// BR/EDR (classic) only.
    case bredr
    /// Low Energy only.
    case le
}

/// One `or_patterns` entry of an advertisement monitor: AD `type` whose data holds `content` at `start`.
public struct BlueZAdvertisementPattern: Sendable, Hashable {
    /// Offset in the AD structure's data.
    public var start: UInt8
    /// AD type (0x03 complete 16-bit UUIDs, 0x16 service data, 0xFF manufacturer data, ...).
    public var adType: UInt8
    /// The bytes to match.
    public var content: [UInt8]

    /// A pattern matching `content` at `start` in AD structures of type `adType`.
    public init(start: UInt8 = 0, adType: UInt8, content: [UInt8]) {
        self.start = start
        self.adType = adType
        self.content = content
    }
}

/// What to look for.
public struct BlueZDiscoveryFilter: Sendable, Hashable {
    /// Only devices advertising one of these services (any form: `180d`, full 128-bit). Empty: all.
    public var serviceUUIDs: [String]
    /// Only advertisements at least this strong (dBm).
    public var rssiThreshold: Int16?
    /// Report every advertisement, not only changed ones (BlueZ's `DuplicateData`).
    public var duplicateData: Bool
    /// LE, BR/EDR, or both.
    public var transport: BlueZTransport
    /// Ask for passive scanning (AdvertisementMonitor1); falls back to active scanning when unavailable.
    public var passive: Bool
    /// Patterns for passive scanning; derived from `serviceUUIDs` when empty.
    public var patterns: [BlueZAdvertisementPattern]
    /// Restart discovery when no advertisement was seen for this long, or when the adapter stopped discovering.
    /// Nil disables the watchdog.
    public var watchdogInterval: Duration?
    /// How many events may wait for a consumer that falls behind; beyond that they are dropped (counted in
    /// `BlueZDiscovery.droppedEvents`, logged), and the consumer then gets the current devices from the tree
    /// (`lost` for the ones gone) instead, so it never misses a state change for good.
    public var eventCapacity: Int

    /// A filter; the defaults scan everything over LE, actively, with BlueZ's duplicate suppression.
    public init(
        serviceUUIDs: [String] = [], rssiThreshold: Int16? = nil, duplicateData: Bool = false,
        transport: BlueZTransport = .le, passive: Bool = false, patterns: [BlueZAdvertisementPattern] = [],
        watchdogInterval: Duration? = .seconds(120), eventCapacity: Int = 4096
    ) {
        self.eventCapacity = eventCapacity
        self.serviceUUIDs = serviceUUIDs
        self.rssiThreshold = rssiThreshold
        self.duplicateData = duplicateData
        self.transport = transport
        self.passive = passive
        self.patterns = patterns
        self.watchdogInterval = watchdogInterval
    }

    /// True when `device` passes this filter on the client side.
    public func matches(_ device: BlueZDevice) -> Bool {
        if let rssiThreshold, let rssi = device.rssi, rssi < rssiThreshold { return false }
        if !serviceUUIDs.isEmpty {
            let wanted = Set(serviceUUIDs.compactMap(bluezUUIDString))
            let advertised = Set(device.uuids).union(device.serviceData.keys)
            if wanted.isDisjoint(with: advertised) { return false }
        }
        return true
    }

    /// The monitor patterns to use: the explicit ones, else one per service UUID (UUID lists and service data).
    var effectivePatterns: [BlueZAdvertisementPattern] {
        if !patterns.isEmpty { return patterns }
        var out: [BlueZAdvertisementPattern] = []
        for text in serviceUUIDs {
            guard let full = bluezUUIDString(text), let bytes = uuidBytesLittleEndian(full) else { continue }
            if full.hasPrefix("0000"), full.hasSuffix("-0000-1000-8000-00805f9b34fb") {
                let short = Array(bytes[12..<14])
                out.append(.init(adType: 0x02, content: short))
                out.append(.init(adType: 0x03, content: short))
                out.append(.init(adType: 0x16, content: short))
            } else {
                out.append(.init(adType: 0x06, content: bytes))
                out.append(.init(adType: 0x07, content: bytes))
                out.append(.init(adType: 0x21, content: bytes))
            }
        }
        return out
    }
}

/// The 16 bytes of a canonical UUID string, least significant first (as they go over the air).
func uuidBytesLittleEndian(_ uuid: String) -> [UInt8]? {
    let hex = Array(uuid.filter { $0 != "-" })
    guard hex.count == 32 else { return nil }
    var out: [UInt8] = []
    for i in stride(from: 0, to: 32, by: 2) {
        guard let b = UInt8(String(hex[i..<i + 2]), radix: 16) else { return nil }
        out.append(b)
    }
    return out.reversed()
}

/// What a discovery reports.
public enum BlueZDiscoveryEvent: Sendable, Hashable {
    /// A matching device was seen for the first time in this session.
    case appeared(BlueZDevice)
    /// A reported device's advertisement changed (RSSI, data, name...).
    case updated(BlueZDevice)
    /// A reported device left BlueZ's tree (expired, removed, or bluetoothd stopped). The device is as it was when
    /// it was removed from the tree when that is known, else as it was first reported (its address and path always
    /// hold).
    case lost(BlueZDevice)

    /// The device the event is about.
    public var device: BlueZDevice {
        switch self {
        case .appeared(let d), .updated(let d), .lost(let d): return d
        }
    }
}

/// How a discovery scans.
public enum BlueZScanMode: String, Sendable, Hashable {
    /// SetDiscoveryFilter + StartDiscovery (scan requests sent).
    case active
    /// An AdvertisementMonitor1 with or_patterns (no scan requests).
    case passive
}

/// The events of one discovery session, in order. Ends when the session stops.
public struct BlueZDiscoveryEvents: AsyncSequence, Sendable {
    /// The element type.
    public typealias Element = BlueZDiscoveryEvent
    let base: ResyncingBuffer<BlueZDiscoveryEvent>

    /// Iterates the events in order.
    public struct AsyncIterator: AsyncIteratorProtocol {
        let base: ResyncingBuffer<BlueZDiscoveryEvent>
        /// The next element, or nil at the end.
        public mutating func next() async -> BlueZDiscoveryEvent? { await base.next() }
    }

    /// Returns an iterator; iterate once.
    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(base: base) }
}

/// Lets the event buffer ask its discovery for the current state without keeping it alive.
/// The discovery its event buffer calls back (weakly: the buffer must not keep it). Set once, at the end of the
/// discovery's init, before anything can call the buffer (events flow only after `begin()`, which publishes it
/// through the client's lock); read on every event without a lock of its own.
final class WeakDiscovery: @unchecked Sendable {
    private weak var discovery: BlueZDiscovery?
    var value: BlueZDiscovery? { discovery }
    func set(_ discovery: BlueZDiscovery) { self.discovery = discovery }
}

let advertisementKeys: Set<String> = [
    "RSSI", "ManufacturerData", "ServiceData", "TxPower", "Name", "UUIDs", "AdvertisingData", "AdvertisingFlags",
]

/// A running discovery. Stop it with `stop()`; dropping it without stopping is safe too: its watchdog holds it only
/// weakly, so it is freed, and its deinit closes its connection (which ends the BlueZ session) and ends the event
/// stream.
///
/// It ends on its own (the event stream finishes and `endReason` says why) when the bus connection is lost, or when
/// its adapter is removed and it was started on a fixed adapter. Started with an adapter selector
/// (`startDiscovery(onAdapter:filter:)`) it survives the adapter going away and rebinds to the next adapter that
/// matches. Across a bluetoothd restart it reports its devices lost and starts scanning again on the new daemon.
public final class BlueZDiscovery: Sendable {
    /// The adapter it runs on (the latest one, after a rebind).
    public var adapter: BlueZAdapter { state.withLock { $0.adapter } }
    /// The filter it was started with.
    public let filter: BlueZDiscoveryFilter
    /// Active or passive.
    public let mode: BlueZScanMode
    /// Why passive scanning was not used, when it was asked for.
    public let fallbackReason: String?
    /// Device events.
    public let events: BlueZDiscoveryEvents
    /// The adapter selector it rebinds with, when started with one.
    public let selector: BlueZAdapterSelector?

    let client: BlueZClient
    let connection: DBusConnection
    let continuation: ResyncingBuffer<BlueZDiscoveryEvent>
    /// What the consumer of `events` has been told: devices it got `appeared` for and no `lost` since (consumer
    /// order). A direct consumer needs no such record: it is told under the lock its events are made in (`emit`).
    let delivered = Mutex<[String: BlueZDevice]>([:])
    let monitorRoot: DBusObjectPath
    let server: DBusObjectServer?

    /// How long a device removed while our own restart runs may stay away before it counts as lost: StopDiscovery
    /// drops temporary broadcasters, which come back with their next advertisement (at most 10.24 s later).
    static let restartGrace: Duration = .seconds(11)

    struct State: Sendable {
        var adapter: BlueZAdapter
        /// False while the adapter is gone (waiting for a matching one when there is a selector).
        var bound = true
        /// The reported devices, as each was first reported (not replaced on every update: the mirror's device
        /// value then stays the only holder of its data, which the mirror overwrites in place).
        var reported: [String: BlueZDevice] = [:]
        /// Devices removed by our own restart, with the time they count as lost if they have not come back.
        var held: [String: (device: BlueZDevice, until: ContinuousClock.Instant)] = [:]
        /// When our last restart finished: removals signalled shortly after it still come from it (the signal
        /// travels on the client's connection, the StopDiscovery reply on ours, unordered).
        var restartEnded: ContinuousClock.Instant?
        var lastActivity = ContinuousClock.now
        /// The client subscriptions (tree events, advertisements).
        var subscriptions: [UInt64] = []
        var watchdog: Task<Void, Never>?
        var restarting: Task<Void, Never>?
        var stopped = false
        var restarts = 0
        var endReason: BlueZError?
    }
    let state: Mutex<State>

    init(
        client: BlueZClient, adapter: BlueZAdapter, selector: BlueZAdapterSelector?, filter: BlueZDiscoveryFilter,
        mode: BlueZScanMode, fallbackReason: String?, connection: DBusConnection,
        consumer: (@Sendable (BlueZDiscoveryEvent) -> Void)? = nil
    ) {
        self.client = client
        self.selector = selector
        self.filter = filter
        self.mode = mode
        self.fallbackReason = fallbackReason
        self.connection = connection
        state = Mutex(State(adapter: adapter))
        let box = WeakDiscovery()
        let name = adapter.name
        let logger = client.logger
        let buffer = ResyncingBuffer<BlueZDiscoveryEvent>(
            capacity: filter.eventCapacity,
            resync: { box.value?.resyncEvents() ?? [] },
            normalize: { event in box.value?.normalize(event) ?? event },
            onOverflow: { dropped in
                logger.warning(
                    "discovery on \(name): the consumer fell behind; \(dropped) event(s) dropped so far (buffer "
                        + "\(filter.eventCapacity)); it gets the current devices from BlueZ's tree once it catches up")
            }, direct: consumer)
        self.events = BlueZDiscoveryEvents(base: buffer)
        self.continuation = buffer
        let suffix = connection.uniqueName.filter { $0.isNumber || $0.isLetter }
        monitorRoot = DBusObjectPath(stringLiteral: "/io/blebridge/monitor\(suffix)")
        server = mode == .passive ? DBusObjectServer(connection: connection, objectManagerPath: monitorRoot) : nil
        box.set(self)
    }

    deinit {
        let (subs, watchdog, restarting) = state.withLock { ($0.subscriptions, $0.watchdog, $0.restarting) }
        watchdog?.cancel()
        restarting?.cancel()
        for sub in subs { client.unsubscribe(sub) }
        continuation.finish()
        connection.close()
    }

    /// Number of times the watchdog or a bluetoothd restart restarted this discovery.
    public var restartCount: Int { state.withLock { $0.restarts } }

    /// Why the discovery ended on its own (bus lost, adapter removed); nil while it runs and after `stop()`.
    public var endReason: BlueZError? { state.withLock { $0.endReason } }

    /// Passive when asked for, offered by the adapter, and there is a pattern; else active, with the reason.
    static func scanMode(adapter: BlueZAdapter, filter: BlueZDiscoveryFilter) -> (BlueZScanMode, String?) {
        guard filter.passive else { return (.active, nil) }
        if !adapter.supportsAdvertisementMonitor {
            return (
                .active,
                "adapter \(adapter.name) has no AdvertisementMonitorManager1 (bluetoothd needs --experimental)"
            )
        }
        if filter.effectivePatterns.isEmpty {
            return (.active, "passive scanning needs at least one pattern or service UUID")
        }
        return (.passive, nil)
    }

    // MARK: starting and stopping

    func begin() async throws(BlueZError) {
        let ids = [
            client.subscribe { [weak self] event, tree in self?.handle(event, tree) },
            client.subscribeAdvertisements { [weak self] device in self?.advertised(device) },
        ]
        state.withLock { $0.subscriptions = ids }
        do {
            try await startOnBlueZ()
        } catch {
            for id in ids { client.unsubscribe(id) }
            await connection.closeAndWait()
            continuation.finish()
            throw error
        }
        // Devices already advertising (another client was scanning) count as seen now.
        let path = adapter.path
        for device in client.tree.devices where device.adapterPath == path && device.rssi != nil {
            report(device, advertisement: true)
        }
        if let interval = filter.watchdogInterval {
            // Holds the discovery only between naps, so that dropping it frees it.
            let task = Task { [weak self] in
                let tick = max(interval / 4, .milliseconds(20))
                while !Task.isCancelled {
                    await nap(tick)
                    guard !Task.isCancelled, let discovery = self else { return }
                    discovery.watchdogTick(interval: interval, tick: tick)
                }
            }
            state.withLock { $0.watchdog = task }
        }
    }

    private var adapterPath: DBusObjectPath { DBusObjectPath(stringLiteral: adapter.path) }

    private func startOnBlueZ() async throws(BlueZError) {
        switch mode {
        case .active:
            try await setFilter(active: true)
            try await callAdapter("StartDiscovery", tolerating: ["org.bluez.Error.InProgress"])
        case .passive:
            exportMonitor()
            do {
                _ = try await connection.call(
                    destination: BlueZName.service, path: adapterPath, interface: BlueZName.monitorManager,
                    method: "RegisterMonitor", arguments: [.objectPath(monitorRoot)], timeout: .seconds(10))
            } catch {
                if error.name == "org.bluez.Error.AlreadyExists" { return }
                throw mapAdapterError(error, operation: "register advertisement monitor")
            }
        }
    }

    private func setFilter(active: Bool) async throws(BlueZError) {
        var entries: [(String, DBusValue)] = []
        if active {
            entries.append(("Transport", .string(filter.transport.rawValue)))
            entries.append(("DuplicateData", .boolean(filter.duplicateData)))
            let uuids = filter.serviceUUIDs.compactMap(bluezUUIDString)
            if !uuids.isEmpty { entries.append(("UUIDs", .array("s", uuids.map { .string($0) }))) }
            if let rssi = filter.rssiThreshold { entries.append(("RSSI", .int16(rssi))) }
        }
        let name = adapter.name
        do {
            _ = try await connection.call(
                destination: BlueZName.service, path: adapterPath, interface: BlueZName.adapter,
                method: "SetDiscoveryFilter", arguments: [.stringVariantDictionary(entries)], timeout: .seconds(10))
        } catch {
            if error.name == "org.bluez.Error.NotSupported" {
                client.logger.warning("adapter \(name): SetDiscoveryFilter not supported; scanning without a filter")
                return
            }
            if error.name == "org.bluez.Error.InvalidArguments" {
                throw .invalidArgument("adapter \(name): BlueZ rejected the discovery filter: \(error.message)")
            }
            throw mapAdapterError(error, operation: "set discovery filter")
        }
    }

    private func callAdapter(_ method: String, tolerating: Set<String>) async throws(BlueZError) {
        do {
            _ = try await connection.call(
                destination: BlueZName.service, path: adapterPath, interface: BlueZName.adapter, method: method,
                timeout: .seconds(10))
        } catch {
            if tolerating.contains(error.name) { return }
            throw mapAdapterError(error, operation: method)
        }
    }

    private func mapAdapterError(_ error: DBusError, operation: String) -> BlueZError {
        let name = adapter.name
        switch error.name {
        case "org.bluez.Error.NotReady":
            return .adapterUnavailable(adapter: name, reason: "powered off (\(operation): \(error.message))")
        case DBusError.unknownObject, DBusError.unknownMethod:
            return .adapterUnavailable(adapter: name, reason: "gone (\(operation): \(error.name))")
        case DBusError.serviceUnknown, DBusError.noReply, DBusError.disconnected:
            return .bluetoothdUnavailable(reason: "\(operation): \(BlueZDBusFailure(error))")
        case DBusError.cancelled:
            return .cancelled(operation: "adapter \(name): \(operation)")
        default:
            return .failed(device: nil, operation: "adapter \(name): \(operation)", failure: .init(error))
        }
    }

    /// StopDiscovery the way bleak does it: `InProgress` is a kernel stop/restart race, recovered with
    /// Start+Stop; `NotReady` (powered off) and `Failed "No discovery started"` mean there is nothing to stop.
    private func stopOnBlueZ() async {
        let name = adapter.name
        switch mode {
        case .active:
            for attempt in 0..<4 {
                do {
                    _ = try await connection.call(
                        destination: BlueZName.service, path: adapterPath, interface: BlueZName.adapter,
                        method: "StopDiscovery", timeout: .seconds(10))
                    break
                } catch {
                    if error.name == "org.bluez.Error.InProgress", attempt < 3 {
                        client.logger.debug("StopDiscovery on \(name): InProgress; retrying with Start+Stop")
                        await nap(.milliseconds(50 * (attempt + 1)))
                        _ = try? await connection.call(
                            destination: BlueZName.service, path: adapterPath, interface: BlueZName.adapter,
                            method: "StartDiscovery", timeout: .seconds(10))
                        continue
                    }
                    client.logger.debug("StopDiscovery on \(name): \(error) (nothing to stop)")
                    break
                }
            }
            try? await setFilter(active: false)
        case .passive:
            _ = try? await connection.call(
                destination: BlueZName.service, path: adapterPath, interface: BlueZName.monitorManager,
                method: "UnregisterMonitor", arguments: [.objectPath(monitorRoot)], timeout: .seconds(5))
        }
    }

    /// Stops scanning, ends the event stream and closes the session's connection. Idempotent.
    public func stop() async {
        let (first, subs, watchdog, restarting, bound) = state.withLock { s in
            let first = !s.stopped
            s.stopped = true
            defer { s.subscriptions = [] }
            return (first, s.subscriptions, s.watchdog, s.restarting, s.bound)
        }
        guard first else { return }
        watchdog?.cancel()
        restarting?.cancel()
        for sub in subs { client.unsubscribe(sub) }
        if bound, client.isBluetoothdRunning { await stopOnBlueZ() }
        continuation.finish()
        await connection.closeAndWait()
    }

    /// Ends the discovery on its own (bus lost, adapter removed): what `stop()` does, without calls to BlueZ.
    private func end(_ reason: BlueZError) {
        let (first, subs, watchdog, restarting) = state.withLock { s in
            let first = !s.stopped
            s.stopped = true
            if first { s.endReason = reason }
            defer { s.subscriptions = [] }
            return (first, s.subscriptions, s.watchdog, s.restarting)
        }
        guard first else { return }
        client.logger.warning("discovery on \(adapter.name) ended: \(reason)")
        watchdog?.cancel()
        restarting?.cancel()
        for sub in subs { client.unsubscribe(sub) }
        continuation.finish()
        let connection = self.connection
        Task { await connection.closeAndWait() }
    }

    /// Restarts scanning on BlueZ (after a bluetoothd restart, a rebind, or when the watchdog finds it stopped).
    private func restart(_ why: String) {
        state.withLock { s in
            guard !s.stopped, s.bound, s.restarting == nil else { return }
            s.restarts += 1
            s.lastActivity = .now
            s.restarting = Task { [weak self] in await self?.performRestart(why) }
        }
    }

    private func performRestart(_ why: String) async {
        client.logger.info("discovery on \(adapter.name): \(why); restarting it")
        if mode == .active { await stopOnBlueZ() }
        do {
            try await startOnBlueZ()
        } catch {
            client.logger.warning("discovery on \(adapter.name): restart failed: \(error)")
        }
        state.withLock {
            $0.restarting = nil
            $0.lastActivity = .now
            $0.restartEnded = .now
        }
    }

    /// Restarts when discovery really stopped (Discovering=false that we did not cause: a power cycle, a kernel
    /// reset), or, when every advertisement is expected (duplicate data on), after `interval` of silence. With
    /// duplicate data off, silence is normal (BlueZ signals nothing for an unchanged advertisement) and restarting
    /// would only make StopDiscovery drop temporary devices.
    private func watchdogTick(interval: Duration, tick: Duration) {
        var silent = Duration.zero
        var busy = false
        continuation.emit(all: {
            state.withLock { s -> [BlueZDiscoveryEvent] in
                var flush: [BlueZDevice] = []
                let now = ContinuousClock.now
                for (path, entry) in s.held where entry.until <= now {
                    flush.append(entry.device)
                    s.held[path] = nil
                }
                flush.sort { $0.path < $1.path }
                silent = now - s.lastActivity
                busy = s.restarting != nil || !s.bound || s.stopped
                return flush.map { .lost($0) }
            }
        })
        guard !busy, client.isBluetoothdRunning, let current = client.tree.adapter(at: adapter.path), current.powered
        else { return }
        if mode == .active, !current.discovering, silent > tick {
            restart("the adapter is no longer discovering")
        } else if filter.duplicateData, silent > interval {
            restart("no advertisement for \(formatSeconds(silent.seconds)) s")
        }
    }

    // MARK: events

    private func handle(_ event: BlueZTreeEvent, _ tree: BlueZObjectTree) {
        let current = state.withLock { $0.bound ? $0.adapter.path : nil }
        switch event {
        case .interfacesAdded(let path, let interfaces):
            if interfaces[BlueZName.adapter] != nil, current == nil, let selector, let a = tree.adapter(at: path),
                selector.matches(a)
            {
                rebind(a, why: "adapter \(a.name) appeared")
                return
            }
            guard interfaces[BlueZName.device] != nil, let device = tree.device(at: path),
                device.adapterPath == current
            else { return }
            report(device, advertisement: device.rssi != nil)
        case .propertiesChanged(let path, BlueZName.device, let changed, _):
            guard !advertisementKeys.isDisjoint(with: changed.keys), let device = tree.device(at: path),
                device.adapterPath == current
            else { return }
            report(device, advertisement: true)
        case .interfacesRemoved(let path, let names, let previous) where names.contains(BlueZName.device):
            continuation.emit {
                state.withLock { s -> BlueZDiscoveryEvent? in
                    guard let first = s.reported.removeValue(forKey: path) else { return nil }
                    let device = previous[BlueZName.device].map { BlueZDevice(path: path, properties: $0) } ?? first
                    // Our own StopDiscovery drops temporary devices: hold them until they come back or stay away.
                    let now = ContinuousClock.now
                    if s.restarting != nil || s.restartEnded.map({ now - $0 < .seconds(2) }) == true {
                        s.held[path] = (device, now + Self.restartGrace)
                        return nil
                    }
                    return .lost(device)
                }
            }
        case .interfacesRemoved(let path, let names, _) where names.contains(BlueZName.adapter) && path == current:
            adapterRemoved()
        case .propertiesChanged(let path, BlueZName.adapter, let changed, _)
        where path == current && changed["Powered"]?.bool == false:
            // Powered off: the devices it dropped are gone, whatever our watchdog was doing. A restart that began
            // between Discovering=false and Powered=false (the order bluetoothd, and the simulator, signal them in)
            // held them as dropped by our own StopDiscovery; they are lost now, not 11 s later.
            continuation.emit(all: {
                state.withLock { s -> [BlueZDiscoveryEvent] in
                    let devices = s.held.values.map(\.device).sorted { $0.path < $1.path }
                    s.held = [:]
                    return devices.map { .lost($0) }
                }
            })
        case .daemonLost(_, let busLost):
            loseAll()
            if busLost {
                end(
                    .busUnavailable(
                        BlueZDBusFailure(name: DBusError.disconnected, message: "the system bus connection was lost")))
            }
        case .reloaded:
            guard client.isBluetoothdRunning else { return }
            if let current, tree.adapter(at: current) != nil {
                // After a restart bluetoothd has no record of our session: start it again.
                restart("bluetoothd (re)appeared")
            } else if let selector, let a = tree.adapters.first(where: selector.matches) {
                rebind(a, why: "bluetoothd (re)appeared with adapter \(a.name)")
            } else if current != nil {
                adapterRemoved()
            }
        default:
            return
        }
    }

    /// Every reported (and held) device is lost.
    private func loseAll() {
        continuation.emit(all: {
            state.withLock { s -> [BlueZDiscoveryEvent] in
                defer {
                    s.reported = [:]
                    s.held = [:]
                }
                let lost = (Array(s.reported.values) + s.held.values.map(\.device)).sorted { $0.path < $1.path }
                return lost.map { .lost($0) }
            }
        })
    }

    /// The adapter left the tree: devices are lost; with a selector, wait for a matching adapter, else end.
    private func adapterRemoved() {
        loseAll()
        let name = adapter.name
        guard selector != nil else {
            end(.adapterUnavailable(adapter: name, reason: "adapter removed"))
            return
        }
        let restarting = state.withLock { s -> Task<Void, Never>? in
            s.bound = false
            defer { s.restarting = nil }
            return s.restarting
        }
        restarting?.cancel()
        client.logger.warning(
            "discovery on \(name): adapter removed; waiting for an adapter matching \(selector?.description ?? "")")
    }

    private func rebind(_ adapter: BlueZAdapter, why: String) {
        let ok = state.withLock { s -> Bool in
            guard !s.stopped else { return false }
            s.adapter = adapter
            s.bound = true
            return true
        }
        if ok { restart(why) }
    }

    private func report(_ device: BlueZDevice, advertisement: Bool) {
        guard advertisement else { return }
        let now = ContinuousClock.now
        continuation.emit {
            state.withLock { s in
                guard !s.stopped else { return nil }
                return Self.report(device, now: now, in: &s, filter: filter)
            }
        }
    }

    /// An advertisement (the client's fast path, on the I/O thread): `report` and the adapter check of `handle` in
    /// one pass under the lock.
    private func advertised(_ device: BlueZDevice) {
        let now = ContinuousClock.now
        continuation.emit {
            state.withLock { s in
                guard !s.stopped, s.bound, device.adapterPath == s.adapter.path else { return nil }
                return Self.report(device, now: now, in: &s, filter: filter)
            }
        }
    }

    private static func report(
        _ device: BlueZDevice, now: ContinuousClock.Instant, in s: inout State, filter: BlueZDiscoveryFilter
    ) -> BlueZDiscoveryEvent? {
        s.lastActivity = now
        if s.reported.index(forKey: device.path) != nil { return .updated(device) }
        if s.held.removeValue(forKey: device.path) != nil {
            // Back after our own restart dropped it: not news.
            s.reported[device.path] = device
            return .updated(device)
        }
        guard filter.matches(device) else { return nil }
        s.reported[device.path] = device
        return .appeared(device)
    }

    /// Events dropped because the consumer fell behind (it got the current devices instead).
    public var droppedEvents: Int { continuation.droppedCount }

    /// Keeps the view of the consumer of `events` consistent: `appeared` once per device, `lost` only for a device
    /// it knows (events are made on several threads and queued, and an overflow replaces dropped ones).
    func normalize(_ event: BlueZDiscoveryEvent) -> BlueZDiscoveryEvent? {
        delivered.withLock { known in
            switch event {
            case .appeared(let d), .updated(let d):
                // The value kept is the one `lost` reports after a resync; the device as first delivered will do,
                // and not storing every update saves a copy per advertisement.
                if known.index(forKey: d.path) != nil { return .updated(d) }
                known[d.path] = d
                return .appeared(d)
            case .lost(let d):
                return known.removeValue(forKey: d.path) != nil ? .lost(d) : nil
            }
        }
    }

    /// After an overflow: `lost` for every device the consumer knows that is gone, then every reported device as
    /// it is now in the tree (normalised to `appeared` for the ones the consumer never got).
    func resyncEvents() -> [BlueZDiscoveryEvent] {
        let (reported, held) = state.withLock { ($0.reported, $0.held) }
        let known = delivered.withLock { $0 }
        var out: [BlueZDiscoveryEvent] = []
        for (path, d) in known.sorted(by: { $0.key < $1.key }) where reported[path] == nil && held[path] == nil {
            out.append(.lost(d))
        }
        for (path, d) in reported.sorted(by: { $0.key < $1.key }) {
            out.append(.updated(client.tree.device(at: path) ?? d))
        }
        return out
    }

    // MARK: passive scanning

    private func exportMonitor() {
        guard let server else { return }
        let monitorPath = monitorRoot.appending("monitor0")
        let found: DBusMethodHandler = { [weak self] call in
            if let self, let path = call.arguments.first?.objectPath?.rawValue,
                let device = self.client.tree.device(at: path)
            {
                self.report(device, advertisement: true)
            }
            return .reply([])
        }
        let lost: DBusMethodHandler = { [weak self] call in
            if let self, let path = call.arguments.first?.objectPath?.rawValue {
                self.continuation.emit {
                    self.state.withLock { $0.reported.removeValue(forKey: path) }.map { .lost($0) }
                }
            }
            return .reply([])
        }
        let spec = DBusInterfaceSpec(
            BlueZName.monitor,
            methods: [
                DBusMethodSpec("Release") { _ in .reply([]) },
                DBusMethodSpec("Activate") { _ in .reply([]) },
                DBusMethodSpec("DeviceFound", in: "o", argumentNames: ["device"], handler: found),
                DBusMethodSpec("DeviceLost", in: "o", argumentNames: ["device"], handler: lost),
            ],
            properties: [
                DBusPropertySpec("Type", "s"), DBusPropertySpec("Patterns", "a(yyay)"),
            ])
        let patterns = filter.effectivePatterns.map {
            DBusValue.structure([.byte($0.start), .byte($0.adType), .bytes($0.content)])
        }
        var props: [String: DBusValue] = ["Type": .string("or_patterns"), "Patterns": .array("(yyay)", patterns)]
        if let rssi = filter.rssiThreshold {
            props["RSSILowThreshold"] = .int16(rssi)
        }
        if server.hasObject(at: monitorPath) { return }
        server.addInterfaces(at: monitorPath, [(spec, props)])
        server.flush()
    }
}

extension BlueZClient {
    /// Starts a discovery on `adapter`.
    ///
    /// Passive scanning is used when `filter.passive` is set, the adapter offers `AdvertisementMonitorManager1`,
    /// and there is at least one pattern (explicit or from service UUIDs); otherwise it falls back to active
    /// scanning and logs why. The discovery ends (`endReason`) when this adapter is removed.
    ///
    /// With a `consumer`, each event is handed to it as soon as it happens, on the thread that saw it (usually the
    /// client's D-Bus I/O thread, before the next signal is dispatched), one at a time and in order, and `events`
    /// carries nothing but its end: no queue and no thread hop, the cheapest path for a consumer that decodes and
    /// forwards. The consumer must return quickly and must not wait for BlueZ.
    /// - Throws: `BlueZError.adapterUnavailable` (absent or powered off), `.invalidArgument` (filter rejected).
    public func startDiscovery(
        on adapter: BlueZAdapter, filter: BlueZDiscoveryFilter = BlueZDiscoveryFilter(),
        consumer: (@Sendable (BlueZDiscoveryEvent) -> Void)? = nil
    ) async throws(BlueZError) -> BlueZDiscovery {
        try await startDiscovery(adapter, selector: nil, filter: filter, consumer: consumer)
    }

    /// Starts a discovery on the adapter `selector` picks now, and keeps it on a matching adapter: when that adapter
    /// is removed its devices are reported lost, and the discovery resumes on the next adapter that matches (the
    /// same controller back under a new name, when selected by address).
    /// A `consumer` takes the events as with `startDiscovery(on:filter:consumer:)`.
    /// - Throws: `BlueZError.adapterUnavailable` when no matching adapter is on and powered now, and what
    ///   `startDiscovery(on:filter:consumer:)` throws.
    public func startDiscovery(
        onAdapter selector: BlueZAdapterSelector, filter: BlueZDiscoveryFilter = BlueZDiscoveryFilter(),
        consumer: (@Sendable (BlueZDiscoveryEvent) -> Void)? = nil
    ) async throws(BlueZError) -> BlueZDiscovery {
        guard case .on(let adapter) = adapterState(selector) else { throw unavailable(selector) }
        return try await startDiscovery(adapter, selector: selector, filter: filter, consumer: consumer)
    }

    private func startDiscovery(
        _ adapter: BlueZAdapter, selector: BlueZAdapterSelector?, filter: BlueZDiscoveryFilter,
        consumer: (@Sendable (BlueZDiscoveryEvent) -> Void)?
    ) async throws(BlueZError) -> BlueZDiscovery {
        guard let current = tree.adapter(at: adapter.path) else {
            throw .adapterUnavailable(adapter: adapter.name, reason: "gone")
        }
        guard current.powered else {
            throw .adapterUnavailable(adapter: adapter.name, reason: "powered off (try 'bluetoothctl power on')")
        }
        let (mode, reason) = BlueZDiscovery.scanMode(adapter: current, filter: filter)
        if let reason { logger.warning("passive scanning unavailable: \(reason); using active scanning") }
        let connection = try await Self.openConnectionOffPool(bus)
        let discovery = BlueZDiscovery(
            client: self, adapter: current, selector: selector, filter: filter, mode: mode, fallbackReason: reason,
            connection: connection, consumer: consumer)
        try await discovery.begin()
        logger.debug("discovery started on \(adapter.name) (\(mode.rawValue))")
        return discovery
    }
}
