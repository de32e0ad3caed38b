// Device1.Connect/Disconnect/Pair with BlueZ's signal order, fault injection and the GATT cache.
import DBus

extension BlueZSimulator {
    /// Takes one fault of `kind` (decrementing its count).
    func takeFault(_ d: SimDevice, _ kinds: Set<SimFault.Kind>, uuid: SimUUID? = nil) -> SimFault? {
        guard let i = d.faults.firstIndex(where: { kinds.contains($0.kind) && ($0.uuid == nil || $0.uuid == uuid) })
        else {
            return nil
        }
        let fault = d.faults[i]
        if fault.remaining > 0 {
            d.faults[i].remaining -= 1
            if d.faults[i].remaining == 0 { d.faults.remove(at: i) }
        }
        return fault
    }

    func connectCall(_ call: DBusMethodCall) {
        if let central = centrals.first(where: { $0.devicePath == call.path }) {
            return centralConnectCall(central, call)
        }
        guard let d = device(at: call.path), d.exported, let a = adapter(of: d) else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        guard a.powered else { return call.reply.fail(Self.notReady) }
        switch d.link {
        case .connected: return call.reply.succeed()
        case .connecting, .disconnecting: return call.reply.fail(Self.inProgress)
        case .disconnected: break
        }
        count("connect_calls")
        if let fault = takeFault(d, [.inProgress]) {
            count("faults_fired")
            return call.reply.fail(DBusError(name: fault.errorName, message: fault.errorMessage))
        }
        d.linkGeneration += 1
        let generation = d.linkGeneration
        d.link = .connecting(call.reply, generation: generation)
        if takeFault(d, [.noReply]) != nil {
            count("faults_fired")
            return  // stays pending until Disconnect cancels it or the caller gives up
        }
        if let fault = takeFault(d, [.connectFailed]) {
            count("faults_fired")
            after(d.spec.connectDelay) { [weak self] in
                guard let self, d.linkGeneration == generation, case .connecting(let reply, _) = d.link else { return }
                d.link = .disconnected
                self.count("connect_failures")
                reply.fail(DBusError(name: fault.errorName, message: fault.errorMessage))
            }
            return
        }
        let abort = takeFault(d, [.abortByLocal])
        let early = takeFault(d, [.servicesResolvedEarly])
        let already = takeFault(d, [.alreadyConnected])
        let unsignalled = takeFault(d, [.connectedUnsignalled])
        if abort != nil || early != nil || already != nil || unsignalled != nil { count("faults_fired") }
        // The reply to a Connect() that brings the link up.
        let answer: @Sendable (DBusPendingReply) -> Void = { reply in
            if already != nil {
                reply.fail(Self.bluezError("Failed", "le-connection-already-connected"))
            } else {
                reply.succeed()
            }
        }
        guard d.spec.connectable else {
            after(max(d.spec.connectDelay, 0.2)) { [weak self] in
                guard let self, d.linkGeneration == generation, case .connecting(let reply, _) = d.link else { return }
                d.link = .disconnected
                self.count("connect_failures")
                reply.fail(Self.bluezError("Failed", "le-connection-abort-by-local"))
            }
            return
        }
        after(d.spec.connectDelay) { [weak self] in
            guard let self, d.linkGeneration == generation, case .connecting(let reply, _) = d.link else { return }
            guard let server = self.server else { return }
            if let early, d.gattExported {
                _ = early
                self.unexportGATT(d)  // the cached objects vanish; they come back after ServicesResolved
            }
            d.link = .connected
            if !isPrivateRandomAddress(d.spec.address, type: d.spec.addressType) { d.temporary = false }
            if unsignalled != nil {
                server.storePropertySilently(at: d.path, interface: "org.bluez.Device1", "Connected", .boolean(true))
            } else {
                server.setProperty(at: d.path, interface: "org.bluez.Device1", "Connected", .boolean(true))
            }
            if abort != nil {
                self.count("connect_failures")
                reply.fail(Self.bluezError("Failed", "le-connection-abort-by-local"))
                self.after(0.01) { [weak self] in
                    guard let self, d.linkGeneration == generation else { return }
                    self.linkDown(d, reason: ("org.bluez.Reason.Local", "Connection terminated by local host"))
                }
                return
            }
            self.count("connects")
            // A reconnect with the GATT cache (bluetoothd skips discovery) may resolve services before replying.
            let order = d.gattExported && early == nil ? d.spec.servicesResolved : .afterReply
            switch order {
            case .withConnected, .beforeReply:
                if order == .beforeReply { server.flush() }
                self.resolveServices(d, early: false)
                server.flush()
                self.after(d.spec.servicesDelay) { [weak self] in
                    guard self != nil else { return }
                    guard d.linkGeneration == generation, d.isConnected else {
                        return reply.fail(Self.bluezError("Failed", "br-connection-canceled"))
                    }
                    answer(reply)
                }
            case .afterReply, .kept:
                answer(reply)
                self.after(d.spec.servicesDelay) { [weak self] in
                    guard let self, d.linkGeneration == generation, d.isConnected else { return }
                    self.resolveServices(d, early: early != nil)
                }
            }
        }
    }

