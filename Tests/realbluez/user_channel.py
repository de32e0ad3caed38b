"""Opening a btvirt controller for Bumble through an HCI user channel, shared by peer.py and central.py."""

import asyncio
import errno
import time

from bumble.transport import open_transport


async def open_user_channel(index):
    # The kernel sets a fresh controller up and powers it down again on its own; a user channel can only be opened
    # on a controller that is down, so EBUSY here means "not yet", for a few seconds at most.
    deadline = time.monotonic() + 20
    while True:
        try:
            return await open_transport(f"hci-socket:{index}")
        except OSError as error:
            if error.errno not in (errno.EBUSY, errno.EALREADY) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
