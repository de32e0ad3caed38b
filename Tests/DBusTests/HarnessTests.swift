// The shared test harness itself: children must honour SIGTERM (the runner's threads block it, and children inherit
// the spawning thread's mask), and the waits must report what they waited for.
import DBus
import Foundation
import TestSupport
import Testing

@Suite struct HarnessTests {
    static let sleep = URL(fileURLWithPath: "/bin/sleep")

    /// The child's blocked-signal set, from /proc.
    static func blockedSignals(_ output: String) -> String? {
        output.split(separator: "\n").first { $0.hasPrefix("SigBlk:") }.map {
            $0.dropFirst("SigBlk:".count).trimmingCharacters(in: .whitespaces)
        }
    }

    @Test func childrenStartWithNoBlockedSignals() async throws {
        let grep = URL(fileURLWithPath: "/bin/grep")
        let fromTask = try await runCommand(grep, ["^SigBlk", "/proc/self/status"])
        #expect(Self.blockedSignals(fromTask.stdout) == "0000000000000000", "\(fromTask.stdout)")
        let fromThread = try await offPool { try runCommand(grep, ["^SigBlk", "/proc/self/status"]) }
        #expect(Self.blockedSignals(fromThread.stdout) == "0000000000000000", "\(fromThread.stdout)")
    }

    @Test func stopEndsAChildWithSIGTERM() async throws {
        let child = try ChildProcess(executable: Self.sleep, arguments: ["30"])
        let start = ContinuousClock.now
        await child.stop(grace: 5)
        // The termination status below proves SIGTERM ended it (a SIGKILL after the grace would show 9); the time only
        // bounds the wait, which on a loaded machine can reach the grace period while the poll waits for a thread.
        #expect(ContinuousClock.now - start < .seconds(10))
        #expect(child.process.terminationReason == .uncaughtSignal)
        #expect(child.process.terminationStatus == SIGTERM)
        let status = try await offPool {
            let child = try ChildProcess(executable: Self.sleep, arguments: ["30"])
            child.stop(grace: 5)
            return child.process.terminationStatus
        }
        #expect(status == SIGTERM)
    }

    @Test func privateBusStopsOnSIGTERM() async throws {
        let bus = try await PrivateBus.start()
        #expect(bus.address.hasPrefix("unix:path=\(bus.directory.url.path)/bus"))
        // dbus-daemon prints its address before it installs its SIGTERM handler (bus/main.c): a SIGTERM in between
        // kills it by the default action (1 run in 12 under load). A call it answers comes from its main loop, which
        // it enters after the handler is in place.
        let connection = try await DBusConnection.open(.address(bus.address))
        _ = try await connection.call(
            destination: "org.freedesktop.DBus", path: "/org/freedesktop/DBus", interface: "org.freedesktop.DBus",
            method: "GetId")
        await connection.closeAndWait()
        let start = ContinuousClock.now
        // A grace long enough that only a daemon ignoring SIGTERM would need the SIGKILL, even on a loaded machine
        // (the default 3 s was reached there while the exit waited to be noticed).
        await bus.daemon.stop(grace: 15)
        #expect(ContinuousClock.now - start < .seconds(15))
        // A clean exit (dbus-daemon's own SIGTERM handling), not a kill.
        #expect(bus.daemon.process.terminationReason == .exit)
    }

    @Test func runCommandCapturesOutputAndStatus() async throws {
        let shell = URL(fileURLWithPath: "/bin/sh")
        let script = ["-c", "echo out; echo err >&2; exit 3"]
        let asyncResult = try await runCommand(shell, script)
        #expect(asyncResult.status == 3 && asyncResult.stdout == "out\n" && asyncResult.stderr == "err\n")
        let blockingResult = try await offPool { try runCommand(shell, script) }
        #expect(blockingResult.status == 3 && blockingResult.stdout == "out\n" && blockingResult.stderr == "err\n")
    }

    @Test func waitsFailWithWhatTheyWaitedFor() async throws {
        let child = try ChildProcess(executable: URL(fileURLWithPath: "/bin/sh"), arguments: ["-c", "echo hello"])
        #expect(try await child.waitForOutput(timeout: 5) { $0.contains("hello") } == "hello\n")
        await #expect {
            try await child.waitForOutput(timeout: 5) { $0.contains("never") }
        } throws: { error in
            (error as? HarnessError)?.description.contains("exited (status 0)") == true
        }
        let slow = try ChildProcess(executable: Self.sleep, arguments: ["30"])
        await #expect {
            try await slow.waitForExit(timeout: 0.1)
        } throws: { error in
            (error as? HarnessError)?.description.contains("did not exit within 0.1s") == true
        }
        #expect(!slow.isRunning)
    }
}

@Suite struct CPUBoundTests {
    static func niceness() -> Int32 { getpriority(__priority_which_t(PRIO_PROCESS.rawValue), 0) }

    @Test func runsAtTheLowestPriorityOnItsOwnThread() async throws {
        let before = Self.niceness()
        let inside = try await cpuBound { (Self.niceness(), Thread.isMainThread) }
        #expect(inside.0 == 19)
        #expect(!inside.1)
        // Only that thread was lowered: the test's own thread keeps its priority.
        #expect(Self.niceness() == before)
        await #expect(throws: HarnessError.self) { try await cpuBound { throw HarnessError("inside") } }
    }
}

@Suite struct EnvironmentTests {
    @Test func setEnvironmentVariableAddsAndReplaces() async throws {
        let name = "BLEBRIDGE_HARNESS_TEST_\(UInt32.random(in: 0...UInt32.max))"
        #expect(getenv(name) == nil)
        try setEnvironmentVariable(name, "one")
        #expect(getenv(name).map { String(cString: $0) } == "one")
        try setEnvironmentVariable(name, "two")
        #expect(getenv(name).map { String(cString: $0) } == "two")
        // Children started afterwards inherit it (once).
        let env = try await runCommand(URL(fileURLWithPath: "/usr/bin/env"), [])
        #expect(env.stdout.split(separator: "\n").filter { $0.hasPrefix("\(name)=") } == ["\(name)=two"])
    }
}
