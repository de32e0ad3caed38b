// bench-adverts: the BlueZ layer's advertisement path as the bridge uses it, for bench/adverts.sh: a BlueZClient
// mirror, one BlueZDiscovery with duplicate data, and every appeared/updated device decoded by the parser registry
// (RuuviTag RAWv2, BTHome v2). Each event is recorded like bench/dbus-ref.c records a signal: CLOCK_MONOTONIC ns,
// the device number (the address's last two octets) and the advertisement's sequence number, so the script can
// count what each client received in the same window and what ours missed.
//   bench-adverts --bus ADDRESS --out FILE     runs until SIGTERM/SIGINT, then writes FILE and exits
//   bench-adverts --bus ADDRESS --out FILE --notify UUID
//       the StartNotify path instead: connects to every device the simulator advertises, subscribes to the
//       characteristic UUID with StartNotify (values from PropertiesChanged(Value), as for an indication), decodes
//       each value with a declarative parser (`seq`: u32le at 0, as bench/bridge-gen.py's bench_seq) and records
//       it with the value's counter as the key
import BlueZ
import Dispatch
import GATT
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

func say(_ text: String, to fd: Int32 = 1) {
    var line = "bench-adverts: " + text + "\n"
    _ = line.withUTF8 { write(fd, $0.baseAddress, $0.count) }
}

func fail(_ text: String) -> Never {
    say(text, to: 2)
    exit(1)
}

var address: String?
var out: String?
var notifyUUID: String?
var arguments = CommandLine.arguments.dropFirst()
while let a = arguments.popFirst() {
    guard let v = arguments.popFirst() else { fail("\(a) needs a value") }
    switch a {
    case "--bus": address = v
    case "--out": out = v
    case "--notify": notifyUUID = v
    default: fail("unknown option \(a) (options: --bus ADDRESS --out FILE [--notify UUID])")
    }
}
guard let address, let out else { fail("--bus ADDRESS and --out FILE are required") }

// Allocation counting: bench/adverts.sh preloads bench/malloc-count.c, which counts malloc/calloc/realloc calls
// and exports blebridge_malloc_count(); without it no allocation figure is printed.
typealias AllocationCounter = @convention(c) () -> UInt

let allocationCounter: AllocationCounter? = {
    guard let symbol = dlsym(nil, "blebridge_malloc_count") else { return nil }
    return unsafeBitCast(symbol, to: AllocationCounter.self)
}()

/// The records, in buffers allocated up front as bench/dbus-ref.c keeps its own: one writer (the thread that
/// delivers events, the D-Bus I/O thread) fills a slot and then publishes it by storing the count with release
/// ordering; the stop handler loads the count with acquire ordering and reads that many. No lock per event (the
/// reference takes none either). An event from any other thread is not recorded but counted, and the run says so.
final class Recorder: @unchecked Sendable {
    static let capacity = 1 << 21
    let t = UnsafeMutablePointer<Int64>.allocate(capacity: capacity)
    let device = UnsafeMutablePointer<Int32>.allocate(capacity: capacity)
    let key = UnsafeMutablePointer<Int32>.allocate(capacity: capacity)
    let count = Atomic<Int>(0)
    let decoded = Atomic<Int>(0)
    let errors = Atomic<Int>(0)
    let foreign = Atomic<Int>(0)
    let writer = Atomic<UInt64>(0)
    /// Allocations when the 1,000th event was recorded (after the start-up's own allocations).
    let baseline = Atomic<UInt>(0)

    func append(_ time: Int64, device number: Int32, key value: Int32, decoded ok: Bool?) {
        let me = UInt64(pthread_self())
        if writer.load(ordering: .relaxed) != me {
            guard writer.compareExchange(expected: 0, desired: me, ordering: .relaxed).exchanged else {
                foreign.wrappingAdd(1, ordering: .relaxed)
                return
            }
        }
        if ok == true { decoded.wrappingAdd(1, ordering: .relaxed) } else if ok == false {
            errors.wrappingAdd(1, ordering: .relaxed)
        }
        let i = count.load(ordering: .relaxed)
        guard i < Self.capacity else { return }
        t[i] = time
        device[i] = number
        key[i] = value
        count.store(i + 1, ordering: .releasing)
        if i + 1 == 1000, let allocations = allocationCounter { baseline.store(allocations(), ordering: .relaxed) }
    }
}
let recorder = Recorder()

