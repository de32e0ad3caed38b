// The MQTT side: connection states (birth, discovery), `/set` and `/get`, and the `bridge/request/<op>` API.
import GATT
import Logging

/// What a command answers: `{"status":"ok","data":{...}}` or `{"status":"error","error":"..."}`.
struct CommandOutcome {
    var ok: Bool
    var data: [(String, JSONValue)] = []
    var error: String?

    static func success(_ data: [(String, JSONValue)] = []) -> CommandOutcome { CommandOutcome(ok: true, data: data) }
    static func failure(_ error: String) -> CommandOutcome { CommandOutcome(ok: false, error: error) }
}

extension Bridge {
    func consumeMQTTStates() async {
        for await state in mqtt.states() {
            if Task.isCancelled { return }
            switch state {
            case .connected:
                // Birth once the subscriptions are made: `bridge/state` online tells a client that the bridge hears
                // commands now. (On a reconnection the transport has sent them again before it says connected.)
                let birth = engine.withLock { s -> Bool in
                    let was = s.mqttConnected
                    s.mqttConnected = true
                    s.lastMQTTFailure = nil
                    return !was && s.commandsSubscribed
                }
                logger.info("MQTT connected to \(config.mqtt.url)")
                if birth { publishBirth() }
            case .connecting:
                break
            case .disconnected(let reason):
                let (was, repeated) = engine.withLock { s -> (Bool, Bool) in
                    let was = s.mqttConnected
                    s.mqttConnected = false
                    let repeated = s.lastMQTTFailure == reason
                    s.lastMQTTFailure = reason
                    return (was, repeated)
                }
                if was {
                    logger.warning("MQTT connection lost (\(reason)); state is queued until it is back")
                } else if !repeated {
                    // A broker that refuses us (bad credentials, TLS) must say so, once per distinct reason.
                    logger.error("cannot connect to MQTT: \(reason); retrying")
                }
            }
        }
    }

    /// `bridge/state` online (retained, the will's counterpart), info, devices, availability and discovery.
    func publishBirth() {
        let t = topics
        publish(t.bridgeState, JSONValue.object([("state", .string("online"))]).bytes, qos: 1, retain: true)
        publishInfo()
        publishDevices()
        for r in records {
            let (online, hasState) = r.data.withLock { ($0.online, !$0.fields.isEmpty) }
            if let online { setAvailability(r, online: online, force: true) }
            // A retained state restored from the last run is right again at once.
            if hasState, r.config.retain ?? config.mqtt.retain { publishState(r) }
        }
        publishAllDiscovery()
    }

    func subscribeCommands() async {
        var filters = topics.subscriptions
        let ha = config.homeAssistant
        if ha.enabled {
            filters.append(ha.statusTopic)
            // Retained discovery messages of ours for devices no longer configured are removed when they arrive.
            filters.append("\(ha.prefix)/device/+/config")
        }
        filters += peripheral?.sourceTopics ?? []
        if coordination != nil {
            filters += topics.coordinationSubscriptions
            // Passive devices: what the gateways publish for them (one reading once), and their availability (one
            // that still hears a device answers a gateway that called it offline).
            filters.append(topics.availability("+"))
            filters += records.filter { $0.config.mode == .passive }.map { topics.state($0.id) }
        }
        // All at once: the birth waits for the last of them, one round trip to the broker rather than one per filter
        // (multi-gateway mode has one per passive device).
        await mqtt.subscribe(all: filters) { [logger] filter, error in
            logger.error("cannot subscribe to \(filter): \(error); commands there are not served")
        }
        coordination?.subscribed()
        // Connected meanwhile: that connection's birth waited for this.
        let birth = engine.withLock { s -> Bool in
            s.commandsSubscribed = true
            return s.mqttConnected
        }
        if birth { publishBirth() }
    }

