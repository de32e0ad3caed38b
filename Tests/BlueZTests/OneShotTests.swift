import Testing

// OneShot: every waiter gets the value, whether it waits before or after completion (a second waiter used to be
// left suspended forever), and only the first completion counts.
@testable import BlueZ

@Suite struct AuditOneShotTests {
    @Test(.timeLimit(.minutes(1))) func severalWaitersBeforeAndAfterCompletion() async {
        let shot = OneShot<Int>()
        async let a = shot.value()
        async let b = shot.value()
        try? await Task.sleep(for: .milliseconds(20))
        #expect(!shot.isCompleted)
        #expect(shot.complete(7))
        #expect(!shot.complete(8))
        #expect(shot.isCompleted)
        let values = await [a, b, shot.value(), shot.value()]
        #expect(values == [7, 7, 7, 7])
    }
}
