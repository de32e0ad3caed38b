"""bleak 3.1 against bluez-sim, driven exactly as it drives real BlueZ."""
import asyncio
import time

from bleak import BleakClient, BleakScanner

from sim_fixtures import (BTHOME, ECHO, ENVIRO, HR_STRAP, RUUVI, sim, uuid16, wait_until)  # noqa: F401

NUS_SERVICE = "6e400001-b5a3-f393-e0a9-e50e24dcca9e"
NUS_RX = "6e400002-b5a3-f393-e0a9-e50e24dcca9e"
NUS_TX = "6e400003-b5a3-f393-e0a9-e50e24dcca9e"
HRM_SEQUENCE = [bytes.fromhex(h) for h in
                ("1E 48 10 00 55 03", "1E 4A 10 00 3E 03", "1E 4B 11 00 33 03", "1E 49 11 00 4A 03")]


def run(coro):
    return asyncio.run(coro)


def test_scan_with_service_uuid_filter_reports_name_rssi(sim):
    async def main():
        found = await BleakScanner.discover(timeout=1.5, return_adv=True, service_uuids=[uuid16("180d")])
        return {d.address: (d, adv) for d, adv in found.values()}

    found = run(main())
    assert list(found) == [HR_STRAP], "the UUID filter lets only the heart-rate strap through"
    device, adv = found[HR_STRAP]
    assert adv.local_name == "Polar H10 4F2C11"
    assert -61 - 1 <= adv.rssi <= -55 + 1
    assert adv.tx_power == 0
    assert uuid16("180d") in adv.service_uuids


def test_scan_reports_manufacturer_and_service_data(sim):
    async def main():
        found = await BleakScanner.discover(timeout=2.5, return_adv=True)
        return {d.address: adv for d, adv in found.values()}

    found = run(main())
    assert {HR_STRAP, BTHOME, RUUVI, ECHO, ENVIRO} <= set(found)
    ruuvi = found[RUUVI].manufacturer_data[0x0499]
    assert len(ruuvi) == 24 and ruuvi[0] == 0x05
    assert ruuvi[-6:] == bytes.fromhex("CBB8334C884F")
    bthome = found[BTHOME].service_data[uuid16("fcd2")]
    assert bthome[0] == 0x40 and bthome[1] == 0x00
    assert found[BTHOME].local_name == "ATC_8F80A5"


def test_service_tree_has_bluez_handles(sim):
    async def main():
        async with BleakClient(HR_STRAP, timeout=10) as client:
            tree = {}
            for service in client.services:
                tree[(service.uuid, service.handle)] = {
                    (c.uuid, c.handle, tuple(c.properties)): sorted((d.uuid, d.handle) for d in c.descriptors)
                    for c in service.characteristics
                }
            return tree

    tree = run(main())
    assert set(tree) == {(uuid16("1800"), 0x01), (uuid16("180a"), 0x06), (uuid16("180d"), 0x0d),
                         (uuid16("180f"), 0x13)}
    hr = tree[(uuid16("180d"), 0x0d)]
    assert hr[(uuid16("2a37"), 0x0e, ("notify",))] == [(uuid16("2902"), 0x10)]
    assert hr[(uuid16("2a38"), 0x11, ("read",))] == []
    battery = tree[(uuid16("180f"), 0x13)]
    assert battery[(uuid16("2a19"), 0x14, ("read", "notify"))] == [(uuid16("2902"), 0x16), (uuid16("2904"), 0x17)]


def test_start_notify_delivers_at_the_configured_rate(sim):
    async def main():
        received = []
        async with BleakClient(HR_STRAP, timeout=10) as client:
            await client.start_notify(uuid16("2a37"), lambda _, data: received.append((time.monotonic(), bytes(data))))
            await asyncio.sleep(3.4)
            await client.stop_notify(uuid16("2a37"))
        return received

    received = run(main())
    assert 3 <= len(received) <= 4, received
    values = [v for _, v in received]
    assert values == HRM_SEQUENCE[:len(values)]
    gaps = [b[0] - a[0] for a, b in zip(received, received[1:])]
    assert all(0.8 <= g <= 1.2 for g in gaps), gaps


