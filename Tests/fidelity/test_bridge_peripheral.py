"""The peripheral role end to end: `blebridge run` (and `blebridge serve`) with a `peripheral:` section on bluez-sim,
a real mosquitto, paho-mqtt as the judge of the MQTT side, and the simulator acting as a remote central (its control
interface: CentralConnect, CentralRead, CentralWrite, CentralSubscribe, CentralNotifications, GetLocalGatt,
GetAdvertisements) as the judge of the BLE side. busctl (systemd) makes the control calls, with JSON replies."""
import json
import subprocess
import time

import pytest

from bridge_fixtures import BridgeProcess, Judge, broker  # noqa: F401 (fixture)
from conftest import bin_dir
from sim_fixtures import start_simulator, uuid16, wait_until

CENTRAL = "5C:F3:70:11:22:33"
LAMP_SERVICE = "6e400001-b5a3-f393-e0a9-e50e24dcca9e"
LAMP_RAW = "6e400003-b5a3-f393-e0a9-e50e24dcca9e"

SCENARIO = """
settings: {temporary_timeout: 5}
adapters: [{id: hci0, address: "00:1A:7D:DA:71:10"}]
"""


def peripheral_config(port: int, extra: str = "") -> str:
    return f"""
mqtt: {{url: "mqtt://127.0.0.1:{port}"}}
homeassistant: false
logging: {{level: debug}}
peripheral:
  name: bb-e2e
  services:
    - preset: environmental_sensing
      temperature: {{topic: home/living, field: temperature_c}}
      humidity: {{topic: home/living, field: humidity_pct}}
    - preset: battery
      level: home/ups/battery
    - preset: device_information
      manufacturer: ACME
    - uuid: "{LAMP_SERVICE}"
      name: lamp
      characteristics:
        - uuid: battery_level
          flags: [read, write, indicate]
          source: {{topic: home/lamp, field: level}}
          sink: home/lamp/set
        - uuid: "{LAMP_RAW}"
          flags: [write-without-response, write]
          sink: home/lamp/raw
  broadcast:
    name: attic
    interval: 0.2
    values:
      - {{field: temperature_c, source: {{topic: home/attic, field: t}}}}
      - {{field: humidity_pct, source: {{topic: home/attic, field: h}}}}
{extra}
"""


class Control:
    """io.blebridge.Simulator1 through busctl, replies as JSON."""

    def __init__(self, sim):
        self.sim = sim

    def call(self, method, signature="", *args, check=True):
        cmd = ["busctl", f"--address={self.sim.address}", "--json=short", "call", "org.bluez", "/org/bluez/sim",
               "io.blebridge.Simulator1", method]
        if signature:
            cmd += [signature, *[str(a) for a in args]]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if check and r.returncode != 0:
            raise AssertionError(f"{method}{args}: {r.stderr.strip()}")
        return r

    def data(self, method, signature="", *args):
        out = self.call(method, signature, *args).stdout.strip()
        return json.loads(out)["data"] if out else None

    def error(self, method, signature, *args) -> str:
        r = self.call(method, signature, *args, check=False)
        assert r.returncode != 0, f"{method}{args} succeeded"
        return r.stderr.strip()

    def local_gatt(self):
        return json.loads(self.data("GetLocalGatt", "s", "")[0])

    def advertisements(self):
        return json.loads(self.data("GetAdvertisements", "s", "")[0])

    def read(self, uuid, offset=0) -> bytes:
        return bytes(self.data("CentralRead", "ssu", CENTRAL, uuid, offset)[0])

    def write(self, uuid, value: bytes, kind="request"):
        return self.call("CentralWrite", "ssays", CENTRAL, uuid, len(value), *value, kind)

    def write_error(self, uuid, value: bytes, kind="request") -> str:
        return self.error("CentralWrite", "ssays", CENTRAL, uuid, len(value), *value, kind)

    def notifications(self, uuid):
        return [bytes(v) for v in self.data("CentralNotifications", "ss", CENTRAL, uuid)[0]]


def service_uuids(apps):
    return [s["uuid"] for app in apps for s in app["services"]]


