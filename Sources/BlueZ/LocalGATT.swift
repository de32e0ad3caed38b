// The peripheral role's GATT server: a description of services, exported as BlueZ's "GATT application"
// (doc/org.bluez.GattManager.rst, GattService.rst, GattCharacteristic.rst, GattDescriptor.rst) and served the way
// bluetoothd's src/gatt-database.c calls it.
import DBus
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// The flags of a local characteristic or descriptor: BlueZ's `Flags` strings (doc/org.bluez.GattCharacteristic.rst).
///
/// Descriptors take only `read`, `write`, the `encrypt-*`/`secure-*` read and write flags and `authorize`.
public struct LocalGATTFlags: OptionSet, Sendable, Hashable {
    /// The bits.
    public let rawValue: UInt32
    /// Flags from bits.
    public init(rawValue: UInt32) { self.rawValue = rawValue }

    /// `broadcast`
    public static let broadcast = LocalGATTFlags(rawValue: 1 << 0)
    /// `read`
    public static let read = LocalGATTFlags(rawValue: 1 << 1)
    /// `write-without-response`
    public static let writeWithoutResponse = LocalGATTFlags(rawValue: 1 << 2)
    /// `write`
    public static let write = LocalGATTFlags(rawValue: 1 << 3)
    /// `notify`
    public static let notify = LocalGATTFlags(rawValue: 1 << 4)
    /// `indicate`
    public static let indicate = LocalGATTFlags(rawValue: 1 << 5)
    /// `authenticated-signed-writes`
    public static let authenticatedSignedWrites = LocalGATTFlags(rawValue: 1 << 6)
    /// `extended-properties`
    public static let extendedProperties = LocalGATTFlags(rawValue: 1 << 7)
    /// `reliable-write`
    public static let reliableWrite = LocalGATTFlags(rawValue: 1 << 8)
    /// `writable-auxiliaries`
    public static let writableAuxiliaries = LocalGATTFlags(rawValue: 1 << 9)
    /// `encrypt-read`
    public static let encryptRead = LocalGATTFlags(rawValue: 1 << 10)
    /// `encrypt-write`
    public static let encryptWrite = LocalGATTFlags(rawValue: 1 << 11)
    /// `encrypt-notify`
    public static let encryptNotify = LocalGATTFlags(rawValue: 1 << 12)
    /// `encrypt-indicate`
    public static let encryptIndicate = LocalGATTFlags(rawValue: 1 << 13)
    /// `encrypt-authenticated-read`
    public static let encryptAuthenticatedRead = LocalGATTFlags(rawValue: 1 << 14)
    /// `encrypt-authenticated-write`
    public static let encryptAuthenticatedWrite = LocalGATTFlags(rawValue: 1 << 15)
    /// `encrypt-authenticated-notify`
    public static let encryptAuthenticatedNotify = LocalGATTFlags(rawValue: 1 << 16)
    /// `encrypt-authenticated-indicate`
    public static let encryptAuthenticatedIndicate = LocalGATTFlags(rawValue: 1 << 17)
    /// `secure-read`
    public static let secureRead = LocalGATTFlags(rawValue: 1 << 18)
    /// `secure-write`
    public static let secureWrite = LocalGATTFlags(rawValue: 1 << 19)
    /// `secure-notify`
    public static let secureNotify = LocalGATTFlags(rawValue: 1 << 20)
    /// `secure-indicate`
    public static let secureIndicate = LocalGATTFlags(rawValue: 1 << 21)
    /// `authorize`
    public static let authorize = LocalGATTFlags(rawValue: 1 << 22)

    /// Every flag with its BlueZ string, in the order the documentation lists them.
    public static let bluezNames: [(LocalGATTFlags, String)] = [
        (.broadcast, "broadcast"), (.read, "read"), (.writeWithoutResponse, "write-without-response"),
        (.write, "write"), (.notify, "notify"), (.indicate, "indicate"),
        (.authenticatedSignedWrites, "authenticated-signed-writes"), (.extendedProperties, "extended-properties"),
        (.reliableWrite, "reliable-write"), (.writableAuxiliaries, "writable-auxiliaries"),
        (.encryptRead, "encrypt-read"), (.encryptWrite, "encrypt-write"), (.encryptNotify, "encrypt-notify"),
        (.encryptIndicate, "encrypt-indicate"), (.encryptAuthenticatedRead, "encrypt-authenticated-read"),
        (.encryptAuthenticatedWrite, "encrypt-authenticated-write"),
        (.encryptAuthenticatedNotify, "encrypt-authenticated-notify"),
        (.encryptAuthenticatedIndicate, "encrypt-authenticated-indicate"), (.secureRead, "secure-read"),
        (.secureWrite, "secure-write"), (.secureNotify, "secure-notify"), (.secureIndicate, "secure-indicate"),
        (.authorize, "authorize"),
    ]

    /// The `Flags` strings BlueZ reads.
    public var bluezStrings: [String] { Self.bluezNames.filter { contains($0.0) }.map(\.1) }

    /// Parses BlueZ's strings.
    /// - Throws: `BlueZError.invalidArgument` naming the first string that is not one of BlueZ's flags.
    public init(bluezStrings: [String]) throws(BlueZError) {
        var flags: LocalGATTFlags = []
        for text in bluezStrings {
            guard let (flag, _) = Self.bluezNames.first(where: { $0.1 == text }) else {
                throw .invalidArgument("GATT flag \"\(text)\" is not one of BlueZ's characteristic flags")
            }
            flags.insert(flag)
        }
        self = flags
    }

    /// Some way to read (plain, encrypted, authenticated, secure).
    public var allowsRead: Bool { !isDisjoint(with: [.read, .encryptRead, .encryptAuthenticatedRead, .secureRead]) }
    /// Write with response (plain, encrypted, authenticated, secure) or reliable write.
    public var allowsWriteRequest: Bool {
        !isDisjoint(with: [.write, .encryptWrite, .encryptAuthenticatedWrite, .secureWrite, .reliableWrite])
    }
    /// Write without response (or signed write).
    public var allowsWriteCommand: Bool { !isDisjoint(with: [.writeWithoutResponse, .authenticatedSignedWrites]) }
    /// Any kind of write.
    public var allowsWrite: Bool { allowsWriteRequest || allowsWriteCommand }
    /// Notifications or indications, with or without security.
    public var allowsNotify: Bool {
        !isDisjoint(with: [
            .notify, .indicate, .encryptNotify, .encryptIndicate, .encryptAuthenticatedNotify,
            .encryptAuthenticatedIndicate, .secureNotify, .secureIndicate,
        ])
    }
}

