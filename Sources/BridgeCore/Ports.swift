// The ports the bridge core owns: what it needs from BLE, from MQTT and from time. Adapters over BlueZ and MQTT
// implement them in BridgeAdapters; tests implement them in memory.
import GATT
import Logging
import Synchronization

// MARK: Addresses

/// A Bluetooth device address, parsed once (`A4:C1:38:12:34:56`, stored upper-case).
public struct BLEAddress: Hashable, Sendable, Comparable, CustomStringConvertible {
    /// Upper-case, colon-separated.
    public let text: String

    /// Parses six ASCII hex octets separated by `:`; nil for anything else.
    public init?(_ text: String) {
        let parts = text.split(separator: ":", omittingEmptySubsequences: false)
        guard parts.count == 6,
            parts.allSatisfy({ $0.utf8.count == 2 && $0.utf8.allSatisfy { isASCIIHexDigit($0) } })
        else { return nil }
        self.text = text.uppercased()
    }

    /// Lower-case hex without colons (`a4c138123456`): the stable id of a device without a name.
    public var compact: String { text.lowercased().filter { $0 != ":" } }

    /// The address as printed.
    public var description: String { text }

    /// Orders by text.
    public static func < (lhs: BLEAddress, rhs: BLEAddress) -> Bool { lhs.text < rhs.text }
}

func isASCIIHexDigit(_ byte: UInt8) -> Bool {
    (byte >= 0x30 && byte <= 0x39) || (byte >= 0x41 && byte <= 0x46) || (byte >= 0x61 && byte <= 0x66)
}

// MARK: BLE central

/// One advertisement (or a change to what a device advertises), as the bridge sees it.
public struct BLEAdvertisement: Sendable, Equatable {
    /// Who advertised.
    public var address: BLEAddress
    /// The adapter that heard it (`hci0`).
    public var adapter: String
    /// The advertised local name.
    public var name: String?
    /// Signal strength in dBm, when known.
    public var rssi: Int?
    /// Advertised TX power in dBm.
    public var txPower: Int?
    /// Advertised service UUIDs.
    public var serviceUUIDs: [BluetoothUUID]
    /// Service data by UUID.
    public var serviceData: [BluetoothUUID: [UInt8]]
    /// Manufacturer data by company id.
    public var manufacturerData: [UInt16: [UInt8]]

    /// An advertisement.
    public init(
        address: BLEAddress, adapter: String, name: String? = nil, rssi: Int? = nil, txPower: Int? = nil,
        serviceUUIDs: [BluetoothUUID] = [], serviceData: [BluetoothUUID: [UInt8]] = [:],
        manufacturerData: [UInt16: [UInt8]] = [:]
    ) {
        self.address = address
        self.adapter = adapter
        self.name = name
        self.rssi = rssi
        self.txPower = txPower
        self.serviceUUIDs = serviceUUIDs
        self.serviceData = serviceData
        self.manufacturerData = manufacturerData
    }
}

/// An adapter (`hci0`).
public struct BLEAdapterInfo: Sendable, Hashable {
    /// Its name (`hci0`).
    public var name: String
    /// Its address.
    public var address: String
    /// Whether it is powered.
    public var powered: Bool

    /// An adapter.
    public init(name: String, address: String, powered: Bool) {
        self.name = name
        self.address = address
        self.powered = powered
    }
}

/// What happens on the BLE side besides connections.
public enum BLECentralEvent: Sendable, Equatable {
    /// A device advertised (or its advertised data changed).
    case advertisement(BLEAdvertisement)
    /// BlueZ forgot a device (expired from its cache, or removed).
    case deviceRemoved(BLEAddress, adapter: String)
    /// An adapter appeared (or was powered on).
    case adapterAdded(BLEAdapterInfo)
    /// An adapter disappeared (or was powered off).
    case adapterRemoved(String)
    /// bluetoothd appeared on the bus.
    case bluetoothdStarted
    /// bluetoothd left the bus.
    case bluetoothdStopped
}

/// How to scan.
public struct BLEScanRequest: Sendable, Equatable {
    /// Only advertisers of these services (empty: everything).
    public var serviceUUIDs: [BluetoothUUID]
    /// Passive scanning (no scan requests).
    public var passive: Bool
    /// Report every advertisement, not only changes.
    public var duplicateData: Bool
    /// Adapters to scan on (names or addresses); empty: every adapter.
    public var adapters: [String]

    /// A scan request.
    public init(
        serviceUUIDs: [BluetoothUUID] = [], passive: Bool = false, duplicateData: Bool = true, adapters: [String] = []
    ) {
        self.serviceUUIDs = serviceUUIDs
        self.passive = passive
        self.duplicateData = duplicateData
        self.adapters = adapters
    }
}

