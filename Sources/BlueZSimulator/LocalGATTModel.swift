// The peripheral side of the simulated world: GATT applications registered through GattManager1, the remote
// centrals connected to the local adapter, and LE advertisements. Confined to the loop like Model.swift.
import DBus

/// ATT error codes (Bluetooth Core Specification Vol 3 Part F §3.4.1.1, and BlueZ's own codes in
/// BlueZ's src/shared/att-types.h) with their names, for the control interface's `io.blebridge.Simulator1.Error.ATT`.
enum SimATT {
    static let readNotPermitted: UInt8 = 0x02
    static let writeNotPermitted: UInt8 = 0x03
    static let authentication: UInt8 = 0x05
    static let requestNotSupported: UInt8 = 0x06
    static let invalidOffset: UInt8 = 0x07
    static let authorization: UInt8 = 0x08
    static let invalidValueLength: UInt8 = 0x0d
    static let unlikely: UInt8 = 0x0e
    static let insufficientEncryption: UInt8 = 0x0f
    static let cccImproperlyConfigured: UInt8 = 0xfd
    static let alreadyInProgress: UInt8 = 0xfe

    static let names: [UInt8: String] = [
        0x01: "Invalid Handle", 0x02: "Read Not Permitted", 0x03: "Write Not Permitted", 0x04: "Invalid PDU",
        0x05: "Insufficient Authentication", 0x06: "Request Not Supported", 0x07: "Invalid Offset",
        0x08: "Insufficient Authorization", 0x09: "Prepare Queue Full", 0x0a: "Attribute Not Found",
        0x0b: "Attribute Not Long", 0x0c: "Insufficient Encryption Key Size", 0x0d: "Invalid Attribute Value Length",
        0x0e: "Unlikely Error", 0x0f: "Insufficient Encryption", 0x10: "Unsupported Group Type",
        0x11: "Insufficient Resources", 0xfc: "Write Request Rejected", 0xfd: "CCC Improperly Configured",
        0xfe: "Procedure Already in Progress", 0xff: "Out of Range",
    ]

    /// `0x03 Write Not Permitted`, plus `: detail` when there is one.
    static func text(_ code: UInt8, _ detail: String = "") -> String {
        let hex = String(code, radix: 16)
        let name = names[code] ?? ((0x80...0x9f).contains(code) ? "Application Error" : "Reserved")
        return "0x" + (hex.count < 2 ? "0" + hex : hex) + " " + name + (detail.isEmpty ? "" : ": " + detail)
    }

    /// The control interface's error for an ATT error response the central received.
    static func error(_ code: UInt8, _ detail: String = "") -> DBusError {
        DBusError(name: "io.blebridge.Simulator1.Error.ATT", message: text(code, detail))
    }

    /// How bluetoothd turns an application's D-Bus error into an ATT error code (`dbus_error_to_att_ecode` in
    /// BlueZ's src/gatt-database.c): `Failed` carries an application code 0x80–0x9f in its message (0x80 when the
    /// message is not a number, Unlikely Error when the number is out of range); `NotPermitted` becomes the
    /// operation's own "not permitted" code; anything unknown is Unlikely Error.
    static func code(forError name: String, message: String, permissionError: UInt8) -> UInt8 {
        switch name {
        case "org.bluez.Error.Failed":
            let text = message.trimmingCharacters(in: " ")
            let value: Int?
            if text.hasPrefix("0x") || text.hasPrefix("0X") {
                value = Int(text.dropFirst(2), radix: 16)
            } else if text.count > 1, text.hasPrefix("0") {
                value = Int(text.dropFirst(), radix: 8)
            } else {
                value = Int(text)
            }
            guard let value else { return 0x80 }
            return (0x80...0x9f).contains(value) ? UInt8(value) : unlikely
        case "org.bluez.Error.NotSupported": return requestNotSupported
        case "org.bluez.Error.NotAuthorized": return authorization
        case "org.bluez.Error.InvalidValueLength": return invalidValueLength
        case "org.bluez.Error.InvalidOffset": return invalidOffset
        case "org.bluez.Error.InProgress": return alreadyInProgress
        case "org.bluez.Error.ImproperlyConfigured": return cccImproperlyConfigured
        case "org.bluez.Error.NotPermitted": return permissionError
        default: return unlikely
        }
    }
}

