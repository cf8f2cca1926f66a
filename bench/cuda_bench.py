#!/usr/bin/env python3
"""ZipMoE with expert slots in GPU memory against stock llama.cpp on CUDA, one model, one run:

    python bench/cuda_bench.py --bf16 M.gguf --zipmoe M.zipmoe.gguf [--ghuf M.ghuf.gguf] [--budgets 25,50,100]
        [--gen-tokens 64] [--prompt-repeat 8] [--threads 16] [--repeats 2] [--out cuda_bench.json]

Systems, each `llama-completion -m FILE -p PROMPT -n N --temp 1 --seed S --ignore-eos -no-cnv -t T
-ngl 99 -v` (the fork's build with ZIPMOE_CUDA=ON):
  stock-gpu      the BF16 GGUF, every weight in VRAM (the ceiling: no expert is ever read)
  stock-cpu-moe  the BF16 GGUF with --cpu-moe: routed experts in host memory, computed by the CPU
  zipmoe-P       the ZipMoE GGUF with ZIPMOE_BUDGET = P% of the routed experts' BF16 bytes: slots in
                 VRAM, misses read from disk (O_DIRECT), exponents decoded on the CPU, BF16
                 recovered on the GPU
  zipmoe-ghuf-P  with --ghuf: the same with the model repacked --codec ghuf, exponents decoded on the
                 GPU (phase 2); its counters give the MB sent to the GPU against zipmoe-P's
TTFT is llama-completion's "prompt eval time", TPOT its "eval time" per token. The ZipMoE runtime's
counters (hits, misses, MB read, MB to the GPU) come from its log line when the context is freed.
Prints a table and saves --out (JSON) and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = ("In a mixture of experts model every token is routed to a few experts chosen by a small router, "
          "so most of the weights sit idle at any moment and can wait on disk until they are needed. ")
STATS = re.compile(r"ZipMoE expert cache so far: (.*)")
PERF = re.compile(r"(prompt eval|eval) time =\s*([0-9.]+) ms /\s*(\d+) (?:tokens|runs)")


def run_one(model: Path, extra: list[str], env: dict, args) -> dict:
    from zipmoe_py import _paths

    cmd = [str(_paths.program("llama-completion")), "-m", str(model), "-p", PROMPT * args.prompt_repeat,
           "-n", str(args.gen_tokens), "--temp", "1", "--seed", "1", "--ignore-eos", "-no-cnv",
           "-t", str(args.threads), "-ngl", "99", "-v", *extra]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), stdin=subprocess.DEVNULL,
                              env={**os.environ, **env}, timeout=args.run_timeout)
    except subprocess.TimeoutExpired as e:
        return {"command": cmd[:2] + ["..."] + extra, "env": env, "rc": "timeout",
                "error": (e.stderr or b"")[-1500:].decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)[-1500:]}
    row = {"command": cmd[:2] + ["..."] + extra, "env": env, "wall_s": round(time.perf_counter() - t, 2),
           "rc": proc.returncode}
    perf = {kind: (float(ms), int(n)) for kind, ms, n in PERF.findall(proc.stderr)}
    if proc.returncode != 0 or "eval" not in perf:
        row["error"] = proc.stderr[-1500:]
        return row
    row["ttft_ms"] = perf["prompt eval"][0]
    row["prompt_tokens"] = perf["prompt eval"][1]
    row["tpot_ms"] = perf["eval"][0] / max(1, perf["eval"][1])
    row["tok_s"] = 1000.0 / row["tpot_ms"]
    stats = STATS.findall(proc.stderr)
    if stats:
        row["zipmoe_stats"] = stats[-1].strip()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", type=Path, required=True, help="the BF16 GGUF (stock)")
    ap.add_argument("--zipmoe", type=Path, required=True, help="the ZipMoE GGUF made from it")
    ap.add_argument("--ghuf", type=Path, default=None,
                    help="the same model repacked with --codec ghuf (phase 2: exponents decoded on the GPU); "
                         "adds systems zipmoe-ghuf-P beside zipmoe-P")
    ap.add_argument("--budgets", default="25,50,100", help="VRAM budgets, %% of the routed experts (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per run (default: %(default)s)")
    ap.add_argument("--prompt-repeat", type=int, default=8, help="the prompt sentence repeated (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per system, interleaved (default: %(default)s)")
    ap.add_argument("--run-timeout", type=float, default=240, help="seconds before a run counts as hung (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("cuda_bench.json"), help="JSON results (default: %(default)s)")
    args = ap.parse_args(argv)

    from zipmoe_py import format as zformat

    with zformat.ZipMoEFile(args.zipmoe) as zf:
        all_experts = zf.expert_bytes().all_experts
    systems = {"stock-gpu": (args.bf16, [], {}), "stock-cpu-moe": (args.bf16, ["--cpu-moe"], {})}
    for pct in (int(p) for p in args.budgets.split(",")):
        budget = {"ZIPMOE_BUDGET": str(all_experts * pct // 100)}
        systems[f"zipmoe-{pct}"] = (args.zipmoe, [], budget)
        if args.ghuf is not None:
            systems[f"zipmoe-ghuf-{pct}"] = (args.ghuf, [], budget)
    rows = []
    for rep in range(args.repeats):
        for name, (model, extra, env) in systems.items():
            row = {"system": name, "repeat": rep, **run_one(model, extra, env, args)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)

    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    result = {"gpu": gpu, "cpus": os.cpu_count(), "bf16": str(args.bf16), "zipmoe": str(args.zipmoe),
              "bf16_bytes": args.bf16.stat().st_size, "zipmoe_bytes": args.zipmoe.stat().st_size,
              "all_experts_bytes": all_experts, "gen_tokens": args.gen_tokens, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    lines = ["| system | TTFT ms | TPOT ms | tok/s | ZipMoE counters |", "|---|---|---|---|---|"]
    for name in systems:
        got = [r for r in rows if r["system"] == name and "tpot_ms" in r]
        if not got:
            lines.append(f"| {name} | failed | | | |")
            continue
        best = min(got, key=lambda r: r["tpot_ms"])
        lines.append(f"| {name} | {best['ttft_ms']:.0f} | {best['tpot_ms']:.2f} | {best['tok_s']:.1f} | "
                     f"{best.get('zipmoe_stats', '')[:160]} |")
    table = "\n".join(lines)
    args.out.with_suffix(".md").write_text(f"GPU: {gpu}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
