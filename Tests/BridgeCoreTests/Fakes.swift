// In-memory ports for the bridge core: a BLE central and its links, an MQTT transport, and a manual clock. Tests
// drive them (push advertisements, notifications, incoming messages; advance time) and read what the bridge did
// (connects, subscriptions, writes, publishes). Everything is behind a Mutex, so any task may use them.
import BridgeCore
import GATT
import Logging
import Synchronization
import Testing

// MARK: Waiting

/// A wait that did not end in time.
struct TimeoutError: Error, CustomStringConvertible {
    /// What was waited for.
    let description: String
}

/// Polls `condition` (yielding, then sleeping a millisecond between polls) until it holds or `seconds` of real time
/// have passed. A bound, never a synchronisation: the condition is what the test waits for.
func eventually(
    _ what: @autoclosure () -> String, within seconds: Double = 30, _ condition: () throws -> Bool
) async throws {
    let deadline = ContinuousClock.now + .milliseconds(Int64(seconds * 1000))
    var polls = 0
    while true {
        if try condition() { return }
        if ContinuousClock.now >= deadline {
            throw TimeoutError(description: "timed out after \(seconds) s: \(what())")
        }
        polls += 1
        if polls < 200 { await Task.yield() } else { try await Task.sleep(for: .milliseconds(1)) }
    }
}

// MARK: Clock

/// Manual time. `sleep(until:)` suspends until `advance(by:)` moves `now` past the deadline (or the task is
/// cancelled); `advance` resumes the due sleepers in deadline order, setting `now` to each deadline in turn.
final class TestClock: BridgeClock {
    struct Sleeper {
        let id: UInt64
        let deadline: Duration
        let continuation: CheckedContinuation<Void, any Error>
    }

    struct State {
        var now: Duration = .zero
        var nextID: UInt64 = 0
        var sleepers: [Sleeper] = []
    }

    let state = Mutex(State())
    /// Wall-clock seconds at `now == 0`: 2026-12-01T00:00:00Z.
    let wallOrigin: Double

    init(wallOrigin: Double = 1_796_083_200) { self.wallOrigin = wallOrigin }

    var now: Duration { state.withLock { $0.now } }

    var wallClock: Double { wallOrigin + now.seconds }

    func sleep(until deadline: Duration) async throws {
        let id = state.withLock { s -> UInt64 in
            s.nextID += 1
            return s.nextID
        }
        try await withTaskCancellationHandler {
            try await withCheckedThrowingContinuation { (c: CheckedContinuation<Void, any Error>) in
                let immediate = state.withLock { s -> Result<Void, any Error>? in
                    if Task.isCancelled { return .failure(CancellationError()) }
                    if deadline <= s.now { return .success(()) }
                    s.sleepers.append(Sleeper(id: id, deadline: deadline, continuation: c))
                    return nil
                }
                if let immediate { c.resume(with: immediate) }
            }
        } onCancel: {
            let c = state.withLock { s -> CheckedContinuation<Void, any Error>? in
                guard let i = s.sleepers.firstIndex(where: { $0.id == id }) else { return nil }
                return s.sleepers.remove(at: i).continuation
            }
            c?.resume(throwing: CancellationError())
        }
    }

    /// Moves time forward by `duration`, resuming every sleeper whose deadline is reached, earliest first.
    func advance(by duration: Duration) {
        let target = now + duration
        while true {
            let due = state.withLock { s -> [Sleeper]? in
                guard let earliest = s.sleepers.map(\.deadline).min(), earliest <= target else {
                    s.now = max(s.now, target)
                    return nil
                }
                s.now = max(s.now, earliest)
                let due = s.sleepers.filter { $0.deadline == earliest }
                s.sleepers.removeAll { $0.deadline == earliest }
                return due
            }
            guard let due else { return }
            for sleeper in due { sleeper.continuation.resume() }
        }
    }

    /// The deadlines of the tasks sleeping now, relative to `now`.
    var pendingDelays: [Duration] {
        state.withLock { s in s.sleepers.map { $0.deadline - s.now }.sorted() }
    }

    /// True when some task sleeps with a deadline `range` away from now.
    func hasSleeper(in range: ClosedRange<Duration>) -> Bool { pendingDelays.contains { range.contains($0) } }

    /// True when some task sleeps until exactly `deadline` (absolute).
    func hasSleeper(at deadline: Duration) -> Bool {
        state.withLock { $0.sleepers.contains { $0.deadline == deadline } }
    }

