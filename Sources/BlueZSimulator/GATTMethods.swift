// GattCharacteristic1/GattDescriptor1 methods: reads, writes, notify sessions, AcquireNotify/AcquireWrite sockets
// and the notification generators.
import DBus
import Dispatch

extension BlueZSimulator {
    static let characteristicInterfaceName = "org.bluez.GattCharacteristic1"
    /// Services bluetoothd claims with its own plugins and exports read-only.
    static let claimedServices: Set<UInt16> = [0x1800, 0x1801, 0x180A, 0x180F]

    func characteristic(at path: DBusObjectPath) -> (SimDevice, SimCharacteristic)? {
        for d in devices where path.rawValue.hasPrefix(d.path.rawValue + "/") {
            if let c = d.characteristics.first(where: { $0.path == path }) { return (d, c) }
        }
        return nil
    }

    func descriptor(at path: DBusObjectPath) -> (SimDevice, SimCharacteristic, Int)? {
        for d in devices where path.rawValue.hasPrefix(d.path.rawValue + "/") {
            for c in d.characteristics {
                if let i = c.layout.descriptors.firstIndex(where: { d.path.rawValue + $0.pathSuffix == path.rawValue })
                {
                    return (d, c, i)
                }
            }
        }
        return nil
    }

    /// Reads `offset` from an options dictionary; nil result + error when it has the wrong type.
    func offsetOption(_ value: DBusValue?) -> (offset: Int, type: String?, ok: Bool) {
        guard let options = value?.stringVariantDictionary else { return (0, nil, false) }
        var offset = 0
        if let o = options["offset"] {
            guard let q = o.uint16 else { return (0, nil, false) }
            offset = Int(q)
        }
        var type: String?
        if let t = options["type"] {
            guard let s = t.string else { return (0, nil, false) }
            type = s.lowercased()
        }
        return (offset, type, true)
    }

    func attFailure(_ fault: SimFault) -> DBusError { DBusError(name: fault.errorName, message: fault.errorMessage) }

    func readValue(_ call: DBusMethodCall) {
        guard let (d, c) = characteristic(at: call.path) else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        guard d.isConnected else { return call.reply.fail(Self.notConnectedFailed) }
        let (offset, _, ok) = offsetOption(call.arguments.first)
        guard ok else { return call.reply.fail(Self.invalidArguments) }
        count("reads")
        if let fault = takeFault(d, [.readError], uuid: c.uuid) {
            count("faults_fired")
            return call.reply.fail(attFailure(fault))
        }
        if takeFault(d, [.readNoReply], uuid: c.uuid) != nil {
            count("faults_fired")
            d.unanswered.append(call.reply)
            return
        }
        guard c.layout.spec.flags.contains("read") else {
            let e = simATTError(0x02, write: false)
            return call.reply.fail(DBusError(name: e.name, message: e.message))
        }
        guard offset <= c.stored.count else {
            let e = simATTError(0x07, write: false)
            return call.reply.fail(DBusError(name: e.name, message: e.message))
        }
        let value = Array(c.stored[offset...])
        server?.setProperty(
            at: c.path, interface: Self.characteristicInterfaceName, "Value", .bytes(value), flush: true)
        call.reply.succeed([.bytes(value)])
    }

