// SingleFlight, which shares bluetoothd's whole-tree reads among the peripherals that ask for one at the same time
// (refreshMissingObjects): however many ask, at most one read runs and one waits, each caller gets a read that
// started after it asked, and a cancelled caller stops waiting without stopping the read for the others.
import Synchronization
import TestSupport
import Testing

@testable import BlueZ

/// Reads that each block until the test opens their gate, numbered from 1 in the order they start.
private final class GatedReads: Sendable {
    private let started = Mutex<Int>(0)
    private let gates = Mutex<[Int: OneShot<Bool>]>([:])

    var count: Int { started.withLock { $0 } }

    private func gate(_ n: Int) -> OneShot<Bool> {
        gates.withLock { g in
            if let shot = g[n] { return shot }
            let shot = OneShot<Bool>()
            g[n] = shot
            return shot
        }
    }

    func open(_ n: Int) { gate(n).complete(true) }

    func read() async -> Int {
        let n = started.withLock { c -> Int in
            c += 1
            return c
        }
        _ = await gate(n).value()
        return n
    }
}

@Suite struct SingleFlightTests {
    @Test(.timeLimit(.minutes(1))) func callersDuringARunShareOneLaterRun() async throws {
        let flight = SingleFlight<Int>()
        let reads = GatedReads()
        let first = Task { await flight.value { await reads.read() } }
        try await eventually(5, "the first read to start") { reads.count == 1 }
        // Twenty callers while the first read runs: it started before they asked, so none may take its result;
        // they all share one queued read.
        let later = (0..<20).map { _ in Task { await flight.value { await reads.read() } } }
        try await eventually(5, "a run under way and one queued") { flight.pending == 2 }
        #expect(reads.count == 1)
        reads.open(1)
        #expect(await first.value == 1)
        try await eventually(5, "the queued read to start") { reads.count == 2 }
        reads.open(2)
        for task in later { #expect(await task.value == 2) }
        #expect(reads.count == 2)
        try await eventually(5, "nothing under way") { flight.pending == 0 }
        // Nothing under way: the next caller starts a read of its own at once.
        let next = Task { await flight.value { await reads.read() } }
        try await eventually(5, "a third read") { reads.count == 3 }
        reads.open(3)
        #expect(await next.value == 3)
    }

    @Test(.timeLimit(.minutes(1))) func aCancelledCallerStopsWaitingAndTheReadGoesOn() async throws {
        let flight = SingleFlight<Int>()
        let reads = GatedReads()
        let starter = Task { await flight.value { await reads.read() } }
        try await eventually(5, "the read to start") { reads.count == 1 }
        let queued = Task { await flight.value { await reads.read() } }
        try await eventually(5, "one queued") { flight.pending == 2 }
        // The caller that started the read is cancelled: it gets nil at once, while the read is still blocked.
        starter.cancel()
        #expect(await starter.value == nil)
        reads.open(1)
        try await eventually(5, "the queued read to start") { reads.count == 2 }
        reads.open(2)
        #expect(await queued.value == 2)
    }
}
