// The peripheral role's advertising: an org.bluez.LEAdvertisement1 object registered with
// LEAdvertisingManager1 (doc/org.bluez.LEAdvertisement.rst, doc/org.bluez.LEAdvertisingManager.rst). bluetoothd
// follows PropertiesChanged of the properties it parses (src/advertising.c), so updates need no re-registration.
import DBus
import Synchronization

/// What to advertise (the `LEAdvertisement1` properties).
public struct LocalAdvertisementData: Sendable, Hashable {
    /// `Type`.
    public enum Kind: String, Sendable, Hashable {
        /// Not connectable.
        case broadcast
        /// Connectable.
        case peripheral
    }

    /// `Type`.
    public var type: Kind
    /// `ServiceUUIDs` (any form ``bluezUUIDString(_:)`` takes).
    public var serviceUUIDs: [String]
    /// `ManufacturerData`: company identifier -> bytes.
    public var manufacturerData: [UInt16: [UInt8]]
    /// `ServiceData`: UUID -> bytes.
    public var serviceData: [String: [UInt8]]
    /// `LocalName` (bluetoothd puts it in the scan response).
    public var localName: String?
    /// `Appearance`.
    public var appearance: UInt16?
    /// `Includes`: what bluetoothd adds itself (`tx-power`, `appearance`, `local-name`).
    public var includes: [String]
    /// `Discoverable`: adds the general-discoverable AD flag.
    public var discoverable: Bool?
    /// `MinInterval` (sent in whole milliseconds; BlueZ 5.63 and later).
    public var minInterval: Duration?
    /// `MaxInterval` (whole milliseconds; BlueZ 5.63 and later).
    public var maxInterval: Duration?
    /// `TxPower`: the requested transmit power in dBm (BlueZ 5.63 and later).
    public var txPower: Int16?

    /// An advertisement description.
    public init(
        type: Kind = .peripheral, serviceUUIDs: [String] = [], manufacturerData: [UInt16: [UInt8]] = [:],
        serviceData: [String: [UInt8]] = [:], localName: String? = nil, appearance: UInt16? = nil,
        includes: [String] = [], discoverable: Bool? = nil, minInterval: Duration? = nil,
        maxInterval: Duration? = nil, txPower: Int16? = nil
    ) {
        self.type = type
        self.serviceUUIDs = serviceUUIDs
        self.manufacturerData = manufacturerData
        self.serviceData = serviceData
        self.localName = localName
        self.appearance = appearance
        self.includes = includes
        self.discoverable = discoverable
        self.minInterval = minInterval
        self.maxInterval = maxInterval
        self.txPower = txPower
    }

    /// The most a legacy advertising PDU (or scan response) carries.
    public static let legacyMaximumLength = 31

    /// The length of the advertising data bluetoothd builds from this description (src/advertising.c with
    /// src/shared/ad.c): AD flags (3 bytes for a peripheral or when discoverable), Appearance (4), TX power
    /// (3, when included), each UUID list (2 + size per UUID, 16-bit where the UUID is on the Bluetooth base),
    /// each manufacturer data field (4 + length), each service data field (2 + UUID size + length). The local
    /// name goes in the scan response (``legacyScanResponseLength``).
    public var legacyAdvertisingLength: Int {
        var length = 0
        if type == .peripheral || discoverable == true { length += 3 }
        if appearance != nil || includes.contains("appearance") { length += 4 }
        if includes.contains("tx-power") { length += 3 }
        let sizes = serviceUUIDs.compactMap(Self.uuidSize)
        for size in [2, 4, 16] {
            let count = sizes.filter { $0 == size }.count
            if count > 0 { length += 2 + size * count }
        }
        for (_, bytes) in manufacturerData { length += 4 + bytes.count }
        for (uuid, bytes) in serviceData { length += 2 + (Self.uuidSize(uuid) ?? 16) + bytes.count }
        return length
    }

