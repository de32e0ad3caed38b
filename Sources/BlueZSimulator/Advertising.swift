// LEAdvertisingManager1 on each adapter, as BlueZ's src/advertising.c runs it: the LEAdvertisement1 properties are
// read from the sender (Properties.GetAll, as its GDBusProxy does) and parsed property by property, the legacy
// advertising data is sized the way BlueZ's src/shared/ad.c builds it, and PropertiesChanged updates the data in place.
import DBus

extension BlueZSimulator {
    static let advertisementInterface = "org.bluez.LEAdvertisement1"
    static let advertisingManagerInterface = "org.bluez.LEAdvertisingManager1"
    /// `max_ads` of a controller without extended advertising (what the simulator's adapters report).
    static let maxAdvertisements = 5
    /// BT_AD_MAX_DATA_LEN: legacy advertising data.
    static let maxAdvertisingData = 31
    static let parseFailed = bluezError("Failed", "Failed to parse advertisement.")

    func registerAdvertisement(_ call: DBusMethodCall) {
        guard let path = call.arguments.first?.objectPath, call.arguments.count == 2 else {
            return call.reply.fail(Self.invalidArguments)
        }
        guard let a = adapters.first(where: { $0.path == call.path }) else { return call.reply.fail(Self.doesNotExist) }
        let sender = call.sender
        let id = a.spec.id
        let mine = advertisements.filter { $0.adapterID == id }
        let pending = pendingAds.filter { $0.adapterID == id }
        if mine.contains(where: { $0.owner == sender && $0.path == path })
            || pending.contains(where: { $0.owner == sender && $0.path == path })
        {
            return call.reply.fail(Self.alreadyExists)
        }
        // util_get_uid over max_ads: no free instance left.
        guard mine.count + pending.count < Self.maxAdvertisements else {
            return call.reply.fail(Self.bluezError("NotPermitted", "Maximum advertisements reached"))
        }
        guard let connection else {
            return call.reply.fail(Self.bluezError("Failed", "Failed to register advertisement"))
        }
        pendingAds.append((sender, path, id))
        let epoch = self.epoch
        Task { [weak self] in
            let changes = try? await connection.signals(
                matching: DBusMatchRule(
                    type: .signal, sender: sender, interface: "org.freedesktop.DBus.Properties",
                    member: "PropertiesChanged", path: path, arguments: [0: Self.advertisementInterface]))
            let props: [String: DBusValue]?
            do {
                props = try await connection.call(
                    destination: sender, path: path, interface: "org.freedesktop.DBus.Properties", method: "GetAll",
                    arguments: [.string(Self.advertisementInterface)], timeout: .seconds(5)
                ).first?.stringVariantDictionary
            } catch {
                props = nil
            }
            guard let self else { return }
            self.onLoop(epoch: epoch) {
                let isPending = { (p: (owner: String, path: DBusObjectPath, adapterID: String)) in
                    p.owner == sender && p.path == path && p.adapterID == id
                }
                // Gone meanwhile: the owner left the bus or the adapter went (client_free's answer).
                guard self.pendingAds.contains(where: isPending) else {
                    return call.reply.fail(Self.bluezError("Failed", "Failed to complete registration"))
                }
                self.pendingAds.removeAll(where: isPending)
                guard let props, let adapter = self.adapters.first(where: { $0.spec.id == id }) else {
                    return call.reply.fail(Self.bluezError("Failed", "Failed to complete registration"))
                }
                guard let parsed = self.parseAdvertisement(props, adapter: adapter) else {
                    self.count("advertisements_rejected")
                    return call.reply.fail(Self.parseFailed)
                }
                let ad = SimLocalAdvertisement(
                    owner: sender, path: path, adapterID: id, properties: props, parsed: parsed)
                self.advertisements.append(ad)
                self.count("advertisements_registered")
                self.updateInstances(adapter)
                call.reply.succeed()
                self.armAdvertisementTimeout(ad)
                if let changes {
                    // Cancelled when the advertisement goes, so it may hold the simulator.
                    ad.watch = Task { [self] in
                        for await m in changes {
                            self.onLoop(epoch: epoch) { self.advertisementChanged(ad, m) }
                        }
                    }
                }
            }
        }
    }

    func unregisterAdvertisement(_ call: DBusMethodCall) {
        guard let path = call.arguments.first?.objectPath else { return call.reply.fail(Self.invalidArguments) }
        let id = adapterID(call.path)
        guard let ad = advertisements.first(where: { $0.owner == call.sender && $0.path == path && $0.adapterID == id })
        else { return call.reply.fail(Self.doesNotExist) }
        // client_remove: no Release for an advertisement its owner takes back.
        removeAdvertisement(ad, release: false)
        call.reply.succeed()
    }

