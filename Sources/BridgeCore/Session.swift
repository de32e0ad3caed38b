// Device sessions: the connection state machine of connected and poll devices (connect, resolve, subscribe,
// stream, back off), connection slots per adapter, and the silent-subscription watchdog.
import GATT
import Logging
import Synchronization

/// The backoff policy: exponential with jitter, base and cap by error class (short after
/// `le-connection-abort-by-local`, longer when out of slots or the device is not found).
public struct ReconnectPolicy: Sendable, Equatable {
    /// First delay for ordinary failures.
    public var initial: Duration
    /// Longest delay.
    public var maximum: Duration

    /// A policy.
    public init(initial: Duration, maximum: Duration) {
        self.initial = initial
        self.maximum = maximum
    }

    /// The delay before attempt `attempt` (1-based) after a failure of `kind`; `jitter` in 0...1 spreads it ±20 %.
    public func delay(attempt: Int, kind: BLEError.Kind?, jitter: Double) -> Duration {
        let base: Double
        switch kind {
        case .connectionAborted?: base = min(initial.seconds, 0.5)
        case .notFound?, .adapterUnavailable?, .bluetoothdUnavailable?: base = max(initial.seconds, 1) * 5
        case .noSlots?: base = max(initial.seconds, 1) * 10
        default: base = initial.seconds
        }
        let exponent = Double(min(max(attempt - 1, 0), 30))
        let spread = base * pow2(exponent) * (0.8 + 0.4 * min(max(jitter, 0), 1))
        return .milliseconds(Int64(max(min(spread, maximum.seconds), 0.01) * 1000))
    }
}

func pow2(_ e: Double) -> Double {
    var v = 1.0
    var i = 0.0
    while i < e {
        v *= 2
        i += 1
    }
    return v
}

/// What `Bridge.tick()` watches for a streaming session (see `DeviceData.streamWatch`).
struct StreamWatch: Sendable {
    /// Where the session waits for the first reason to end.
    let ends: AsyncStream<StreamEnd>.Continuation
    /// Whether a subscription going silent ends the stream (false with no subscriptions).
    let silence: Bool
    /// `silence_factor`: how many usual intervals without a notification count as silent.
    let factor: Double
}

/// The tasks that hold back a subscription's `.disconnected` end (`Bridge.subscriptionEnded`), cancelled together
/// when the stream is over; one added after that is cancelled at once.
final class GraceTasks: Sendable {
    private let state = Mutex<(tasks: [Task<Void, Never>], closed: Bool)>(([], false))

    func add(_ task: Task<Void, Never>) {
        let closed = state.withLock { s -> Bool in
            if !s.closed { s.tasks.append(task) }
            return s.closed
        }
        if closed { task.cancel() }
    }

    func cancelAll() {
        let tasks = state.withLock { s -> [Task<Void, Never>] in
            s.closed = true
            defer { s.tasks = [] }
            return s.tasks
        }
        for t in tasks { t.cancel() }
    }
}

/// How a streaming session ended.
enum StreamEnd: Sendable {
    case linkLost(BLEDisconnection)
    case silent(BluetoothUUID, Double)
    case subscriptionEnded(BluetoothUUID, String)
    case stopped
    /// Multi-gateway mode: another gateway serves the device now.
    case handedOver(String)
}

extension Bridge {
    var reconnectPolicy: ReconnectPolicy {
        let b = config.bluetooth
        return ReconnectPolicy(initial: b.reconnectInitialDelay, maximum: b.reconnectMaximumDelay)
    }

    /// Starts the device's session task if it needs one and has none.
    func ensureSession(_ r: DeviceRecord) {
        guard r.config.mode == .connected || r.config.mode == .poll else { return }
        if engine.withLock({ $0.shuttingDown }) { return }
        r.data.withLock { d in
            guard d.sessionTask == nil, !d.userDisconnected else { return }
            d.sessionTask = Task { [self] in
                if r.config.mode == .poll {
                    await self.pollLoop(r)
                } else {
                    await self.connectionLoop(r)
                }
                r.data.withLock { $0.sessionTask = nil }
            }
        }
    }

