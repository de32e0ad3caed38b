"""BlueZ's own peripheral examples (Debian's bluez-test-scripts: example-gatt-server, example-advertisement), run
unchanged against bluez-sim: they register on GattManager1/LEAdvertisingManager1 as they would on bluetoothd,
and the simulator's remote central (io.blebridge.Simulator1.Central*) reads, writes and subscribes."""
import asyncio
import json
import os
import pathlib
import queue
import re
import subprocess
import threading

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from sim_fixtures import start_simulator, uuid16, wait_until

EXAMPLES = pathlib.Path("/usr/share/doc/bluez-test-scripts/examples")
# The examples need Debian's python3-dbus and python3-gi, which only the system interpreter has.
SYSTEM_PYTHON = "/usr/bin/python3"
CENTRAL = "5C:F3:70:00:00:01"
TEST_CHRC = "12345678-1234-5678-1234-56789abcdef1"
TEST_DESC = "12345678-1234-5678-1234-56789abcdef2"
ENCRYPT_CHRC = "12345678-1234-5678-1234-56789abcdef3"


class Example:
    """One example program on the simulator's bus, its stdout collected line by line."""

    def __init__(self, name: str, env: dict, argv=None):
        self.proc = subprocess.Popen(argv or [SYSTEM_PYTHON, "-u", str(EXAMPLES / name)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.seen: list = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            # bluetoothctl's colours and readline's invisible-prompt markers.
            line = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line)
            self.lines.put(re.sub(r"[\r\x01\x02]", "", line).rstrip("\n"))

    def send(self, text: str):
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def wait_for(self, text: str, timeout: float = 15) -> str:
        """Returns the first line containing `text` (lines are read as the program prints them)."""
        for line in self.seen:
            if text in line:
                return line
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"{text!r} not printed within {timeout}s; output so far: {self.seen}")
            self.seen.append(line)
            if text in line:
                return line

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Control:
    """Typed calls of io.blebridge.Simulator1 (dbus-fast, so byte arrays and errors come back as values)."""

    def __init__(self, address: str):
        self.address = address

    def call(self, member: str, signature: str = "", *body):
        async def main():
            bus = await MessageBus(bus_address=self.address).connect()
            try:
                return await bus.call(Message(destination="org.bluez", path="/org/bluez/sim",
                                              interface="io.blebridge.Simulator1", member=member,
                                              signature=signature, body=list(body)))
            finally:
                bus.disconnect()

        reply = asyncio.run(main())
        if reply.message_type == MessageType.ERROR:
            raise ControlError(reply.error_name, reply.body[0] if reply.body else "")
        return reply.body

    def counters(self) -> dict:
        return {k: v.value for k, v in self.call("GetCounters")[0].items()}


class ControlError(Exception):
    def __init__(self, name, message):
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


@pytest.fixture
def world():
    if not (EXAMPLES / "example-gatt-server").exists():
        raise AssertionError("bluez-test-scripts is not installed; run scripts/install-deps.sh")
    sim = start_simulator("adapters:\n  - id: hci0\n    address: \"00:1A:7D:DA:71:10\"\n")
    env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=sim.address)
    started = []
    yield sim, env, Control(sim.address), started
    for example in started:
        example.stop()
    sim.stop()


def start(started, name, env, argv=None) -> Example:
    example = Example(name, env, argv)
    started.append(example)
    return example


