// OneShot, the exactly-once promise behind every wait in the BlueZ client: every waiter gets the value, whether it
// waits before or after completion (a second waiter used to be left suspended forever), only the first completion
// counts, and a cancelled wait returns nil and leaves nothing behind.
import TestSupport
import Testing

@testable import BlueZ

@Suite struct OneShotTests {
    @Test(.timeLimit(.minutes(1))) func severalWaitersBeforeAndAfterCompletion() async throws {
        let shot = OneShot<Int>()
        async let a = shot.value()
        async let b = shot.value()
        // Both must be suspended before the completion, or this would only test waiting after it.
        try await eventually(5, "two suspended waiters") { shot.waiterCount == 2 }
        #expect(!shot.isCompleted)
        #expect(shot.complete(7))
        #expect(!shot.complete(8))
        #expect(shot.isCompleted)
        #expect(shot.waiterCount == 0)
        let values = await [a, b, shot.value(), shot.value()]
        #expect(values == [7, 7, 7, 7])
    }
}

@Suite struct OneShotCancellationTests {
    @Test(.timeLimit(.minutes(1))) func cancelledWaitReturnsNilAndIsDropped() async throws {
        let shot = OneShot<Int>()
        let waiter = Task { await shot.value() }
        try await eventually(5, "the waiter to suspend") { shot.waiterCount == 1 }
        waiter.cancel()
        #expect(await waiter.value == nil)
        #expect(shot.waiterCount == 0)
        // A task group that races a wait against another task finishes when the other task wins: it returns once
        // the wait is suspended, and cancelling the group must release the wait.
        let raced = await withTaskGroup(of: Int?.self) { group in
            group.addTask { await shot.value() }
            group.addTask {
                let suspended = (try? await waitUntil(timeout: 5) { shot.waiterCount == 1 }) ?? false
                return suspended ? -1 : -2
            }
            let first = await group.next() ?? nil
            group.cancelAll()
            return first
        }
        #expect(raced == -1)
        #expect(shot.waiterCount == 0)
        #expect(shot.complete(3))
        #expect(await shot.value() == 3)
    }
}