    /// client_remove (and client_destroy with `release`, which first calls `Release()` on the object).
    func removeAdvertisement(_ ad: SimLocalAdvertisement, release: Bool) {
        ad.watch?.cancel()
        ad.watch = nil
        advertisements.removeAll { $0 === ad }
        count("advertisements_removed")
        if release, let connection {
            count("advertisements_released")
            let message = DBusMessage.methodCall(
                destination: ad.owner, path: ad.path, interface: Self.advertisementInterface, method: "Release")
            Task { _ = try? await connection.call(message, timeout: .seconds(5)) }
        }
        if let a = adapters.first(where: { $0.spec.id == ad.adapterID }) { updateInstances(a) }
    }

    func updateInstances(_ a: SimAdapter) {
        let n = advertisements.filter { $0.adapterID == a.spec.id }.count
        server?.setProperty(at: a.path, interface: Self.advertisingManagerInterface, "ActiveInstances", .byte(UInt8(n)))
        server?.setProperty(
            at: a.path, interface: Self.advertisingManagerInterface, "SupportedInstances",
            .byte(UInt8(max(0, Self.maxAdvertisements - n))))
    }

    /// client_timeout: when Timeout expires bluetoothd releases the advertisement and removes it.
    func armAdvertisementTimeout(_ ad: SimLocalAdvertisement) {
        ad.timeout += 1
        let generation = ad.timeout
        guard let seconds = ad.parsed.timeout, seconds > 0 else { return }
        after(Double(seconds)) { [weak self] in
            guard let self, ad.timeout == generation, self.advertisements.contains(where: { $0 === ad }) else { return }
            self.removeAdvertisement(ad, release: true)
        }
    }

    /// properties_changed: each changed property goes through its parser; a valid one updates the data in place.
    func advertisementChanged(_ ad: SimLocalAdvertisement, _ m: DBusMessage) {
        guard advertisements.contains(where: { $0 === ad }), m.body.count == 3,
            let entries = m.body[1].dictionaryEntries,
            let adapter = adapters.first(where: { $0.spec.id == ad.adapterID })
        else { return }
        let invalidated = m.body[2].arrayElements?.compactMap(\.string) ?? []
        // In the signal's order, as GDBusProxy hands them to properties_changed.
        for entry in entries {
            guard let name = entry.key.string else { continue }
            let value = entry.value.variantValue ?? entry.value
            var next = ad.parsed
            guard Self.parseAdvertisementProperty(name, value, into: &next) else { continue }
            ad.properties[name] = value
            ad.parsed = next
            if name == "Timeout" { armAdvertisementTimeout(ad) }
        }
        for name in invalidated {
            var next = ad.parsed
            guard Self.parseAdvertisementProperty(name, nil, into: &next) else { continue }
            ad.properties[name] = nil
            ad.parsed = next
        }
        ad.parsed.adLength = advertisingDataLength(ad.parsed, adapter: adapter).length
        count("advertisement_updates")
    }

    /// parse_advertisement: every known property through its parser, then the flag, timeout and interval checks,
    /// then refresh_legacy_adv's length check. Nil when bluetoothd would answer "Failed to parse advertisement."
    func parseAdvertisement(_ props: [String: DBusValue], adapter: SimAdapter) -> SimParsedAdvertisement? {
        var p = SimParsedAdvertisement()
        for name in Self.advertisementParsers {
            guard let value = props[name] else { continue }
            guard Self.parseAdvertisementProperty(name, value, into: &p) else { return nil }
        }
        if p.discoverable == true, p.type == "broadcast" { return nil }
        if let t = p.timeout, t > 0, let dt = p.discoverableTimeout, p.discoverable == true, t < dt { return nil }
        if (p.minIntervalMS ?? 0) > (p.maxIntervalMS ?? 0) { return nil }
        let (length, max) = advertisingDataLength(p, adapter: adapter)
        guard length <= max else { return nil }
        p.adLength = length
        return p
    }

    /// The parsers table of src/advertising.c, in its order.
    static let advertisementParsers = [
        "Type", "ServiceUUIDs", "SolicitUUIDs", "ManufacturerData", "ServiceData", "Includes", "LocalName",
        "Appearance", "Duration", "Timeout", "Data", "Discoverable", "DiscoverableTimeout", "SecondaryChannel",
        "MinInterval", "MaxInterval", "TxPower",
    ]

