// The core's peripheral port over the BlueZ layer: a BlueZGATTApplication (GattManager1) for the served services
// and BlueZAdvertisement objects (LEAdvertisingManager1) for the advertisements, on the client's own bus.
import BlueZ
import BridgeCore
import GATT
import Logging
import Synchronization

/// `BLEPeripheralHost` over a started `BlueZClient`.
public final class BlueZPeripheralHost: BLEPeripheralHost {
    let client: BlueZClient
    let logger: Logger

    /// A host on `client`.
    public init(client: BlueZClient, logger: Logger) {
        self.client = client
        self.logger = logger.labelled(component: "peripheral")
    }

    /// A host on the central's client (one connection to the system bus for both roles).
    public convenience init(central: BlueZCentral, logger: Logger) {
        self.init(client: central.client, logger: logger)
    }

    /// A GATT application for `services`.
    public func makeServer(
        services: [LocalServiceSpec], adapter: String?, onWrite: @escaping @Sendable (LocalWrite) async -> LocalWriteError?,
        events: @escaping @Sendable (LocalPeripheralEvent) -> Void
    ) -> any LocalGATTServer {
        let described = services.map { service in
            LocalGATTService(
                uuid: service.uuid.fullString,
                characteristics: service.characteristics.map { c in
                    LocalGATTCharacteristic(
                        uuid: c.uuid.fullString, id: c.id, flags: Self.flags(c.flags), initialValue: c.value,
                        descriptors: c.descriptors.map {
                            LocalGATTDescriptor(uuid: $0.uuid.fullString, flags: Self.flags($0.flags), value: $0.value)
                        })
                })
        }
        let app: BlueZGATTApplication?
        do {
            app = try BlueZGATTApplication(
                client: client, services: described, adapter: BlueZAdapterSelector(adapter),
                writeHandler: { write in
                    let result = await onWrite(
                        LocalWrite(
                            characteristic: write.characteristicID, value: write.bytes, offset: write.offset,
                            withResponse: write.type != .command, central: Self.address(ofDevice: write.device)))
                    switch result {
                    case nil: return .accept
                    case .notPermitted?: return .reject(.notPermitted)
                    case .invalidLength?: return .reject(.invalidValueLength)
                    case .invalidOffset?: return .reject(.invalidOffset)
                    case .valueNotAllowed(let why)?: return .reject(.failed(why))
                    }
                })
        } catch {
            logger.error("the GATT application cannot be built: \(error)")
            app = nil
        }
        return BlueZLocalServer(app: app, events: events, logger: logger)
    }

    /// An advertisement.
    public func makeAdvertiser(
        _ spec: LocalAdvertisementSpec, adapter: String?, events: @escaping @Sendable (LocalPeripheralEvent) -> Void
    ) -> any LocalAdvertiser {
        let advertisement: BlueZAdvertisement?
        do {
            advertisement = try BlueZAdvertisement(
                client: client, data: Self.data(spec), adapter: BlueZAdapterSelector(adapter))
        } catch {
            logger.error("the advertisement cannot be built: \(error)")
            advertisement = nil
        }
        return BlueZLocalAdvertiser(
            advertisement: advertisement, broadcast: !spec.connectable, events: events, logger: logger)
    }

    /// The adapter's address.
    public func adapterAddress(_ adapter: String?) async -> String? {
        let adapters = client.adapters
        switch BlueZAdapterSelector(adapter) {
        case .any: return adapters.first?.address
        case .name(let n): return adapters.first { $0.name == n || $0.path == n }?.address
        case .address(let a): return adapters.first { $0.address == a.uppercased() }?.address
        }
    }

    static func flags(_ names: [String]) -> LocalGATTFlags {
        var out: LocalGATTFlags = []
        for (flag, name) in LocalGATTFlags.bluezNames where names.contains(name) { out.insert(flag) }
        return out
    }

    static func data(_ spec: LocalAdvertisementSpec) -> LocalAdvertisementData {
        var serviceData: [String: [UInt8]] = [:]
        for (u, bytes) in spec.serviceData { serviceData[u.fullString] = bytes }
        return LocalAdvertisementData(
            type: spec.connectable ? .peripheral : .broadcast, serviceUUIDs: spec.serviceUUIDs.map(\.fullString),
            manufacturerData: spec.manufacturerData, serviceData: serviceData, localName: spec.localName,
            includes: spec.includeTxPower ? ["tx-power"] : [], discoverable: spec.connectable ? true : nil,
            minInterval: spec.minInterval, maxInterval: spec.maxInterval)
    }

