#!/usr/bin/env python3
"""Lists the HCI commands and events of a btmon trace (hci.btsnoop, monitor format) one line each.

Usage: snoop-list.py hci.btsnoop [--index N] [--after EPOCH] [--before EPOCH] [--all]

btmon 5.66 (`btmon -r`) crashes part way through the rig's traces, so this reads the file itself. Times are
seconds since the epoch, the clock of bluetoothd.log and dbus-monitor.log. Without --all only commands and events
are listed (no ACL data). LE meta events show their subevent; a few common opcodes are named.
"""

import argparse
import struct
import sys

EPOCH_2000_US = 0x00DCDDB30F2F8000  # btsnoop timestamps: microseconds since year 0
OPS = {0: "new-index", 1: "del-index", 2: "CMD", 3: "EVT", 4: "ACL>", 5: "ACL<", 8: "open-index", 9: "close-index",
       10: "index-info", 11: "vendor-diag", 12: "system-note", 13: "user-logging", 14: "ctrl-open", 15: "ctrl-close",
       16: "ctrl-command", 17: "ctrl-event"}
COMMANDS = {0x0406: "Disconnect", 0x0C03: "Reset", 0x2005: "LE Set Random Address", 0x2006: "LE Set Adv Parameters",
            0x2008: "LE Set Adv Data", 0x2009: "LE Set Scan Rsp Data", 0x200A: "LE Set Adv Enable",
            0x200B: "LE Set Scan Parameters", 0x200C: "LE Set Scan Enable", 0x200D: "LE Create Connection",
            0x200E: "LE Create Connection Cancel", 0x2011: "LE Add To Accept List", 0x2016: "LE Read Remote Features",
            0x2041: "LE Set Ext Scan Parameters", 0x2042: "LE Set Ext Scan Enable", 0x2043: "LE Ext Create Connection"}
EVENTS = {0x05: "Disconnection Complete", 0x0E: "Command Complete", 0x0F: "Command Status", 0x13: "Num Completed"}
LE_SUB = {0x01: "LE Connection Complete", 0x02: "LE Advertising Report", 0x03: "LE Conn Update Complete",
          0x04: "LE Read Remote Features Complete", 0x0A: "LE Enhanced Connection Complete"}


def describe(op, data):
    if op == 2 and len(data) >= 3:
        opcode = struct.unpack("<H", data[:2])[0]
        return f"CMD {COMMANDS.get(opcode, f'0x{opcode:04x}')} {data[3:].hex()}"
    if op == 3 and len(data) >= 2:
        code, body = data[0], data[2:]
        if code == 0x3E and body:
            return f"EVT {LE_SUB.get(body[0], f'LE 0x{body[0]:02x}')} {body[1:].hex()}"
        if code == 0x0E and len(body) >= 4:
            opcode = struct.unpack("<H", body[1:3])[0]
            return f"EVT Command Complete {COMMANDS.get(opcode, f'0x{opcode:04x}')} status 0x{body[3]:02x} {body[4:].hex()}"
        if code == 0x0F and len(body) >= 4:
            opcode = struct.unpack("<H", body[2:4])[0]
            return f"EVT Command Status {COMMANDS.get(opcode, f'0x{opcode:04x}')} status 0x{body[0]:02x}"
        return f"EVT {EVENTS.get(code, f'0x{code:02x}')} {body.hex()}"
    return f"{OPS.get(op, f'op{op}')} {data[:40].hex()}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--index", type=int)
    parser.add_argument("--after", type=float, default=0)
    parser.add_argument("--before", type=float, default=float("inf"))
    parser.add_argument("--all", action="store_true")
    args = parser.parse_args()
    data = open(args.trace, "rb").read()
    if data[:8] != b"btsnoop\0":
        sys.exit(f"{args.trace}: not a btsnoop file")
    offset = 16
    while offset + 24 <= len(data):
        _, included, flags, _, stamp = struct.unpack(">IIIIq", data[offset:offset + 24])
        body = data[offset + 24:offset + 24 + included]
        offset += 24 + included
        index, op = flags >> 16, flags & 0xFFFF
        when = (stamp - EPOCH_2000_US) / 1e6
        if args.index is not None and index != args.index:
            continue
        if not (args.after <= when <= args.before) or (not args.all and op not in (2, 3)):
            continue
        if not args.all and op == 3 and body[:1] == b"\x13":
            continue
        print(f"{when:.6f} hci{index} {describe(op, body)}")


main()
