// The one error type of the BlueZ target. Every case names the thing it happened to, so the message a person
// reads says what happened, to which device, and (where BlueZ told us) the D-Bus error name and text.
import DBus

/// Names a device in messages: `kitchen-thermo (A4:C1:38:00:11:22)`, or just the address when it has no name.
public struct BlueZDeviceLabel: Sendable, Hashable, CustomStringConvertible {
    /// The Bluetooth address, upper case (`A4:C1:38:00:11:22`).
    public var address: String
    /// The advertised or configured name, if known.
    public var name: String?

    /// A label for `address`, optionally with a `name`.
    public init(address: String, name: String? = nil) {
        self.address = address
        self.name = name
    }

    /// The text people read in logs and error output.
    public var description: String {
        if let name, !name.isEmpty { return "\(name) (\(address))" }
        return address
    }
}

/// The D-Bus error BlueZ answered with: its name (`org.bluez.Error.Failed`) and message
/// (`le-connection-abort-by-local`).
public struct BlueZDBusFailure: Sendable, Hashable, CustomStringConvertible {
    /// The D-Bus error name.
    public var name: String
    /// The error text.
    public var message: String

    /// A failure with `name` and `message`.
    public init(name: String, message: String) {
        self.name = name
        self.message = message
    }

    init(_ error: DBusError) {
        self.init(name: error.name, message: error.message)
    }

    /// The text people read in logs and error output.
    public var description: String { message.isEmpty ? name : "\(name) \(message)" }
}

/// Everything that can go wrong talking to bluetoothd.
public enum BlueZError: Error, Sendable, Equatable, CustomStringConvertible {
    /// bluetoothd is not on the bus (not running, or restarting).
    case bluetoothdUnavailable(reason: String)
    /// The bus itself could not be reached.
    case busUnavailable(BlueZDBusFailure)
    /// No such adapter, or it is powered off (`reason` says which).
    case adapterUnavailable(adapter: String, reason: String)
    /// The device is not in BlueZ's object tree (never seen, or expired from its cache).
    case deviceNotFound(device: BlueZDeviceLabel, failure: BlueZDBusFailure?)
    /// No service, characteristic or descriptor matches `attribute` on the device.
    case attributeNotFound(device: BlueZDeviceLabel, attribute: String)
    /// The operation needs a connection and the device is not connected.
    case notConnected(device: BlueZDeviceLabel, operation: String, failure: BlueZDBusFailure?)
    /// `Connect()` failed; `reason` is BlueZ's reason string (`le-connection-abort-by-local`).
    case connectionFailed(device: BlueZDeviceLabel, reason: String, failure: BlueZDBusFailure?)
    /// BlueZ kept answering `InProgress` until the deadline.
    case inProgress(device: BlueZDeviceLabel?, operation: String, failure: BlueZDBusFailure?)
    /// The peer or BlueZ refused (`NotPermitted`, `NotAuthorized`, ATT permission errors).
    case notPermitted(device: BlueZDeviceLabel?, operation: String, failure: BlueZDBusFailure?)
    /// The characteristic does not support the operation (`NotSupported`).
    case notSupported(device: BlueZDeviceLabel?, operation: String, failure: BlueZDBusFailure?)
    /// The operation did not finish within `seconds`.
    case timeout(device: BlueZDeviceLabel?, operation: String, seconds: Double)
    /// The device disconnected while the operation was running.
    case disconnected(device: BlueZDeviceLabel, reason: BlueZDisconnectReason)
    /// Any other D-Bus error.
    case failed(device: BlueZDeviceLabel?, operation: String, failure: BlueZDBusFailure)
    /// The caller passed something BlueZ cannot take (a bad UUID, an empty pattern list).
    case invalidArgument(String)
    /// The task running `operation` was cancelled before it finished (nothing failed on BlueZ's side).
    case cancelled(operation: String)
    /// A notification stream ended while the device stayed connected: bluetoothd closed the AcquireNotify socket
    /// or ended the StartNotify session (another client's StopNotify, Service Changed). Subscribe again.
    case notificationsEnded(device: BlueZDeviceLabel, characteristic: String, reason: String)

    /// The D-Bus error carried by the case, if any.
    public var dbusFailure: BlueZDBusFailure? {
        switch self {
        case .busUnavailable(let f): return f
        case .deviceNotFound(_, let f), .notConnected(_, _, let f), .connectionFailed(_, _, let f),
            .inProgress(_, _, let f), .notPermitted(_, _, let f), .notSupported(_, _, let f):
            return f
        case .failed(_, _, let f): return f
        default: return nil
        }
    }

