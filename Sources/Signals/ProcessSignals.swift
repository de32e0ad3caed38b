// SIGINT, SIGTERM and SIGHUP for the whole process: a handler that writes the signal's number to a pipe, and one
// thread that reads the pipe and calls what was registered.
//
// Why not DispatchSource.makeSignalSource: on Linux libdispatch reads signals from a signalfd, which only sees a
// signal while it is blocked in the thread that polls it, and its own handler forwards a signal that lands in
// another thread with pthread_kill to the thread that registered the source. The main thread of an async `main`
// blocks nothing (the runtime resets its mask after the first `await`), and libdispatch's manager work moves
// between worker threads, so now and then a SIGTERM was taken and never reached the handler: `blebridge run` kept
// running after systemd (or a test) asked it to stop. (swift-corelibs-libdispatch#695; signalfd(2), NOTES.)
//
// A handler installed with sigaction runs in whichever thread the kernel picks, whatever the masks, and writing
// one byte to a pipe is async-signal-safe; the reading thread does the rest. A signal with no registration keeps
// its default effect (the process ends by it), so a command that never asked for one still stops on SIGTERM.
internal import CLinux
import Synchronization

#if canImport(Glibc)
    import Glibc
#endif

public enum ProcessSignals {
    /// The signals taken here.
    public static let handled: [Int32] = [SIGINT, SIGTERM, SIGHUP]

    private struct State {
        var started = false
        var next = 0
        var handlers: [Int32: [(id: Int, body: @Sendable (Int32) -> Void)]] = [:]
    }

    private static let state = Mutex(State())

    /// Installs the handler and starts the thread that reads the pipe (once; `on` calls it too).
    public static func install() {
        let first = state.withLock { s in
            defer { s.started = true }
            return !s.started
        }
        guard first else { return }
        var fds: [Int32] = [-1, -1]
        guard pipe(&fds) == 0 else { return }
        for fd in fds { _ = fcntl(fd, F_SETFD, FD_CLOEXEC) }
        // A full pipe (a storm of signals nobody reads yet) drops the byte instead of blocking the handler.
        _ = fcntl(fds[1], F_SETFL, fcntl(fds[1], F_GETFL) | O_NONBLOCK)
        signalPipeWrite = fds[1]
        let reader = Box(fds[0])
        var thread = pthread_t()
        let created = pthread_create(
            &thread, nil,
            { raw in
                let fd = Unmanaged<Box>.fromOpaque(raw!).takeRetainedValue().fd
                clinux_name_thread("signals")
                ProcessSignals.readLoop(fd)
                return nil
            }, Unmanaged.passRetained(reader).toOpaque())
        guard created == 0 else { return }
        pthread_detach(thread)
        for sig in handled {
            var action = sigaction()
            action.__sigaction_handler.sa_handler = { sig in
                let saved = errno
                var byte = UInt8(truncatingIfNeeded: sig)
                _ = write(signalPipeWrite, &byte, 1)
                errno = saved
            }
            sigemptyset(&action.sa_mask)
            action.sa_flags = SA_RESTART
            sigaction(sig, &action, nil)
        }
    }

    private final class Box {
        let fd: Int32
        init(_ fd: Int32) { self.fd = fd }
    }

    /// Calls `body` (on the signal thread; keep it short) for every `signal` that arrives until the token is
    /// cancelled.
    public static func on(_ signal: Int32, _ body: @escaping @Sendable (Int32) -> Void) -> Token {
        install()
        let id = state.withLock { s in
            s.next += 1
            s.handlers[signal, default: []].append((s.next, body))
            return s.next
        }
        return Token(signal: signal, id: id)
    }

    /// A registration; `cancel()` removes it.
    public struct Token: Sendable {
        let signal: Int32
        let id: Int

        public func cancel() {
            ProcessSignals.state.withLock { s in s.handlers[signal]?.removeAll { $0.id == id } }
        }
    }

    private static func readLoop(_ fd: Int32) {
        var byte: UInt8 = 0
        while true {
            let n = read(fd, &byte, 1)
            if n < 0, errno == EINTR { continue }
            guard n == 1 else { return }
            let received = Int32(byte)
            let bodies = state.withLock { $0.handlers[received] ?? [] }
            if bodies.isEmpty {
                // Nobody asked for it: the default effect, which for these three ends the process by the signal.
                signal(received, SIG_DFL)
                raise(received)
                continue
            }
            for body in bodies { body.body(received) }
        }
    }
}

/// The pipe's write end, for the handler (a plain global with a constant initializer: no lazy initialization in
/// signal context).
nonisolated(unsafe) private var signalPipeWrite: Int32 = -1
