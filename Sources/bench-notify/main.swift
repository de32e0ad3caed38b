// bench-notify: how many notifications per second one libdbus client receives from bluez-sim over the StartNotify
// path (PropertiesChanged Value signals), how many are lost, and what each costs the simulator in CPU time.
import DBus
import Dispatch

#if canImport(Glibc)
    import Glibc
#endif

struct Options {
    var busAddress: String?
    var device = "F1:E2:D3:C4:B5:A6"
    var uuid = "6e400003-b5a3-f393-e0a9-e50e24dcca9e"
    var count = 100_000
    var simPID: Int32?
}

func fail(_ text: String) -> Never {
    var line = "bench-notify: " + text + "\n"
    _ = line.withUTF8 { write(2, $0.baseAddress, $0.count) }
    exit(1)
}

func parseOptions() -> Options {
    var o = Options()
    var args = CommandLine.arguments.dropFirst()
    while let a = args.popFirst() {
        guard let v = args.popFirst() else { fail("\(a) needs a value") }
        switch a {
        case "--bus": o.busAddress = v
        case "--device": o.device = v.uppercased()
        case "--uuid": o.uuid = v.lowercased()
        case "--count":
            guard let n = Int(v), (1...Int(UInt32.max)).contains(n) else {
                fail("--count: '\(v)' is not a positive count")
            }
            o.count = n
        case "--sim-pid":
            guard let pid = Int32(v), pid > 0 else { fail("--sim-pid: '\(v)' is not a process id") }
            o.simPID = pid
        default: fail("unknown option \(a) (options: --bus ADDR --device MAC --uuid UUID --count N --sim-pid PID)")
        }
    }
    return o
}

/// utime + stime of a process in seconds, from /proc/<pid>/stat.
func cpuSeconds(_ pid: Int32) -> Double? {
    let fd = open("/proc/\(pid)/stat", O_RDONLY)
    guard fd >= 0 else { return nil }
    defer { close(fd) }
    var buffer = [UInt8](repeating: 0, count: 4096)
    let n = buffer.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
    guard n > 0 else { return nil }
    let text = String(decoding: buffer[0..<n], as: UTF8.self)
    guard let close = text.lastIndex(of: ")") else { return nil }
    let fields = text[text.index(after: close)...].split(separator: " ")
    // fields[0] is state (field 3); utime is field 14, stime field 15.
    guard fields.count > 13, let u = Double(fields[11]), let s = Double(fields[12]) else { return nil }
    return (u + s) / Double(sysconf(Int32(_SC_CLK_TCK)))
}

func now() -> Double {
    var ts = timespec()
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return Double(ts.tv_sec) + Double(ts.tv_nsec) / 1e9
}

let options = parseOptions()
let bus: DBusBus = options.busAddress.map { .address($0) } ?? .system
let connection: DBusConnection
do { connection = try DBusConnection(bus) } catch { fail("cannot connect to the bus: \(error)") }

let devicePath = DBusObjectPath(stringLiteral: "/org/bluez/hci0/dev_" + options.device.replacingColons())

extension String {
    func replacingColons() -> String { String(map { $0 == ":" ? "_" : $0 }) }
}

@discardableResult
func bluez(
    _ path: DBusObjectPath, _ interface: String, _ method: String, _ args: [DBusValue] = [],
    timeout: Duration = .seconds(25)
) async throws(DBusError) -> [DBusValue] {
    try await connection.call(
        destination: "org.bluez", path: path, interface: interface, method: method,
        arguments: args, timeout: timeout)
}

func property(_ path: DBusObjectPath, _ interface: String, _ name: String) async -> DBusValue? {
    try? await bluez(path, "org.freedesktop.DBus.Properties", "Get", [.string(interface), .string(name)]).first
}

