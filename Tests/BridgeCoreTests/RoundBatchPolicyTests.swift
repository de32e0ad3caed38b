// The policy for holding the publishes of signal rounds: at once after a quiet spell, at most a window after the
// last send under a stream, and nothing left held.
import BridgeCore
import Testing

@Suite struct RoundBatchPolicyTests {
    @Test func aLoneRoundIsSentAtOnce() {
        var policy = RoundBatchPolicy(window: 10)
        let r1 = policy.begin()
        #expect(r1)
        let r2 = policy.end(now: 1_000)
        #expect(r2 == .release)
        // A quiet spell longer than the window: the next one too.
        let r3 = policy.begin()
        #expect(r3)
        let r4 = policy.end(now: 1_011)
        #expect(r4 == .release)
    }

    @Test func aStreamOfRoundsIsSentOncePerWindow() {
        var policy = RoundBatchPolicy(window: 10)
        let r5 = policy.begin()
        #expect(r5)
        let r6 = policy.end(now: 100)
        #expect(r6 == .release)
        let r7 = policy.begin()
        #expect(r7)
        let r8 = policy.end(now: 102)
        #expect(r8 == .wait(milliseconds: 8))
        // Still holding: the next round does not hold again, and waits for the rest of the window.
        let r9 = policy.begin()
        #expect(!r9)
        let r10 = policy.end(now: 104)
        #expect(r10 == .wait(milliseconds: 6))
        // The empty round asked for: the window is over.
        let r11 = policy.begin()
        #expect(!r11)
        let r12 = policy.end(now: 110)
        #expect(r12 == .release)
        // The window counts from that send.
        let r13 = policy.begin()
        #expect(r13)
        let r14 = policy.end(now: 112)
        #expect(r14 == .wait(milliseconds: 8))
        let r15 = policy.begin()
        #expect(!r15)
        let r16 = policy.end(now: 125)
        #expect(r16 == .release)
    }

    @Test func anEmptyRoundWithNothingHeldDoesNothing() {
        var policy = RoundBatchPolicy(window: 10)
        let r17 = policy.end(now: 5)
        #expect(r17 == .nothing)
        let r18 = policy.finish()
        #expect(!r18)
    }

    @Test func finishingSendsWhatIsHeld() {
        var policy = RoundBatchPolicy(window: 10)
        let r19 = policy.begin()
        #expect(r19)
        let r20 = policy.end(now: 50)
        #expect(r20 == .release)
        let r21 = policy.begin()
        #expect(r21)
        let r22 = policy.end(now: 52)
        #expect(r22 == .wait(milliseconds: 8))
        let r23 = policy.finish()
        #expect(r23)
        let r24 = policy.finish()
        #expect(!r24)
        let r25 = policy.begin()
        #expect(r25, "held no more: the next round holds anew")
    }
}