@Sendable func nowNS() -> Int64 {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return Int64(ts.tv_sec) * 1_000_000_000 + Int64(ts.tv_nsec)
}

/// The last two octets of `AA:BB:CC:DD:EE:FF` as a number (0xEEFF), like dbus-ref reads them from the path.
@Sendable func deviceNumber(_ address: String) -> Int32 {
    // Read in place from the bytes, as cheaply as dbus-ref reads them from the path.
    var value: Int32 = 0
    var digits = 0
    var count = 0
    for c in address.utf8 {
        count += 1
        guard count > 12 else { continue }
        let d: UInt8
        switch c {
        case UInt8(ascii: "0")...UInt8(ascii: "9"): d = c - UInt8(ascii: "0")
        case UInt8(ascii: "A")...UInt8(ascii: "F"): d = c - UInt8(ascii: "A") + 10
        case UInt8(ascii: "a")...UInt8(ascii: "f"): d = c - UInt8(ascii: "a") + 10
        case UInt8(ascii: ":"): continue
        default: return -1
        }
        value = value << 4 | Int32(d)
        digits += 1
    }
    return count == 17 && digits == 4 ? value : -1
}

signal(SIGTERM, SIG_IGN)
signal(SIGINT, SIG_IGN)
let stopSources = [SIGTERM, SIGINT].map { number -> any DispatchSourceSignal in
    let source = DispatchSource.makeSignalSource(signal: number, queue: .main)
    source.setEventHandler {
        // Every count is taken before the file is written: events keep coming while it is, and writing it
        // allocates (a string per line), which the allocation figure must not include.
        let n = recorder.count.load(ordering: .acquiring)
        let decoded = recorder.decoded.load(ordering: .relaxed)
        let errors = recorder.errors.load(ordering: .relaxed)
        let foreign = recorder.foreign.load(ordering: .relaxed)
        let allocated = allocationCounter?()
        var allocations = ""
        let base = recorder.baseline.load(ordering: .relaxed)
        if let allocated, base > 0, n > 1000 {
            let per = Double(allocated - base) / Double(n - 1000)
            allocations = ", \((per * 10).rounded() / 10) allocations per event"
        }
        guard let f = fopen(out, "w") else { fail("cannot write \(out)") }
        for i in 0..<n { fputs("d \(recorder.t[i]) \(recorder.device[i]) \(recorder.key[i])\n", f) }
        fclose(f)
        say(
            "\(n) events, \(decoded) decoded, \(errors) rejected\(allocations)"
                + (foreign > 0 ? ", \(foreign) not recorded (delivered on another thread)" : ""))
        exit(0)
    }
    source.resume()
    return source
}

let registry: GATTParserRegistry = {
    do { return try GATTParserRegistry.builtIn() } catch { fail("registry: \(error)") }
}()
let ruuvi = AdvertisementSource.manufacturer(0x0499)
let bthome = AdvertisementSource.serviceData(BluetoothUUID(UInt16(0xFCD2)))

/// Decodes `d`'s advertisement as the bridge does (the registry; the sequence number is the decoded
/// measurement_sequence or packet_id) and records it.
@Sendable func record(_ d: BlueZDevice) {
    let t = nowNS()
    var key: Int32 = -1
    var ok: Bool?
    let found: (AdvertisementSource, [UInt8], String)? =
        if let payload = d.manufacturerData[0x0499] {
            (ruuvi, payload, "measurement_sequence")
        } else if let payload = d.serviceData.first(where: { $0.key.lowercased().hasPrefix("0000fcd2") })?.value {
            (bthome, payload, "packet_id")
        } else {
            nil
        }
    if let (source, payload, field) = found {
        do {
            let r = try registry.decode(source, payload, context: AdvertisementContext(mac: d.address))
            if case .int(let s)? = r[field] { key = Int32(truncatingIfNeeded: s) }
            ok = true
        } catch {
            ok = false
        }
    }
    recorder.append(t, device: deviceNumber(d.address), key: key, decoded: ok)
}

