#!/usr/bin/env python3
"""The peripheral role under load (MQTT -> BLE): bench/peripheral.sh runs this with release builds.

A private mosquitto on a free loopback port, bluez-sim on its own private bus with one adapter, and
`blebridge serve` serving one notify characteristic (raw, no parser) bound to an MQTT topic. bluez-sim plays the
central (CentralConnect + CentralSubscribe) and collects what it is notified. A paho-mqtt publisher sends RATE values
a second for WINDOW seconds, each a 4-octet little-endian counter in hex. Printed: values/s sent and notified, lost,
out of order, the bridge's CPU µs per value (from /proc/PID/stat), its peak RSS and threads, and the simulator's CPU
per value in the same run as the reference.

  bench/peripheral.py BIN_DIR [--rate 500] [--window 10]
"""
import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import paho.mqtt.client as mqtt

CHAR = "b1eb5e00-0000-4000-8000-00000000be01"
SERVICE = "b1eb5e00-0000-4000-8000-00000000be00"
CENTRAL = "5C:F3:70:00:00:01"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin")
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--window", type=float, default=10)
    a = ap.parse_args()
    bin_dir = pathlib.Path(a.bin)
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-peripheral-"))
    procs = []
    try:
        port = free_port()
        (work / "mosquitto.conf").write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
        procs.append(subprocess.Popen([shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c",
                                       str(work / "mosquitto.conf")], stderr=subprocess.DEVNULL))
        (work / "scenario.yaml").write_text('adapters: [{id: hci0, address: "00:1A:7D:DA:71:10"}]\n')
        sim = subprocess.Popen([str(bin_dir / "bluez-sim"), "--spawn-bus", "--scenario", str(work / "scenario.yaml")],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(sim)
        address = None
        for line in sim.stdout:
            if line.startswith("DBUS_SYSTEM_BUS_ADDRESS="):
                address = line.strip().split("=", 1)[1]
            if line.startswith("bluez-sim: ready"):
                break
        env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=address)
        (work / "serve.yaml").write_text(f"""
mqtt: {{url: "mqtt://127.0.0.1:{port}"}}
logging: {{level: warning}}
peripheral:
  advertise: false
  services:
    - uuid: "{SERVICE}"
      characteristics:
        - {{uuid: "{CHAR}", flags: [read, notify], source: bench/value}}
""")
        bridge = subprocess.Popen([str(bin_dir / "blebridge"), "serve", "--config", str(work / "serve.yaml")], env=env,
                                  stderr=open(work / "bridge.log", "w"))
        procs.append(bridge)

        def ctl(method, sig, *args):
            r = subprocess.run(["busctl", f"--address={address}", "--json=short", "call", "org.bluez", "/org/bluez/sim",
                                "io.blebridge.Simulator1", method, sig, *[str(x) for x in args]],
                               capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise RuntimeError(f"{method}: {r.stderr.strip()}")
            return json.loads(r.stdout)["data"] if r.stdout.strip() else None

        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                if CHAR in ctl("GetLocalGatt", "s", "")[0]:
                    break
            except RuntimeError:
                pass
            time.sleep(0.1)
        else:
            sys.exit("bench/peripheral.py: the GATT application was not registered")
        ctl("CentralConnect", "ss", "", CENTRAL)
        ctl("CentralSubscribe", "ssb", CENTRAL, CHAR, "true")
        pub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
        pub.connect("127.0.0.1", port)
        pub.loop_start()
        time.sleep(1)
        ctl("CentralNotifications", "ss", CENTRAL, CHAR)  # drop anything from before the window
        n = int(a.rate * a.window)
        b0, s0, t0 = ticks(bridge.pid), ticks(sim.pid), time.monotonic()
        for i in range(n):
            target = t0 + i / a.rate
            now = time.monotonic()
            if target > now:
                time.sleep(target - now)
            pub.publish("bench/value", i.to_bytes(4, "little").hex(), qos=0)
        sent_s = time.monotonic() - t0
        got = []
        quiet = 0
        while quiet < 10:
            batch = ctl("CentralNotifications", "ss", CENTRAL, CHAR)[0]
            got += [int.from_bytes(bytes(v), "little") for v in batch]
            quiet = quiet + 1 if not batch else 0
            if len(got) >= n:
                break
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        b1, s1 = ticks(bridge.pid), ticks(sim.pid)
        tck = os.sysconf("SC_CLK_TCK")
        seen = set(got)
        out_of_order = sum(1 for x, y in zip(got, got[1:]) if y < x)
        result = {
            "rate": a.rate, "window_s": round(sent_s, 2), "sent": n, "notified": len(got),
            "lost": len([i for i in range(n) if i not in seen]), "out_of_order": out_of_order,
            "bridge_us_per_value": round((b1 - b0) / tck * 1e6 / max(1, len(got)), 1),
            "sim_us_per_value": round((s1 - s0) / tck * 1e6 / max(1, len(got)), 1),
            "bridge_peak_rss_mb": round(status(bridge.pid, "VmHWM") / 1024, 1),
            "bridge_threads": status(bridge.pid, "Threads"), "elapsed_s": round(elapsed, 2),
        }
        pub.loop_stop()
        lost = [i for i in range(n) if i not in seen]
        if lost:
            print("lost (first 30):", lost[:30], file=sys.stderr)
        print(json.dumps(result))
        print(f"| {a.rate:.0f}/s | {result['sent']} | {result['notified']} | {result['lost']} | "
              f"{result['out_of_order']} | {result['bridge_us_per_value']} µs | {result['sim_us_per_value']} µs | "
              f"{result['bridge_peak_rss_mb']} MB | {result['bridge_threads']} |")
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if not os.environ.get("KEEP"):
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("kept", work, file=sys.stderr)


if __name__ == "__main__":
    main()