    /// True when some task sleeps until after `deadline` (absolute).
    func hasSleeper(after deadline: Duration) -> Bool {
        state.withLock { $0.sleepers.contains { $0.deadline > deadline } }
    }
}

// MARK: BLE link

/// A connected fake device: its characteristics, values to read, recorded writes, notification streams the test
/// pushes into, and a disconnection the test triggers.
final class FakeLink: BLELink {
    /// One write the bridge made.
    struct Write: Equatable, Sendable {
        var uuid: BluetoothUUID
        var value: [UInt8]
        var withResponse: Bool
    }

    struct State {
        var values: [BluetoothUUID: [UInt8]]
        var readErrors: [BluetoothUUID: BLEError] = [:]
        var writeErrors: [BluetoothUUID: BLEError] = [:]
        var reads: [BluetoothUUID] = []
        var writes: [Write] = []
        var subscriptions: [BluetoothUUID] = []
        var streams: [BluetoothUUID: BLENotificationStream.Continuation] = [:]
        var ended: BLEDisconnection?
        var nextWaiter: UInt64 = 0
        var waiters: [UInt64: CheckedContinuation<BLEDisconnection, Never>] = [:]
        var disconnectCalls = 0
        /// While true, writes wait (in `heldWrites`) until the test releases them: a slow peripheral.
        var holdWrites = false
        var heldWrites: [(value: [UInt8], release: CheckedContinuation<Void, Never>)] = []
    }

    let address: BLEAddress
    let adapter: String
    let characteristics: [BLECharacteristic]
    let state: Mutex<State>
    /// The next scripted failure of a subscription to this characteristic, if any (`FakeCentral.failSubscriptions`).
    let takeSubscribeError: @Sendable (BluetoothUUID) -> BLEError?

    init(
        address: BLEAddress, adapter: String, characteristics: [BLECharacteristic], values: [BluetoothUUID: [UInt8]],
        takeSubscribeError: @escaping @Sendable (BluetoothUUID) -> BLEError? = { _ in nil }
    ) {
        self.address = address
        self.adapter = adapter
        self.characteristics = characteristics
        self.takeSubscribeError = takeSubscribeError
        state = Mutex(State(values: values))
    }

    func read(_ characteristic: BLECharacteristic) async throws(BLEError) -> [UInt8] {
        let result = state.withLock { s -> Result<[UInt8], BLEError> in
            s.reads.append(characteristic.uuid)
            if s.ended != nil { return .failure(BLEError(.notConnected, message: "\(address) is not connected")) }
            if let e = s.readErrors[characteristic.uuid] { return .failure(e) }
            guard let v = s.values[characteristic.uuid] else {
                return .failure(BLEError(.notSupported, message: "\(characteristic.uuid) has no value"))
            }
            return .success(v)
        }
        return try result.get()
    }

    func write(_ characteristic: BLECharacteristic, _ value: [UInt8], withResponse: Bool) async throws(BLEError) {
        if state.withLock({ $0.holdWrites }) {
            await withCheckedContinuation { (c: CheckedContinuation<Void, Never>) in
                state.withLock { $0.heldWrites.append((value, c)) }
            }
        }
        let result = state.withLock { s -> Result<Void, BLEError> in
            if s.ended != nil { return .failure(BLEError(.notConnected, message: "\(address) is not connected")) }
            if let e = s.writeErrors[characteristic.uuid] { return .failure(e) }
            s.writes.append(Write(uuid: characteristic.uuid, value: value, withResponse: withResponse))
            s.values[characteristic.uuid] = value
            return .success(())
        }
        try result.get()
    }

    func notifications(_ characteristic: BLECharacteristic) async throws(BLEError) -> BLENotificationStream {
        if state.withLock({ $0.ended == nil }), let error = takeSubscribeError(characteristic.uuid) { throw error }
        let (stream, continuation) = BLENotificationStream.makeStream()
        let ok = state.withLock { s -> Bool in
            guard s.ended == nil else { return false }
            s.subscriptions.append(characteristic.uuid)
            s.streams[characteristic.uuid] = continuation
            return true
        }
        guard ok else { throw BLEError(.notConnected, message: "\(address) is not connected") }
        return stream
    }

