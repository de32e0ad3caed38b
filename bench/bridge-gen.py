#!/usr/bin/env python3
"""Writes the bluez-sim scenario and the blebridge configuration of one bench/bridge.sh scenario.

  bridge-gen.py notify  N RATE PORT DIR   N connected devices, one characteristic each notifying a u32le counter at
                                          RATE Hz (parser bench_seq: {name: seq, type: u32le}); 25 devices per
                                          adapter (bluetooth.connection_slots is at most 32 per adapter)
  bridge-gen.py passive N RATE PORT DIR   N non-connectable advertisers at RATE Hz, even numbers BTHome v2 service
                                          data (FCD2), odd ones RuuviTag RAWv2 (0x0499); the payload changes with
                                          every advertisement and carries its index (packet_id / measurement_sequence)
  bridge-gen.py ruuvi N RATE PORT DIR     the same with RuuviTags only (bench/compare-ble2mqtt.sh: ble2mqtt has no
                                          BTHome decoder); also writes DIR/ble2mqtt.json for ble2mqtt 0.2.5

Device k has the address C0:00:00:00:HH:LL (HHLL = k) and the bridge name d<k> (dNNNN), so both sides of the
benchmark can name it with a number. The notify scenarios add device 4095 (C0:00:00:00:0F:FF, d4095), the latency
probe: a characteristic without a generator (parser bench_probe: {name: probe_us, type: u32le}) that
bench/bridge-sub.c makes notify its own clock through Simulator1.PushNotification. Writes DIR/scenario.yaml and DIR/bridge.yaml; prints nothing.
"""
import json
import sys

PER_ADAPTER = 25
SEQUENCE = 64  # distinct advertisement payloads per device, longer than any measurement window at 1 Hz
SERVICE = "6e40aa00-b5a3-f393-e0a9-e50e24dcca9e"
CHARACTERISTIC = "6e40aa01-b5a3-f393-e0a9-e50e24dcca9e"
PROBE = "6e40aa02-b5a3-f393-e0a9-e50e24dcca9e"
PROBE_DEVICE = 4095  # C0:00:00:00:0F:FF, bridge name d4095


def address(k):
    return "C0:00:00:00:%02X:%02X" % (k >> 8, k & 0xFF)


def bthome(k, i):
    temperature = 2000 + (k * 7 + i * 3) % 800  # 0.01 °C
    humidity = 4000 + (k * 11 + i * 5) % 2000  # 0.01 %
    payload = bytes([0x40, 0x00, i & 0xFF, 0x01, 90, 0x02]) + temperature.to_bytes(2, "little", signed=True)
    payload += bytes([0x03]) + humidity.to_bytes(2, "little")
    return payload.hex(" ")


def ruuvi(k, i):
    temperature = 4000 + (k * 7 + i * 3) % 800  # 0.005 °C
    humidity = 16000 + (k * 11 + i * 5) % 4000  # 0.0025 %
    pressure = 51325 + (i % 50)  # Pa - 50000
    power = ((2977 - 1600) << 5) | 20  # 2.977 V, +4 dBm
    payload = bytes([0x05]) + temperature.to_bytes(2, "big", signed=True) + humidity.to_bytes(2, "big")
    payload += pressure.to_bytes(2, "big")
    for axis in (4, -4, 1036):
        payload += axis.to_bytes(2, "big", signed=True)
    payload += power.to_bytes(2, "big") + bytes([i % 200]) + i.to_bytes(2, "big")
    payload += bytes([0xC0, 0x00, 0x00, 0x00, k >> 8, k & 0xFF])
    return payload.hex(" ")


def main():
    kind, n, rate, port, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    peripherals = []
    devices = []
    adapters = 1
    if kind == "notify":
        adapters = max(1, (n + PER_ADAPTER - 1) // PER_ADAPTER)
        for k in range(n):
            peripherals.append({
                "address": address(k), "adapter": "hci%d" % (k // PER_ADAPTER), "name": "bench-%04d" % k,
                "advertising_interval": 1.0,
                "gatt": [{"uuid": SERVICE, "characteristics": [{
                    "uuid": CHARACTERISTIC, "flags": ["notify"],
                    "notify": {"rate": rate, "counter": {"start": 0, "step": 1, "size": 4}},
                }]}],
            })
            devices.append({"name": "d%04d" % k, "match": {"address": address(k)}, "mode": "connected"})
        # The latency probe: no generator; bench/bridge-sub.c sends its notifications with PushNotification.
        peripherals.append({
            "address": address(PROBE_DEVICE), "adapter": "hci0", "name": "bench-probe", "advertising_interval": 1.0,
            "gatt": [{"uuid": SERVICE, "characteristics": [{"uuid": PROBE, "flags": ["notify"]}]}],
        })
        devices.append({"name": "d%04d" % PROBE_DEVICE, "match": {"address": address(PROBE_DEVICE)},
                        "mode": "connected"})
    elif kind in ("passive", "ruuvi"):
        for k in range(n):
            p = {"address": address(k), "address_type": "random", "connectable": False,
                 "advertising_interval": round(1.0 / rate, 3)}
            if k % 2 == 0 and kind == "passive":
                p["service_data"] = [{"uuid": "FCD2", "sequence": [bthome(k, i) for i in range(SEQUENCE)]}]
            else:
                p["manufacturer_data"] = [{"company": 0x0499, "sequence": [ruuvi(k, i) for i in range(SEQUENCE)]}]
            peripherals.append(p)
            devices.append({"name": "d%04d" % k, "match": {"address": address(k)}, "mode": "passive"})
    else:
        sys.exit("bridge-gen.py: unknown scenario kind %r (notify or passive)" % kind)
    scenario = {
        "settings": {"temporary_timeout": 60},
        "adapters": [{"id": "hci%d" % a, "address": "00:1A:7D:DA:71:%02X" % (0x20 + a)} for a in range(adapters)],
        "peripherals": peripherals,
    }
    config = {
        "mqtt": {"url": "mqtt://127.0.0.1:%d" % port, "base_topic": "blebridge", "client_id": "blebridge-bench"},
        "homeassistant": False,
        "logging": {"level": "warning"},
        "bluetooth": {"connection_slots": 32},
        "parsers": [
            {"name": "bench_seq", "uuid": CHARACTERISTIC, "fields": [{"name": "seq", "type": "u32le", "offset": 0}]},
            {"name": "bench_probe", "uuid": PROBE, "fields": [{"name": "probe_us", "type": "u32le", "offset": 0}]},
        ],
        "devices": devices,
    }
    if kind == "ruuvi":
        ble2mqtt = {
            "mqtt_host": "127.0.0.1", "mqtt_port": port, "base_topic": "ble2mqtt", "hci_adapter": "hci0",
            "log_level": "WARNING",
            # interval: seconds between the state messages of a passive device (default 60)
            "devices": [{"address": address(k), "type": "ruuvitag", "interval": 1} for k in range(n)],
        }
        with open(out + "/ble2mqtt.json", "w") as f:
            json.dump(ble2mqtt, f, indent=1)
    # JSON is YAML: both files are read by libyaml.
    with open(out + "/scenario.yaml", "w") as f:
        json.dump(scenario, f, indent=1)
    with open(out + "/bridge.yaml", "w") as f:
        json.dump(config, f, indent=1)


if __name__ == "__main__":
    main()
