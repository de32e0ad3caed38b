import Testing

@testable import BlueZSimulator

@Suite struct EngineTests {
    @Test func gattHandlesFollowBlueZNumbering() throws {
        let s = try Scenario.parse(
            """
            peripherals:
              - address: "AA:BB:CC:DD:EE:FF"
                gatt:
                  - uuid: 1800
                    characteristics:
                      - {uuid: 2A00, flags: [read]}
                      - {uuid: 2A01, flags: [read]}
                  - uuid: 180D
                    characteristics:
                      - {uuid: 2A37, flags: [notify], descriptors: [{uuid: 2901, value: "41"}]}
                      - {uuid: 2A38, flags: [read]}
            """)
        let layout = SimGATTLayout(s.peripherals[0].gatt)
        #expect(layout.services.map(\.handle) == [0x0001, 0x0006])
        #expect(layout.services[0].endHandle == 0x0005)
        #expect(layout.services[0].characteristics.map(\.handle) == [0x0002, 0x0004])
        let hrm = layout.services[1].characteristics[0]
        #expect(hrm.handle == 0x0007)
        #expect(hrm.pathSuffix == "/service0006/char0007")
        #expect(hrm.descriptors.map(\.handle) == [0x0009, 0x000a])
        #expect(hrm.descriptors.map(\.uuid.short16) == [0x2902, 0x2901])
        #expect(hrm.descriptors[1].pathSuffix == "/service0006/char0007/desc000a")
        #expect(hrm.cccdIndex == 0)
        #expect(layout.services[1].characteristics[1].handle == 0x000b)
        // bleak's grammar: the device path is char_path[:-21].
        #expect("/service0006/char0007".count == 21)
        #expect(deviceComponent("aa:bb:cc:dd:ee:0f") == "dev_AA_BB_CC_DD_EE_0F")
    }

