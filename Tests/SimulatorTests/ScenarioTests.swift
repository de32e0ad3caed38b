import Foundation
import Testing

@testable import BlueZSimulator

@Suite struct ScenarioValidationTests {
    func error(_ yaml: String) -> ScenarioError? {
        do {
            _ = try Scenario.parse(yaml)
            return nil
        } catch {
            return error
        }
    }

    @Test func minimalScenarioGetsDefaults() throws {
        let s = try Scenario.parse("peripherals:\n  - address: \"aa:bb:cc:dd:ee:ff\"\n")
        #expect(s.adapters.map(\.id) == ["hci0"])
        #expect(s.temporaryTimeout == 30)
        #expect(s.mtu == 517)
        let p = try #require(s.peripherals.first)
        #expect(p.address == "AA:BB:CC:DD:EE:FF")
        #expect(p.addressType == "public")
        #expect(p.connectable)
        #expect(p.rssi == -60)
        #expect(p.name == nil)
    }

    @Test func badUUIDNamesTheKeyPath() {
        let e = error(
            """
            peripherals:
              - address: "AA:BB:CC:DD:EE:01"
              - address: "AA:BB:CC:DD:EE:02"
              - address: "AA:BB:CC:DD:EE:03"
                gatt:
                  - uuid: "180D"
                    characteristics:
                      - {uuid: "2A37", flags: [notify]}
                      - {uuid: "2A3", flags: [read]}
            """)
        #expect(e?.description == #"peripherals[2].gatt[0].characteristics[1].uuid: "2A3" is not a UUID"#)
    }

