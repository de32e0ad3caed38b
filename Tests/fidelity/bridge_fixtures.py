"""Fixtures for the bridge's end-to-end tests: a private mosquitto (restartable on the same port), bluez-sim on a
private bus, `blebridge run` with a config, and a paho-mqtt client as the independent judge of the MQTT contract."""
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from conftest import ROOT, bin_dir
from sim_fixtures import start_simulator

DEMO_CONFIG = ROOT / "config" / "demo.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """mosquitto on 127.0.0.1:<port>, with persistence so a persistent subscriber session survives a restart."""

    def __init__(self, extra_config: str = ""):
        """`extra_config`: more mosquitto.conf lines (a bridge `connection` section, say)."""
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="blebridge-mosq-")
        # mkdtemp makes the directory 0700; mosquitto started as root drops to the `mosquitto` user and then cannot
        # save its database there ("Error saving in-memory database ... Permission denied"), so every session is
        # lost on a restart without a word.
        os.chmod(self.dir, 0o777)
        self.config = pathlib.Path(self.dir) / "mosquitto.conf"
        self.config.write_text(
            f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {self.dir}/\nmax_queued_messages 100000\n" + extra_config)
        self.proc = None
        self.start()

    def start(self):
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        self.proc = subprocess.Popen([binary, "-c", str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("mosquitto did not start")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    def close(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Judge:
    """A paho MQTT 5 client recording everything under the given filters."""

    def __init__(self, port: int, filters=("blebridge/#", "homeassistant/#"), client_id=None, persistent=False):
        self.messages = []
        self.cond = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or "",
                                  protocol=mqtt.MQTTv5)
        self.client.on_message = self._on_message
        self.subscribed = threading.Event()
        self.client.on_subscribe = lambda *a: self.subscribed.set()
        self.filters = filters
        self.client.on_connect = self._on_connect
        props = None
        if persistent:
            from paho.mqtt.properties import Properties
            from paho.mqtt.packettypes import PacketTypes
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600
        self.client.reconnect_delay_set(0.1, 0.5)
        self.client.connect("127.0.0.1", port, clean_start=not persistent, properties=props)
        self.client.loop_start()
        assert self.subscribed.wait(10), "paho: no SUBACK"

    def _on_connect(self, client, userdata, flags, reason, properties):
        for f in self.filters:
            client.subscribe(f, qos=1)

    def _on_message(self, client, userdata, message):
        with self.cond:
            self.messages.append((time.monotonic(), message.topic, message.payload, message.retain))
            self.cond.notify_all()

    def snapshot(self):
        with self.cond:
            return list(self.messages)

    def on(self, topic):
        return [m for m in self.snapshot() if m[1] == topic]

    def json_on(self, topic):
        out = []
        for _, t, p, _ in self.snapshot():
            if t == topic and p:
                out.append(json.loads(p))
        return out

    def wait(self, predicate, timeout=20.0, what="condition"):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                result = predicate(list(self.messages))
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0:
                    topics = sorted({m[1] for m in self.messages})
                    raise AssertionError(f"timed out waiting for {what}; topics seen: {topics}")
                self.cond.wait(min(left, 0.2))

    def wait_json(self, topic, predicate=lambda v: True, timeout=20.0, after=0.0):
        def check(msgs):
            for ts, t, p, _ in msgs:
                if t == topic and ts >= after and p:
                    try:
                        v = json.loads(p)
                    except ValueError:
                        continue
                    if predicate(v):
                        return v
            return None
        return self.wait(check, timeout, what=f"a matching message on {topic}")

    def publish(self, topic, payload, qos=1, properties=None, retain=False):
        if isinstance(payload, (dict, list)):
            payload = json.dumps(payload)
        self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties).wait_for_publish(10)

    def close(self):
        self.client.loop_stop()
        self.client.disconnect()


def thread_stacks(pid: int) -> str:
    """Every thread's stack of a process that hangs (gdb when installed), for the failure message."""
    gdb = shutil.which("gdb")
    if not gdb:
        return "(gdb not installed: no stacks)"
    try:
        out = subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off",
                              "-ex", "thread apply all bt 60"], capture_output=True, text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return "(gdb timed out)"
    return compact_stacks(out)


def compact_stacks(gdb_output: str) -> str:
    """gdb's backtraces cut to what tells a hang apart (thread names, then each frame's function and source line,
    without addresses and arguments; frames of unknown code dropped), so that every thread fits in a CI log."""
    lines = []
    for line in gdb_output.splitlines():
        if line.startswith("Thread "):
            name = line[line.find('"'):].rstrip(":")[:-1] if '"' in line else ""
            lines.append(line.split(" (Thread 0x")[0] + (" " + name if name else ""))
        elif line.startswith("#"):
            number, _, rest = line.partition(" ")
            rest = re.sub(r"^0x[0-9a-f]+ in ", "", rest.strip())
            if rest.startswith("?? "):
                continue
            function = rest.split(" (", 1)[0]
            where = re.search(r" at (\S+:\d+)$", rest) or re.search(r" from (\S+)$", rest)
            lines.append(f"  {number} {function}" + (f" ({where.group(1).rsplit('/', 1)[-1]})" if where else ""))
    return "\n".join(lines)[-30000:]


class BridgeProcess:
    """`blebridge run --config FILE` on the simulator's bus."""

    # Every bridge started by the running test, so that a failure shows their logs (conftest.py).
    started: list = []

    def __init__(self, config_text: str, env: dict, extra_args=()):
        self.final_log = None
        BridgeProcess.started.append(self)
        self.dir = tempfile.mkdtemp(prefix="blebridge-run-")
        self.config = pathlib.Path(self.dir) / "config.yaml"
        self.config.write_text(config_text)
        self.stderr_path = pathlib.Path(self.dir) / "stderr.log"
        self.stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen([str(bin_dir() / "blebridge"), "run", "--config", str(self.config), *extra_args],
                                     env=env, stdout=subprocess.DEVNULL, stderr=self.stderr)

    def log(self) -> str:
        if self.final_log is not None:
            return self.final_log
        self.stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def stop(self, timeout=15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                stacks = thread_stacks(self.proc.pid)
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"blebridge did not stop within {timeout} s; log:\n{self.log()[-3000:]}"
                                     f"\nthreads:\n{stacks}")
        return self.proc.returncode

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.final_log = self.log()
        self.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def demo_config(port: int, **replace) -> str:
    text = DEMO_CONFIG.read_text().replace("mqtt://127.0.0.1:1883", f"mqtt://127.0.0.1:{port}")
    for old, new in replace.items():
        text = text.replace(old, new)
    return text


@pytest.fixture
def broker():
    b = Broker()
    yield b
    b.close()


@pytest.fixture
def demo_sim():
    s = start_simulator()
    yield s
    s.stop()


class Rig:
    def __init__(self, broker, sim):
        self.broker = broker
        self.sim = sim
        self.judge = Judge(broker.port)
        self.bridges = []

    def bridge(self, config_text=None, **replace):
        b = BridgeProcess(config_text or demo_config(self.broker.port, **replace), self.sim.env)
        self.bridges.append(b)
        return b

    def close(self):
        for b in self.bridges:
            b.close()
        self.judge.close()


@pytest.fixture
def rig(broker, demo_sim):
    r = Rig(broker, demo_sim)
    yield r
    r.close()