    /// The length of the scan response: the local name field (2 + its UTF-8 length), 0 without a name. A name
    /// included with `local-name` is the adapter's, not known here, and not counted.
    public var legacyScanResponseLength: Int { localName.map { 2 + $0.utf8.count } ?? 0 }

    /// Checks that the description fits legacy advertising (31 bytes each for the data and the scan response).
    /// Longer data makes bluetoothd switch to extended advertising, which many scanners do not see.
    /// - Throws: `BlueZError.invalidArgument` naming the lengths.
    public func checkLegacyLength() throws(BlueZError) {
        let data = legacyAdvertisingLength
        let scan = legacyScanResponseLength
        if data > Self.legacyMaximumLength {
            throw .invalidArgument(
                "advertisement: the advertising data takes \(data) bytes, more than the \(Self.legacyMaximumLength) "
                    + "of legacy advertising (remove service UUIDs or data, or shorten them)")
        }
        if scan > Self.legacyMaximumLength {
            throw .invalidArgument(
                "advertisement: the local name takes \(scan) bytes of the scan response, more than "
                    + "\(Self.legacyMaximumLength) (use at most \(Self.legacyMaximumLength - 2) bytes of UTF-8)")
        }
    }

    /// 2, 4 or 16 bytes; nil for what is not a UUID.
    static func uuidSize(_ text: String) -> Int? {
        guard let full = bluezUUIDString(text) else { return nil }
        guard full.hasSuffix("-0000-1000-8000-00805f9b34fb") else { return 16 }
        return full.hasPrefix("0000") ? 2 : 4
    }

    /// The property values, wrapped as `LEAdvertisement1` declares them; absent ones are left out.
    var properties: [String: DBusValue] {
        var values: [String: DBusValue] = ["Type": .string(type.rawValue)]
        if !serviceUUIDs.isEmpty {
            values["ServiceUUIDs"] = .stringArray(serviceUUIDs.map { bluezUUIDString($0) ?? $0 })
        }
        if !manufacturerData.isEmpty {
            values["ManufacturerData"] = .dictionary(
                key: "q", value: "v",
                manufacturerData.sorted { $0.key < $1.key }.map {
                    DBusDictEntry(key: .uint16($0.key), value: .variant(.bytes($0.value)))
                })
        }
        if !serviceData.isEmpty {
            values["ServiceData"] = .stringVariantDictionary(
                serviceData.map { (bluezUUIDString($0.key) ?? $0.key, DBusValue.bytes($0.value)) }.sorted {
                    $0.0 < $1.0
                })
        }
        if let localName { values["LocalName"] = .string(localName) }
        if let appearance { values["Appearance"] = .uint16(appearance) }
        if !includes.isEmpty { values["Includes"] = .stringArray(includes) }
        if let discoverable { values["Discoverable"] = .boolean(discoverable) }
        if let minInterval { values["MinInterval"] = .uint32(Self.milliseconds(minInterval)) }
        if let maxInterval { values["MaxInterval"] = .uint32(Self.milliseconds(maxInterval)) }
        if let txPower { values["TxPower"] = .int16(txPower) }
        return values
    }

    static func milliseconds(_ duration: Duration) -> UInt32 {
        let (seconds, attoseconds) = duration.components
        let ms = seconds * 1000 + attoseconds / 1_000_000_000_000_000
        return UInt32(clamping: max(0, ms))
    }

    static let propertySpecs: [DBusPropertySpec] = [
        DBusPropertySpec("Type", "s"), DBusPropertySpec("ServiceUUIDs", "as"),
        DBusPropertySpec("ManufacturerData", "a{qv}"), DBusPropertySpec("ServiceData", "a{sv}"),
        DBusPropertySpec("LocalName", "s"), DBusPropertySpec("Appearance", "q"), DBusPropertySpec("Includes", "as"),
        DBusPropertySpec("Discoverable", "b"), DBusPropertySpec("MinInterval", "u"),
        DBusPropertySpec("MaxInterval", "u"), DBusPropertySpec("TxPower", "n"),
    ]
}

