#!/opt/bumble/bin/python3
"""The scripted BLE central of the real-BlueZ rig: a Bumble GATT client on the second btvirt controller, for the
bridge's peripheral role (`blebridge serve`, served by the real bluetoothd on the first controller).

Usage: central.py HCI_INDEX ADDRESS NAME GO_FILE

It opens controller hciN through an HCI user channel (so bluetoothd never sees it), scans until an advertiser whose
local name is NAME appears (restarting the scan every 2 s: under btvirt an advertisement reaches a scanner once per
scan start), connects, discovers, and then, printing one line per step for the check runner to test:

  POWERED                          the controller is ours (the runner starts bluetoothd again after this)
  FOUND <address>                  the bridge's advertisement
  CONNECTED                        the link and GATT discovery
  READ 2a19 <hex>                  Battery Level, served from MQTT
  SUBSCRIBED 2a19                  the CCC written (bluetoothd calls the bridge's StartNotify)
  NOTIFY 2a19 <hex>                each notification; the runner publishes a new level once it sees SUBSCRIBED
  WRITTEN <uuid> <hex>             a write with response to the custom characteristic (it becomes an MQTT message)
  READ <uuid> <hex>                the same characteristic read back
  DONE                             everything above happened

It waits for GO_FILE to exist before writing (the runner creates it once the notification arrived), so the order
on MQTT is fixed. Every wait is bounded; a failure prints "ERROR <step>: <reason>" and exits 1.
"""

import asyncio
import os
import sys

from bumble.core import UUID, AdvertisingData
from bumble.device import Device, Peer
from bumble.hci import Address
from user_channel import open_user_channel  # next to this script

LAMP_CHAR = "b1eb4e71-0000-4000-8000-00000000de70"


def say(text):
    print(text, flush=True)


async def step(name, awaitable, limit):
    try:
        return await asyncio.wait_for(awaitable, limit)
    except asyncio.TimeoutError:
        say(f"ERROR {name}: no answer within {limit} s")
    except Exception as error:  # the reason goes to the runner's log
        say(f"ERROR {name}: {error!r}")
    sys.exit(1)


async def main():
    index, address, name, go_file = sys.argv[1:5]
    transport = await open_user_channel(index)
    device = Device.with_hci("blebridge-central", Address(address), transport.source, transport.sink)
    await device.power_on()
    say("POWERED")
    found = asyncio.get_running_loop().create_future()

    def on_advertisement(advertisement):
        local = advertisement.data.get(AdvertisingData.COMPLETE_LOCAL_NAME)
        if local is None:
            local = advertisement.data.get(AdvertisingData.SHORTENED_LOCAL_NAME)
        if isinstance(local, bytes):
            local = local.decode("utf-8", "replace")
        if local == name and advertisement.is_connectable and not found.done():
            found.set_result(advertisement.address)

    device.on("advertisement", on_advertisement)

    async def scan_until_found():
        while not found.done():
            await device.start_scanning(active=True, filter_duplicates=False)
            try:
                await asyncio.wait_for(asyncio.shield(found), 2)
            except asyncio.TimeoutError:
                pass
            await device.stop_scanning()
        return found.result()

    target = await step("scan", scan_until_found(), 150)
    say(f"FOUND {target}")
    connection = await step("connect", device.connect(target, own_address_type=1), 30)
    peer = Peer(connection)
    await step("discover", peer.discover_all(), 60)
    say("CONNECTED")

    battery = peer.get_characteristics_by_uuid(UUID("2A19"))
    lamp = peer.get_characteristics_by_uuid(UUID(LAMP_CHAR))
    if not battery or not lamp:
        say(f"ERROR discover: services {[str(s.uuid) for s in peer.services]}")
        sys.exit(1)
    battery, lamp = battery[0], lamp[0]
    value = await step("read 2a19", peer.read_value(battery), 30)
    say(f"READ 2a19 {bytes(value).hex()}")

    notified = asyncio.Queue()
    await step("subscribe 2a19", peer.subscribe(battery, lambda v: notified.put_nowait(bytes(v))), 30)
    say("SUBSCRIBED 2a19")
    value = await step("notification 2a19", notified.get(), 60)
    say(f"NOTIFY 2a19 {value.hex()}")

    async def go():
        while not os.path.exists(go_file):
            await asyncio.sleep(0.2)

    await step("wait for the runner", go(), 60)
    await step(f"write {LAMP_CHAR}", peer.write_value(lamp, bytes([0x2A]), with_response=True), 30)
    say(f"WRITTEN {LAMP_CHAR} 2a")
    value = await step(f"read {LAMP_CHAR}", peer.read_value(lamp), 30)
    say(f"READ {LAMP_CHAR} {bytes(value).hex()}")
    await step("disconnect", connection.disconnect(), 30)
    say("DONE")


asyncio.run(main())