    /// `/org/bluez/hci0/dev_AA_BB_CC_DD_EE_FF` → `AA:BB:CC:DD:EE:FF`.
    static func address(ofDevice path: String?) -> BLEAddress? {
        guard let path, let last = path.split(separator: "/").last, last.hasPrefix("dev_") else { return nil }
        return BLEAddress(last.dropFirst(4).replacingUnderscores)
    }
}

extension Substring {
    var replacingUnderscores: String { String(map { $0 == "_" ? ":" : $0 }) }
}

extension BluetoothUUID {
    /// The 128-bit form BlueZ prints.
    var fullString: String { uuidString }
}

/// A served application, reporting its events to the core.
final class BlueZLocalServer: LocalGATTServer {
    let app: BlueZGATTApplication?
    let events: @Sendable (LocalPeripheralEvent) -> Void
    let logger: Logger

    init(app: BlueZGATTApplication?, events: @escaping @Sendable (LocalPeripheralEvent) -> Void, logger: Logger) {
        self.app = app
        self.events = events
        self.logger = logger
    }

    func run() async {
        guard let app else {
            await waitUntilCancelled()
            return
        }
        let events = self.events
        let consumer = Task {
            for await e in app.events {
                switch e {
                case .registered(let adapter): events(.registered(adapter: adapter.name))
                case .unregistered(let reason): events(.unregistered(reason: reason.description))
                case .registrationFailed(let failure): events(.registrationFailed(failure.description))
                case .subscribed(let id, _, let device):
                    events(.subscribed(characteristic: id, central: BlueZPeripheralHost.address(ofDevice: device)))
                case .unsubscribed(let id, _): events(.unsubscribed(characteristic: id))
                case .centralConnected(let address, _):
                    if let a = BLEAddress(address) { events(.centralConnected(a)) }
                case .centralDisconnected(let address, _):
                    if let a = BLEAddress(address) { events(.centralDisconnected(a)) }
                case .read, .write, .confirmed: break
                }
            }
        }
        do {
            try await app.run()
        } catch {
            if !Task.isCancelled { logger.error("GATT application: \(error)") }
            await waitUntilCancelled()
        }
        consumer.cancel()
    }

    func setValue(_ value: [UInt8], characteristic: String) {
        guard let app else { return }
        do {
            try app.setValue(value, for: characteristic)
        } catch {
            logger.warning("characteristic \(characteristic): value not set: \(error)")
        }
    }
}

/// An advertisement, reporting its events to the core.
final class BlueZLocalAdvertiser: LocalAdvertiser {
    let advertisement: BlueZAdvertisement?
    let broadcast: Bool
    let events: @Sendable (LocalPeripheralEvent) -> Void
    let logger: Logger

    init(
        advertisement: BlueZAdvertisement?, broadcast: Bool,
        events: @escaping @Sendable (LocalPeripheralEvent) -> Void, logger: Logger
    ) {
        self.advertisement = advertisement
        self.broadcast = broadcast
        self.events = events
        self.logger = logger
    }

    func run() async {
        guard let advertisement else {
            await waitUntilCancelled()
            return
        }
        let events = self.events
        let broadcast = self.broadcast
        let logger = self.logger
        let consumer = Task { [advertisement] in
            for await e in advertisement.events {
                switch e {
                case .registered: events(.advertising(broadcast: broadcast))
                case .unregistered(let reason):
                    events(.advertisingStopped(broadcast: broadcast, reason: reason.description))
                case .registrationFailed(let failure): logger.warning("advertisement: \(failure)")
                }
            }
        }
        do {
            try await advertisement.run()
        } catch {
            if !Task.isCancelled { logger.error("advertisement: \(error)") }
            await waitUntilCancelled()
        }
        consumer.cancel()
    }

    func update(_ spec: LocalAdvertisementSpec) {
        do {
            try advertisement?.update(BlueZPeripheralHost.data(spec))
        } catch {
            logger.warning("advertisement not updated: \(error)")
        }
    }
}

/// Suspends until the calling task is cancelled.
func waitUntilCancelled() async {
    let stream = AsyncStream<Void> { _ in }
    for await _ in stream {}
}