    func writeValue(_ call: DBusMethodCall) {
        guard let (d, c) = characteristic(at: call.path) else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        guard call.arguments.count == 2, let value = call.arguments[0].bytes else {
            return call.reply.fail(Self.invalidArguments)
        }
        guard d.isConnected else { return call.reply.fail(Self.notConnectedFailed) }
        guard c.writeSocket == nil else { return call.reply.fail(Self.bluezError("NotPermitted", "Write acquired")) }
        let (offset, requested, ok) = offsetOption(call.arguments[1])
        guard ok else { return call.reply.fail(Self.invalidArguments) }
        let flags = c.layout.spec.flags
        let type: String
        switch requested {
        case nil:
            if flags.contains("write") {
                type = "request"
            } else if flags.contains("write-without-response"), offset == 0 {
                type = "command"
            } else {
                return call.reply.fail(Self.notSupported)
            }
        case "request", "reliable":
            type = "request"
        case "command":
            guard flags.contains("write-without-response"), offset == 0 else {
                return call.reply.fail(Self.notSupported)
            }
            type = "command"
        default:
            return call.reply.fail(Self.notSupported)
        }
        if let short = c.serviceUUID.short16, Self.claimedServices.contains(short) {
            return call.reply.fail(Self.bluezError("NotAuthorized", "Operation Not Authorized"))
        }
        if let fault = takeFault(d, [.writeError], uuid: c.uuid) {
            count("faults_fired")
            // A command has no response: the peer's error cannot reach the client.
            if type == "command" { return call.reply.succeed() }
            return call.reply.fail(attFailure(fault))
        }
        if type == "request", !flags.contains("write") {
            let e = simATTError(0x03, write: true)
            return call.reply.fail(DBusError(name: e.name, message: e.message))
        }
        guard offset <= c.stored.count else {
            let e = simATTError(0x07, write: true)
            return call.reply.fail(DBusError(name: e.name, message: e.message))
        }
        received(d, c, value: value, offset: offset, type: type)
        call.reply.succeed()
    }

    /// The peripheral received a write: store it, log it, echo it when configured.
    func received(_ d: SimDevice, _ c: SimCharacteristic, value: [UInt8], offset: Int, type: String) {
        count("writes")
        c.stored = Array(c.stored.prefix(offset)) + value
        d.writes.append((c.uuid.string, value, type))
        if let target = c.layout.spec.echoTo, let t = d.characteristic(target) { notify(d, t, value) }
    }

    // MARK: descriptors

    func readDescriptor(_ call: DBusMethodCall) {
        guard let (d, c, i) = descriptor(at: call.path) else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        guard d.isConnected else { return call.reply.fail(Self.notConnectedFailed) }
        let (offset, _, ok) = offsetOption(call.arguments.first)
        guard ok else { return call.reply.fail(Self.invalidArguments) }
        var value = c.descriptorValues[i]
        if c.layout.cccdIndex == i {
            let on: UInt8 = c.isSubscribed ? (c.layout.spec.flags.contains("notify") ? 1 : 2) : 0
            value = [on, 0]
        }
        guard offset <= value.count else {
            return call.reply.fail(Self.bluezError("InvalidArguments", "Invalid offset"))
        }
        let result = Array(value[offset...])
        count("reads")
        server?.setProperty(
            at: DBusObjectPath(stringLiteral: d.path.rawValue + c.layout.descriptors[i].pathSuffix),
            interface: "org.bluez.GattDescriptor1", "Value", .bytes(result), flush: true)
        call.reply.succeed([.bytes(result)])
    }

    func writeDescriptor(_ call: DBusMethodCall) {
        guard let (d, c, i) = descriptor(at: call.path) else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        guard call.arguments.count == 2, let value = call.arguments[0].bytes else {
            return call.reply.fail(Self.invalidArguments)
        }
        guard d.isConnected else { return call.reply.fail(Self.notConnectedFailed) }
        guard c.layout.cccdIndex != i else {
            return call.reply.fail(Self.bluezError("NotPermitted", "Write not permitted"))
        }
        if let short = c.serviceUUID.short16, Self.claimedServices.contains(short) {
            return call.reply.fail(Self.bluezError("NotAuthorized", "Operation Not Authorized"))
        }
        c.descriptorValues[i] = value
        count("writes")
        d.writes.append((c.layout.descriptors[i].uuid.string, value, "descriptor"))
        call.reply.succeed()
    }

    // MARK: notify sessions

