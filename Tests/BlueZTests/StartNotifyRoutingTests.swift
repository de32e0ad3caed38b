// StartNotify values come from the D-Bus I/O thread straight to the subscribed characteristic's stream (the client's
// value routes), not through every peripheral's tree-event handler: each stream gets its own values, in order, the
// mirror keeps the last value as a decoded PropertiesChanged would, and a stopped subscription's route is gone.
import BlueZ
import DBus
import Foundation
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
}
