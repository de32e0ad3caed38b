// D-Bus values: the whole type system as Swift values, validated before they reach libdbus.
internal import CDBus
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// A D-Bus type signature such as `"a{sv}"`.
///
/// A string literal is not checked when written; it is validated when a message using it is built, so an invalid
/// literal surfaces as a thrown ``DBusError`` (``DBusError/invalidSignature``), never as a crash.
public struct DBusSignature: Hashable, Sendable, ExpressibleByStringLiteral, CustomStringConvertible {
    /// The signature text.
    public let rawValue: String

    /// Creates a signature after checking it with libdbus.
    /// - Throws: ``DBusError`` named ``DBusError/invalidSignature`` when `validating` is not a valid signature.
    public init(validating: String) throws(DBusError) {
        guard DBusSignature.isValid(validating) else {
            throw DBusError(name: DBusError.invalidSignature, message: "invalid D-Bus signature \"\(validating)\"")
        }
        rawValue = validating
    }

    /// Creates a signature without checking it (it is checked when used).
    public init(stringLiteral value: String) { rawValue = value }

    init(unchecked value: String) { rawValue = value }

    /// The signature text.
    public var description: String { rawValue }

    /// True when `text` is a valid (possibly empty) sequence of complete types.
    static func isValid(_ text: String) -> Bool {
        if text.isEmpty { return true }
        if text.utf8.contains(0) { return false }
        return text.withCString { dbus_signature_validate($0, nil) != 0 }
    }

    /// True when `text` is exactly one complete type.
    static func isValidSingle(_ text: String) -> Bool {
        if text.isEmpty || text.utf8.contains(0) { return false }
        return text.withCString { dbus_signature_validate_single($0, nil) != 0 }
    }
}

/// A D-Bus object path such as `/org/bluez/hci0`.
///
/// A string literal is checked when used in a message (an invalid one throws ``DBusError/invalidArgs``).
public struct DBusObjectPath: Hashable, Sendable, ExpressibleByStringLiteral, CustomStringConvertible,
    Comparable
{
    /// The path text.
    public let rawValue: String

    /// Creates a path after checking it.
    /// - Throws: ``DBusError`` named ``DBusError/invalidArgs`` when `validating` is not a valid object path.
    public init(validating: String) throws(DBusError) {
        guard DBusObjectPath.isValid(validating) else {
            throw DBusError(name: DBusError.invalidArgs, message: "invalid D-Bus object path \"\(validating)\"")
        }
        rawValue = validating
    }

    /// Creates a path without checking it (it is checked when used).
    public init(stringLiteral value: String) { rawValue = value }

    init(unchecked value: String) { rawValue = value }

    /// The path text.
    public var description: String { rawValue }

    /// The root path `/`.
    public static let root = DBusObjectPath(unchecked: "/")

    /// This path with one more component (`/a` + `b` = `/a/b`). The component is not checked here.
    public func appending(_ component: String) -> DBusObjectPath {
        DBusObjectPath(unchecked: rawValue == "/" ? "/" + component : rawValue + "/" + component)
    }

    /// The path one level up; nil for `/`.
    public var parent: DBusObjectPath? {
        guard rawValue != "/", let slash = rawValue.utf8.lastIndex(of: UInt8(ascii: "/")) else { return nil }
        if slash == rawValue.utf8.startIndex { return .root }
        return DBusObjectPath(unchecked: String(rawValue[..<slash]))
    }

    /// True when this path equals `other` or lies below it.
    public func isDescendant(ofOrEqualTo other: DBusObjectPath) -> Bool {
        if other.rawValue == "/" || other == self { return true }
        return rawValue.hasPrefix(other.rawValue + "/")
    }

    /// The path components (`/a/b` -> `["a", "b"]`; `/` -> `[]`).
    public var components: [String] { rawValue.split(separator: "/").map(String.init) }

    /// Orders paths by their text.
    public static func < (lhs: DBusObjectPath, rhs: DBusObjectPath) -> Bool { lhs.rawValue < rhs.rawValue }

    static func isValid(_ text: String) -> Bool {
        if text.isEmpty || text.utf8.contains(0) { return false }
        return text.withCString { dbus_validate_path($0, nil) != 0 }
    }
}

/// Owns a unix file descriptor and closes it in `deinit` unless ``take()`` handed it out.
///
/// A descriptor received in a message is a duplicate that the receiver owns. Equality is identity.
public final class DBusFileDescriptor: Hashable, Sendable, CustomStringConvertible {
    private let fd: Mutex<Int32>

    /// Takes ownership of `fd`.
    public init(owning fd: Int32) { self.fd = Mutex(fd) }