do {
    // Scan until the device object exists, then connect and wait for the services.
    try await bluez("/org/bluez/hci0", "org.bluez.Adapter1", "StartDiscovery")
    var seen = false
    for _ in 0..<300 {
        if await property(devicePath, "org.bluez.Device1", "Address") != nil {
            seen = true
            break
        }
        try? await Task.sleep(for: .milliseconds(10))
    }
    guard seen else { fail("device \(options.device) not found while scanning") }
    try await bluez(devicePath, "org.bluez.Device1", "Connect")
    for _ in 0..<500 {
        if await property(devicePath, "org.bluez.Device1", "ServicesResolved")?.bool == true { break }
        try? await Task.sleep(for: .milliseconds(10))
    }
    try await bluez("/org/bluez/hci0", "org.bluez.Adapter1", "StopDiscovery")

    // Find the characteristic by UUID.
    let objects = try await bluez("/", "org.freedesktop.DBus.ObjectManager", "GetManagedObjects")
    var charPath: DBusObjectPath?
    for entry in objects.first?.dictionaryEntries ?? [] {
        guard let path = entry.key.objectPath, path.rawValue.hasPrefix(devicePath.rawValue + "/") else { continue }
        for iface in entry.value.dictionaryEntries ?? [] where iface.key.string == "org.bluez.GattCharacteristic1" {
            if iface.value.stringVariantDictionary?["UUID"]?.string == options.uuid { charPath = path }
        }
    }
    guard let charPath else { fail("characteristic \(options.uuid) not found on \(options.device)") }

    let stream = try await connection.signals(
        matching: DBusMatchRule(
            type: .signal, sender: "org.bluez", interface: "org.freedesktop.DBus.Properties",
            member: "PropertiesChanged", path: charPath))
    try await bluez(charPath, "org.bluez.GattCharacteristic1", "StartNotify")

    let total = options.count
    let cpuBefore = options.simPID.flatMap(cpuSeconds)
    let start = now()
    let burst = Task {
        try await bluez(
            "/org/bluez/sim", "io.blebridge.Simulator1", "Burst",
            [.string(options.device), .string(options.uuid), .uint32(UInt32(total))], timeout: .seconds(120))
    }
    var received = 0
    var outOfOrder = 0
    var expected: UInt32 = 0
    var last = start
    let watchdog = Task {
        try await Task.sleep(for: .seconds(60))
        connection.close()
    }
    for try await message in stream {
        guard message.body.count >= 2, message.body[0].string == "org.bluez.GattCharacteristic1",
            let value = message.body[1].stringVariantDictionary?["Value"]?.bytes, value.count == 4
        else { continue }
        let seq = UInt32(value[0]) | UInt32(value[1]) << 8 | UInt32(value[2]) << 16 | UInt32(value[3]) << 24
        if seq != expected { outOfOrder += 1 }
        expected = seq &+ 1
        received += 1
        last = now()
        if received == total { break }
    }
    watchdog.cancel()
    let sent = (try? await burst.value)?.first?.uint32 ?? 0
    let cpuAfter = options.simPID.flatMap(cpuSeconds)
    let seconds = last - start
    let rate = Double(received) / max(seconds, 1e-9)
    print("bench-notify: StartNotify path, one libdbus client, \(total) notifications requested")
    print("  sent by simulator:   \(sent)")
    print("  received:            \(received)")
    print("  lost:                \(Int(sent) - received)")
    print("  out of order:        \(outOfOrder)")
    print("  elapsed:             \(String(format3(seconds))) s")
    print("  rate:                \(Int(rate)) notifications/s")
    if let a = cpuBefore, let b = cpuAfter {
        print(
            "  simulator CPU:       \(format3(b - a)) s = \(format3((b - a) / Double(max(received, 1)) * 1e6)) µs/notification"
        )
    }
    _ = try? await bluez(charPath, "org.bluez.GattCharacteristic1", "StopNotify")
    _ = try? await bluez(devicePath, "org.bluez.Device1", "Disconnect")
    connection.close()
    exit(received == total && Int(sent) == total ? 0 : 1)
} catch {
    fail("\(error)")
}

func format3(_ v: Double) -> String {
    let scaled = (v * 1000).rounded()
    let whole = Int(scaled) / 1000
    let frac = abs(Int(scaled) % 1000)
    let f = String(frac)
    return "\(whole).\(String(repeating: "0", count: 3 - f.count))\(f)"
}