/// Something that happened to a ``BlueZAdvertisement``.
public enum LocalAdvertisementEvent: Sendable, Hashable {
    /// Registered with `LEAdvertisingManager1` on `adapter`.
    case registered(adapter: BlueZAdapter)
    /// No longer registered (`.released` when bluetoothd called `Release`); it registers again unless cancelled.
    case unregistered(reason: BlueZRegistrationEndReason)
    /// A registration attempt failed; it is retried.
    case registrationFailed(BlueZRegistrationFailure)
}

/// The events of an advertisement: the newest 256 are kept when the consumer falls behind. Ends when `run()`
/// returns.
public struct LocalAdvertisementEvents: AsyncSequence, Sendable {
    /// Each event.
    public typealias Element = LocalAdvertisementEvent
    let base: AsyncStream<LocalAdvertisementEvent>

    /// Iterates the events.
    public struct AsyncIterator: AsyncIteratorProtocol {
        var base: AsyncStream<LocalAdvertisementEvent>.AsyncIterator
        /// The next event; nil once the advertisement stopped.
        public mutating func next() async -> LocalAdvertisementEvent? { await base.next() }
    }

    /// An iterator.
    public func makeAsyncIterator() -> AsyncIterator { AsyncIterator(base: base.makeAsyncIterator()) }
}

/// An LE advertisement published through bluetoothd.
///
/// Call ``run()`` in a task: it registers on the selected adapter, registers again after `Release`, a bluetoothd
/// restart, bus loss or the adapter coming back, and unregisters (`UnregisterAdvertisement`) when cancelled.
/// ``update(_:)`` changes the properties in place. Safe from any task.
public final class BlueZAdvertisement: Sendable {
    /// The object path of the `LEAdvertisement1` object.
    public let path: String
    /// The advertisement's events.
    public let events: LocalAdvertisementEvents

    let objectPath: DBusObjectPath
    let root: DBusObjectPath
    let client: BlueZClient
    let selector: BlueZAdapterSelector
    let current: Mutex<LocalAdvertisementData>
    let continuation: AsyncStream<LocalAdvertisementEvent>.Continuation
    let driver: Mutex<LocalRegistrationDriver?> = Mutex(nil)
    let releases = Atomic<Int>(0)

    private static let counter = Atomic<Int>(0)

    /// Describes an advertisement; nothing is exported until ``run()``.
    /// - Parameters:
    ///   - client: the started client whose bus and mirror it uses.
    ///   - data: what to advertise (check ``LocalAdvertisementData/checkLegacyLength()`` first for legacy PDUs).
    ///   - adapter: where.
    /// - Throws: `BlueZError.invalidArgument` for a service UUID or service data key that is not a UUID.
    public init(client: BlueZClient, data: LocalAdvertisementData, adapter: BlueZAdapterSelector = .any)
        throws(BlueZError)
    {
        try Self.validate(data)
        self.client = client
        self.selector = adapter
        let n = Self.counter.add(1, ordering: .relaxed).newValue
        root = DBusObjectPath(stringLiteral: "/io/blebridge/adv\(n)")
        objectPath = root.appending("advertisement0")
        path = objectPath.rawValue
        current = Mutex(data)
        let (stream, continuation) = AsyncStream<LocalAdvertisementEvent>.makeStream(
            bufferingPolicy: .bufferingNewest(256))
        events = LocalAdvertisementEvents(base: stream)
        self.continuation = continuation
    }

    deinit { continuation.finish() }