/// A BLE failure, classified for the bridge's retry policy, with BlueZ's own error name where there is one.
public struct BLEError: Error, Sendable, Equatable, CustomStringConvertible {
    /// What kind of failure (decides the backoff).
    public enum Kind: String, Sendable, Hashable {
        /// The device is not known to BlueZ (not seen, or expired).
        case notFound = "not-found"
        /// `le-connection-abort-by-local`: the link came up and was dropped at once; retried soon.
        case connectionAborted = "connection-aborted"
        /// Connect failed for another reason.
        case connectFailed = "connect-failed"
        /// Too many connections on the adapter.
        case noSlots = "no-slots"
        /// The operation timed out.
        case timeout
        /// The device is not connected.
        case notConnected = "not-connected"
        /// The peer or BlueZ refused.
        case notPermitted = "not-permitted"
        /// Not supported by the characteristic.
        case notSupported = "not-supported"
        /// The link dropped during the operation.
        case disconnected
        /// bluetoothd is not running.
        case bluetoothdUnavailable = "bluetoothd-unavailable"
        /// No adapter, or it is off.
        case adapterUnavailable = "adapter-unavailable"
        /// Something we passed was wrong.
        case invalidArgument = "invalid-argument"
        /// The operation was cancelled.
        case cancelled
        /// Anything else.
        case failed
    }

    /// The class of failure.
    public var kind: Kind
    /// BlueZ's D-Bus error name (`org.bluez.Error.Failed`), when BlueZ answered with one.
    public var name: String?
    /// The full text: what happened, to which device, and BlueZ's message.
    public var message: String

    /// A failure.
    public init(_ kind: Kind, name: String? = nil, message: String) {
        self.kind = kind
        self.name = name
        self.message = message
    }

    /// The message.
    public var description: String { message }

    /// The short name published in results (`org.bluez.Error.NotPermitted`, or the kind).
    public var errorName: String { name ?? kind.rawValue }
}

/// A GATT characteristic of a connected device.
public struct BLECharacteristic: Sendable, Hashable {
    /// An opaque id (BlueZ's object path).
    public var id: String
    /// The characteristic UUID.
    public var uuid: BluetoothUUID
    /// The UUID of its service.
    public var serviceUUID: BluetoothUUID
    /// BlueZ's flags (`read`, `write`, `write-without-response`, `notify`, `indicate`, ...).
    public var flags: Set<String>
    /// The 0x2904 presentation format descriptor's value, when it has one.
    public var presentationFormat: [UInt8]?

    /// A characteristic.
    public init(
        id: String, uuid: BluetoothUUID, serviceUUID: BluetoothUUID, flags: Set<String>,
        presentationFormat: [UInt8]? = nil
    ) {
        self.id = id
        self.uuid = uuid
        self.serviceUUID = serviceUUID
        self.flags = flags
        self.presentationFormat = presentationFormat
    }

    /// Readable.
    public var canRead: Bool { flags.contains("read") }
    /// Writable with response.
    public var canWrite: Bool { flags.contains("write") || flags.contains("reliable-write") }
    /// Writable without response.
    public var canWriteWithoutResponse: Bool { flags.contains("write-without-response") }
    /// Notifies or indicates.
    public var canNotify: Bool { flags.contains("notify") || flags.contains("indicate") }
}

/// Why a link ended.
public struct BLEDisconnection: Sendable, Equatable, CustomStringConvertible {
    /// True when we asked for it (then the bridge does not reconnect).
    public var requested: Bool
    /// What BlueZ said (`org.bluez.Reason.Timeout`, `connection timeout`).
    public var reason: String

    /// A disconnection.
    public init(requested: Bool, reason: String) {
        self.requested = requested
        self.reason = reason
    }

    /// The reason.
    public var description: String { reason }
}

/// Notification values of one characteristic; ends (with an error) when the link or the subscription ends.
public typealias BLENotificationStream = AsyncThrowingStream<[UInt8], any Error>

/// What `BLELink.watchDisconnection(_:)` and `BLELink.subscribe(_:deliver:ended:)` return: `cancel()`, or
/// dropping the watch, stops what it watches (a subscription ends; a handler is no longer called).
public final class BLEWatch: Sendable {
    private let stop: Mutex<(@Sendable () -> Void)?>

    /// A watch that runs `cancel` once, when cancelled or dropped.
    public init(cancel: @escaping @Sendable () -> Void) {
        stop = Mutex(cancel)
    }

    /// Stops it (once).
    public func cancel() {
        let run = stop.withLock { current -> (@Sendable () -> Void)? in
            defer { current = nil }
            return current
        }
        run?()
    }

    deinit { cancel() }
}

