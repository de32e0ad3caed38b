// Value snapshots of BlueZ objects, built from the mirror. Paths are kept as strings so callers need not import DBus.
import DBus

/// An adapter (`/org/bluez/hci0`).
public struct BlueZAdapter: Sendable, Hashable {
    /// The object path (`/org/bluez/hci0`).
    public var path: String
    /// The last path component (`hci0`).
    public var name: String
    /// The controller address, upper case.
    public var address: String
    /// `Powered`.
    public var powered: Bool
    /// `Discovering`.
    public var discovering: Bool
    /// `Roles` (bleak needs `central` here).
    public var roles: [String]
    /// True when the adapter offers `AdvertisementMonitorManager1` (bluetoothd `--experimental`).
    public var supportsAdvertisementMonitor: Bool
}

/// How an adapter looks to a caller waiting on it.
public enum BlueZAdapterState: Sendable, Hashable, CustomStringConvertible {
    /// No adapter matches (or bluetoothd is not running).
    case absent
    /// The adapter exists and is powered off.
    case off(BlueZAdapter)
    /// The adapter exists and is powered.
    case on(BlueZAdapter)

    /// The adapter, when present.
    public var adapter: BlueZAdapter? {
        switch self {
        case .absent: return nil
        case .off(let a), .on(let a): return a
        }
    }

    /// The text people read in logs and error output.
    public var description: String {
        switch self {
        case .absent: return "absent"
        case .off(let a): return "\(a.name) off"
        case .on(let a): return "\(a.name) on"
        }
    }
}

/// Picks an adapter: the first one, one by name (`hci0`), or one by address.
public enum BlueZAdapterSelector: Sendable, Hashable, CustomStringConvertible {
    /// The first adapter in path order.
    case any
    /// `hci0`, or a full path `/org/bluez/hci0`.
    case name(String)
    /// The controller address (any case).
    case address(String)

    /// `hci0` -> `.name`, `AA:BB:...` -> `.address`, nil or empty -> `.any`.
    public init(_ text: String?) {
        guard let text, !text.isEmpty else {
            self = .any
            return
        }
        self = text.contains(":") ? .address(text.uppercased()) : .name(text)
    }

    func matches(_ adapter: BlueZAdapter) -> Bool {
        switch self {
        case .any: return true
        case .name(let n): return adapter.name == n || adapter.path == n
        case .address(let a): return adapter.address.uppercased() == a.uppercased()
        }
    }

    /// The text people read in logs and error output.
    public var description: String {
        switch self {
        case .any: return "(default)"
        case .name(let n): return n
        case .address(let a): return a
        }
    }
}

/// A remote device as BlueZ knows it (`Device1`), including its latest advertisement fields.
public struct BlueZDevice: Sendable, Hashable {
    /// The object path.
    public var path: String
    /// The adapter's object path (from the `Adapter` property).
    public var adapterPath: String
    /// The address, upper case.
    public var address: String
    /// `public` or `random`.
    public var addressType: String
    /// The advertised name (`Name`), absent when unknown.
    public var name: String?
    /// `Alias` (the address with dashes when there is no name).
    public var alias: String?
    /// Signal strength of the latest advertisement, absent when not scanning.
    public var rssi: Int16?
    /// Advertised TX power.
    public var txPower: Int16?
    /// Manufacturer data by company identifier.
    public var manufacturerData: [UInt16: [UInt8]]
    /// Service data by 128-bit lowercase UUID string.
    public var serviceData: [String: [UInt8]]
    /// Advertised (or, once resolved, GATT) service UUIDs, lowercase 128-bit.
    public var uuids: [String]
    /// `Connected`.
    public var connected: Bool
    /// `ServicesResolved`.
    public var servicesResolved: Bool
    /// `Paired`.
    public var paired: Bool

    /// The name for messages.
    public var label: BlueZDeviceLabel { BlueZDeviceLabel(address: address, name: name) }
}

/// A GATT service (`GattService1`).
public struct BlueZService: Sendable, Hashable {
    /// The object path.
    public var path: String
    /// Lowercase 128-bit UUID.
    public var uuid: String
    /// `Primary`.
    public var primary: Bool
    /// `Handle`, when exported.
    public var handle: UInt16?
    /// The device's object path (from the `Device` property).
    public var devicePath: String
}

/// A GATT characteristic (`GattCharacteristic1`).
public struct BlueZCharacteristic: Sendable, Hashable {
    /// The object path.
    public var path: String
    /// Lowercase 128-bit UUID.
    public var uuid: String
    /// The service's object path (from the `Service` property).
    public var servicePath: String
    /// `Flags`: `read`, `write`, `write-without-response`, `notify`, `indicate`, ...
    public var flags: [String]
    /// `Handle`, when exported.
    public var handle: UInt16?
    /// `MTU`, when exported.
    public var mtu: UInt16?
    /// True when `NotifyAcquired` is present, i.e. AcquireNotify can be used.
    public var notifyAcquireAvailable: Bool
    /// `Notifying`.
    public var notifying: Bool
    /// The cached `Value` (last read or notified).
    public var value: [UInt8]?

    /// True when the characteristic can be read.
    public var canRead: Bool { flags.contains("read") }
    /// True when a write request is possible.
    public var canWrite: Bool { flags.contains("write") || flags.contains("reliable-write") }
    /// True when a write command (without response) is possible.
    public var canWriteWithoutResponse: Bool { flags.contains("write-without-response") }
    /// True when the characteristic notifies or indicates.
    public var canNotify: Bool { flags.contains("notify") || flags.contains("indicate") }
}

/// A GATT descriptor (`GattDescriptor1`).
public struct BlueZDescriptor: Sendable, Hashable {
    /// The object path.
    public var path: String
    /// Lowercase 128-bit UUID.
    public var uuid: String
    /// The characteristic's object path (from the `Characteristic` property).
    public var characteristicPath: String
    /// `Flags`.
    public var flags: [String]
    /// The cached `Value`.
    public var value: [UInt8]?
}

/// Normalises a UUID string to BlueZ's form: 16- and 32-bit values expanded on the Bluetooth base, lower case.
/// Returns nil for anything that is not a UUID.
public func bluezUUIDString(_ text: String) -> String? {
    var s = Substring(text.lowercased())
    if s.hasPrefix("0x") { s = s.dropFirst(2) }
    let hex = s.filter { $0 != "-" }
    // ASCII only: Character.isHexDigit also accepts fullwidth forms (U+FF10...), which BlueZ would reject.
    guard !hex.isEmpty, hex.allSatisfy({ $0.isASCII && $0.isHexDigit }) else { return nil }
    switch hex.count {
    case 4: return "0000\(hex)-0000-1000-8000-00805f9b34fb"
    case 8: return "\(hex)-0000-1000-8000-00805f9b34fb"
    case 32:
        let c = Array(hex)
        return String(c[0..<8]) + "-" + String(c[8..<12]) + "-" + String(c[12..<16]) + "-" + String(c[16..<20])
            + "-" + String(c[20..<32])
    default: return nil
    }
}