@pytest.fixture
def prig(broker):  # noqa: F811
    sim = start_simulator(SCENARIO)
    judge = Judge(broker.port, filters=("blebridge/#", "home/#"))
    procs = []

    class R:
        pass

    r = R()
    r.sim, r.judge, r.ctl, r.broker = sim, judge, Control(sim), broker

    def start(text=None, command="run"):
        b = BridgeProcess(text or peripheral_config(broker.port), sim.env)
        if command != "run":
            b.proc.kill()
            b.proc.wait()
            b.proc = subprocess.Popen([str(bin_dir() / "blebridge"), command, "--config", str(b.config)],
                                      env=sim.env, stdout=subprocess.DEVNULL, stderr=b.stderr)
        procs.append(b)
        return b

    r.start = start

    def registered():
        try:
            return LAMP_SERVICE in service_uuids(r.ctl.local_gatt())
        except (AssertionError, ValueError):
            return False

    r.registered = registered
    yield r
    for b in procs:
        b.close()
    judge.close()
    sim.stop()


def test_values_on_mqtt_reach_a_central_by_read_and_notification_in_order(prig):
    b = prig.start()
    assert wait_until(prig.registered, 20), f"the GATT application was not registered; log:\n{b.log()[-3000:]}"
    apps = prig.ctl.local_gatt()
    assert service_uuids(apps) == [uuid16("181A"), uuid16("180F"), uuid16("180A"), LAMP_SERVICE]
    prig.ctl.call("CentralConnect", "ss", "", CENTRAL)
    # Device Information is static; Temperature comes from MQTT.
    assert prig.ctl.read("2A29") == b"ACME"
    assert prig.ctl.read("2A29", 2) == b"ME"
    assert "0x07" in prig.ctl.error("CentralRead", "ssu", CENTRAL, "2A29", 9)
    prig.judge.publish("home/living", {"temperature_c": 21.5, "humidity_pct": 40}, retain=True)
    assert wait_until(lambda: prig.ctl.read("2A6E") == bytes([0x66, 0x08]), 10)
    assert prig.ctl.read("2A6F") == bytes([0xA0, 0x0F])
    # 100 values at 100/s, notified in order, none lost.
    prig.ctl.call("CentralSubscribe", "ssb", CENTRAL, "2A19", "true")
    prig.judge.wait_json("blebridge/bridge/event", lambda v: v["type"] == "central_subscribed"
                         and v["data"].get("characteristic") == "2A19")
    for i in range(100):
        prig.judge.publish("home/ups/battery", str(i), qos=1)
        time.sleep(0.01)
    got = []
    deadline = time.monotonic() + 20
    while len(got) < 100 and time.monotonic() < deadline:
        got += prig.ctl.notifications(uuid16("2A19"))
        time.sleep(0.05)
    assert got == [bytes([i]) for i in range(100)], f"notifications: {[g.hex() for g in got]}"
    assert prig.ctl.read("2A19") == bytes([99])
    info = prig.judge.wait_json("blebridge/bridge/info", lambda v: CENTRAL in v.get("peripheral", {})
                                .get("centrals", []))
    assert [s["uuid"] for s in info["peripheral"]["services"]] == ["181A", "180F", "180A", LAMP_SERVICE]
    events = [v["type"] for v in prig.judge.json_on("blebridge/bridge/event")]
    assert "central_connected" in events and "peripheral_registered" in events
    prig.ctl.call("CentralDisconnect", "s", CENTRAL)
    prig.judge.wait_json("blebridge/bridge/event", lambda v: v["type"] == "central_disconnected")
    assert b.stop() == 0
    assert wait_until(lambda: not prig.registered(), 10), "the application stayed registered after shutdown"
    assert prig.ctl.advertisements() == []


