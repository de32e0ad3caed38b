// `blebridge/bridge/request/<op>`: the bridge API, answered on `bridge/response/<op>` (or the MQTT 5 response topic).
import GATT
import Logging
import Synchronization

/// Collects what a `scan` request sees.
final class ScanCollector: Sendable {
    let seen = Mutex<[BLEAddress: BLEAdvertisement]>([:])
    func add(_ adv: BLEAdvertisement) {
        seen.withLock { s in
            var merged = adv
            if let old = s[adv.address] {
                if merged.name == nil { merged.name = old.name }
                if merged.rssi == nil { merged.rssi = old.rssi }
                merged.serviceData.merge(old.serviceData) { new, _ in new }
                merged.manufacturerData.merge(old.manufacturerData) { new, _ in new }
                if merged.serviceUUIDs.isEmpty { merged.serviceUUIDs = old.serviceUUIDs }
            }
            s[adv.address] = merged
        }
    }
}

extension Bridge {
    /// The request operations, for the docs and `bridge/info`.
    public static let requestOperations = [
        "devices", "scan", "device/connect", "device/disconnect", "device/read", "device/write", "device/remove",
        "health_check", "info", "config/reload",
    ]

    func handleRequest(_ op: String, _ message: BridgeIncomingMessage) async {
        let command = BridgeTopics.Command.request(op: op)
        var body: [(String, JSONValue)] = []
        var transaction: JSONValue?
        if !message.payload.isEmpty, !message.text.trimmingSpaces.isEmpty {
            do {
                guard case .object(let fields) = try JSONReader.parse(message.payload) else {
                    answer(command, message, transaction: nil, .failure("the request body must be a JSON object"))
                    return
                }
                for (k, v) in fields {
                    if k == "transaction" { transaction = v } else { body.append((k, v)) }
                }
            } catch {
                answer(command, message, transaction: nil, .failure("\(error)"))
                return
            }
        }
        let request = JSONValue.object(body)
        let outcome: CommandOutcome
        switch op {
        case "devices": outcome = .success([("devices", devicesJSON())])
        case "info": outcome = .success(infoFields())
        case "health_check": outcome = .success(healthFields())
        case "scan": outcome = await scanRequest(request)
        case "device/connect": outcome = await deviceRequest(request) { r in await self.connectRequest(r) }
        case "device/disconnect": outcome = await deviceRequest(request) { r in await self.disconnectRequest(r) }
        case "device/remove": outcome = await deviceRequest(request) { r in await self.removeRequest(r) }
        case "config/reload":
            switch await reloadFromSource() {
            case .success(let summary):
                outcome = .success([
                    ("added", .array(summary.added.map(JSONValue.string))),
                    ("removed", .array(summary.removed.map(JSONValue.string))),
                    ("changed", .array(summary.changed.map(JSONValue.string))),
                    ("needs_restart", .array(summary.needsRestart.map(JSONValue.string))),
                ])
            case .failure(let errors):
                outcome = .failure(
                    "the new configuration is invalid, the old one stays: \(errors.errors.map(\.description).joined(separator: "; "))"
                )
            }
        case "device/read": outcome = await rawGATT(request, write: false)
        case "device/write": outcome = await rawGATT(request, write: true)
        default:
            outcome = .failure(
                "unknown request '\(op)'; known: \(Bridge.requestOperations.joined(separator: ", "))")
        }
        answer(command, message, transaction: transaction, outcome)
    }

    func deviceRequest(_ request: JSONValue, _ body: (DeviceRecord) async -> CommandOutcome) async -> CommandOutcome {
        if let id = request["id"]?.string ?? request["device"]?.string {
            guard let r = record(id) ?? BLEAddress(id).flatMap({ a in engine.withLock { $0.byAddress[a] } }) else {
                return .failure("unknown device '\(id)'")
            }
            return await body(r)
        }
        if let text = request["address"]?.string {
            guard let a = BLEAddress(text) else { return .failure("\"\(text)\" is not a Bluetooth address") }
            guard let r = engine.withLock({ $0.byAddress[a] }) else {
                return .failure("no known device has address \(a)")
            }
            return await body(r)
        }
        return .failure("give the device as {\"id\": \"name\"} or {\"address\": \"AA:BB:CC:DD:EE:FF\"}")
    }

    func connectRequest(_ r: DeviceRecord) async -> CommandOutcome {
        guard r.config.mode != .passive else { return .failure("\(r.id) is passive; it is never connected") }
        r.data.withLock { $0.userDisconnected = false }
        if r.config.mode == .connected || r.config.mode == .poll {
            ensureSession(r)
            r.wakeSession()
            return .success([("id", .string(r.id)), ("state", .string(r.data.withLock { $0.session.rawValue }))])
        }
        // poll and on-demand: connect once now, to check the device can be reached.
        let result = await withTemporaryLink(r) { _ in }
        switch result {
        case .success: return .success([("id", .string(r.id)), ("connected", .bool(true))])
        case .failure(let e): return .failure("connect \(r.id): \(e.errorName): \(e.message)")
        }
    }

