// What the bridge says about itself and its devices: `bridge/info`, `bridge/devices`, and Home Assistant's
// device-based MQTT discovery (`homeassistant/device/<id>/config`, one message per device with all its components;
// see Home Assistant's MQTT integration docs, "Device discovery payload").
import GATT
import Logging

extension Bridge {
    /// The Home Assistant device id of the bridge itself (`via_device` of every device).
    var bridgeObjectID: String { "blebridge_bridge_\(sanitizeDeviceID(gatewayName))" }

    func objectID(_ r: DeviceRecord) -> String { "blebridge_\(r.id)" }

    // MARK: bridge/info and bridge/devices

    func infoFields() -> [(String, JSONValue)] {
        let c = config
        let adapters = engine.withLock { $0.adapters }
        return [
            ("version", .string(BridgeVersion.current)),
            ("gateway", .string(gatewayName)),
            (
                "adapters",
                .array(
                    adapters.map {
                        .object([
                            ("name", .string($0.name)), ("address", .string($0.address)),
                            ("powered", .bool($0.powered)),
                        ])
                    })
            ),
            ("config", configSummary(c)),
            ("requests", .array(Bridge.requestOperations.map(JSONValue.string))),
        ] + (peripheral.map { [("peripheral", $0.info)] } ?? [])
    }

    /// The effective configuration without secrets.
    func configSummary(_ c: BridgeConfig) -> JSONValue { EffectiveConfig.summary(c) }
}

/// The configuration as JSON with secrets masked (`bridge/info`, `blebridge check-config`).
public enum EffectiveConfig {
    /// Every setting, devices included.
    public static func json(_ c: BridgeConfig) -> JSONValue {
        guard case .object(var fields) = summary(c) else { return summary(c) }
        fields.removeAll { $0.0 == "devices" }
        fields.append(
            (
                "devices",
                .array(
                    c.devices.map { d in
                        var o: [(String, JSONValue)] = [
                            ("id", .string(d.id)), ("name", d.friendlyName.map(JSONValue.string) ?? .null),
                        ]
                        var m: [(String, JSONValue)] = []
                        if let a = d.match.address { m.append(("address", .string(a.text))) }
                        if let s = d.match.service { m.append(("service", .string(s.description))) }
                        if let n = d.match.namePattern { m.append(("name", .string(n))) }
                        if let id = d.match.manufacturer { m.append(("manufacturer", .int(Int64(id)))) }
                        o.append(("match", .object(m)))
                        o.append(("mode", .string(d.mode.rawValue)))
                        o.append(("subscribe", .array(d.subscribe.map { .string($0.description) })))
                        o.append(("poll", .array(d.poll.map { .string($0.description) })))
                        if d.mode == .poll { o.append(("poll_interval", .double(d.pollInterval.seconds))) }
                        o.append(
                            (
                                "writable",
                                .array(
                                    d.writable.map { w in
                                        .object([
                                            ("name", .string(w.name)),
                                            ("characteristic", .string(w.characteristic.description)),
                                            ("parser", w.parserName.map(JSONValue.string) ?? .null),
                                            ("platform", .string(w.platform)),
                                        ])
                                    })
                            ))
                        if let v = d.debounce { o.append(("debounce", .double(v.seconds))) }
                        if let v = d.throttle { o.append(("throttle", .double(v.seconds))) }
                        if let v = d.retain { o.append(("retain", .bool(v))) }
                        if d.qos >= 0 { o.append(("qos", .int(Int64(d.qos)))) }
                        if let v = d.availabilityTimeout { o.append(("availability_timeout", .double(v.seconds))) }
                        o.append(("output", .string(d.output.rawValue)))
                        if d.bindKey != nil { o.append(("bindkey", .string("***"))) }
                        return .object(o)
                    })
            ))
        return .object(fields)
    }