extension String {
    fileprivate func trimmingCharacters(in set: Character) -> String {
        var s = Substring(self)
        while s.first == set { s.removeFirst() }
        while s.last == set { s.removeLast() }
        return String(s)
    }
}

/// ATT permissions of a local attribute, as `parse_chrc_flags`/`parse_desc_flags` in BlueZ's src/gatt-database.c
/// derive them from the Flags property.
struct SimATTPermissions: OptionSet, Sendable {
    let rawValue: UInt16
    static let read = SimATTPermissions(rawValue: 1 << 0)
    static let write = SimATTPermissions(rawValue: 1 << 1)
    static let readEncrypt = SimATTPermissions(rawValue: 1 << 2)
    static let writeEncrypt = SimATTPermissions(rawValue: 1 << 3)
    static let readAuthenticated = SimATTPermissions(rawValue: 1 << 4)
    static let writeAuthenticated = SimATTPermissions(rawValue: 1 << 5)
    static let readSecure = SimATTPermissions(rawValue: 1 << 6)
    static let writeSecure = SimATTPermissions(rawValue: 1 << 7)

    /// The check of BlueZ's src/shared/gatt-server.c `check_permissions` for an unencrypted link (the simulated
    /// central never pairs): no permission at all means no check; a missing read/write bit is Read/Write Not
    /// Permitted; secure and authenticated access need authentication, encrypted access needs encryption.
    func check(write: Bool) -> UInt8? {
        guard !isEmpty else { return nil }
        if write, !contains(.write) { return SimATT.writeNotPermitted }
        if !write, !contains(.read) { return SimATT.readNotPermitted }
        let secure: SimATTPermissions = write ? .writeSecure : .readSecure
        let authenticated: SimATTPermissions = write ? .writeAuthenticated : .readAuthenticated
        let encrypt: SimATTPermissions = write ? .writeEncrypt : .readEncrypt
        if contains(secure) || contains(authenticated) { return SimATT.authentication }
        if contains(encrypt) { return SimATT.insufficientEncryption }
        return nil
    }
}

/// A characteristic of a registered application.
final class SimLocalCharacteristic: @unchecked Sendable {
    let path: DBusObjectPath
    let uuid: SimUUID
    let flags: [String]
    let permissions: SimATTPermissions
    let notify: Bool
    let indicate: Bool
    let writeWithoutResponse: Bool
    let reliableWrite: Bool
    /// The application exposes `WriteAcquired` / `NotifyAcquired` (bluetoothd then uses AcquireWrite/AcquireNotify).
    let hasWriteAcquired: Bool
    let hasNotifyAcquired: Bool
    var descriptors: [SimLocalDescriptor] = []
    /// The value handle in the local database, and the app's own `Handle` property (nil when it has none).
    var handle: UInt16 = 0
    var handleProperty: UInt16?
    /// reliable-write or writable-auxiliaries: bluetoothd adds an Extended Properties descriptor.
    var extendedProperties: Bool { flags.contains("reliable-write") || flags.contains("writable-auxiliaries") }
    /// CCC value per central address (1 notify, 2 indicate), like bluetoothd's per-device ccc_state.
    var ccc: [String: UInt16] = [:]
    /// bluetoothd's `ntfy_cnt`: enabled CCCs; the first starts the app's notifications, the last stops them.
    var notifyCount = 0
    /// The AcquireNotify socket (one per characteristic, as in bluetoothd 5.66's `notify_io`).
    var notifySocket: SimSocket?
    /// The AcquireWrite socket (`write_io`), and the commands waiting for AcquireWrite's reply.
    var writeSocket: SimSocket?
    var acquiringWrite: [[UInt8]]?

    init(
        path: DBusObjectPath, uuid: SimUUID, flags: [String], permissions: SimATTPermissions,
        hasWriteAcquired: Bool, hasNotifyAcquired: Bool
    ) {
        self.path = path
        self.uuid = uuid
        self.flags = flags
        self.permissions = permissions
        let has = Set(flags)
        notify = !has.isDisjoint(with: ["notify", "encrypt-notify", "encrypt-authenticated-notify", "secure-notify"])
        indicate = !has.isDisjoint(with: [
            "indicate", "encrypt-indicate", "encrypt-authenticated-indicate", "secure-indicate",
        ])
        writeWithoutResponse = has.contains("write-without-response")
        reliableWrite = has.contains("reliable-write")
        self.hasWriteAcquired = hasWriteAcquired
        self.hasNotifyAcquired = hasNotifyAcquired
    }
}