    func setSession(_ r: DeviceRecord, _ state: SessionState) {
        let old = r.data.withLock { d -> SessionState in
            let old = d.session
            d.session = state
            // A wake-up asked for from now on counts; one from before the backoff began does not.
            if state == .backingOff { d.wakeRequested = false }
            return old
        }
        if old != state { logger.debug("session \(old.rawValue) -> \(state.rawValue)", ["device": r.id]) }
    }

    // MARK: Slots

    /// Whether a usable adapter has a free connection slot (several gateways: one without is no candidate). No
    /// usable adapter known (BlueZ not started yet, adapters down) is not "full": that is a connection failure.
    var hasFreeSlot: Bool {
        engine.withLock { s in
            let usable = s.usableAdapters
            return usable.isEmpty || usable.contains { (s.slots[$0.name] ?? 0) < s.config.bluetooth.connectionSlots }
        }
    }

    /// Takes a connection slot on the adapter that hears the device best among those with a free slot.
    func acquireSlot(_ r: DeviceRecord) -> String? {
        let heard = r.data.withLock { $0.rssiByAdapter }
        let c = config
        return engine.withLock { s -> String? in
            let usable = s.usableAdapters
            let free = usable.filter { (s.slots[$0.name] ?? 0) < c.bluetooth.connectionSlots }
            let ranked = free.sorted { a, b in
                let ra = heard[a.name]?.rssi ?? -200
                let rb = heard[b.name]?.rssi ?? -200
                return ra != rb ? ra > rb : a.name < b.name
            }
            // Only adapters that heard the device, unless none did (a bonded device BlueZ already knows).
            let candidates = ranked.filter { heard[$0.name] != nil }
            guard let chosen = (candidates.isEmpty ? (heard.isEmpty ? ranked.first : nil) : candidates.first) else {
                return nil
            }
            s.slots[chosen.name, default: 0] += 1
            return chosen.name
        }
    }

    /// How many connects an adapter has in progress at once. The controller makes one LE connection at a time
    /// (the kernel queues the rest), so more in flight only wait inside bluetoothd and the kernel, each holding
    /// its D-Bus call, its deadline and the bridge's state for a connect (at start-up with 100 devices, 0.7 MB
    /// at once); the second one lets a connect start while the previous one resolves its services.
    static let connectsPerAdapter = 2

    /// The adapter's connect permits (`connectsPerAdapter`).
    func connectPermits(_ adapter: String) -> AsyncPermits {
        engine.withLock { s in
            if let p = s.connectPermits[adapter] { return p }
            let p = AsyncPermits(Self.connectsPerAdapter)
            s.connectPermits[adapter] = p
            return p
        }
    }

    func releaseSlot(_ adapter: String) {
        engine.withLock { s in s.slots[adapter] = max(0, (s.slots[adapter] ?? 1) - 1) }
        // A device waiting for a slot gets it now instead of sitting out its backoff.
        for r in records where r.data.withLock({ $0.session == .backingOff && $0.lastFailure == .noSlots }) {
            r.wakeSession()
            break
        }
    }

    /// Why no slot was free.
    func noSlotError(_ r: DeviceRecord) -> BLEError {
        let heard = r.data.withLock { $0.rssiByAdapter.keys.sorted() }
        let known = engine.withLock { $0.adapters }
        if known.isEmpty { return BLEError(.adapterUnavailable, message: "no adapter is available") }
        // After bluetoothd starts (or a dongle comes back) the adapter is there before it is powered: that is not
        // a lack of slots.
        if !known.contains(where: \.powered) {
            return BLEError(
                .adapterUnavailable,
                message: "no adapter is powered (\(known.map(\.name).joined(separator: ", ")) off); waiting for one")
        }
        let adapters = known.filter(\.powered).map(\.name)
        if heard.isEmpty || heard.contains(where: adapters.contains) {
            return BLEError(
                .noSlots,
                message:
                    "every connection slot is in use on \(heard.isEmpty ? adapters.joined(separator: ", ") : heard.joined(separator: ", ")) (bluetooth.connection_slots: \(config.bluetooth.connectionSlots))"
            )
        }
        return BLEError(
            .adapterUnavailable, message: "the adapters that heard it (\(heard.joined(separator: ", "))) are gone")
    }