    /// One parser of src/advertising.c; `value` nil is the property going away. False when it rejects the value.
    static func parseAdvertisementProperty(_ name: String, _ value: DBusValue?, into p: inout SimParsedAdvertisement)
        -> Bool
    {
        switch name {
        case "Type":
            guard let value else { return true }
            guard case .string(let t) = value, t == "broadcast" || t == "peripheral" else { return false }
            p.type = t
        case "ServiceUUIDs", "SolicitUUIDs":
            var list: [SimUUID] = []
            if let value {
                guard let strings = stringList(value) else { return false }
                for s in strings {
                    guard let u = SimUUID(s) else { return false }
                    list.append(u)
                }
            }
            if name == "ServiceUUIDs" { p.serviceUUIDs = list } else { p.solicitUUIDs = list }
        case "ManufacturerData":
            var list: [(UInt16, [UInt8])] = []
            for entry in value?.dictionaryEntries ?? [] {
                // bt_ad_add_manufacturer_data: at most 31 - 2 - 2 bytes; a second entry for an id replaces it.
                guard case .uint16(let company) = entry.key, let bytes = entry.value.variantValue?.bytes,
                    bytes.count <= maxAdvertisingData - 4
                else { return false }
                list.removeAll { $0.0 == company }
                list.append((company, bytes))
            }
            if let value, value.dictionaryEntries == nil { return false }
            p.manufacturerData = list
        case "ServiceData":
            var list: [(SimUUID, [UInt8])] = []
            for entry in value?.dictionaryEntries ?? [] {
                guard case .string(let text) = entry.key, let uuid = SimUUID(text),
                    let bytes = entry.value.variantValue?.bytes,
                    bytes.count <= maxAdvertisingData - 2 - uuidLength(uuid)
                else { return false }
                list.removeAll { $0.0 == uuid }
                list.append((uuid, bytes))
            }
            if let value, value.dictionaryEntries == nil { return false }
            p.serviceData = list
        case "Includes":
            guard let value else {
                p.includes = []
                return true
            }
            guard let strings = stringList(value) else { return false }
            // Unsupported names are skipped, not refused.
            p.includes = ["tx-power", "appearance", "local-name"].filter { strings.contains($0) }
        case "LocalName":
            guard let value else {
                p.localName = nil
                return true
            }
            guard case .string(let n) = value, !p.includes.contains("local-name") else { return false }
            p.localName = n.isEmpty ? nil : n
        case "Appearance":
            guard let value else {
                p.appearance = nil
                return true
            }
            guard case .uint16(let v) = value, !p.includes.contains("appearance") else { return false }
            p.appearance = v
        case "Duration", "Timeout", "DiscoverableTimeout":
            var v: UInt16?
            if let value {
                guard case .uint16(let q) = value else { return false }
                v = q
            }
            switch name {
            case "Duration": p.duration = v
            case "Timeout": p.timeout = v
            default: p.discoverableTimeout = v
            }
        case "Data":
            var list: [(UInt8, [UInt8])] = []
            for entry in value?.dictionaryEntries ?? [] {
                // bt_ad_add_data: at most 29 bytes, and no type bluetoothd builds from other properties.
                guard case .byte(let type) = entry.key, let bytes = entry.value.variantValue?.bytes,
                    bytes.count <= maxAdvertisingData - 2, !rejectedDataTypes.contains(type)
                else { return false }
                list.removeAll { $0.0 == type }
                list.append((type, bytes))
            }
            if let value, value.dictionaryEntries == nil { return false }
            p.data = list
        case "Discoverable":
            guard let value else {
                p.discoverable = nil
                return true
            }
            guard case .boolean(let b) = value else { return false }
            p.discoverable = b
        case "SecondaryChannel":
            guard let value else {
                p.secondaryChannel = nil
                return true
            }
            guard case .string(let s) = value, ["1M", "2M", "Coded"].contains(s) else { return false }
            p.secondaryChannel = s
        case "MinInterval", "MaxInterval":
            // parse_min_interval/parse_max_interval (bluetoothd -E): milliseconds, 0x20...0xFFFFFF in 0.625 ms.
            guard case .uint32(let ms)? = value else { return false }
            let units = Double(ms) / 0.625
            guard units >= 0x20, units <= 0xFF_FFFF else { return false }
            if name == "MinInterval" { p.minIntervalMS = ms } else { p.maxIntervalMS = ms }
        case "TxPower":
            guard case .int16(let v)? = value, (-127...20).contains(v) else { return false }
            p.txPower = v
        default:
            return false
        }
        return true
    }