/// A descriptor of a local characteristic.
public struct LocalGATTDescriptor: Sendable, Hashable {
    /// The UUID (any form ``bluezUUIDString(_:)`` takes; exported in BlueZ's 128-bit form).
    public var uuid: String
    /// What a central may do (`read`, `write`, security flags).
    public var flags: LocalGATTFlags
    /// The value served to reads.
    public var value: [UInt8]

    /// A descriptor.
    public init(uuid: String, flags: LocalGATTFlags = [.read], value: [UInt8] = []) {
        self.uuid = uuid
        self.flags = flags
        self.value = value
    }

    /// The Characteristic User Description (0x2901): `text` in UTF-8, read-only.
    public static func userDescription(_ text: String) -> LocalGATTDescriptor {
        LocalGATTDescriptor(uuid: "2901", flags: [.read], value: Array(text.utf8))
    }

    /// The Characteristic Presentation Format (0x2904), read-only: format, exponent, unit (a 16-bit UUID such as
    /// 0x272F for degrees Celsius), namespace (1 = Bluetooth SIG) and description, little-endian.
    public static func presentationFormat(
        format: UInt8, exponent: Int8 = 0, unit: UInt16, namespace: UInt8 = 1, description: UInt16 = 0
    ) -> LocalGATTDescriptor {
        let value: [UInt8] = [
            format, UInt8(bitPattern: exponent), UInt8(unit & 0xff), UInt8(unit >> 8), namespace,
            UInt8(description & 0xff), UInt8(description >> 8),
        ]
        return LocalGATTDescriptor(uuid: "2904", flags: [.read], value: value)
    }
}

/// Which descriptor-passing methods a characteristic offers bluetoothd (it uses them when their properties exist).
public struct LocalGATTAcquire: OptionSet, Sendable, Hashable {
    /// The bits.
    public let rawValue: UInt8
    /// From bits.
    public init(rawValue: UInt8) { self.rawValue = rawValue }
    /// `AcquireNotify` (and the `NotifyAcquired` property), when the flags allow notifications.
    public static let notify = LocalGATTAcquire(rawValue: 1)
    /// `AcquireWrite` (and `WriteAcquired`), when the flags allow write without response.
    public static let write = LocalGATTAcquire(rawValue: 2)
}

/// A characteristic of a local service.
public struct LocalGATTCharacteristic: Sendable, Hashable {
    /// The application's name for it, unique in the application (defaults to the normalised UUID).
    public var id: String
    /// The UUID.
    public var uuid: String
    /// What a central may do.
    public var flags: LocalGATTFlags
    /// The value at start.
    public var initialValue: [UInt8]
    /// Its descriptors (BlueZ adds the CCCD 0x2902 and extended properties 0x2900 itself).
    public var descriptors: [LocalGATTDescriptor]
    /// The descriptor-passing methods offered where the flags allow (both by default).
    public var acquire: LocalGATTAcquire

    /// A characteristic.
    public init(
        uuid: String, id: String? = nil, flags: LocalGATTFlags, initialValue: [UInt8] = [],
        descriptors: [LocalGATTDescriptor] = [], acquire: LocalGATTAcquire = [.notify, .write]
    ) {
        self.uuid = uuid
        self.id = id ?? bluezUUIDString(uuid) ?? uuid
        self.flags = flags
        self.initialValue = initialValue
        self.descriptors = descriptors
        self.acquire = acquire
    }

    var offersAcquireNotify: Bool { acquire.contains(.notify) && flags.allowsNotify }
    var offersAcquireWrite: Bool { acquire.contains(.write) && flags.allowsWriteCommand }
}

/// A local GATT service.
public struct LocalGATTService: Sendable, Hashable {
    /// The UUID.
    public var uuid: String
    /// Primary (true) or secondary.
    public var primary: Bool
    /// Its characteristics.
    public var characteristics: [LocalGATTCharacteristic]

    /// A service.
    public init(uuid: String, primary: Bool = true, characteristics: [LocalGATTCharacteristic]) {
        self.uuid = uuid
        self.primary = primary
        self.characteristics = characteristics
    }
}

/// How a central wrote (the `type` option; bluetoothd versions that omit it send commands without a reply).
public enum LocalGATTWriteType: String, Sendable, Hashable {
    /// Write with response.
    case request
    /// Write without response (also every write arriving on an `AcquireWrite` socket).
    case command
    /// Reliable (queued, then executed) write.
    case reliable
}

/// A write from a central, handed to the application's write handler.
public struct LocalGATTWrite: Sendable, Hashable {
    /// The characteristic's ``LocalGATTCharacteristic/id``.
    public var characteristicID: String
    /// The characteristic's UUID (BlueZ form).
    public var characteristicUUID: String
    /// Set when the write is to a descriptor of the characteristic (BlueZ form).
    public var descriptorUUID: String?
    /// The bytes written.
    public var bytes: [UInt8]
    /// The `offset` option (0 when absent).
    public var offset: Int
    /// The kind of write.
    public var type: LocalGATTWriteType
    /// The `device` option: the object path of the central (nil when bluetoothd did not say).
    public var device: String?
    /// The `mtu` option.
    public var mtu: UInt16?
    /// The `link` option (`LE`, `BR/EDR`).
    public var link: String?
    /// The `prepare-authorize` option: bluetoothd asks only whether a prepared write is allowed; the value is not
    /// stored.
    public var prepareAuthorize: Bool
}

/// An error the application answers a central with; bluetoothd turns each into an ATT error (src/gatt-database.c,
/// `dbus_error_to_att_ecode`).
public enum LocalGATTError: Error, Sendable, Hashable, CustomStringConvertible {
    /// `org.bluez.Error.NotPermitted` (ATT Read/Write Not Permitted).
    case notPermitted
    /// `org.bluez.Error.InvalidValueLength` (ATT Invalid Attribute Value Length).
    case invalidValueLength
    /// `org.bluez.Error.InvalidOffset` (ATT Invalid Offset).
    case invalidOffset
    /// `org.bluez.Error.NotAuthorized` (ATT Insufficient Authorization).
    case notAuthorized
    /// `org.bluez.Error.NotSupported` (ATT Request Not Supported).
    case notSupported
    /// `org.bluez.Error.InProgress`.
    case inProgress
    /// `org.bluez.Error.Failed` with a text; bluetoothd sends ATT application error 0x80 for it.
    case failed(String)
    /// An application ATT error code 0x80-0x9f: `org.bluez.Error.Failed` whose message is the code ("0x85").
    /// Codes outside that range reach the central as ATT Unlikely Error.
    case application(code: UInt8)

    /// The D-Bus error name sent to bluetoothd (`org.bluez.Error.NotPermitted`).
    public var errorName: String { dbusError.name }

