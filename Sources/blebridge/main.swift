// blebridge: wiring only. The tools live in BridgeTools, the daemon in BridgeDaemon; this table joins them.
import BridgeCore
import BridgeDaemon
import BridgeKit
import BridgeTools
import MQTT
import Signals

#if canImport(Glibc)
    import Glibc
#endif

// SIGINT, SIGTERM and SIGHUP are blocked here, before any thread starts, and taken by one sigwait thread (see
// Sources/Signals for why not a dispatch source).
ProcessSignals.install()

// libmosquitto writes to its socket with plain write(2) (TLS writes in every version): a broker that drops the
// connection mid-write must not kill the process with SIGPIPE.
MQTTProcess.ignoreBrokenPipe()

let dispatcher = CommandLineDispatcher(
    commands: BridgeDaemonCommands.all + BridgeToolCommands.all, version: BridgeVersion.current)
let status = await dispatcher.main(Array(CommandLine.arguments.dropFirst()))
exit(status)