    func waitForDisconnection() async -> BLEDisconnection {
        let id = state.withLock { s -> UInt64 in
            s.nextWaiter += 1
            return s.nextWaiter
        }
        return await withTaskCancellationHandler {
            await withCheckedContinuation { (c: CheckedContinuation<BLEDisconnection, Never>) in
                let now = state.withLock { s -> BLEDisconnection? in
                    if let e = s.ended { return e }
                    if Task.isCancelled { return BLEDisconnection(requested: true, reason: "wait cancelled") }
                    s.waiters[id] = c
                    return nil
                }
                if let now { c.resume(returning: now) }
            }
        } onCancel: {
            let c = state.withLock { $0.waiters.removeValue(forKey: id) }
            c?.resume(returning: BLEDisconnection(requested: true, reason: "wait cancelled"))
        }
    }

    func disconnect() async {
        state.withLock { $0.disconnectCalls += 1 }
        end(BLEDisconnection(requested: true, reason: "disconnected by the bridge"))
    }

    // MARK: Test side

    /// The device sends a notification on `uuid`.
    func notify(_ uuid: BluetoothUUID, _ value: [UInt8]) {
        _ = state.withLock { $0.streams[uuid] }?.yield(value)
    }

    /// The subscription to `uuid` ends with `error`.
    func failNotifications(_ uuid: BluetoothUUID, _ error: BLEError) {
        state.withLock { $0.streams[uuid] }?.finish(throwing: error)
    }

    /// The link ends: on request (the bridge asked, or a shutdown) or not (out of range, timeout).
    func drop(requested: Bool, reason: String = "org.bluez.Reason.Timeout") {
        end(BLEDisconnection(requested: requested, reason: reason))
    }

    func end(_ disconnection: BLEDisconnection) {
        let waiters = state.withLock { s -> [CheckedContinuation<BLEDisconnection, Never>] in
            guard s.ended == nil else { return [] }
            s.ended = disconnection
            let w = Array(s.waiters.values)
            s.waiters = [:]
            return w
        }
        for w in waiters { w.resume(returning: disconnection) }
    }

    /// The values of the writes waiting for `releaseWrite`, oldest first.
    var heldWrites: [[UInt8]] { state.withLock { $0.heldWrites.map(\.value) } }

    /// Lets the held write at `index` complete.
    func releaseWrite(at index: Int) {
        let c = state.withLock { s -> CheckedContinuation<Void, Never>? in
            guard s.heldWrites.indices.contains(index) else { return nil }
            return s.heldWrites.remove(at: index).release
        }
        c?.resume()
    }

    var subscriptions: [BluetoothUUID] { state.withLock { $0.subscriptions } }
    var writes: [Write] { state.withLock { $0.writes } }
    var reads: [BluetoothUUID] { state.withLock { $0.reads } }
    var disconnectCalls: Int { state.withLock { $0.disconnectCalls } }
    var isEnded: Bool { state.withLock { $0.ended != nil } }
}

// MARK: BLE central

/// A BLE central over a table of fake devices. The test pushes advertisements and adapter/bluetoothd events,
/// scripts connect failures, and reads back every connect attempt.
final class FakeCentral: BLECentral {
    /// A device that can be connected: what its links offer.
    struct Device {
        var characteristics: [BLECharacteristic]
        var values: [BluetoothUUID: [UInt8]]
    }

    /// One `connect` call.
    struct Attempt: Equatable, Sendable {
        var address: BLEAddress
        var adapter: String
    }

    struct State {
        var adapters: [BLEAdapterInfo]
        var devices: [BLEAddress: Device] = [:]
        var scriptedErrors: [BLEAddress: [BLEError]] = [:]
        var subscribeErrors: [BLEAddress: [BluetoothUUID: [BLEError]]] = [:]
        var attempts: [Attempt] = []
        var connectedAtStart: [BLEAdvertisement] = []
        var disconnected: [BLEAddress] = []
        var links: [FakeLink] = []
        var scans: [BLEScanRequest] = []
        var stopScans = 0
        var removed: [BLEAddress] = []
        var started = false
        var closed = false
        /// While true, each `connect` waits in `heldConnects` until `releaseConnects()`.
        var holdConnects = false
        var heldConnects: [CheckedContinuation<Void, Never>] = []
        /// Connects in progress now, and the most there ever were at once.
        var connectsInProgress = 0
        var mostConnectsInProgress = 0
    }

    let state: Mutex<State>
    let eventStream: AsyncStream<BLECentralEvent>
    let eventContinuation: AsyncStream<BLECentralEvent>.Continuation

