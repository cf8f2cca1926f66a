#!/usr/bin/env python3
"""ZipMoE with expert slots in GPU memory against stock llama.cpp on CUDA, one model, one run:

    python bench/cuda_bench.py --bf16 M.gguf --zipmoe M.zipmoe.gguf [--ghuf M.ghuf.gguf] [--budgets 25,50,100]
        [--gen-tokens 64] [--prompt-repeat 8] [--threads 16] [--repeats 3] [--device-stores] [--cpu-compute] [--systems A,B]
        [--host-cap 24G] [--out cuda_bench.json]

Systems, each `llama-completion -m FILE -p PROMPT -n N --temp 1 --seed S --ignore-eos -no-cnv -t T
-ngl 99 -v` (the fork's build with ZIPMOE_CUDA=ON):
  stock-gpu      the BF16 GGUF, every weight in VRAM (the ceiling: no expert is ever read)
  stock-cpu-moe  the BF16 GGUF with --cpu-moe: routed experts in host memory, computed by the CPU
  stock-n-cpu-moe-P  the BF16 GGUF with --n-cpu-moe N, N the fewest leading layers whose experts stay on
                 the CPU so that the rest hold at most P% of the routed experts: stock at zipmoe-P's VRAM
                 (the fair baseline at a partial budget; each row records its CUDA0 weights' MiB)
  zipmoe-P       the ZipMoE GGUF with ZIPMOE_BUDGET = P% of the routed experts' BF16 bytes: slots in
                 VRAM, misses read from disk (O_DIRECT), exponents decoded on the CPU, BF16
                 recovered on the GPU
  zipmoe-n-cpu-moe-P  the ZipMoE GGUF with stock-n-cpu-moe-P's flags and no budget: a slot set in VRAM for
                 the GPU layers (their experts, the VRAM stock gives them) and one in host memory for the
                 others, sized from host memory and computed by the CPU as stock computes them
  zipmoe-ghuf-P  with --ghuf: the same with the model repacked --codec ghuf, exponents decoded on the
                 GPU (phase 2); its counters give the MB sent to the GPU against zipmoe-P's
TTFT is llama-completion's "prompt eval time", TPOT its "eval time" per token. The ZipMoE runtime's
counters (hits, misses, MB read, MB to the GPU) come from its log line when the context is freed;
"H2D MB/token" divides the MB to the GPU by the tokens the run processed (prompt and generated).
With --host-cap, every run is `capped-run --mem CAP --evict MODEL -- llama-completion ...` (a memory
cgroup, page cache included, the model evicted first: both sides page, as on a machine with that much
memory; ../shared/tools/capped-run, or $ZIPMOE_CAPPED_RUN), and the O_DIRECT read rate of the disk is
measured before the runs. Where no memory cgroup can be made (the GPU machines' containers), a balloon
stands in: a process holds all but CAP of the memory available (anonymous pages, locked where it may, so
neither the page cache nor the programs can use them), and each run evicts its model first.
Without it the host keeps whatever the page cache holds.
Systems run interleaved, --repeats rounds; the table gives each cell's median with min-max. Prints
the table and saves --out (JSON, every run with its full command) and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import CAPPED_RUN, PERF, last_stats

PROMPT = ("In a mixture of experts model every token is routed to a few experts chosen by a small router, "
          "so most of the weights sit idle at any moment and can wait on disk until they are needed. ")
H2D = re.compile(r"([0-9.]+) MB to the slots' device")
CUDA_WEIGHTS = re.compile(r"CUDA\d+ model buffer size =\s*([0-9.]+) MiB")
GPU_SLOTS = re.compile(r"ZipMoE expert cache: (?:the \d+ MoE layers whose experts are computed there: )?(\d+) slots of ([0-9.]+) MiB in CUDA\d+ memory")


def run_one(model: Path, extra: list[str], env: dict, args) -> dict:
    from zipmoe_py import _paths

    cmd = [str(_paths.program("llama-completion")), "-m", str(model), "-p", PROMPT * args.prompt_repeat,
           "-n", str(args.gen_tokens), "--temp", "1", "--seed", "1", "--ignore-eos", "-no-cnv",
           "-t", str(args.threads), "-ngl", "99", "-v", *extra]
    if args.host_cap and args.balloon is None:
        cmd = [sys.executable, str(capped_run()), "--mem", args.host_cap, "--evict", str(model), "--", *cmd]
    elif args.host_cap:
        evict(model)
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=tempfile.gettempdir(), stdin=subprocess.DEVNULL,
                              env={**os.environ, **env}, timeout=args.run_timeout)
    except subprocess.TimeoutExpired as e:
        return {"command": cmd, "env": env, "rc": "timeout",
                "error": (e.stderr or b"")[-1500:].decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)[-1500:]}
    row = {"command": cmd, "env": env, "wall_s": round(time.perf_counter() - t, 2), "rc": proc.returncode}
    if args.host_cap and args.balloon is None:
        capped = [line for line in proc.stdout.splitlines() if line.startswith('{"rc"')]
        row["peak_bytes"] = json.loads(capped[-1]).get("peak_bytes") if capped else None
    perf = {kind: (float(ms), int(n)) for kind, ms, n in PERF.findall(proc.stderr)}
    if proc.returncode != 0 or "eval" not in perf:
        row["error"] = proc.stderr[-1500:]
        return row
    row["ttft_ms"] = perf["prompt eval"][0]
    row["prompt_tokens"] = perf["prompt eval"][1]
    row["tpot_ms"] = perf["eval"][0] / max(1, perf["eval"][1])
    row["tok_s"] = 1000.0 / row["tpot_ms"]
    slots = GPU_SLOTS.findall(proc.stderr)
    row["cuda_weights_mib"] = round(sum(float(m) for m in CUDA_WEIGHTS.findall(proc.stderr))
                                    + sum(int(n) * float(mib) for n, mib in slots[-1:]), 1)
    row["resident_views"] = "products use the slots in place" in proc.stderr
    stats = last_stats(proc.stderr)
    if stats:
        row["zipmoe_stats"] = stats
        h2d = H2D.findall(stats)  # every slot set's
        if h2d:
            row["h2d_mb"] = sum(float(mb) for mb in h2d)
            row["h2d_mb_per_token"] = row["h2d_mb"] / (row["prompt_tokens"] + args.gen_tokens)
    return row


def capped_run() -> Path:
    return Path(os.environ.get("ZIPMOE_CAPPED_RUN") or CAPPED_RUN)


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


BALLOON = '''import ctypes, mmap, sys, time
n = int(sys.argv[1])
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)  # every page now
ctypes.CDLL(None).mlockall(1)  # MCL_CURRENT; where refused, no swap keeps them anyway
print("ready", flush=True)
time.sleep(1e9)
'''


def start_balloon(cap: int, files: list[Path]) -> subprocess.Popen:
    """A process holding all the memory available but cap bytes, once files are evicted."""
    for f in files:
        evict(f)
    hold = mem_available() - cap
    if hold <= 0:
        raise SystemExit(f"--host-cap: only {mem_available() / 2**30:.1f} GiB is available, no more than the cap")
    proc = subprocess.Popen([sys.executable, "-c", BALLOON, str(hold)], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit("--host-cap: the balloon process could not hold its memory")
    return proc


def n_cpu_moe_for(moe_layers: list[int], pct: int) -> tuple[int, float]:
    """--n-cpu-moe N keeps the experts of layers below N on the CPU: the smallest N whose GPU layers
    hold at most pct% of the routed experts, and the share they hold."""
    on_gpu = len(moe_layers) * pct // 100
    layers = sorted(moe_layers)
    n = layers[len(layers) - on_gpu] if on_gpu else layers[-1] + 1
    return n, on_gpu / len(layers)


def median_cell(rows: list[dict], key: str, fmt: str) -> str:
    vals = sorted(r[key] for r in rows if key in r)
    if not vals:
        return ""
    return f"{format(statistics.median(vals), fmt)} ({format(vals[0], fmt)}-{format(vals[-1], fmt)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bf16", type=Path, required=True, help="the BF16 GGUF (stock)")
    ap.add_argument("--zipmoe", type=Path, required=True, help="the ZipMoE GGUF made from it")
    ap.add_argument("--ghuf", type=Path, default=None,
                    help="the same model repacked with --codec ghuf (phase 2: exponents decoded on the GPU); "
                         "adds systems zipmoe-ghuf-P beside zipmoe-P")
    ap.add_argument("--budgets", default="25,50,100", help="VRAM budgets, %% of the routed experts (default: %(default)s)")
    ap.add_argument("--device-stores", action="store_true",
                    help="add systems zipmoe-stores-P: zipmoe-P with ZIPMOE_DEVICE_STORES=1 (host memory keeps compressed "
                         "experts beside the GPU slots from the prompt on)")
    ap.add_argument("--cpu-compute", action="store_true",
                    help="add systems zipmoe-cpu-P: zipmoe-stores-P with ZIPMOE_CPU_COMPUTE=1 (the CPU computes the "
                         "missing experts SMoE's CPU-load balancer gives it; exact weights, the CPU's rounding)")
    ap.add_argument("--systems", default=None,
                    help="run only these systems (comma-separated names, as in the table; default: all)")
    ap.add_argument("--host-cap", default=None, metavar="SIZE",
                    help="run every system under a host memory cap (e.g. 24G), page cache included, the model "
                         "evicted first (capped-run)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="tokens generated per run (default: %(default)s)")
    ap.add_argument("--prompt-repeat", type=int, default=8, help="the prompt sentence repeated (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per system, interleaved (default: %(default)s)")
    ap.add_argument("--run-timeout", type=float, default=240, help="seconds before a run counts as hung (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("cuda_bench.json"), help="JSON results (default: %(default)s)")
    args = ap.parse_args(argv)
    args.balloon = None

    from zipmoe_py import format as zformat, options

    with zformat.ZipMoEFile(args.zipmoe) as zf:
        all_experts = zf.expert_bytes().all_experts
        moe_layers = list(zf.moe_layers())
    systems = {"stock-gpu": (args.bf16, [], {}), "stock-cpu-moe": (args.bf16, ["--cpu-moe"], {})}
    shares = {}
    for pct in (int(p) for p in args.budgets.split(",")):
        if pct < 100:
            n, shares[pct] = n_cpu_moe_for(moe_layers, pct)
            systems[f"stock-n-cpu-moe-{pct}"] = (args.bf16, ["--n-cpu-moe", str(n)], {})
            systems[f"zipmoe-n-cpu-moe-{pct}"] = (args.zipmoe, ["--n-cpu-moe", str(n)], {})
        budget = {"ZIPMOE_BUDGET": str(all_experts * pct // 100)}
        systems[f"zipmoe-{pct}"] = (args.zipmoe, [], budget)
        if args.device_stores and pct < 100:
            systems[f"zipmoe-stores-{pct}"] = (args.zipmoe, [], {**budget, "ZIPMOE_DEVICE_STORES": "1"})
        if args.cpu_compute and pct < 100:
            systems[f"zipmoe-cpu-{pct}"] = (args.zipmoe, [], {**budget, "ZIPMOE_DEVICE_STORES": "1",
                                                              "ZIPMOE_CPU_COMPUTE": "1"})
        if args.ghuf is not None:
            systems[f"zipmoe-ghuf-{pct}"] = (args.ghuf, [], budget)
    if args.systems:
        wanted = args.systems.split(",")
        unknown = [w for w in wanted if w not in systems]
        if unknown:
            ap.error(f"--systems: no system named {', '.join(unknown)} (there are: {', '.join(systems)})")
        systems = {name: systems[name] for name in wanted}
    disk = None
    if args.host_cap:
        if not capped_run().is_file():
            ap.error(f"--host-cap needs capped-run: not found at {capped_run()} (set ZIPMOE_CAPPED_RUN)")
        probe = subprocess.run([sys.executable, str(capped_run()), "--mem", args.host_cap, "--", "true"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            print(f"--host-cap {args.host_cap}: no memory cgroup here, so a balloon holds the rest of the memory: "
                  f"{(probe.stderr or probe.stdout).strip().splitlines()[-1][-200:]}", flush=True)
            args.balloon = start_balloon(options.parse_size(args.host_cap, "--host-cap"), [args.bf16, args.zipmoe])
            print(json.dumps({"mem_available_beside_balloon": mem_available()}), flush=True)
        out = subprocess.run([sys.executable, str(capped_run()), "--disk-bw", str(args.zipmoe)], capture_output=True,
                             text=True)
        disk = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None
        print(json.dumps({"disk": disk}), flush=True)
    rows = []
    try:
        for rep in range(args.repeats):
            for name, (model, extra, env) in systems.items():
                row = {"system": name, "repeat": rep, **run_one(model, extra, env, args)}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
                # the runs so far, should the bench be stopped before its table
                args.out.with_suffix(".partial.json").write_text(json.dumps(rows, indent=1))
    finally:
        if args.balloon is not None:
            args.balloon.kill()

    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        gpu = "none (no nvidia-smi)"
    result = {"gpu": gpu, "cpus": os.cpu_count(), "bf16": str(args.bf16), "zipmoe": str(args.zipmoe),
              "bf16_bytes": args.bf16.stat().st_size, "zipmoe_bytes": args.zipmoe.stat().st_size,
              "all_experts_bytes": all_experts, "gen_tokens": args.gen_tokens, "repeats": args.repeats,
              "host_cap": args.host_cap, "host_cap_by": None if not args.host_cap else
              "balloon" if args.balloon is not None else "cgroup", "disk": disk,
              "n_cpu_moe_expert_share": shares, "argv": sys.argv, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    lines = [f"| system | TTFT ms | TPOT ms | tok/s | CUDA0 weights MiB | H2D MB/token | runs | command |",
             "|---|---|---|---|---|---|---|---|"]
    for name in systems:
        got = [r for r in rows if r["system"] == name and "tpot_ms" in r]
        if not got:
            lines.append(f"| {name} | failed | | | | | 0 | |")
            continue
        env = " ".join(f"{k}={v}" for k, v in got[0]["env"].items())
        cmd = shlex.join(f"<PROMPT x{args.prompt_repeat}>" if a == PROMPT * args.prompt_repeat
                         else Path(a).name if a.startswith("/") else a for a in got[0]["command"])
        lines.append(f"| {name} | {median_cell(got, 'ttft_ms', '.0f')} | {median_cell(got, 'tpot_ms', '.2f')} | "
                     f"{median_cell(got, 'tok_s', '.1f')} | {median_cell(got, 'cuda_weights_mib', '.0f')} | "
                     f"{median_cell(got, 'h2d_mb_per_token', '.2f')} | {len(got)} | `{(env + ' ' + cmd).strip()}` |")
    table = "\n".join(lines)
    cap = (f"Host memory capped at {args.host_cap} (page cache included, the model evicted before each run); disk "
           f"{disk['odirect_gbps'] if disk else '?'} GB/s (O_DIRECT).\n\n" if args.host_cap else
           "Host memory not capped: the page cache keeps what it reads.\n\n")
    args.out.with_suffix(".md").write_text(f"GPU: {gpu}\n\nMedian (min-max) of {args.repeats} interleaved runs "
                                           f"per system; PROMPT is bench/cuda_bench.py's.\n\n{cap}{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
