// A received signal read in place: header fields on demand and the arguments through a pull reader over libdbus's
// own iterator (dbus_message_iter_*, the libdbus API reference's DBusMessage section), so a handler that needs two
// fields of a hot signal builds no DBusValue for the rest.
internal import CDBus
import Glibc

/// A signal as libdbus holds it, handed to a `signals(matching:ended:reader:)` handler. It borrows libdbus's message
/// and is valid only while that handler runs; `decode()` makes a `DBusMessage` that outlives it.
public struct DBusSignalView {
    let pointer: OpaquePointer

    init(_ pointer: OpaquePointer) { self.pointer = pointer }

    /// The object path the signal was emitted from.
    public var path: String? { dbus_message_get_path(pointer).map { String(cString: $0) } }
    /// The bytes of the object path (no terminating NUL) in libdbus's message, for a handler that reads them before it
    /// returns (the view's own lifetime): nothing is allocated and no closure is needed. Nil when the message has no
    /// path.
    public var unsafePathBytes: UnsafeBufferPointer<UInt8>? {
        guard let path = dbus_message_get_path(pointer) else { return nil }
        let bytes = UnsafeRawPointer(path).assumingMemoryBound(to: UInt8.self)
        return UnsafeBufferPointer(start: bytes, count: strlen(path))
    }
    /// The interface.
    public var interface: String? { dbus_message_get_interface(pointer).map { String(cString: $0) } }
    /// The signal's name.
    public var member: String? { dbus_message_get_member(pointer).map { String(cString: $0) } }
    /// The sender's unique name.
    public var sender: String? { dbus_message_get_sender(pointer).map { String(cString: $0) } }

    /// True when this is `interface`.`member` (compared in place, nothing allocated).
    public func isSignal(interface: String, member: String) -> Bool {
        // withCString hands a native string's own bytes over; the implicit String-to-pointer conversion copies.
        interface.withCString { i in member.withCString { m in dbus_message_is_signal(pointer, i, m) != 0 } }
    }

    /// The whole message as a value.
    /// - Throws: `DBusError` when the message carries something that cannot be represented (an unusable fd).
    public func decode() throws(DBusError) -> DBusMessage { try Marshal.decode(pointer) }

    /// A reader positioned at the first argument.
    public func arguments() -> DBusArgumentReader { DBusArgumentReader(message: pointer) }

    /// Builds `message` as libdbus would send it and hands a view of it to `body` (for tests and replays).
    /// - Throws: `DBusError` when the message cannot be built.
    public static func withView<R>(of message: DBusMessage, _ body: (DBusSignalView) throws -> R) throws -> R {
        let built = try Marshal.build(message)
        return try withExtendedLifetime(built) { try body(DBusSignalView(built.pointer)) }
    }
}

/// Reads a message's arguments one at a time, in place. Every typed read returns nil, and stays where it is, when the
/// current argument is not of that type (or there is none), so a caller checks shapes as it goes and never traps.
/// A successful read moves to the next argument. Valid only as long as the message it reads.
public struct DBusArgumentReader {
    private var iter = DBusMessageIter()
    /// The current argument's type code, `TypeCode.invalid` at the end: read from libdbus once per position (each
    /// `dbus_message_iter_get_arg_type` parses the signature again), not once per question asked about it.
    private var code: Int32

    init(message: OpaquePointer) {
        code = dbus_message_iter_init(message, &iter) != 0 ? dbus_message_iter_get_arg_type(&iter) : TypeCode.invalid
    }

    private init(recursingInto parent: inout DBusMessageIter) {
        dbus_message_iter_recurse(&parent, &iter)
        code = dbus_message_iter_get_arg_type(&iter)
    }

    /// True when every argument (or element) has been read.
    public var isAtEnd: Bool { code == TypeCode.invalid }

    /// The current argument's type code (`s`, `a`, `v`, ...), nil at the end.
    public var currentType: Character? {
        let c = code
        guard c != TypeCode.invalid else { return nil }
        return Character(UnicodeScalar(UInt8(truncatingIfNeeded: c)))
    }

    private mutating func advance() {
        code = dbus_message_iter_next(&iter) != 0 ? dbus_message_iter_get_arg_type(&iter) : TypeCode.invalid
    }

    private mutating func fixed<T: BitwiseCopyable>(_ expected: Int32, _ initial: T) -> T? {
        guard code == expected else { return nil }
        var value = initial
        withUnsafeMutablePointer(to: &value) { dbus_message_iter_get_basic(&iter, $0) }
        advance()
        return value
    }