    init(adapters: [String] = ["hci0"]) {
        let infos = adapters.enumerated().map { i, name in
            BLEAdapterInfo(name: name, address: "00:1A:7D:DA:71:0\(i)", powered: true)
        }
        state = Mutex(State(adapters: infos))
        (eventStream, eventContinuation) = AsyncStream<BLECentralEvent>.makeStream()
    }

    func start() async throws(BLEError) -> [BLEAdapterInfo] {
        state.withLock { s in
            s.started = true
            return s.adapters
        }
    }

    func events() -> AsyncStream<BLECentralEvent> { eventStream }

    func adapters() -> [BLEAdapterInfo] { state.withLock { $0.adapters } }

    func startScanning(_ request: BLEScanRequest) async throws(BLEError) {
        state.withLock { $0.scans.append(request) }
    }

    func stopScanning() async { state.withLock { $0.stopScans += 1 } }

    func connect(_ address: BLEAddress, adapter: String, timeout: Duration) async throws(BLEError) -> any BLELink {
        let hold = state.withLock { s -> Bool in
            s.connectsInProgress += 1
            s.mostConnectsInProgress = max(s.mostConnectsInProgress, s.connectsInProgress)
            return s.holdConnects
        }
        if hold {
            await withCheckedContinuation { (c: CheckedContinuation<Void, Never>) in
                state.withLock { $0.heldConnects.append(c) }
            }
        }
        defer { state.withLock { $0.connectsInProgress -= 1 } }
        let result = state.withLock { s -> Result<FakeLink, BLEError> in
            s.attempts.append(Attempt(address: address, adapter: adapter))
            if var errors = s.scriptedErrors[address], !errors.isEmpty {
                let e = errors.removeFirst()
                s.scriptedErrors[address] = errors
                return .failure(e)
            }
            guard let device = s.devices[address] else {
                return .failure(
                    BLEError(.notFound, name: "org.bluez.Error.DoesNotExist", message: "\(address) not found"))
            }
            let link = FakeLink(
                address: address, adapter: adapter, characteristics: device.characteristics, values: device.values,
                takeSubscribeError: { [weak self] uuid in
                    self?.state.withLock { s in
                        guard var errors = s.subscribeErrors[address]?[uuid], !errors.isEmpty else { return nil }
                        let e = errors.removeFirst()
                        s.subscribeErrors[address]?[uuid] = errors
                        return e
                    }
                })
            s.links.append(link)
            return .success(link)
        }
        return try result.get()
    }

    func removeDevice(_ address: BLEAddress, adapter: String) async throws(BLEError) {
        state.withLock { $0.removed.append(address) }
    }

    /// Connects waiting in `holdConnects` now.
    var heldConnectCount: Int { state.withLock { $0.heldConnects.count } }
    /// The most connects there were in progress at once.
    var mostConnectsInProgress: Int { state.withLock { $0.mostConnectsInProgress } }

    /// Holds every connect from now on (true) or lets them through (false).
    func holdConnects(_ hold: Bool) { state.withLock { $0.holdConnects = hold } }

    /// Lets the held connects go on.
    func releaseConnects() {
        let held = state.withLock { s -> [CheckedContinuation<Void, Never>] in
            defer { s.heldConnects = [] }
            return s.heldConnects
        }
        for c in held { c.resume() }
    }

    func connectedDevices() -> [BLEAdvertisement] { state.withLock { $0.connectedAtStart } }

    func disconnect(_ address: BLEAddress, adapter: String) async throws(BLEError) {
        state.withLock { s in
            s.disconnected.append(address)
            s.connectedAtStart.removeAll { $0.address == address }
        }
    }

    /// BlueZ has `address` connected already when the bridge starts (an earlier run's link).
    func leaveConnected(
        _ address: BLEAddress, adapter: String = "hci0", name: String? = nil, services: [BluetoothUUID] = []
    ) {
        state.withLock {
            $0.connectedAtStart.append(
                BLEAdvertisement(address: address, adapter: adapter, name: name, rssi: nil, serviceUUIDs: services))
        }
    }

    /// Devices disconnected through `disconnect(_:adapter:)`.
    var disconnected: [BLEAddress] { state.withLock { $0.disconnected } }

    func close() async { state.withLock { $0.closed = true } }

    // MARK: Test side