    /// The error text sent with it (the code, "0x85", for an application error).
    public var errorMessage: String { dbusError.message }

    var dbusError: DBusError {
        switch self {
        case .notPermitted: return DBusError(name: "org.bluez.Error.NotPermitted", message: "Not permitted")
        case .invalidValueLength:
            return DBusError(name: "org.bluez.Error.InvalidValueLength", message: "Invalid value length")
        case .invalidOffset: return DBusError(name: "org.bluez.Error.InvalidOffset", message: "Invalid offset")
        case .notAuthorized: return DBusError(name: "org.bluez.Error.NotAuthorized", message: "Not authorized")
        case .notSupported: return DBusError(name: "org.bluez.Error.NotSupported", message: "Not supported")
        case .inProgress: return DBusError(name: "org.bluez.Error.InProgress", message: "In progress")
        case .failed(let text): return DBusError(name: "org.bluez.Error.Failed", message: text)
        case .application(let code):
            let hex = String(code, radix: 16)
            return DBusError(name: "org.bluez.Error.Failed", message: "0x" + (hex.count < 2 ? "0" + hex : hex))
        }
    }

    /// The D-Bus error name and text.
    public var description: String { dbusError.description }
}

/// What the write handler answers.
public enum LocalGATTWriteResult: Sendable, Hashable {
    /// Accept: the stored value becomes the written bytes (at the offset). The `Value` property follows unless a
    /// central is subscribed (bluetoothd would send that change out as a notification); call
    /// ``BlueZGATTApplication/setValue(_:for:)`` to notify.
    case accept
    /// Accept, but keep the stored value as it is (the application sets it itself, or the write is a command).
    case acceptWithoutStoring
    /// Refuse with an ATT error.
    case reject(LocalGATTError)
}

/// The application's write handler. It runs on a task of the application's `run()`, one write at a time in
/// arrival order; the D-Bus reply waits for it.
public typealias LocalGATTWriteHandler = @Sendable (LocalGATTWrite) async -> LocalGATTWriteResult

/// How a central subscribed.
public enum LocalGATTSubscription: String, Sendable, Hashable {
    /// `StartNotify`: values go out as `PropertiesChanged` of `Value`.
    case startNotify
    /// `AcquireNotify`: values go out as datagrams on a socket bluetoothd holds.
    case acquireNotify
}

/// Something that happened to a ``BlueZGATTApplication``.
public enum LocalGATTEvent: Sendable, Hashable {
    /// Registered with `GattManager1` on `adapter`.
    case registered(adapter: BlueZAdapter)
    /// No longer registered (it registers again unless `reason` is `.cancelled`).
    case unregistered(reason: BlueZRegistrationEndReason)
    /// A registration attempt failed; it is retried.
    case registrationFailed(BlueZRegistrationFailure)
    /// A central read a characteristic (or one of its descriptors).
    case read(device: String?, characteristicID: String, descriptorUUID: String?)
    /// A write was accepted (from `WriteValue` or the `AcquireWrite` socket; not a `prepare-authorize` check).
    case write(
        device: String?, characteristicID: String, descriptorUUID: String?, bytes: [UInt8], type: LocalGATTWriteType)
    /// Notifications or indications were enabled.
    case subscribed(characteristicID: String, via: LocalGATTSubscription, device: String?)
    /// They were disabled (`StopNotify`, the acquired socket closed, or bluetoothd gone).
    case unsubscribed(characteristicID: String, via: LocalGATTSubscription)
    /// A central confirmed an indication (`Confirm`, or 0x01 on the acquired socket).
    case confirmed(characteristicID: String)
    /// A central that used the application is connected (`Device1.Connected`).
    case centralConnected(address: String, device: String)
    /// It disconnected.
    case centralDisconnected(address: String, device: String)
}

/// The events of an application: a bounded buffer that keeps the newest 1024 events (older ones are dropped when
/// the consumer falls behind). One consumer; it ends when `run()` returns.
public struct LocalGATTEvents: AsyncSequence, Sendable {
    /// Each event.
    public typealias Element = LocalGATTEvent
    let base: AsyncStream<LocalGATTEvent>

    /// Iterates the events.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncStream<LocalGATTEvent>.AsyncIterator
        /// The next event; nil once the application stopped.
        public mutating func next() async -> LocalGATTEvent? { await base.next() }
    }

    /// An iterator.
    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(base: base.makeAsyncIterator()) }
}

/// A GATT application: local services published in bluetoothd's database (`GattManager1.RegisterApplication`).
///
/// Create it with its services, call ``run()`` in a task (it registers on the selected adapter, follows
/// bluetoothd across restarts, bus loss and adapter changes, and unregisters when cancelled), consume ``events``,
/// update values with ``setValue(_:for:)``. All methods are safe from any task.
public final class BlueZGATTApplication: Sendable {
    /// The services, as given.
    public let services: [LocalGATTService]
    /// The object path of the application root (its `ObjectManager`).
    public let path: String
    /// The application's events.
    public let events: LocalGATTEvents

    struct Entry: Sendable {
        var characteristic: LocalGATTCharacteristic
        var uuid: String
        var path: DBusObjectPath
        var servicePath: DBusObjectPath
        var descriptorPaths: [DBusObjectPath]
    }

    struct CharacteristicState: Sendable {
        var value: [UInt8]
        var descriptorValues: [[UInt8]]
        var notifying = false
        var notifySocket: AcquiredSocket?
        var writeSocket: AcquiredSocket?
        var confirmations = 0
    }

    struct State: Sendable {
        var characteristics: [CharacteristicState]
        /// Centrals that called us, by device path, with their address.
        var centrals: [String: String] = [:]
        var writes: AsyncStream<WriteJob>.Continuation?
    }

    struct WriteJob: Sendable {
        var write: LocalGATTWrite
        var index: Int
        var descriptorIndex: Int?
        var reply: DBusPendingReply?
    }

    let entries: [Entry]
    let servicePaths: [DBusObjectPath]
    let root: DBusObjectPath
    let client: BlueZClient
    let writeHandler: LocalGATTWriteHandler
    let state: Mutex<State>
    let continuation: AsyncStream<LocalGATTEvent>.Continuation
    let driver: Mutex<LocalRegistrationDriver?> = Mutex(nil)
    let selector: BlueZAdapterSelector

    private static let counter = Atomic<Int>(0)