def test_read_and_write_with_and_without_response(sim):
    async def main():
        echoes = []
        async with BleakClient(ECHO, timeout=10) as client:
            model = await client.read_gatt_char(uuid16("2a24"))
            manufacturer = await client.read_gatt_char(uuid16("2a29"))
            await client.start_notify(NUS_TX, lambda _, data: echoes.append(bytes(data)))
            await client.write_gatt_char(NUS_RX, b"hello", response=True)
            await client.write_gatt_char(NUS_RX, b"world", response=False)
            for _ in range(100):
                if len(echoes) >= 2:
                    break
                await asyncio.sleep(0.02)
            return model, manufacturer, echoes

    model, manufacturer, echoes = run(main())
    assert model == b"nRF52832"
    assert manufacturer == b"Nordic Semiconductor"
    assert echoes == [b"hello", b"world"]
    writes = sim.control("GetWrites", f"string:{ECHO}")
    assert writes.count(NUS_RX) == 2
    assert '"request"' in writes and '"command"' in writes


def test_remote_disconnect_fires_the_disconnected_callback(sim):
    async def main():
        gone = asyncio.Event()
        client = BleakClient(HR_STRAP, timeout=10, disconnected_callback=lambda _: gone.set())
        await client.connect()
        assert client.is_connected
        await asyncio.to_thread(sim.control, "Disconnect", f"string:{HR_STRAP}", "string:remote")
        await asyncio.wait_for(gone.wait(), 5)
        return client.is_connected

    assert run(main()) is False
    assert sim.counters()["remote_disconnects"] == 1


def test_le_connection_abort_by_local_is_retried_by_bleak(sim):
    sim.control("InjectFault", f"string:{HR_STRAP}", "string:le-connection-abort-by-local", "string:{count: 1}")

    async def main():
        async with BleakClient(HR_STRAP, timeout=15) as client:
            return client.is_connected, await client.read_gatt_char(uuid16("2a38"))

    connected, location = run(main())
    assert connected and location == b"\x01"
    counters = sim.counters()
    assert counters["connect_failures"] == 1
    assert counters["connects"] == 1
    assert counters["connect_calls"] == 2


def test_acquire_notify_path(sim):
    async def main():
        received = []
        async with BleakClient(ENVIRO, timeout=10) as client:
            await client.start_notify(uuid16("2a6e"), lambda _, data: received.append(bytes(data)),
                                      bluez={"use_start_notify": False})
            await asyncio.to_thread(sim.control, "PushNotification", f"string:{ENVIRO}", "string:2A6E",
                                    "array:byte:0x70,0x08")
            await asyncio.sleep(1.3)
            await client.stop_notify(uuid16("2a6e"))
        return received

    received = run(main())
    assert bytes([0x70, 0x08]) in received
    assert len(received) >= 2  # the pushed one and at least one from the 1 Hz generator
    counters = sim.counters()
    assert counters["notify_acquired"] == 1
    assert counters.get("notify_sessions", 0) == 0


def test_passive_scan_with_advertisement_monitor(sim):
    from bleak.args.bluez import OrPattern
    from bleak.assigned_numbers import AdvertisementDataType

    async def main():
        seen = {}

        def callback(device, adv):
            seen[device.address] = adv

        scanner = BleakScanner(callback, scanning_mode="passive", bluez={
            "or_patterns": [OrPattern(0, AdvertisementDataType.SERVICE_DATA_UUID16, b"\xd2\xfc")]})
        async with scanner:
            for _ in range(60):
                if BTHOME in seen:
                    break
                await asyncio.sleep(0.05)
        return seen

    seen = run(main())
    assert BTHOME in seen
    assert seen[BTHOME].service_data[uuid16("fcd2")][0] == 0x40
    assert sim.counters()["monitors_registered"] == 1