    // MARK: Connected mode

    /// Multi-gateway mode: waits while another gateway serves the device (or our claim has not stood yet). False
    /// when cancelled.
    func waitForOwnership(_ r: DeviceRecord) async -> Bool {
        guard let g = coordination else {
            r.data.withLock { $0.leftConnectedOn = nil }
            return true
        }
        while !Task.isCancelled, !g.mayConnect(r.id) {
            r.data.withLock { $0.handOverTo = nil }
            // An earlier run's link while another gateway serves the device: let it go, or a device that takes one
            // connection stays tied to this radio.
            if let adapter = r.data.withLock({ $0.leftConnectedOn }), let address = r.address,
                let owner = g.owner(of: r.id, wall: clock.wallClock), owner != g.me
            {
                r.data.withLock { $0.leftConnectedOn = nil }
                logger.info(
                    "connected here by an earlier run, but gateway \(owner) serves it: disconnecting", ["device": r.id])
                let central = central
                await uncancelled {
                    do {
                        try await central.disconnect(address, adapter: adapter)
                    } catch {
                        self.logger.warning("cannot disconnect: \(error)", ["device": r.id])
                    }
                }
            }
            if r.data.withLock({ $0.session }) != .standby {
                setSession(r, .standby)
                publishDevices()
            }
            if await waitForRetry(r, delay: .seconds(5)) == false { return false }
        }
        r.data.withLock {
            $0.handOverTo = nil
            // Connecting now: an earlier run's link becomes this session's.
            $0.leftConnectedOn = nil
        }
        return !Task.isCancelled
    }

    func connectionLoop(_ r: DeviceRecord) async {
        var attempt = 0
        var quickDrops = 0
        while !Task.isCancelled {
            if await waitForOwnership(r) == false { break }
            let outcome: Result<StreamEnd, BLEError>
            outcome = await connectAndStream(r)
            if Task.isCancelled { break }
            let kind: BLEError.Kind?
            switch outcome {
            case .success(.stopped):
                setSession(r, .disconnected)
                publishDevices()
                return
            case .success(let end):
                // A link that did not last counts as a failed attempt, so a device that drops right after
                // connecting backs off instead of being retried every fraction of a second.
                let lasted = r.data.withLock { d in d.connectedSince.map { clock.now - $0 } ?? .zero }
                if lasted < .seconds(30) { quickDrops += 1 } else { quickDrops = 1 }
                attempt = 0
                kind = nil
                r.data.withLock { $0.lastFailure = nil }
                let reason: String
                switch end {
                case .linkLost(let d): reason = "link lost (\(d.reason))"
                case .silent(let uuid, let secs):
                    reason = "characteristic \(uuid) silent for \(Int(secs)) s (subscription stalled)"
                case .subscriptionEnded(let uuid, let why): reason = "subscription to \(uuid) ended (\(why))"
                case .stopped: reason = "stopped"
                case .handedOver(let to):
                    // Not a failure: wait for the ownership to come back (waitForOwnership) without a reconnect.
                    publishEvent("handed_over", r, [("to", .string(to))])
                    continue
                }
                count(reconnect: reason.hasPrefix("link") ? "link-lost" : "silent-or-ended")
                r.data.withLock {
                    $0.lastError = reason
                    $0.reconnects += 1
                }
                logger.warning("\(reason); reconnecting", ["device": r.id])
                setAvailability(r, online: false)
                publishEvent("disconnected", r, [("reason", .string(reason))])
            case .failure(let error):
                attempt += 1
                kind = error.kind
                count(reconnect: error.errorName)
                r.data.withLock {
                    $0.lastError = error.message
                    $0.lastFailure = error.kind
                }
                let delay = reconnectPolicy.delay(attempt: attempt, kind: kind, jitter: jitter(r.id, attempt))
                logger.warning(
                    "\(error.message); retrying in \(formatDelay(delay)) (attempt \(attempt))", ["device": r.id])
                setSession(r, .backingOff)
                if await waitForRetry(r, delay: delay) == false { return }
                continue
            }
            _ = kind
            setSession(r, .backingOff)
            // The first reconnect after a drop is almost immediate (a short pause lets BlueZ finish tearing the link
            // down); a link that keeps dropping backs off like a failing connect.
            let delay =
                quickDrops <= 1
                ? Duration.milliseconds(200)
                : reconnectPolicy.delay(attempt: quickDrops - 1, kind: nil, jitter: jitter(r.id, quickDrops))
            if quickDrops > 1 {
                logger.info(
                    "reconnecting in \(formatDelay(delay)) (the link dropped \(quickDrops) times within 30 s of connecting)",
                    ["device": r.id])
            }
            if await waitForRetry(r, delay: delay) == false { return }
        }
    }

