// BridgeCore's BLE ports over the BlueZ client: one discovery per adapter feeding advertisements, peripherals as
// links, BlueZ errors classified for the core's retry policy.
import BlueZ
import BridgeCore
import GATT
import Logging
import Synchronization

/// `BLECentral` over bluetoothd.
public final class BlueZCentral: BLECentral {
    let client: BlueZClient
    let logger: Logger
    let state = Mutex(State())
    let continuation: AsyncStream<BLECentralEvent>.Continuation
    let stream: AsyncStream<BLECentralEvent>

    struct State {
        var discoveries: [String: BlueZDiscovery] = [:]
        var request: BLEScanRequest?
        var eventsTask: Task<Void, Never>?
        var closed = false
        var powered: [String: Bool] = [:]
        /// Takes scan results directly, when the bridge asked for that.
        var scanResults: (@Sendable (BLECentralEvent) -> Void)?
    }

    /// A central on `bus` (the system bus, or `DBUS_SYSTEM_BUS_ADDRESS`).
    /// - Throws: `BLEError` when the bus cannot be reached.
    public init(bus: BlueZBus = .system, logger: Logger) throws(BLEError) {
        self.logger = logger.labelled(component: "bluez")
        do {
            client = try BlueZClient(bus: bus, logger: self.logger)
        } catch {
            throw BlueZCentral.classify(error)
        }
        (stream, continuation) = AsyncStream<BLECentralEvent>.makeStream(bufferingPolicy: .bufferingNewest(65536))
    }

    /// True while bluetoothd is on the bus.
    public var bluetoothdRunning: Bool { client.isBluetoothdRunning }

    /// The events (one consumer).
    public func events() -> AsyncStream<BLECentralEvent> { stream }

    /// Connects to bluetoothd and reports adapters and daemon restarts from then on.
    public func start() async throws(BLEError) -> [BLEAdapterInfo] {
        do {
            try await client.start()
        } catch {
            throw BlueZCentral.classify(error)
        }
        let events = client.events()
        state.withLock { s in for a in client.adapters { s.powered[a.name] = a.powered } }
        let task = Task { [weak self, continuation] in
            for await event in events {
                guard let self else { return }
                switch event {
                case .bluetoothdStarted: continuation.yield(.bluetoothdStarted)
                case .bluetoothdStopped:
                    self.state.withLock { $0.powered = [:] }
                    self.dropDiscoveries()
                    continuation.yield(.bluetoothdStopped)
                case .busLost(let reason):
                    self.logger.warning("the system bus connection was lost (\(reason)); reconnecting")
                    self.state.withLock { $0.powered = [:] }
                    self.dropDiscoveries()
                    continuation.yield(.bluetoothdStopped)
                case .busRestored:
                    self.logger.info("the system bus is back")
                case .adapterAdded(let a), .adapterChanged(let a):
                    // Only a change of Powered matters here (Discovering flips with every scan start).
                    let was = self.state.withLock { s -> Bool? in
                        let was = s.powered[a.name]
                        s.powered[a.name] = a.powered
                        return was
                    }
                    if a.powered, was != true {
                        continuation.yield(.adapterAdded(Self.info(a)))
                    } else if !a.powered, was == true {
                        self.dropDiscovery(a.name)
                        continuation.yield(.adapterRemoved(a.name))
                    }
                case .adapterRemoved(let a):
                    self.state.withLock { _ = $0.powered.removeValue(forKey: a.name) }
                    self.dropDiscovery(a.name)
                    continuation.yield(.adapterRemoved(a.name))
                }
            }
        }
        state.withLock { $0.eventsTask = task }
        guard client.isBluetoothdRunning else {
            throw BLEError(
                .bluetoothdUnavailable,
                message: "bluetoothd (org.bluez) is not running on the system bus; start bluetooth.service")
        }
        return adapters()
    }

    static func info(_ a: BlueZAdapter) -> BLEAdapterInfo {
        BLEAdapterInfo(name: a.name, address: a.address, powered: a.powered)
    }

    /// The adapters now.
    public func adapters() -> [BLEAdapterInfo] { client.adapters.map(Self.info) }

    /// Forgets the adapter's discovery (released, it ends its BlueZ session).
    func dropDiscovery(_ name: String) {
        _ = state.withLock { $0.discoveries.removeValue(forKey: name) }
    }

    func dropDiscoveries() {
        state.withLock { $0.discoveries = [:] }
    }

