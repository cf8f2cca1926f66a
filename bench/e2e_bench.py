#!/usr/bin/env python3
"""End-to-end bench: stock llama.cpp (the same build, BF16 GGUF, mmap) against ZipMoE (default
codec) and ZipMoE with compression off (raw E-chunks through the same cache and I/O path),
each under a memory cap of 25 / 50 / 75% of the BF16 model's size, with the model evicted from
the page cache before every run.

    .venv/bin/python bench/e2e_bench.py --bf16 M.gguf [--zipmoe M.zipmoe.gguf] [--raw M.raw.gguf]
        [--caps 25,50,75] [--prompt-tokens 64] [--gen-tokens 16] [--threads 2] [--direct-io]

Missing ZipMoE files are made from the BF16 GGUF (fhuf, and raw for the ablation). Every run is
`capped-run --mem CAP --evict FILE -- python -c <probe>` (../shared/tools/capped-run: a child
memory cgroup, page cache included); the probe loads the model, evaluates a prompt of
--prompt-tokens tokens (TTFT: until the first generated token) and generates --gen-tokens
tokens greedily (TPOT: mean time per token after the first). The ZipMoE expert-cache budget
is what the cap leaves after the non-expert weights and a fixed allowance for the runtime.
The O_DIRECT bandwidth of the model's disk is measured in the same run. Prints a table, saves
bench/results/e2e_bench.json and e2e_bench.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CAPPED_RUN = Path(__file__).resolve().parents[2] / "shared" / "tools" / "capped-run"

PROBE = r"""
import json, os, sys, time
path, n_prompt, n_gen, threads, budget, direct = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6] == "1"
from zipmoe_py import Llama
opts = {} if budget == "-" else {"zipmoe_budget": int(budget), "zipmoe_direct_io": direct}
t0 = time.perf_counter()
llm = Llama(model_path=path, n_ctx=n_prompt + n_gen + 8, n_batch=512, n_threads=threads, verbose=False, **opts)
t_load = time.perf_counter() - t0
words = ("the model routes every token to a few experts and the cache keeps the popular ones close "
         "while the rest stay compressed on disk until the router asks for them again").split()
tokens = [llm.token_bos()]
i = 0
while len(tokens) < n_prompt:
    tokens += llm.tokenize((" " + words[i % len(words)]).encode(), add_bos=False)
    i += 1
tokens = tokens[:n_prompt]
stamps = []
t0 = time.perf_counter()
for tok in llm.generate(tokens, temp=0.0, repeat_penalty=1.0):
    stamps.append(time.perf_counter())
    if len(stamps) == n_gen:
        break
ttft = stamps[0] - t0
tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
io = dict(line.split(":") for line in open("/proc/self/io"))
print(json.dumps({"load_s": t_load, "ttft_s": ttft, "tpot_s": tpot, "tok_per_s": 1 / tpot,
                  "read_bytes": int(io["read_bytes"]), "zipmoe": llm.zipmoe_stats()}))
