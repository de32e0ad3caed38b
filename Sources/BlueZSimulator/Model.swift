import DBus
// Runtime state of the simulated world. Every object here is confined to the simulator's loop (the D-Bus
// connection's dispatch thread, see `BlueZSimulator`); that confinement makes the `@unchecked Sendable` sound.
import Dispatch

/// A fault injected through the control interface.
struct SimFault: Sendable {
    enum Kind: String, Sendable, CaseIterable {
        /// Link comes up (Connected true), Connect fails `le-connection-abort-by-local`, then Connected false.
        case abortByLocal = "le-connection-abort-by-local"
        /// Connect fails at once with `InProgress`.
        case inProgress = "in-progress"
        /// Connect never answers (until Disconnect cancels it, or the caller times out).
        case noReply = "connect-no-reply"
        /// Connect fails with `org.bluez.Error.Failed` and the option `message` (no link).
        case connectFailed = "connect-failed"
        /// The next ReadValue fails with an ATT error (`att`) or a named error (`error` + `message`).
        case readError = "read-error"
        /// The next ReadValue is never answered: the caller times out, or gives up when the link drops (a peer
        /// that stopped answering mid-request).
        case readNoReply = "read-no-reply"
        /// The next WriteValue fails the same way.
        case writeError = "write-error"
        /// The next StartNotify or AcquireNotify fails the same way (the CCC write was refused or failed).
        case notifyError = "notify-error"
        /// On the next connect, ServicesResolved=true arrives before the GATT objects are exported.
        case servicesResolvedEarly = "services-resolved-early"
        /// The link comes up and services resolve as usual, but `Connect` fails
        /// `org.bluez.Error.Failed "le-connection-already-connected"` (the controller already had the connection).
        case alreadyConnected = "connect-already-connected"
        /// The link comes up and services resolve, but `Connected=true` is never signalled (only `Get` shows it):
        /// bluetoothd 5.66 when the ATT channel is up before the kernel's Device Connected event
        /// (`device_add_connection()` logs "already connected" and returns before emitting the property).
        case connectedUnsignalled = "connected-unsignalled"
    }
    var kind: Kind
    /// Remaining uses; 0 = until cleared.
    var remaining: Int
    /// Characteristic UUID restriction for read/write errors.
    var uuid: SimUUID?
    var errorName: String
    var errorMessage: String
}

/// One end of an AcquireNotify/AcquireWrite socketpair that the simulator keeps.
final class SimSocket: @unchecked Sendable {
    let fd: Int32
    var source: DispatchSourceRead?
    init(fd: Int32) { self.fd = fd }
    /// Cancels the read source; its cancel handler closes the fd (cancelling twice is harmless).
    func close() { source?.cancel() }
}

/// A characteristic at run time.
final class SimCharacteristic: @unchecked Sendable {
    let layout: SimGATTLayout.Characteristic
    let path: DBusObjectPath
    let servicePath: DBusObjectPath
    let serviceUUID: SimUUID
    var uuid: SimUUID { layout.spec.uuid }
    /// The peripheral-side value (reads return it; writes store into it).
    var stored: [UInt8]
    var descriptorValues: [[UInt8]]
    /// Unique names with a StartNotify session.
    var sessions: Set<String> = []
    var notifySocket: SimSocket?
    var notifyOwner: String?
    var writeSocket: SimSocket?
    var timer: DispatchSourceTimer?
    /// Identifies the current timer, so ticks already queued from a cancelled one are dropped.
    var timerGeneration = 0
    var notifyIndex = 0
    var rateHz: Double

    init(layout: SimGATTLayout.Characteristic, devicePath: DBusObjectPath, service: SimGATTLayout.Service) {
        self.layout = layout
        path = DBusObjectPath(stringLiteral: devicePath.rawValue + layout.pathSuffix)
        servicePath = DBusObjectPath(stringLiteral: devicePath.rawValue + service.pathSuffix)
        serviceUUID = service.uuid
        stored = layout.spec.value
        descriptorValues = layout.descriptors.map(\.value)
        rateHz = layout.spec.notify?.rateHz ?? 0
    }

