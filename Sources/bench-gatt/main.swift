// bench-gatt: decodes per second and heap allocations per decode for Heart Rate Measurement, Temperature
// Measurement and BTHome v2 (plain), on one core. Build in release: `swift build -c release --product bench-gatt`,
// or run bench/gatt.sh.
import GATT

#if canImport(Glibc)
    import Glibc
#endif

// Allocation counting: this executable defines `malloc`, which the dynamic linker binds ahead of glibc's for every
// library (the Swift runtime included); it counts and forwards to glibc's own entry point. Single-threaded use only:
// the count is a plain global so that counting itself never allocates or takes a lock.
@_silgen_name("__libc_malloc")
func libcMalloc(_ size: Int) -> UnsafeMutableRawPointer?

/// Calls to malloc so far.
nonisolated(unsafe) var mallocCount = 0

/// The interposed malloc.
@_cdecl("malloc")
public func countingMalloc(_ size: Int) -> UnsafeMutableRawPointer? {
    mallocCount &+= 1
    return libcMalloc(size)
}

/// Monotonic nanoseconds.
func now() -> UInt64 {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return UInt64(ts.tv_sec) * 1_000_000_000 + UInt64(ts.tv_nsec)
}

struct Case {
    let label: String
    let payload: [UInt8]
    let decode: ([UInt8]) throws -> GATTReading
}

/// Keeps the optimiser from discarding results.
nonisolated(unsafe) var sink = 0

func measure(_ benchCase: Case, seconds: Double) -> (rate: Double, allocations: Double)? {
    // Warm up and check it decodes at all.
    do {
        for _ in 0..<1000 { sink &+= try benchCase.decode(benchCase.payload).fields.count }
    } catch {
        print("\(benchCase.label): decode failed: \(error)")
        return nil
    }
    // Allocations per decode, over a fixed count.
    let countRuns = 100_000
    let before = mallocCount
    for _ in 0..<countRuns { sink &+= (try? benchCase.decode(benchCase.payload).fields.count) ?? 0 }
    let allocations = Double(mallocCount - before) / Double(countRuns)
    // Throughput: batches until the time is up.
    var decodes = 0
    let start = now()
    let deadline = start + UInt64(seconds * 1e9)
    var t = start
    while t < deadline {
        for _ in 0..<10_000 { sink &+= (try? benchCase.decode(benchCase.payload).fields.count) ?? 0 }
        decodes += 10_000
        t = now()
    }
    let rate = Double(decodes) / (Double(t - start) / 1e9)
    return (rate, allocations)
}

func format(_ rate: Double) -> String {
    let millions = (rate / 1e4).rounded() / 100
    return "\(millions) M/s"
}

let seconds = CommandLine.arguments.count > 1 ? Double(CommandLine.arguments[1]) ?? 2 : 2
let registry: GATTParserRegistry
do {
    registry = try GATTParserRegistry.builtIn()
} catch {
    print("registry: \(error)")
    exit(1)
}

let hrm = HeartRateMeasurementParser()
let htm = TemperatureMeasurementParser.measurement
let context = GATTDecodeContext()
var cases: [Case] = [
    Case(label: "heart_rate_measurement uint8, no RR (0055)", payload: [0x00, 0x55]) {
        try hrm.decode($0, context: context)
    },
    Case(label: "heart_rate_measurement uint16 + energy + 3 RR", payload: bytesFromHex("1F0101320101000201FFFF")!) {
        try hrm.decode($0, context: context)
    },
    Case(label: "heart_rate_measurement via registry lookup (0055)", payload: [0x00, 0x55]) {
        try registry.decode(BluetoothUUID(UInt16(0x2A37)), $0)
    },
    Case(label: "temperature_measurement FLOAT °C (006C0100FF)", payload: bytesFromHex("006C0100FF")!) {
        try htm.decode($0, context: context)
    },
    Case(
        label: "temperature_measurement + timestamp + type", payload: bytesFromHex("066C0100FFE7070C190E1E2D01")!
    ) {
        try htm.decode($0, context: context)
    },
]

let bthome = AdvertisementSource.serviceData(BluetoothUUID(UInt16(0xFCD2)))
if registry.parser(for: bthome) != nil {
    let advContext = AdvertisementContext(mac: "A4:C1:38:8D:18:B2")
    cases.append(
        Case(label: "bthome_v2 plain temp+humidity (4002CA0903BF13)", payload: bytesFromHex("4002CA0903BF13")!) {
            try registry.decode(bthome, $0, context: advContext)
        })
} else {
    print("note: no BTHome parser is registered yet (the advertisement parsers are not merged); skipping BTHome v2")
}

print("bench-gatt: \(seconds) s per case, one thread")
for benchCase in cases {
    guard let (rate, allocations) = measure(benchCase, seconds: seconds) else { continue }
    let allocText = (allocations * 100).rounded() / 100
    print("  \(benchCase.label): \(format(rate)) decodes, \(allocText) heap allocations/decode")
}
if sink == 42 { print("") }