    @Test func rssiIsSignalledOnlyBeyondTheThreshold() {
        var state = SimAdvertisementState()
        func adv(_ rssi: Int) -> SimAdvertisementState.Advertisement {
            .init(rssi: rssi, txPower: nil, name: "x", manufacturerData: [], serviceData: [], uuids: [])
        }
        #expect(
            state.apply(adv(-60), rssiThreshold: 8, duplicateData: false, servicesResolved: false) == ["RSSI", "Name"])
        #expect(state.apply(adv(-66), rssiThreshold: 8, duplicateData: false, servicesResolved: false).isEmpty)
        #expect(state.apply(adv(-68), rssiThreshold: 8, duplicateData: false, servicesResolved: false) == ["RSSI"])
        #expect(state.apply(adv(-69), rssiThreshold: 0, duplicateData: false, servicesResolved: false) == ["RSSI"])
        #expect(state.apply(adv(-69), rssiThreshold: 0, duplicateData: false, servicesResolved: false).isEmpty)
        state.rssi = nil  // invalidated at StopDiscovery: always sent again
        #expect(state.apply(adv(-69), rssiThreshold: 8, duplicateData: false, servicesResolved: false) == ["RSSI"])
    }

    @Test func dataIsMergedAndDuplicateDataResignals() {
        var state = SimAdvertisementState()
        let fcd2 = SimUUID("FCD2")!
        let a = SimAdvertisementState.Advertisement(
            rssi: -50, txPower: 4, name: nil, manufacturerData: [(0x0499, [5, 1])], serviceData: [(fcd2, [0x40])],
            uuids: [SimUUID("181A")!])
        let first = state.apply(a, rssiThreshold: 8, duplicateData: false, servicesResolved: false)
        #expect(first == ["RSSI", "TxPower", "ManufacturerData", "ServiceData", "UUIDs"])
        #expect(state.uuids == ["0000181a-0000-1000-8000-00805f9b34fb", fcd2.string])
        #expect(state.apply(a, rssiThreshold: 8, duplicateData: false, servicesResolved: false).isEmpty)
        #expect(
            state.apply(a, rssiThreshold: 8, duplicateData: true, servicesResolved: false) == [
                "ManufacturerData", "ServiceData",
            ])
        var b = a
        b.manufacturerData = [(0x004C, [2])]
        #expect(state.apply(b, rssiThreshold: 8, duplicateData: false, servicesResolved: false) == ["ManufacturerData"])
        #expect(state.manufacturerData.keys.sorted() == [0x004C, 0x0499])  // merged per company
        var c = a
        c.uuids = [SimUUID("180D")!]
        #expect(state.apply(c, rssiThreshold: 8, duplicateData: false, servicesResolved: true).isEmpty)
    }

    @Test func discoveryFilterMatching() {
        var f = SimDiscoveryFilter()
        let hr = SimUUID("180D")!
        #expect(f.matches(name: nil, address: "AA:BB:CC:DD:EE:FF", rssi: -90, txPower: nil, uuids: []))
        f.uuids = [hr]
        #expect(!f.matches(name: nil, address: "AA:BB:CC:DD:EE:FF", rssi: -90, txPower: nil, uuids: []))
        #expect(f.matches(name: nil, address: "AA:BB:CC:DD:EE:FF", rssi: -90, txPower: nil, uuids: [hr]))
        f.rssi = -70
        #expect(!f.matches(name: nil, address: "AA:BB:CC:DD:EE:FF", rssi: -90, txPower: nil, uuids: [hr]))
        f = SimDiscoveryFilter()
        f.transport = "bredr"
        #expect(!f.matches(name: nil, address: "AA:BB:CC:DD:EE:FF", rssi: -50, txPower: nil, uuids: []))
        f = SimDiscoveryFilter()
        f.pathloss = 30
        #expect(!f.matches(name: nil, address: "AA", rssi: -80, txPower: 0, uuids: []))
        #expect(f.matches(name: nil, address: "AA", rssi: -20, txPower: 0, uuids: []))
    }

    @Test func attErrorsMapLikeBlueZ() {
        #expect(simATTError(0x02, write: false) == ("org.bluez.Error.NotPermitted", "Read not permitted"))
        #expect(simATTError(0x03, write: true) == ("org.bluez.Error.NotPermitted", "Write not permitted"))
        #expect(simATTError(0x05, write: true).message == "Not paired")
        #expect(simATTError(0x07, write: false) == ("org.bluez.Error.InvalidArguments", "Invalid offset"))
        #expect(simATTError(0x0e, write: false) == ("org.bluez.Error.Failed", "Operation failed with ATT error: 0x0e"))
        #expect(simATTError(0x80, write: false).message == "Operation failed with ATT error: 0x80")
    }

    @Test func uuidsAndAddresses() {
        #expect(SimUUID("180d")?.string == "0000180d-0000-1000-8000-00805f9b34fb")
        #expect(SimUUID("0x2A37")?.short16 == 0x2A37)
        #expect(SimUUID("6E400001-B5A3-F393-E0A9-E50E24DCCA9E")?.string == "6e400001-b5a3-f393-e0a9-e50e24dcca9e")
        #expect(SimUUID("6e400001-b5a3-f393-e0a9-e50e24dcca9e")?.short16 == nil)
        #expect(SimUUID("2A3") == nil)
        #expect(SimUUID("zzzz") == nil)
        #expect(isPrivateRandomAddress("4F:00:00:00:00:01", type: "random"))
        #expect(!isPrivateRandomAddress("CB:B8:33:4C:88:4F", type: "random"))
        #expect(!isPrivateRandomAddress("4F:00:00:00:00:01", type: "public"))
    }

    @Test func monitorPatternsMatchAdvertisingStructures() {
        let adv = SimAdvertisementState.Advertisement(
            rssi: -50, txPower: nil, name: "T", manufacturerData: [(0x0499, [5])],
            serviceData: [(SimUUID("FCD2")!, [0x40])],
            uuids: [])
        let s = advertisingStructures(adv, connectable: false)
        #expect(SimMonitorPattern(start: 0, adType: 0x16, content: [0xD2, 0xFC]).matches(s))
        #expect(SimMonitorPattern(start: 0, adType: 0xFF, content: [0x99, 0x04, 0x05]).matches(s))
        #expect(!SimMonitorPattern(start: 0, adType: 0xFF, content: [0x4C, 0x00]).matches(s))
        #expect(!SimMonitorPattern(start: 5, adType: 0x16, content: [0xD2]).matches(s))
    }

    @Test func jitterStaysInRange() {
        var r = SimRandom(seed: "AA:BB")
        for _ in 0..<1000 {
            let j = r.jitter(4)
            #expect((-4...4).contains(j))
        }
        #expect(r.jitter(0) == 0)
    }
}
