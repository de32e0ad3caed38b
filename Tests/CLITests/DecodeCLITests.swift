// `blebridge decode` through the built binary: every vector (GATT and advertisement) decodes to the expected JSON
// or is rejected with exit 65, and the usage contract holds.
import Foundation
import TestSupport
import Testing

func blebridge(_ arguments: [String]) async throws -> (status: Int32, stdout: String, stderr: String) {
    try await runCommand(Fixtures.executable("blebridge"), arguments, timeout: 30)
}

/// The command line for a vector.
func decodeArguments(_ vector: GATTVector) -> [String] {
    if vector.kind == "gatt" { return ["decode", "gatt", vector.uuid, vector.payloadHex] }
    var arguments = [
        "decode", vector.isManufacturerData ? "manufacturer" : "service-data", vector.uuid, vector.payloadHex,
    ]
    if let mac = vector.param("mac") { arguments += ["--mac", mac] }
    if let key = vector.param("bindkey") { arguments += ["--bindkey", key] }
    if let name = vector.param("name") { arguments += ["--name", name] }
    return arguments
}

@Suite struct DecodeCLITests {
    @Test(arguments: GATTVectors.all)
    func vectorThroughTheBinary(_ vector: GATTVector) async throws {
        let result = try await blebridge(decodeArguments(vector))
        if vector.mustReject {
            #expect(result.status == 65, "\(vector.id): exit \(result.status), stdout \(result.stdout)")
            #expect(result.stdout.isEmpty, "\(vector.id)")
            let lines = result.stderr.split(separator: "\n")
            #expect(lines.count == 1, "\(vector.id): \(result.stderr)")
            return
        }
        #expect(result.status == 0, "\(vector.id): \(result.stderr)")
        #expect(result.stdout.hasSuffix("}\n") && result.stdout.split(separator: "\n").count == 1, "\(vector.id)")
        let json = try JSONValue.parse(result.stdout)
        #expect(json["raw"] == nil, "\(vector.id): no parser")
        let mismatch = jsonMismatch(
            expected: .object(vector.expected), actual: json, tolerance: vector.absoluteTolerance)
        #expect(mismatch == nil, "\(vector.id): \(mismatch ?? "") in \(result.stdout)")

        if let valueHex = vector.param("value_hex"), let unit = vector.param("value_unit"),
            let expected = vector.params?["value_expected"]
        {
            let value = try await blebridge([
                "decode", "gatt", "f000aa01-0451-4000-b000-000000000000", valueHex, "--presentation-format",
                vector.payloadHex,
            ])
            #expect(value.status == 0, "\(value.stderr)")
            let decoded = try JSONValue.parse(value.stdout)
            #expect(decoded["unit"] == .string(unit))
            guard case .object(let fields) = decoded, let field = fields.keys.first(where: { $0.hasPrefix("value") })
            else {
                Issue.record("no value field in \(value.stdout)")
                return
            }
            #expect(jsonMismatch(expected: expected, actual: fields[field], tolerance: vector.absoluteTolerance) == nil)
        }
    }

    @Test func rejectionNamesCharacteristicAndOffset() async throws {
        let result = try await blebridge(["decode", "gatt", "2A37", "170101"])
        #expect(result.status == 65)
        #expect(result.stdout.isEmpty)
        #expect(
            result.stderr
                == "blebridge decode: heart_rate_measurement (2A37): truncated at offset 3: needed 2 octet(s), 0 available\n"
        )
        let long = try await blebridge(["decode", "gatt", "2A19", "6400"])
        #expect(long.status == 65 && long.stdout.isEmpty)
        #expect(long.stderr.hasPrefix("blebridge decode: battery_level (2A19): invalid length 2"))
        #expect(long.stderr.contains("offset 2"))
        // Every GATT rejection names the characteristic and an offset.
        for vector in GATTVectors.gatt where vector.mustReject {
            let rejected = try await blebridge(decodeArguments(vector))
            #expect(rejected.stderr.contains("offset"), "\(vector.id): \(rejected.stderr)")
            #expect(rejected.stderr.contains("(\(vector.uuid))"), "\(vector.id): \(rejected.stderr)")
        }
    }

    @Test func unknownUUIDsAndCompaniesPassThroughAsRaw() async throws {
        let gatt = try await blebridge(["decode", "gatt", "0000fff1-0000-1000-8000-00805f9b34fb", "DEADBEEF"])
        #expect(gatt.status == 0)
        #expect(gatt.stdout == "{\"raw\":\"deadbeef\"}\n")
        let manufacturer = try await blebridge(["decode", "manufacturer", "0xFFFF", "0102"])
        #expect(manufacturer.status == 0)
        #expect(manufacturer.stdout == "{\"raw\":\"0102\"}\n")
    }

    @Test(arguments: ["2A19", "2a19", "0x2A19", "00002a19", "00002a19-0000-1000-8000-00805f9b34fb", "battery_level"])
    func uuidFormsAndNames(_ target: String) async throws {
        let result = try await blebridge(["decode", "gatt", target, "64"])
        #expect(result.status == 0)
        #expect(result.stdout == "{\"battery_pct\":100}\n")
    }

    @Test func descriptorItself() async throws {
        let result = try await blebridge(["decode", "gatt", "2904", "0EFE2F27010000"])
        #expect(result.status == 0)
        #expect(try JSONValue.parse(result.stdout)["format_name"] == .string("sint16"))
    }

    @Test(arguments: [
        [String](), ["decode"], ["decode", "gatt", "2A37"], ["decode", "gatt", "2A37", "0G"],
        ["decode", "ble", "2A37", "00"],
        ["decode", "gatt", "2A37", "00", "--bogus", "1"], ["decode", "gatt", "2A37", "00", "--presentation-format"],
        ["decode", "gatt", "2A37", "00", "--mac", "AA:BB:CC:DD:EE:FF"], ["decode", "gatt", "not_a_parser", "00"],
        ["decode", "service-data", "FCD2", "40", "--mac", "AA:BB"], ["decode", "manufacturer", "12345", "00"],
        ["decode", "service-data", "FCD2", "40", "--bindkey", "xyz"], ["decode", "gatt", "2A37", "00", "extra"],
    ])
    func badUsageExits64(_ arguments: [String]) async throws {
        let result = try await blebridge(arguments)
        #expect(result.status == 64, "\(arguments): \(result.status)")
        #expect(result.stdout.isEmpty || arguments.isEmpty)
        #expect((result.stderr + result.stdout).contains("usage: blebridge"))
    }

    @Test func helpExitsZero() async throws {
        let result = try await blebridge(["decode", "--help"])
        #expect(result.status == 0)
        #expect(result.stdout.contains("blebridge decode gatt UUID HEX [--presentation-format HEX]"))
        let top = try await blebridge(["--help"])
        #expect(top.status == 0 && top.stdout.contains("decode"))
    }
}
