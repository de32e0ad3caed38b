// The only code that moves values in and out of libdbus messages. Everything is validated before libdbus sees
// it, because libdbus aborts the process on invalid arguments (dbus_return_if_fail checks are fatal).
internal import CDBus

/// D-Bus type codes (libdbus defines them as cast macros, which Swift cannot import).
enum TypeCode {
    static let invalid: Int32 = 0
    static let byte = Int32(UInt8(ascii: "y"))
    static let boolean = Int32(UInt8(ascii: "b"))
    static let int16 = Int32(UInt8(ascii: "n"))
    static let uint16 = Int32(UInt8(ascii: "q"))
    static let int32 = Int32(UInt8(ascii: "i"))
    static let uint32 = Int32(UInt8(ascii: "u"))
    static let int64 = Int32(UInt8(ascii: "x"))
    static let uint64 = Int32(UInt8(ascii: "t"))
    static let double = Int32(UInt8(ascii: "d"))
    static let string = Int32(UInt8(ascii: "s"))
    static let objectPath = Int32(UInt8(ascii: "o"))
    static let signature = Int32(UInt8(ascii: "g"))
    static let unixFD = Int32(UInt8(ascii: "h"))
    static let array = Int32(UInt8(ascii: "a"))
    static let variant = Int32(UInt8(ascii: "v"))
    static let structure = Int32(UInt8(ascii: "r"))
    static let dictEntry = Int32(UInt8(ascii: "e"))

    static let basicSignatures: Set<String> = ["y", "b", "n", "q", "i", "u", "x", "t", "d", "s", "o", "g", "h"]
}

/// Owns one reference to a libdbus message.
final class CMessage: @unchecked Sendable {
    let pointer: OpaquePointer

    /// Adopts a reference the caller already holds.
    init(adopting pointer: OpaquePointer) { self.pointer = pointer }

    /// Takes a new reference.
    init(retaining pointer: OpaquePointer) {
        dbus_message_ref(pointer)
        self.pointer = pointer
    }

    deinit { dbus_message_unref(pointer) }

    var type: Int32 { dbus_message_get_type(pointer) }
}

/// Name checks for header fields.
enum Names {
    static func check(_ value: String, _ what: String, _ validate: (UnsafePointer<CChar>) -> Bool) throws(DBusError) {
        let ok = !value.isEmpty && !value.utf8.contains(0) && value.withCString { validate($0) }
        guard ok else { throw DBusError(name: DBusError.invalidArgs, message: "invalid D-Bus \(what) \"\(value)\"") }
    }
    static func interface(_ value: String) throws(DBusError) {
        try check(value, "interface name") { dbus_validate_interface($0, nil) != 0 }
    }
    static func member(_ value: String) throws(DBusError) {
        try check(value, "member name") { dbus_validate_member($0, nil) != 0 }
    }
    static func errorName(_ value: String) throws(DBusError) {
        try check(value, "error name") { dbus_validate_error_name($0, nil) != 0 }
    }
    static func busName(_ value: String) throws(DBusError) {
        try check(value, "bus name") { dbus_validate_bus_name($0, nil) != 0 }
    }
    static func path(_ value: DBusObjectPath) throws(DBusError) {
        guard DBusObjectPath.isValid(value.rawValue) else {
            throw DBusError(name: DBusError.invalidArgs, message: "invalid D-Bus object path \"\(value.rawValue)\"")
        }
    }
}

enum Marshal {
    // MARK: validation