    func disconnectRequest(_ r: DeviceRecord) async -> CommandOutcome {
        let (task, link) = r.data.withLock { d -> (Task<Void, Never>?, (any BLELink)?) in
            d.userDisconnected = true
            return (d.sessionTask, d.link)
        }
        if let task {
            task.cancel()
            await task.value
        } else if let link {
            await uncancelled { await link.disconnect() }
        }
        setSession(r, .disconnected)
        publishDevices()
        return .success([("id", .string(r.id)), ("state", .string("disconnected"))])
    }

    func removeRequest(_ r: DeviceRecord) async -> CommandOutcome {
        _ = await disconnectRequest(r)
        var result: CommandOutcome = .success([("id", .string(r.id))])
        if let a = r.address {
            let adapter = r.data.withLock { $0.adapter } ?? engine.withLock { $0.adapters.first?.name } ?? "hci0"
            do {
                try await central.removeDevice(a, adapter: adapter)
            } catch {
                if error.kind != .notFound { result = .failure("remove \(r.id) from BlueZ: \(error.message)") }
            }
        }
        r.data.withLock { d in
            d.fields = []
            d.rssiByAdapter = [:]
            d.lastPayloads = [:]
            d.session = .idle
            d.userDisconnected = r.config.mode == .connected ? false : d.userDisconnected
        }
        setAvailability(r, online: false)
        publishEvent("removed", r)
        if r.config.index < 0 {
            // An auto device is forgotten entirely (it comes back if it advertises again); a configured one stays.
            engine.withLock { s in
                s.devices.removeValue(forKey: r.id)
                s.order.removeAll { $0 == r.id }
                if let a = r.address { s.byAddress.removeValue(forKey: a) }
            }
            removeDiscovery(id: r.id)
        } else {
            r.data.withLock { $0.userDisconnected = false }
        }
        publishDevices()
        return result
    }

    func scanRequest(_ request: JSONValue) async -> CommandOutcome {
        if let d = request["duration"], d.number == nil {
            return .failure("duration must be a number of seconds, not \(d.text)")
        }
        let seconds = request["duration"]?.number ?? 5
        guard seconds > 0, seconds <= 300 else { return .failure("duration must be between 0 and 300 seconds") }
        let collector = ScanCollector()
        let id = engine.withLock { s -> UInt64 in
            s.nextScanID += 1
            s.scans[s.nextScanID] = collector
            return s.nextScanID
        }
        try? await clock.sleep(for: .milliseconds(Int64(seconds * 1000)))
        engine.withLock { _ = $0.scans.removeValue(forKey: id) }
        let registry = config.registry
        let found = collector.seen.withLock { $0.values.sorted { $0.address < $1.address } }
        let items = found.map { adv -> JSONValue in
            var f: [(String, JSONValue)] = [("address", .string(adv.address.text))]
            f.append(("name", adv.name.map(JSONValue.string) ?? .null))
            f.append(("rssi", adv.rssi.map { .int(Int64($0)) } ?? .null))
            f.append(("adapter", .string(adv.adapter)))
            f.append(("services", .array(adv.serviceUUIDs.map { .string($0.description) })))
            var decoded: [(String, JSONValue)] = []
            let context = AdvertisementContext(mac: adv.address.text, localName: adv.name, cipher: advertisementCipher)
            for (uuid, payload) in adv.serviceData.sorted(by: { $0.key < $1.key }) {
                if let p = registry.parser(for: .serviceData(uuid)),
                    let r = try? registry.decode(.serviceData(uuid), payload, context: context)
                {
                    decoded.append((p.name, JSONValue(.object(r))))
                }
            }
            for (company, payload) in adv.manufacturerData.sorted(by: { $0.key < $1.key }) {
                if let p = registry.parser(for: .manufacturer(company)),
                    let r = try? registry.decode(.manufacturer(company), payload, context: context)
                {
                    decoded.append((p.name, JSONValue(.object(r))))
                }
            }
            f.append(("decoded", .object(decoded)))
            let known = engine.withLock { $0.byAddress[adv.address]?.id }
            f.append(("device", known.map(JSONValue.string) ?? .null))
            return .object(f)
        }
        return .success([("devices", .array(items))])
    }