def test_a_centrals_write_reaches_the_sink_decoded_and_bad_writes_get_the_att_error(prig):
    b = prig.start()
    assert wait_until(prig.registered, 20), b.log()[-3000:]
    prig.ctl.call("CentralConnect", "ss", "", CENTRAL)
    # The lamp's level characteristic is Battery Level's format (uint8 0..100), under a custom service.
    lamp_level = None
    for app in prig.ctl.local_gatt():
        for s in app["services"]:
            if s["uuid"] == LAMP_SERVICE:
                lamp_level = s["characteristics"][0]
                assert set(lamp_level["flags"]) == {"read", "write", "indicate"}
    assert lamp_level
    # A read-only characteristic: bluetoothd answers Write Not Permitted itself. The lamp's level shares 2A19 with
    # the battery preset, so it is addressed by its object path.
    assert "0x03" in prig.ctl.write_error("2A6E", b"\x01\x02"), "a read-only characteristic was written"
    prig.ctl.write(LAMP_RAW, b"\xde\xad")
    raw = prig.judge.wait_json("home/lamp/raw")
    assert raw == {"raw": "dead"}
    prig.ctl.write(LAMP_RAW, b"\xbe\xef", kind="command")
    prig.judge.wait_json("home/lamp/raw", lambda v: v == {"raw": "beef"})
    time.sleep(0.2)
    sinks_before = len(prig.judge.on("home/lamp/set"))
    # The lamp's level: wrong length and out of range are refused with the ATT error, nothing published.
    err = prig.ctl.error("CentralWrite", "ssays", CENTRAL, lamp_level["path"], 2, 1, 2, "request")
    assert "0x0d" in err.lower(), err
    err = prig.ctl.error("CentralWrite", "ssays", CENTRAL, lamp_level["path"], 1, 150, "request")
    assert "0x80" in err.lower(), err
    prig.ctl.call("CentralWrite", "ssays", CENTRAL, lamp_level["path"], 1, 55, "request")
    v = prig.judge.wait_json("home/lamp/set")
    assert v == {"battery_pct": 55}
    assert len(prig.judge.on("home/lamp/set")) == sinks_before + 1
    assert bytes(prig.ctl.data("CentralRead", "ssu", CENTRAL, lamp_level["path"], 0)[0]) == bytes([55])
    assert "refused" in b.log()


def test_advertisements_carry_the_name_services_and_bthome_data_that_decodes_back(prig):
    b = prig.start()
    assert wait_until(prig.registered, 20), b.log()[-3000:]

    def connectable():
        return [a for a in prig.ctl.advertisements() if a["type"] == "peripheral"]

    assert wait_until(lambda: connectable(), 10), prig.ctl.advertisements()
    adv = connectable()[0]
    assert adv["local_name"] == "bb-e2e"
    assert adv["service_uuids"][:3] == [uuid16("181A"), uuid16("180F"), uuid16("180A")]
    prig.judge.publish("home/attic", {"t": 21.25, "h": 50}, retain=True)

    def bthome():
        for a in prig.ctl.advertisements():
            if a["type"] == "broadcast":
                return a
        return None

    assert wait_until(lambda: bthome() is not None, 10), prig.ctl.advertisements()
    a = bthome()
    assert a["local_name"] == "attic"
    assert a["ad_length"] <= 31
    data = a["service_data"][uuid16("FCD2")]
    out = subprocess.run([str(bin_dir() / "blebridge"), "decode", "service-data", "FCD2", data],
                         capture_output=True, text=True, check=True).stdout
    decoded = json.loads(out)
    assert decoded["temperature_c"] == 21.25 and decoded["humidity_pct"] == 50
    first_id = decoded["packet_id"]
    # A new value updates the data in place (same object, new packet id).
    prig.judge.publish("home/attic", {"t": 22.5, "h": 51})

    def updated():
        a2 = bthome()
        if not a2:
            return None
        d = json.loads(subprocess.run([str(bin_dir() / "blebridge"), "decode", "service-data", "FCD2",
                                       a2["service_data"][uuid16("FCD2")]], capture_output=True, text=True).stdout)
        return d if d.get("temperature_c") == 22.5 else None

    assert wait_until(lambda: updated() is not None, 10)
    assert updated()["packet_id"] != first_id
    assert bthome()["path"] == a["path"]
    assert b.stop() == 0


def test_everything_comes_back_after_bluetoothd_restarts(prig):
    b = prig.start()
    assert wait_until(prig.registered, 20), b.log()[-3000:]
    prig.judge.publish("home/living", {"temperature_c": 19.0, "humidity_pct": 30}, retain=True)
    prig.judge.publish("home/attic", {"t": 18.5, "h": 40}, retain=True)
    prig.ctl.call("CentralConnect", "ss", "", CENTRAL)
    assert wait_until(lambda: prig.ctl.read("2A6E") == (1900).to_bytes(2, "little"), 10)
    assert wait_until(lambda: any(a["type"] == "broadcast" for a in prig.ctl.advertisements()), 10)
    prig.ctl.call("RestartDaemon", "d", "1.0")
    assert wait_until(lambda: not prig.registered(), 5)
    assert wait_until(prig.registered, 20), f"not registered again; log:\n{b.log()[-3000:]}"
    assert wait_until(lambda: any(a["type"] == "peripheral" for a in prig.ctl.advertisements()), 10)
    # The BTHome broadcast is back too, with the last values.
    assert wait_until(lambda: any(a["type"] == "broadcast" for a in prig.ctl.advertisements()), 10)
    data = [a for a in prig.ctl.advertisements() if a["type"] == "broadcast"][0]["service_data"][uuid16("FCD2")]
    decoded = json.loads(subprocess.run([str(bin_dir() / "blebridge"), "decode", "service-data", "FCD2", data],
                                        capture_output=True, text=True, check=True).stdout)
    assert decoded["temperature_c"] == 18.5
    prig.ctl.call("CentralConnect", "ss", "", CENTRAL)
    # The value served is the last one from MQTT, kept across the restart.
    assert prig.ctl.read("2A6E") == (1900).to_bytes(2, "little")
    prig.judge.publish("home/living", {"temperature_c": 20.0, "humidity_pct": 31})
    assert wait_until(lambda: prig.ctl.read("2A6E") == (2000).to_bytes(2, "little"), 10)
    assert "registered" in b.log()
    assert b.stop() == 0


