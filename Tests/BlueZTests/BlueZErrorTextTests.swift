// Error texts people read say what happened, to which thing, and what to do (STYLE.md).
import BlueZ
import Testing

@Suite struct BlueZErrorTextTests {
    private let device = BlueZDeviceLabel(address: "A4:C1:38:00:11:22", name: "kitchen-thermo")

    @Test func bluetoothdUnavailableSaysWhatToDo() {
        let text = BlueZError.bluetoothdUnavailable(reason: "org.bluez has no owner").description
        #expect(
            text == "bluetoothd (org.bluez) is not available: org.bluez has no owner; start it (systemctl start "
                + "bluetooth) or check that it runs on this bus")
    }

    @Test func busUnavailableSaysWhatToCheck() {
        let failure = BlueZDBusFailure(name: "org.freedesktop.DBus.Error.FileNotFound", message: "no socket")
        let text = BlueZError.busUnavailable(failure).description
        #expect(
            text.hasPrefix("cannot reach the D-Bus system bus: org.freedesktop.DBus.Error.FileNotFound no socket; "))
        #expect(text.contains("DBUS_SYSTEM_BUS_ADDRESS"))
    }

    @Test func notConnectedNamesTheDeviceAndTheRemedy() {
        let text = BlueZError.notConnected(device: device, operation: "read 2A19", failure: nil).description
        #expect(
            text
                == "device kitchen-thermo (A4:C1:38:00:11:22): read 2A19 failed: not connected (connect first; the link "
                + "may have dropped)")
    }
}