    /// The main settings, secrets masked.
    public static func summary(_ c: BridgeConfig) -> JSONValue {
        .object([
            (
                "mqtt",
                .object([
                    ("url", .string(c.mqtt.url)), ("base_topic", .string(c.mqtt.baseTopic)),
                    ("protocol", .string(c.mqtt.protocolVersion)), ("qos", .int(Int64(c.mqtt.qos))),
                    ("username", c.mqtt.username.map(JSONValue.string) ?? .null),
                    ("password", c.mqtt.password == nil && c.mqtt.passwordFile == nil ? .null : .string("***")),
                ])
            ),
            (
                "homeassistant",
                .object([
                    ("enabled", .bool(c.homeAssistant.enabled)), ("prefix", .string(c.homeAssistant.prefix)),
                    ("status_topic", .string(c.homeAssistant.statusTopic)),
                    ("state_resend_delay", .double(c.homeAssistant.stateResendDelay.seconds)),
                ])
            ),
            (
                "bluetooth",
                .object([
                    ("adapters", .array(c.bluetooth.adapters.map(JSONValue.string))),
                    ("scan_services", .array(c.bluetooth.scanServices.map { .string($0.description) })),
                    ("scan_filter", .array(c.scanServiceUUIDs.map { .string($0.description) })),
                    ("passive", .bool(c.bluetooth.passive)), ("duplicate_data", .bool(c.bluetooth.duplicateData)),
                    ("connection_slots", .int(Int64(c.bluetooth.connectionSlots))),
                    ("connect_timeout", .double(c.bluetooth.connectTimeout.seconds)),
                    (
                        "reconnect",
                        .object([
                            ("initial_delay", .double(c.bluetooth.reconnectInitialDelay.seconds)),
                            ("max_delay", .double(c.bluetooth.reconnectMaximumDelay.seconds)),
                        ])
                    ),
                    ("silence_factor", .double(c.bluetooth.silenceFactor)),
                ])
            ),
            (
                "availability",
                .object([
                    ("passive_timeout", .double(c.availability.passiveMinimumTimeout.seconds)),
                    ("passive_intervals", .double(c.availability.passiveIntervals)),
                ])
            ),
            (
                "logging",
                .object([
                    ("level", .string(c.logging.level)), ("format", .string(c.logging.format)),
                    ("mqtt_level", .string(c.logging.mqttLevel)),
                ])
            ),
            ("health", .object([("interval", .double(c.healthInterval.seconds))])),
            ("allow_raw_gatt", .bool(c.allowRawGATT)),
            ("devices", .int(Int64(c.devices.count))),
            ("auto_devices", .bool(c.autoDevices.enabled)),
            ("parsers", .array(c.parserSpecs.map { .string($0.name) })),
            ("peripheral", c.peripheral.map(peripheralSummary) ?? .null),
            (
                "gateway",
                c.gateway.map { g in
                    .object([
                        ("id", .string(g.id)), ("lease", .double(g.ownership.lease)),
                        ("handover_margin", .double(g.ownership.handoverMargin)),
                        ("handover_after", .double(g.ownership.handoverAfter)),
                        ("link_lost_grace", .double(g.ownership.linkLostGrace)),
                        ("passive_delay", .double(g.passiveDelay)), ("dedup_window", .double(g.dedupWindow)),
                    ])
                } ?? .null
            ),
        ])
    }

    /// The `peripheral` section: services and their bindings, the broadcast (bind key masked).
    static func peripheralSummary(_ p: PeripheralConfig) -> JSONValue {
        var fields: [(String, JSONValue)] = [
            ("adapter", p.adapter.map(JSONValue.string) ?? .null), ("name", .string(p.name)),
            ("advertise", .bool(p.advertise)),
            (
                "services",
                .array(
                    p.services.map { s in
                        .object([
                            ("uuid", .string(s.uuid.description)), ("name", s.name.map(JSONValue.string) ?? .null),
                            (
                                "characteristics",
                                .array(
                                    s.characteristics.map { c in
                                        .object([
                                            ("uuid", .string(c.uuid.description)),
                                            ("parser", c.parserName.map(JSONValue.string) ?? .null),
                                            ("flags", .array(c.flags.map(JSONValue.string))),
                                            ("source", c.source.map { .string($0.description) } ?? .null),
                                            ("sink", c.sink.map(JSONValue.string) ?? .null),
                                        ])
                                    })
                            ),
                        ])
                    })
            ),
        ]
        if let b = p.broadcast {
            fields.append(
                (
                    "broadcast",
                    .object([
                        ("name", b.name.map(JSONValue.string) ?? .null),
                        (
                            "interval_s",
                            .double(
                                Double(b.interval.components.seconds)
                                    + Double(b.interval.components.attoseconds) / 1e18)
                        ),
                        ("bind_key", b.bindKey == nil ? .null : .string("***")),
                        (
                            "values",
                            .array(
                                b.values.map {
                                    .object([("field", .string($0.field)), ("source", .string($0.source.description))])
                                })
                        ),
                        ("payload_octets", .int(Int64(b.payloadLength))),
                    ])
                ))
        }
        return .object(fields)
    }
}

