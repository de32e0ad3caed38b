// The hot path's JSON writer gives exactly the text of the general one (JSONValue.write, iso8601).
import GATT
import Testing

@testable import BridgeCore

/// A passive device's record with the defaults, nothing merged yet.
private func passiveRecord() -> DeviceRecord {
    let config = DeviceConfig(
        id: "d", friendlyName: nil, match: DeviceMatch(address: nil), mode: .passive, subscribe: [], poll: [],
        pollInterval: .seconds(300), writable: [], debounce: nil, throttle: nil, retain: nil, qos: -1,
        output: .json, bindKey: nil, availabilityTimeout: nil, index: -1)
    return DeviceRecord(id: "d", config: config, address: nil)
}

@Suite struct HotPathJSONTests {
    @Test func timestampsMatchISO8601() {
        let samples: [Double] = [
            0, 1_796_083_200.25, 951_825_600, 1_709_164_800.5, -0.5, -62_135_596_800, -70_000_000_000,
            253_402_300_799.999,
            999_999_999_999, .nan, .infinity, -.infinity, 1e13, 0.0005, 59.9999,
        ]
        for seconds in samples {
            var out: [UInt8] = []
            appendISO8601JSON(seconds, to: &out)
            #expect(String(decoding: out, as: UTF8.self) == "\"\(iso8601(seconds))\"", "\(seconds)")
        }
    }

    @Test func decimalsMatchStringInit() {
        for value: Int64 in [0, 7, -7, 10, 99, 100, -100, 1_234_567_890, .max, .min, .min + 1] {
            var out: [UInt8] = []
            appendDecimal(value, to: &out)
            #expect(String(decoding: out, as: UTF8.self) == String(value))
        }
    }

    @Test func compactValuesMatchTheGeneralWriter() {
        let value = JSONValue.object([
            ("a", .null), ("b", .bool(true)), ("c", .bool(false)), ("d", .int(-42)), ("e", .double(36.4)),
            ("f", .string("quote \" and \\ and \n")), ("g", .array([.int(1), .double(1e-7), .array([])])),
            ("h", .object([])), ("ü", .object([("x", .int(Int64.min))])),
        ])
        var fast: [UInt8] = []
        value.appendCompact(to: &fast)
        #expect(fast == value.bytes)
    }

    @Test func stateJSONMatchesTheObjectItStandsFor() {
        let record = passiveRecord()
        #expect(record.stateJSON() == JSONValue.object([]).bytes)
        record.merge(
            GATTReading([GATTField("temperature", .double(21.5)), GATTField("count", .int(3))]), now: .seconds(1),
            wall: 1_796_083_200.25)
        record.data.withLock { $0.rssi = -61 }
        let expected = JSONValue.object([
            ("temperature", .double(21.5)), ("count", .int(3)), ("rssi", .int(-61)),
            ("last_seen", .string(iso8601(1_796_083_200.25))),
        ])
        #expect(record.stateJSON() == expected.bytes)
    }

    /// `merge` looks at the k-th field first (a parser repeats its order); readings of other sources, or in
    /// another order, still replace the field of that name and append only new names.
    @Test func mergeKeepsOneFieldPerNameInFirstSeenOrder() {
        let record = passiveRecord()
        func merge(_ fields: [(String, Int64)]) {
            record.merge(GATTReading(fields.map { GATTField($0.0, .int($0.1)) }), now: .seconds(1), wall: 0)
        }
        merge([("a", 1), ("b", 2), ("c", 3)])
        merge([("a", 4), ("b", 5), ("c", 6)])  // same order
        merge([("battery", 90)])  // another source: its k-th is not there
        merge([("c", 7), ("a", 8)])  // another order
        merge([("b", 9), ("battery", 80), ("d", 10)])
        let fields = record.data.withLock { $0.fields.map { ($0.0, $0.1) } }
        #expect(fields.map(\.0) == ["a", "b", "c", "battery", "d"])
        #expect(fields.map(\.1) == [.int(8), .int(9), .int(7), .int(80), .int(10)])
    }
}