    func count(reconnect name: String) {
        engine.withLock { $0.counters.reconnects[name, default: 0] += 1 }
    }

    /// A deterministic jitter in 0...1 per device and attempt (tests stay repeatable).
    func jitter(_ id: String, _ attempt: Int) -> Double {
        var h: UInt64 = 1_469_598_103_934_665_603
        for b in id.utf8 { h = (h ^ UInt64(b)) &* 1_099_511_628_211 }
        h = (h ^ UInt64(truncatingIfNeeded: attempt)) &* 1_099_511_628_211
        return Double(h % 1000) / 1000
    }

    /// Waits `delay`, or less when the device advertises again (wakeSession). False when cancelled.
    func waitForRetry(_ r: DeviceRecord, delay: Duration) async -> Bool {
        let deadline = clock.now + delay
        let clock = self.clock
        await withTaskGroup(of: Void.self) { group in
            group.addTask {
                try? await clock.sleep(until: deadline)
            }
            group.addTask {
                await withTaskCancellationHandler {
                    await withCheckedContinuation { (c: CheckedContinuation<Void, Never>) in
                        let resumeNow = r.data.withLock { d -> Bool in
                            if d.wakeRequested || Task.isCancelled {
                                d.wakeRequested = false
                                return true
                            }
                            d.wake = c
                            return false
                        }
                        if resumeNow { c.resume() }
                    }
                } onCancel: {
                    let c = r.data.withLock { d -> CheckedContinuation<Void, Never>? in
                        let c = d.wake
                        d.wake = nil
                        return c
                    }
                    c?.resume()
                }
            }
            await group.next()
            group.cancelAll()
        }
        return !Task.isCancelled
    }

