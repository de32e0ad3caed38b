// The fan-out of received messages and connection states to every stream that reads them, under the race a daemon
// meets when it stops: a message arrives on libmosquitto's thread at the moment the task that reads it is
// cancelled.
import Foundation
import Synchronization
import Testing

@testable import MQTT

@Suite struct BroadcastTests {
    /// A cancelled reader's termination handler runs while the runtime holds the reading task's status lock, and a
    /// yield that resumes that task needs the lock. When the handler also waited for the lock `yield` holds, the
    /// two threads waited for each other for ever (a daemon that did not stop on SIGTERM). Before the fix this
    /// hung within a few hundred rounds.
    @Test func cancellingAReaderWhileMessagesArriveNeverDeadlocks() async throws {
        let broadcast = Broadcast<Int>()
        let stop = Atomic<Bool>(false)
        let producer = Thread {
            var i = 0
            while !stop.load(ordering: .relaxed) {
                broadcast.yield(i)
                i += 1
                usleep(UInt32.random(in: 0..<30))
            }
        }
        producer.start()
        defer { stop.store(true, ordering: .relaxed) }
        let cancelled = Atomic<Int>(0)
        let rounds = 1500
        let canceller = Thread {
            for _ in 0..<rounds {
                let stream = broadcast.makeStream(bufferingPolicy: .unbounded)
                let reader = Task.detached {
                    for await _ in stream {}
                }
                usleep(UInt32.random(in: 0..<100))
                reader.cancel()
                cancelled.add(1, ordering: .relaxed)
            }
        }
        canceller.start()
        // Progress, not time: every round must end; a stuck cancel stops the count for good.
        var last = -1
        while cancelled.load(ordering: .relaxed) < rounds {
            try await Task.sleep(for: .seconds(3))
            let now = cancelled.load(ordering: .relaxed)
            #expect(now != last, "cancelling a reader hung after \(now) rounds")
            if now == last { return }
            last = now
        }
        // And nothing is left behind: the streams of cancelled readers are gone after the next yield.
        broadcast.yield(-1)
        #expect(broadcast.subscriberCount == 0)
    }

    @Test func aFinishedStreamIsRemovedAndTheOthersStillReceive() async throws {
        let broadcast = Broadcast<Int>()
        let kept = broadcast.makeStream(bufferingPolicy: .unbounded)
        let dropped = broadcast.makeStream(bufferingPolicy: .unbounded)
        let reader = Task { for await _ in dropped {} }
        reader.cancel()
        await reader.value
        broadcast.yield(1)
        broadcast.yield(2)
        broadcast.finish()
        var received: [Int] = []
        for await v in kept { received.append(v) }
        #expect(received == [1, 2])
        #expect(broadcast.subscriberCount == 0)
    }
}