    /// Checks that `value` can be marshalled: valid strings, paths and signatures, and containers whose elements
    /// match their declared signatures.
    static func validate(_ value: DBusValue, depth: Int = 0) throws(DBusError) {
        guard depth < 64 else {
            throw DBusError(name: DBusError.invalidArgs, message: "value nested more than 64 levels deep")
        }
        switch value {
        case .byte, .boolean, .int16, .uint16, .int32, .uint32, .int64, .uint64, .double: return
        case .string(let s):
            try validateString(s)
        case .objectPath(let p):
            try Names.path(p)
        case .signature(let s):
            guard DBusSignature.isValid(s.rawValue), s.rawValue.utf8.count <= 255 else {
                throw DBusError(name: DBusError.invalidSignature, message: "invalid D-Bus signature \"\(s.rawValue)\"")
            }
        case .unixFD(let fd):
            guard fd.rawValue >= 0 else {
                throw DBusError(name: DBusError.invalidArgs, message: "unix fd value was already taken or is invalid")
            }
        case .bytes: return
        case .array(let element, let elements):
            guard DBusSignature.isValidSingle(element.rawValue), DBusSignature.isValid("a" + element.rawValue) else {
                throw DBusError(
                    name: DBusError.invalidSignature,
                    message: "invalid array element signature \"\(element.rawValue)\"")
            }
            for (index, item) in elements.enumerated() {
                let actual = item.signatureText
                guard actual == element.rawValue else {
                    throw DBusError(
                        name: DBusError.invalidArgs,
                        message:
                            "array element \(index) has type \"\(actual)\" but the array holds \"\(element.rawValue)\"")
                }
                try validate(item, depth: depth + 1)
            }
        case .dictionary(let key, let valueSignature, let entries):
            guard TypeCode.basicSignatures.contains(key.rawValue) else {
                throw DBusError(
                    name: DBusError.invalidSignature,
                    message: "dictionary key signature \"\(key.rawValue)\" is not a basic type")
            }
            guard DBusSignature.isValidSingle(valueSignature.rawValue),
                DBusSignature.isValid("a{" + key.rawValue + valueSignature.rawValue + "}")
            else {
                throw DBusError(
                    name: DBusError.invalidSignature,
                    message: "invalid dictionary value signature \"\(valueSignature.rawValue)\"")
            }
            for (index, entry) in entries.enumerated() {
                guard entry.key.signatureText == key.rawValue else {
                    throw DBusError(
                        name: DBusError.invalidArgs,
                        message:
                            "dictionary entry \(index) has key type \"\(entry.key.signatureText)\" but the dictionary keys are \"\(key.rawValue)\""
                    )
                }
                guard entry.value.signatureText == valueSignature.rawValue else {
                    throw DBusError(
                        name: DBusError.invalidArgs,
                        message:
                            "dictionary entry \(index) has value type \"\(entry.value.signatureText)\" but the dictionary values are \"\(valueSignature.rawValue)\""
                    )
                }
                try validate(entry.key, depth: depth + 1)
                try validate(entry.value, depth: depth + 1)
            }
        case .structure(let fields):
            guard !fields.isEmpty else {
                throw DBusError(name: DBusError.invalidSignature, message: "a struct needs at least one field")
            }
            for field in fields { try validate(field, depth: depth + 1) }
        case .variant(let inner):
            let signature = inner.signatureText
            guard DBusSignature.isValidSingle(signature) else {
                throw DBusError(
                    name: DBusError.invalidSignature, message: "variant content has invalid signature \"\(signature)\"")
            }
            try validate(inner, depth: depth + 1)
        }
    }

    static func validateString(_ s: String) throws(DBusError) {
        guard !s.utf8.contains(0) else {
            throw DBusError(name: DBusError.invalidArgs, message: "string contains a NUL character")
        }
        let valid = s.withCString { dbus_validate_utf8($0, nil) != 0 }
        guard valid else { throw DBusError(name: DBusError.invalidArgs, message: "string is not valid UTF-8") }
    }

    static func validateBody(_ body: [DBusValue]) throws(DBusError) {
        for value in body { try validate(value) }
        let signature = body.map(\.signatureText).joined()
        guard signature.utf8.count <= 255, DBusSignature.isValid(signature) else {
            throw DBusError(name: DBusError.invalidSignature, message: "message signature \"\(signature)\" is invalid")
        }
    }

    // MARK: building messages

