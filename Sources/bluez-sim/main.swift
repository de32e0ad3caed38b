// bluez-sim: serves a simulated bluetoothd (org.bluez) on the system bus, or on a private bus it spawns.
import BlueZSimulator
import DBus
import Signals

#if canImport(Glibc)
    import Glibc
#endif

// SIGTERM and SIGINT are taken by one thread from the start (see Sources/Signals).
ProcessSignals.install()

let usage = """
    usage: bluez-sim --scenario FILE [--spawn-bus] [--verbose]
      --scenario FILE  the simulated world (YAML or JSON, see config/SCENARIO.md)
      --spawn-bus      start a private dbus-daemon, print DBUS_SYSTEM_BUS_ADDRESS=... first, stop it on exit
      --verbose        log every method call to stderr
    Without --spawn-bus, serves org.bluez on the bus named by DBUS_SYSTEM_BUS_ADDRESS (or the system bus).
    """

var scenarioPath: String?
var spawnBus = false
var verbose = false
var arguments = CommandLine.arguments.dropFirst()
while let argument = arguments.popFirst() {
    switch argument {
    case "--scenario":
        guard let value = arguments.popFirst() else {
            writeErrorLine("bluez-sim: --scenario needs a file\n\(usage)")
            exit(2)
        }
        scenarioPath = value
    case "--spawn-bus": spawnBus = true
    case "--verbose", "-v": verbose = true
    case "--help", "-h":
        writeLine(usage)
        exit(0)
    default:
        writeErrorLine("bluez-sim: unknown argument \(argument)\n\(usage)")
        exit(2)
    }
}
guard let scenarioPath else {
    writeErrorLine("bluez-sim: --scenario FILE is required\n\(usage)")
    exit(2)
}

let scenario: Scenario
do {
    scenario = try Scenario.parse(try readTextFile(scenarioPath))
} catch let error as ScenarioError {
    writeErrorLine("bluez-sim: \(scenarioPath): \(error)")
    exit(1)
} catch {
    writeErrorLine("bluez-sim: \(error)")
    exit(1)
}

var spawned: SpawnedBus?
var bus = DBusBus.system
if spawnBus {
    do {
        let b = try SpawnedBus()
        spawned = b
        bus = .address(b.address)
        setenv("DBUS_SYSTEM_BUS_ADDRESS", b.address, 1)
        writeLine("DBUS_SYSTEM_BUS_ADDRESS=\(b.address)")
    } catch {
        writeErrorLine("bluez-sim: \(error)")
        exit(1)
    }
}
let busToStop = spawned

let simulator = BlueZSimulator(scenario: scenario, bus: bus, verbose: verbose)

let signalSources = onTerminationSignals { [simulator, busToStop] in
    simulator.stop()
    busToStop?.stop()
    exit(0)
}

do {
    try await simulator.start()
} catch {
    writeErrorLine("bluez-sim: \(error)")
    busToStop?.stop()
    exit(1)
}
let connectable = scenario.peripherals.filter(\.connectable).count
writeLine(
    "bluez-sim: ready (\(scenario.adapters.count) adapter(s), \(scenario.peripherals.count) peripheral(s), "
        + "\(connectable) connectable; control: /org/bluez/sim io.blebridge.Simulator1)")
if await simulator.waitUntilBusLost() {
    writeErrorLine("bluez-sim: lost the bus connection; exiting")
    busToStop?.stop()
    exit(1)
}
// stop() was called by the signal handler, which exits the process itself.
while true { try? await Task.sleep(for: .seconds(60)) }