/// A descriptor of a registered application.
struct SimLocalDescriptor: Sendable {
    let path: DBusObjectPath
    let uuid: SimUUID
    let flags: [String]
    let permissions: SimATTPermissions
    var handle: UInt16 = 0
    var handleProperty: UInt16? = nil
}

/// A service of a registered application.
struct SimLocalService: Sendable {
    let path: DBusObjectPath
    let uuid: SimUUID
    let primary: Bool
    let includes: [DBusObjectPath]
    var characteristics: [SimLocalCharacteristic]
    var handle: UInt16 = 0
    var handleProperty: UInt16? = nil

    /// Attributes the service takes (chrc_create/desc_create's attr_cnt): its declaration, one per include, two
    /// per characteristic plus its CCC and Extended Properties descriptors, one per descriptor.
    var attributeCount: Int {
        1 + includes.count
            + characteristics.reduce(0) {
                $0 + 2 + ($1.notify || $1.indicate ? 1 : 0) + ($1.extendedProperties ? 1 : 0) + $1.descriptors.count
            }
    }
}

/// A GATT application registered with RegisterApplication.
final class SimLocalApp: @unchecked Sendable {
    let owner: String
    let path: DBusObjectPath
    let adapterID: String
    var services: [SimLocalService]
    /// Follows the app's PropertiesChanged and InterfacesRemoved; cancelled when the app goes.
    var watch: Task<Void, Never>?
    init(owner: String, path: DBusObjectPath, adapterID: String, services: [SimLocalService]) {
        self.owner = owner
        self.path = path
        self.adapterID = adapterID
        self.services = services
    }
    var characteristics: [SimLocalCharacteristic] { services.flatMap(\.characteristics) }
}

/// A remote central connected to a local adapter.
final class SimCentral: @unchecked Sendable {
    let address: String
    let adapterID: String
    let devicePath: DBusObjectPath
    var connected = true
    /// Values received per characteristic path, oldest first.
    var notifications: [DBusObjectPath: [[UInt8]]] = [:]
    init(address: String, adapterID: String, devicePath: DBusObjectPath) {
        self.address = address
        self.adapterID = adapterID
        self.devicePath = devicePath
    }
}

/// An advertisement registered with RegisterAdvertisement.
final class SimLocalAdvertisement: @unchecked Sendable {
    let owner: String
    let path: DBusObjectPath
    let adapterID: String
    var properties: [String: DBusValue]
    var parsed: SimParsedAdvertisement
    var watch: Task<Void, Never>?
    var timeout: Int = 0
    init(
        owner: String, path: DBusObjectPath, adapterID: String, properties: [String: DBusValue],
        parsed: SimParsedAdvertisement
    ) {
        self.owner = owner
        self.path = path
        self.adapterID = adapterID
        self.properties = properties
        self.parsed = parsed
    }
}

/// The LEAdvertisement1 properties after bluetoothd's parsers (BlueZ's src/advertising.c).
struct SimParsedAdvertisement: Sendable {
    var type = "peripheral"
    var serviceUUIDs: [SimUUID] = []
    var solicitUUIDs: [SimUUID] = []
    var manufacturerData: [(UInt16, [UInt8])] = []
    var serviceData: [(SimUUID, [UInt8])] = []
    var data: [(UInt8, [UInt8])] = []
    var localName: String?
    var appearance: UInt16?
    var includes: [String] = []
    var discoverable: Bool?
    var discoverableTimeout: UInt16?
    var secondaryChannel: String?
    var duration: UInt16?
    var timeout: UInt16?
    var minIntervalMS: UInt32?
    var maxIntervalMS: UInt32?
    var txPower: Int16?
    /// Length of the advertising data as bluetoothd builds it (BlueZ's src/shared/ad.c), flags included when it
    /// adds them.
    var adLength = 0
}