    /// Builds a libdbus message from a Swift one (serial and sender are left to libdbus and the bus).
    static func build(_ message: DBusMessage) throws(DBusError) -> CMessage {
        let type: Int32
        switch message.type {
        case .methodCall:
            type = DBUS_MESSAGE_TYPE_METHOD_CALL
            guard message.path != nil, message.member != nil else {
                throw DBusError(name: DBusError.invalidArgs, message: "a method call needs a path and a member")
            }
        case .methodReturn:
            type = DBUS_MESSAGE_TYPE_METHOD_RETURN
            guard message.replySerial != nil else {
                throw DBusError(name: DBusError.invalidArgs, message: "a method return needs a reply serial")
            }
        case .error:
            type = DBUS_MESSAGE_TYPE_ERROR
            guard message.errorName != nil, message.replySerial != nil else {
                throw DBusError(name: DBusError.invalidArgs, message: "an error needs an error name and a reply serial")
            }
        case .signal:
            type = DBUS_MESSAGE_TYPE_SIGNAL
            guard message.path != nil, message.interface != nil, message.member != nil else {
                throw DBusError(
                    name: DBusError.invalidArgs, message: "a signal needs a path, an interface and a member")
            }
        }
        if let path = message.path { try Names.path(path) }
        if let interface = message.interface { try Names.interface(interface) }
        if let member = message.member { try Names.member(member) }
        if let errorName = message.errorName { try Names.errorName(errorName) }
        if let destination = message.destination { try Names.busName(destination) }
        try validateBody(message.body)

        guard let pointer = dbus_message_new(type) else {
            throw DBusError(name: DBusError.noMemory, message: "dbus_message_new failed")
        }
        let result = CMessage(adopting: pointer)
        var ok = true
        if let path = message.path { ok = ok && dbus_message_set_path(pointer, path.rawValue) != 0 }
        if let interface = message.interface { ok = ok && dbus_message_set_interface(pointer, interface) != 0 }
        if let member = message.member { ok = ok && dbus_message_set_member(pointer, member) != 0 }
        if let errorName = message.errorName { ok = ok && dbus_message_set_error_name(pointer, errorName) != 0 }
        if let destination = message.destination {
            ok = ok && dbus_message_set_destination(pointer, destination) != 0
        }
        if let replySerial = message.replySerial {
            ok = ok && dbus_message_set_reply_serial(pointer, replySerial) != 0
        }
        if message.noReplyExpected { dbus_message_set_no_reply(pointer, 1) }
        guard ok else { throw DBusError(name: DBusError.noMemory, message: "setting message header fields failed") }
        try appendValidated(message.body, to: pointer)
        return result
    }

    /// Appends already validated values to a message.
    static func appendValidated(_ body: [DBusValue], to message: OpaquePointer) throws(DBusError) {
        guard !body.isEmpty else { return }
        var iter = DBusMessageIter()
        dbus_message_iter_init_append(message, &iter)
        for value in body { try append(value, &iter) }
    }

    private static func fail(_ what: String) -> DBusError {
        DBusError(name: DBusError.noMemory, message: "appending \(what) to a D-Bus message failed")
    }

    private static func appendBasic<T: BitwiseCopyable>(_ iter: inout DBusMessageIter, _ code: Int32, _ value: T)
        throws(DBusError)
    {
        var copy = value
        let ok = withUnsafeMutablePointer(to: &copy) { dbus_message_iter_append_basic(&iter, code, $0) != 0 }
        guard ok else { throw fail("a basic value") }
    }

    private static func appendString(_ iter: inout DBusMessageIter, _ code: Int32, _ text: String) throws(DBusError) {
        let ok = text.withCString { cString -> Bool in
            var pointer: UnsafePointer<CChar>? = cString
            return dbus_message_iter_append_basic(&iter, code, &pointer) != 0
        }
        guard ok else { throw fail("a string") }
    }

