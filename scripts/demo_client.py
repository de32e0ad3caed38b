#!/usr/bin/env python3
"""Demo client: what a real BlueZ client (bleak) sees of bluez-sim running config/demo-scenario.yaml.
Scans, lists what it found, connects to the heart-rate strap and prints live decoded notifications."""
import asyncio
import os
import sys
import time

from bleak import BleakClient, BleakScanner

HEART_RATE_SERVICE = "0000180d-0000-1000-8000-00805f9b34fb"
HEART_RATE_MEASUREMENT = "00002a37-0000-1000-8000-00805f9b34fb"
BATTERY_LEVEL = "00002a19-0000-1000-8000-00805f9b34fb"
SECONDS = float(os.environ.get("DEMO_SECONDS", "15"))


def decode_heart_rate(data: bytes) -> str:
    flags = data[0]
    i = 1
    if flags & 0x01:
        bpm = int.from_bytes(data[i:i + 2], "little")
        i += 2
    else:
        bpm = data[i]
        i += 1
    parts = [f"{bpm} bpm"]
    if flags & 0x04:
        parts.append("contact" if flags & 0x02 else "no contact")
    if flags & 0x08:
        parts.append(f"{int.from_bytes(data[i:i + 2], 'little')} kJ")
        i += 2
    if flags & 0x10:
        rr = [int.from_bytes(data[j:j + 2], "little") / 1024 for j in range(i, len(data) - 1, 2)]
        parts.append("RR " + ", ".join(f"{r:.3f} s" for r in rr))
    return ", ".join(parts)


async def main() -> int:
    print("scanning for 3 s ...")
    found = await BleakScanner.discover(timeout=3.0, return_adv=True)
    for device, adv in sorted(found.values(), key=lambda x: x[0].address):
        extras = []
        if adv.manufacturer_data:
            extras.append("mfr " + ", ".join(f"0x{k:04X}={v.hex()}" for k, v in adv.manufacturer_data.items()))
        if adv.service_data:
            extras.append("svc " + ", ".join(f"{k[4:8]}={v.hex()}" for k, v in adv.service_data.items()))
        print(f"  {device.address}  {adv.local_name or '?':20} RSSI {adv.rssi:4} dBm  {'; '.join(extras)}")

    strap = next((d for d, adv in found.values() if HEART_RATE_SERVICE in adv.service_uuids), None)
    if strap is None:
        print("no heart-rate strap found", file=sys.stderr)
        return 1
    print(f"connecting to {strap.name} ({strap.address}) ...")
    async with BleakClient(strap, timeout=15) as client:
        for service in client.services:
            print(f"  service {service.uuid} (handle 0x{service.handle:04x})")
            for char in service.characteristics:
                print(f"    char {char.uuid} (0x{char.handle:04x}) {','.join(char.properties)}")
        battery = await client.read_gatt_char(BATTERY_LEVEL)
        print(f"battery: {battery[0]} %")
        start = time.monotonic()

        def on_measurement(_, data: bytearray):
            print(f"  [{time.monotonic() - start:5.1f} s] heart rate: {decode_heart_rate(bytes(data))}")

        await client.start_notify(HEART_RATE_MEASUREMENT, on_measurement)
        print(f"live heart-rate notifications for {SECONDS:.0f} s:")
        await asyncio.sleep(SECONDS)
        await client.stop_notify(HEART_RATE_MEASUREMENT)
    print("disconnected; done")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