    func rawGATT(_ request: JSONValue, write: Bool) async -> CommandOutcome {
        guard config.allowRawGATT else {
            return .failure(
                "raw GATT access is off; set allow_raw_gatt: true in the configuration to use device/\(write ? "write" : "read")"
            )
        }
        guard let text = request["characteristic"]?.string, let uuid = BluetoothUUID(text) else {
            return .failure("give \"characteristic\": a UUID such as \"2A19\"")
        }
        let bytes: [UInt8]
        if write {
            guard let hex = request["value"]?.string, let b = bytesFromHex(hex) else {
                return .failure("give \"value\": hex bytes such as \"0a1b\"")
            }
            bytes = b
        } else {
            bytes = []
        }
        let withResponse: Bool? = {
            if case .bool(let b)? = request["with_response"] { return b }
            return nil
        }()
        let registry = config.registry
        return await deviceRequest(request) { r in
            await self.withLink(r) { link -> CommandOutcome in
                guard let c = link.characteristics.first(where: { $0.uuid == uuid }) else {
                    return .failure("\(r.id) has no characteristic \(uuid)")
                }
                do throws(BLEError) {
                    if write {
                        try await link.write(c, bytes, withResponse: withResponse ?? c.canWrite)
                        return .success([("id", .string(r.id)), ("characteristic", .string(uuid.description))])
                    }
                    let value = try await link.read(c)
                    var data: [(String, JSONValue)] = [
                        ("id", .string(r.id)), ("characteristic", .string(uuid.description)),
                        ("value", .string(hexString(value))),
                    ]
                    if let reading = try? registry.decode(
                        uuid, value, context: GATTDecodeContext(presentationFormat: c.presentationFormat))
                    {
                        data.append(("decoded", JSONValue(.object(reading))))
                    }
                    return .success(data)
                } catch {
                    return .failure("\(write ? "write" : "read") \(uuid): \(error.errorName): \(error.message)")
                }
            }
        }
    }

    func healthFields() -> [(String, JSONValue)] {
        let (mqttUp, bluez, adapters, counters) = engine.withLock {
            ($0.mqttConnected, $0.bluetoothdRunning, $0.adapters, hot.adding(to: $0.counters))
        }
        let duplicates: [(String, JSONValue)] =
            coordination == nil ? [] : [("duplicates_suppressed", .int(Int64(counters.duplicatesSuppressed)))]
        let healthy = mqttUp && bluez && !adapters.isEmpty
        let stats = mqtt.statistics
        return [
            ("healthy", .bool(healthy)),
            ("uptime_s", .double(((clock.now - started).seconds * 10).rounded() / 10)),
            (
                "mqtt",
                .object([
                    ("connected", .bool(mqttUp)), ("published", .int(Int64(stats.published))),
                    ("received", .int(Int64(stats.received))), ("queued", .int(Int64(stats.queued))),
                    ("dropped", .int(Int64(stats.dropped))),
                ])
            ),
            ("bluetoothd", .bool(bluez)),
            (
                "adapters",
                .array(
                    adapters.map { a in
                        let (used, scanning) = engine.withLock { ($0.slots[a.name] ?? 0, $0.scanning.contains(a.name)) }
                        return .object([
                            ("name", .string(a.name)), ("address", .string(a.address)), ("powered", .bool(a.powered)),
                            ("discovering", .bool(scanning)),
                            ("connections", .int(Int64(used))),
                            ("free_slots", .int(Int64(max(0, config.bluetooth.connectionSlots - used)))),
                        ])
                    })
            ),
            ("process", .object(processStatistics())),
            (
                "devices",
                .object(
                    records.map { r in
                        let d = r.data.withLock { $0 }
                        let since = d.connectedSince.map { (clock.now - $0).seconds } ?? (clock.now - started).seconds
                        return (
                            r.id,
                            .object([
                                ("state", .string(d.session.rawValue)),
                                ("availability", d.online.map { .string($0 ? "online" : "offline") } ?? .null),
                                ("messages", .int(Int64(d.messages))),
                                (
                                    "messages_per_s",
                                    .double(since > 0 ? (Double(d.messages) / since * 100).rounded() / 100 : 0)
                                ),
                                ("last_seen", d.lastSeenWall.map { .string(iso8601($0)) } ?? .null),
                                ("reconnects", .int(Int64(d.reconnects))),
                                ("last_error", d.lastError.map(JSONValue.string) ?? .null),
                            ])
                        )
                    })
            ),
            (
                "counters",
                .object(
                    [
                        ("notifications", .int(Int64(counters.notifications))),
                        ("advertisements", .int(Int64(counters.advertisements))),
                        ("decoded", .int(Int64(counters.decoded))),
                        ("decode_errors", .int(Int64(counters.decodeErrors))),
                        ("state_publishes", .int(Int64(counters.statePublishes))),
                    ] + duplicates + [
                        (
                            "reconnects",
                            .object(
                                counters.reconnects.sorted { $0.key < $1.key }.map { ($0.key, .int(Int64($0.value))) })
                        )
                    ])
            ),
        ] + (peripheral.map { [("peripheral", $0.healthJSON)] } ?? [])
    }
}