def test_example_gatt_server_served_to_a_remote_central(world):
    sim, env, control, started = world
    server = start(started, "example-gatt-server", env)
    server.wait_for("GATT application registered")

    apps = json.loads(control.call("GetLocalGatt", "s", "")[0])
    assert len(apps) == 1 and apps[0]["path"] == "/"
    services = {s["uuid"]: s for s in apps[0]["services"]}
    assert set(services) == {uuid16("180d"), uuid16("180f"), "12345678-1234-5678-1234-56789abcdef0"}
    hr = {c["uuid"]: c for c in services[uuid16("180d")]["characteristics"]}
    assert hr[uuid16("2a37")]["flags"] == ["notify"]
    assert hr[uuid16("2a39")]["flags"] == ["write"]
    test = services["12345678-1234-5678-1234-56789abcdef0"]["characteristics"]
    assert {d["uuid"] for d in test[0]["descriptors"]} == {TEST_DESC, uuid16("2901")}

    device = control.call("CentralConnect", "ss", "", CENTRAL)[0]
    assert device == "/org/bluez/hci0/dev_5C_F3_70_00_00_01"

    # Battery Level starts at 100 %, Body Sensor Location is "chest" (1).
    assert control.call("CentralRead", "ssu", CENTRAL, "2A19", 0)[0] == bytes([100])
    assert control.call("CentralRead", "ssu", CENTRAL, uuid16("2a38"), 0)[0] == bytes([1])

    # Write request, read back, read blob with an offset.
    control.call("CentralWrite", "ssays", CENTRAL, TEST_CHRC, b"\x01\x02\x03\x04", "request")
    assert control.call("CentralRead", "ssu", CENTRAL, TEST_CHRC, 0)[0] == b"\x01\x02\x03\x04"
    server.wait_for("TestCharacteristic Write")
    # The Characteristic User Description descriptor (read, then written and read back).
    assert control.call("CentralRead", "ssu", CENTRAL, "2901", 0)[0] == b"This is a characteristic for testing"
    control.call("CentralWrite", "ssays", CENTRAL, "2901", b"renamed", "request")
    assert control.call("CentralRead", "ssu", CENTRAL, "2901", 0)[0] == b"renamed"
    # The example's test descriptor raises a Python TypeError (dbus.Byte('T') under Python 3): an unknown error
    # name, which bluetoothd answers with Unlikely Error.
    with pytest.raises(ControlError) as broken:
        control.call("CentralRead", "ssu", CENTRAL, TEST_DESC, 0)
    assert broken.value.message.startswith("0x0e Unlikely Error: org.freedesktop.DBus.Python.TypeError")

    # The control point raises org.bluez.Error.Failed("0x80") for anything but 1: application error 0x80.
    control.call("CentralWrite", "ssays", CENTRAL, uuid16("2a39"), b"\x01", "request")
    with pytest.raises(ControlError) as failed:
        control.call("CentralWrite", "ssays", CENTRAL, uuid16("2a39"), b"\x02", "request")
    assert failed.value.name == "io.blebridge.Simulator1.Error.ATT"
    assert failed.value.message.startswith("0x80 ")
    with pytest.raises(ControlError) as length:
        control.call("CentralWrite", "ssays", CENTRAL, uuid16("2a39"), b"\x01\x01", "request")
    assert length.value.message.startswith("0x0d Invalid Attribute Value Length")
    # Body Sensor Location is read-only; an encrypt-read characteristic needs an encrypted link.
    with pytest.raises(ControlError) as readonly:
        control.call("CentralWrite", "ssays", CENTRAL, uuid16("2a38"), b"\x02", "request")
    assert readonly.value.message.startswith("0x03 Write Not Permitted")
    with pytest.raises(ControlError) as encrypted:
        control.call("CentralRead", "ssu", CENTRAL, ENCRYPT_CHRC, 0)
    assert encrypted.value.message.startswith("0x0f Insufficient Encryption")

    # Heart Rate Measurement: the CCC write makes bluetoothd call StartNotify; the app's PropertiesChanged
    # (once a second) arrive as notifications.
    control.call("CentralSubscribe", "ssb", CENTRAL, "2a37", True)
    received = []

    def got_two():
        received.extend(control.call("CentralNotifications", "ss", CENTRAL, "2a37")[0])
        return len(received) >= 2

    assert wait_until(got_two, timeout=6), f"notifications: {received}"
    for value in received:
        assert value[0] & 0x06 == 0x06 and 90 <= value[1] <= 130
    assert received[0][0] & 0x08, "the first measurement carries Energy Expended"
    control.call("CentralSubscribe", "ssb", CENTRAL, "2a37", False)
    counters = control.counters()
    assert counters["local_start_notify"] == 1 and counters["local_stop_notify"] == 1

    control.call("CentralDisconnect", "s", CENTRAL)
    # The program leaving the bus takes its application with it.
    server.stop()
    assert wait_until(lambda: json.loads(control.call("GetLocalGatt", "s", "hci0")[0]) == [], timeout=5)