    /// A `y`.
    public mutating func byte() -> UInt8? { fixed(TypeCode.byte, UInt8(0)) }
    /// A `b`.
    public mutating func boolean() -> Bool? { fixed(TypeCode.boolean, dbus_bool_t(0)).map { $0 != 0 } }
    /// An `n`.
    public mutating func int16() -> Int16? { fixed(TypeCode.int16, Int16(0)) }
    /// A `q`.
    public mutating func uint16() -> UInt16? { fixed(TypeCode.uint16, UInt16(0)) }
    /// An `i`.
    public mutating func int32() -> Int32? { fixed(TypeCode.int32, Int32(0)) }
    /// A `u`.
    public mutating func uint32() -> UInt32? { fixed(TypeCode.uint32, UInt32(0)) }

    private mutating func text() -> UnsafePointer<CChar>? {
        let c = code
        guard c == TypeCode.string || c == TypeCode.objectPath else { return nil }
        var pointer: UnsafePointer<CChar>? = nil
        dbus_message_iter_get_basic(&iter, &pointer)
        return pointer
    }

    /// An `s` or an `o`.
    public mutating func string() -> String? {
        guard let pointer = text() else { return nil }
        advance()
        return String(cString: pointer)
    }

    /// Hands an `s` or `o` to `body` in place (valid only while `body` runs; nothing is copied) and moves past it.
    /// Nil, and the reader stays where it is, for any other type.
    public mutating func withString<R>(_ body: (UnsafePointer<CChar>) throws -> R) rethrows -> R? {
        guard let pointer = text() else { return nil }
        advance()
        return try body(pointer)
    }

    /// Reads an `s` or `o` only when it equals `expected` (compared in place, nothing allocated); false, and the
    /// reader stays where it is, otherwise.
    public mutating func string(equals expected: String) -> Bool {
        guard let pointer = text(), expected.withCString({ strcmp(pointer, $0) }) == 0 else { return false }
        advance()
        return true
    }

    /// An `s` (not an `o`) in libdbus's message, valid as long as the message (for a signal view: while its handler
    /// runs), and moves past it; nothing is copied. Nil, and the reader stays where it is, for any other type.
    public mutating func unsafeString() -> UnsafePointer<CChar>? {
        guard code == TypeCode.string else { return nil }
        var pointer: UnsafePointer<CChar>? = nil
        dbus_message_iter_get_basic(&iter, &pointer)
        advance()
        return pointer
    }

    /// An `ay` in libdbus's message, valid as long as the message (for a signal view: while its handler runs), and
    /// moves past it; nothing is copied. Nil, and the reader stays where it is, for any other type.
    public mutating func unsafeBytes() -> UnsafeBufferPointer<UInt8>? {
        guard code == TypeCode.array, dbus_message_iter_get_element_type(&iter) == TypeCode.byte else { return nil }
        var sub = DBusMessageIter()
        dbus_message_iter_recurse(&iter, &sub)
        var pointer: UnsafePointer<UInt8>? = nil
        var count: Int32 = 0
        dbus_message_iter_get_fixed_array(&sub, &pointer, &count)
        advance()
        return UnsafeBufferPointer(start: count > 0 ? pointer : nil, count: count > 0 ? Int(count) : 0)
    }

    /// An `ay`, copied out.
    public mutating func bytes() -> [UInt8]? {
        withBytes { Array($0) }
    }

    /// Hands an `ay` to `body` in place (valid only while `body` runs; nothing is copied) and moves past it. Nil,
    /// and the reader stays where it is, for any other type.
    public mutating func withBytes<R>(_ body: (UnsafeBufferPointer<UInt8>) throws -> R) rethrows -> R? {
        guard let bytes = unsafeBytes() else { return nil }
        return try body(bytes)
    }

    /// A reader over the contents of the current container (array, dictionary entry, struct or variant); this reader
    /// moves past it. Nil when the current argument is not a container.
    public mutating func enter() -> DBusArgumentReader? {
        let c = code
        guard c == TypeCode.array || c == TypeCode.dictEntry || c == TypeCode.structure || c == TypeCode.variant
        else { return nil }
        let sub = DBusArgumentReader(recursingInto: &iter)
        advance()
        return sub
    }

    /// The current argument as a value, whatever its type.
    /// - Throws: `DBusError` when it cannot be represented (an unusable fd); at the end, nil.
    public mutating func value() throws(DBusError) -> DBusValue? {
        guard code != TypeCode.invalid else { return nil }
        let value = try Marshal.readValue(&iter)
        advance()
        return value
    }

    /// Moves past the current argument without reading it.
    public mutating func skip() {
        if code != TypeCode.invalid { advance() }
    }
}

extension DBusMatchRule {
    /// True when the rule constrains only what a message's header holds, so the header match decides it.
    var matchesOnHeaderOnly: Bool { arguments.isEmpty && argumentPaths.isEmpty && pathNamespace == nil }
}