    func startNotify(_ call: DBusMethodCall) {
        guard let (d, c) = characteristic(at: call.path) else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        guard c.canNotify else { return call.reply.fail(Self.notSupported) }
        guard c.notifySocket == nil else { return call.reply.fail(Self.bluezError("NotPermitted", "Notify acquired")) }
        if case .disconnecting = d.link { return call.reply.fail(Self.bluezError("NotConnected", "Not Connected")) }
        if c.sessions.contains(call.sender) { return call.reply.succeed() }
        if d.isConnected, let fault = takeFault(d, [.notifyError], uuid: c.uuid) {
            count("faults_fired")
            return call.reply.fail(attFailure(fault))
        }
        c.sessions.insert(call.sender)
        count("notify_sessions")
        if c.sessions.count == 1, d.isConnected {
            server?.setProperty(at: c.path, interface: Self.characteristicInterfaceName, "Notifying", .boolean(true))
        }
        call.reply.succeed()
        updateGenerator(d, c)
    }

    func stopNotify(_ call: DBusMethodCall) {
        guard let (d, c) = characteristic(at: call.path) else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        if c.notifySocket != nil, c.notifyOwner == call.sender {
            releaseNotifySocket(d, c)
            return call.reply.succeed()
        }
        guard c.sessions.contains(call.sender) else {
            return call.reply.fail(Self.bluezError("Failed", "No notify session started"))
        }
        removeNotifySession(d, c, call.sender)
        call.reply.succeed()
    }

    func removeNotifySession(_ d: SimDevice, _ c: SimCharacteristic, _ sender: String) {
        guard c.sessions.remove(sender) != nil else { return }
        if c.sessions.isEmpty, d.gattExported {
            server?.setProperty(at: c.path, interface: Self.characteristicInterfaceName, "Notifying", .boolean(false))
        }
        updateGenerator(d, c)
    }

    // MARK: acquired sockets

    func acquire(_ call: DBusMethodCall, notify: Bool) {
        guard let (d, c) = characteristic(at: call.path) else {
            return call.reply.fail(DBusError(name: DBusError.unknownObject, message: "Unknown object"))
        }
        guard call.arguments.first?.stringVariantDictionary != nil else {
            return call.reply.fail(Self.invalidArguments)
        }
        guard d.isConnected else { return call.reply.fail(Self.notConnectedFailed) }
        let flags = c.layout.spec.flags
        if notify {
            guard c.canNotify else { return call.reply.fail(Self.notSupported) }
            guard c.notifySocket == nil else {
                return call.reply.fail(Self.bluezError("NotPermitted", "Notify acquired"))
            }
            if let fault = takeFault(d, [.notifyError], uuid: c.uuid) {
                count("faults_fired")
                return call.reply.fail(attFailure(fault))
            }
            guard c.sessions.isEmpty else { return call.reply.fail(Self.inProgress) }
        } else {
            guard flags.contains("write-without-response") else { return call.reply.fail(Self.notSupported) }
            guard c.writeSocket == nil else {
                return call.reply.fail(Self.bluezError("NotPermitted", "Write acquired"))
            }
            if let short = c.serviceUUID.short16, Self.claimedServices.contains(short) {
                return call.reply.fail(Self.bluezError("NotAuthorized", "Operation Not Authorized"))
            }
        }
        guard let (mine, theirs) = makeSeqPacketPair() else {
            return call.reply.fail(Self.bluezError("Failed", "Failed to create socket pair"))
        }
        let socket = SimSocket(fd: mine)
        let source = DispatchSource.makeReadSource(fileDescriptor: mine, queue: queue)
        let epoch = self.epoch
        // Datagrams are read on the timer queue (so the source does not fire again and again) and applied on the loop.
        source.setEventHandler { [weak self, weak socket, source] in
            let (datagrams, eof) = readAllDatagrams(mine)
            if eof { source.cancel() }
            guard let self, let socket else { return }
            let (received, closed) = (datagrams, eof)
            self.onLoop(epoch: epoch) {
                self.socketEvents(d, c, socket, notify: notify, datagrams: received, eof: closed)
            }
        }
        source.setCancelHandler { _ = closeFD(mine) }
        socket.source = source
        source.resume()
        let iface = Self.characteristicInterfaceName
        if notify {
            c.notifySocket = socket
            c.notifyOwner = call.sender
            server?.setProperty(at: c.path, interface: iface, "NotifyAcquired", .boolean(true))
            count("notify_acquired")
        } else {
            c.writeSocket = socket
            server?.setProperty(at: c.path, interface: iface, "WriteAcquired", .boolean(true))
            count("write_acquired")
        }
        call.reply.succeed([.unixFD(DBusFileDescriptor(owning: theirs)), .uint16(scenario.mtu)])
        if notify { updateGenerator(d, c) }
    }