    private static func append(_ value: DBusValue, _ iter: inout DBusMessageIter) throws(DBusError) {
        switch value {
        case .byte(let v): try appendBasic(&iter, TypeCode.byte, v)
        case .boolean(let v): try appendBasic(&iter, TypeCode.boolean, dbus_bool_t(v ? 1 : 0))
        case .int16(let v): try appendBasic(&iter, TypeCode.int16, v)
        case .uint16(let v): try appendBasic(&iter, TypeCode.uint16, v)
        case .int32(let v): try appendBasic(&iter, TypeCode.int32, v)
        case .uint32(let v): try appendBasic(&iter, TypeCode.uint32, v)
        case .int64(let v): try appendBasic(&iter, TypeCode.int64, v)
        case .uint64(let v): try appendBasic(&iter, TypeCode.uint64, v)
        case .double(let v): try appendBasic(&iter, TypeCode.double, v)
        case .string(let s): try appendString(&iter, TypeCode.string, s)
        case .objectPath(let p): try appendString(&iter, TypeCode.objectPath, p.rawValue)
        case .signature(let s): try appendString(&iter, TypeCode.signature, s.rawValue)
        case .unixFD(let fd):
            // libdbus duplicates the descriptor; ours stays owned by the value.
            try appendBasic(&iter, TypeCode.unixFD, Int32(fd.rawValue))
        case .bytes(let bytes):
            var sub = DBusMessageIter()
            guard dbus_message_iter_open_container(&iter, TypeCode.array, "y", &sub) != 0 else { throw fail("ay") }
            let ok = bytes.withUnsafeBufferPointer { buffer -> Bool in
                var base: UnsafePointer<UInt8>? = buffer.baseAddress
                if base == nil {
                    // An empty array still needs a valid pointer.
                    return withUnsafePointer(to: UInt8(0)) { zero -> Bool in
                        var p: UnsafePointer<UInt8>? = zero
                        return dbus_message_iter_append_fixed_array(&sub, TypeCode.byte, &p, 0) != 0
                    }
                }
                return dbus_message_iter_append_fixed_array(&sub, TypeCode.byte, &base, Int32(buffer.count)) != 0
            }
            guard ok, dbus_message_iter_close_container(&iter, &sub) != 0 else { throw fail("ay") }
        case .array(let element, let elements):
            var sub = DBusMessageIter()
            guard dbus_message_iter_open_container(&iter, TypeCode.array, element.rawValue, &sub) != 0 else {
                throw fail("an array")
            }
            for item in elements { try append(item, &sub) }
            guard dbus_message_iter_close_container(&iter, &sub) != 0 else { throw fail("an array") }
        case .dictionary(let key, let valueSignature, let entries):
            var sub = DBusMessageIter()
            let entrySignature = "{" + key.rawValue + valueSignature.rawValue + "}"
            guard dbus_message_iter_open_container(&iter, TypeCode.array, entrySignature, &sub) != 0 else {
                throw fail("a dictionary")
            }
            for entry in entries {
                var entryIter = DBusMessageIter()
                guard dbus_message_iter_open_container(&sub, TypeCode.dictEntry, nil, &entryIter) != 0 else {
                    throw fail("a dictionary entry")
                }
                try append(entry.key, &entryIter)
                try append(entry.value, &entryIter)
                guard dbus_message_iter_close_container(&sub, &entryIter) != 0 else { throw fail("a dictionary entry") }
            }
            guard dbus_message_iter_close_container(&iter, &sub) != 0 else { throw fail("a dictionary") }
        case .structure(let fields):
            var sub = DBusMessageIter()
            guard dbus_message_iter_open_container(&iter, TypeCode.structure, nil, &sub) != 0 else {
                throw fail("a struct")
            }
            for field in fields { try append(field, &sub) }
            guard dbus_message_iter_close_container(&iter, &sub) != 0 else { throw fail("a struct") }
        case .variant(let inner):
            var sub = DBusMessageIter()
            guard dbus_message_iter_open_container(&iter, TypeCode.variant, inner.signatureText, &sub) != 0 else {
                throw fail("a variant")
            }
            try append(inner, &sub)
            guard dbus_message_iter_close_container(&iter, &sub) != 0 else { throw fail("a variant") }
        }
    }

    // MARK: reading messages

    /// Reads a libdbus message into a Swift one.
    static func decode(_ message: OpaquePointer) throws(DBusError) -> DBusMessage {
        let type: DBusMessage.MessageType
        switch dbus_message_get_type(message) {
        case DBUS_MESSAGE_TYPE_METHOD_CALL: type = .methodCall
        case DBUS_MESSAGE_TYPE_METHOD_RETURN: type = .methodReturn
        case DBUS_MESSAGE_TYPE_ERROR: type = .error
        case DBUS_MESSAGE_TYPE_SIGNAL: type = .signal
        default: throw DBusError(name: DBusError.invalidArgs, message: "unknown D-Bus message type")
        }
        func text(_ p: UnsafePointer<CChar>?) -> String? { p.map { String(cString: $0) } }
        let replySerial = dbus_message_get_reply_serial(message)
        var result = DBusMessage(
            type: type,
            serial: dbus_message_get_serial(message),
            replySerial: replySerial == 0 ? nil : replySerial,
            path: text(dbus_message_get_path(message)).map { DBusObjectPath(unchecked: $0) },
            interface: text(dbus_message_get_interface(message)),
            member: text(dbus_message_get_member(message)),
            errorName: text(dbus_message_get_error_name(message)),
            destination: text(dbus_message_get_destination(message)),
            sender: text(dbus_message_get_sender(message)),
            body: try decodeBody(message))
        result.noReplyExpected = dbus_message_get_no_reply(message) != 0
        return result
    }

