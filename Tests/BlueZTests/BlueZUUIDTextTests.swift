// UUID text from the command line or config: only ASCII hex digits count (Character.isHexDigit also accepts the
// fullwidth forms, which produced a "UUID" BlueZ rejects later with a less helpful error).
import BlueZ
import Testing

@Suite struct BlueZUUIDTextTests {
    @Test func fullwidthDigitsAreNotAUUID() {
        #expect(bluezUUIDString("\u{FF11}\u{FF18}\u{FF10}\u{FF24}") == nil)
        #expect(bluezUUIDString("0000180\u{FF24}") == nil)
        #expect(bluezUUIDString("180D") == "0000180d-0000-1000-8000-00805f9b34fb")
        #expect(bluezUUIDString("0x2a37") == "00002a37-0000-1000-8000-00805f9b34fb")
    }
}