    /// Multi-gateway mode: a passive device's state (remembered, so a reading is published once) or availability
    /// (an `offline` from a gateway that stopped hearing it, while this one still does, is answered `online`).
    func handlePassiveMessage(_ message: BridgeIncomingMessage) -> Bool {
        let prefix = topics.base + "/"
        guard message.topic.hasPrefix(prefix) else { return false }
        let rest = message.topic.dropFirst(prefix.count).split(separator: "/", omittingEmptySubsequences: false)
        guard rest.count == 1 || (rest.count == 2 && rest[1] == "availability"),
            let r = record(String(rest[0])), r.config.mode == .passive
        else { return false }
        if rest.count == 1 {
            passiveReadings?.noteState(r.id, message.payload, wall: clock.wallClock)
            return true
        }
        let said = (try? JSONReader.parse(message.payload))?["state"]?.string ?? message.text
        guard said == "offline" else { return true }
        let now = clock.now
        let hearing = r.data.withLock { d -> Bool in
            guard d.online == true, let last = d.lastAdvert else { return false }
            return now - last <= passiveTimeout(r.config, interval: d.advertInterval, settings: config.availability)
        }
        if hearing {
            logger.info("another gateway called it offline; this one still hears it", ["device": r.id])
            setAvailability(r, online: true, force: true)
        } else {
            // Offline is what everyone agrees on now; this gateway publishes online again when it hears it.
            r.data.withLock { if $0.online == true { $0.online = false } }
        }
        return true
    }

    /// `messages` is taken before the first subscribe (`incoming()` only gives what arrives from then on), so the
    /// retained messages a subscribe brings are not lost to a consumer that starts a moment later.
    func consumeCommands(_ messages: AsyncStream<BridgeIncomingMessage>) async {
        for await message in messages {
            if Task.isCancelled { return }
            await handleIncoming(message)
        }
    }

    func handleIncoming(_ message: BridgeIncomingMessage) async {
        let c = config
        if let g = coordination {
            let (handled, effects) = g.handle(message, wall: clock.wallClock)
            apply(effects)
            if handled { return }
        }
        if passiveReadings != nil, handlePassiveMessage(message) { return }
        if let peripheral, peripheral.handle(message) { return }
        if c.homeAssistant.enabled, message.topic == c.homeAssistant.statusTopic {
            if message.text == "online" {
                let delay = c.homeAssistant.stateResendDelay
                logger.info("Home Assistant is online: publishing discovery again, the device states in \(delay)")
                publishAllDiscovery()
                resendStatesLater(after: delay)
            }
            return
        }
        if c.homeAssistant.enabled, message.topic.hasPrefix("\(c.homeAssistant.prefix)/device/") {
            removeStaleDiscovery(message)
            return
        }
        guard let command = topics.command(for: message.topic) else { return }
        engine.withLock { $0.counters.commands += 1 }
        if message.payload.count > c.mqtt.maxPayload {
            let why =
                "payload of \(message.payload.count) bytes on \(message.topic) is over mqtt.max_payload (\(c.mqtt.maxPayload)); ignored"
            reportError(why)
            answer(command, message, transaction: nil, .failure(why))
            return
        }
        switch command {
        case .request(let op):
            if op.hasPrefix("device/") {
                // Device requests run in the order they came (a connect right after a disconnect must not overtake
                // it); scans and queries run at once.
                let tail = engine.withLock { s -> Task<Void, Never> in
                    let previous = s.requestTail
                    let task = Task {
                        await previous?.value
                        await self.handleRequest(op, message)
                    }
                    s.requestTail = task
                    return task
                }
                _ = tail
            } else {
                Task { await self.handleRequest(op, message) }
            }
        case .set(let device, let name), .get(let device, let name):
            let isSet: Bool
            if case .set = command { isSet = true } else { isSet = false }
            let body: @Sendable () async -> Void = {
                await self.handleSetGet(isSet: isSet, device: device, name: name, message)
            }
            if let r = record(device), let g = coordination, r.config.mode != .passive, !g.mayConnect(r.id) {
                // Several gateways: the one that serves the device answers.
                return
            }
            if let r = record(device) {
                // Commands to one device run one after the other, in order.
                r.data.withLock { d in
                    let previous = d.commandTail
                    d.commandTail = Task {
                        await previous?.value
                        await body()
                    }
                }
            } else {
                Task { await body() }
            }
        }
    }