    /// One connection: connect, resolve, subscribe, stream until the link or a subscription ends.
    func connectAndStream(_ r: DeviceRecord) async -> Result<StreamEnd, BLEError> {
        guard let address = r.address else {
            return .failure(BLEError(.notFound, message: "not seen advertising yet"))
        }
        guard let adapter = acquireSlot(r) else { return .failure(noSlotError(r)) }
        defer { releaseSlot(adapter) }
        setSession(r, .connecting)
        let link: any BLELink
        let (central, timeout) = (self.central, config.bluetooth.connectTimeout)
        let permits = connectPermits(adapter)
        guard await permits.acquire() else { return .success(.stopped) }
        do {
            defer { permits.release() }
            link = try await inChildTask { () async throws(BLEError) -> any BLELink in
                try await central.connect(address, adapter: adapter, timeout: timeout)
            }
        } catch {
            if Task.isCancelled { return .success(.stopped) }
            return .failure(error)
        }
        setSession(r, .resolving)
        let characteristics = link.characteristics
        r.data.withLock {
            $0.link = link
            $0.characteristics = characteristics
            $0.adapter = adapter
            $0.connectedSince = clock.now
            // A new connection: no notification yet (the intervals learned stay).
            $0.notifyTiming = $0.notifyTiming.mapValues { NotifyTiming(last: nil, interval: $0.interval) }
        }
        defer { r.data.withLock { $0.link = nil } }
        noteCharacteristicFields(r, characteristics)
        setSession(r, .subscribing)
        let chosen = subscriptionTargets(r, characteristics)
        // The first of: the link ends, a subscription ends, a subscription goes silent, or this task is cancelled.
        // The link and the subscriptions say so through callbacks (no task waits on each), so the ends exist
        // before the first subscription, which can end at once.
        let (ends, endsContinuation) = AsyncStream<StreamEnd>.makeStream(bufferingPolicy: .bufferingOldest(8))
        let graces = GraceTasks()
        defer {
            graces.cancelAll()
            endsContinuation.finish()
        }
        var subscriptions: [(BLECharacteristic, BLEWatch)] = []
        // A subscription that fails for a reason that may pass (bluetoothd just restarted, the CCC write failed)
        // is tried again a few times; if it still fails, the connection is dropped and retried with backoff, so
        // that a device never stays online with a characteristic it was meant to stream missing. A refusal (not
        // permitted, not supported) is reported once and the other characteristics stream without it.
        var unsubscribed: BLEError?
        for c in chosen {
            var attempt = 0
            while true {
                do {
                    // Values are handled where they are read: no hop per notification.
                    let ended = subscriptionEnded(c, into: endsContinuation, graces: graces)
                    let watch = try await inChildTask { () async throws(BLEError) -> BLEWatch in
                        try await link.subscribe(c, deliver: { self.handleNotification(r, c, $0) }, ended: ended)
                    }
                    subscriptions.append((c, watch))
                    break
                } catch {
                    if Task.isCancelled {
                        await uncancelled { await link.disconnect() }
                        return .success(.stopped)
                    }
                    if error.kind == .disconnected || error.kind == .notConnected {
                        return .success(.linkLost(BLEDisconnection(requested: false, reason: error.message)))
                    }
                    attempt += 1
                    let refused = [.notPermitted, .notSupported, .invalidArgument].contains(error.kind)
                    if refused || attempt >= Self.subscribeAttempts {
                        reportError(
                            "cannot subscribe to \(c.uuid): \(error.message)"
                                + (refused ? "" : " (\(attempt) attempts; reconnecting)"), device: r.id)
                        if !refused { unsubscribed = error }
                        break
                    }
                    logger.debug(
                        "cannot subscribe to \(c.uuid): \(error.message); trying again", ["device": r.id])
                    do {
                        try await clock.sleep(for: Self.subscribeRetryDelay * (1 << (attempt - 1)))
                    } catch {
                        await uncancelled { await link.disconnect() }
                        return .success(.stopped)
                    }
                }
            }
            if unsubscribed != nil { break }
        }
        if let unsubscribed {
            // Our own disconnect: the failure below, not the link, decides what happens next.
            await uncancelled { await link.disconnect() }
            return .failure(unsubscribed)
        }
        // Initial reads: the poll list, so the state is complete before the first notification.
        let initial = pollTargets(r, characteristics)
        for c in initial { await readAndMerge(r, link: link, c) }
        if !initial.isEmpty { requestStatePublish(r) }
        setSession(r, .streaming)
        setAvailability(r, online: true)
        logger.info(
            "connected on \(adapter): \(subscriptions.count) subscriptions"
                + (subscriptions.isEmpty
                    ? "" : " (\(subscriptions.map { $0.0.uuid.description }.joined(separator: ", ")))"),
            ["device": r.id])
        publishEvent("connected", r, [("adapter", .string(adapter))])
        publishDevices()
        // After the device streams (its values are delivered meanwhile; the link's end waits in `ends`).
        await readDeviceInformation(r, link: link, characteristics)
        let end = await stream(
            r, link: link, subscribed: !subscriptions.isEmpty, ends: ends, endsContinuation: endsContinuation)
        for (_, watch) in subscriptions { watch.cancel() }
        if case .stopped = end {
            await uncancelled { await link.disconnect() }
            setAvailability(r, online: false)
            logger.info("disconnected on request", ["device": r.id])
            publishEvent("disconnected", r, [("reason", .string("requested"))])
        } else if case .handedOver(let to) = end {
            await uncancelled { await link.disconnect() }
            logger.info("disconnected: gateway \(to) serves it now", ["device": r.id])
        } else if case .linkLost = end {
        } else {
            await uncancelled { await link.disconnect() }
        }
        return .success(end)
    }

