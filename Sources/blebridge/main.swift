// blebridge: wiring only. The tools live in BridgeTools, the daemon in BridgeDaemon; this table joins them.
import BridgeCore
import BridgeDaemon
import BridgeKit
import BridgeTools
import CLinux
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

// One malloc arena instead of one per thread that ever allocated alongside another (glibc's default allows 16 on
// two cores): each arena keeps its own free pages, so with a hundred devices the bridge held 2.6 MB more for the
// same data (bench/bridge.sh, notify-b), at no measurable cost in CPU (threads take most small blocks from their
// own cache, not the arena). A MALLOC_ARENA_MAX or GLIBC_TUNABLES in the environment is left to decide.
if getenv("MALLOC_ARENA_MAX") == nil, getenv("GLIBC_TUNABLES") == nil { _ = clinux_limit_malloc_arenas(1) }

let dispatcher = CommandLineDispatcher(
    commands: BridgeDaemonCommands.all + BridgeToolCommands.all, version: BridgeVersion.current)
let status = await dispatcher.main(Array(CommandLine.arguments.dropFirst()))
exit(status)
