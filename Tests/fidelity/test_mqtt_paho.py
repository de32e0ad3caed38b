"""paho-mqtt as an independent MQTT peer of our client (driven through bench-mqtt's helper modes)."""
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def broker():
    mosquitto = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        config = pathlib.Path(directory) / "mosquitto.conf"
        config.write_text(
            f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
            "max_queued_messages 100000\nmax_inflight_messages 100\n")
        process = subprocess.Popen([mosquitto, "-c", str(config)], stderr=subprocess.PIPE)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield port
        process.terminate()
        process.wait(timeout=5)


class Collector:
    """A paho MQTT 5 client that records what it receives."""

    def __init__(self, port: int, topic: str, qos: int = 1):
        self.messages = []
        self.lock = threading.Condition()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *args: subscribed.set()
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        self.client.subscribe(topic, qos=qos)
        assert subscribed.wait(10), "paho: no SUBACK"

    def _on_message(self, client, userdata, message):
        with self.lock:
            self.messages.append(message)
            self.lock.notify_all()

    def wait_for(self, count: int, timeout: float = 20):
        with self.lock:
            assert self.lock.wait_for(lambda: len(self.messages) >= count, timeout), \
                f"paho received {len(self.messages)} of {count}"
            return list(self.messages)

    def close(self):
        self.client.loop_stop()
        self.client.disconnect()


def wait_for_line(process: subprocess.Popen, text: str, timeout: float = 10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = process.stdout.readline()
        if text in line:
            return
        if process.poll() is not None:
            raise AssertionError(f"helper exited: {process.stderr.read()}")
    raise AssertionError(f"helper did not print {text!r}")


def test_will_of_a_killed_client_reaches_paho(broker, binaries):
    watcher = Collector(broker, "will/#")
    child = subprocess.Popen(
        [str(binaries / "bench-mqtt"), "will-child", "--port", str(broker), "--topic", "will/py"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(child, "connected")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=5)
        (message,) = watcher.wait_for(1)
        assert message.topic == "will/py"
        assert message.payload == f"child {child.pid} died".encode()
        assert message.qos == 1
    finally:
        if child.poll() is None:
            child.kill()
        watcher.close()


def test_mqtt5_request_response_interop(broker, binaries):
    echo = subprocess.Popen(
        [str(binaries / "bench-mqtt"), "echo", "--port", str(broker)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    responses = Collector(broker, "echo/response/#")
    try:
        wait_for_line(echo, "ready")
        properties = Properties(PacketTypes.PUBLISH)
        properties.ResponseTopic = "echo/response/1"
        properties.CorrelationData = bytes([0, 1, 2, 0xFF])
        properties.ContentType = "application/octet-stream"
        properties.UserProperty = [("unit", "°C"), ("unit", "K")]
        responses.client.publish("echo/request", b"\x00payload\xff", qos=1, properties=properties).wait_for_publish(10)
        (response,) = responses.wait_for(1)
        assert response.topic == "echo/response/1"
        assert response.payload == b"\x00payload\xff"
        assert response.properties.CorrelationData == bytes([0, 1, 2, 0xFF])
        assert response.properties.ContentType == "application/octet-stream"
        assert response.properties.UserProperty == [("unit", "°C"), ("unit", "K"), ("echoed-by", "blebridge")]
    finally:
        echo.kill()
        echo.wait(timeout=5)
        responses.close()


def test_oversized_request_never_reaches_our_client(broker, binaries):
    """Our client announces a 1 MiB maximum packet size in its MQTT 5 CONNECT: the broker drops paho's 2 MiB request
    instead of forwarding it, and our client stays connected and answers the next, small one."""
    echo = subprocess.Popen(
        [str(binaries / "bench-mqtt"), "echo", "--port", str(broker)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    responses = Collector(broker, "echo/response/#")
    try:
        wait_for_line(echo, "ready")
        for topic, payload in [("echo/response/big", b"x" * (2 << 20)), ("echo/response/small", b"small")]:
            properties = Properties(PacketTypes.PUBLISH)
            properties.ResponseTopic = topic
            responses.client.publish("echo/request", payload, qos=1, properties=properties).wait_for_publish(10)
        (response,) = responses.wait_for(1)
        assert response.topic == "echo/response/small" and response.payload == b"small"
        assert echo.poll() is None, echo.stderr.read()
    finally:
        echo.kill()
        echo.wait(timeout=5)
        responses.close()


def test_benchmark_messages_seen_by_paho(broker, binaries):
    """Everything our publisher sends in the benchmark also reaches an independent subscriber, intact and in order."""
    watcher = Collector(broker, "bench/#", qos=1)
    try:
        result = subprocess.run(
            [str(binaries / "bench-mqtt"), "--port", str(broker), "--count", "3000", "--qos", "0,1"],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "QoS 0: 3000 x 100 B" in result.stdout and "QoS 1: 3000 x 100 B" in result.stdout
        messages = watcher.wait_for(6000)
        assert [m.topic for m in messages] == ["bench/qos0"] * 3000 + ["bench/qos1"] * 3000
        assert all(m.payload == b"Z" * 100 for m in messages)
        assert [m.qos for m in messages[3000:]] == [1] * 3000
    finally:
        watcher.close()
