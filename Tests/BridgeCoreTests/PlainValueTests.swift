// `/set/<name>` with a plain payload (what Home Assistant's text entities send): the payload is the value, whatever
// it looks like.
import BridgeCore
import GATT
import Testing

@Suite struct PlainValueTests {
    static let config = """
        mqtt: {url: mqtt://127.0.0.1:1883}
        parsers:
          - name: nus_rx
            uuid: 6e400002-b5a3-f393-e0a9-e50e24dcca9e
            fields:
              - {name: message, type: utf8, offset: 0}
        devices:
          - name: echo
            match: {address: "D0:12:34:56:78:9A"}
            mode: connected
            writable:
              - message
              - {name: raw_cmd, characteristic: "6e400005-b5a3-f393-e0a9-e50e24dcca9e"}
        """

    static func setup(_ central: FakeCentral) throws {
        let service = try uuid("6e400001-b5a3-f393-e0a9-e50e24dcca9e")
        central.addDevice(
            try address(Radiator.addressText),
            [
                characteristic(try uuid("6e400002-b5a3-f393-e0a9-e50e24dcca9e"), service: service, ["write"]),
                characteristic(try uuid("6e400005-b5a3-f393-e0a9-e50e24dcca9e"), service: service, ["write"]),
            ])
    }

    func connect(_ h: BridgeHarness) async throws -> FakeLink {
        let a = try address(Radiator.addressText)
        h.central.advertise(a)
        try await h.mqtt.waitForMessage(on: "blebridge/echo/availability") { $0.text.contains("online") }
        return try #require(h.central.links(to: a).first)
    }

    @Test func textFieldTakesTheTextAsIs() async throws {
        try await withBridge(Self.config, setup: Self.setup) { h in
            let link = try await connect(h)
            let hello = try await h.command("blebridge/echo/set/message", "hello")
            #expect(hello["status"] == .string("ok"), "\(hello.text)")
            let digits = try await h.command("blebridge/echo/set/message", "42")
            #expect(digits["status"] == .string("ok"), "\(digits.text)")
            let word = try await h.command("blebridge/echo/set/message", "true")
            #expect(word["status"] == .string("ok"), "\(word.text)")
            #expect(link.writes.map(\.value) == [Array("hello".utf8), Array("42".utf8), Array("true".utf8)])
        }
    }

    @Test func rawValueIsHexEvenWhenItIsAllDigits() async throws {
        try await withBridge(Self.config, setup: Self.setup) { h in
            let link = try await connect(h)
            let letters = try await h.command("blebridge/echo/set/raw_cmd", "0a1b")
            #expect(letters["status"] == .string("ok"), "\(letters.text)")
            let digits = try await h.command("blebridge/echo/set/raw_cmd", "1234")
            #expect(digits["status"] == .string("ok"), "\(digits.text)")
            #expect(link.writes.map(\.value) == [[0x0A, 0x1B], [0x12, 0x34]])
            let odd = try await h.command("blebridge/echo/set/raw_cmd", "abc")
            #expect(odd["status"] == .string("error"))
        }
    }
}
