// The policy for holding the publishes of signal rounds: at once after a quiet spell, at most a window after the
// last send under a stream, and nothing left held.
import BridgeCore
import Testing

@Suite struct RoundBatchPolicyTests {
    /// One round at `now`: whether it started a hold, then what its end says.
    private func round(_ policy: inout RoundBatchPolicy, at now: Int64) -> (holds: Bool, next: RoundBatchPolicy.Next) {
        let holds = policy.begin()
        return (holds, policy.end(now: now))
    }

    @Test func aLoneRoundIsSentAtOnce() {
        var policy = RoundBatchPolicy(window: 10)
        #expect(round(&policy, at: 1_000) == (true, .release))
        // A quiet spell longer than the window: the next one too.
        #expect(round(&policy, at: 1_011) == (true, .release))
    }

    @Test func aStreamOfRoundsIsSentOncePerWindow() {
        var policy = RoundBatchPolicy(window: 10)
        #expect(round(&policy, at: 100) == (true, .release))
        #expect(round(&policy, at: 102) == (true, .wait(milliseconds: 8)))
        // Still holding: the next round does not hold again, and waits for the rest of the window.
        #expect(round(&policy, at: 104) == (false, .wait(milliseconds: 6)))
        // The empty round asked for: the window is over.
        #expect(round(&policy, at: 110) == (false, .release))
        // The window counts from that send.
        #expect(round(&policy, at: 112) == (true, .wait(milliseconds: 8)))
        #expect(round(&policy, at: 125) == (false, .release))
    }

    /// A round that carried more than advertisements (a notification's value) is sent at once, with what the
    /// rounds before it held; advertisement rounds after it wait for the window again.
    @Test func anUrgentRoundIsSentAtOnce() {
        var policy = RoundBatchPolicy(window: 50)
        #expect(round(&policy, at: 100) == (true, .release))
        #expect(round(&policy, at: 110) == (true, .wait(milliseconds: 40)))
        #expect(policy.begin() == false)
        #expect(policy.end(now: 120, urgent: true) == .release)
        #expect(round(&policy, at: 130) == (true, .wait(milliseconds: 40)))
        // Urgent with nothing held: nothing to send.
        #expect(policy.end(now: 170) == .release)
        #expect(policy.end(now: 171, urgent: true) == .nothing)
    }

    @Test func anEmptyRoundWithNothingHeldDoesNothing() {
        var policy = RoundBatchPolicy(window: 10)
        let next = policy.end(now: 5)
        let held = policy.finish()
        #expect(next == .nothing && !held)
    }

    @Test func finishingSendsWhatIsHeld() {
        var policy = RoundBatchPolicy(window: 10)
        #expect(round(&policy, at: 50) == (true, .release))
        #expect(round(&policy, at: 52) == (true, .wait(milliseconds: 8)))
        let first = policy.finish()
        let second = policy.finish()
        #expect(first && !second)
        #expect(round(&policy, at: 53).holds, "held no more: the next round holds anew")
    }
}