    /// Describes an application; nothing is exported until ``run()``.
    /// - Parameters:
    ///   - client: the started client whose bus and mirror it uses.
    ///   - services: what to publish.
    ///   - adapter: where (`hci0`, an address, or the first adapter).
    ///   - writeHandler: decides on every write (the default accepts all).
    /// - Throws: `BlueZError.invalidArgument` for an invalid UUID or a duplicate characteristic id.
    public init(
        client: BlueZClient, services: [LocalGATTService], adapter: BlueZAdapterSelector = .any,
        writeHandler: @escaping LocalGATTWriteHandler = { _ in .accept }
    ) throws(BlueZError) {
        self.client = client
        self.services = services
        self.selector = adapter
        self.writeHandler = writeHandler
        let n = Self.counter.add(1, ordering: .relaxed).newValue
        root = DBusObjectPath(stringLiteral: "/io/blebridge/app\(n)")
        path = root.rawValue
        var entries: [Entry] = []
        var servicePaths: [DBusObjectPath] = []
        var states: [CharacteristicState] = []
        var ids = Set<String>()
        for (i, service) in services.enumerated() {
            guard bluezUUIDString(service.uuid) != nil else {
                throw .invalidArgument("GATT service \(i): \"\(service.uuid)\" is not a UUID")
            }
            let servicePath = root.appending("service\(i)")
            servicePaths.append(servicePath)
            for (j, characteristic) in service.characteristics.enumerated() {
                guard let uuid = bluezUUIDString(characteristic.uuid) else {
                    throw .invalidArgument(
                        "GATT service \(i) characteristic \(j): \"\(characteristic.uuid)\" is not a UUID")
                }
                guard ids.insert(characteristic.id).inserted else {
                    throw .invalidArgument(
                        "GATT characteristic id \"\(characteristic.id)\" is used twice (give each an id)")
                }
                let path = servicePath.appending("char\(j)")
                var descriptorPaths: [DBusObjectPath] = []
                for (k, descriptor) in characteristic.descriptors.enumerated() {
                    guard bluezUUIDString(descriptor.uuid) != nil else {
                        throw .invalidArgument(
                            "GATT characteristic \(characteristic.id) descriptor \(k): \"\(descriptor.uuid)\" is not a UUID"
                        )
                    }
                    descriptorPaths.append(path.appending("desc\(k)"))
                }
                entries.append(
                    Entry(
                        characteristic: characteristic, uuid: uuid, path: path, servicePath: servicePath,
                        descriptorPaths: descriptorPaths))
                states.append(
                    CharacteristicState(
                        value: characteristic.initialValue, descriptorValues: characteristic.descriptors.map(\.value)))
            }
        }
        self.entries = entries
        self.servicePaths = servicePaths
        state = Mutex(State(characteristics: states))
        let (stream, continuation) = AsyncStream<LocalGATTEvent>.makeStream(bufferingPolicy: .bufferingNewest(1024))
        events = LocalGATTEvents(base: stream)
        self.continuation = continuation
    }

    deinit {
        continuation.finish()
        let sockets = state.withLock { s in s.characteristics.flatMap { [$0.notifySocket, $0.writeSocket] } }
        for socket in sockets { socket?.close() }
    }

    // MARK: values

    /// The stored value of a characteristic.
    public func value(for characteristicID: String) -> [UInt8]? {
        guard let index = index(of: characteristicID) else { return nil }
        return state.withLock { $0.characteristics[index].value }
    }

    /// True while a central is subscribed (`StartNotify` or `AcquireNotify`).
    public func isNotifying(_ characteristicID: String) -> Bool {
        guard let index = index(of: characteristicID) else { return false }
        return state.withLock { $0.characteristics[index].notifying || $0.characteristics[index].notifySocket != nil }
    }

    /// How many indication confirmations arrived for a characteristic.
    public func confirmationCount(for characteristicID: String) -> Int {
        guard let index = index(of: characteristicID) else { return 0 }
        return state.withLock { $0.characteristics[index].confirmations }
    }

    /// Stores a new value and, while a central is subscribed, sends it: as a datagram on the `AcquireNotify` socket
    /// when there is one, else as `PropertiesChanged` of `Value` (one signal per call, even for equal values).
    /// Calls from one task go out in call order. A datagram that the socket cannot take within one second (bluetoothd
    /// not reading) is dropped with a warning; keep values within the MTU bluetoothd gave minus 3 bytes.
    /// - Throws: `BlueZError.invalidArgument` for an unknown characteristic id.
    public func setValue(_ bytes: [UInt8], for characteristicID: String) throws(BlueZError) {
        guard let index = index(of: characteristicID) else {
            throw .invalidArgument("GATT application \(path): no characteristic with id \"\(characteristicID)\"")
        }
        let (notifying, socket) = state.withLock { s -> (Bool, AcquiredSocket?) in
            s.characteristics[index].value = bytes
            return (s.characteristics[index].notifying, s.characteristics[index].notifySocket)
        }
        if let socket {
            if !socket.send(bytes) {
                client.logger.warning(
                    "GATT application \(path): characteristic \(characteristicID): notification dropped (the "
                        + "AcquireNotify socket did not take it)")
            }
            return
        }
        let server = driver.withLock { $0?.server }
        server?.setProperty(
            at: entries[index].path, interface: BlueZName.characteristic, "Value", .bytes(bytes), flush: notifying)
    }

    private func index(of id: String) -> Int? { entries.firstIndex { $0.characteristic.id == id } }

    // MARK: lifecycle

    /// Registers the application and keeps it registered until the calling task is cancelled; then unregisters it
    /// (`UnregisterApplication`), removes its objects, ends ``events`` and returns.
    /// - Throws: `BlueZError.invalidArgument` when it is already running.
    public func run() async throws(BlueZError) {
        let hooks = LocalRegistrationDriver.Hooks(
            managerInterface: "org.bluez.GattManager1", registerMethod: "RegisterApplication",
            unregisterMethod: "UnregisterApplication", objectPath: root, label: "GATT application \(path)",
            export: { [weak self] connection in
                self?.export(on: connection) ?? DBusObjectServer(connection: connection, objectManagerPath: "/")
            },
            registered: { [weak self] adapter in self?.continuation.yield(.registered(adapter: adapter)) },
            unregistered: { [weak self] reason in self?.lost(reason) },
            failed: { [weak self] failure in self?.continuation.yield(.registrationFailed(failure)) },
            treeEvent: { [weak self] event, tree in self?.treeEvent(event, tree) })
        let driver = LocalRegistrationDriver(client: client, selector: selector, hooks: hooks)
        let claimed = self.driver.withLock { current -> Bool in
            if current != nil { return false }
            current = driver
            return true
        }
        guard claimed, driver.claim() else {
            throw .invalidArgument("GATT application \(path) is already running")
        }
        let (writes, writeContinuation) = AsyncStream<WriteJob>.makeStream()
        state.withLock { $0.writes = writeContinuation }
        await withTaskGroup(of: Void.self) { group in
            group.addTask { [self] in
                for await job in writes { await self.perform(job) }
            }
            await driver.run()
            writeContinuation.finish()
            group.cancelAll()
        }
        state.withLock { $0.writes = nil }
        self.driver.withLock { $0 = nil }
        continuation.finish()
    }

