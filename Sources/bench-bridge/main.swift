// bench-bridge: the second reference client of bench/bridge.sh's passive scenario, in the style of bench-notify: the
// project's own D-Bus layer (the DBus target, as the bridge uses it) subscribed to the same advertisement signals
// (PropertiesChanged of org.bluez.Device1, BlueZ's doc/org.bluez.Device.rst), reading ServiceData and
// ManufacturerData out of each. Its CPU per signal, next to bench/dbus-ref.c's (bare libdbus in C), splits the
// bridge's cost into what the D-Bus layer takes and what the rest of the bridge adds.
//   bench-bridge --bus ADDRESS      runs until SIGTERM/SIGINT, then prints the signals and payload octets it saw
import DBus
import Dispatch

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

// Counted by the stream loop and printed by the signal handler, both on the main queue.
nonisolated(unsafe) var signals = 0
nonisolated(unsafe) var octets = 0

signal(SIGTERM, SIG_IGN)
signal(SIGINT, SIG_IGN)
let stopSources = [SIGTERM, SIGINT].map { number -> any DispatchSourceSignal in
    let source = DispatchSource.makeSignalSource(signal: number, queue: .main)
    source.setEventHandler {
        say("\(signals) signals, \(octets) payload octets")
        exit(0)
    }
    source.resume()
    return source
}

do {
    let stream = try await connection.signals(
        matching: DBusMatchRule(
            type: .signal, sender: "org.bluez", interface: "org.freedesktop.DBus.Properties",
            member: "PropertiesChanged", arguments: [0: "org.bluez.Device1"]))
    say("ready")
    for try await message in stream {
        guard message.body.count >= 2, message.body[0].string == "org.bluez.Device1",
            let changed = message.body[1].stringVariantDictionary
        else { continue }
        signals += 1
        for key in ["ServiceData", "ManufacturerData"] {
            for entry in changed[key]?.dictionaryEntries ?? [] {
                octets += entry.value.variantValue?.bytes?.count ?? entry.value.bytes?.count ?? 0
            }
        }
    }
} catch {
    fail("\(error)")
}