/// The StartNotify path's registry: the built-in parsers and bench_seq (`seq`, u32le at 0) for the benchmark's
/// characteristic, as the bridge builds it from its configuration.
func notifyRegistry(_ uuid: String) -> GATTParserRegistry {
    do {
        var r = try GATTParserRegistry.builtIn()
        try r.register(
            DeclarativeParser(
                DeclarativeParserSpec(
                    name: "bench_seq", uuid: uuid, fields: [DeclarativeFieldSpec(name: "seq", type: "u32le", offset: 0)])))
        return r
    } catch {
        fail("registry: \(error)")
    }
}

/// Decodes one notification as the bridge does and records it under `device` with its counter as the key.
@Sendable func recordValue(_ value: [UInt8], device: Int32, uuid: BluetoothUUID, registry: GATTParserRegistry) {
    let t = nowNS()
    var key: Int32 = -1
    let ok: Bool
    do {
        let r = try registry.decode(uuid, value)
        if case .int(let s)? = r["seq"] { key = Int32(truncatingIfNeeded: s & 0x7FFF_FFFF) }
        ok = true
    } catch {
        ok = false
    }
    recorder.append(t, device: device, key: key, decoded: ok)
}

/// Connects to every advertising device that has `uuid` and subscribes to it with StartNotify, each value handed
/// over on the D-Bus I/O thread (the bridge's way); returns the peripherals, which must stay alive.
func startNotifyPath(_ client: BlueZClient, uuid text: String) async throws -> [(BlueZPeripheral, BlueZNotifications)] {
    guard let uuid = BluetoothUUID(text) else { fail("--notify: \(text) is not a UUID") }
    let registry = notifyRegistry(text)
    // Every device the simulator has: scan until the count stops growing.
    var devices: [BlueZDevice] = []
    var scans: [BlueZDiscovery] = []
    for adapter in client.adapters {
        scans.append(try await client.startDiscovery(on: adapter, filter: BlueZDiscoveryFilter()))
    }
    var stable = 0
    while stable < 6 {
        try await Task.sleep(for: .milliseconds(500))
        let now = client.devices()
        stable = now.count == devices.count ? stable + 1 : 0
        devices = now
    }
    for scan in scans { await scan.stop() }
    var peripherals: [(BlueZPeripheral, BlueZNotifications)] = []
    for d in devices.sorted(by: { $0.address < $1.address }) {
        let p = try await client.connect(d)
        guard let c = p.characteristics(uuid: text).first else {
            await p.disconnect()
            continue
        }
        let n = deviceNumber(d.address)
        // Kept: dropping the stream would stop the subscription.
        let values = try await p.notifications(for: c, preferAcquire: false, mapError: { $0 }) { value in
            recordValue(value, device: n, uuid: uuid, registry: registry)
        }
        peripherals.append((p, values))
    }
    say("subscribed to \(peripherals.count) device(s) with StartNotify")
    return peripherals
}

do {
    let client = try BlueZClient(bus: .address(address))
    try await client.start()
    if let notifyUUID {
        let peripherals = try await startNotifyPath(client, uuid: notifyUUID)
        say("ready")
        while true {
            try await Task.sleep(for: .seconds(3600))
            _ = peripherals.count
        }
    }
    guard let adapter = client.adapters.first else { fail("no adapter") }
    // The bridge's way: events handed over on the D-Bus I/O thread as each signal is dispatched.
    let discovery = try await client.startDiscovery(
        on: adapter, filter: BlueZDiscoveryFilter(duplicateData: true)
    ) { event in
        switch event {
        case .appeared(let d), .updated(let d): record(d)
        case .lost: return
        }
    }
    say("ready")
    for await _ in discovery.events {}
} catch {
    fail("\(error)")
}