    func answer(
        _ command: BridgeTopics.Command, _ message: BridgeIncomingMessage, transaction: JSONValue?,
        _ outcome: CommandOutcome
    ) {
        var body: [(String, JSONValue)] = [("status", .string(outcome.ok ? "ok" : "error"))]
        body.append(("data", .object(outcome.data)))
        if let e = outcome.error { body.append(("error", .string(e))) }
        if let transaction { body.append(("transaction", transaction)) }
        let payload = JSONValue.object(body).bytes
        let t = topics
        let topic: String
        switch command {
        case .request(let op): topic = message.responseTopic ?? t.response(op)
        case .set(let device, _): topic = message.responseTopic ?? "\(t.set(sanitizeDeviceID(device)))/result"
        case .get(let device, _): topic = message.responseTopic ?? "\(t.get(sanitizeDeviceID(device)))/result"
        }
        if !outcome.ok, case .request = command {
            logger.warning("request \(message.topic) failed: \(outcome.error ?? "")")
        } else if !outcome.ok {
            logger.warning("\(message.topic): \(outcome.error ?? "")")
        }
        publish(topic, payload, qos: 1, retain: false, correlation: message.correlationData)
    }

    /// A retained discovery message of ours (object id `blebridge_<id>`, state under our base topic) for a device
    /// that is not known any more: publish the empty retained message that removes it from Home Assistant.
    func removeStaleDiscovery(_ message: BridgeIncomingMessage) {
        guard message.retain, !message.payload.isEmpty else { return }
        let parts = message.topic.split(separator: "/").map(String.init)
        guard parts.count >= 4, let objectID = parts.dropLast().last, objectID.hasPrefix("blebridge_"),
            !objectID.hasPrefix("blebridge_bridge_")
        else { return }
        let id = String(objectID.dropFirst("blebridge_".count))
        guard record(id) == nil else { return }
        // An auto device (its id is its address) is simply not seen yet.
        if config.autoDevices.enabled, id.count == 12, id.utf8.allSatisfy(isASCIIHexDigit) { return }
        guard let json = try? JSONReader.parse(message.payload), let state = json["state_topic"]?.string,
            state == topics.state(id)
        else { return }
        logger.info("device \(id) is not configured any more: removing it from Home Assistant")
        removeDiscovery(id: id)
    }

    // MARK: /set and /get

    func handleSetGet(isSet: Bool, device: String, name: String?, _ message: BridgeIncomingMessage) async {
        let command: BridgeTopics.Command = isSet ? .set(device: device, name: name) : .get(device: device, name: name)
        var values: [(String, JSONValue)] = []
        var transaction: JSONValue?
        if let name {
            // `/set/<name>` with a plain value: the text for a text field, else JSON when it parses, else the text.
            let text = message.text.trimmingSpaces
            let kind = record(device)?.config.writable.first { $0.name == name }.flatMap { spec in
                config.registry.parser(named: spec.parserName ?? "")?.fields.first { $0.name == name }?.kind
            }
            let isText = kind == .text || record(device)?.config.writable.first { $0.name == name }?.platform == "text"
            values = [(name, isText ? .string(text) : ((try? JSONReader.parse(message.payload)) ?? .string(text)))]
        } else {
            do {
                let json = try JSONReader.parse(message.payload)
                guard case .object(let fields) = json else {
                    answer(
                        command, message, transaction: nil,
                        .failure("payload must be a JSON object, like {\"name\": value}"))
                    return
                }
                for (k, v) in fields {
                    if k == "transaction" { transaction = v } else { values.append((k, v)) }
                }
            } catch {
                answer(command, message, transaction: nil, .failure("\(error)"))
                return
            }
        }
        guard let r = record(device) else {
            answer(command, message, transaction: transaction, .failure("unknown device '\(device)'"))
            return
        }
        guard !values.isEmpty else {
            answer(command, message, transaction: transaction, .failure("nothing to \(isSet ? "set" : "get")"))
            return
        }
        let outcome = isSet ? await set(r, values) : await get(r, values.map(\.0))
        answer(command, message, transaction: transaction, outcome)
    }

