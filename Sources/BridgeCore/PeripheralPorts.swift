// What the peripheral role needs from the BLE side: a local GATT database served to centrals, and advertisements.
// The core owns these protocols; the BlueZ adapter implements them over GattManager1 and LEAdvertisingManager1.
import GATT

/// A descriptor of a served characteristic.
public struct LocalDescriptorSpec: Sendable, Equatable {
    /// The descriptor UUID (0x2901 user description, 0x2904 presentation format, ...).
    public var uuid: BluetoothUUID
    /// BlueZ flag strings (`read`).
    public var flags: [String]
    /// Its value.
    public var value: [UInt8]

    /// A descriptor.
    public init(uuid: BluetoothUUID, flags: [String] = ["read"], value: [UInt8]) {
        self.uuid = uuid
        self.flags = flags
        self.value = value
    }
}

/// A served characteristic.
public struct LocalCharacteristicSpec: Sendable, Equatable {
    /// A stable id the core uses to address it (`s0c1`).
    public var id: String
    /// The characteristic UUID.
    public var uuid: BluetoothUUID
    /// BlueZ flag strings.
    public var flags: [String]
    /// The value before the first update.
    public var value: [UInt8]
    /// Its descriptors.
    public var descriptors: [LocalDescriptorSpec]

    /// A characteristic.
    public init(
        id: String, uuid: BluetoothUUID, flags: [String], value: [UInt8] = [], descriptors: [LocalDescriptorSpec] = []
    ) {
        self.id = id
        self.uuid = uuid
        self.flags = flags
        self.value = value
        self.descriptors = descriptors
    }
}

/// A served (primary) service.
public struct LocalServiceSpec: Sendable, Equatable {
    /// The service UUID.
    public var uuid: BluetoothUUID
    /// Its characteristics.
    public var characteristics: [LocalCharacteristicSpec]

    /// A service.
    public init(uuid: BluetoothUUID, characteristics: [LocalCharacteristicSpec]) {
        self.uuid = uuid
        self.characteristics = characteristics
    }
}

/// An advertisement the bridge sends.
public struct LocalAdvertisementSpec: Sendable, Equatable {
    /// Connectable (`peripheral`) or not (`broadcast`).
    public var connectable: Bool
    /// The local name, when included.
    public var localName: String?
    /// Service UUIDs.
    public var serviceUUIDs: [BluetoothUUID]
    /// Service data by UUID.
    public var serviceData: [BluetoothUUID: [UInt8]]
    /// Manufacturer data by company id.
    public var manufacturerData: [UInt16: [UInt8]]
    /// Include the TX power level.
    public var includeTxPower: Bool
    /// Advertising interval bounds (BlueZ 5.63+), when set.
    public var minInterval: Duration?
    /// The upper bound.
    public var maxInterval: Duration?

    /// An advertisement.
    public init(
        connectable: Bool, localName: String? = nil, serviceUUIDs: [BluetoothUUID] = [],
        serviceData: [BluetoothUUID: [UInt8]] = [:], manufacturerData: [UInt16: [UInt8]] = [:],
        includeTxPower: Bool = false, minInterval: Duration? = nil, maxInterval: Duration? = nil
    ) {
        self.connectable = connectable
        self.localName = localName
        self.serviceUUIDs = serviceUUIDs
        self.serviceData = serviceData
        self.manufacturerData = manufacturerData
        self.includeTxPower = includeTxPower
        self.minInterval = minInterval
        self.maxInterval = maxInterval
    }
}

/// A central's write to a served characteristic.
public struct LocalWrite: Sendable, Equatable {
    /// The characteristic's id.
    public var characteristic: String
    /// The bytes written.
    public var value: [UInt8]
    /// The offset (prepared writes).
    public var offset: Int
    /// A write request (the central waits for the result) rather than a write command.
    public var withResponse: Bool
    /// The central, when BlueZ names it.
    public var central: BLEAddress?

    /// A write.
    public init(characteristic: String, value: [UInt8], offset: Int = 0, withResponse: Bool, central: BLEAddress?) {
        self.characteristic = characteristic
        self.value = value
        self.offset = offset
        self.withResponse = withResponse
        self.central = central
    }
}

/// Why a write was refused: the ATT error the central gets.
public enum LocalWriteError: Error, Sendable, Equatable, CustomStringConvertible {
    /// Write Not Permitted (0x03).
    case notPermitted(String)
    /// Invalid Attribute Value Length (0x0D).
    case invalidLength(String)
    /// Invalid Offset (0x07).
    case invalidOffset(String)
    /// The value is out of range or malformed: an application error (BlueZ answers `Failed` with 0x80).
    case valueNotAllowed(String)

    /// The text people read in logs.
    public var description: String {
        switch self {
        case .notPermitted(let s), .invalidLength(let s), .invalidOffset(let s), .valueNotAllowed(let s): return s
        }
    }
}

/// What happens on the peripheral side.
public enum LocalPeripheralEvent: Sendable, Equatable {
    /// The application is registered with bluetoothd on `adapter`.
    case registered(adapter: String)
    /// It is no longer registered (bluetoothd went away, the adapter was removed, ...).
    case unregistered(reason: String)
    /// Registration failed; it is retried.
    case registrationFailed(String)
    /// An advertisement is on the air (`broadcast` true for the BTHome one).
    case advertising(broadcast: Bool)
    /// An advertisement stopped, and why.
    case advertisingStopped(broadcast: Bool, reason: String)
    /// A central connected.
    case centralConnected(BLEAddress)
    /// A central disconnected.
    case centralDisconnected(BLEAddress)
    /// A central subscribed to a characteristic (by id).
    case subscribed(characteristic: String, central: BLEAddress?)
    /// Notifications of a characteristic stopped.
    case unsubscribed(characteristic: String)
}

/// A local GATT database being served.
public protocol LocalGATTServer: AnyObject, Sendable {
    /// Registers and keeps the application registered (again after bluetoothd restarts or the adapter returns)
    /// until the calling task is cancelled, then unregisters and returns.
    func run() async
    /// Sets a characteristic's value and notifies or indicates it to subscribed centrals.
    func setValue(_ value: [UInt8], characteristic: String)
}

/// An advertisement being sent.
public protocol LocalAdvertiser: AnyObject, Sendable {
    /// Registers and keeps the advertisement registered until the calling task is cancelled, then unregisters.
    func run() async
    /// Changes the advertised data in place.
    func update(_ spec: LocalAdvertisementSpec)
}

/// The peripheral side of the BLE stack.
public protocol BLEPeripheralHost: AnyObject, Sendable {
    /// A GATT server for `services` on `adapter` (nil: the first). Writes are answered by `onWrite` (nil accepts);
    /// everything else is reported through `events`.
    func makeServer(
        services: [LocalServiceSpec], adapter: String?,
        onWrite: @escaping @Sendable (LocalWrite) async -> LocalWriteError?,
        events: @escaping @Sendable (LocalPeripheralEvent) -> Void
    ) -> any LocalGATTServer
    /// An advertiser for `spec` on `adapter`.
    func makeAdvertiser(
        _ spec: LocalAdvertisementSpec, adapter: String?, events: @escaping @Sendable (LocalPeripheralEvent) -> Void
    ) -> any LocalAdvertiser
    /// The address of `adapter` (nil: the first), as centrals see it; nil when there is none yet.
    func adapterAddress(_ adapter: String?) async -> String?
}