    /// Scans on every selected, powered adapter (replacing earlier scans).
    public func startScanning(_ request: BLEScanRequest) async throws(BLEError) {
        state.withLock { $0.request = request }
        let selected = client.adapters.filter { a in
            a.powered
                && (request.adapters.isEmpty || request.adapters.contains(a.name)
                    || request.adapters.contains(a.address.uppercased()))
        }
        guard !selected.isEmpty else {
            let names = request.adapters.isEmpty ? "any adapter" : request.adapters.joined(separator: ", ")
            throw BLEError(.adapterUnavailable, message: "no powered adapter (\(names)); try 'bluetoothctl power on'")
        }
        let filter = BlueZDiscoveryFilter(
            serviceUUIDs: request.serviceUUIDs.map(\.uuidString), duplicateData: request.duplicateData,
            passive: request.passive)
        var firstError: BLEError?
        for adapter in selected {
            if let old = state.withLock({ $0.discoveries.removeValue(forKey: adapter.name) }) { await old.stop() }
            do {
                // Each event is turned into the core's on the D-Bus I/O thread as its signal is dispatched, and
                // goes to the bridge's handler when it asked for one, else into `events()`. The discovery calls
                // the consumer one event at a time, which makes the cache's unsynchronised use safe.
                let name = adapter.name
                let continuation = self.continuation
                let toEvents: @Sendable (BLECentralEvent) -> Void = { event in continuation.yield(event) }
                let deliver = state.withLock { $0.scanResults } ?? toEvents
                let parsed = TextCacheBox()
                let discovery = try await client.startDiscovery(on: adapter, filter: filter) { event in
                    if let e = Self.scanResult(event, adapter: name, cache: &parsed.cache) { deliver(e) }
                }
                state.withLock { $0.discoveries[adapter.name] = discovery }
            } catch {
                logger.warning("cannot scan on \(adapter.name): \(error)")
                firstError = firstError ?? Self.classify(error)
            }
        }
        if state.withLock({ $0.discoveries.isEmpty }), let firstError { throw firstError }
    }

    /// Scan results go to `deliver` from the next scan on, instead of `events()` (see
    /// `BLECentral.deliverScanResults(to:)`).
    public func deliverScanResults(to deliver: @escaping @Sendable (BLECentralEvent) -> Void) {
        state.withLock { $0.scanResults = deliver }
    }

    /// The core's event for a discovery event.
    static func scanResult(_ event: BlueZDiscoveryEvent, adapter: String, cache: inout AdvertisementTextCache)
        -> BLECentralEvent?
    {
        switch event {
        case .appeared(let d), .updated(let d):
            return advertisement(d, adapter: adapter, cache: &cache).map { .advertisement($0) }
        case .lost(let d):
            return BLEAddress(d.address).map { .deviceRemoved($0, adapter: adapter) }
        }
    }

    static func advertisement(_ d: BlueZDevice, adapter: String) -> BLEAdvertisement? {
        var cache = AdvertisementTextCache()
        return advertisement(d, adapter: adapter, cache: &cache)
    }

    /// `advertisement(_:adapter:)`, parsing each address and UUID text once per `cache`.
    static func advertisement(_ d: BlueZDevice, adapter: String, cache: inout AdvertisementTextCache)
        -> BLEAdvertisement?
    {
        guard let address = cache.address(d.address) else { return nil }
        var serviceData: [BluetoothUUID: [UInt8]] = [:]
        for (k, v) in d.serviceData { if let u = cache.uuid(k) { serviceData[u] = v } }
        return BLEAdvertisement(
            address: address, adapter: adapter, name: d.name, rssi: d.rssi.map(Int.init),
            txPower: d.txPower.map(Int.init), serviceUUIDs: d.uuids.compactMap { cache.uuid($0) },
            serviceData: serviceData, manufacturerData: d.manufacturerData)
    }

    /// Stops every scan.
    public func stopScanning() async {
        let all = state.withLock { s -> [BlueZDiscovery] in
            defer { s.discoveries = [:] }
            return Array(s.discoveries.values)
        }
        for discovery in all { await discovery.stop() }
    }

