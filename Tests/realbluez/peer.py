#!/opt/bumble/bin/python3
"""The scripted BLE peer of the real-BlueZ rig: a Bumble GATT peripheral on the second btvirt controller.

Usage: peer.py HCI_INDEX ADDRESS READY_FILE

It opens controller hciN through an HCI user channel (so bluetoothd never sees that controller), serves one custom
service and the standard Battery service, and advertises as "blebridge-peer" with the random static ADDRESS; the
advertising data stays within the 31 legacy bytes (btvirt silently drops longer data).

Under btvirt a controller's advertisement reaches a scanner once per scan start (and when advertising is enabled
during a scan), so until the first connection the peer re-enables advertising every second, for a discovery that
started before it advertised. After that it only restarts advertising when a link ends: a restart is a window of
tens of milliseconds with advertising off, and an LE Create Connection that lands in it fails at once with 0x3e
(Connection Failed to be Established) -- which, on this kernel, left every later connect to the peer stuck (see
docs/REAL-BLUEZ.md). The kernel starts a fresh scan for each connect, so steady advertising is enough from then on. SIGUSR1 drops every connection (link loss on demand); SIGUSR2 logs the peer's state (connections,
advertising sets, what each task waits for). When advertising first starts it writes
READY_FILE, which the check runner waits for.
"""

import asyncio
import signal
import sys
import time

from bumble.core import AdvertisingData
from bumble.device import Device
from bumble.gatt import Characteristic, CharacteristicValue, Service
from bumble.hci import Address
from user_channel import open_user_channel  # next to this script

SERVICE = "6e400001-b5a3-f393-e0a9-e50e24dcca9e"
READ_CHAR = "6e400002-b5a3-f393-e0a9-e50e24dcca9e"  # read: b"hello real bluez"
WRITE_CHAR = "6e400003-b5a3-f393-e0a9-e50e24dcca9e"  # write / write without response; read back
NOTIFY_CHAR = "6e400004-b5a3-f393-e0a9-e50e24dcca9e"  # notify: a counter, once a second
INDICATE_CHAR = "6e400005-b5a3-f393-e0a9-e50e24dcca9e"  # indicate: the same counter, once a second


def log(text):
    print(f"peer {time.monotonic():.3f}: {text}", flush=True)


async def main():
    index, address, ready_file = sys.argv[1], sys.argv[2], sys.argv[3]
    transport = await open_user_channel(index)
    device = Device.with_hci("blebridge-peer", Address(address), transport.source, transport.sink)

    written = bytearray(b"\x00")

    def on_write(connection, value):
        log(f"write {bytes(value).hex()}")
        written[:] = value

    counter = 0
    battery = Characteristic("2A19", Characteristic.Properties.READ | Characteristic.Properties.NOTIFY,
                             Characteristic.READABLE, bytes([87]))
    notify = Characteristic(NOTIFY_CHAR, Characteristic.Properties.READ | Characteristic.Properties.NOTIFY,
                            Characteristic.READABLE, bytes([0]))
    indicate = Characteristic(INDICATE_CHAR, Characteristic.Properties.READ | Characteristic.Properties.INDICATE,
                              Characteristic.READABLE, bytes([0]))
    device.add_services([
        Service(SERVICE, [
            Characteristic(READ_CHAR, Characteristic.Properties.READ, Characteristic.READABLE,
                           b"hello real bluez"),
            Characteristic(WRITE_CHAR,
                           Characteristic.Properties.READ | Characteristic.Properties.WRITE
                           | Characteristic.Properties.WRITE_WITHOUT_RESPONSE,
                           Characteristic.READABLE | Characteristic.WRITEABLE,
                           CharacteristicValue(read=lambda connection: bytes(written), write=on_write)),
            notify,
            indicate,
        ]),
        Service("180F", [battery]),
    ])
    # Flags, the 16-bit service list and the name: 3 + 4 + 16 = 23 bytes, within the 31 legacy bytes.
    device.advertising_data = bytes(AdvertisingData([
        (AdvertisingData.FLAGS, bytes([0x06])),
        (AdvertisingData.COMPLETE_LIST_OF_16_BIT_SERVICE_CLASS_UUIDS, bytes.fromhex("0f18")),
        (AdvertisingData.COMPLETE_LOCAL_NAME, b"blebridge-peer"),
    ]))

    # Set by the connection event itself, so a link that comes and goes between two rounds is not missed.
    links = {"ever": False, "since_advertising": False}

    def on_connection(connection):
        log(f"connected {connection.peer_address}")
        links["ever"] = True
        links["since_advertising"] = True
        connection.on("disconnection", lambda reason: log(f"disconnected {connection.peer_address}, reason {reason}"))

    device.on("connection", on_connection)

    loop = asyncio.get_running_loop()

    def drop_links():
        for connection in list(device.connections.values()):
            log(f"dropping the link to {connection.peer_address} (SIGUSR1)")
            loop.create_task(connection.disconnect())

    loop.add_signal_handler(signal.SIGUSR1, drop_links)

    rounds = {"advertise": 0, "hung": 0, "failed": 0}

    def dump_state():
        # For a failed check: what the peer thinks it is doing (the runner sends SIGUSR2 then copies peer.log).
        log(f"state: connections {[str(c.peer_address) for c in device.connections.values()]}, "
            f"legacy set {device.legacy_advertising_set!r}, sets {list(device.extended_advertising_sets)}, "
            f"legacy advertiser {device.legacy_advertiser!r}, rounds {rounds}")
        for task in asyncio.all_tasks():
            frames = task.get_stack(limit=4)
            where = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in frames)
            log(f"task {task.get_name()}: {where or 'no frames'}")

    loop.add_signal_handler(signal.SIGUSR2, dump_state)

    await device.power_on()
    log(f"powered on hci{index} as {address}")
    ready = False
    while True:
        if not device.connections and (not links["ever"] or links["since_advertising"] or not device.is_advertising):
            again = links["since_advertising"]
            # Cleared before the await: a connection that arrives meanwhile sets it again.
            links["since_advertising"] = False
            try:
                # Bounded: a command btvirt never answers must show in the log, not stop the peer silently.
                await asyncio.wait_for(device.start_advertising(own_address_type=1), 5)  # random static
                rounds["advertise"] += 1
                if again:
                    log("advertising again")
                if not ready:
                    log("advertising")
                    with open(ready_file, "w") as f:
                        f.write(address + "\n")
                    ready = True
            except asyncio.TimeoutError:
                rounds["hung"] += 1
                links["since_advertising"] = again
                log("re-advertising: start_advertising did not complete within 5 s")
            except Exception as error:  # a connection that came in between; the next round sees it
                rounds["failed"] += 1
                links["since_advertising"] = again
                log(f"re-advertising failed: {error!r}")
        elif device.connections:
            counter = (counter + 1) % 256
            notify.value = bytes([counter])
            indicate.value = bytes([counter])
            try:
                await device.notify_subscribers(notify, bytes([counter]))
                await device.notify_subscribers(battery, bytes([87]))
                # Bounded: an indication waits for the central's confirmation.
                await asyncio.wait_for(device.indicate_subscribers(indicate, bytes([counter])), 5)
            except Exception as error:
                log(f"notify failed: {error!r}")
        await asyncio.sleep(1.0)


asyncio.run(main())