    @Test(arguments: [
        ("peripherals:\n  - address: \"AA:BB\"\n", #"peripherals[0].address: "AA:BB" is not a MAC address"#),
        ("peripherals:\n  - name: x\n", "peripherals[0].address: is required"),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", rssi: loud}\n",
            #"peripherals[0].rssi: "loud" is not an integer"#
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", rssi: 50}\n",
            "peripherals[0].rssi: 50 is out of range -127...20"
        ),
        ("peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", colour: red}\n", "peripherals[0].colour: unknown key"),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", address_type: static}\n",
            #"peripherals[0].address_type: "static" is not public or random"#
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", manufacturer_data: [{company: 0x499, value: \"0\"}]}\n",
            #"peripherals[0].manufacturer_data[0].value: "0" is not hex bytes (odd number of digits)"#
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", service_data: [{uuid: FCD2}]}\n",
            "peripherals[0].service_data[0]: needs `value` or `sequence`"
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", gatt: [{uuid: 180D, characteristics: [{uuid: 2A37}]}]}\n",
            "peripherals[0].gatt[0].characteristics[0].flags: is required (e.g. [read, notify])"
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", gatt: [{uuid: 180D, characteristics: [{uuid: 2A37, flags: [fly]}]}]}\n",
            "peripherals[0].gatt[0].characteristics[0].flags[0]: \"fly\" is not a flag"
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", gatt: [{uuid: 180D, characteristics: [{uuid: 2A38, flags: [read], notify: {rate: 1, sequence: [\"01\"]}}]}]}\n",
            "peripherals[0].gatt[0].characteristics[0].notify: the characteristic has neither the notify nor the indicate flag"
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", gatt: [{uuid: FFF0, characteristics: [{uuid: FFF1, flags: [write], on_write: {echo_to: FFF2}}]}]}\n",
            "peripherals[0].gatt[0].characteristics[0].on_write.echo_to: no characteristic 0000fff2-0000-1000-8000-00805f9b34fb"
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", gatt: [{uuid: 180D, characteristics: [{uuid: 2A37, flags: [notify], descriptors: [{uuid: 2902}]}]}]}\n",
            "peripherals[0].gatt[0].characteristics[0].descriptors[0].uuid: the CCCD (2902) is added automatically"
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\"}\n  - {address: \"aa:bb:cc:dd:ee:ff\"}\n",
            "peripherals[1].address: duplicate peripheral address AA:BB:CC:DD:EE:FF"
        ),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", adapter: hci1}\n",
            #"peripherals[0].adapter: "hci1" is not a declared adapter"#
        ),
        ("settings: {mtu: 10}\n", "settings.mtu: 10 is out of range 23...517"),
        ("adapters: [{id: usb0}]\n", #"adapters[0].id: "usb0" is not an adapter name like hci0"#),
        (
            "peripherals:\n  - {address: \"AA:BB:CC:DD:EE:FF\", services_resolved: early}\n",
            #"peripherals[0].services_resolved: "early" is not one of after-reply, with-connected, before-reply, kept"#
        ),
        ("peripherals: 3\n", #"peripherals: expected a list, found "3""#),
        ("- a\n- b\n", "expected a mapping, found a sequence"),
    ])
    func rejectsWithPathAndReason(yaml: String, expected: String) {
        let e = error(yaml)
        #expect(e != nil)
        #expect(e?.description.hasPrefix(expected) == true, "got: \(e?.description ?? "nil")")
    }

    @Test func syntaxErrorsAreReportedWithPosition() {
        let e = error("peripherals:\n  - address: [1, 2\n")
        #expect(e?.description.contains("invalid YAML at line") == true)
    }

    @Test func jsonScenariosParseToo() throws {
        let s = try Scenario.parse(
            #"{"peripherals": [{"address": "AA:BB:CC:DD:EE:FF", "name": "J", "gatt": [{"uuid": "180F", "characteristics": [{"uuid": "2A19", "flags": ["read"], "value": "64"}]}]}]}"#
        )
        #expect(s.peripherals.first?.gatt.first?.characteristics.first?.value == [0x64])
    }

    @Test func valuesSequencesAndFormats() throws {
        let s = try Scenario.parse(
            """
            peripherals:
              - address: "AA:BB:CC:DD:EE:FF"
                manufacturer_data: [{company: 0x0499, sequence: ["01 02", "03:04"], period: 2}]
                service_data: [{uuid: FCD2, value: "40"}]
                gatt:
                  - uuid: 181A
                    characteristics:
                      - uuid: 2A6E
                        flags: [notify, read]
                        value: {text: "hi"}
                        notify: {rate: 10, counter: {start: 250, step: 3, size: 2}}
                        presentation_format: {format: 0x0E, exponent: -2, unit: 0x272F}
            """)
        let p = try #require(s.peripherals.first)
        #expect(p.manufacturerData.first?.company == 0x0499)
        #expect(p.manufacturerData.first?.data.values == [[1, 2], [3, 4]])
        #expect(p.manufacturerData.first?.data.value(at: 2.5, count: 0) == [3, 4])
        #expect(p.manufacturerData.first?.data.value(at: 4.1, count: 0) == [1, 2])
        #expect(p.serviceData.first?.uuid.string == "0000fcd2-0000-1000-8000-00805f9b34fb")
        let c = try #require(p.gatt.first?.characteristics.first)
        #expect(c.flags == ["read", "notify"])  // BlueZ order
        #expect(c.value == Array("hi".utf8))
        #expect(c.notify?.rateHz == 10)
        #expect(c.notify?.value(0) == [250, 0])
        #expect(c.notify?.value(2) == [0, 1])
        #expect(c.descriptors.first?.uuid.short16 == 0x2904)
        #expect(c.descriptors.first?.value == [0x0E, 0xFE, 0x2F, 0x27, 0x01, 0x00, 0x00])
    }

    @Test func everyShippedScenarioLoads() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
            .deletingLastPathComponent()
        let config = root.appendingPathComponent("config")
        let files = try FileManager.default.contentsOfDirectory(atPath: config.path)
            .filter { $0.hasSuffix(".yaml") || $0.hasSuffix(".yml") || $0.hasSuffix(".json") }
            .filter { $0.contains("scenario") }
        #expect(!files.isEmpty)
        for file in files {
            let text = try String(contentsOf: config.appendingPathComponent(file), encoding: .utf8)
            do { _ = try Scenario.parse(text) } catch { Issue.record("\(file): \(error)") }
        }
    }

    @Test func demoScenarioHasTheSensorsTheIssueAsksFor() throws {
        let root = URL(fileURLWithPath: #filePath).deletingLastPathComponent().deletingLastPathComponent()
            .deletingLastPathComponent()
        let text = try String(contentsOf: root.appendingPathComponent("config/demo-scenario.yaml"), encoding: .utf8)
        let s = try Scenario.parse(text)
        func has(_ service: UInt16) -> [SimPeripheralSpec] {
            s.peripherals.filter { $0.gatt.contains { $0.uuid.short16 == service } }
        }
        let hr = try #require(has(0x180D).first)
        let hrm = try #require(hr.gatt.flatMap(\.characteristics).first { $0.uuid.short16 == 0x2A37 })
        #expect(hrm.notify?.rateHz == 1)
        #expect(hr.gatt.flatMap(\.characteristics).contains { $0.uuid.short16 == 0x2A38 })
        #expect(hr.gatt.flatMap(\.characteristics).contains { $0.uuid.short16 == 0x2A19 })
        #expect(
            has(0x1809).first?.gatt.flatMap(\.characteristics).first { $0.uuid.short16 == 0x2A1C }?.flags == [
                "indicate"
            ])
        let env = try #require(has(0x181A).first).gatt.flatMap(\.characteristics)
        for u: UInt16 in [0x2A6E, 0x2A6F, 0x2A6D] { #expect(env.first { $0.uuid.short16 == u }?.notify != nil) }
        let bthome = try #require(s.peripherals.first { $0.serviceData.contains { $0.uuid.short16 == 0xFCD2 } })
        #expect(!bthome.connectable)
        #expect(bthome.serviceData[0].data.values.count > 1)
        let ruuvi = try #require(s.peripherals.first { $0.manufacturerData.contains { $0.company == 0x0499 } })
        #expect(ruuvi.manufacturerData[0].data.values.allSatisfy { $0.count == 24 && $0[0] == 5 })
        let writable = try #require(
            s.peripherals.first { $0.gatt.flatMap(\.characteristics).contains { $0.echoTo != nil } })
        let rx = try #require(writable.gatt.flatMap(\.characteristics).first { $0.echoTo != nil })
        #expect(rx.flags.contains("write") && rx.flags.contains("write-without-response"))
        for p in s.peripherals where p.connectable {
            #expect(p.gatt.contains { $0.uuid.short16 == 0x1800 }, "\(p.address) lacks GAP")
            #expect(p.gatt.contains { $0.uuid.short16 == 0x180A }, "\(p.address) lacks DIS")
        }
    }
}