    /// Reads the arguments of a libdbus message.
    static func decodeBody(_ message: OpaquePointer) throws(DBusError) -> [DBusValue] {
        var iter = DBusMessageIter()
        guard dbus_message_iter_init(message, &iter) != 0 else { return [] }
        var values: [DBusValue] = []
        while dbus_message_iter_get_arg_type(&iter) != TypeCode.invalid {
            values.append(try read(&iter))
            dbus_message_iter_next(&iter)
        }
        return values
    }

    private static func basic<T: BitwiseCopyable>(_ iter: inout DBusMessageIter, _ initial: T) -> T {
        var value = initial
        withUnsafeMutablePointer(to: &value) { dbus_message_iter_get_basic(&iter, $0) }
        return value
    }

    private static func basicString(_ iter: inout DBusMessageIter) -> String {
        var pointer: UnsafePointer<CChar>? = nil
        dbus_message_iter_get_basic(&iter, &pointer)
        return pointer.map { String(cString: $0) } ?? ""
    }

    private static func currentSignature(_ iter: inout DBusMessageIter) -> String {
        guard let raw = dbus_message_iter_get_signature(&iter) else { return "" }
        defer { dbus_free(raw) }
        return String(cString: raw)
    }

    /// The one-character signature of a type code (a small string: no allocation).
    private static func signatureText(_ code: Int32) -> String {
        String(UnicodeScalar(UInt8(truncatingIfNeeded: code)))
    }

    /// The key and value signatures of the dictionary at `iter` (`first` is recursed into it). The common shapes,
    /// a basic value or a variant (`a{sv}`, `a{qv}`), are read off the first entry's type codes; any other (and an
    /// empty dictionary) from libdbus's signature.
    private static func entrySignature(_ iter: inout DBusMessageIter, first: inout DBusMessageIter) -> (String, String)
    {
        if dbus_message_iter_get_arg_type(&first) == TypeCode.dictEntry {
            var entry = DBusMessageIter()
            dbus_message_iter_recurse(&first, &entry)
            let keyCode = dbus_message_iter_get_arg_type(&entry)
            dbus_message_iter_next(&entry)
            let valueCode = dbus_message_iter_get_arg_type(&entry)
            if dbus_type_is_basic(keyCode) != 0, dbus_type_is_basic(valueCode) != 0 || valueCode == TypeCode.variant {
                return (signatureText(keyCode), signatureText(valueCode))
            }
        }
        // "a{kv...}": the key is one basic type code.
        let inner = currentSignature(&iter).dropFirst(2).dropLast()
        return (String(inner.prefix(1)), String(inner.dropFirst()))
    }

    /// Reads the value at `iter` (which stays there).
    static func readValue(_ iter: inout DBusMessageIter) throws(DBusError) -> DBusValue { try read(&iter) }