    /// Registration ended: every subscription ends with it (bluetoothd forgets them).
    private func lost(_ reason: BlueZRegistrationEndReason) {
        let ended = state.withLock { s -> [(Int, LocalGATTSubscription, AcquiredSocket?)] in
            var ended: [(Int, LocalGATTSubscription, AcquiredSocket?)] = []
            for index in s.characteristics.indices {
                if s.characteristics[index].notifying {
                    s.characteristics[index].notifying = false
                    ended.append((index, .startNotify, nil))
                }
                if let socket = s.characteristics[index].notifySocket {
                    s.characteristics[index].notifySocket = nil
                    ended.append((index, .acquireNotify, socket))
                }
                s.characteristics[index].writeSocket?.close()
                s.characteristics[index].writeSocket = nil
            }
            return ended
        }
        for (index, via, socket) in ended {
            socket?.close()
            continuation.yield(.unsubscribed(characteristicID: entries[index].characteristic.id, via: via))
        }
        continuation.yield(.unregistered(reason: reason))
        if reason != .cancelled, let server = driver.withLock({ $0?.server }) {
            for entry in entries {
                let c = entry.characteristic
                let interface = BlueZName.characteristic
                if c.flags.allowsNotify {
                    server.setProperty(at: entry.path, interface: interface, "Notifying", .boolean(false))
                }
                if c.offersAcquireNotify {
                    server.setProperty(at: entry.path, interface: interface, "NotifyAcquired", .boolean(false))
                }
                if c.offersAcquireWrite {
                    server.setProperty(at: entry.path, interface: interface, "WriteAcquired", .boolean(false))
                }
            }
        }
    }

    // MARK: the exported tree

    private func export(on connection: DBusConnection) -> DBusObjectServer {
        let server = DBusObjectServer(connection: connection, objectManagerPath: root, propertyErrors: .bluez)
        let serviceSpec = DBusInterfaceSpec(
            BlueZName.gattService,
            properties: [
                DBusPropertySpec("UUID", "s"), DBusPropertySpec("Primary", "b"), DBusPropertySpec("Includes", "ao"),
            ])
        for (i, service) in services.enumerated() {
            server.addInterfaces(
                at: servicePaths[i],
                [
                    (
                        serviceSpec,
                        [
                            "UUID": .string(bluezUUIDString(service.uuid) ?? service.uuid),
                            "Primary": .boolean(service.primary), "Includes": .objectPathArray([]),
                        ]
                    )
                ])
        }
        let snapshot = state.withLock { $0.characteristics }
        for (index, entry) in entries.enumerated() {
            let c = entry.characteristic
            var values: [String: DBusValue] = [
                "UUID": .string(entry.uuid), "Service": .objectPath(entry.servicePath),
                "Flags": .stringArray(c.flags.bluezStrings), "Value": .bytes(snapshot[index].value),
            ]
            if c.flags.allowsNotify { values["Notifying"] = .boolean(false) }
            if c.offersAcquireNotify { values["NotifyAcquired"] = .boolean(false) }
            if c.offersAcquireWrite { values["WriteAcquired"] = .boolean(false) }
            server.addInterfaces(at: entry.path, [(characteristicSpec(index), values)])
            for (k, descriptor) in c.descriptors.enumerated() {
                server.addInterfaces(
                    at: entry.descriptorPaths[k],
                    [
                        (
                            descriptorSpec(index, k),
                            [
                                "UUID": .string(bluezUUIDString(descriptor.uuid) ?? descriptor.uuid),
                                "Characteristic": .objectPath(entry.path),
                                "Flags": .stringArray(descriptor.flags.bluezStrings),
                                "Value": .bytes(snapshot[index].descriptorValues[k]),
                            ]
                        )
                    ])
            }
        }
        return server
    }

    private func characteristicSpec(_ index: Int) -> DBusInterfaceSpec {
        let c = entries[index].characteristic
        var methods: [DBusMethodSpec] = [
            DBusMethodSpec(
                "ReadValue", in: "a{sv}", out: "ay", argumentNames: ["options"], resultNames: ["value"],
                acceptingAnySignature: true
            ) { [weak self] call in self?.read(call, index, nil) ?? .error(Self.gone) },
            DBusMethodSpec(
                "WriteValue", in: "aya{sv}", argumentNames: ["value", "options"], acceptingAnySignature: true
            ) { [weak self] call in self?.write(call, index, nil) ?? .error(Self.gone) },
            DBusMethodSpec("StartNotify", acceptingAnySignature: true) { [weak self] call in
                self?.startNotify(call, index) ?? .error(Self.gone)
            },
            DBusMethodSpec("StopNotify", acceptingAnySignature: true) { [weak self] call in
                self?.stopNotify(call, index) ?? .error(Self.gone)
            },
            DBusMethodSpec("Confirm", acceptingAnySignature: true) { [weak self] _ in
                self?.confirmed(index)
                return .reply([])
            },
        ]
        if c.offersAcquireNotify {
            methods.append(
                DBusMethodSpec(
                    "AcquireNotify", in: "a{sv}", out: "hq", argumentNames: ["options"], resultNames: ["fd", "mtu"],
                    acceptingAnySignature: true
                ) { [weak self] call in self?.acquireNotify(call, index) ?? .error(Self.gone) })
        }
        if c.offersAcquireWrite {
            methods.append(
                DBusMethodSpec(
                    "AcquireWrite", in: "a{sv}", out: "hq", argumentNames: ["options"], resultNames: ["fd", "mtu"],
                    acceptingAnySignature: true
                ) { [weak self] call in self?.acquireWrite(call, index) ?? .error(Self.gone) })
        }
        var properties = [
            DBusPropertySpec("UUID", "s"), DBusPropertySpec("Service", "o"), DBusPropertySpec("Flags", "as"),
            DBusPropertySpec("Value", "ay"),
        ]
        if c.flags.allowsNotify { properties.append(DBusPropertySpec("Notifying", "b")) }
        if c.offersAcquireNotify { properties.append(DBusPropertySpec("NotifyAcquired", "b")) }
        if c.offersAcquireWrite { properties.append(DBusPropertySpec("WriteAcquired", "b")) }
        return DBusInterfaceSpec(BlueZName.characteristic, methods: methods, properties: properties)
    }

