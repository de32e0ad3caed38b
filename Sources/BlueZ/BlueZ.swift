// BlueZ: a typed central-role client for bluetoothd (org.bluez) over the DBus target.
// Layering: imports DBus only; no MQTT, no value parsing. What bluetoothd does on the bus follows BlueZ's doc/org.bluez.*.rst.

/// The bus the client talks to.
public enum BlueZBus: Sendable, Hashable {
    /// The system bus (honours `DBUS_SYSTEM_BUS_ADDRESS`).
    case system
    /// A bus at an explicit address (`unix:path=/run/...`).
    case address(String)
}

/// D-Bus names used by bluetoothd.
enum BlueZName {
    static let service = "org.bluez"
    static let adapter = "org.bluez.Adapter1"
    static let device = "org.bluez.Device1"
    static let gattService = "org.bluez.GattService1"
    static let characteristic = "org.bluez.GattCharacteristic1"
    static let descriptor = "org.bluez.GattDescriptor1"
    static let monitorManager = "org.bluez.AdvertisementMonitorManager1"
    static let monitor = "org.bluez.AdvertisementMonitor1"
    static let objectManager = "org.freedesktop.DBus.ObjectManager"
    static let properties = "org.freedesktop.DBus.Properties"
}
