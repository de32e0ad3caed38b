// D-Bus errors as one Swift error type: the D-Bus error name plus its message.
internal import CDBus

/// A D-Bus error: an error reply from a peer, or a failure of this library with a standard name.
public struct DBusError: Error, Hashable, Sendable, CustomStringConvertible {
    /// The D-Bus error name, e.g. `org.bluez.Error.Failed`.
    public var name: String
    /// The human-readable message, e.g. `le-connection-abort-by-local`.
    public var message: String

    /// Creates an error.
    public init(name: String, message: String) {
        self.name = name
        self.message = message
    }

    /// `name: message`.
    public var description: String { message.isEmpty ? name : "\(name): \(message)" }

    /// `org.freedesktop.DBus.Error.Failed`
    public static let failed = "org.freedesktop.DBus.Error.Failed"
    /// `org.freedesktop.DBus.Error.NoReply` (also a call timeout)
    public static let noReply = "org.freedesktop.DBus.Error.NoReply"
    /// `org.freedesktop.DBus.Error.UnknownObject`
    public static let unknownObject = "org.freedesktop.DBus.Error.UnknownObject"
    /// `org.freedesktop.DBus.Error.UnknownMethod`
    public static let unknownMethod = "org.freedesktop.DBus.Error.UnknownMethod"
    /// `org.freedesktop.DBus.Error.UnknownInterface`
    public static let unknownInterface = "org.freedesktop.DBus.Error.UnknownInterface"
    /// `org.freedesktop.DBus.Error.UnknownProperty`
    public static let unknownProperty = "org.freedesktop.DBus.Error.UnknownProperty"
    /// `org.freedesktop.DBus.Error.PropertyReadOnly`
    public static let propertyReadOnly = "org.freedesktop.DBus.Error.PropertyReadOnly"
    /// `org.freedesktop.DBus.Error.InvalidArgs`
    public static let invalidArgs = "org.freedesktop.DBus.Error.InvalidArgs"
    /// `org.freedesktop.DBus.Error.InvalidSignature`
    public static let invalidSignature = "org.freedesktop.DBus.Error.InvalidSignature"
    /// `org.freedesktop.DBus.Error.ServiceUnknown`
    public static let serviceUnknown = "org.freedesktop.DBus.Error.ServiceUnknown"
    /// `org.freedesktop.DBus.Error.Disconnected`
    public static let disconnected = "org.freedesktop.DBus.Error.Disconnected"
    /// `org.freedesktop.DBus.Error.AccessDenied`
    public static let accessDenied = "org.freedesktop.DBus.Error.AccessDenied"
    /// `org.freedesktop.DBus.Error.NoMemory`
    public static let noMemory = "org.freedesktop.DBus.Error.NoMemory"
    /// `org.freedesktop.DBus.Error.TimedOut`
    public static let timedOut = "org.freedesktop.DBus.Error.TimedOut"
    /// `org.freedesktop.DBus.Error.NameHasNoOwner`
    public static let nameHasNoOwner = "org.freedesktop.DBus.Error.NameHasNoOwner"
    /// `org.freedesktop.DBus.Error.NotSupported`
    public static let notSupported = "org.freedesktop.DBus.Error.NotSupported"
    /// Thrown by an awaiting call whose task was cancelled (not a standard D-Bus name; never sent on the bus).
    public static let cancelled = "org.freedesktop.DBus.Error.Cancelled"

    /// Builds an error from a filled-in libdbus `DBusError` (and frees it).
    static func consume(_ error: inout CDBus.DBusError, context: String) -> DBusError {
        let name = error.name.map { String(cString: $0) } ?? DBusError.failed
        let text = error.message.map { String(cString: $0) } ?? ""
        dbus_error_free(&error)
        return DBusError(name: name, message: context.isEmpty ? text : "\(context): \(text)")
    }
}

extension CDBus.DBusError {
    /// An initialised libdbus error.
    static func make() -> CDBus.DBusError {
        var error = CDBus.DBusError()
        dbus_error_init(&error)
        return error
    }
}