extension Bridge {
    func publishInfo() {
        publish(topics.bridgeInfo, JSONValue.object(infoFields()).bytes, qos: 1, retain: true)
    }

    func devicesJSON() -> JSONValue {
        let registry = config.registry
        return .array(
            records.map { r in
                let d = r.data.withLock { $0 }
                var f: [(String, JSONValue)] = [
                    ("id", .string(r.id)),
                    ("friendly_name", r.config.friendlyName.map(JSONValue.string) ?? .null),
                    ("address", d.address.map { .string($0.text) } ?? .null),
                    ("mode", .string(r.config.mode.rawValue)),
                    ("state", .string(d.session.rawValue)),
                    ("availability", d.online.map { .string($0 ? "online" : "offline") } ?? .null),
                    ("adapter", d.adapter.map(JSONValue.string) ?? .null),
                    ("rssi", d.rssi.map { .int(Int64($0)) } ?? .null),
                    ("last_seen", d.lastSeenWall.map { .string(iso8601($0)) } ?? .null),
                ]
                if let info = d.deviceInformation {
                    // The Device Information Service's strings, once read (after the first connection).
                    f.append(
                        (
                            "device_information",
                            .object([
                                ("manufacturer", info.manufacturer.map(JSONValue.string) ?? .null),
                                ("model", info.model.map(JSONValue.string) ?? .null),
                                ("firmware", info.firmware.map(JSONValue.string) ?? .null),
                                ("hardware", info.hardware.map(JSONValue.string) ?? .null),
                            ])
                        ))
                }
                let services = Array(Set(d.characteristics.map(\.serviceUUID))).sorted()
                f.append(("services", .array(services.map { .string($0.description) })))
                f.append(
                    (
                        "characteristics",
                        .array(
                            d.characteristics.map { c in
                                .object([
                                    ("uuid", .string(c.uuid.description)),
                                    ("service", .string(c.serviceUUID.description)),
                                    ("flags", .array(c.flags.sorted().map(JSONValue.string))),
                                    ("parser", registry.parser(for: c.uuid).map { .string($0.name) } ?? .null),
                                ])
                            })
                    ))
                f.append(
                    (
                        "writable",
                        .array(
                            r.config.writable.map { w in
                                var o: [(String, JSONValue)] = [
                                    ("name", .string(w.name)),
                                    ("characteristic", .string(w.characteristic.description)),
                                    ("parser", w.parserName.map(JSONValue.string) ?? .null),
                                    ("platform", .string(w.platform)),
                                ]
                                if let v = w.minimum { o.append(("min", .double(v))) }
                                if let v = w.maximum { o.append(("max", .double(v))) }
                                if let v = w.options { o.append(("options", .array(v.map(JSONValue.string)))) }
                                return .object(o)
                            })
                    ))
                f.append(("reconnects", .int(Int64(d.reconnects))))
                f.append(("last_error", d.lastError.map(JSONValue.string) ?? .null))
                return .object(f)
            })
    }

    func publishDevices() {
        publish(topics.bridgeDevices, devicesJSON().bytes, qos: 1, retain: true)
    }

    // MARK: Home Assistant

    func publishAllDiscovery() {
        guard config.homeAssistant.enabled else { return }
        publishBridgeDiscovery()
        for r in records { publishDiscovery(r, force: true) }
    }

    /// After Home Assistant's birth: every device's state again once `delay` has passed, the time Home Assistant
    /// takes to make the entities of the discovery messages and subscribe to their state topics (Zigbee2MQTT does the
    /// same). States are not retained by default, so a device that reports rarely (a thermostat read once after
    /// connecting) would show unknown until its next report. Another birth meanwhile starts the wait again.
    func resendStatesLater(after delay: Duration) {
        let task = Task { [clock] in
            do { try await clock.sleep(until: clock.now + delay) } catch { return }
            guard !Task.isCancelled, !engine.withLock({ $0.shuttingDown }) else { return }
            for r in records where r.data.withLock({ !$0.fields.isEmpty }) { publishState(r) }
        }
        // The one before is replaced; after shutdown (which cancels the one it finds) nothing is kept.
        engine.withLock { e in
            e.stateResend?.cancel()
            e.stateResend = task
            if e.shuttingDown { task.cancel() }
        }
    }