    func resolveServices(_ d: SimDevice, early: Bool) {
        guard let server else { return }
        let uuids = d.adv.uuids + d.layout.services.map(\.uuid.string).filter { !d.adv.uuids.contains($0) }
        d.adv.uuids = uuids
        if early {
            server.setProperty(at: d.path, interface: "org.bluez.Device1", "UUIDs", .stringArray(uuids))
            server.setProperty(at: d.path, interface: "org.bluez.Device1", "ServicesResolved", .boolean(true))
            server.flush()
            d.servicesResolved = true
            let generation = d.linkGeneration
            after(0.05) { [weak self] in
                guard let self, d.linkGeneration == generation, d.isConnected else { return }
                self.exportGATT(d)
                self.servicesUp(d)
            }
            return
        }
        exportGATT(d)
        server.setProperty(at: d.path, interface: "org.bluez.Device1", "UUIDs", .stringArray(uuids))
        server.setProperty(at: d.path, interface: "org.bluez.Device1", "ServicesResolved", .boolean(true))
        d.servicesResolved = true
        servicesUp(d)
    }

    /// Re-registers the notify sessions that survived a disconnect (BlueZ `btd_gatt_client_connected`).
    func servicesUp(_ d: SimDevice) {
        if !isPrivateRandomAddress(d.spec.address, type: d.spec.addressType) { d.temporary = false }
        for c in d.characteristics where !c.sessions.isEmpty {
            server?.setProperty(at: c.path, interface: "org.bluez.GattCharacteristic1", "Notifying", .boolean(true))
            updateGenerator(d, c)
        }
    }

    func disconnectCall(_ call: DBusMethodCall) {
        if let central = centrals.first(where: { $0.devicePath == call.path }) {
            if central.connected { dropCentral(central, reason: Self.reasons["local"] ?? ("", "")) }
            return call.reply.succeed()
        }
        guard let d = device(at: call.path), d.exported else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        switch d.link {
        case .disconnected: call.reply.succeed()
        case .connecting(let pending, _):
            d.link = .disconnected
            d.linkGeneration += 1
            pending.fail(Self.bluezError("Failed", "br-connection-canceled"))
            call.reply.succeed()
        case .disconnecting, .connected:
            count("disconnect_calls")
            disconnect(d, reason: ("org.bluez.Reason.Local", "Connection terminated by local host")) {
                call.reply.succeed()
            }
        }
    }

    /// Takes the link down after the device's disconnect delay, then runs `completion` (after Connected=false).
    func disconnect(_ d: SimDevice, reason: (String, String), completion: @escaping @Sendable () -> Void) {
        if case .connecting(let pending, _) = d.link {
            d.link = .disconnected
            d.linkGeneration += 1
            pending.fail(Self.bluezError("Failed", "br-connection-canceled"))
            return completion()
        }
        guard d.isConnected || { if case .disconnecting = d.link { return true } else { return false } }() else {
            return completion()
        }
        d.link = .disconnecting
        let generation = d.linkGeneration
        after(d.spec.disconnectDelay) { [weak self] in
            guard let self else { return }
            if d.linkGeneration == generation, case .disconnecting = d.link { self.linkDown(d, reason: reason) }
            completion()
        }
    }

    /// device_remove_connection: sockets shut, ServicesResolved false, Disconnected(reason), Connected false.
    func linkDown(_ d: SimDevice, reason: (String, String)) {
        guard let server else { return }
        d.linkGeneration += 1
        for c in d.characteristics {
            c.timer?.cancel()
            c.timer = nil
            if c.notifySocket != nil { releaseNotifySocket(d, c) }
            if c.writeSocket != nil { releaseWriteSocket(d, c) }
        }
        let iface = "org.bluez.Device1"
        if d.servicesResolved, d.spec.servicesResolved != .kept {
            server.setProperty(at: d.path, interface: iface, "ServicesResolved", .boolean(false))
        }
        d.servicesResolved = false
        if scenario.disconnectedSignal {
            server.emitSignal(
                path: d.path, interface: iface, name: "Disconnected",
                arguments: [.string(reason.0), .string(reason.1)])
        } else {
            server.flush()  // bluetoothd 5.66 still sends ServicesResolved=false and Connected=false apart
        }
        server.setProperty(at: d.path, interface: iface, "Connected", .boolean(false))
        server.flush()
        d.link = .disconnected
        count("disconnects")
        if !scenario.gattCache { unexportGATT(d) }
        if d.temporary {
            scheduleExpiry(d)
        } else if isPrivateRandomAddress(d.spec.address, type: d.spec.addressType) {
            scheduleExpiry(d)
        }
    }

    func pairCall(_ call: DBusMethodCall) {
        guard let d = device(at: call.path), d.exported else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        guard !d.paired else { return call.reply.fail(Self.alreadyExists) }
        d.paired = true
        d.temporary = false
        server?.setProperty(at: d.path, interface: "org.bluez.Device1", "Paired", .boolean(true))
        server?.setProperty(at: d.path, interface: "org.bluez.Device1", "Bonded", .boolean(true))
        call.reply.succeed()
    }
}