    var canNotify: Bool { layout.spec.flags.contains("notify") || layout.spec.flags.contains("indicate") }
    var isSubscribed: Bool { !sessions.isEmpty || notifySocket != nil }
}

/// A peripheral at run time.
final class SimDevice: @unchecked Sendable {
    var spec: SimPeripheralSpec
    let path: DBusObjectPath
    let adapterID: String
    let layout: SimGATTLayout
    let characteristics: [SimCharacteristic]
    var random: SimRandom
    /// Device1 exported on the bus.
    var exported = false
    var temporary = true
    var adv = SimAdvertisementState()
    var advertisementCount = 0
    var advertisementGeneration = 0
    var expiryGeneration = 0
    var seenInDiscovery = false
    var startTime: Double
    enum Link {
        case disconnected
        case connecting(DBusPendingReply, generation: Int)
        case connected
        case disconnecting
    }
    var link: Link = .disconnected
    var linkGeneration = 0
    var servicesResolved = false
    var gattExported = false
    var paired = false
    var faults: [SimFault] = []
    /// Calls a `read-no-reply` fault keeps unanswered (held, so that nothing answers them for us).
    var unanswered: [DBusPendingReply] = []
    var writes: [(uuid: String, value: [UInt8], type: String)] = []
    /// Monitor keys that have been told DeviceFound.
    var foundBy: Set<String> = []

    init(spec: SimPeripheralSpec, adapterPath: DBusObjectPath, now: Double) {
        self.spec = spec
        adapterID = spec.adapter
        path = adapterPath.appending(deviceComponent(spec.address))
        layout = SimGATTLayout(spec.gatt)
        var chars: [SimCharacteristic] = []
        for s in layout.services {
            for c in s.characteristics { chars.append(SimCharacteristic(layout: c, devicePath: path, service: s)) }
        }
        characteristics = chars
        random = SimRandom(seed: spec.address)
        startTime = now
    }

    var isConnected: Bool {
        if case .connected = link { return true }
        return false
    }

    func characteristic(_ uuid: SimUUID) -> SimCharacteristic? { characteristics.first { $0.uuid == uuid } }

    /// The advertisement the device sends now.
    func nextAdvertisement(now: Double) -> SimAdvertisementState.Advertisement {
        let t = now - startTime
        let count = advertisementCount
        advertisementCount += 1
        return SimAdvertisementState.Advertisement(
            rssi: max(-127, min(20, spec.rssi + random.jitter(spec.rssiJitter))), txPower: spec.txPower,
            name: spec.name,
            manufacturerData: spec.manufacturerData.map { ($0.company, $0.data.value(at: t, count: count)) },
            serviceData: spec.serviceData.map { ($0.uuid, $0.data.value(at: t, count: count)) },
            uuids: spec.serviceUUIDs)
    }
}

/// An adapter at run time.
final class SimAdapter: @unchecked Sendable {
    let spec: SimAdapterSpec
    let path: DBusObjectPath
    /// Unique names with a discovery session.
    var sessions: Set<String> = []
    /// Discovery filters per unique name (kept until the name leaves the bus).
    var filters: [String: SimDiscoveryFilter] = [:]
    var powered: Bool
    /// gatt_db's next_handle for the adapter's local database: bluetoothd's GAP (7 handles), GATT (10) and
    /// Device Information (3) services come first (populate_*_service in src/gatt-database.c).
    var nextHandle = 0x0015
    init(spec: SimAdapterSpec) {
        self.spec = spec
        path = DBusObjectPath(stringLiteral: "/org/bluez/" + spec.id)
        powered = spec.powered
    }
    var discovering: Bool { !sessions.isEmpty }
}

/// A registered AdvertisementMonitor1 object of a client.
struct SimMonitor: Sendable {
    var owner: String
    var root: DBusObjectPath
    var path: DBusObjectPath
    var patterns: [SimMonitorPattern]
    var key: String { owner + path.rawValue }
}