    /// The descriptor, still owned by this object (-1 once taken).
    public var rawValue: Int32 { fd.withLock { $0 } }

    /// Moves ownership to the caller; returns -1 if it was already taken.
    public func take() -> Int32 {
        fd.withLock { value in
            let result = value
            value = -1
            return result
        }
    }

    deinit {
        let value = fd.withLock { $0 }
        if value >= 0 { _ = Glibc.close(value) }
    }

    /// Identity: two objects are equal only if they are the same owner.
    public static func == (lhs: DBusFileDescriptor, rhs: DBusFileDescriptor) -> Bool { lhs === rhs }
    /// Hashes the identity.
    public func hash(into hasher: inout Hasher) { hasher.combine(ObjectIdentifier(self)) }
    /// `fd(N)`.
    public var description: String { "fd(\(rawValue))" }
}

/// One entry of a D-Bus dictionary (`{kv}`); entry order is kept.
public struct DBusDictEntry: Hashable, Sendable {
    /// The key (a basic type).
    public var key: DBusValue
    /// The value.
    public var value: DBusValue

    /// Creates an entry.
    public init(key: DBusValue, value: DBusValue) {
        self.key = key
        self.value = value
    }
}

/// Any D-Bus value.
///
/// `ay` is always ``bytes(_:)`` when received. Containers carry their element signatures so empty ones
/// marshal correctly; elements whose type does not match are rejected with ``DBusError/invalidArgs``.
public enum DBusValue: Hashable, Sendable {
    /// `y`
    case byte(UInt8)
    /// `b`
    case boolean(Bool)
    /// `n`
    case int16(Int16)
    /// `q`
    case uint16(UInt16)
    /// `i`
    case int32(Int32)
    /// `u`
    case uint32(UInt32)
    /// `x`
    case int64(Int64)
    /// `t`
    case uint64(UInt64)
    /// `d`
    case double(Double)
    /// `s` (must not contain NUL)
    case string(String)
    /// `o`
    case objectPath(DBusObjectPath)
    /// `g`
    case signature(DBusSignature)
    /// `h`: sent as a duplicate of the descriptor; received as a duplicate the receiver owns.
    case unixFD(DBusFileDescriptor)
    /// An `ay` (marshalled as one fixed array).
    case bytes([UInt8])
    /// An array: the element signature and the elements (`"as"` is `.array("s", [...])`).
    case array(DBusSignature, [DBusValue])
    /// A dictionary `a{kv}` with its key and value signatures; entry order is kept.
    case dictionary(key: DBusSignature, value: DBusSignature, [DBusDictEntry])
    /// A struct `(...)`.
    case structure([DBusValue])
    /// A variant `v`.
    indirect case variant(DBusValue)

    /// The D-Bus signature of this value (one complete type when the value is well-formed).
    public var signature: DBusSignature {
        DBusSignature(unchecked: signatureText)
    }

    var signatureText: String {
        switch self {
        case .byte: return "y"
        case .boolean: return "b"
        case .int16: return "n"
        case .uint16: return "q"
        case .int32: return "i"
        case .uint32: return "u"
        case .int64: return "x"
        case .uint64: return "t"
        case .double: return "d"
        case .string: return "s"
        case .objectPath: return "o"
        case .signature: return "g"
        case .unixFD: return "h"
        case .bytes: return "ay"
        case .array(let element, _): return "a" + element.rawValue
        case .dictionary(let key, let value, _): return "a{" + key.rawValue + value.rawValue + "}"
        case .structure(let fields): return "(" + fields.map(\.signatureText).joined() + ")"
        case .variant: return "v"
        }
    }

    private var unwrapped: DBusValue {
        if case .variant(let inner) = self { return inner }
        return self
    }

    /// The text of a string, object path or signature.
    public var string: String? {
        switch unwrapped {
        case .string(let s): return s
        case .objectPath(let p): return p.rawValue
        case .signature(let s): return s.rawValue
        default: return nil
        }
    }

    /// A boolean.
    public var bool: Bool? { if case .boolean(let v) = unwrapped { return v } else { return nil } }
    /// A byte.
    public var uint8: UInt8? { if case .byte(let v) = unwrapped { return v } else { return nil } }
    /// An `n`.
    public var int16: Int16? { if case .int16(let v) = unwrapped { return v } else { return nil } }
    /// A `q`.
    public var uint16: UInt16? { if case .uint16(let v) = unwrapped { return v } else { return nil } }
    /// An `i`.
    public var int32: Int32? { if case .int32(let v) = unwrapped { return v } else { return nil } }
    /// A `u`.
    public var uint32: UInt32? { if case .uint32(let v) = unwrapped { return v } else { return nil } }
    /// An `x`.
    public var int64: Int64? { if case .int64(let v) = unwrapped { return v } else { return nil } }
    /// A `t`.
    public var uint64: UInt64? { if case .uint64(let v) = unwrapped { return v } else { return nil } }
    /// A `d`.
    public var double: Double? { if case .double(let v) = unwrapped { return v } else { return nil } }
    /// A unix fd.
    public var fileDescriptor: DBusFileDescriptor? {
        if case .unixFD(let v) = unwrapped { return v } else { return nil }
    }