    private func descriptorSpec(_ index: Int, _ k: Int) -> DBusInterfaceSpec {
        DBusInterfaceSpec(
            BlueZName.descriptor,
            methods: [
                DBusMethodSpec(
                    "ReadValue", in: "a{sv}", out: "ay", argumentNames: ["options"], resultNames: ["value"],
                    acceptingAnySignature: true
                ) { [weak self] call in self?.read(call, index, k) ?? .error(Self.gone) },
                DBusMethodSpec(
                    "WriteValue", in: "aya{sv}", argumentNames: ["value", "options"], acceptingAnySignature: true
                ) { [weak self] call in self?.write(call, index, k) ?? .error(Self.gone) },
            ],
            properties: [
                DBusPropertySpec("UUID", "s"), DBusPropertySpec("Characteristic", "o"),
                DBusPropertySpec("Flags", "as"), DBusPropertySpec("Value", "ay"),
            ])
    }

    static let gone = DBusError(name: "org.bluez.Error.Failed", message: "the application is gone")

    static func invalidArguments(_ call: DBusMethodCall, expected: String) -> DBusMethodOutcome {
        .error(
            DBusError(
                name: "org.bluez.Error.InvalidArguments",
                message: "\(call.member) takes (\(expected)), got (\(call.message.signature.rawValue))"))
    }

    // MARK: method handlers (on the connection's I/O thread; none blocks)

    /// The options dictionary: known keys of the right type; others are ignored. Nil when it is not an a{sv}.
    struct Options {
        var offset = 0
        var device: String?
        var mtu: UInt16?
        var link: String?
        var type: LocalGATTWriteType?
        var prepareAuthorize = false

        init?(_ value: DBusValue?) {
            guard let value, value.signature.rawValue == "a{sv}", let dict = value.stringVariantDictionary else {
                return nil
            }
            if let offset = dict["offset"]?.uint16 { self.offset = Int(offset) }
            device = dict["device"]?.objectPath?.rawValue
            mtu = dict["mtu"]?.uint16
            link = dict["link"]?.string
            type = dict["type"]?.string.flatMap(LocalGATTWriteType.init(rawValue:))
            prepareAuthorize = dict["prepare-authorize"]?.bool ?? false
        }
    }

    private func read(_ call: DBusMethodCall, _ index: Int, _ k: Int?) -> DBusMethodOutcome {
        guard call.message.signature.rawValue == "a{sv}", let options = Options(call.arguments.first) else {
            return Self.invalidArguments(call, expected: "a{sv}")
        }
        let entry = entries[index]
        let flags = k.map { entry.characteristic.descriptors[$0].flags } ?? entry.characteristic.flags
        guard flags.allowsRead else { return .error(LocalGATTError.notPermitted.dbusError) }
        let value = state.withLock { s in
            k.map { s.characteristics[index].descriptorValues[$0] } ?? s.characteristics[index].value
        }
        guard options.offset <= value.count else { return .error(LocalGATTError.invalidOffset.dbusError) }
        noteCentral(options.device)
        continuation.yield(
            .read(
                device: options.device, characteristicID: entry.characteristic.id,
                descriptorUUID: k.flatMap { bluezUUIDString(entry.characteristic.descriptors[$0].uuid) }))
        return .reply([.bytes(Array(value[options.offset...]))])
    }

    private func write(_ call: DBusMethodCall, _ index: Int, _ k: Int?) -> DBusMethodOutcome {
        guard call.message.signature.rawValue == "aya{sv}", let bytes = call.arguments.first?.bytes,
            let options = Options(call.arguments.last)
        else { return Self.invalidArguments(call, expected: "aya{sv}") }
        let entry = entries[index]
        let type = options.type ?? (call.message.noReplyExpected ? .command : .request)
        if let k {
            guard entry.characteristic.descriptors[k].flags.allowsRequestOrAny else {
                return .error(LocalGATTError.notPermitted.dbusError)
            }
        } else {
            let flags = entry.characteristic.flags
            let allowed: Bool
            switch type {
            case .command: allowed = flags.allowsWrite
            case .request: allowed = flags.allowsWrite
            case .reliable: allowed = flags.contains(.reliableWrite) || flags.allowsWriteRequest
            }
            guard allowed else { return .error(LocalGATTError.notPermitted.dbusError) }
        }
        let current = state.withLock { s in
            k.map { s.characteristics[index].descriptorValues[$0] } ?? s.characteristics[index].value
        }
        guard options.offset <= current.count else { return .error(LocalGATTError.invalidOffset.dbusError) }
        noteCentral(options.device)
        let job = WriteJob(
            write: LocalGATTWrite(
                characteristicID: entry.characteristic.id, characteristicUUID: entry.uuid,
                descriptorUUID: k.flatMap { bluezUUIDString(entry.characteristic.descriptors[$0].uuid) },
                bytes: bytes, offset: options.offset, type: type, device: options.device, mtu: options.mtu,
                link: options.link, prepareAuthorize: options.prepareAuthorize),
            index: index, descriptorIndex: k, reply: call.reply)
        guard let writes = state.withLock({ $0.writes }), case .enqueued = writes.yield(job) else {
            return .error(LocalGATTError.failed("the application is stopping").dbusError)
        }
        return .deferred
    }

    /// Runs the write handler for one write and answers it (on the application's write task).
    private func perform(_ job: WriteJob) async {
        let result = await writeHandler(job.write)
        switch result {
        case .reject(let error):
            job.reply?.fail(error.dbusError)
            return
        case .accept where !job.write.prepareAuthorize:
            store(job)
        case .accept, .acceptWithoutStoring:
            break
        }
        job.reply?.succeed([])
        let w = job.write
        // Authorising a prepared write is not yet a write: the execute comes later.
        guard !w.prepareAuthorize else { return }
        continuation.yield(
            .write(
                device: w.device, characteristicID: w.characteristicID, descriptorUUID: w.descriptorUUID,
                bytes: w.bytes, type: w.type))
    }

    private func store(_ job: WriteJob) {
        let index = job.index
        let offset = job.write.offset
        let (value, subscribed) = state.withLock { s -> ([UInt8], Bool) in
            var current =
                job.descriptorIndex.map { s.characteristics[index].descriptorValues[$0] }
                ?? s.characteristics[index].value
            current = Array(current.prefix(offset)) + job.write.bytes
            if let k = job.descriptorIndex {
                s.characteristics[index].descriptorValues[k] = current
            } else {
                s.characteristics[index].value = current
            }
            let c = s.characteristics[index]
            return (current, c.notifying || c.notifySocket != nil)
        }
        guard let server = driver.withLock({ $0?.server }) else { return }
        if let k = job.descriptorIndex {
            server.setProperty(
                at: entries[index].descriptorPaths[k], interface: BlueZName.descriptor, "Value", .bytes(value))
        } else if !subscribed {
            // While a central is subscribed, bluetoothd would send a change of Value out as a notification: a
            // central's own write is not echoed (the application calls setValue to notify).
            server.setProperty(at: entries[index].path, interface: BlueZName.characteristic, "Value", .bytes(value))
        }
    }

