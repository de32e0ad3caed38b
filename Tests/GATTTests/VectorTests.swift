// Every GATT vector of Tests/Fixtures/vectors.json through the Swift API: the registry decodes it to the expected
// fields (through the JSON text, so the JSON writer is checked too) or rejects it.
import Foundation
import GATT
import TestSupport
import Testing

let sharedRegistry: GATTParserRegistry = {
    do {
        return try GATTParserRegistry.builtIn()
    } catch {
        Issue.record("the built-in registry does not start: \(error)")
        return GATTParserRegistry()
    }
}()

/// A vendor UUID that no parser handles, for presentation-format decoding.
let vendorUUID = BluetoothUUID("12345678-1234-5678-1234-56789abcdef0")!

@Suite struct VectorTests {
    @Test func fixtureHasGATTVectors() {
        #expect(GATTVectors.gatt.count >= 80)
        #expect(GATTVectors.gatt.filter(\.mustReject).count >= 15)
    }

    @Test(arguments: GATTVectors.gatt)
    func gattVector(_ vector: GATTVector) throws {
        let uuid = try #require(BluetoothUUID(vector.uuid), "vector UUID \(vector.uuid)")
        let payload = try #require(bytesFromHex(vector.payloadHex))
        if vector.mustReject {
            #expect(throws: GATTDecodeError.self, "\(vector.id) must be rejected: \(vector.error ?? "")") {
                try sharedRegistry.decode(uuid, payload)
            }
            return
        }
        let reading = try sharedRegistry.decode(uuid, payload)
        let actual = try JSONValue.parse(reading.jsonString)
        #expect(reading["raw"] == nil, "\(vector.id): no parser for \(vector.uuid)")
        let mismatch = jsonMismatch(
            expected: .object(vector.expected), actual: actual, tolerance: vector.absoluteTolerance)
        #expect(mismatch == nil, "\(vector.id): \(mismatch ?? "") in \(reading.jsonString)")

        // 0x2904 vectors also carry a characteristic value to decode with the descriptor.
        if let valueHex = vector.param("value_hex"), let unit = vector.param("value_unit") {
            let value = try #require(bytesFromHex(valueHex))
            let decoded = try sharedRegistry.decode(
                vendorUUID, value, context: GATTDecodeContext(presentationFormat: payload))
            let format = try PresentationFormat(descriptor: payload)
            let suffix = try #require(format.unitSuffix)
            let json = try JSONValue.parse(decoded.jsonString)
            let expectedValue = try #require(vector.params?["value_expected"])
            let valueMismatch = jsonMismatch(
                expected: expectedValue, actual: json["value_\(suffix)"], tolerance: vector.absoluteTolerance)
            #expect(valueMismatch == nil, "\(vector.id): \(valueMismatch ?? "") in \(decoded.jsonString)")
            #expect(json["unit"] == .string(unit))
        }
    }

    @Test func rejectionsNameTheCharacteristicAndOffset() throws {
        for vector in GATTVectors.gatt where vector.mustReject {
            let uuid = try #require(BluetoothUUID(vector.uuid))
            do {
                _ = try sharedRegistry.decode(uuid, bytesFromHex(vector.payloadHex) ?? [])
                Issue.record("\(vector.id) was accepted")
            } catch {
                let parser = try #require(sharedRegistry.parser(for: uuid))
                #expect(error.characteristic == parser.name)
                #expect(error.description.hasPrefix("\(parser.name) (\(vector.uuid)): "), "\(error)")
                #expect(error.description.contains("offset"), "\(vector.id): \(error)")
                #expect(!error.description.contains("\n"))
            }
        }
    }
}