    /// Connects and resolves services; reads every 0x2904 presentation format descriptor.
    public func connect(_ address: BLEAddress, adapter: String, timeout: Duration) async throws(BLEError)
        -> any BLELink
    {
        let bluezAdapter = client.adapters.first { $0.name == adapter }
        let peripheral: BlueZPeripheral
        do {
            peripheral = try await client.connect(
                address: address.text, on: bluezAdapter, options: BlueZConnectOptions(timeout: timeout))
        } catch {
            throw Self.classify(error)
        }
        var characteristics: [BLECharacteristic] = []
        let services = Dictionary(peripheral.services().map { ($0.path, $0.uuid) }) { a, _ in a }
        for c in peripheral.characteristics() {
            guard let uuid = BluetoothUUID(c.uuid) else { continue }
            var format: [UInt8]?
            if let d = peripheral.descriptors(of: c).first(where: {
                BluetoothUUID($0.uuid) == BluetoothUUID(UInt16(0x2904))
            }) {
                format = try? await peripheral.read(d)
            }
            let service = services[c.servicePath].flatMap(BluetoothUUID.init) ?? BluetoothUUID(UInt16(0))
            characteristics.append(
                BLECharacteristic(
                    id: c.path, uuid: uuid, serviceUUID: service, flags: Set(c.flags), presentationFormat: format))
        }
        return BlueZLink(peripheral: peripheral, address: address, adapter: adapter, characteristics: characteristics)
    }

    /// Makes BlueZ forget the device.
    public func removeDevice(_ address: BLEAddress, adapter: String) async throws(BLEError) {
        let d = try knownDevice(address, adapter: adapter)
        do {
            try await client.removeDevice(d)
        } catch {
            throw Self.classify(error)
        }
    }

    /// BlueZ's device `address` on `adapter`.
    func knownDevice(_ address: BLEAddress, adapter: String) throws(BLEError) -> BlueZDevice {
        guard let d = client.device(address: address.text, on: client.adapters.first { $0.name == adapter }) else {
            throw BLEError(.notFound, message: "BlueZ does not know \(address)")
        }
        return d
    }

    /// The devices BlueZ has connected now, on any adapter (asked at start: an earlier run's links).
    public func connectedDevices() -> [BLEAdvertisement] {
        var out: [BLEAdvertisement] = []
        for adapter in client.adapters {
            for d in client.devices(on: adapter) where d.connected {
                if let adv = Self.advertisement(d, adapter: adapter.name) { out.append(adv) }
            }
        }
        return out
    }

    /// Disconnects a device this process holds no link for.
    public func disconnect(_ address: BLEAddress, adapter: String) async throws(BLEError) {
        let d = try knownDevice(address, adapter: adapter)
        do {
            try await client.disconnect(d)
        } catch {
            throw Self.classify(error)
        }
    }

    /// Stops scanning and closes the client.
    public func close() async {
        await stopScanning()
        // Cancelled outside the lock: cancelling runs the task's cancellation handlers on this thread.
        state.withLock { $0.eventsTask }?.cancel()
        continuation.finish()
        client.close()
    }

    /// True for BlueZ's le-connection-abort-by-local (and its BR/EDR twin), in whatever message carries it.
    /// (hasPrefix over the indices: StringProtocol.contains(_:) would link the regex engine, 0.8 MB.)
    static func isLocalAbort(_ message: String) -> Bool {
        message.indices.contains { message[$0...].hasPrefix("abort-by-local") }
    }

    /// The core's class of a BlueZ error.
    static func classify(_ error: BlueZError) -> BLEError {
        let name = error.dbusFailure?.name
        let kind: BLEError.Kind
        switch error {
        case .bluetoothdUnavailable: kind = .bluetoothdUnavailable
        case .busUnavailable: kind = .bluetoothdUnavailable
        case .adapterUnavailable: kind = .adapterUnavailable
        case .deviceNotFound: kind = .notFound
        case .attributeNotFound: kind = .notSupported
        case .notConnected: kind = .notConnected
        case .connectionFailed(_, let reason, _):
            kind = Self.isLocalAbort(reason) ? .connectionAborted : .connectFailed
        case .inProgress: kind = .connectFailed
        case .notPermitted: kind = .notPermitted
        case .notSupported: kind = .notSupported
        case .timeout: kind = .timeout
        case .disconnected: kind = .disconnected
        case .failed(_, _, let f):
            kind = Self.isLocalAbort(f.message) ? .connectionAborted : .failed
        case .invalidArgument: kind = .invalidArgument
        case .cancelled: kind = .cancelled
        case .notificationsEnded: kind = .disconnected
        }
        return BLEError(kind, name: name, message: error.description)
    }
}

/// `BLELink` over a connected `BlueZPeripheral`.
final class BlueZLink: BLELink {
    let peripheral: BlueZPeripheral
    let address: BLEAddress
    let adapter: String
    let characteristics: [BLECharacteristic]

