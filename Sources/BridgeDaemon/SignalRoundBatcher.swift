// Batches the MQTT writes of D-Bus signal rounds over a few milliseconds (RoundBatchPolicy): one write(2), one PUBACK
// segment back and one wake-up of the MQTT loop thread for several advertisements, not one each.
import BlueZ
import BridgeAdapters
import BridgeCore
import Synchronization

/// Applies `RoundBatchPolicy` to the bridge's MQTT connection on the D-Bus I/O thread (`BlueZSignalRounds`): holds
/// the writes of signal rounds, sends them at most `window` ms after the last send, and asks for an empty round when
/// a hold is kept, so that it ends even when no other round comes.
final class SignalRoundBatcher: Sendable {
    /// 50 ms: an advertisement's state reaches the broker at most that much later (advertisers send every 100 ms
    /// to 10 s). Rounds that carried more than advertisements (a notification over StartNotify, a connection's
    /// change: `BlueZSignalRounds.takeCarriedMoreThanAdvertisements`) are sent at their end, with what is held;
    /// notifications over AcquireNotify have rounds of their own, sent at their end. A publish from another thread
    /// (a command's result) during a hold waits for it. Each send is a write(2) to the broker over TCP, which wakes
    /// the broker (and the broker's PUBACKs wake the MQTT thread): with 500 advertisers at 1 Hz whose advertisements
    /// are spread in time (bench/bridge.sh, passive, 2026-12-06) a 10 ms window made about 95 writes a second and
    /// cost the bridge 1.9-2.2x the bare client's CPU; 50 ms made about 20 and 1.2-1.5x (the D-Bus loop's 16 ms
    /// gathering alone: no gain).
    static let window: Int64 = 50

    /// How long the D-Bus loop lets signals gather after a round of advertisements only (its own pause is 16 ms,
    /// which a value over StartNotify or a connection's change still gets): fewer wake-ups and rounds.
    static let advertisementGathering: Int64 = 32

    private let transport: MQTTBrokerTransport
    private let policy = Mutex(RoundBatchPolicy(window: SignalRoundBatcher.window))

    init(transport: MQTTBrokerTransport) { self.transport = transport }

    /// The observer to register with `BlueZSignalRounds.observe`.
    var observer: BlueZNotificationRounds.Observer {
        BlueZNotificationRounds.Observer(begin: { [self] in begin() }, end: { [self] in end() })
    }

    private func begin() {
        if policy.withLock({ $0.begin() }) { transport.holdWrites() }
    }

    private func end() {
        let now = monotonicMicroseconds() / 1000
        let urgent = BlueZSignalRounds.takeCarriedMoreThanAdvertisements()
        // Advertisements only: the D-Bus loop may let the next ones gather longer (their publishes wait here anyway).
        if !urgent { BlueZSignalRounds.requestLongerGathering(milliseconds: Int(Self.advertisementGathering)) }
        switch policy.withLock({ $0.end(now: now, urgent: urgent) }) {
        case .nothing: break
        case .release: transport.releaseWrites()
        case .wait(let milliseconds): BlueZSignalRounds.requestEmptyRound(afterMilliseconds: Int(milliseconds))
        }
    }

    /// Sends what is held (the observer was removed: no empty round will come for it).
    func finish() {
        if policy.withLock({ $0.finish() }) { transport.releaseWrites() }
    }
}