    func origin() -> JSONValue {
        .object([("name", .string("blebridge")), ("sw", .string(BridgeVersion.current))])
    }

    func publishBridgeDiscovery() {
        let t = topics
        let id = bridgeObjectID
        let payload = JSONValue.object([
            (
                "dev",
                .object([
                    ("ids", .array([.string(id)])), ("name", .string("blebridge \(gatewayName)")),
                    ("mf", .string("blebridge")), ("mdl", .string("BLE to MQTT bridge")),
                    ("sw", .string(BridgeVersion.current)),
                ])
            ),
            ("o", origin()),
            (
                "cmps",
                .object([
                    (
                        "\(id)_connection_state",
                        .object([
                            ("p", .string("binary_sensor")), ("name", .string("Connection state")),
                            ("unique_id", .string("\(id)_connection_state")), ("device_class", .string("connectivity")),
                            ("entity_category", .string("diagnostic")), ("state_topic", .string(t.bridgeState)),
                            ("value_template", .string("{{ value_json.state }}")), ("payload_on", .string("online")),
                            ("payload_off", .string("offline")),
                        ])
                    )
                ])
            ),
            ("qos", .int(1)),
        ])
        publish(t.discovery(id), payload.bytes, qos: 1, retain: true)
    }

    /// Publishes the device's discovery message when what it would contain changed (or always with `force`).
    func publishDiscovery(_ r: DeviceRecord, force: Bool = false) {
        let c = config
        guard c.homeAssistant.enabled else { return }
        // Several gateways: the one that serves a device publishes its discovery (naming itself as via_device).
        if let g = coordination, r.config.mode != .passive, !g.mayConnect(r.id) { return }
        let bytes = discoveryPayload(r, c).bytes
        // A hash of the message, not its text (a few kilobytes a device, kept for the life of the process).
        var hasher = Hasher()
        hasher.combine(bytes)
        let signature = hasher.finalize()
        let changed = r.data.withLock { d -> Bool in
            if d.discoverySignature == signature && !force { return false }
            d.discoverySignature = signature
            return true
        }
        guard changed else { return }
        publish(topics.discovery(objectID(r)), bytes, qos: 1, retain: true)
    }

    /// Removes a device from Home Assistant (empty retained discovery message).
    func removeDiscovery(id: String) {
        publish(topics.discovery("blebridge_\(id)"), [], qos: 1, retain: true)
    }

