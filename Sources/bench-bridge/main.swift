// bench-bridge: the second reference client of bench/bridge.sh's passive scenario, in the style of bench-notify: the
// project's own D-Bus layer (the DBus target, as the bridge uses it) subscribed to the same advertisement signals
// (PropertiesChanged of org.bluez.Device1, BlueZ's doc/org.bluez.Device.rst), reading ServiceData and
// ManufacturerData out of each. Its CPU per signal, next to bench/dbus-ref.c's (bare libdbus in C), splits the
// bridge's cost into what the D-Bus layer takes and what the rest of the bridge adds.
//   bench-bridge --bus ADDRESS      runs until SIGTERM/SIGINT, then prints the signals and payload octets it saw
import DBus
import Dispatch
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

func say(_ text: String, to fd: Int32 = 1) {
    var line = "bench-bridge: " + text + "\n"
    _ = line.withUTF8 { write(fd, $0.baseAddress, $0.count) }
}

func fail(_ text: String) -> Never {
    say(text, to: 2)
    exit(1)
}

var address: String?
var arguments = CommandLine.arguments.dropFirst()
while let a = arguments.popFirst() {
    guard let v = arguments.popFirst() else { fail("\(a) needs a value") }
    switch a {
    case "--bus": address = v
    default: fail("unknown option \(a) (options: --bus ADDRESS)")
    }
}
guard let address else { fail("--bus ADDRESS is required") }

let connection: DBusConnection
do { connection = try DBusConnection(.address(address)) } catch { fail("cannot connect to \(address): \(error)") }

// Counted on the D-Bus I/O thread, printed by the signal handler on the main queue.
let signals = Atomic<Int>(0)
let octets = Atomic<Int>(0)

signal(SIGTERM, SIG_IGN)
signal(SIGINT, SIG_IGN)
let stopSources = [SIGTERM, SIGINT].map { number -> any DispatchSourceSignal in
    let source = DispatchSource.makeSignalSource(signal: number, queue: .main)
    source.setEventHandler {
        say("\(signals.load(ordering: .relaxed)) signals, \(octets.load(ordering: .relaxed)) payload octets")
        exit(0)
    }
    source.resume()
    return source
}

do {
    // As the bridge takes them: on the I/O thread as each signal is dispatched (no queue, no task hop), read in
    // place through libdbus's iterator (DBusSignalView), not decoded into values first, and with a rule on header
    // fields only (the bridge's is the sender alone), which the I/O thread checks in place; a rule on arguments (an
    // arg0 of org.bluez.Device1) has the DBus target decode each signal to check it, which the bridge never pays
    // (13 % of this client's CPU when it had one). The interface argument is checked here instead.
    let subscription = try await connection.signals(
        matching: DBusMatchRule(
            type: .signal, sender: "org.bluez", interface: "org.freedesktop.DBus.Properties",
            member: "PropertiesChanged"),
        reader: { signal in
            var arguments = signal.arguments()
            guard arguments.string(equals: "org.bluez.Device1"), var changed = arguments.enter() else { return }
            signals.add(1, ordering: .relaxed)
            var n = 0
            // a{sv}: ServiceData is a{sv} of ay, ManufacturerData a{qv} of ay.
            while var entry = changed.enter() {
                let isData = entry.string(equals: "ServiceData") || entry.string(equals: "ManufacturerData")
                guard isData, var variant = entry.enter(), var dictionary = variant.enter() else { continue }
                while var item = dictionary.enter() {
                    item.skip()
                    if var value = item.enter() { n += value.withBytes { $0.count } ?? 0 }
                }
            }
            octets.add(n, ordering: .relaxed)
        })
    say("ready")
    await connection.waitUntilDisconnected()
    _ = subscription
} catch {
    fail("\(error)")
}