    /// The text people read in logs and error output.
    public var description: String {
        func prefix(_ device: BlueZDeviceLabel?) -> String { device.map { "device \($0): " } ?? "" }
        func detail(_ f: BlueZDBusFailure?) -> String { f.map { ": \($0)" } ?? "" }
        switch self {
        case .bluetoothdUnavailable(let reason):
            return "bluetoothd (org.bluez) is not available: \(reason); start it (systemctl start bluetooth) "
                + "or check that it runs on this bus"
        case .busUnavailable(let f):
            return "cannot reach the D-Bus system bus: \(f); is dbus running, and DBUS_SYSTEM_BUS_ADDRESS right if set?"
        case .adapterUnavailable(let adapter, let reason):
            return "adapter \(adapter): \(reason)"
        case .deviceNotFound(let device, let f):
            return "device \(device): not found (not seen by a scan, or expired from BlueZ's cache; scan again)"
                + detail(f)
        case .attributeNotFound(let device, let attribute):
            return "device \(device): no \(attribute)"
        case .notConnected(let device, let op, let f):
            return "device \(device): \(op) failed: not connected (connect first; the link may have dropped)"
                + detail(f)
        case .connectionFailed(let device, let reason, let f):
            if let f, f.message == reason { return "device \(device): connect failed: \(f)" }
            return "device \(device): connect failed: \(reason)" + detail(f)
        case .inProgress(let device, let op, let f):
            return prefix(device) + "\(op) failed: another operation is in progress" + detail(f)
        case .notPermitted(let device, let op, let f):
            return prefix(device) + "\(op) failed: not permitted" + detail(f)
        case .notSupported(let device, let op, let f):
            return prefix(device) + "\(op) failed: not supported" + detail(f)
        case .timeout(let device, let op, let seconds):
            return prefix(device) + "\(op) timed out after \(formatSeconds(seconds)) s"
        case .disconnected(let device, let reason):
            return "device \(device): disconnected (\(reason))"
        case .failed(let device, let op, let f):
            return prefix(device) + "\(op) failed: \(f)"
        case .invalidArgument(let text):
            return text
        case .cancelled(let op):
            return "\(op) cancelled"
        case .notificationsEnded(let device, let characteristic, let reason):
            return "device \(device): notifications from \(characteristic) ended: \(reason); subscribe again"
        }
    }
}

func formatSeconds(_ seconds: Double) -> String {
    if seconds == seconds.rounded(), abs(seconds) < 1e15 { return String(Int64(seconds)) }
    return String((seconds * 10).rounded() / 10)
}

extension Duration {
    var seconds: Double {
        let c = components
        return Double(c.seconds) + Double(c.attoseconds) / 1e18
    }
}

/// Turns a D-Bus error from a Device1 or GATT call into a `BlueZError`.
func mapDBusError(_ error: DBusError, device: BlueZDeviceLabel, operation: String, objectIsDevice: Bool = false)
    -> BlueZError
{
    let failure = BlueZDBusFailure(error)
    switch error.name {
    case DBusError.unknownObject, DBusError.unknownMethod, "org.bluez.Error.DoesNotExist":
        if objectIsDevice { return .deviceNotFound(device: device, failure: failure) }
        return .attributeNotFound(device: device, attribute: "\(operation) target (\(failure))")
    case "org.bluez.Error.NotConnected":
        return .notConnected(device: device, operation: operation, failure: failure)
    case "org.bluez.Error.Failed" where error.message.lowercased() == "not connected":
        return .notConnected(device: device, operation: operation, failure: failure)
    case "org.bluez.Error.InProgress":
        return .inProgress(device: device, operation: operation, failure: failure)
    case "org.bluez.Error.NotPermitted", "org.bluez.Error.NotAuthorized", "org.bluez.Error.InsufficientAuthentication",
        "org.bluez.Error.InsufficientEncryption", "org.bluez.Error.InsufficientAuthorization":
        return .notPermitted(device: device, operation: operation, failure: failure)
    case "org.bluez.Error.NotSupported":
        return .notSupported(device: device, operation: operation, failure: failure)
    case "org.bluez.Error.NotReady":
        return .notConnected(device: device, operation: operation, failure: failure)
    case DBusError.noReply, DBusError.timedOut:
        return .timeout(device: device, operation: operation, seconds: 0)
    case DBusError.cancelled:
        return .cancelled(operation: "device \(device): \(operation)")
    default:
        return .failed(device: device, operation: operation, failure: failure)
    }
}
