"""bluez-sim fixtures for the fidelity tests: `bluez-sim --spawn-bus` with a scenario, a control helper over
dbus-send, and the environment that points bleak and bluetoothctl at the simulator's private bus."""
import os
import pathlib
import queue
import subprocess
import tempfile
import threading
import time

import pytest

from conftest import ROOT, bin_dir

DEMO_SCENARIO = ROOT / "config" / "demo-scenario.yaml"

HR_STRAP = "A0:9E:1A:4F:2C:11"
THERMOMETER = "00:09:1F:84:6C:21"
ENVIRO = "D4:3A:2C:7E:10:05"
BTHOME = "A4:C1:38:8F:80:A5"
RUUVI = "CB:B8:33:4C:88:4F"
ECHO = "F1:E2:D3:C4:B5:A6"


def uuid16(short: str) -> str:
    return f"0000{short.lower()}-0000-1000-8000-00805f9b34fb"


class Simulator:
    """A running `bluez-sim --spawn-bus` (its own dbus-daemon)."""

    def __init__(self, scenario: pathlib.Path, extra_args=()):
        self.binary = bin_dir() / "bluez-sim"
        self.proc = subprocess.Popen(
            [str(self.binary), "--spawn-bus", "--scenario", str(scenario), *extra_args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: "queue.Queue[str]" = queue.Queue()
        self.stderr_lines: list = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr_lines.append), daemon=True).start()
        first = self._next_line(15)
        assert first.startswith("DBUS_SYSTEM_BUS_ADDRESS="), f"first line was {first!r}"
        self.address = first.split("=", 1)[1]
        ready = self._next_line(15)
        assert ready.startswith("bluez-sim: ready"), f"expected the ready line, got {ready!r}"
        self.env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=self.address)

    @staticmethod
    def _pump(stream, sink):
        for line in stream:
            sink(line.rstrip("\n"))

    def _next_line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"bluez-sim printed nothing in {timeout}s; stderr: {self.stderr_lines}")

    def dbus_send(self, *args, timeout=20):
        return subprocess.run(["dbus-send", "--system", f"--reply-timeout={int(timeout * 1000)}", *args],
                              env=self.env, capture_output=True, text=True, timeout=timeout + 5)

    def control(self, method: str, *args: str) -> str:
        """Calls io.blebridge.Simulator1.<method> with dbus-send typed args ("string:...", "double:1")."""
        r = self.dbus_send("--print-reply", "--dest=org.bluez", "/org/bluez/sim",
                           f"io.blebridge.Simulator1.{method}", *args)
        if r.returncode != 0:
            raise AssertionError(f"Simulator1.{method} failed: {r.stderr.strip()}")
        return r.stdout

    def counters(self) -> dict:
        out = self.control("GetCounters")
        result = {}
        key = None
        for line in out.splitlines():
            line = line.strip()
            if line.startswith('string "'):
                key = line.split('"')[1]
            elif line.startswith("variant") and key is not None:
                result[key] = int(line.split()[-1])
                key = None
        return result

    def alive(self) -> bool:
        return self.proc.poll() is None and self.dbus_send(
            "--print-reply", "--dest=org.bluez", "/", "org.freedesktop.DBus.Peer.Ping").returncode == 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def hr_peripheral(address, rssi, name=None, adapter=None, sequence=("00 41", "00 42")):
    """A scenario `peripherals[]` entry: a heart-rate strap notifying 2A37 at 2 Hz, cycling through `sequence`."""
    values = ", ".join(f'"{v}"' for v in sequence)
    return (f'  - address: "{address}"\n' + (f"    adapter: {adapter}\n" if adapter else "")
            + f'    name: "{name or "HR " + address[-2:]}"\n    rssi: {rssi}\n    service_uuids: ["180D"]\n'
            + '    gatt:\n      - uuid: "180D"\n        characteristics:\n'
            + f'          - {{uuid: "2A37", flags: [notify], notify: {{rate: 2, sequence: [{values}]}}}}\n')


def bthome_thermometer(address, rssi, packets=200, period=0.5, interval=0.2, name="BTHome thermo"):
    """A scenario `peripherals[]` entry: a BTHome v2 thermometer whose packet id counts 0..packets-1 (and its
    temperature, 20.00 + id/100 °C, with it), a new packet every `period` s, advertised every `interval` s."""
    seq = ", ".join(f'"40 00 {i:02X} 02 {(2000 + i) & 0xFF:02X} {(2000 + i) >> 8:02X}"' for i in range(packets))
    return (f'  - address: "{address}"\n    name: "{name}"\n    rssi: {rssi}\n    connectable: false\n'
            f"    advertising_interval: {interval}\n    service_data:\n"
            f'      - {{uuid: "FCD2", period: {period}, sequence: [{seq}]}}\n')


def start_simulator(scenario_text: str = None, path: pathlib.Path = DEMO_SCENARIO, extra_args=()):
    if scenario_text is not None:
        handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
        handle.write(scenario_text)
        handle.close()
        path = pathlib.Path(handle.name)
    return Simulator(path, extra_args)


@pytest.fixture
def sim(monkeypatch):
    """The demo scenario on a private bus; DBUS_SYSTEM_BUS_ADDRESS points at it for bleak."""
    s = start_simulator()
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", s.address)
    yield s
    s.stop()


def wait_until(predicate, timeout=5.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
