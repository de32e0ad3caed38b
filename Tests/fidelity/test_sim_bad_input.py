"""Hostile and malformed input: the simulator answers like BlueZ/libdbus and never crashes."""
import subprocess

from sim_fixtures import HR_STRAP, bin_dir, sim  # noqa: F401

DEV = "/org/bluez/hci0/dev_" + HR_STRAP.replace(":", "_")


def call(sim, path, method, *args, dest="org.bluez"):
    return sim.dbus_send("--print-reply", f"--dest={dest}", path, method, *args, timeout=5)


def test_unknown_object_method_and_signature(sim):
    r = call(sim, "/org/bluez/hci0/dev_00_00_00_00_00_00", "org.bluez.Device1.Connect")
    assert r.returncode != 0
    assert "org.freedesktop.DBus.Error.UnknownObject" in r.stderr

    r = call(sim, "/org/bluez/hci0", "org.bluez.Adapter1.Explode")
    assert "org.freedesktop.DBus.Error.UnknownMethod" in r.stderr

    r = call(sim, "/org/bluez/hci0", "org.bluez.Adapter1.StartDiscovery", "string:now")
    assert "org.freedesktop.DBus.Error.UnknownMethod" in r.stderr
    assert 'Method "StartDiscovery" with signature "s" on interface "org.bluez.Adapter1" doesn\'t exist' in r.stderr


def test_properties_errors(sim):
    # BlueZ's gdbus answers Get of an unknown property/interface with org.freedesktop.DBus.Error.InvalidArgs, Set of
    # an unknown property with UnknownProperty, Set of a read-only one with PropertyReadOnly.
    r = call(sim, "/org/bluez/hci0", "org.freedesktop.DBus.Properties.Get", "string:org.bluez.Adapter1",
             "string:Colour")
    assert "org.freedesktop.DBus.Error.InvalidArgs: No such property 'Colour'" in r.stderr
    r = call(sim, "/org/bluez/hci0", "org.freedesktop.DBus.Properties.Get", "string:org.bluez.Nope",
             "string:Address")
    assert "org.freedesktop.DBus.Error.InvalidArgs: No such interface 'org.bluez.Nope'" in r.stderr
    r = call(sim, "/org/bluez/hci0", "org.freedesktop.DBus.Properties.Set", "string:org.bluez.Adapter1",
             "string:Address", "variant:string:00:00:00:00:00:00")
    assert "org.freedesktop.DBus.Error.PropertyReadOnly: Property 'Address' is not writable" in r.stderr
    r = call(sim, "/org/bluez/hci0", "org.freedesktop.DBus.Properties.Set", "string:org.bluez.Adapter1",
             "string:Colour", "variant:string:red")
    assert "org.freedesktop.DBus.Error.UnknownProperty" in r.stderr
    r = call(sim, "/org/bluez/hci0", "org.freedesktop.DBus.Properties.Get", "string:org.bluez.Adapter1",
             "string:Powered")
    assert r.returncode == 0 and "boolean true" in r.stdout
    r = call(sim, "/org/bluez/hci0", "org.freedesktop.DBus.Properties.GetAll", "string:org.bluez.Adapter1")
    assert r.returncode == 0 and '"Roles"' in r.stdout and '"central"' in r.stdout


def test_bluez_errors(sim):
    r = call(sim, "/org/bluez/hci0", "org.bluez.Adapter1.StopDiscovery")
    assert "org.bluez.Error.Failed: No discovery started" in r.stderr
    r = call(sim, "/org/bluez/hci0", "org.bluez.Adapter1.RemoveDevice", "objpath:/org/bluez/hci0/dev_11_22_33_44_55_66")
    assert "org.bluez.Error.DoesNotExist" in r.stderr
    # a{ss} is not a{sv}: gdbus rejects the signature before BlueZ sees the call.
    r = call(sim, "/org/bluez/hci0", "org.bluez.Adapter1.SetDiscoveryFilter",
             "dict:string:string:Transport,carrier-pigeon")
    assert ('org.freedesktop.DBus.Error.UnknownMethod: Method "SetDiscoveryFilter" with signature "a{ss}" on '
            'interface "org.bluez.Adapter1" doesn\'t exist') in r.stderr