    /// Makes `address` connectable with these characteristics and read values.
    func addDevice(
        _ address: BLEAddress, _ characteristics: [BLECharacteristic], values: [BluetoothUUID: [UInt8]] = [:]
    ) {
        state.withLock { $0.devices[address] = Device(characteristics: characteristics, values: values) }
    }

    /// The next connects to `address` fail with these errors, in order.
    func failConnects(to address: BLEAddress, with errors: [BLEError]) {
        state.withLock { $0.scriptedErrors[address, default: []] += errors }
    }

    /// The next subscriptions to `uuid` on `address` (over every connection) fail with these errors, in order.
    func failSubscriptions(to address: BLEAddress, _ uuid: BluetoothUUID, with errors: [BLEError]) {
        state.withLock { $0.subscribeErrors[address, default: [:]][uuid, default: []] += errors }
    }

    /// Delivers a central event to the bridge.
    func send(_ event: BLECentralEvent) { eventContinuation.yield(event) }

    /// Delivers an advertisement.
    func advertise(
        _ address: BLEAddress, adapter: String = "hci0", name: String? = nil, rssi: Int? = -60,
        services: [BluetoothUUID] = [], serviceData: [BluetoothUUID: [UInt8]] = [:]
    ) {
        send(
            .advertisement(
                BLEAdvertisement(
                    address: address, adapter: adapter, name: name, rssi: rssi, serviceUUIDs: services,
                    serviceData: serviceData)))
    }

    var attempts: [Attempt] { state.withLock { $0.attempts } }
    func attempts(to address: BLEAddress) -> [Attempt] { attempts.filter { $0.address == address } }
    func connectCount(adapter: String) -> Int { attempts.filter { $0.adapter == adapter }.count }
    func links(to address: BLEAddress) -> [FakeLink] { state.withLock { $0.links.filter { $0.address == address } } }
    var scans: [BLEScanRequest] { state.withLock { $0.scans } }
    var stopScans: Int { state.withLock { $0.stopScans } }
    var started: Bool { state.withLock { $0.started } }
}

// MARK: MQTT

/// An MQTT transport that records what is published and lets the test inject messages and connection states.
final class FakeMQTT: MQTTTransport {
    let published = Mutex<[BridgeOutgoingMessage]>([])
    let filters = Mutex<[String]>([])
    let received = Mutex(0)
    let incomingStream: AsyncStream<BridgeIncomingMessage>
    let incomingContinuation: AsyncStream<BridgeIncomingMessage>.Continuation
    let stateStream: AsyncStream<BridgeTransportState>
    let stateContinuation: AsyncStream<BridgeTransportState>.Continuation

    init(initialState: BridgeTransportState = .connected) {
        (incomingStream, incomingContinuation) = AsyncStream<BridgeIncomingMessage>.makeStream()
        (stateStream, stateContinuation) = AsyncStream<BridgeTransportState>.makeStream()
        stateContinuation.yield(initialState)
    }

    /// The broker shared with other FakeMQTTs (multi-gateway tests); nil: this transport stands alone.
    let broker = Mutex<FakeBroker?>(nil)

    func publish(_ message: BridgeOutgoingMessage) throws(BridgeTransportError) {
        published.withLock { $0.append(message) }
        journal.withLock { $0.append("publish \(message.topic)") }
        broker.withLock { $0 }?.route(message)
    }

    /// Publishes (`publish <topic>`) and finished subscribes (`subscribed <filter>`), in the order they happened.
    let journal = Mutex<[String]>([])

    /// While held (`holdSubscribes`), a subscribe waits in it, as for a SUBACK that has not come yet, until
    /// `releaseSubscribes`.
    let heldSubscribes = Mutex<(holding: Bool, waiting: [CheckedContinuation<Void, Never>])>((false, []))

    func holdSubscribes() { heldSubscribes.withLock { $0.holding = true } }

    func releaseSubscribes() {
        let waiting = heldSubscribes.withLock { h in
            h.holding = false
            defer { h.waiting = [] }
            return h.waiting
        }
        for w in waiting { w.resume() }
    }

    /// What the broker holds retained (`retain(_:_:)`), delivered on every matching subscribe, as a broker does.
    let retainedMessages = Mutex<[(topic: String, text: String)]>([])
    /// Whether `incoming()` was called: before that, messages are lost (the port's contract: "from now on").
    let listening = Mutex(false)
    /// Retained messages a subscribe delivered while nobody listened.
    let lostRetained = Mutex(0)

