import BlueZ
// `blebridge scan`: nearby devices with their advertisement fields, decoded where a parser exists.
import BridgeKit
import GATT

/// Scans for advertising devices and prints what each advertised.
public enum ScanCommand: CLICommand {
    /// The subcommand's name on the command line.
    public static let name = "scan"
    /// One line for `blebridge --help`.
    public static let summary = "list nearby BLE devices and their decoded advertisements"
    /// The subcommand's help text.
    public static let usage = """
        usage: blebridge scan [--service UUID]... [--duration S] [--json] [--passive] [--rssi DBM] [--duplicates]

        Scans for S seconds (default 5), then prints every device seen: address, name, RSSI, services,
        manufacturer and service data, and the advertisement decoded where a parser exists.
          --service UUID      only devices advertising this service (repeatable)
          --duration S        scan time in seconds (default 5)
          --json              print one JSON document
          --passive           passive scanning (needs bluetoothd --experimental; falls back to active)
          --rssi DBM          only devices at least this strong
          --duplicates        ask BlueZ for every advertisement (DuplicateData), not only changed ones
        \(BLECommon.usage)
        """

    /// Runs the subcommand with its arguments (after the name) and returns the exit code.
    public static func run(_ arguments: [String]) async -> Int32 {
        await runBLE(name) { () async throws(BLEFailure) -> Int32 in
            let args = try BLEArguments(
                arguments, valued: BLECommon.valued.union(["--service", "--duration", "--rssi"]),
                flags: BLECommon.flags.union(["--json", "--passive", "--duplicates"]))
            guard args.positional.isEmpty else { throw .usage("unexpected argument '\(args.positional[0])'") }
            let services = args.values["--service"] ?? []
            for s in services where bluezUUIDString(s) == nil { throw .usage("--service: '\(s)' is not a UUID") }
            var rssi: Int16?
            if let text = args.value("--rssi") {
                guard let v = Int16(text) else { throw .usage("--rssi: '\(text)' is not a number of dBm") }
                rssi = v
            }
            let duration = try args.seconds("--duration", default: 5)
            let session = try await BLESession.open(args)
            defer { session.client.close() }
            let filter = BlueZDiscoveryFilter(
                serviceUUIDs: services, rssiThreshold: rssi, duplicateData: args.flags.contains("--duplicates"),
                passive: args.flags.contains("--passive"),
                watchdogInterval: nil)
            let discovery: BlueZDiscovery
            do {
                discovery = try await session.client.startDiscovery(on: session.adapter, filter: filter)
            } catch {
                throw BLEFailure(error)
            }
            let devices = await collect(discovery, for: duration)
            await discovery.stop()
            let registry = bleRegistry()
            let sorted = devices.values.sorted { $0.address < $1.address }
            if args.flags.contains("--json") {
                writeOut(BLEJSON.array(sorted.map { deviceJSON($0, registry: registry) }).text)
            } else {
                if sorted.isEmpty { writeOut("no devices found on \(session.adapter.name)") }
                for d in sorted { writeOut(deviceText(d, registry: registry)) }
            }
            return ExitCode.success
        }
    }

    /// The latest state of every device reported during `duration` seconds.
    static func collect(_ discovery: BlueZDiscovery, for duration: Double) async -> [String: BlueZDevice] {
        await withTaskGroup(of: [String: BlueZDevice]?.self) { group in
            let seen = SeenDevices()
            group.addTask {
                for await event in discovery.events {
                    switch event {
                    case .appeared(let d), .updated(let d): await seen.put(d)
                    case .lost: break
                    }
                }
                return nil
            }
            group.addTask {
                try? await Task.sleep(for: seconds(duration))
                return await seen.all
            }
            var result: [String: BlueZDevice] = [:]
            for await r in group {
                if let r {
                    result = r
                    group.cancelAll()
                    break
                }
            }
            return result
        }
    }

    actor SeenDevices {
        var all: [String: BlueZDevice] = [:]
        func put(_ d: BlueZDevice) {
            var d = d
            // Keep the last RSSI seen when a later update invalidated it.
            if d.rssi == nil { d.rssi = all[d.address]?.rssi }
            all[d.address] = d
        }
    }