    /// What a subscription's end tells the stream: why it ended. A `.disconnected` end waits 5 s first: the link
    /// went (the real bluetoothd closes the notify socket before it signals Connected=false), so the link's own end,
    /// lost or requested, is the reason, and this one speaks only if the link never does.
    func subscriptionEnded(
        _ c: BLECharacteristic, into ends: AsyncStream<StreamEnd>.Continuation, graces: GraceTasks
    ) -> @Sendable ((any Error)?) -> Void {
        let clock = self.clock
        return { error in
            guard let error else {
                ends.yield(.subscriptionEnded(c.uuid, "stream finished"))
                return
            }
            if let e = error as? BLEError, e.kind == .disconnected {
                graces.add(
                    Task {
                        do { try await clock.sleep(for: .seconds(5)) } catch { return }
                        if !Task.isCancelled { ends.yield(.subscriptionEnded(c.uuid, "\(error)")) }
                    })
            } else {
                ends.yield(.subscriptionEnded(c.uuid, "\(error)"))
            }
        }
    }

    /// Waits for the first reason to end: the link's end (told by the link), a subscription's (told through
    /// `subscriptionEnded`), a hand-over or a silent subscription (told by the tick), or this task's cancellation.
    func stream(
        _ r: DeviceRecord, link: any BLELink, subscribed: Bool, ends: AsyncStream<StreamEnd>,
        endsContinuation: AsyncStream<StreamEnd>.Continuation
    ) async -> StreamEnd {
        let factor = config.bluetooth.silenceFactor
        let linkWatch = link.watchDisconnection { d in endsContinuation.yield(d.requested ? .stopped : .linkLost(d)) }
        // A hand-over or a silent subscription: told by the bridge's tick, once a second (`watchStreams`).
        if subscribed || coordination != nil {
            let watch = StreamWatch(ends: endsContinuation, silence: subscribed, factor: factor)
            r.data.withLock { $0.streamWatch = watch }
        }
        var end: StreamEnd = .stopped
        for await first in ends {  // a cancelled task ends the iteration
            end = first
            break
        }
        r.data.withLock { $0.streamWatch = nil }
        linkWatch.cancel()
        if Task.isCancelled { return .stopped }
        return end
    }

    /// Part of the tick, under the device's lock: ends the stream of a device that another gateway serves now, or
    /// whose subscription went silent (each stream is told once). Returns the stream to tell, and why.
    static func streamToEnd(_ d: inout DeviceData, now: Duration) -> (StreamWatch, StreamEnd)? {
        guard let watch = d.streamWatch else { return nil }
        if let to = d.handOverTo {
            d.streamWatch = nil
            return (watch, .handedOver(to))
        }
        if watch.silence, let silent = silentCharacteristic(d, now: now, factor: watch.factor) {
            d.streamWatch = nil
            return (watch, .silent(silent.0, silent.1))
        }
        return nil
    }

    /// A characteristic whose notifications stopped for `factor` × its usual interval (at least 10 s), if any.
    static func silentCharacteristic(_ d: DeviceData, now: Duration, factor: Double) -> (BluetoothUUID, Double)? {
        for (uuid, timing) in d.notifyTiming {
            guard let last = timing.last, let interval = timing.interval else { continue }
            let silence = (now - last).seconds
            if silence > max(10, interval * factor) { return (uuid, silence) }
        }
        return nil
    }

    func handleNotification(_ r: DeviceRecord, _ c: BLECharacteristic, _ value: [UInt8]) {
        let now = clock.now
        r.data.withLock { $0.notifyTiming[c.uuid, default: NotifyTiming()].record(now) }
        hot.notifications.add(1, ordering: .relaxed)
        // One trip to the engine for the registry (not a copy of the whole configuration).
        let registry = engine.withLock { $0.config.registry }
        decode(r, c, value, registry: registry, now: now)
    }

    func decodeAndPublish(_ r: DeviceRecord, _ c: BLECharacteristic, _ value: [UInt8]) {
        decode(r, c, value, registry: engine.withLock { $0.config.registry }, now: clock.now)
    }