    func socketEvents(
        _ d: SimDevice, _ c: SimCharacteristic, _ socket: SimSocket, notify: Bool, datagrams: [[UInt8]],
        eof: Bool
    ) {
        // Datagrams on the write socket are Write Without Response; on the notify socket they are ignored.
        if !notify, c.writeSocket === socket, d.isConnected {
            for bytes in datagrams { received(d, c, value: bytes, offset: 0, type: "command") }
        }
        if eof {
            if notify, c.notifySocket === socket { releaseNotifySocket(d, c) }
            if !notify, c.writeSocket === socket { releaseWriteSocket(d, c) }
        }
    }

    func releaseNotifySocket(_ d: SimDevice, _ c: SimCharacteristic) {
        guard let s = c.notifySocket else { return }
        c.notifySocket = nil
        c.notifyOwner = nil
        s.close()
        server?.setProperty(at: c.path, interface: Self.characteristicInterfaceName, "NotifyAcquired", .boolean(false))
        updateGenerator(d, c)
    }

    func releaseWriteSocket(_ d: SimDevice, _ c: SimCharacteristic) {
        guard let s = c.writeSocket else { return }
        c.writeSocket = nil
        s.close()
        server?.setProperty(at: c.path, interface: Self.characteristicInterfaceName, "WriteAcquired", .boolean(false))
    }

    // MARK: notifications

    /// Sends one notification from the peripheral: a datagram on the acquired socket, or a `Value`
    /// PropertiesChanged (flushed, one signal per notification) when StartNotify sessions exist.
    @discardableResult
    func notify(_ d: SimDevice, _ c: SimCharacteristic, _ value: [UInt8]) -> Bool {
        guard d.isConnected, d.gattExported else { return false }
        if let s = c.notifySocket {
            if sendDatagram(s.fd, value) {
                count("notifications")
                return true
            }
            count("notifications_dropped")
            return false
        }
        guard !c.sessions.isEmpty, let server else { return false }
        server.setProperty(at: c.path, interface: Self.characteristicInterfaceName, "Value", .bytes(value), flush: true)
        count("notifications")
        return true
    }

    /// Runs the characteristic's generator while it is subscribed and the device connected.
    func updateGenerator(_ d: SimDevice, _ c: SimCharacteristic) {
        let active =
            d.isConnected && d.servicesResolved && c.isSubscribed && c.rateHz > 0 && c.layout.spec.notify != nil
        if !active {
            c.timer?.cancel()
            c.timer = nil
            return
        }
        guard c.timer == nil, let generator = c.layout.spec.notify else { return }
        let timer = DispatchSource.makeTimerSource(queue: queue)
        c.timerGeneration += 1
        let generation = c.timerGeneration
        let interval = 1.0 / c.rateHz
        let epoch = self.epoch
        timer.schedule(deadline: .now() + interval, repeating: interval, leeway: .milliseconds(1))
        timer.setEventHandler { [weak self] in
            self?.onLoop(epoch: epoch) { [weak self] in
                guard let self, c.timer != nil, c.timerGeneration == generation else { return }
                let value = generator.value(c.notifyIndex)
                c.notifyIndex += 1
                self.notify(d, c, value)
            }
        }
        c.timer = timer
        timer.resume()
    }
}