    func subscribe(_ filter: String) async throws(BridgeTransportError) {
        filters.withLock { $0.append(filter) }
        if heldSubscribes.withLock({ $0.holding }) {
            await withCheckedContinuation { (w: CheckedContinuation<Void, Never>) in
                let held = heldSubscribes.withLock { h -> Bool in
                    if h.holding { h.waiting.append(w) }
                    return h.holding
                }
                if !held { w.resume() }
            }
        }
        journal.withLock { $0.append("subscribed \(filter)") }
        let held = broker.withLock { $0 }?.retainedMessages ?? retainedMessages.withLock { $0 }
        let matching = held.filter { Self.matches(filter, $0.topic) }
        guard !matching.isEmpty else { return }
        if listening.withLock({ $0 }) {
            for m in matching { inject(m.topic, m.text, retain: true) }
        } else {
            lostRetained.withLock { $0 += matching.count }
        }
    }

    func incoming() -> AsyncStream<BridgeIncomingMessage> {
        listening.withLock { $0 = true }
        return incomingStream
    }

    /// The broker holds `text` retained on `topic` (for subscribes from now on).
    func retain(_ topic: String, _ text: String) { retainedMessages.withLock { $0.append((topic, text)) } }

    static func matches(_ filter: String, _ topic: String) -> Bool {
        let f = filter.split(separator: "/", omittingEmptySubsequences: false)
        let t = topic.split(separator: "/", omittingEmptySubsequences: false)
        for (i, level) in f.enumerated() {
            if level == "#" { return true }
            if i >= t.count { return false }
            if level != "+" && level != t[i] { return false }
        }
        return f.count == t.count
    }

    /// How many times the reader of `states()` asked for a state: once more than it has finished handling.
    let statesAsked = Mutex(0)

    func states() -> AsyncStream<BridgeTransportState> {
        let reader = StateReader(stateStream.makeAsyncIterator())
        return AsyncStream(unfolding: { [self] in
            self.statesAsked.withLock { $0 += 1 }
            return await reader.next()
        })
    }

    /// The one reader of the state stream, for `states()`'s unfolding stream.
    final class StateReader: @unchecked Sendable {
        var iterator: AsyncStream<BridgeTransportState>.Iterator
        init(_ iterator: AsyncStream<BridgeTransportState>.Iterator) { self.iterator = iterator }
        func next() async -> BridgeTransportState? { await iterator.next(isolation: nil) }
    }

    var statistics: BridgeTransportStatistics {
        BridgeTransportStatistics(published: published.withLock { $0.count }, received: received.withLock { $0 })
    }

    // MARK: Test side

    /// A message from the broker.
    func inject(
        _ topic: String, _ text: String, retain: Bool = false, responseTopic: String? = nil,
        correlationData: [UInt8]? = nil
    ) {
        received.withLock { $0 += 1 }
        incomingContinuation.yield(
            BridgeIncomingMessage(
                topic: topic, payload: Array(text.utf8), retain: retain, responseTopic: responseTopic,
                correlationData: correlationData)
        )
    }

    /// The broker connection changes state.
    func setState(_ state: BridgeTransportState) { stateContinuation.yield(state) }

    /// Everything published so far.
    var messages: [BridgeOutgoingMessage] { published.withLock { $0 } }

    /// What was published on `topic`, in order.
    func messages(on topic: String) -> [BridgeOutgoingMessage] { messages.filter { $0.topic == topic } }

    /// Waits for a message on `topic` (the `skip` first ones on it ignored) that satisfies `predicate`.
    @discardableResult
    func waitForMessage(
        on topic: String, skip: Int = 0, within seconds: Double = 30,
        where predicate: (BridgeOutgoingMessage) -> Bool = { _ in true }
    ) async throws -> BridgeOutgoingMessage {
        var found: BridgeOutgoingMessage?
        try await eventually(
            "a message on \(topic) (after \(skip)); got \(messages(on: topic).map(\.text))", within: seconds
        ) {
            found = messages(on: topic).dropFirst(skip).first(where: predicate)
            return found != nil
        }
        guard let found else { throw TimeoutError(description: "no message on \(topic)") }
        return found
    }

