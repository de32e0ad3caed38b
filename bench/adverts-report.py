#!/usr/bin/env python3
"""The figures of bench/adverts.sh.

  adverts-report.py row N INTERVAL T0 T1 CLK_TCK "REF0" "REF1" "OURS0" "OURS1" "SIM0" "SIM1" REF.rec OURS.rec [PATH]
      one JSON line: signals/s, lost, CPU µs per signal of ref and ours, the ratio, threads ("CPU THREADS" samples
      taken at T0 and T1, CLOCK_MONOTONIC ns; CPU in units of CLK_TCK per second); PATH names the path measured
      (advertisements by default, or startnotify)
  adverts-report.py table ROWS.jsonl
      the table
"""
import collections
import json
import sys

GRACE_NS = 2_000_000_000  # ours may deliver an advertisement this long after ref saw it


def records(path):
    out = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 4 and parts[0] == "d":
                out.append((int(parts[1]), int(parts[2]), int(parts[3])))
    return out


def row(args):
    n, interval, t0, t1, tck = int(args[0]), float(args[1]), int(args[2]), int(args[3]), int(args[4])
    (r0, rt0), (r1, rt1), (o0, ot0), (o1, ot1), (s0, _), (s1, _) = [tuple(map(int, a.split())) for a in args[5:11]]
    ref, ours = records(args[11]), records(args[12])
    path = args[13] if len(args) > 13 else "advertisements"
    window = (t1 - t0) / 1e9
    ref_in = [r for r in ref if t0 <= r[0] <= t1]
    ours_in = [r for r in ours if t0 <= r[0] <= t1]
    # Lost: an advertisement ref received in the window that ours never delivered (within the grace around the window:
    # at the window's start ours may have taken a signal a moment before ref did).
    have = collections.Counter((d, k) for t, d, k in ours if t0 - GRACE_NS <= t <= t1 + GRACE_NS)
    lost = 0
    for _, d, k in ref_in:
        if have[(d, k)] > 0:
            have[(d, k)] -= 1
        else:
            lost += 1
    ref_us = (r1 - r0) / tck * 1e6 / max(1, len(ref_in))
    ours_us = (o1 - o0) / tck * 1e6 / max(1, len(ours_in))
    out = {
        "path": path, "n": n, "interval": interval, "window_s": round(window, 2), "signals_per_s": round(len(ref_in) / window, 1),
        "ref_signals": len(ref_in), "ours_events": len(ours_in), "lost": lost,
        "ref_us": round(ref_us, 1), "ours_us": round(ours_us, 1), "ratio": round(ours_us / ref_us, 2) if ref_us else None,
        "ref_threads": rt1, "ours_threads": ot1, "sim_cpu_pct": round((s1 - s0) / tck / window * 100, 1),
    }
    print(json.dumps(out))


def table(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print("| path | N | interval | signals/s | lost | ref µs/signal | ours µs/signal | ratio (target ≤ 1.3) "
          "| threads ref / ours |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        measured = r["ratio"] is not None and r["ours_events"] > 0 and r["ours_us"] > 0
        verdict = "met" if measured and r["ratio"] <= 1.3 and r["lost"] == 0 else "MISSED"
        print(f"| {r.get('path', 'advertisements')} | {r['n']} | {r['interval']} s | {r['signals_per_s']} | {r['lost']} | {r['ref_us']} | {r['ours_us']} | "
              f"{r['ratio']} ({verdict}) | {r['ref_threads']} / {r['ours_threads']} |")


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "row":
        row(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "table":
        table(sys.argv[2])
    else:
        sys.exit(__doc__)