    struct DecodedAdvertisement {
        var source: String
        var parser: String
        var reading: GATTReading?
        var error: String?
    }

    static func decoded(_ d: BlueZDevice, registry: GATTParserRegistry) -> [DecodedAdvertisement] {
        var out: [DecodedAdvertisement] = []
        let context = AdvertisementContext(mac: d.address, localName: d.name)
        for (uuid, payload) in d.serviceData.sorted(by: { $0.key < $1.key }) {
            guard let id = BluetoothUUID(uuid), let parser = registry.parser(for: .serviceData(id)) else { continue }
            do {
                let r = try registry.decode(.serviceData(id), payload, context: context)
                out.append(.init(source: "service data \(id)", parser: parser.name, reading: r))
            } catch {
                out.append(.init(source: "service data \(id)", parser: parser.name, error: error.description))
            }
        }
        for (company, payload) in d.manufacturerData.sorted(by: { $0.key < $1.key }) {
            guard let parser = registry.parser(for: .manufacturer(company)) else { continue }
            let source = AdvertisementSource.manufacturer(company)
            do {
                let r = try registry.decode(source, payload, context: context)
                out.append(.init(source: source.description, parser: parser.name, reading: r))
            } catch {
                out.append(.init(source: source.description, parser: parser.name, error: error.description))
            }
        }
        return out
    }

    static func companyHex(_ id: UInt16) -> String {
        let h = String(id, radix: 16, uppercase: true)
        return "0x" + String(repeating: "0", count: 4 - h.count) + h
    }

    static func deviceText(_ d: BlueZDevice, registry: GATTParserRegistry) -> String {
        var line = "\(d.address)  \(d.name ?? "(no name)")"
        if let rssi = d.rssi { line += "  RSSI \(rssi) dBm" }
        if let tx = d.txPower { line += "  TX \(tx) dBm" }
        line += "  (\(d.addressType))"
        var lines = [line]
        if !d.uuids.isEmpty { lines.append("  services: " + d.uuids.map(displayUUID).joined(separator: ", ")) }
        for (company, payload) in d.manufacturerData.sorted(by: { $0.key < $1.key }) {
            lines.append("  manufacturer \(companyHex(company)): \(hexBytes(payload))")
        }
        for (uuid, payload) in d.serviceData.sorted(by: { $0.key < $1.key }) {
            lines.append("  service data \(displayUUID(uuid)): \(hexBytes(payload))")
        }
        for a in decoded(d, registry: registry) {
            if let r = a.reading {
                lines.append("  \(a.parser) (\(a.source)): \(readingJSON(r))")
            } else {
                lines.append("  \(a.parser) (\(a.source)): cannot decode: \(a.error ?? "")")
            }
        }
        return lines.joined(separator: "\n")
    }

    static func deviceJSON(_ d: BlueZDevice, registry: GATTParserRegistry) -> BLEJSON {
        var fields: [(String, BLEJSON)] = [
            ("address", .string(d.address)), ("address_type", .string(d.addressType)),
            ("name", d.name.map(BLEJSON.string) ?? .null),
            ("rssi", d.rssi.map { .int(Int64($0)) } ?? .null),
            ("tx_power", d.txPower.map { .int(Int64($0)) } ?? .null),
            ("services", .array(d.uuids.map { .string(displayUUID($0)) })),
            (
                "manufacturer_data",
                .object(
                    d.manufacturerData.sorted(by: { $0.key < $1.key }).map {
                        (companyHex($0.key), .string(hexBytes($0.value)))
                    })
            ),
            (
                "service_data",
                .object(
                    d.serviceData.sorted(by: { $0.key < $1.key }).map {
                        (displayUUID($0.key), .string(hexBytes($0.value)))
                    })
            ),
        ]
        let decoded = decoded(d, registry: registry).map { a -> BLEJSON in
            var f: [(String, BLEJSON)] = [("source", .string(a.source)), ("parser", .string(a.parser))]
            if let r = a.reading { f.append(("reading", BLEJSON(r))) }
            if let e = a.error { f.append(("error", .string(e))) }
            return .object(f)
        }
        fields.append(("decoded", .array(decoded)))
        return .object(fields)
    }
}