    private func startNotify(_ call: DBusMethodCall, _ index: Int) -> DBusMethodOutcome {
        guard call.arguments.isEmpty else { return Self.invalidArguments(call, expected: "") }
        let c = entries[index].characteristic
        guard c.flags.allowsNotify else { return .error(LocalGATTError.notSupported.dbusError) }
        let started = state.withLock { s -> Bool? in
            if s.characteristics[index].notifySocket != nil { return nil }
            if s.characteristics[index].notifying { return false }
            s.characteristics[index].notifying = true
            return true
        }
        switch started {
        case nil:
            return .error(
                DBusError(name: "org.bluez.Error.NotPermitted", message: "Notify acquired (AcquireNotify)"))
        case false?:
            return .reply([])
        case true?:
            driver.withLock { $0?.server }?.setProperty(
                at: entries[index].path, interface: BlueZName.characteristic, "Notifying", .boolean(true))
            continuation.yield(.subscribed(characteristicID: c.id, via: .startNotify, device: nil))
            return .reply([])
        }
    }

    private func stopNotify(_ call: DBusMethodCall, _ index: Int) -> DBusMethodOutcome {
        guard call.arguments.isEmpty else { return Self.invalidArguments(call, expected: "") }
        let c = entries[index].characteristic
        guard c.flags.allowsNotify else { return .error(LocalGATTError.notSupported.dbusError) }
        let stopped = state.withLock { s -> Bool in
            guard s.characteristics[index].notifying else { return false }
            s.characteristics[index].notifying = false
            return true
        }
        if stopped {
            driver.withLock { $0?.server }?.setProperty(
                at: entries[index].path, interface: BlueZName.characteristic, "Notifying", .boolean(false))
            continuation.yield(.unsubscribed(characteristicID: c.id, via: .startNotify))
        }
        return .reply([])
    }

    private func confirmed(_ index: Int) {
        state.withLock { $0.characteristics[index].confirmations += 1 }
        continuation.yield(.confirmed(characteristicID: entries[index].characteristic.id))
    }

    private func acquireNotify(_ call: DBusMethodCall, _ index: Int) -> DBusMethodOutcome {
        guard call.arguments.count == 1, let options = Options(call.arguments.first) else {
            return Self.invalidArguments(call, expected: "a{sv}")
        }
        if state.withLock({ $0.characteristics[index].notifying }) {
            return .error(DBusError(name: "org.bluez.Error.NotPermitted", message: "Notifying (StartNotify)"))
        }
        guard let (socket, remote) = AcquiredSocket.pair() else {
            return .error(LocalGATTError.failed("socketpair: \(String(cString: strerror(errno)))").dbusError)
        }
        let id = entries[index].characteristic.id
        let started = socket.watch { [weak self, weak socket] event in
            guard let self, let socket else { return }
            switch event {
            case .data(let bytes):
                // bluetoothd writes 0x01 for each indication confirmation.
                for _ in bytes { self.confirmed(index) }
            case .closed:
                self.notifySocketClosed(index, socket)
            }
        }
        guard started else {
            socket.close()
            return .error(LocalGATTError.failed("cannot watch the notification socket").dbusError)
        }
        let previous = state.withLock { s -> AcquiredSocket? in
            let previous = s.characteristics[index].notifySocket
            s.characteristics[index].notifySocket = socket
            return previous
        }
        previous?.close()
        noteCentral(options.device)
        driver.withLock { $0?.server }?.setProperty(
            at: entries[index].path, interface: BlueZName.characteristic, "NotifyAcquired", .boolean(true))
        if previous == nil {
            continuation.yield(.subscribed(characteristicID: id, via: .acquireNotify, device: options.device))
        }
        return .reply([.unixFD(remote), .uint16(options.mtu ?? 23)])
    }

    private func notifySocketClosed(_ index: Int, _ socket: AcquiredSocket) {
        let was = state.withLock { s -> Bool in
            guard s.characteristics[index].notifySocket === socket else { return false }
            s.characteristics[index].notifySocket = nil
            return true
        }
        socket.close()
        guard was else { return }
        driver.withLock { $0?.server }?.setProperty(
            at: entries[index].path, interface: BlueZName.characteristic, "NotifyAcquired", .boolean(false))
        continuation.yield(.unsubscribed(characteristicID: entries[index].characteristic.id, via: .acquireNotify))
    }

    private func acquireWrite(_ call: DBusMethodCall, _ index: Int) -> DBusMethodOutcome {
        guard call.arguments.count == 1, let options = Options(call.arguments.first) else {
            return Self.invalidArguments(call, expected: "a{sv}")
        }
        guard let (socket, remote) = AcquiredSocket.pair() else {
            return .error(LocalGATTError.failed("socketpair: \(String(cString: strerror(errno)))").dbusError)
        }
        let entry = entries[index]
        let base = LocalGATTWrite(
            characteristicID: entry.characteristic.id, characteristicUUID: entry.uuid, descriptorUUID: nil, bytes: [],
            offset: 0, type: .command, device: options.device, mtu: options.mtu, link: options.link,
            prepareAuthorize: false)
        let started = socket.watch { [weak self, weak socket] event in
            guard let self, let socket else { return }
            switch event {
            case .data(let bytes):
                var write = base
                write.bytes = bytes
                if let writes = self.state.withLock({ $0.writes }) {
                    writes.yield(WriteJob(write: write, index: index, descriptorIndex: nil, reply: nil))
                }
            case .closed:
                self.writeSocketClosed(index, socket)
            }
        }
        guard started else {
            socket.close()
            return .error(LocalGATTError.failed("cannot watch the write socket").dbusError)
        }
        let previous = state.withLock { s -> AcquiredSocket? in
            let previous = s.characteristics[index].writeSocket
            s.characteristics[index].writeSocket = socket
            return previous
        }
        previous?.close()
        noteCentral(options.device)
        driver.withLock { $0?.server }?.setProperty(
            at: entry.path, interface: BlueZName.characteristic, "WriteAcquired", .boolean(true))
        return .reply([.unixFD(remote), .uint16(options.mtu ?? 23)])
    }

