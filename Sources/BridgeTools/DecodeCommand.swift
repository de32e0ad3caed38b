// `blebridge decode`: decodes one characteristic value or advertisement payload with the parser registry and prints
// one JSON object. The contract other tools and tests rely on:
//   success -> exactly one JSON object on stdout, exit 0
//   a payload that must be rejected -> nothing on stdout, one line on stderr naming the parser and offset, exit 65
//   unknown UUID or company -> {"raw": "<hex>"}, exit 0
//   bad usage -> usage text on stderr, exit 64
import BridgeKit
import GATT
import GATTCrypto

/// `blebridge decode gatt|service-data|manufacturer ...`
public enum DecodeCommand: CLICommand {
    /// The subcommand's name on the command line.
    public static let name = "decode"
    /// One line for `blebridge --help`.
    public static let summary = "decode a characteristic value or advertisement payload to JSON"
    /// The subcommand's help text.
    public static let usage = """
        usage: blebridge decode gatt UUID HEX [--presentation-format HEX]
               blebridge decode service-data UUID HEX [--mac MAC] [--bindkey HEX] [--name NAME]
               blebridge decode manufacturer COMPANY_ID HEX [--mac MAC] [--bindkey HEX] [--name NAME]

        Decodes HEX (the value octets; for advertisements, the data after the 16-bit UUID or company id) and prints
        one JSON object. UUID: 2A37, 0x2a37, 00002a37, a full 128-bit UUID, or a parser name
        (heart_rate_measurement). COMPANY_ID: hex, e.g. 0499 or 0x004C.

        options:
          --presentation-format HEX  a 0x2904 descriptor value; decodes a characteristic without a parser of its own
          --mac MAC                  the advertiser address (AA:BB:CC:DD:EE:FF), needed by some formats
          --bindkey HEX              the AES key for encrypted advertisements
          --name NAME                the advertised local name

        exit status: 0 decoded (unknown UUIDs give {"raw": "<hex>"}), 65 payload rejected, 64 bad usage
        """

    /// Runs the subcommand with its arguments (after the name) and returns the exit code.
    public static func run(_ arguments: [String]) async -> Int32 {
        switch parse(arguments) {
        case .failure(let problem):
            writeErr("blebridge decode: \(problem.text)\n\n\(usage)")
            return ExitCode.usage
        case .success(let request):
            return execute(request)
        }
    }

    enum Kind: String {
        case gatt
        case serviceData = "service-data"
        case manufacturer
    }

    struct Request {
        var kind: Kind
        var target: String
        var payload: [UInt8]
        var presentationFormat: [UInt8]?
        var mac: String?
        var bindKey: [UInt8]?
        var localName: String?
    }

    /// A usage problem, as text.
    struct UsageProblem: Error {
        let text: String
        init(_ text: String) { self.text = text }
    }

    static func parse(_ arguments: [String]) -> Result<Request, UsageProblem> {
        var positional: [String] = []
        var options: [String: String] = [:]
        let known: Set<String> = ["--presentation-format", "--mac", "--bindkey", "--name"]
        var index = 0
        while index < arguments.count {
            let argument = arguments[index]
            if argument.hasPrefix("--") {
                var key = argument
                var value: String?
                if let equals = argument.firstIndex(of: "=") {
                    key = String(argument[..<equals])
                    value = String(argument[argument.index(after: equals)...])
                }
                guard known.contains(key) else { return .failure(.init("unknown option '\(key)'")) }
                if value == nil {
                    index += 1
                    guard index < arguments.count else { return .failure(.init("\(key) needs a value")) }
                    value = arguments[index]
                }
                options[key] = value
            } else {
                positional.append(argument)
            }
            index += 1
        }
        guard positional.count == 3 else {
            return .failure(.init("expected KIND TARGET HEX, got \(positional.count) argument(s)"))
        }
        guard let kind = Kind(rawValue: positional[0]) else {
            return .failure(.init("unknown kind '\(positional[0])' (gatt, service-data or manufacturer)"))
        }
        guard let payload = bytesFromHex(positional[2]) else {
            return .failure(.init("'\(positional[2])' is not hex"))
        }
        var request = Request(kind: kind, target: positional[1], payload: payload)
        if let text = options["--presentation-format"] {
            guard kind == .gatt else { return .failure(.init("--presentation-format is for 'gatt' only")) }
            guard let bytes = bytesFromHex(text) else {
                return .failure(.init("--presentation-format '\(text)' is not hex"))
            }
            request.presentationFormat = bytes
        }
        for key in ["--mac", "--bindkey", "--name"] where options[key] != nil && kind == .gatt {
            return .failure(.init("\(key) is for advertisements only"))
        }
        if let mac = options["--mac"] {
            guard isMACAddress(mac) else { return .failure(.init("--mac '\(mac)' is not AA:BB:CC:DD:EE:FF")) }
            request.mac = mac.uppercased()
        }
        if let text = options["--bindkey"] {
            guard let key = bytesFromHex(text), !key.isEmpty else {
                return .failure(.init("--bindkey '\(text)' is not hex"))
            }
            request.bindKey = key
        }
        request.localName = options["--name"]
        return .success(request)
    }