def test_example_advertisement_is_registered(world):
    sim, env, control, started = world
    advertiser = start(started, "example-advertisement", env)
    advertiser.wait_for("Advertisement registered")
    ads = json.loads(control.call("GetAdvertisements", "s", "")[0])
    assert len(ads) == 1
    ad = ads[0]
    assert ad["path"] == "/org/bluez/example/advertisement0"
    assert ad["type"] == "peripheral"
    assert ad["local_name"] == "TestAdvertisement"
    assert ad["service_uuids"] == [uuid16("180d"), uuid16("180f")]
    assert ad["manufacturer_data"] == {str(0xFFFF): "00010203"}
    assert ad["service_data"] == {uuid16("9999"): "0001020304"}
    assert ad["includes"] == ["tx-power"]
    # 6 (two 16-bit UUIDs) + 8 (manufacturer data) + 9 (service data) + 5 (Data 0x26): exactly the 28 bytes
    # that are left of 31 once the kernel's TX power field is reserved.
    assert ad["ad_length"] == 28
    assert control.counters()["local_advertisements"] == 1
    advertiser.stop()
    assert wait_until(lambda: json.loads(control.call("GetAdvertisements", "s", "")[0]) == [], timeout=5)


def test_example_advertisement_released_when_the_adapter_goes(world):
    sim, env, control, started = world
    advertiser = start(started, "example-advertisement", env)
    advertiser.wait_for("Advertisement registered")
    # bluetoothd destroys the adapter's advertising manager, which calls Release() on every advertisement.
    control.call("RemoveAdapter", "s", "hci0")
    advertiser.wait_for("/org/bluez/example/advertisement0: Released!")
    assert control.counters()["advertisements_released"] == 1


def test_bluetoothctl_advertise_menu(world):
    """Debian's bluetoothctl (BlueZ 5.66) as the advertiser: its advertise menu registers an LEAdvertisement1."""
    sim, env, control, started = world
    ctl = start(started, "bluetoothctl", env, argv=["bluetoothctl"])
    ctl.wait_for("Agent registered")
    for command in ("menu advertise", "name BctlAd", "uuids 0x180D 0x180F", "manufacturer 0xffff 0x01 0x02",
                    "back", "advertise on"):
        ctl.send(command)
    ctl.wait_for("Advertising object registered")
    ctl.wait_for("ActiveInstances: 0x01 (1)")
    ads = json.loads(control.call("GetAdvertisements", "s", "")[0])
    assert len(ads) == 1
    ad = ads[0]
    assert ad["local_name"] == "BctlAd" and ad["type"] == "peripheral" and ad["discoverable"] is True
    assert ad["service_uuids"] == [uuid16("180d"), uuid16("180f")]
    assert ad["manufacturer_data"] == {"65535": "0102"}
    # 6 (UUIDs) + 6 (manufacturer data) + 3 (the Flags structure Discoverable adds).
    assert ad["ad_length"] == 15
    ctl.send("advertise off")
    ctl.wait_for("Advertising object unregistered")
    assert json.loads(control.call("GetAdvertisements", "s", "")[0]) == []
    ctl.send("quit")


def test_bluetoothctl_gatt_server_menu(world):
    """bluetoothctl's gatt menu as a GATT server: register-service/-characteristic/-application. bluetoothd
    writes the assigned handles back (bluetoothctl prints them) and a written value, which bluetoothctl
    announces with PropertiesChanged, comes back to the subscribed central as a notification."""
    sim, env, control, started = world
    ctl = start(started, "bluetoothctl", env, argv=["bluetoothctl"])
    ctl.wait_for("Agent registered")
    ctl.send("menu gatt")
    ctl.send("register-service 0x180F")
    ctl.wait_for("Battery Service")
    ctl.send("yes")
    ctl.send("register-characteristic 0x2A19 read,write,notify")
    ctl.wait_for("Battery Level")
    ctl.send("0x55")
    ctl.send("register-application")
    ctl.wait_for("Application registered")
    ctl.wait_for("Characteristic (Handle 0x0017)")
    apps = json.loads(control.call("GetLocalGatt", "s", "")[0])
    chrc = apps[0]["services"][0]["characteristics"][0]
    assert chrc["uuid"] == uuid16("2a19") and chrc["flags"] == ["read", "write", "notify"] and chrc["handle"] == 0x17

    control.call("CentralConnect", "ss", "hci0", CENTRAL)
    assert control.call("CentralRead", "ssu", CENTRAL, "2a19", 0)[0] == b"\x55"
    control.call("CentralSubscribe", "ssb", CENTRAL, "2a19", True)
    control.call("CentralWrite", "ssays", CENTRAL, "2a19", b"\x42", "request")
    assert control.call("CentralRead", "ssu", CENTRAL, "2a19", 0)[0] == b"\x42"
    assert wait_until(lambda: control.call("CentralNotifications", "ss", CENTRAL, "2a19")[0] == [b"\x42"], timeout=5)
    ctl.send("quit")