"""


def run_capped(cap: int, evict: Path, cmd: list) -> tuple[dict, dict]:
    # from a neutral folder: `python -c` puts the current folder first on sys.path, and the source
    # tree's zipmoe_py holds no build
    proc = subprocess.run([sys.executable, str(CAPPED_RUN), "--mem", str(cap), "--evict", str(evict), "--",
                           *map(str, cmd)], capture_output=True, text=True, cwd=tempfile.gettempdir())
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or len(lines) < 2:
        return {"error": (proc.stderr or proc.stdout)[-1500:]}, json.loads(lines[-1]) if lines else {}
    return json.loads(lines[-2]), json.loads(lines[-1])


def non_expert_bytes(zipmoe_path: Path) -> int:
    from zipmoe_py import gguf_file

    header = gguf_file.read_header(zipmoe_path)
    return sum(t.nbytes() for t in header.tensors if not t.name.endswith(".zipmoe"))


def ensure_zipmoe(bf16: Path, out: Path, codec: str) -> Path:
    if not out.exists():
        from zipmoe_py import format as zformat

        print(f"making {out} ({codec}) from {bf16} ...", flush=True)
        zformat.repack(bf16, out, codec=codec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bf16", type=Path, required=True, help="BF16 GGUF (stock llama.cpp's input)")
    ap.add_argument("--zipmoe", type=Path, default=None, help="ZipMoE GGUF made from it (default: made beside it)")
    ap.add_argument("--raw", type=Path, default=None, help="ZipMoE GGUF with raw E-chunks (default: made beside it)")
    ap.add_argument("--caps", default="25,50,75", help="memory caps in %% of the BF16 model size (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runtime-allowance", default="400M",
                    help="memory kept for the runtime (Python, compute buffers, KV) when sizing the expert "
                         "cache: budget = cap - non-expert weights - this (default: %(default)s)")
    ap.add_argument("--direct-io", action="store_true", help="ZipMoE reads chunks with O_DIRECT")
    ap.add_argument("--systems", default="stock,zipmoe,raw", help="which systems to run (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/e2e_bench.json"))
    args = ap.parse_args()

    from zipmoe_py.bindings import parse_size

    bf16 = args.bf16.resolve()
    zipmoe = (args.zipmoe or ensure_zipmoe(bf16, bf16.with_suffix(".zipmoe.gguf"), "fhuf")).resolve()
    raw = (args.raw or ensure_zipmoe(bf16, bf16.with_suffix(".raw.gguf"), "raw")).resolve()
    model_bytes = bf16.stat().st_size
    fixed = non_expert_bytes(zipmoe)
    allowance = parse_size(args.runtime_allowance, "--runtime-allowance")
    one_expert = None
    from zipmoe_py import format as zformat

    with zformat.ZipMoEFile(zipmoe) as zf:
        layer = zf.tensors[0].split(".")[1]
        one_expert = sum(s[0] * s[1] * 2 for t in zf.tensors if t.split(".")[1] == layer for s in [zf.shape(t)])
    bw = json.loads(subprocess.run([sys.executable, str(CAPPED_RUN), "--disk-bw", str(zipmoe)], capture_output=True,
                                   text=True).stdout.strip().splitlines()[-1])
    print(f"model {model_bytes / 1e9:.2f} GB BF16 ({zipmoe.stat().st_size / 1e9:.2f} GB ZipMoE), non-expert weights "
          f"{fixed / 1e9:.2f} GB, one expert {one_expert / 1e6:.1f} MB, O_DIRECT {bw['odirect_gbps']:.2f} GB/s", flush=True)

    rows = []
    systems = args.systems.split(",")
    for pct in [int(c) for c in args.caps.split(",")]:
        cap = model_bytes * pct // 100
        budget = max(cap - fixed - allowance, one_expert)
        for system in systems:
            path = {"stock": bf16, "zipmoe": zipmoe, "raw": raw}[system]
            cmd = [sys.executable, "-c", PROBE, path, args.prompt_tokens, args.gen_tokens, args.threads,
                   "-" if system == "stock" else budget, int(args.direct_io)]
            t = time.perf_counter()
            probe, capped = run_capped(cap, path, cmd)
            row = {"system": system, "cap_pct": pct, "cap_bytes": cap, "budget_bytes": None if system == "stock" else budget,
                   "wall_s": time.perf_counter() - t, "peak_bytes": capped.get("peak_bytes"), **probe}
            rows.append(row)
            if "error" in probe:
                print(f"{pct:>3}% {system:7s} FAILED: {probe['error'][-300:]}", flush=True)
                continue
            z = probe.get("zipmoe") or {}
            print(f"{pct:>3}% {system:7s} TTFT {probe['ttft_s']:7.2f} s  TPOT {probe['tpot_s'] * 1e3:8.1f} ms  "
                  f"{probe['tok_per_s']:6.2f} tok/s  read {probe['read_bytes'] / 1e9:6.2f} GB  peak "
                  f"{(capped.get('peak_bytes') or 0) / 1e9:5.2f} GB"
                  + (f"  hit {z['hit_rate'] or 0:.2f} slots {z['n_slots']}" if z else ""), flush=True)

    result = {"bf16": str(bf16), "zipmoe": str(zipmoe), "raw": str(raw), "model_bytes": model_bytes,
              "non_expert_bytes": fixed, "one_expert_bytes": one_expert, "odirect_gbps": bw["odirect_gbps"],
              "threads": args.threads, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
              "direct_io": args.direct_io, "runtime_allowance": allowance, "machine": platform.platform(),
              "cpu_count": os.cpu_count(), "rows": rows,
              "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for system in systems:
            pts = [(r["cap_pct"], r["tok_per_s"]) for r in rows if r["system"] == system and "tok_per_s" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        ax.set_xlabel("memory cap, % of the BF16 model")
        ax.set_ylabel("decode tokens/s")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"{bf16.name}, {args.threads} threads")
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot (pip install '.[bench]')")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
