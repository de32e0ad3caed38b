"""The measurements of bench/handover.sh (see there). Uses the end-to-end fixtures of Tests/fidelity."""
import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "Tests" / "fidelity"))
from bridge_fixtures import Broker, BridgeProcess, Judge  # noqa: E402
from sim_fixtures import bthome_thermometer, hr_peripheral, start_simulator  # noqa: E402


def address(i):
    return f"C0:00:00:00:01:{i:02X}"


def thermo(i):
    return f"D0:00:00:00:02:{i:02X}"


def scenario(rssi, devices, passive=0):
    out = ['adapters:\n  - {id: hci0, address: "00:1A:7D:DA:71:10", name: gw}\nperipherals:\n']
    out += [bthome_thermometer(thermo(i), rssi, packets=240, period=1, interval=0.25, name=f"thermo {i}")
            for i in range(passive)]
    out += [hr_peripheral(address(i), rssi, name=f"HR {i}") for i in range(devices)]
    return "".join(out)


def config(port, gateway, devices, passive=0):
    lines = [f'mqtt: {{url: "mqtt://127.0.0.1:{port}"}}', "homeassistant: {enabled: false}",
             f"gateway: {{id: {gateway}, handover_after: 600}}", f"bluetooth: {{connection_slots: {max(5, devices)}}}",
             "devices:"]
    for i in range(devices):
        lines.append(f'  - {{name: strap{i}, match: {{address: "{address(i)}"}}, mode: connected}}')
    for i in range(passive):
        lines.append(f'  - {{name: thermo{i}, match: {{address: "{thermo(i)}"}}, mode: passive}}')
    return "\n".join(lines) + "\n"


def owner(judge, device="strap0"):
    claims = judge.json_on(f"blebridge/bridge/claims/{device}")
    return claims[-1]["owner"] if claims else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--steady", type=float, default=60)
    ap.add_argument("--passive", type=int, default=10)
    args = ap.parse_args()
    broker = Broker()
    rssi = {"a": -50, "b": -80}
    sims = {g: start_simulator(scenario(rssi[g], args.devices, args.passive)) for g in ("a", "b")}
    judge = Judge(broker.port, filters=("blebridge/#",))
    bridges = {g: BridgeProcess(config(broker.port, g, args.devices, args.passive), sims[g].env)
               for g in ("a", "b")}
    try:
        judge.wait(lambda m: all(owner(judge, f"strap{i}") for i in range(args.devices)), timeout=60,
                   what="every strap claimed")
        # Steady state: what coordination publishes per device per minute.
        time.sleep(5)
        t0 = time.monotonic()
        time.sleep(args.steady)
        t1 = time.monotonic()
        window = [m for m in judge.snapshot() if t0 <= m[0] < t1]
        claims = [m for m in window if m[1].startswith("blebridge/bridge/claims/")]
        sightings = [m for m in window if m[1].endswith("/sightings")]
        minutes = (t1 - t0) / 60
        per = args.devices * minutes
        n = len(claims) + len(sightings)
        size = sum(len(m[1]) + len(m[2]) for m in claims + sightings)
        per = (args.devices + args.passive) * minutes
        print(f"coordination, {args.devices} connected and {args.passive} passive devices, 2 gateways, "
              f"{t1 - t0:.0f} s steady: {len(claims) / (args.devices * minutes):.2f} claim messages per connected "
              f"device per minute, {len(sightings) / minutes:.2f} sightings messages per minute from the two gateways; "
              f"{size / per:.0f} bytes of topic and payload per device per minute")
        if args.passive:
            states = [json.loads(m[2]) for m in window if m[1].startswith("blebridge/thermo") and m[2]
                      and "/" not in m[1][len("blebridge/"):]]
            keys = [(m[1], json.loads(m[2]).get("packet_id")) for m in window
                    if m[1].startswith("blebridge/thermo") and "/" not in m[1][len("blebridge/"):] and m[2]]
            distinct = len(set(keys))
            expected = args.passive * (t1 - t0)  # one new packet per second per thermometer
            best = sum(1 for v in states if v.get("rssi") == rssi["a"])
            print(f"passive, {args.passive} BTHome thermometers heard by both gateways: {len(keys)} states published "
                  f"for {distinct} distinct readings ({len(keys) - distinct} duplicates; about {expected:.0f} "
                  f"readings advertised), {best} of them with the best gateway's RSSI; each gateway also receives "
                  f"the {len(keys) / (args.passive * minutes):.0f} states per passive "
                  f"device per minute it reads to de-duplicate")
        times = []
        for r in range(args.rounds):
            current = owner(judge)
            other = "b" if current == "a" else "a"
            killed = time.monotonic()
            bridges[current].proc.kill()
            bridges[current].proc.wait()
            # bluetoothd keeps a killed client's links; a gateway that lost power would drop them (supervision
            # timeout), and only then can another gateway connect to a device that takes one connection.
            for i in range(args.devices):
                try:
                    sims[current].control("Disconnect", f"string:{address(i)}", "string:timeout")
                except AssertionError:
                    pass  # not connected there
            judge.wait(lambda m: owner(judge) == other, timeout=60, what=f"round {r + 1}: {other}'s claim")
            judge.wait_json("blebridge/strap0", lambda v: v.get("heart_rate_bpm") in (65, 66),
                            after=time.monotonic(), timeout=60)
            took = time.monotonic() - killed
            times.append(took)
            print(f"round {r + 1}: {current} killed, {other} serving after {took:.2f} s", flush=True)
            bridges[current].close()
            bridges[current] = BridgeProcess(
                config(broker.port, current, args.devices, args.passive), sims[current].env)
            judge.wait_json(f"blebridge/bridge/{current}/state", lambda v: v == {"state": "online"},
                            after=time.monotonic(), timeout=30)
            time.sleep(3)
        times.sort()
        print(f"hand-over after SIGKILL of the owner, {len(times)} rounds: p50 {statistics.median(times):.2f} s, "
              f"max {times[-1]:.2f} s (to the new owner's first reading at a subscriber; lease 30 s, which a will "
              f"makes irrelevant)")
    finally:
        for b in bridges.values():
            b.close()
        judge.close()
        for s in sims.values():
            s.stop()
        broker.close()


if __name__ == "__main__":
    main()