/// A connected device.
public protocol BLELink: AnyObject, Sendable {
    /// The device.
    var address: BLEAddress { get }
    /// The adapter the link is on.
    var adapter: String { get }
    /// Every characteristic, services resolved.
    var characteristics: [BLECharacteristic] { get }
    /// Reads a value.
    func read(_ characteristic: BLECharacteristic) async throws(BLEError) -> [UInt8]
    /// Writes a value, with response (request) or without (command).
    func write(_ characteristic: BLECharacteristic, _ value: [UInt8], withResponse: Bool) async throws(BLEError)
    /// Subscribes to notifications or indications.
    func notifications(_ characteristic: BLECharacteristic) async throws(BLEError) -> BLENotificationStream
    /// Subscribes and hands every value to `deliver`, in order (`deliver` must not block), and calls `ended` once
    /// when the subscription ends by itself (nil: it finished; else its error, a `BLEError` of kind `.disconnected`
    /// when the link went). Cancelling or dropping the returned watch stops the subscription (`ended` may still be
    /// told of it). The default relays `notifications(_:)` through a task; an adapter that can hand values over on
    /// the thread that received them, and say when a subscription ends, needs none.
    func subscribe(
        _ characteristic: BLECharacteristic, deliver: @escaping @Sendable ([UInt8]) -> Void,
        ended: @escaping @Sendable ((any Error)?) -> Void
    ) async throws(BLEError) -> BLEWatch
    /// Waits until the link ends and says why.
    func waitForDisconnection() async -> BLEDisconnection
    /// Calls `handler` once when the link ends, with why (at once when it has already ended), until the returned
    /// watch is cancelled or dropped. The default waits in a task (`waitForDisconnection()`); an adapter that is
    /// told of the end needs none.
    func watchDisconnection(_ handler: @escaping @Sendable (BLEDisconnection) -> Void) -> BLEWatch
    /// Disconnects on purpose (the bridge will not reconnect because of it).
    func disconnect() async
}

extension BLELink {
    /// Relays `notifications(_:)` to `deliver` through a task, which reports the end.
    public func subscribe(
        _ characteristic: BLECharacteristic, deliver: @escaping @Sendable ([UInt8]) -> Void,
        ended: @escaping @Sendable ((any Error)?) -> Void
    ) async throws(BLEError) -> BLEWatch {
        let values = try await notifications(characteristic)
        let relay = Task {
            do {
                for try await value in values { deliver(value) }
                if !Task.isCancelled { ended(nil) }
            } catch {
                if !Task.isCancelled { ended(error) }
            }
        }
        return BLEWatch { relay.cancel() }
    }

    /// Waits for `waitForDisconnection()` in a task.
    public func watchDisconnection(_ handler: @escaping @Sendable (BLEDisconnection) -> Void) -> BLEWatch {
        let watcher = Task {
            let d = await waitForDisconnection()
            if !Task.isCancelled { handler(d) }
        }
        return BLEWatch { watcher.cancel() }
    }
}

extension BLECentral {
    /// Scan results come through `events()`.
    public func deliverScanResults(to deliver: @escaping @Sendable (BLECentralEvent) -> Void) {}
}

/// The BLE central the bridge drives.
public protocol BLECentral: AnyObject, Sendable {
    /// Starts (connects to bluetoothd) and returns the adapters there are now.
    func start() async throws(BLEError) -> [BLEAdapterInfo]
    /// Events from now on. The bridge is the only consumer.
    func events() -> AsyncStream<BLECentralEvent>
    /// The adapters there are now.
    func adapters() -> [BLEAdapterInfo]
    /// Starts (or changes) scanning.
    func startScanning(_ request: BLEScanRequest) async throws(BLEError)
    /// Hands scan results (`.advertisement`, `.deviceRemoved`) to `deliver` instead of `events()`: on the thread
    /// that received them, one at a time and in order, with no task hop per advertisement (`deliver` must not
    /// block). Takes effect for scans started afterwards. The default does nothing, and scan results keep coming
    /// through `events()`.
    func deliverScanResults(to deliver: @escaping @Sendable (BLECentralEvent) -> Void)
    /// Stops scanning.
    func stopScanning() async
    /// Connects, resolves services and reads presentation formats.
    func connect(_ address: BLEAddress, adapter: String, timeout: Duration) async throws(BLEError) -> any BLELink
    /// Makes BlueZ forget a device.
    func removeDevice(_ address: BLEAddress, adapter: String) async throws(BLEError)
    /// The devices connected now on any adapter. Asked at start, before this process connects anything: links an
    /// earlier run made (bluetoothd keeps a link when the client that made it goes away, so after a crash the device
    /// does not advertise and would never be seen again).
    func connectedDevices() -> [BLEAdvertisement]
    /// Disconnects such a device (one this process holds no link for).
    func disconnect(_ address: BLEAddress, adapter: String) async throws(BLEError)
    /// Stops everything.
    func close() async
}

