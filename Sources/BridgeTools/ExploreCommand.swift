import BlueZ
// `blebridge explore`: connect and print the GATT tree with current values, decoded where a parser exists.
import BridgeKit
import GATT

/// Connects to a device and prints its services, characteristics, descriptors and readable values.
public enum ExploreCommand: CLICommand {
    /// The subcommand's name on the command line.
    public static let name = "explore"
    /// One line for `blebridge --help`.
    public static let summary = "connect and print a device's GATT tree with decoded values"
    /// The subcommand's help text.
    public static let usage = """
        usage: blebridge explore ADDRESS [--json]

        Connects, then prints every service, characteristic (with its properties), descriptor, and the current
        value of each readable characteristic: decoded where a parser exists, raw hex otherwise.
          --json              print one JSON document
        \(BLECommon.usage)
        """

    struct CharacteristicReport {
        var characteristic: BlueZCharacteristic
        var parser: String?
        var value: [UInt8]?
        var reading: GATTReading?
        var decodeError: String?
        var readError: String?
        var descriptors: [(BlueZDescriptor, [UInt8]?)]
    }

    /// Runs the subcommand with its arguments (after the name) and returns the exit code.
    public static func run(_ arguments: [String]) async -> Int32 {
        await runBLE(name) { () async throws(BLEFailure) -> Int32 in
            let args = try BLEArguments(arguments, valued: BLECommon.valued, flags: BLECommon.flags.union(["--json"]))
            guard args.positional.count == 1 else { throw .usage("expected ADDRESS\n\n\(usage)") }
            let address = try parseAddress(args.positional[0])
            let session = try await BLESession.open(args)
            defer { session.client.close() }
            let peripheral = try await session.connect(address, args: args)
            let registry = bleRegistry()
            var tree: [(BlueZService, [CharacteristicReport])] = []
            for service in peripheral.services() {
                var reports: [CharacteristicReport] = []
                for c in peripheral.characteristics(of: service) {
                    reports.append(await report(c, peripheral: peripheral, registry: registry))
                }
                tree.append((service, reports))
            }
            let device = peripheral.device
            let mtu = peripheral.mtu
            await peripheral.disconnect()
            if args.flags.contains("--json") {
                writeOut(json(peripheral.label, device: device, mtu: mtu, tree).text)
            } else {
                writeOut(text(peripheral.label, mtu: mtu, tree))
            }
            return ExitCode.success
        }
    }

    static func report(_ c: BlueZCharacteristic, peripheral: BlueZPeripheral, registry: GATTParserRegistry) async
        -> CharacteristicReport
    {
        var r = CharacteristicReport(
            characteristic: c, parser: BluetoothUUID(c.uuid).flatMap { registry.parser(for: $0)?.name },
            descriptors: [])
        var presentation: [UInt8]?
        for d in peripheral.descriptors(of: c) {
            var value: [UInt8]?
            if d.flags.isEmpty || d.flags.contains("read") {
                value = try? await peripheral.read(d, timeout: .seconds(5))
            }
            if BluetoothUUID(d.uuid) == BluetoothUUID(UInt16(0x2904)) { presentation = value }
            r.descriptors.append((d, value))
        }
        guard c.canRead else { return r }
        do {
            let bytes = try await peripheral.read(c)
            r.value = bytes
            let (reading, error) = decodeValue(c.uuid, bytes, registry: registry, presentationFormat: presentation)
            if r.parser != nil || presentation != nil {
                r.reading = reading
                r.decodeError = error
            }
        } catch {
            r.readError = error.description
        }
        return r
    }

    static func text(_ label: BlueZDeviceLabel, mtu: Int?, _ tree: [(BlueZService, [CharacteristicReport])]) -> String {
        var lines = ["device \(label)" + (mtu.map { ", MTU \($0)" } ?? "")]
        for (service, reports) in tree {
            lines.append("service \(displayUUID(service.uuid))" + (service.primary ? " (primary)" : " (secondary)"))
            for r in reports {
                let c = r.characteristic
                var line = "  characteristic \(displayUUID(c.uuid))"
                if let p = r.parser { line += " \(p)" }
                line += " [\(c.flags.joined(separator: ", "))]"
                lines.append(line)
                for (d, value) in r.descriptors {
                    lines.append("    descriptor \(displayUUID(d.uuid))" + (value.map { ": \(hexBytes($0))" } ?? ""))
                }
                if let e = r.readError {
                    lines.append("    value: \(e)")
                } else if let v = r.value {
                    if let reading = r.reading {
                        lines.append("    value: \(hexBytes(v)) -> \(readingJSON(reading))")
                    } else if let e = r.decodeError {
                        lines.append("    value: \(hexBytes(v)) (cannot decode: \(e))")
                    } else {
                        lines.append("    value: \(hexBytes(v))")
                    }
                }
            }
        }
        return lines.joined(separator: "\n")
    }

    static func json(
        _ label: BlueZDeviceLabel, device: BlueZDevice?, mtu: Int?, _ tree: [(BlueZService, [CharacteristicReport])]
    ) -> BLEJSON {
        let services = tree.map { service, reports -> BLEJSON in
            let chars = reports.map { r -> BLEJSON in
                let c = r.characteristic
                var f: [(String, BLEJSON)] = [
                    ("uuid", .string(displayUUID(c.uuid))), ("uuid128", .string(c.uuid)),
                    ("parser", r.parser.map(BLEJSON.string) ?? .null),
                    ("properties", .array(c.flags.map(BLEJSON.string))),
                    (
                        "descriptors",
                        .array(
                            r.descriptors.map { d, v in
                                .object([
                                    ("uuid", .string(displayUUID(d.uuid))),
                                    ("value", v.map { .string(hexBytes($0)) } ?? .null),
                                ])
                            })
                    ),
                ]
                if let v = r.value { f.append(("value", .string(hexBytes(v)))) }
                if let reading = r.reading { f.append(("decoded", BLEJSON(reading))) }
                if let e = r.decodeError { f.append(("decode_error", .string(e))) }
                if let e = r.readError { f.append(("read_error", .string(e))) }
                return .object(f)
            }
            return .object([
                ("uuid", .string(displayUUID(service.uuid))), ("uuid128", .string(service.uuid)),
                ("primary", .bool(service.primary)), ("characteristics", .array(chars)),
            ])
        }
        return .object([
            ("address", .string(label.address)), ("name", label.name.map(BLEJSON.string) ?? .null),
            ("address_type", device.map { .string($0.addressType) } ?? .null),
            ("mtu", mtu.map { .int(Int64($0)) } ?? .null), ("services", .array(services)),
        ])
    }
}