def test_garbage_to_the_control_interface(sim):
    cases = [
        ("AddPeripheral", "string:{address: nope}"),
        ("AddPeripheral", "string:[[[["),
        ("AddPeripheral", "string:"),
        ("SetAdvertisement", f"string:{HR_STRAP}", "string:{rssi: 1000}"),
        ("SetAdvertisement", f"string:{HR_STRAP}", "string:{address: \"00:11:22:33:44:55\"}"),
        ("PushNotification", "string:zz", "string:2A37", "array:byte:1"),
        ("PushNotification", f"string:{HR_STRAP}", "string:not-a-uuid", "array:byte:1"),
        ("SetNotificationRate", f"string:{HR_STRAP}", "string:2A37", "double:-5"),
        ("InjectFault", f"string:{HR_STRAP}", "string:meteor", "string:{}"),
        ("InjectFault", f"string:{HR_STRAP}", "string:read-error", "string:{count: many}"),
        ("Disconnect", f"string:{HR_STRAP}", "string:gremlins"),
        ("RestartDaemon", "double:-1"),
        ("GetWrites", "string:"),
        ("Burst", f"string:{HR_STRAP}", "string:2A37", "uint32:5"),
    ]
    for method, *args in cases:
        r = call(sim, "/org/bluez/sim", f"io.blebridge.Simulator1.{method}", *args)
        assert r.returncode != 0, (method, args, r.stdout)
        assert "Error" in r.stderr
    r = call(sim, "/org/bluez/sim", "io.blebridge.Simulator1.InjectFault", f"string:{HR_STRAP}", "string:meteor",
             "string:{}")
    assert "unknown fault" in r.stderr
    assert sim.alive()


def test_gatt_rules_over_a_raw_dbus_client(sim):
    """BlueZ's rules for GATT calls, seen by a plain D-Bus client (dbus-fast, bleak's own bus library)."""
    import asyncio

    from dbus_fast import BusType, Message, MessageType, Variant
    from dbus_fast.aio import MessageBus

    char = DEV + "/service000d/char000e"  # 2A37, notify only
    location = DEV + "/service000d/char0011"  # 2A38, read only
    cccd = char + "/desc0010"

    async def main():
        bus = await MessageBus(bus_type=BusType.SYSTEM, negotiate_unix_fd=True).connect()

        async def invoke(path, interface, member, signature="", body=()):
            reply = await bus.call(Message(destination="org.bluez", path=path, interface=interface, member=member,
                                           signature=signature, body=list(body)))
            if reply.message_type == MessageType.ERROR:
                return reply.error_name, (reply.body or [""])[0]
            return "ok", reply.body

        results = {}
        adapter = ("/org/bluez/hci0", "org.bluez.Adapter1")
        results["filter_bad_transport"] = await invoke(*adapter, "SetDiscoveryFilter", "a{sv}",
                                                       [{"Transport": Variant("s", "carrier-pigeon")}])
        results["filter_unknown_key"] = await invoke(*adapter, "SetDiscoveryFilter", "a{sv}",
                                                     [{"Colour": Variant("s", "red")}])
        results["filter_wrong_type"] = await invoke(*adapter, "SetDiscoveryFilter", "a{sv}",
                                                    [{"RSSI": Variant("s", "-70")}])
        results["filter_rssi_and_pathloss"] = await invoke(*adapter, "SetDiscoveryFilter", "a{sv}",
                                                           [{"RSSI": Variant("n", -70), "Pathloss": Variant("q", 5)}])
        results["filter_ok"] = await invoke(*adapter, "SetDiscoveryFilter", "a{sv}",
                                            [{"Transport": Variant("s", "le"), "DuplicateData": Variant("b", False)}])
        results["start"] = await invoke("/org/bluez/hci0", "org.bluez.Adapter1", "StartDiscovery")
        results["start_again"] = await invoke("/org/bluez/hci0", "org.bluez.Adapter1", "StartDiscovery")
        for _ in range(100):
            ok, _ = await invoke(DEV, "org.freedesktop.DBus.Properties", "Get", "ss", ["org.bluez.Device1", "RSSI"])
            if ok == "ok":
                break
            await asyncio.sleep(0.02)
        results["disconnect_idle"] = await invoke(DEV, "org.bluez.Device1", "Disconnect")
        results["read_before_connect"] = await invoke(location, "org.bluez.GattCharacteristic1", "ReadValue",
                                                      "a{sv}", [{}])
        results["connect"] = await invoke(DEV, "org.bluez.Device1", "Connect")
        results["connect_again"] = await invoke(DEV, "org.bluez.Device1", "Connect")
        for _ in range(100):
            ok, body = await invoke(DEV, "org.freedesktop.DBus.Properties", "Get", "ss",
                                    ["org.bluez.Device1", "ServicesResolved"])
            if ok == "ok" and body[0].value:
                break
            await asyncio.sleep(0.02)
        results["read"] = await invoke(location, "org.bluez.GattCharacteristic1", "ReadValue", "a{sv}", [{}])
        results["read_bad_offset_type"] = await invoke(location, "org.bluez.GattCharacteristic1", "ReadValue",
                                                       "a{sv}", [{"offset": Variant("s", "x")}])
        results["read_notify_only"] = await invoke(char, "org.bluez.GattCharacteristic1", "ReadValue", "a{sv}", [{}])
        results["write_command_no_flag"] = await invoke(char, "org.bluez.GattCharacteristic1", "WriteValue",
                                                        "aya{sv}", [b"\x01", {"type": Variant("s", "command")}])
        results["write_unknown_type"] = await invoke(char, "org.bluez.GattCharacteristic1", "WriteValue",
                                                     "aya{sv}", [b"\x01", {"type": Variant("s", "bogus")}])
        results["write_cccd"] = await invoke(cccd, "org.bluez.GattDescriptor1", "WriteValue", "aya{sv}",
                                             [b"\x01\x00", {}])
        results["stop_notify_none"] = await invoke(char, "org.bluez.GattCharacteristic1", "StopNotify")
        results["start_notify"] = await invoke(char, "org.bluez.GattCharacteristic1", "StartNotify")
        results["acquire_while_session"] = await invoke(char, "org.bluez.GattCharacteristic1", "AcquireNotify",
                                                        "a{sv}", [{}])
        results["start_notify_read_only"] = await invoke(location, "org.bluez.GattCharacteristic1", "StartNotify")
        results["disconnect"] = await invoke(DEV, "org.bluez.Device1", "Disconnect")
        results["read_after_disconnect"] = await invoke(location, "org.bluez.GattCharacteristic1", "ReadValue",
                                                        "a{sv}", [{}])
        ok, body = await invoke(char, "org.freedesktop.DBus.Properties", "Get", "ss",
                                ["org.bluez.GattCharacteristic1", "Notifying"])
        results["notifying_after_disconnect"] = body[0].value
        bus.disconnect()
        return results

    r = asyncio.run(main())
    invalid = ("org.bluez.Error.InvalidArguments", "Invalid arguments in method call")
    for key in ("filter_bad_transport", "filter_unknown_key", "filter_wrong_type", "filter_rssi_and_pathloss"):
        assert r[key] == invalid, key
    assert r["filter_ok"] == ("ok", [])
    assert r["start"] == ("ok", [])
    assert r["start_again"] == ("org.bluez.Error.InProgress", "Operation already in progress")
    assert r["disconnect_idle"] == ("ok", [])
    assert r["read_before_connect"][0] == "org.freedesktop.DBus.Error.UnknownObject"
    assert r["connect"] == ("ok", []) and r["connect_again"] == ("ok", [])
    assert r["read"] == ("ok", [b"\x01"])
    assert r["read_bad_offset_type"] == ("org.bluez.Error.InvalidArguments", "Invalid arguments in method call")
    assert r["read_notify_only"] == ("org.bluez.Error.NotPermitted", "Read not permitted")
    assert r["write_command_no_flag"] == ("org.bluez.Error.NotSupported", "Operation is not supported")
    assert r["write_unknown_type"] == ("org.bluez.Error.NotSupported", "Operation is not supported")
    assert r["write_cccd"] == ("org.bluez.Error.NotPermitted", "Write not permitted")
    assert r["stop_notify_none"] == ("org.bluez.Error.Failed", "No notify session started")
    assert r["start_notify"] == ("ok", [])
    assert r["acquire_while_session"][0] == "org.bluez.Error.InProgress"
    assert r["start_notify_read_only"] == ("org.bluez.Error.NotSupported", "Operation is not supported")
    assert r["disconnect"] == ("ok", [])
    assert r["read_after_disconnect"] == ("org.bluez.Error.Failed", "Not connected")
    assert r["notifying_after_disconnect"] is True  # sessions survive a disconnect
    assert sim.alive()