    func discoveryPayload(_ r: DeviceRecord, _ c: BridgeConfig) -> JSONValue {
        let t = topics
        let oid = objectID(r)
        let (d, info) = r.data.withLock {
            (($0.address, $0.advertisedName, $0.characteristicFields, $0.advertFields), $0.deviceInformation)
        }
        var fields = d.2
        for f in d.3 where !fields.contains(where: { $0.name == f.name }) { fields.append(f) }
        var components: [(String, JSONValue)] = []
        let writableNames = Set(r.config.writable.map(\.name))
        let perField = r.config.output == .attribute
        let names = entityNames(
            fields.filter { !writableNames.contains($0.name) && $0.kind != .structured }
                + r.config.writable.map { GATTFieldDescriptor.inferred(fromName: $0.name) })
        for f in fields where !writableNames.contains(f.name) {
            guard var component = sensorComponent(f, oid: oid, name: names[f.name]) else { continue }
            if perField, case .object(var o) = component {
                // `output: attribute` publishes no JSON state: each entity reads its own plain-value topic.
                o.removeAll { $0.0 == "value_template" }
                o.append(("state_topic", .string(t.attribute(r.id, f.name))))
                if f.kind == .boolean {
                    o.append(("payload_on", .string("true")))
                    o.append(("payload_off", .string("false")))
                }
                component = .object(o)
            }
            components.append(("\(oid)_\(f.name)", component))
        }
        for w in r.config.writable {
            components.append(("\(oid)_\(w.name)", writableComponent(w, r, oid: oid, name: names[w.name])))
        }
        components.append(
            (
                "\(oid)_rssi",
                .object([
                    ("p", .string("sensor")), ("name", .string("RSSI")), ("unique_id", .string("\(oid)_rssi")),
                    ("device_class", .string("signal_strength")), ("unit_of_measurement", .string("dBm")),
                    ("state_class", .string("measurement")), ("entity_category", .string("diagnostic")),
                    ("value_template", .string(Self.valueTemplate("rssi", absent: "None"))),
                ])
            ))
        components.append(
            (
                "\(oid)_last_seen",
                .object([
                    ("p", .string("sensor")), ("name", .string("Last seen")),
                    ("unique_id", .string("\(oid)_last_seen")),
                    ("device_class", .string("timestamp")), ("entity_category", .string("diagnostic")),
                    ("enabled_by_default", .bool(false)),
                    ("value_template", .string(Self.valueTemplate("last_seen", absent: "None"))),
                ])
            ))
        var device: [(String, JSONValue)] = [
            ("ids", .array([.string(oid)])),
            ("name", .string(deviceDisplayName(r, advertisedName: d.1))),
            ("via_device", .string(bridgeObjectID)),
        ]
        if let a = d.0 {
            device.append(("cns", .array([.array([.string("bluetooth"), .string(a.text.lowercased())])])))
        }
        // The Device Information Service's strings when the device has them (read after connecting), else the
        // advertised name as the model.
        if let manufacturer = info?.manufacturer { device.append(("mf", .string(manufacturer))) }
        if let model = info?.model ?? d.1 { device.append(("mdl", .string(model))) }
        if let firmware = info?.firmware { device.append(("sw", .string(firmware))) }
        if let hardware = info?.hardware { device.append(("hw", .string(hardware))) }
        return .object([
            ("dev", .object(device)),
            ("o", origin()),
            ("cmps", .object(components)),
            ("state_topic", .string(t.state(r.id))),
            (
                "availability",
                .array([
                    .object([("topic", .string(t.bridgeState)), ("value_template", .string("{{ value_json.state }}"))]),
                    .object([
                        ("topic", .string(t.availability(r.id))), ("value_template", .string("{{ value_json.state }}")),
                    ]),
                ])
            ),
            ("availability_mode", .string("all")),
            ("qos", .int(Int64(stateQoS(r)))),
        ])
    }

    /// The friendly name; a second device matching one entry gets its address suffix so the two can be told apart.
    func deviceDisplayName(_ r: DeviceRecord, advertisedName: String?) -> String {
        guard let friendly = r.config.friendlyName else { return advertisedName ?? r.id }
        if r.id != sanitizeDeviceID(friendly), let a = r.address { return "\(friendly) \(a.compact.suffix(6))" }
        return friendly
    }

    func humanName(_ f: GATTFieldDescriptor) -> String {
        var parts = f.name.split(separator: "_").map(String.init)
        let unitSuffixes: Set<String> = [
            "c", "f", "k", "pct", "pa", "hpa", "kpa", "bpm", "kj", "kcal", "v", "mv", "a", "ma", "w", "kwh", "wh", "s",
            "ms", "lux", "lx", "dbm", "db", "m", "cm", "mm", "kg", "g", "ppm", "ugm3", "rpm", "hz", "l", "ml", "m3",
        ]
        if parts.count > 1, f.unit != nil, let last = parts.last, unitSuffixes.contains(last) { parts.removeLast() }
        guard let first = parts.first else { return f.name }
        return ([first.prefix(1).uppercased() + first.dropFirst()] + parts.dropFirst()).joined(separator: " ")
    }

    /// The entity name of each field: `humanName`, or, where two fields of the device would get the same one (a
    /// thermometer's `temperature_c` and `temperature_f`), that name with the field's unit (`Temperature (°F)`), else
    /// the field name's words in full. Home Assistant makes entity ids from the names, and would number the second.
    func entityNames(_ fields: [GATTFieldDescriptor]) -> [String: String] {
        var count: [String: Int] = ["RSSI": 1, "Last seen": 1]
        for f in fields { count[humanName(f), default: 0] += 1 }
        var names: [String: String] = [:]
        for f in fields {
            let name = humanName(f)
            if count[name, default: 0] < 2 {
                names[f.name] = name
            } else if let unit = f.unit {
                names[f.name] = "\(name) (\(unit))"
            } else {
                let words = f.name.split(separator: "_").joined(separator: " ")
                names[f.name] = words.prefix(1).uppercased() + words.dropFirst()
            }
        }
        return names
    }