    init(peripheral: BlueZPeripheral, address: BLEAddress, adapter: String, characteristics: [BLECharacteristic]) {
        self.peripheral = peripheral
        self.address = address
        self.adapter = adapter
        self.characteristics = characteristics
    }

    func bluez(_ c: BLECharacteristic) throws(BLEError) -> BlueZCharacteristic {
        guard let found = peripheral.characteristics().first(where: { $0.path == c.id }) else {
            throw BLEError(
                .notSupported, message: "device \(address): characteristic \(c.uuid) is gone (services changed)")
        }
        return found
    }

    func read(_ characteristic: BLECharacteristic) async throws(BLEError) -> [UInt8] {
        let c = try bluez(characteristic)
        do {
            return try await peripheral.read(c)
        } catch {
            throw BlueZCentral.classify(error)
        }
    }

    func write(_ characteristic: BLECharacteristic, _ value: [UInt8], withResponse: Bool) async throws(BLEError) {
        let c = try bluez(characteristic)
        do {
            try await peripheral.write(c, value, type: withResponse ? .request : .command)
        } catch {
            throw BlueZCentral.classify(error)
        }
    }

    func notifications(_ characteristic: BLECharacteristic) async throws(BLEError) -> BLENotificationStream {
        try await session(characteristic, consumer: nil, ended: nil)
    }

    /// Values go straight from the notify reader thread to `deliver`, and the notify session tells its end: no
    /// task per subscription. The watch holds the session's stream (it carries no values); dropping the stream,
    /// when the watch is cancelled or dropped, stops the subscription.
    func subscribe(
        _ characteristic: BLECharacteristic, deliver: @escaping @Sendable ([UInt8]) -> Void,
        ended: @escaping @Sendable ((any Error)?) -> Void
    ) async throws(BLEError) -> BLEWatch {
        let stream = try await session(characteristic, consumer: deliver, ended: ended)
        return BLEWatch { withExtendedLifetime(stream) {} }
    }

    /// The notify session's own stream, its end error already classified (no relay task).
    private func session(
        _ characteristic: BLECharacteristic, consumer: (@Sendable ([UInt8]) -> Void)?,
        ended: (@Sendable ((any Error)?) -> Void)?
    ) async throws(BLEError) -> BLENotificationStream {
        let c = try bluez(characteristic)
        do {
            return try await peripheral.notifications(
                for: c, mapError: { error in BlueZCentral.classify(error) }, consumer: consumer, ended: ended
            ).stream
        } catch {
            throw BlueZCentral.classify(error)
        }
    }

    func waitForDisconnection() async -> BLEDisconnection {
        let reason = await peripheral.waitForDisconnection()
        return BLEDisconnection(requested: reason.requested, reason: reason.description)
    }

    /// Told by the peripheral when the link ends: no task waits for it.
    func watchDisconnection(_ handler: @escaping @Sendable (BLEDisconnection) -> Void) -> BLEWatch {
        let peripheral = self.peripheral
        let id = peripheral.onDisconnection { reason in
            handler(BLEDisconnection(requested: reason.requested, reason: reason.description))
        }
        return BLEWatch {
            if let id { peripheral.removeDisconnectionHandler(id) }
        }
    }

    func disconnect() async { await peripheral.disconnect() }
}

/// Addresses and UUIDs parsed from BlueZ's text, remembered by that text (nil: the text does not parse). Bounded:
/// it starts over once it holds `limit` entries, so random addresses cannot make it grow without end.
/// An `AdvertisementTextCache` used by one discovery consumer, which the discovery calls one event at a time.
final class TextCacheBox: @unchecked Sendable {
    var cache = AdvertisementTextCache()
}

struct AdvertisementTextCache {
    private var addresses: [String: BLEAddress?] = [:]
    private var uuids: [String: BluetoothUUID?] = [:]
    let limit = 4096

    /// `BLEAddress(text)`.
    mutating func address(_ text: String) -> BLEAddress? {
        if let known = addresses[text] { return known }
        if addresses.count >= limit { addresses.removeAll(keepingCapacity: true) }
        let parsed = BLEAddress(text)
        addresses[text] = .some(parsed)
        return parsed
    }

    /// `BluetoothUUID(text)`.
    mutating func uuid(_ text: String) -> BluetoothUUID? {
        if let known = uuids[text] { return known }
        if uuids.count >= limit { uuids.removeAll(keepingCapacity: true) }
        let parsed = BluetoothUUID(text)
        uuids[text] = .some(parsed)
        return parsed
    }
}