// MARK: MQTT

/// A message the bridge publishes.
public struct BridgeOutgoingMessage: Sendable, Equatable {
    /// The topic.
    public var topic: String
    /// The payload.
    public var payload: [UInt8]
    /// QoS 0, 1 or 2.
    public var qos: Int
    /// Retained.
    public var retain: Bool
    /// MQTT 5 correlation data for a response.
    public var correlationData: [UInt8]?

    /// A message.
    public init(topic: String, payload: [UInt8], qos: Int = 1, retain: Bool = false, correlationData: [UInt8]? = nil) {
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.correlationData = correlationData
    }

    /// A message with a text payload.
    public init(topic: String, text: String, qos: Int = 1, retain: Bool = false) {
        self.init(topic: topic, payload: Array(text.utf8), qos: qos, retain: retain)
    }

    /// The payload as text.
    public var text: String { String(decoding: payload, as: UTF8.self) }
}

/// A message the bridge received.
public struct BridgeIncomingMessage: Sendable, Equatable {
    /// The topic.
    public var topic: String
    /// The payload.
    public var payload: [UInt8]
    /// Retained (sent at subscription time).
    public var retain: Bool
    /// MQTT 5 response topic.
    public var responseTopic: String?
    /// MQTT 5 correlation data.
    public var correlationData: [UInt8]?

    /// A message.
    public init(
        topic: String, payload: [UInt8], retain: Bool = false, responseTopic: String? = nil,
        correlationData: [UInt8]? = nil
    ) {
        self.topic = topic
        self.payload = payload
        self.retain = retain
        self.responseTopic = responseTopic
        self.correlationData = correlationData
    }
}

/// The broker connection's state.
public enum BridgeTransportState: Sendable, Equatable {
    /// Connecting (or waiting to retry).
    case connecting
    /// Connected.
    case connected
    /// Not connected; why.
    case disconnected(reason: String)
}

/// A publish the transport refused at once (bad topic, payload too large, shut down).
public struct BridgeTransportError: Error, Sendable, Equatable, CustomStringConvertible {
    /// What happened.
    public var description: String
    /// An error.
    public init(_ description: String) { self.description = description }
}

/// Counters of the broker connection.
public struct BridgeTransportStatistics: Sendable, Equatable {
    /// Messages published (handed to the broker connection).
    public var published: Int = 0
    /// Messages received.
    public var received: Int = 0
    /// Messages waiting for the broker.
    public var queued: Int = 0
    /// Messages dropped (offline queue full).
    public var dropped: Int = 0
    /// Counters.
    public init(published: Int = 0, received: Int = 0, queued: Int = 0, dropped: Int = 0) {
        self.published = published
        self.received = received
        self.queued = queued
        self.dropped = dropped
    }
}

/// The MQTT side the bridge drives. The will (`bridge/state` offline) is set up by whoever makes the transport.
public protocol MQTTTransport: AnyObject, Sendable {
    /// Publishes without waiting: sent now, or queued (bounded) while the broker is away.
    func publish(_ message: BridgeOutgoingMessage) throws(BridgeTransportError)
    /// Subscribes (kept across reconnects).
    func subscribe(_ filter: String) async throws(BridgeTransportError)
    /// Received messages from now on. The bridge is the only consumer.
    func incoming() -> AsyncStream<BridgeIncomingMessage>
    /// Connection states: the current one first.
    func states() -> AsyncStream<BridgeTransportState>
    /// Counters.
    var statistics: BridgeTransportStatistics { get }
}

extension MQTTTransport {
    /// Subscribes to every filter at once, each waiting for its own acknowledgement, and returns when all have
    /// answered: one round trip to the broker, not one per filter. A filter that fails goes to `failed`; the others
    /// are made all the same.
    func subscribe(all filters: [String], failed: @escaping @Sendable (String, BridgeTransportError) -> Void) async {
        await withTaskGroup(of: Void.self) { group in
            for filter in filters {
                group.addTask {
                    do throws(BridgeTransportError) {
                        try await self.subscribe(filter)
                    } catch {
                        failed(filter, error)
                    }
                }
            }
        }
    }
}

// MARK: Time

/// Time, so tests can run a day of backoff in a millisecond.
public protocol BridgeClock: Sendable {
    /// Monotonic time since an arbitrary origin.
    var now: Duration { get }
    /// Wall-clock time, seconds since 1970 (for `last_seen`).
    var wallClock: Double { get }
    /// Sleeps until `deadline` (on the `now` scale). Throws `CancellationError` when the task is cancelled.
    func sleep(until deadline: Duration) async throws
}

extension BridgeClock {
    /// Sleeps for `duration`.
    public func sleep(for duration: Duration) async throws { try await sleep(until: now + duration) }
}