    private func writeSocketClosed(_ index: Int, _ socket: AcquiredSocket) {
        let was = state.withLock { s -> Bool in
            guard s.characteristics[index].writeSocket === socket else { return false }
            s.characteristics[index].writeSocket = nil
            return true
        }
        socket.close()
        guard was else { return }
        driver.withLock { $0?.server }?.setProperty(
            at: entries[index].path, interface: BlueZName.characteristic, "WriteAcquired", .boolean(false))
    }

    // MARK: centrals

    /// A device named in a call's options: reported connected once, then followed through `Device1.Connected`.
    private func noteCentral(_ device: String?) {
        guard let device else { return }
        let tree = client.tree
        let address = tree.device(at: device)?.address ?? Self.address(fromDevicePath: device)
        let connected = tree.device(at: device)?.connected ?? true
        guard connected else { return }
        let isNew = state.withLock { s -> Bool in
            guard s.centrals[device] == nil else { return false }
            s.centrals[device] = address
            return true
        }
        if isNew { continuation.yield(.centralConnected(address: address, device: device)) }
    }

    private func treeEvent(_ event: BlueZTreeEvent, _ tree: BlueZObjectTree) {
        var gone: [(String, String)] = []
        switch event {
        case .propertiesChanged(let path, let interface, let changed, _):
            guard interface == BlueZName.device, changed["Connected"]?.bool == false else { return }
            state.withLock { s in
                if let address = s.centrals.removeValue(forKey: path) { gone.append((address, path)) }
            }
        case .interfacesRemoved(let path, let interfaces, _):
            guard interfaces.contains(BlueZName.device) else { return }
            state.withLock { s in
                if let address = s.centrals.removeValue(forKey: path) { gone.append((address, path)) }
            }
        case .daemonLost:
            state.withLock { s in
                gone = s.centrals.sorted { $0.key < $1.key }.map { ($0.value, $0.key) }
                s.centrals = [:]
            }
        default:
            return
        }
        for (address, path) in gone { continuation.yield(.centralDisconnected(address: address, device: path)) }
    }

    /// `/org/bluez/hci0/dev_AA_BB_CC_DD_EE_FF` -> `AA:BB:CC:DD:EE:FF` (the path itself when it has no such part).
    static func address(fromDevicePath path: String) -> String {
        guard let last = path.split(separator: "/").last, last.hasPrefix("dev_") else { return path }
        return last.dropFirst(4).replacingOccurrences(of: "_", with: ":").uppercased()
    }
}

extension LocalGATTFlags {
    /// Descriptors: any write flag.
    var allowsRequestOrAny: Bool {
        !isDisjoint(with: [.write, .encryptWrite, .encryptAuthenticatedWrite, .secureWrite, .writableAuxiliaries])
    }
}

extension Substring {
    fileprivate func replacingOccurrences(of target: Character, with replacement: String) -> String {
        var out = ""
        for character in self { if character == target { out += replacement } else { out.append(character) } }
        return out
    }
}

/// One end of a SOCK_SEQPACKET socket pair handed to bluetoothd by `AcquireNotify`/`AcquireWrite`.
///
/// Sends happen under the socket's own lock (never the application's); the reading side is a duplicate descriptor
/// watched by the shared reader thread, so closing never races a handler.
final class AcquiredSocket: Sendable {
    enum Event: Sendable {
        case data([UInt8])
        case closed
    }
    private let fd: Mutex<Int32>
    private let watched = Mutex<Int32>(-1)

    private init(fd: Int32) { self.fd = Mutex(fd) }

    /// Our end and the remote end (for the reply).
    static func pair() -> (AcquiredSocket, DBusFileDescriptor)? {
        var fds: [Int32] = [-1, -1]
        let type = Int32(SOCK_SEQPACKET.rawValue) | Int32(SOCK_CLOEXEC.rawValue)
        guard socketpair(AF_UNIX, type, 0, &fds) == 0 else { return nil }
        return (AcquiredSocket(fd: fds[0]), DBusFileDescriptor(owning: fds[1]))
    }

    /// Reads on the shared reader thread: each datagram, then `.closed` once at the end.
    func watch(_ handler: @escaping @Sendable (Event) -> Void) -> Bool {
        let copy = fd.withLock { $0 >= 0 ? dup($0) : -1 }
        guard copy >= 0 else { return false }
        _ = fcntl(copy, F_SETFD, FD_CLOEXEC)
        _ = fcntl(copy, F_SETFL, fcntl(copy, F_GETFL) | O_NONBLOCK)
        let ended = Atomic<Bool>(false)
        // Recorded before the reader can run the handler, so that its end-of-stream removal finds it.
        watched.withLock { $0 = copy }
        let added = NotifySocketReader.shared.add(copy) { [weak self] in
            var buffer = [UInt8](repeating: 0, count: 1024)
            while !ended.load(ordering: .relaxed) {
                let n = buffer.withUnsafeMutableBytes { recv(copy, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT)) }
                if n > 0 {
                    handler(.data(Array(buffer[0..<n])))
                    continue
                }
                if n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) { return }
                // 0: the peer closed its end (bluetoothd releases it); an error: the same for us.
                if !ended.exchange(true, ordering: .relaxed) {
                    self?.stopWatching()
                    handler(.closed)
                }
                return
            }
        }
        guard added else {
            watched.withLock { $0 = -1 }
            Glibc.close(copy)
            return false
        }
        return true
    }

    /// Sends one datagram; waits up to one second for room. False when it could not be sent.
    func send(_ bytes: [UInt8]) -> Bool {
        fd.withLock { fd -> Bool in
            guard fd >= 0 else { return false }
            let deadline = ContinuousClock.now + .seconds(1)
            while true {
                let n = bytes.withUnsafeBytes {
                    Glibc.send(fd, $0.baseAddress, $0.count, Int32(MSG_DONTWAIT) | Int32(MSG_NOSIGNAL))
                }
                if n >= 0 { return true }
                guard errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR else { return false }
                let left = deadline - .now
                if left <= .zero { return false }
                var p = pollfd(fd: fd, events: Int16(POLLOUT), revents: 0)
                _ = poll(&p, 1, Int32(max(1, min(left.components.seconds * 1000 + 1, 100))))
            }
        }
    }

    /// Unregisters the reading copy (the reader closes it); once only, so a reused descriptor number is never
    /// removed by mistake.
    private func stopWatching() {
        let copy = watched.withLock { value -> Int32 in
            defer { value = -1 }
            return value
        }
        if copy >= 0 { NotifySocketReader.shared.remove(copy) }
    }

    /// Closes our end (bluetoothd sees HUP) and stops watching. Idempotent.
    func close() {
        stopWatching()
        fd.withLock { value in
            if value >= 0 { Glibc.close(value) }
            value = -1
        }
    }

    deinit { close() }
}
