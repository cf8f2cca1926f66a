#!/usr/bin/env python3
"""ZipMoE runs against the floors their own counters imply, from the JSON of bench/cli_bench.py:

    .venv/bin/python bench/floors.py docs/benchmarks/cpu/flagship_ds27.json [more.json ...] [--md OUT.md]

A run's counters (the log line "ZipMoE expert cache so far", recorded as zipmoe_stats) cover its whole
generation: the prompt and every decoded token. Its time is prompt_s + tpot_s x decode_tokens, and
its floors are:
  I/O     the I/O thread's time in reads (the runtime's io ms; it reads one chunk at a time), and
          beside it MB read / the O_DIRECT bandwidth cli_bench measured (a sequential read,
          which the runtime's reads sometimes beat: a ratio below 1 on that column)
  decode  (decode + recover CPU time) / the threads it ran with
The compute floor (the products with every weight in memory) cannot be measured for a model that
does not fit: time / max(I/O, decode) above 1 is then compute, and what the pipeline fails to overlap.
Counters of a build with the time account (docs/GUIDE.md, "Where a token's time goes") add where the
graphs' time went: compute outside fetches, and on a fetch's critical path the wait for reads and
thread 0's own decoding.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _common import ACCOUNT, COUNTERS as STATS


def rows(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    bw = doc.get("odirect_gbps")
    threads = doc.get("threads") or 1
    out = []
    for r in doc.get("rows", []):
        m = STATS.search(r.get("zipmoe_stats", ""))
        if not m or r.get("rc") != 0 or r.get("tpot_s") is None or not bw:
            continue
        mb, io_ms, dec_ms, rec_ms = (float(x) for x in m.groups())
        time_s = (r.get("prompt_s") or 0) + r["tpot_s"] * r["decode_tokens"]
        io_floor = io_ms / 1e3
        bw_floor = mb / 1e3 / bw
        dec_floor = (dec_ms + rec_ms) / 1e3 / threads
        row = {"file": path.name, "cap_pct": r.get("cap_pct"), "context": r.get("context"), "time_s": time_s,
               "io_floor_s": io_floor, "bw_floor_s": bw_floor, "decode_floor_s": dec_floor,
               "ratio": time_s / max(io_floor, dec_floor, 1e-9), "bound": "I/O" if io_floor >= dec_floor else "decode"}
        account = ACCOUNT.search(r.get("zipmoe_stats", ""))
        if account:
            fetch_ms, own_ms, wait_ms, graphs_ms = (float(x) for x in account.groups())
            row.update({"compute_s": max(0.0, graphs_ms - fetch_ms) / 1e3, "read_wait_s": wait_ms / 1e3,
                        "own_decode_s": own_ms / 1e3})
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", type=Path, help="bench/cli_bench.py results")
    ap.add_argument("--md", type=Path, default=None, help="also write the table here (Markdown)")
    args = ap.parse_args(argv)
    table = ["| results | cap | context | time s | I/O time s | MB read / measured bw, s | decode floor s | "
             "time / max(I/O, decode) | bound by | compute s | waiting for reads s | thread 0 decoding s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in args.json:
        for r in rows(path):
            table.append(f"| {r['file']} | {r['cap_pct']}% | {r['context']} | {r['time_s']:.1f} | {r['io_floor_s']:.1f} | "
                         f"{r['bw_floor_s']:.1f} | {r['decode_floor_s']:.1f} | {r['ratio']:.2f} | {r['bound']} | "
                         + " | ".join(f"{r[k]:.1f}" if k in r else "-" for k in ("compute_s", "read_wait_s", "own_decode_s"))
                         + " |")
    text = "\n".join(table)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