    private static func validate(_ data: LocalAdvertisementData) throws(BlueZError) {
        for uuid in data.serviceUUIDs where bluezUUIDString(uuid) == nil {
            throw .invalidArgument("advertisement: service UUID \"\(uuid)\" is not a UUID")
        }
        for uuid in data.serviceData.keys where bluezUUIDString(uuid) == nil {
            throw .invalidArgument("advertisement: service data key \"\(uuid)\" is not a UUID")
        }
        if let name = data.localName, name.utf8.contains(0) {
            throw .invalidArgument("advertisement: the local name contains a NUL character")
        }
    }

    /// What is advertised now.
    public var data: LocalAdvertisementData { current.withLock { $0 } }

    /// How many times bluetoothd called `Release`.
    public var releaseCount: Int { releases.load(ordering: .relaxed) }

    /// Changes what is advertised: changed properties go out in one `PropertiesChanged`, removed ones as
    /// invalidated; bluetoothd follows them without a new registration.
    /// - Throws: `BlueZError.invalidArgument` as `init` does.
    public func update(_ data: LocalAdvertisementData) throws(BlueZError) {
        try Self.validate(data)
        let old = current.withLock { value -> LocalAdvertisementData in
            defer { value = data }
            return value
        }
        guard let server = driver.withLock({ $0?.server }) else { return }
        let before = old.properties
        let after = data.properties
        let path = objectPath
        // On the dispatch thread, where held-back changes are flushed only when it idles: one signal for all.
        server.perform {
            for spec in LocalAdvertisementData.propertySpecs {
                let name = spec.name
                if let value = after[name] {
                    if before[name] != value {
                        server.setProperty(at: path, interface: Self.interface, name, value)
                    }
                } else if before[name] != nil {
                    server.invalidateProperty(at: path, interface: Self.interface, name)
                }
            }
        }
    }

    static let interface = "org.bluez.LEAdvertisement1"

    /// Registers the advertisement and keeps it registered until the calling task is cancelled; then unregisters
    /// it, removes its object, ends ``events`` and returns.
    /// - Throws: `BlueZError.invalidArgument` when it is already running.
    public func run() async throws(BlueZError) {
        let hooks = LocalRegistrationDriver.Hooks(
            managerInterface: "org.bluez.LEAdvertisingManager1", registerMethod: "RegisterAdvertisement",
            unregisterMethod: "UnregisterAdvertisement", objectPath: objectPath, label: "advertisement \(path)",
            export: { [weak self] connection in
                self?.export(on: connection) ?? DBusObjectServer(connection: connection, objectManagerPath: "/")
            },
            registered: { [weak self] adapter in self?.continuation.yield(.registered(adapter: adapter)) },
            unregistered: { [weak self] reason in self?.continuation.yield(.unregistered(reason: reason)) },
            failed: { [weak self] failure in self?.continuation.yield(.registrationFailed(failure)) },
            treeEvent: { _, _ in })
        let driver = LocalRegistrationDriver(client: client, selector: selector, hooks: hooks)
        let claimed = self.driver.withLock { slot -> Bool in
            if slot != nil { return false }
            slot = driver
            return true
        }
        guard claimed, driver.claim() else { throw .invalidArgument("advertisement \(path) is already running") }
        await driver.run()
        self.driver.withLock { $0 = nil }
        continuation.finish()
    }

    private func export(on connection: DBusConnection) -> DBusObjectServer {
        let server = DBusObjectServer(connection: connection, objectManagerPath: root, propertyErrors: .bluez)
        let spec = DBusInterfaceSpec(
            Self.interface,
            methods: [
                DBusMethodSpec("Release", acceptingAnySignature: true) { [weak self] _ in
                    guard let self else { return .reply([]) }
                    self.releases.add(1, ordering: .relaxed)
                    self.client.logger.info("advertisement \(self.path): bluetoothd released it")
                    self.driver.withLock { $0 }?.released()
                    return .reply([])
                }
            ],
            properties: LocalAdvertisementData.propertySpecs)
        server.addInterfaces(at: objectPath, [(spec, data.properties)])
        return server
    }
}
