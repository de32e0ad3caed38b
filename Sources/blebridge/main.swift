// blebridge: wiring only. The tools live in BridgeTools, the daemon in BridgeDaemon; this table joins them.
import BridgeCore
import BridgeDaemon
import BridgeKit
import BridgeTools
import CLinux
import Dispatch
import MQTT
import Signals
import Synchronization

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
// The command runs on a detached task while this thread waits for it (a detached one: top-level code belongs to the
// main actor, whose queue nothing drains here). With an `async` top level instead, the Swift runtime parks the main
// thread in dispatch_main(), which ends it with pthread_exit(); the forced unwind of its stack reads the binary's
// unwind tables (.eh_frame, .eh_frame_hdr) and loads libgcc_s to do it: about 0.4 MB resident for the life of the
// process, for a stack nothing needed unwound (bench/bridge.sh, notify-b's peak RSS).
let status = Atomic<Int32>(0)
let finished = DispatchSemaphore(value: 0)
let arguments = Array(CommandLine.arguments.dropFirst())
Task.detached {
    status.store(await dispatcher.main(arguments), ordering: .relaxed)
    finished.signal()
}
finished.wait()
exit(status.load(ordering: .relaxed))