    func set(_ r: DeviceRecord, _ values: [(String, JSONValue)]) async -> CommandOutcome {
        let registry = config.registry
        // Group by characteristic: fields of one parser are encoded together, the others from the last state.
        var writes: [(WritableSpec, [UInt8])] = []
        var grouped: [BluetoothUUID: [(String, JSONValue)]] = [:]
        var specs: [BluetoothUUID: WritableSpec] = [:]
        for (name, value) in values {
            guard let spec = r.config.writable.first(where: { $0.name == name }) else {
                let allowed = r.config.writable.map(\.name)
                return .failure(
                    "'\(name)' is not writable on \(r.id)"
                        + (allowed.isEmpty
                            ? " (it has no writable values)" : " (writable: \(allowed.joined(separator: ", ")))"))
            }
            if let problem = check(value, against: spec) { return .failure("\(name): \(problem)") }
            grouped[spec.characteristic, default: []].append((name, value))
            specs[spec.characteristic] = spec
        }
        for (uuid, items) in grouped.sorted(by: { $0.key < $1.key }) {
            guard let spec = specs[uuid] else { continue }
            if let parserName = spec.parserName, let parser = registry.parser(named: parserName) {
                let current = r.data.withLock { $0.fields }
                var reading = GATTReading()
                let names = parser.fields.map(\.name)
                for field in names {
                    if let v = items.first(where: { $0.0 == field })?.1 {
                        reading.append(field, coerce(v, kind: parser.fields.first { $0.name == field }?.kind))
                    } else if let v = current.first(where: { $0.0 == field })?.1 {
                        reading.append(field, v.gattValue)
                    }
                }
                do {
                    writes.append((spec, try parser.encode(reading)))
                } catch {
                    return .failure(
                        "cannot encode \(items.map(\.0).joined(separator: ", ")) with \(parser.name): \(error)")
                }
            } else {
                guard let text = items.first?.1.string, let bytes = bytesFromHex(text) else {
                    return .failure("\(items.first?.0 ?? ""): a raw value is a hex string, like \"0a1b\"")
                }
                writes.append((spec, bytes))
            }
        }
        let planned = writes
        let result = await withLink(r) { link -> CommandOutcome in
            for (spec, bytes) in planned {
                guard let c = link.characteristics.first(where: { $0.uuid == spec.characteristic }) else {
                    return .failure("\(r.id) has no characteristic \(spec.characteristic)")
                }
                let withResponse = spec.withResponse ?? c.canWrite
                do throws(BLEError) {
                    try await link.write(c, bytes, withResponse: withResponse)
                } catch {
                    return .failure(
                        "write \(spec.name) to \(spec.characteristic): \(error.errorName): \(error.message)")
                }
            }
            return .success(values)
        }
        if result.ok {
            // The state takes what was written, decoded back through the same parser (a switch set with "OFF"
            // shows false, a scaled value its rounded encoding), or the raw hex.
            for (spec, bytes) in planned {
                if let name = spec.parserName, let parser = registry.parser(named: name),
                    let written = try? parser.decode(bytes, context: GATTDecodeContext())
                {
                    let names = Set(values.map(\.0))
                    r.merge(
                        GATTReading(written.fields.filter { names.contains($0.name) }), now: clock.now,
                        wall: clock.wallClock)
                } else {
                    r.merge(
                        GATTReading([GATTField(spec.name, .string(hexString(bytes)))]), now: clock.now,
                        wall: clock.wallClock)
                }
            }
            requestStatePublish(r)
        }
        return result
    }