    /// The bytes of an `ay` (``bytes(_:)`` or an array of ``byte(_:)``).
    public var bytes: [UInt8]? {
        switch unwrapped {
        case .bytes(let b): return b
        case .array(let sig, let elements) where sig.rawValue == "y":
            var out: [UInt8] = []
            out.reserveCapacity(elements.count)
            for element in elements {
                guard case .byte(let b) = element else { return nil }
                out.append(b)
            }
            return out
        default: return nil
        }
    }

    /// An object path.
    public var objectPath: DBusObjectPath? {
        if case .objectPath(let p) = unwrapped { return p } else { return nil }
    }

    /// The elements of an array (``bytes(_:)`` yields ``byte(_:)`` elements; a dictionary yields nil).
    public var arrayElements: [DBusValue]? {
        switch unwrapped {
        case .array(_, let elements): return elements
        case .bytes(let b): return b.map { .byte($0) }
        default: return nil
        }
    }

    /// The entries of a dictionary.
    public var dictionaryEntries: [DBusDictEntry]? {
        if case .dictionary(_, _, let entries) = unwrapped { return entries } else { return nil }
    }

    /// The fields of a struct.
    public var structureFields: [DBusValue]? {
        if case .structure(let fields) = unwrapped { return fields } else { return nil }
    }

    /// The content of a variant (nil when this is not a variant).
    public var variantValue: DBusValue? {
        if case .variant(let inner) = self { return inner } else { return nil }
    }

    /// An `a{sv}` as a Swift dictionary with the variants unwrapped (a later duplicate key wins).
    public var stringVariantDictionary: [String: DBusValue]? {
        guard case .dictionary(let key, _, let entries) = unwrapped, key.rawValue == "s" else { return nil }
        var out: [String: DBusValue] = [:]
        out.reserveCapacity(entries.count)
        for entry in entries {
            guard case .string(let k) = entry.key else { return nil }
            if case .variant(let inner) = entry.value { out[k] = inner } else { out[k] = entry.value }
        }
        return out
    }

    /// Builds an `a{sv}` from key/value pairs (values are wrapped in variants unless they already are).
    public static func stringVariantDictionary(_ entries: [(String, DBusValue)]) -> DBusValue {
        .dictionary(
            key: "s", value: "v",
            entries.map { key, value in
                if case .variant = value { return DBusDictEntry(key: .string(key), value: value) }
                return DBusDictEntry(key: .string(key), value: .variant(value))
            })
    }

    /// Builds an `as`.
    public static func stringArray(_ strings: [String]) -> DBusValue { .array("s", strings.map { .string($0) }) }

    /// Builds an `ao`.
    public static func objectPathArray(_ paths: [DBusObjectPath]) -> DBusValue {
        .array("o", paths.map { .objectPath($0) })
    }
}

extension DBusValue: CustomStringConvertible {
    /// A readable rendering, in the spirit of `dbus-send --print-reply`.
    public var description: String {
        switch self {
        case .byte(let v): return "byte \(v)"
        case .boolean(let v): return "boolean \(v)"
        case .int16(let v): return "int16 \(v)"
        case .uint16(let v): return "uint16 \(v)"
        case .int32(let v): return "int32 \(v)"
        case .uint32(let v): return "uint32 \(v)"
        case .int64(let v): return "int64 \(v)"
        case .uint64(let v): return "uint64 \(v)"
        case .double(let v): return "double \(v)"
        case .string(let v): return "string \"\(v)\""
        case .objectPath(let v): return "object path \"\(v)\""
        case .signature(let v): return "signature \"\(v)\""
        case .unixFD(let v): return "unix fd \(v.rawValue)"
        case .bytes(let v): return "bytes [\(v.map { String($0, radix: 16) }.joined(separator: " "))]"
        case .array(let sig, let v): return "array of \(sig) [\(v.map(\.description).joined(separator: ", "))]"
        case .dictionary(_, _, let v):
            return "dict {\(v.map { "\($0.key.description): \($0.value.description)" }.joined(separator: ", "))}"
        case .structure(let v): return "struct (\(v.map(\.description).joined(separator: ", ")))"
        case .variant(let v): return "variant \(v.description)"
        }
    }
}