    /// AD types bt_ad_add_data refuses (BlueZ's src/shared/ad.c `type_reject_list`).
    static let rejectedDataTypes: Set<UInt8> = [
        0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0d, 0x0e, 0x0f, 0x10, 0x11, 0x12, 0x14, 0x15,
        0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x21, 0x22, 0x23, 0x27, 0x28, 0x29, 0x2a,
        0x2b, 0x3d, 0xff,
    ]

    /// bt_uuid_len after bt_string_to_uuid: SIG base UUIDs shrink to 16 bits.
    static func uuidLength(_ u: SimUUID) -> Int { u.short16 != nil ? 2 : 16 }

    /// The advertising data length (calculate_length in BlueZ's src/shared/ad.c, after generate_adv_data) and the room
    /// for it (calc_max_adv_len in src/advertising.c: 31 less 3 for tx-power, 3 for kernel-managed flags, 4 for
    /// an included appearance).
    func advertisingDataLength(_ p: SimParsedAdvertisement, adapter: SimAdapter) -> (length: Int, max: Int) {
        func uuidList(_ list: [SimUUID]) -> Int {
            guard !list.isEmpty else { return 0 }
            let short = list.filter { $0.short16 != nil }.count
            let long = list.count - short
            return short * 2 + long * 16 + (short > 0 ? 2 : 0) + (long > 0 ? 2 : 0)
        }
        var length = uuidList(p.serviceUUIDs) + uuidList(p.solicitUUIDs)
        length += p.manufacturerData.reduce(0) { $0 + 4 + $1.1.count }
        length += p.serviceData.reduce(0) { $0 + 2 + Self.uuidLength($1.0) + $1.1.count }
        // The name goes in the scan response, except for a connectable advertisement on a secondary PHY.
        if let name = p.localName, p.type == "peripheral", p.secondaryChannel != nil {
            length += min(2 + name.utf8.count, max(0, Self.maxAdvertisingData - length))
        }
        if p.appearance != nil || p.includes.contains("appearance") { length += 4 }
        length += p.data.reduce(0) { $0 + 2 + $1.1.count }
        // set_flags: Discoverable true puts a Flags AD structure (General, plus BR/EDR Not Supported) in the data.
        let hasFlags = p.discoverable == true
        if hasFlags { length += 3 }
        var room = Self.maxAdvertisingData
        if p.includes.contains("tx-power") { room -= 3 }
        let adapterDiscoverable =
            server?.property(at: adapter.path, interface: "org.bluez.Adapter1", "Discoverable")?.bool ?? false
        if p.type == "peripheral", adapterDiscoverable, !hasFlags { room -= 3 }
        if p.includes.contains("appearance") { room -= 4 }
        return (length, room)
    }

    func getAdvertisements(_ call: DBusMethodCall) {
        guard let id = call.arguments.first?.string, let a = controlAdapter(id) else {
            return call.reply.fail(
                Self.controlFailure("DoesNotExist", "No adapter \"\(call.arguments.first?.string ?? "")\""))
        }
        func hex(_ bytes: [UInt8]) -> String {
            bytes.map { b in
                let h = String(b, radix: 16)
                return h.count < 2 ? "0" + h : h
            }.joined()
        }
        var out = SimJSON()
        out.array(advertisements.filter { $0.adapterID == a.spec.id }) { o, ad in
            let p = ad.parsed
            o.object {
                $0.field("owner", ad.owner)
                $0.field("path", ad.path.rawValue)
                $0.field("type", p.type)
                $0.field("local_name", p.localName)
                $0.key("service_uuids")
                $0.strings(p.serviceUUIDs.map(\.string))
                $0.key("solicit_uuids")
                $0.strings(p.solicitUUIDs.map(\.string))
                $0.key("manufacturer_data")
                $0.object { o in
                    for (company, bytes) in p.manufacturerData { o.field(String(company), hex(bytes)) }
                }
                $0.key("service_data")
                $0.object { o in
                    for (uuid, bytes) in p.serviceData { o.field(uuid.string, hex(bytes)) }
                }
                $0.key("data")
                $0.object { o in
                    for (type, bytes) in p.data { o.field(String(type), hex(bytes)) }
                }
                $0.key("includes")
                $0.strings(p.includes)
                $0.field("discoverable", p.discoverable)
                $0.field("min_interval", p.minIntervalMS.map { Int($0) })
                $0.field("max_interval", p.maxIntervalMS.map { Int($0) })
                $0.field("tx_power", p.txPower.map { Int($0) })
                $0.field("appearance", p.appearance.map { Int($0) })
                $0.field("duration", p.duration.map { Int($0) })
                $0.field("timeout", p.timeout.map { Int($0) })
                $0.field("ad_length", p.adLength)
            }
        }
        call.reply.succeed([.string(out.text)])
    }
}
