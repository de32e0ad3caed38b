// Files under the state directory (systemd's StateDirectory, /var/lib/blebridge): the bridge's memory, written
// atomically (write, fsync, rename, fsync the directory), and the journal of QoS 1 messages not yet acknowledged.
import BridgeCore
import GATT
import Logging
import MQTT
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

/// Reads a whole file; nil when it does not exist.
func readFile(_ path: String) throws(BridgeTransportError) -> [UInt8]? {
    let fd = open(path, O_RDONLY | O_CLOEXEC)
    if fd < 0 {
        if errno == ENOENT { return nil }
        throw BridgeTransportError("cannot read \(path): \(String(cString: strerror(errno)))")
    }
    defer { close(fd) }
    var out: [UInt8] = []
    var buffer = [UInt8](repeating: 0, count: 65536)
    while true {
        let n = read(fd, &buffer, buffer.count)
        if n < 0 { throw BridgeTransportError("cannot read \(path): \(String(cString: strerror(errno)))") }
        if n == 0 { break }
        out += buffer[0..<n]
    }
    return out
}

/// Writes `bytes` to `path` atomically.
func writeFileAtomically(_ path: String, _ bytes: [UInt8]) throws(BridgeTransportError) {
    let temporary = path + ".tmp"
    let fd = open(temporary, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
    guard fd >= 0 else { throw BridgeTransportError("cannot write \(temporary): \(String(cString: strerror(errno)))") }
    var written = 0
    while written < bytes.count {
        let n = bytes[written...].withUnsafeBytes { write(fd, $0.baseAddress, $0.count) }
        if n <= 0 {
            let why = String(cString: strerror(errno))
            close(fd)
            throw BridgeTransportError("cannot write \(temporary): \(why)")
        }
        written += n
    }
    fsync(fd)
    close(fd)
    guard rename(temporary, path) == 0 else {
        throw BridgeTransportError("cannot rename \(temporary) to \(path): \(String(cString: strerror(errno)))")
    }
    let directory = String(path[..<(path.lastIndex(of: "/") ?? path.startIndex)])
    let dfd = open(directory.isEmpty ? "." : directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
    if dfd >= 0 {
        fsync(dfd)
        close(dfd)
    }
}

/// Moves a file that cannot be read aside (`NAME.corrupt-<unix time>`), so the next start begins clean and the bad
/// one can be looked at.
func setAside(_ path: String) -> String {
    let target = "\(path).corrupt-\(time(nil))"
    rename(path, target)
    return target
}

/// The bridge's memory in `<directory>/state.json`.
public struct FileStateStore: BridgeStateStore {
    /// The file.
    public let path: String

    /// A store in `directory` (which must exist).
    public init(directory: String) { path = directory + "/state.json" }

    /// Reads the state; a file that is not a JSON object is set aside and reported.
    public func load() throws(BridgeTransportError) -> JSONValue? {
        guard let bytes = try readFile(path) else { return nil }
        do {
            let value = try JSONReader.parse(bytes)
            guard case .object = value else { throw JSONParseError(offset: 0, reason: "not a JSON object") }
            return value
        } catch {
            let aside = setAside(path)
            throw BridgeTransportError("the saved state \(path) is corrupt (\(error)); set aside as \(aside)")
        }
    }

    /// Writes the state atomically.
    public func save(_ state: JSONValue) throws(BridgeTransportError) {
        try writeFileAtomically(path, state.bytes)
    }
}

/// A transport that keeps every QoS 1/2 message in a journal until the broker acknowledged it
/// (`mqtt.offline_queue: disk`), so a bridge killed or restarted while the broker is away loses none of them: they
/// are sent again, in order, at the next start.
///
/// The journal (`<directory>/mqtt-journal.jsonl`) has one line per message (`{"seq":N,"topic":...,"payload":"<hex>",
/// "qos":1,"retain":false}`) and one per acknowledgement (`{"ack":N}`). Lines reach the kernel with every message
/// (a killed process loses nothing) and the disk with an fsync every second.
public final class DiskQueuedTransport: MQTTTransport {
    let base: MQTTBrokerTransport
    let path: String
    let logger: Logger
    struct State {
        var fd: Int32 = -1
        var next: UInt64 = 1
        var pending: Set<UInt64> = []
        var lines = 0
        var dirty = false
    }
    let state = Mutex(State())

    /// Opens (and replays) the journal in `directory`.
    public init(base: MQTTBrokerTransport, directory: String, logger: Logger) {
        self.base = base
        path = directory + "/mqtt-journal.jsonl"
        self.logger = logger.labelled(component: "mqtt")
        replay()
    }

    deinit {
        let fd = state.withLock { $0.fd }
        if fd >= 0 {
            fsync(fd)
            close(fd)
        }
    }

    /// Sends what the last run left unacknowledged, then starts a fresh journal holding just those.
    func replay() {
        var entries: [(UInt64, BridgeOutgoingMessage)] = []
        var acked: Set<UInt64> = []
        do {
            if let bytes = try readFile(path) {
                for line in bytes.split(separator: UInt8(ascii: "\n")) {
                    guard let v = try? JSONReader.parse(Array(line)) else { continue }  // a torn last line
                    if case .int(let n)? = v["ack"] {
                        acked.insert(UInt64(clamping: n))
                    } else if case .int(let n)? = v["seq"], let topic = v["topic"]?.string,
                        let payload = v["payload"]?.string.flatMap(bytesFromHex)
                    {
                        var qos = 1
                        if case .int(let q)? = v["qos"] { qos = Int(clamping: q) }
                        entries.append(
                            (
                                UInt64(clamping: n),
                                BridgeOutgoingMessage(
                                    topic: topic, payload: payload, qos: qos, retain: v["retain"] == .bool(true))
                            ))
                    }
                }
            }
        } catch {
            logger.warning("\(error); the journal is set aside as \(setAside(path))")
        }
        let unsent = entries.filter { !acked.contains($0.0) }
        let fd = open(path + ".new", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0o600)
        state.withLock { $0.fd = fd }
        if fd < 0 {
            logger.error(
                "cannot open the MQTT journal \(path): \(String(cString: strerror(errno))); QoS 1 messages are kept in memory only"
            )
        } else {
            rename(path + ".new", path)
        }
        for (_, message) in unsent { try? publish(message) }
        if !unsent.isEmpty {
            logger.info(
                "sending \(unsent.count) QoS 1 message\(unsent.count == 1 ? "" : "s") the last run could not deliver")
        }
    }

    func append(_ line: String) {
        state.withLock { s in
            guard s.fd >= 0 else { return }
            var text = line
            text.append("\n")
            _ = text.withCString { write(s.fd, $0, strlen($0)) }
            s.lines += 1
            s.dirty = true
        }
    }

    /// Journals a QoS 1/2 message, publishes it, and journals its acknowledgement when the broker sends it.
    public func publish(_ message: BridgeOutgoingMessage) throws(BridgeTransportError) {
        guard message.qos > 0 else { return try base.publish(message) }
        let seq = state.withLock { s -> UInt64 in
            defer { s.next += 1 }
            s.pending.insert(s.next)
            return s.next
        }
        append(
            JSONValue.object([
                ("seq", .int(Int64(seq))), ("topic", .string(message.topic)),
                ("payload", .string(hexString(message.payload))), ("qos", .int(Int64(message.qos))),
                ("retain", .bool(message.retain)),
            ]).text)
        let delivery = try base.sendTracked(message)
        Task { [weak self] in
            guard (try? await delivery.acknowledged()) != nil, let self else { return }
            self.state.withLock { _ = $0.pending.remove(seq) }
            self.append("{\"ack\":\(seq)}")
            self.compactIfWorthIt()
        }
    }

    /// Rewrites the journal with only the pending messages once it is mostly acknowledgements.
    func compactIfWorthIt() {
        let (lines, pending) = state.withLock { ($0.lines, $0.pending.count) }
        guard lines > 20_000, pending < lines / 10 else { return }
        // Simplest safe compaction: start a new journal when nothing is pending.
        guard pending == 0 else { return }
        state.withLock { s in
            guard s.fd >= 0 else { return }
            ftruncate(s.fd, 0)
            lseek(s.fd, 0, SEEK_SET)
            s.lines = 0
        }
    }

    /// fsync when something was written (called every second by the daemon).
    public func sync() {
        state.withLock { s in
            if s.dirty, s.fd >= 0 {
                fsync(s.fd)
                s.dirty = false
            }
        }
    }

    /// Subscribes.
    public func subscribe(_ filter: String) async throws(BridgeTransportError) { try await base.subscribe(filter) }
    /// Received messages.
    public func incoming() -> AsyncStream<BridgeIncomingMessage> { base.incoming() }
    /// Connection states.
    public func states() -> AsyncStream<BridgeTransportState> { base.states() }
    /// Counters; `queued` includes what the journal holds.
    public var statistics: BridgeTransportStatistics {
        var s = base.statistics
        s.queued = max(s.queued, state.withLock { $0.pending.count })
        return s
    }
}
