// StartNotify values come from the D-Bus I/O thread straight to the subscribed characteristic's stream (the client's
// value routes), not through every peripheral's tree-event handler: each stream gets its own values, in order, the
// mirror keeps the last value as a decoded PropertiesChanged would, and a stopped subscription's route is gone.
import BlueZ
import DBus
import Foundation
import Synchronization
import Testing

@Suite struct StartNotifyRoutingTests {
    @Test(.timeLimit(.minutes(1))) func eachCharacteristicGetsItsOwnValuesInOrder() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let hr = try p.characteristic("2A37")
        let battery = try p.characteristic("2A19")
        let heartRates = try await p.notifications(for: hr, preferAcquire: false)
        let levels = try await p.notifications(for: battery, preferAcquire: false)
        for i in 0..<20 {
            try await t.simulator("PushNotification", [.string(strap), .string("2A37"), .bytes([0, UInt8(60 + i)])])
            try await t.simulator("PushNotification", [.string(strap), .string("2A19"), .bytes([UInt8(99 - i)])])
        }
        var h = heartRates.makeAsyncIterator()
        var b = levels.makeAsyncIterator()
        for i in 0..<20 {
            #expect(try await h.next() == [0, UInt8(60 + i)])
            #expect(try await b.next() == [UInt8(99 - i)])
        }
        // The mirror holds the last value of each.
        #expect(p.refreshed(battery)?.value == [80])
        #expect(p.refreshed(hr)?.value == [0, 79])
        // Stopped: the battery's values reach nobody (its stream ended), the heart rate's still arrive.
        await p.stopNotifications(for: battery)
        #expect(try await b.next() == nil)
        try await t.simulator("PushNotification", [.string(strap), .string("2A19"), .bytes([5])])
        try await t.simulator("PushNotification", [.string(strap), .string("2A37"), .bytes([0, 90])])
        #expect(try await h.next() == [0, 90])
        await p.disconnect()
        #expect(try await h.next() == nil)
    }

    /// A round that delivered a StartNotify value says so to the round observers
    /// (`BlueZSignalRounds.takeCarriedMoreThanAdvertisements`), so that the bridge sends its publishes at the round's
    /// end instead of holding them to batch advertisements. The flag is process-wide: run alone (`--filter`), the
    /// rounds of this test are the only ones; in a parallel run other tests' signals may set it too.
    @Test(.timeLimit(.minutes(1))) func aRoundWithAValueSaysItCarriedMoreThanAdvertisements() async throws {
        let t = try await SimClient()
        let p = try await t.connect()
        let hr = try p.characteristic("2A37")
        let values = try await p.notifications(for: hr, preferAcquire: false)
        let ends = Mutex<[Bool]>([])
        let token = BlueZSignalRounds.observe(
            .init(
                begin: {},
                end: { ends.withLock { $0.append(BlueZSignalRounds.takeCarriedMoreThanAdvertisements()) } }))
        defer { BlueZSignalRounds.stopObserving(token) }
        _ = BlueZSignalRounds.takeCarriedMoreThanAdvertisements()
        ends.withLock { $0 = [] }
        try await t.simulator("PushNotification", [.string(strap), .string("2A37"), .bytes([0, 70])])
        var iterator = values.makeAsyncIterator()
        #expect(try await iterator.next() == [0, 70])
        #expect(ends.withLock { $0.contains(true) }, "round ends: \(ends.withLock { $0 })")
        await p.disconnect()
    }
}