    /// Waits for a JSON message on `topic` satisfying `predicate`, and returns it parsed.
    @discardableResult
    func waitForJSON(
        on topic: String, skip: Int = 0, within seconds: Double = 30,
        where predicate: (JSONValue) -> Bool = { _ in true }
    ) async throws -> JSONValue {
        let m = try await waitForMessage(on: topic, skip: skip, within: seconds) { m in
            (try? JSONReader.parse(m.payload)).map(predicate) ?? false
        }
        return try JSONReader.parse(m.payload)
    }
}

// MARK: Harness

/// A running bridge over fresh fakes.
struct BridgeHarness {
    let config: BridgeConfig
    let central: FakeCentral
    let mqtt: FakeMQTT
    let clock: TestClock
    let logs: MemoryLogHandler
    let bridge: Bridge
    let run: Task<Void, Never>

    /// Cancels `run()` and waits (at most `seconds` of real time) for it to return; true when it did.
    @discardableResult
    func stop(within seconds: Double = 20) async -> Bool {
        run.cancel()
        let task = run
        // Unstructured waiters: a task group would wait for a hung `run()` too.
        let (results, continuation) = AsyncStream<Bool>.makeStream()
        Task {
            await task.value
            continuation.yield(true)
        }
        let timer = Task {
            try? await Task.sleep(for: .milliseconds(Int64(seconds * 1000)))
            continuation.yield(false)
        }
        var returned = false
        for await r in results {
            returned = r
            break
        }
        timer.cancel()
        return returned
    }

    /// Sends a request and waits for its answer on `bridge/response/<op>`.
    func request(_ op: String, _ body: String = "") async throws -> JSONValue {
        let topic = "blebridge/bridge/response/\(op)"
        let before = mqtt.messages(on: topic).count
        mqtt.inject("blebridge/bridge/request/\(op)", body)
        return try await mqtt.waitForJSON(on: topic, skip: before)
    }

    /// Sends `payload` to `topic` (a `/set` or `/get`) and waits for the answer on `<topic>/result`.
    func command(_ topic: String, _ payload: String) async throws -> JSONValue {
        let resultTopic = topic.split(separator: "/").prefix(3).joined(separator: "/") + "/result"
        let before = mqtt.messages(on: resultTopic).count
        mqtt.inject(topic, payload)
        return try await mqtt.waitForJSON(on: resultTopic, skip: before)
    }
}

/// Loads `yaml`, starts a bridge over fakes, waits until it is up (birth published, commands subscribed, scanning,
/// ticker asleep), runs `body`, and stops the bridge whatever happens (recording an issue if `run()` hangs).
func withBridge(
    _ yaml: String, adapters: [String] = ["hci0"], gatewayName: String = "testgw",
    setup: (FakeCentral) throws -> Void = { _ in }, _ body: (BridgeHarness) async throws -> Void
) async throws {
    let config = try BridgeConfig.load(text: yaml)
    let central = FakeCentral(adapters: adapters)
    try setup(central)
    let mqtt = FakeMQTT()
    let clock = TestClock()
    let logs = MemoryLogHandler()
    let bridge = Bridge(
        config: config, central: central, mqtt: mqtt, clock: clock, logger: Logger(handler: logs, level: .debug),
        gatewayName: gatewayName)
    let run = Task { await bridge.run() }
    let h = BridgeHarness(
        config: config, central: central, mqtt: mqtt, clock: clock, logs: logs, bridge: bridge, run: run)
    do {
        try await eventually("the bridge is up") {
            !mqtt.messages(on: "blebridge/bridge/state").isEmpty && central.started && !central.scans.isEmpty
                && mqtt.filters.withLock { $0.count } >= BridgeTopics(base: "blebridge").subscriptions.count
                && clock.hasSleeper(in: .seconds(1)...(.seconds(1)))
        }
        try await body(h)
    } catch {
        let stopped = await h.stop()
        if !stopped { Issue.record("run() did not return within 5 s of cancellation") }
        throw error
    }
    let stopped = await h.stop()
    if !stopped { Issue.record("run() did not return within 5 s of cancellation") }
}

// MARK: Values