    /// `decodeAndPublish` with the registry and the time already in hand.
    private func decode(
        _ r: DeviceRecord, _ c: BLECharacteristic, _ value: [UInt8], registry: GATTParserRegistry, now: Duration
    ) {
        do {
            let reading = try registry.decode(
                c.uuid, value, context: GATTDecodeContext(presentationFormat: c.presentationFormat))
            r.merge(reading, now: now, wall: clock.wallClock)
            hot.decoded.add(1, ordering: .relaxed)
            requestStatePublish(r)
        } catch {
            engine.withLock { $0.counters.decodeErrors += 1 }
            reportError("cannot decode \(c.uuid) value \(hexString(value)): \(error)", device: r.id)
        }
    }

    /// Reads and merges a value without publishing.
    func readAndMerge(_ r: DeviceRecord, link: any BLELink, _ c: BLECharacteristic) async {
        do {
            let value = try await link.read(c)
            let reading = try config.registry.decode(
                c.uuid, value, context: GATTDecodeContext(presentationFormat: c.presentationFormat))
            r.merge(reading, now: clock.now, wall: clock.wallClock)
            hot.decoded.add(1, ordering: .relaxed)
        } catch let error as BLEError {
            reportError("cannot read \(c.uuid): \(error.message)", device: r.id)
        } catch {
            engine.withLock { $0.counters.decodeErrors += 1 }
            reportError("cannot decode \(c.uuid): \(error)", device: r.id)
        }
    }

    func readAndPublish(_ r: DeviceRecord, link: any BLELink, _ c: BLECharacteristic) async {
        do {
            let value = try await link.read(c)
            decodeAndPublish(r, c, value)
        } catch {
            reportError("cannot read \(c.uuid): \(error.message)", device: r.id)
        }
    }

    /// How many times one connection tries a subscription that fails for a reason that may pass, and the delay
    /// before the first retry (doubled for each next one: 0.5 s, then 1 s).
    static let subscribeAttempts = 3
    static let subscribeRetryDelay: Duration = .milliseconds(500)

    /// The characteristics to subscribe to: the configured list, or every notifying one that has a parser (or a
    /// presentation format).
    func subscriptionTargets(_ r: DeviceRecord, _ all: [BLECharacteristic]) -> [BLECharacteristic] {
        let registry = config.registry
        if !r.config.subscribe.isEmpty {
            return r.config.subscribe.compactMap { uuid in all.first { $0.uuid == uuid && $0.canNotify } }
        }
        return all.filter { c in
            c.canNotify && (registry.parser(for: c.uuid) != nil || c.presentationFormat != nil)
        }
    }

    func pollTargets(_ r: DeviceRecord, _ all: [BLECharacteristic]) -> [BLECharacteristic] {
        r.config.poll.compactMap { uuid in all.first { $0.uuid == uuid && $0.canRead } }
    }

    func noteCharacteristicFields(_ r: DeviceRecord, _ characteristics: [BLECharacteristic]) {
        let registry = config.registry
        var fields: [GATTFieldDescriptor] = []
        let subscribed = r.config.mode == .connected ? Set(subscriptionTargets(r, characteristics).map(\.uuid)) : []
        let targets = subscribed.union(r.config.poll)
        for c in characteristics where targets.contains(c.uuid) {
            var declared = registry.fields(for: c.uuid)
            if declared.isEmpty, registry.parser(for: c.uuid) == nil, let pf = c.presentationFormat {
                declared = registry.fields(forPresentationFormat: pf)
            }
            for f in declared where !fields.contains(where: { $0.name == f.name }) { fields.append(f) }
        }
        let changed = r.data.withLock { d -> Bool in
            guard d.characteristicFields != fields else { return false }
            d.characteristicFields = fields
            return true
        }
        if changed { publishDiscovery(r) }
    }