    /// The value template of a field: `present` (the value itself by default) when the state has the field and it
    /// is not null, else `absent`. A field is in the merged state once a reading had it, and some never come (a
    /// Celsius thermometer's `temperature_f`, a flag-dependent field); `{{ value_json.x }}` would then make Home
    /// Assistant log "Template variable warning" at every state message. `absent` is what each platform takes for
    /// "no value": `None` (unknown) for sensors, binary sensors and switches, `''` (ignored) for numbers, selects and
    /// texts.
    static func valueTemplate(_ name: String, present: String? = nil, absent: String) -> String {
        let value = "value_json.\(name)"
        return "{{ \(present ?? value) if \(value) is defined and \(value) is not none else \(absent) }}"
    }

    /// The template of an `ON`/`OFF` entity.
    static func onOffTemplate(_ name: String) -> String {
        valueTemplate(name, present: "('ON' if value_json.\(name) else 'OFF')", absent: "None")
    }

    /// Fields about the radio and the packets rather than what a sensor measures: a format's packet counter (BTHome
    /// `packet_id`, RuuviTag `measurement_sequence`, MiBeacon `frame_counter`, pvvx/ATC `packet_counter`, a GATT
    /// record's `sequence_number`), the advertised `mac` and `tx_power_dbm`. Their entities are diagnostic, as Home
    /// Assistant's own BTHome and Ruuvi integrations make them (the device page lists them apart).
    static let diagnosticFields: Set<String> = [
        "packet_id", "measurement_sequence", "frame_counter", "packet_counter", "sequence_number", "mac",
        "tx_power_dbm",
    ]

    func sensorComponent(_ f: GATTFieldDescriptor, oid: String, name: String? = nil) -> JSONValue? {
        var o: [(String, JSONValue)] = []
        switch f.kind {
        case .structured: return nil
        case .boolean:
            o.append(("p", .string("binary_sensor")))
            o.append(("value_template", .string(Self.onOffTemplate(f.name))))
        case .number, .text:
            o.append(("p", .string("sensor")))
            o.append(("value_template", .string(Self.valueTemplate(f.name, absent: "None"))))
        }
        o.append(("name", .string(name ?? humanName(f))))
        o.append(("unique_id", .string("\(oid)_\(f.name)")))
        if Self.diagnosticFields.contains(f.name) { o.append(("entity_category", .string("diagnostic"))) }
        // Home Assistant's enum device class needs the list of options, which a parser does not declare.
        if let dc = f.deviceClass, dc != "enum" { o.append(("device_class", .string(dc))) }
        if f.kind == .number, let unit = f.unit { o.append(("unit_of_measurement", .string(unit))) }
        if f.kind == .number, let sc = f.stateClass { o.append(("state_class", .string(sc))) }
        return .object(o)
    }

    func writableComponent(_ w: WritableSpec, _ r: DeviceRecord, oid: String, name: String? = nil) -> JSONValue {
        let t = topics
        var o: [(String, JSONValue)] = [
            ("p", .string(w.platform)),
            ("name", .string(name ?? humanName(GATTFieldDescriptor.inferred(fromName: w.name)))),
            ("unique_id", .string("\(oid)_\(w.name)")), ("command_topic", .string("\(t.set(r.id))/\(w.name)")),
        ]
        let descriptor =
            config.registry.parser(named: w.parserName ?? "")?.fields.first { $0.name == w.name }
            ?? GATTFieldDescriptor.inferred(fromName: w.name)
        switch w.platform {
        case "switch":
            o.append(("value_template", .string(Self.onOffTemplate(w.name))))
            o.append(("payload_on", .string("ON")))
            o.append(("payload_off", .string("OFF")))
        case "select":
            o.append(("value_template", .string(Self.valueTemplate(w.name, absent: "''"))))
            o.append(("options", .array((w.options ?? []).map(JSONValue.string))))
        case "number":
            o.append(("value_template", .string(Self.valueTemplate(w.name, absent: "''"))))
            if let v = w.minimum { o.append(("min", .double(v))) }
            if let v = w.maximum { o.append(("max", .double(v))) }
            if let v = w.step { o.append(("step", .double(v))) }
            if let unit = descriptor.unit { o.append(("unit_of_measurement", .string(unit))) }
            if let dc = descriptor.deviceClass, dc != "battery" { o.append(("device_class", .string(dc))) }
            o.append(("mode", .string("box")))
        default:
            o.append(("value_template", .string(Self.valueTemplate(w.name, absent: "''"))))
        }
        return .object(o)
    }
}