/// A parsed address (the literal is known good; a typo fails the test instead of trapping).
func address(_ text: String) throws -> BLEAddress { try #require(BLEAddress(text)) }

/// A parsed UUID.
func uuid(_ text: String) throws -> BluetoothUUID { try #require(BluetoothUUID(text)) }

/// A characteristic with BlueZ-like id.
func characteristic(
    _ uuid: BluetoothUUID, service: BluetoothUUID, _ flags: Set<String>, id: String? = nil
) -> BLECharacteristic {
    BLECharacteristic(
        id: id ?? "/org/bluez/hci0/dev/char_\(uuid.description)", uuid: uuid, serviceUUID: service, flags: flags)
}

/// Bytes from hex with optional spaces (`"40 00 01"`).
func hexBytes(_ text: String) throws -> [UInt8] {
    let digits = Array(text.filter { !$0.isWhitespace })
    try #require(digits.count % 2 == 0)
    var out: [UInt8] = []
    var i = 0
    while i < digits.count {
        out.append(try #require(UInt8(String(digits[i...i + 1]), radix: 16)))
        i += 2
    }
    return out
}

extension JSONValue {
    /// The items, if this is an array.
    var items: [JSONValue]? {
        if case .array(let a) = self { return a }
        return nil
    }

    /// The keys, if this is an object.
    var keys: [String]? {
        if case .object(let f) = self { return f.map(\.0) }
        return nil
    }

    /// A number close to `value`.
    func isNumber(near value: Double, tolerance: Double = 1e-9) -> Bool {
        guard let n = number else { return false }
        return abs(n - value) <= tolerance
    }
}

/// The configuration from the docs' first example.
let docsConfig = """
    mqtt:
      url: mqtt://127.0.0.1:1883
    allow_raw_gatt: true
    parsers:
      - name: acme_setpoint
        uuid: 6e400020-b5a3-f393-e0a9-e50e24dcca9e
        fields:
          - {name: setpoint_c, type: s16le, offset: 0, scale: 0.01}
    devices:
      - name: chest_strap
        match: {service: "180D"}
        mode: connected
      - name: balcony
        match: {address: "A4:C1:38:12:34:56"}
        mode: passive
      - name: radiator
        match: {address: "D0:12:34:56:78:9A"}
        mode: connected
        writable: [setpoint_c]
    """

/// A bridge named `id` (its gateway id) on `broker` and `clock`, with its own fake central (`setup` adds devices).
func startGateway(
    _ id: String, config yaml: String, broker: FakeBroker, clock: TestClock,
    setup: (FakeCentral) throws -> Void = { _ in }
) throws -> BridgeHarness {
    let config = try BridgeConfig.load(text: yaml)
    let central = FakeCentral(adapters: ["hci0"])
    try setup(central)
    let mqtt = FakeMQTT()
    broker.attach(mqtt)
    let logs = MemoryLogHandler()
    let bridge = Bridge(
        config: config, central: central, mqtt: mqtt, clock: clock, logger: Logger(handler: logs, level: .debug),
        gatewayName: id)
    let run = Task { await bridge.run() }
    return BridgeHarness(
        config: config, central: central, mqtt: mqtt, clock: clock, logs: logs, bridge: bridge, run: run)
}

/// A broker for several FakeMQTTs: a publish reaches every attached transport whose filters match (the publisher
/// too, as mosquitto does), retained messages are kept (an empty one clears) and delivered on subscribe.
final class FakeBroker: Sendable {
    struct State {
        var clients: [FakeMQTT] = []
        var retained: [(topic: String, text: String)] = []
    }

    let state = Mutex(State())

    func attach(_ client: FakeMQTT) {
        client.broker.withLock { $0 = self }
        state.withLock { $0.clients.append(client) }
    }

    /// The client's connection breaks: it is cut off, and its will (`topic` offline, retained) goes out.
    func cut(_ client: FakeMQTT, will topic: String) {
        client.broker.withLock { $0 = nil }
        state.withLock { $0.clients.removeAll { $0 === client } }
        route(BridgeOutgoingMessage(topic: topic, text: #"{"state":"offline"}"#, retain: true))
    }

    var retainedMessages: [(topic: String, text: String)] { state.withLock { $0.retained } }

    func route(_ message: BridgeOutgoingMessage) {
        let text = String(decoding: message.payload, as: UTF8.self)
        let clients = state.withLock { s -> [FakeMQTT] in
            if message.retain {
                s.retained.removeAll { $0.topic == message.topic }
                if !message.payload.isEmpty { s.retained.append((message.topic, text)) }
            }
            return s.clients
        }
        for c in clients where c.filters.withLock({ $0 }).contains(where: { FakeMQTT.matches($0, message.topic) }) {
            c.inject(message.topic, text)
        }
    }
}