    func get(_ r: DeviceRecord, _ names: [String]) async -> CommandOutcome {
        let registry = config.registry
        return await withLink(r) { link -> CommandOutcome in
            var data: [(String, JSONValue)] = []
            for name in names {
                // A name is a field some readable characteristic's parser declares, or a parser name or UUID.
                let candidates = link.characteristics.filter { c in
                    c.canRead
                        && (registry.fields(for: c.uuid).contains { $0.name == name }
                            || registry.parser(for: c.uuid)?.name == name || BluetoothUUID(name) == c.uuid
                            || r.config.writable.contains { $0.name == name && $0.characteristic == c.uuid })
                }
                guard let c = candidates.first else {
                    return .failure("\(r.id) has no readable characteristic that gives '\(name)'")
                }
                let value: [UInt8]
                do throws(BLEError) {
                    value = try await link.read(c)
                } catch {
                    return .failure("read \(name) from \(c.uuid): \(error.errorName): \(error.message)")
                }
                do {
                    let reading = try registry.decode(
                        c.uuid, value, context: GATTDecodeContext(presentationFormat: c.presentationFormat))
                    r.merge(reading, now: self.clock.now, wall: self.clock.wallClock)
                    if let v = reading[name] {
                        data.append((name, JSONValue(v)))
                    } else {
                        data += reading.fields.map { ($0.name, JSONValue($0.value)) }
                    }
                } catch {
                    return .failure("\(c.uuid) value \(hexString(value)): \(error)")
                }
            }
            self.requestStatePublish(r)
            return .success(data)
        }
    }

    /// Runs `body` on the device's link; poll and on-demand devices are connected for it.
    func withLink(_ r: DeviceRecord, _ body: @escaping @Sendable (any BLELink) async -> CommandOutcome) async
        -> CommandOutcome
    {
        if let link = r.data.withLock({ $0.link }) { return await body(link) }
        switch r.config.mode {
        case .passive:
            return .failure("\(r.id) is passive (advertisements only); use mode connected, poll or on-demand")
        case .connected:
            if r.data.withLock({ $0.userDisconnected }) {
                return .failure("\(r.id) was disconnected on request; send bridge/request/device/connect first")
            }
            // Not connected right now: connect for the command, as on-demand devices are.
            fallthrough
        case .poll, .onDemand:
            let box = OutcomeBox()
            let result = await withTemporaryLink(r) { link in
                box.set(await body(link))
            }
            switch result {
            case .success: return box.value ?? .failure("no result")
            case .failure(let e): return .failure("connect \(r.id): \(e.errorName): \(e.message)")
            }
        }
    }

    func check(_ value: JSONValue, against spec: WritableSpec) -> String? {
        if let options = spec.options {
            let text = value.string ?? value.text
            if !options.contains(text) { return "\(value.text) is not one of \(options.joined(separator: ", "))" }
        }
        if spec.minimum != nil || spec.maximum != nil {
            guard let n = value.number ?? value.string.flatMap(Double.init) else {
                return "\(value.text) is not a number"
            }
            if let lo = spec.minimum, n < lo { return "\(n) is below the minimum \(lo)" }
            if let hi = spec.maximum, n > hi { return "\(n) is above the maximum \(hi)" }
        }
        return nil
    }

    /// A plain text value into the field's kind (`/set/<name>` payloads arrive as text).
    func coerce(_ value: JSONValue, kind: GATTFieldKind?) -> GATTValue {
        if case .string(let s) = value {
            switch kind {
            case .number?:
                if let i = Int64(s) { return .int(i) }
                if let d = Double(s) { return .double(d) }
            case .boolean?:
                switch s.lowercased() {
                case "on", "true", "1": return .bool(true)
                case "off", "false", "0": return .bool(false)
                default: break
                }
            default: break
            }
        }
        if case .bool(let b) = value, kind == .number { return .int(b ? 1 : 0) }
        return value.gattValue
    }
}

/// Carries a result out of a `@Sendable` closure.
final class OutcomeBox: @unchecked Sendable {
    var value: CommandOutcome?
    func set(_ v: CommandOutcome) { value = v }
}

extension String {
    var trimmingSpaces: String {
        var s = Substring(self)
        while let f = s.first, f.isWhitespace { s.removeFirst() }
        while let l = s.last, l.isWhitespace { s.removeLast() }
        return String(s)
    }
}

extension BridgeIncomingMessage {
    /// The payload as text.
    public var text: String { String(decoding: payload, as: UTF8.self) }
}
