// Reloading the configuration (SIGHUP, `bridge/request/config/reload`): devices added, removed or changed are
// applied without touching the others' connections or data. MQTT settings need a restart.
import GATT
import Logging

/// What a reload changed.
public struct ReloadSummary: Sendable, Equatable, CustomStringConvertible {
    /// Devices added.
    public var added: [String] = []
    /// Devices removed.
    public var removed: [String] = []
    /// Devices whose settings changed (their session was restarted).
    public var changed: [String] = []
    /// Settings that need a restart to take effect.
    public var needsRestart: [String] = []

    /// `2 added (a, b), 1 removed (c), 0 changed`.
    public var description: String {
        func list(_ ids: [String]) -> String { ids.isEmpty ? "" : " (\(ids.joined(separator: ", ")))" }
        var text =
            "\(added.count) added\(list(added)), \(removed.count) removed\(list(removed)), "
            + "\(changed.count) changed\(list(changed))"
        if !needsRestart.isEmpty { text += "; restart to apply \(needsRestart.joined(separator: ", "))" }
        return text
    }
}

extension DeviceConfig {
    /// The settings without the position in the file (moving an entry is not a change).
    var comparable: DeviceConfig {
        var copy = self
        copy.index = 0
        return copy
    }
}

extension Bridge {
    /// Applies a new configuration: removed devices are disconnected on purpose and leave Home Assistant, added ones
    /// start, changed ones restart; the others keep their connections and data. The `mqtt` section (broker, base
    /// topic) is kept as it was and reported in `needsRestart` when it differs.
    public func reload(_ new: BridgeConfig) async -> ReloadSummary {
        var summary = ReloadSummary()
        let old = config
        var applied = new
        if old.mqtt != new.mqtt {
            summary.needsRestart.append("mqtt")
            applied.mqtt = old.mqtt
        }
        if old.homeAssistant.prefix != new.homeAssistant.prefix {
            summary.needsRestart.append("homeassistant.prefix")
            applied.homeAssistant.prefix = old.homeAssistant.prefix
        }
        if old.gateway != new.gateway {
            summary.needsRestart.append("gateway")
            applied.gateway = old.gateway
        }
        if old.peripheral != new.peripheral {
            summary.needsRestart.append("peripheral")
            applied.peripheral = old.peripheral
        }
        let oldDevices = Dictionary(old.devices.map { ($0.id, $0) }) { a, _ in a }
        let newDevices = Dictionary(new.devices.map { ($0.id, $0) }) { a, _ in a }
        var stopping: [DeviceRecord] = []
        var restart: [DeviceRecord] = []
        engine.withLock { s in
            s.config = applied
            // Removed devices; extra devices ("<id>_<address>") of entries that went or changed (they come back with
            // the next advertisement); auto devices when auto_devices was turned off.
            for (id, r) in s.devices {
                if r.config.index < 0 {
                    if !new.autoDevices.enabled {
                        stopping.append(r)
                        summary.removed.append(id)
                    }
                    continue
                }
                let entry = old.devices.indices.contains(r.config.index) ? old.devices[r.config.index].id : id
                if entry != id {
                    if newDevices[entry]?.comparable != oldDevices[entry]?.comparable || newDevices[entry] == nil {
                        stopping.append(r)
                        summary.removed.append(id)
                    }
                } else if newDevices[id] == nil {
                    stopping.append(r)
                    summary.removed.append(id)
                }
            }
            for r in stopping {
                s.devices.removeValue(forKey: r.id)
                s.order.removeAll { $0 == r.id }
                if let a = r.address, s.byAddress[a] === r { s.byAddress.removeValue(forKey: a) }
            }
            for device in new.devices {
                if let previous = oldDevices[device.id] {
                    guard previous.comparable != device.comparable, let r = s.devices[device.id] else {
                        // Unchanged: the same record, now with its position in the new file.
                        continue
                    }
                    summary.changed.append(device.id)
                    stopping.append(r)
                    let replacement = DeviceRecord(id: device.id, config: device, address: device.match.address)
                    // What was learned about the device survives the change (state, address, intervals).
                    let learned = r.data.withLock { $0 }
                    replacement.data.withLock { d in
                        d.address = device.match.address ?? (previous.match == device.match ? learned.address : nil)
                        d.fields = learned.fields
                        d.rssi = learned.rssi
                        d.rssiByAdapter = learned.rssiByAdapter
                        d.advertInterval = learned.advertInterval
                        d.lastAdvert = learned.lastAdvert
                        d.lastSeen = learned.lastSeen
                        d.lastSeenWall = learned.lastSeenWall
                        d.advertisedName = learned.advertisedName
                    }
                    s.devices[device.id] = replacement
                    if let a = r.address, s.byAddress[a] === r { s.byAddress.removeValue(forKey: a) }
                    if let a = replacement.address { s.byAddress[a] = replacement }
                    restart.append(replacement)
                } else {
                    summary.added.append(device.id)
                    let r = DeviceRecord(id: device.id, config: device, address: device.match.address)
                    s.devices[device.id] = r
                    if let a = device.match.address, s.byAddress[a] == nil { s.byAddress[a] = r }
                    restart.append(r)
                }
            }
            s.order =
                new.devices.map(\.id).filter { s.devices[$0] != nil }
                + s.order.filter { id in !new.devices.contains { $0.id == id } && s.devices[id] != nil }
        }
        // Sessions of removed and changed devices end on purpose (no reconnect), outside the lock.
        for r in stopping {
            let task = r.data.withLock { d -> Task<Void, Never>? in
                d.userDisconnected = true
                return d.sessionTask
            }
            if let task {
                task.cancel()
                await task.value
            }
        }
        for id in summary.removed {
            if let r = stopping.first(where: { $0.id == id }) {
                setAvailability(r, online: false)
                publishEvent("removed", r)
            }
            removeDiscovery(id: id)
        }
        for r in restart where r.config.mode == .poll || (r.config.mode == .connected && r.address != nil) {
            ensureSession(r)
        }
        if old.scanServiceUUIDs != applied.scanServiceUUIDs || old.bluetooth.passive != applied.bluetooth.passive
            || old.bluetooth.adapters != applied.bluetooth.adapters
            || old.bluetooth.duplicateData != applied.bluetooth.duplicateData
        {
            await startScanning()
        }
        publishInfo()
        publishDevices()
        publishAllDiscovery()
        logger.info("configuration reloaded: \(summary)")
        return summary
    }
}