    static func execute(_ request: Request) -> Int32 {
        let registry: GATTParserRegistry
        do {
            registry = try GATTParserRegistry.builtIn()
        } catch {
            writeErr("blebridge decode: parser registry: \(error.description)")
            return ExitCode.failure
        }
        switch request.kind {
        case .gatt:
            let uuid: BluetoothUUID
            if let parsed = BluetoothUUID(request.target) {
                uuid = parsed
            } else if let parser = registry.parser(named: request.target), let first = parser.uuids.first {
                uuid = first
            } else {
                writeErr("blebridge decode: '\(request.target)' is neither a UUID nor a parser name\n\n\(usage)")
                return ExitCode.usage
            }
            do {
                let reading = try registry.decode(
                    uuid, request.payload, context: GATTDecodeContext(presentationFormat: request.presentationFormat))
                writeOut(reading.jsonString)
                return ExitCode.success
            } catch {
                writeErr("blebridge decode: \(error.description)")
                return ExitCode.dataError
            }
        case .serviceData, .manufacturer:
            let source: AdvertisementSource
            if request.kind == .serviceData {
                guard let uuid = BluetoothUUID(request.target) else {
                    writeErr("blebridge decode: '\(request.target)' is not a UUID\n\n\(usage)")
                    return ExitCode.usage
                }
                source = .serviceData(uuid)
            } else {
                guard let company = companyID(request.target) else {
                    writeErr("blebridge decode: '\(request.target)' is not a company id (hex, 0000...FFFF)\n\n\(usage)")
                    return ExitCode.usage
                }
                source = .manufacturer(company)
            }
            let context = AdvertisementContext(
                mac: request.mac, bindKey: request.bindKey, localName: request.localName, cipher: defaultCipher)
            do {
                let reading = try registry.decode(source, request.payload, context: context)
                writeOut(reading.jsonString)
                return ExitCode.success
            } catch {
                let parserName = registry.parser(for: source)?.name ?? "advertisement"
                writeErr("blebridge decode: \(parserName) (\(source)): \(error.description)")
                return ExitCode.dataError
            }
        }
    }

    /// The AES-CCM implementation for encrypted advertisements (libcrypto).
    static var defaultCipher: (any AESCCMCipher)? { OpenSSLAESCCM() }

    /// `0499`, `0x0499`, `499` -> 0x0499.
    static func companyID(_ text: String) -> UInt16? {
        var digits = Substring(text)
        if digits.hasPrefix("0x") || digits.hasPrefix("0X") { digits = digits.dropFirst(2) }
        guard !digits.isEmpty, digits.count <= 4 else { return nil }
        return UInt16(digits, radix: 16)
    }

    /// Six colon-separated hex octets.
    static func isMACAddress(_ text: String) -> Bool {
        let parts = text.split(separator: ":", omittingEmptySubsequences: false)
        return parts.count == 6 && parts.allSatisfy { $0.count == 2 && UInt8($0, radix: 16) != nil }
    }
}