def test_serve_runs_the_peripheral_alone(prig):
    b = prig.start(command="serve")
    assert wait_until(prig.registered, 20), b.log()[-3000:]
    prig.judge.wait_json("blebridge/bridge/state", lambda v: v["state"] == "online")
    info = prig.judge.wait_json("blebridge/bridge/info", lambda v: v.get("mode") == "serve")
    assert info["peripheral"]["name"] == "bb-e2e"
    prig.judge.publish("home/ups/battery", "42", retain=True)
    prig.ctl.call("CentralConnect", "ss", "", CENTRAL)
    assert wait_until(lambda: prig.ctl.read("2A19") == bytes([42]), 10)
    assert b.stop() == 0
    prig.judge.wait_json("blebridge/bridge/state", lambda v: v["state"] == "offline")


def test_the_application_and_advertisements_come_back_with_the_adapter(prig):
    b = prig.start()
    assert wait_until(prig.registered, 20), b.log()[-3000:]
    # Retained: the application can be registered before the bridge's subscription to the source topic is in place,
    # and a plain message published in between would reach nobody (MQTT's rule, not the bridge's).
    prig.judge.publish("home/ups/battery", "77", retain=True)
    prig.ctl.call("RemoveAdapter", "s", "hci0")
    assert wait_until(lambda: not prig.registered(), 10)
    prig.judge.wait_json("blebridge/bridge/event", lambda v: v["type"] == "peripheral_unregistered")
    # The dongle comes back (as hci1): the application and the advertisement are registered on it again.
    prig.ctl.call("AddAdapter", "s", '{"id": "hci1", "address": "00:1A:7D:DA:71:10"}')
    assert wait_until(prig.registered, 20), f"not registered on the new adapter; log:\n{b.log()[-3000:]}"
    assert wait_until(lambda: any(a["type"] == "peripheral" for a in prig.ctl.advertisements()), 10)
    ev = prig.judge.wait_json("blebridge/bridge/event", lambda v: v["type"] == "peripheral_registered"
                              and v["data"]["adapter"] == "hci1")
    assert ev
    prig.ctl.call("CentralConnect", "ss", "", CENTRAL)
    assert wait_until(lambda: prig.ctl.read("2A19") == bytes([77]), 10)
    assert b.stop() == 0


def test_serve_tells_the_service_manager_ready_and_feeds_its_watchdog(prig):
    from test_bridge_service import NotifySocket
    notify = NotifySocket()
    try:
        b = BridgeProcess(peripheral_config(prig.broker.port), dict(prig.sim.env, NOTIFY_SOCKET=notify.path,
                                                                     WATCHDOG_USEC="2000000"))
        b.proc.kill()
        b.proc.wait()
        b.proc = subprocess.Popen([str(bin_dir() / "blebridge"), "serve", "--config", str(b.config)],
                                  env=dict(prig.sim.env, NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="2000000"),
                                  stdout=subprocess.DEVNULL, stderr=b.stderr)
        try:
            notify.wait(lambda l: l == "READY=1", what="READY=1")
            t = time.monotonic()
            # WATCHDOG_USEC 2 s: a ping every second.
            assert wait_until(lambda: len([x for x in notify.lines(after=t) if x[1] == "WATCHDOG=1"]) >= 3, 10)
            assert b.stop() == 0
            assert [x for x in notify.lines() if x[1] == "STOPPING=1"]
        finally:
            b.close()
    finally:
        notify.close()
