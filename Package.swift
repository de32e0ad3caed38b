// swift-tools-version: 6.0
// blebridge: a BLE-to-MQTT bridge for Linux (BlueZ over D-Bus, MQTT over libmosquitto).
//
// Layering (dependencies only point downwards):
//   C module maps (CDBus, CMosquitto, CYAML, CCrypto, CMicroHTTPD) and one C source target (CMosquittoIO)
//   -> DBus (Swift over libdbus) -> BlueZ (typed org.bluez client)
//   -> MQTT (Swift over libmosquitto)
//   -> GATT (pure Swift parsers, no C, no I/O); GATTCrypto (AES-CCM from libcrypto, injected into GATT)
//   -> YAML (libyaml -> a plain value tree with key paths)
//   -> MetricsHTTP (a metrics HTTP endpoint over libmicrohttpd and a Prometheus text writer; knows nothing of BLE)
//   Logging (one logger for every layer) and Signals (SIGINT/SIGTERM/SIGHUP for a process) sit below all of them.
//   -> BlueZSimulator (a bluetoothd look-alike over DBus)
//   -> BridgeKit (what the tools and the daemon share: arguments, exit codes, finding devices, decoding, JSON)
//   -> BridgeCore (the bridge's policy: config, device sessions, topics, commands, discovery; no BlueZ, no MQTT,
//      no C: it talks to BLE and MQTT only through protocols it owns)
//   -> BridgeAdapters (those protocols over BlueZ and MQTT)
//   -> BridgeTools (the CLI subcommands), BridgeDaemon (`run`, `check-config`)
//   -> executables: blebridge, bluez-sim, benchmarks
import PackageDescription

let package = Package(
    name: "blebridge",
    platforms: [.macOS(.v15)],
    products: [
        .executable(name: "blebridge", targets: ["blebridge"]),
        .executable(name: "bluez-sim", targets: ["bluez-sim"]),
    ],
    targets: [
        // C libraries from Debian's -dev packages.
        .systemLibrary(name: "CDBus", pkgConfig: "dbus-1", providers: [.apt(["libdbus-1-dev"])]),
        .systemLibrary(name: "CMosquitto", pkgConfig: "libmosquitto", providers: [.apt(["libmosquitto-dev"])]),
        .systemLibrary(name: "CYAML", pkgConfig: "yaml-0.1", providers: [.apt(["libyaml-dev"])]),
        .systemLibrary(name: "CCrypto", pkgConfig: "libcrypto", providers: [.apt(["libssl-dev"])]),
        .systemLibrary(name: "CLinux"),  // glibc's own headers (libc6-dev) that the Glibc module leaves out
        // Headers only (libmicrohttpd-dev): the library is loaded with dlopen when a metrics endpoint starts, so it
        // takes no pkgConfig, whose --libs would link it (and gnutls behind it) into every process.
        .systemLibrary(name: "CMicroHTTPD"),
        // C source: libmosquitto's plain-TCP socket reads served from a buffer (read(2) and close(2) for the process).
        .target(name: "CMosquittoIO"),

        // Swift layers.
        .target(name: "Logging"),
        .target(name: "Signals", dependencies: ["CLinux"]),
        .target(name: "DBus", dependencies: ["CDBus", "CLinux"]),
        .target(name: "BlueZ", dependencies: ["DBus", "Logging", "CLinux"]),
        .target(name: "MQTT", dependencies: ["CMosquitto", "CMosquittoIO", "CLinux", "Logging"]),
        .target(name: "GATT"),
        .target(name: "GATTCrypto", dependencies: ["GATT", "CCrypto"]),
        .target(name: "YAML", dependencies: ["CYAML"]),
        .target(name: "MetricsHTTP", dependencies: ["CMicroHTTPD", "Logging"]),
        .target(name: "BlueZSimulator", dependencies: ["DBus", "YAML", "Signals"]),
        .target(name: "BridgeKit", dependencies: ["BlueZ", "GATT", "GATTCrypto", "Logging", "Signals"]),
        .target(name: "BridgeCore", dependencies: ["GATT", "YAML", "Logging"]),
        .target(name: "BridgeAdapters", dependencies: ["BridgeCore", "BridgeKit", "BlueZ", "MQTT", "GATT", "Logging"]),
        .target(name: "BridgeTools", dependencies: ["BridgeKit", "BlueZ", "GATT", "GATTCrypto"]),
        .target(
            name: "BridgeDaemon",
            dependencies: ["BridgeAdapters", "BridgeCore", "BridgeKit", "GATTCrypto", "Logging", "MetricsHTTP", "Signals"]),

        // Executables: wiring only.
        .executableTarget(
            name: "blebridge",
            dependencies: ["BridgeTools", "BridgeDaemon", "BridgeKit", "BridgeCore", "CLinux", "MQTT", "Signals"]),
        .executableTarget(name: "bluez-sim", dependencies: ["BlueZSimulator", "DBus"]),
        .executableTarget(name: "bench-gatt", dependencies: ["GATT", "GATTCrypto"]),
        .executableTarget(name: "bench-mqtt", dependencies: ["MQTT"]),
        .executableTarget(name: "bench-notify", dependencies: ["DBus"]),
        .executableTarget(name: "bench-bridge", dependencies: ["DBus"]),
        .executableTarget(name: "bench-adverts", dependencies: ["BlueZ", "GATT"]),
        .executableTarget(name: "metrics-sample", dependencies: ["MetricsHTTP", "Logging"]),

        // Tests.
        .target(name: "TestSupport", dependencies: ["DBus"], path: "Tests/TestSupport"),
        .testTarget(name: "DBusTests", dependencies: ["DBus", "CDBus", "TestSupport"]),
        .testTarget(name: "YAMLTests", dependencies: ["YAML"]),
        .testTarget(name: "SimulatorTests", dependencies: ["BlueZSimulator", "DBus", "TestSupport"]),
        .testTarget(name: "BlueZTests", dependencies: ["BlueZ", "DBus", "TestSupport"]),
        .testTarget(name: "MQTTTests", dependencies: ["MQTT", "CMosquittoIO", "TestSupport"]),
        .testTarget(name: "GATTTests", dependencies: ["GATT", "GATTCrypto", "TestSupport"]),
        .testTarget(name: "CLITests", dependencies: ["TestSupport"]),
        .testTarget(name: "BridgeCoreTests", dependencies: ["BridgeCore", "GATT", "GATTCrypto", "YAML", "Logging"]),
        .testTarget(name: "MetricsHTTPTests", dependencies: ["MetricsHTTP", "Logging"]),
    ],
    swiftLanguageModes: [.v6]
)