    private static func read(_ iter: inout DBusMessageIter) throws(DBusError) -> DBusValue {
        let code = dbus_message_iter_get_arg_type(&iter)
        switch code {
        case TypeCode.byte: return .byte(basic(&iter, UInt8(0)))
        case TypeCode.boolean: return .boolean(basic(&iter, dbus_bool_t(0)) != 0)
        case TypeCode.int16: return .int16(basic(&iter, Int16(0)))
        case TypeCode.uint16: return .uint16(basic(&iter, UInt16(0)))
        case TypeCode.int32: return .int32(basic(&iter, Int32(0)))
        case TypeCode.uint32: return .uint32(basic(&iter, UInt32(0)))
        case TypeCode.int64: return .int64(basic(&iter, Int64(0)))
        case TypeCode.uint64: return .uint64(basic(&iter, UInt64(0)))
        case TypeCode.double: return .double(basic(&iter, Double(0)))
        case TypeCode.string: return .string(basicString(&iter))
        case TypeCode.objectPath: return .objectPath(DBusObjectPath(unchecked: basicString(&iter)))
        case TypeCode.signature: return .signature(DBusSignature(unchecked: basicString(&iter)))
        case TypeCode.unixFD:
            // libdbus hands out a duplicate that we now own.
            let fd = basic(&iter, Int32(-1))
            guard fd >= 0 else {
                throw DBusError(name: DBusError.invalidArgs, message: "message carries an unusable unix fd")
            }
            return .unixFD(DBusFileDescriptor(owning: fd))
        case TypeCode.array:
            let elementCode = dbus_message_iter_get_element_type(&iter)
            var sub = DBusMessageIter()
            if elementCode == TypeCode.byte {
                dbus_message_iter_recurse(&iter, &sub)
                var pointer: UnsafePointer<UInt8>? = nil
                var count: Int32 = 0
                dbus_message_iter_get_fixed_array(&sub, &pointer, &count)
                guard let pointer, count > 0 else { return .bytes([]) }
                return .bytes(Array(UnsafeBufferPointer(start: pointer, count: Int(count))))
            }
            dbus_message_iter_recurse(&iter, &sub)
            if elementCode == TypeCode.dictEntry {
                let (key, value) = entrySignature(&iter, first: &sub)
                var entries: [DBusDictEntry] = []
                while dbus_message_iter_get_arg_type(&sub) == TypeCode.dictEntry {
                    var entryIter = DBusMessageIter()
                    dbus_message_iter_recurse(&sub, &entryIter)
                    let k = try read(&entryIter)
                    dbus_message_iter_next(&entryIter)
                    let v = try read(&entryIter)
                    entries.append(DBusDictEntry(key: k, value: v))
                    dbus_message_iter_next(&sub)
                }
                return .dictionary(key: DBusSignature(unchecked: key), value: DBusSignature(unchecked: value), entries)
            }
            // A basic element's signature is its type code (no allocation); others are asked of libdbus.
            let element =
                dbus_type_is_basic(elementCode) != 0
                ? signatureText(elementCode) : String(currentSignature(&iter).dropFirst())
            var elements: [DBusValue] = []
            while dbus_message_iter_get_arg_type(&sub) != TypeCode.invalid {
                elements.append(try read(&sub))
                dbus_message_iter_next(&sub)
            }
            return .array(DBusSignature(unchecked: element), elements)
        case TypeCode.structure:
            var sub = DBusMessageIter()
            dbus_message_iter_recurse(&iter, &sub)
            var fields: [DBusValue] = []
            while dbus_message_iter_get_arg_type(&sub) != TypeCode.invalid {
                fields.append(try read(&sub))
                dbus_message_iter_next(&sub)
            }
            return .structure(fields)
        case TypeCode.variant:
            var sub = DBusMessageIter()
            dbus_message_iter_recurse(&iter, &sub)
            return .variant(try read(&sub))
        default:
            throw DBusError(name: DBusError.invalidArgs, message: "unsupported D-Bus type code \(code) in message")
        }
    }

    // MARK: wire format

    /// Serialises a message to the D-Bus wire format (for tests and tools).
    static func serialize(_ message: CMessage) throws(DBusError) -> [UInt8] {
        var buffer: UnsafeMutablePointer<CChar>? = nil
        var length: Int32 = 0
        guard dbus_message_marshal(message.pointer, &buffer, &length) != 0, let buffer else {
            throw DBusError(name: DBusError.noMemory, message: "dbus_message_marshal failed")
        }
        defer { dbus_free(buffer) }
        return buffer.withMemoryRebound(to: UInt8.self, capacity: Int(length)) {
            Array(UnsafeBufferPointer(start: $0, count: Int(length)))
        }
    }

    /// Parses the D-Bus wire format; malformed input becomes a ``DBusError``.
    static func deserialize(_ bytes: [UInt8]) throws(DBusError) -> CMessage {
        var error = CDBus.DBusError.make()
        let pointer = bytes.withUnsafeBufferPointer { buffer in
            buffer.withMemoryRebound(to: CChar.self) { chars in
                dbus_message_demarshal(chars.baseAddress, Int32(chars.count), &error)
            }
        }
        guard let pointer else { throw DBusError.consume(&error, context: "demarshalling a D-Bus message") }
        return CMessage(adopting: pointer)
    }
}

extension DBusMessage {
    /// This message in the D-Bus wire format (serial 1 if none was set). Fails like sending would on an invalid
    /// message; unix fds cannot be serialised this way.
    public func wireFormat() throws(DBusError) -> [UInt8] {
        guard !body.contains(where: { $0.containsFileDescriptor }) else {
            throw DBusError(name: DBusError.notSupported, message: "unix fds cannot be serialised to bytes")
        }
        let message = try Marshal.build(self)
        dbus_message_set_serial(message.pointer, serial == 0 ? 1 : serial)
        return try Marshal.serialize(message)
    }

    /// Parses a message from the D-Bus wire format.
    /// - Throws: ``DBusError`` when the bytes are not a valid message.
    public init(wireFormat bytes: [UInt8]) throws(DBusError) {
        let message = try Marshal.deserialize(bytes)
        self = try Marshal.decode(message.pointer)
    }
}