    /// Reads the Device Information Service strings (`DeviceInformation`) once per device and run: they do not
    /// change, and a device without the service is not asked again. A read that fails leaves that string out. Home
    /// Assistant's device then shows them (`mf`, `mdl`, `sw`, `hw`), as `bridge/devices` does.
    func readDeviceInformation(_ r: DeviceRecord, link: any BLELink, _ characteristics: [BLECharacteristic]) async {
        guard r.data.withLock({ $0.deviceInformation == nil }) else { return }
        let registry = config.registry
        var info = DeviceInformation()
        for (uuid, field) in DeviceInformation.characteristics {
            guard let c = characteristics.first(where: { $0.uuid == uuid && $0.canRead }) else { continue }
            do throws(BLEError) {
                let bytes = try await link.read(c)
                // The string parsers of the registry (trailing NULs cut); blank is none, and a long one is cut.
                if case .string(let text)? = (try? registry.decode(uuid, bytes))?.fields.first?.value {
                    let trimmed = text.trimmingSpaces
                    info[keyPath: field] = trimmed.isEmpty ? nil : String(trimmed.prefix(64))
                }
            } catch {
                if error.kind == .disconnected || error.kind == .notConnected { return }  // read at the next connection
                logger.debug("cannot read \(uuid): \(error.message)", ["device": r.id])
            }
        }
        r.data.withLock { $0.deviceInformation = info }
        guard info != DeviceInformation() else { return }
        publishDiscovery(r)
        publishDevices()
    }

    // MARK: Poll mode

    func pollLoop(_ r: DeviceRecord) async {
        var attempt = 0
        while !Task.isCancelled {
            if await waitForOwnership(r) == false { break }
            let result = await pollOnce(r)
            let delay: Duration
            switch result {
            case .success:
                attempt = 0
                delay = r.config.pollInterval
                setAvailability(r, online: true)
            case .failure(let error):
                attempt += 1
                r.data.withLock { $0.lastError = error.message }
                delay = min(
                    r.config.pollInterval,
                    reconnectPolicy.delay(attempt: attempt, kind: error.kind, jitter: jitter(r.id, attempt)))
                logger.warning("poll failed: \(error.message); next try in \(formatDelay(delay))", ["device": r.id])
                if attempt >= 3 { setAvailability(r, online: false) }
            }
            setSession(r, .backingOff)
            if await waitForRetry(r, delay: delay) == false { return }
        }
    }

    func pollOnce(_ r: DeviceRecord) async -> Result<Void, BLEError> {
        let outcome = await withTemporaryLink(r) { link in
            // Every value of one poll goes out in one state message.
            for c in self.pollTargets(r, link.characteristics) {
                await self.readAndMerge(r, link: link, c)
            }
            self.requestStatePublish(r)
            // Here, not in withTemporaryLink: a command's result does not wait for these reads.
            await self.readDeviceInformation(r, link: link, link.characteristics)
        }
        return outcome
    }

    /// Connects (unless connected), runs `body`, and disconnects again if it connected.
    func withTemporaryLink(_ r: DeviceRecord, _ body: @Sendable (any BLELink) async -> Void) async
        -> Result<Void, BLEError>
    {
        if let link = r.data.withLock({ $0.link }) {
            await body(link)
            return .success(())
        }
        guard let address = r.address else { return .failure(BLEError(.notFound, message: "not seen advertising yet")) }
        if let g = coordination, !g.mayConnect(r.id) {
            return .failure(BLEError(.failed, message: "another gateway serves it (multi-gateway mode)"))
        }
        guard let adapter = acquireSlot(r) else { return .failure(noSlotError(r)) }
        defer { releaseSlot(adapter) }
        let previous = r.data.withLock { $0.session }
        setSession(r, .polling)
        do {
            let link = try await central.connect(address, adapter: adapter, timeout: config.bluetooth.connectTimeout)
            r.data.withLock {
                $0.link = link
                $0.characteristics = link.characteristics
                $0.adapter = adapter
            }
            noteCharacteristicFields(r, link.characteristics)
            await body(link)
            r.data.withLock { $0.link = nil }
            await uncancelled { await link.disconnect() }
            setSession(r, previous == .polling ? .discovered : previous)
            return .success(())
        } catch {
            setSession(r, previous)
            return .failure(error)
        }
    }
}

/// `4 s`, `0.5 s`, `2 min`.
func formatDelay(_ d: Duration) -> String {
    let s = d.seconds
    if s >= 120 { return "\(Int(s / 60)) min" }
    if s >= 10 || s == s.rounded() { return "\(Int(s.rounded())) s" }
    return "\((s * 10).rounded() / 10) s"
}
