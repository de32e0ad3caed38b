// blebridge: wiring only. The tools live in BridgeTools, the daemon in BridgeDaemon; this table joins them.
import BridgeCore
import BridgeDaemon
import BridgeKit
import BridgeTools
import MQTT

#if canImport(Glibc)
    import Glibc
#endif

// libmosquitto writes to its socket with plain write(2) (TLS writes in every version): a broker that drops the
// connection mid-write must not kill the process with SIGPIPE.
MQTTProcess.ignoreBrokenPipe()

let dispatcher = CommandLineDispatcher(
    commands: BridgeDaemonCommands.all + BridgeToolCommands.all, version: BridgeVersion.current)
let status = await dispatcher.main(Array(CommandLine.arguments.dropFirst()))
exit(status)