def test_malformed_scenario_exits_nonzero_with_key_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text('peripherals:\n  - address: "AA:BB:CC:DD:EE:FF"\n    gatt:\n      - uuid: "18G0"\n')
    r = subprocess.run([str(bin_dir() / "bluez-sim"), "--scenario", str(bad)], capture_output=True, text=True,
                       timeout=20)
    assert r.returncode != 0
    assert 'peripherals[0].gatt[0].uuid: "18G0" is not a UUID' in r.stderr


def test_missing_scenario_file(tmp_path):
    r = subprocess.run([str(bin_dir() / "bluez-sim"), "--scenario", str(tmp_path / "nope.yaml")],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode != 0 and "cannot open" in r.stderr


def test_spawn_bus_stops_its_daemon_on_sigterm():
    from sim_fixtures import start_simulator
    s = start_simulator()
    bus_socket = s.address.split("path=", 1)[1].split(",")[0]
    import os
    assert os.path.exists(bus_socket)
    s.stop()
    assert s.proc.returncode == 0
    assert not os.path.exists(bus_socket)


def test_spawned_sim_exits_when_its_bus_dies():
    import os
    import signal
    from sim_fixtures import start_simulator
    s = start_simulator()
    try:
        children = subprocess.run(["pgrep", "-P", str(s.proc.pid), "dbus-daemon"], capture_output=True, text=True)
        daemon = int(children.stdout.split()[0])
        os.kill(daemon, signal.SIGKILL)
        assert s.proc.wait(10) == 1
        from sim_fixtures import wait_until
        assert wait_until(lambda: any("lost the bus connection" in line for line in s.stderr_lines), 3)
    finally:
        s.stop()
