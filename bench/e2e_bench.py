#!/usr/bin/env python3
"""End-to-end bench: stock llama.cpp (the same build, BF16 GGUF, mmap) against ZipMoE (default
codec) and ZipMoE with compression off (raw E-chunks through the same cache and I/O path),
each under a memory cap of 25 / 50 / 75% of the BF16 model's size, with the model evicted from
the page cache before every run.

    .venv/bin/python bench/e2e_bench.py --bf16 M.gguf [--zipmoe M.zipmoe.gguf] [--raw M.raw.gguf]
        [--caps 25,50,75] [--prompt-tokens 64] [--gen-tokens 32] [--threads 2] [--direct-io]

Missing ZipMoE files are made from the BF16 GGUF (fhuf, and raw for the ablation). Every run is
`capped-run --mem CAP --evict FILE -- python -c <probe>` (../shared/tools/capped-run: a child
memory cgroup, page cache included); the probe loads the model, evaluates a prompt of
--prompt-tokens tokens (TTFT) and then decodes --gen-tokens seeded random tokens one at a time
(TPOT: their mean time; cache statistics of these steps only), as llama-bench's tg does:
greedy decoding of a random-weight model repeats one token, whose routing would always hit. The ZipMoE expert-cache budget is what the cap leaves after the non-expert weights
a decode step reads (all but the token embedding) and a fixed allowance for the runtime.

The O_DIRECT bandwidth of the model's disk is measured in the same run, and so is the compute
floor: stock llama.cpp's TPOT with the whole model in the page cache and no cap. Each ZipMoE
row gets the TPOT floor at its measured hit rate, max(compute floor, bytes read per token /
O_DIRECT bandwidth, decode + recover time per token / threads), and its read bandwidth while
reading. Prints a table, saves --out (JSON) and a PNG plot beside it.
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

import numpy as np

from _common import CAPPED_RUN
from accuracy_bench import parse_config  # the lossy configurations' names (bench/ is on sys.path)


PROBE = r"""
import json, os, random, sys, time
path, n_prompt, n_gen, threads, opts, batch, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
from zipmoe_py import Llama, _lib
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
def read_bytes():
    return int(dict(line.split(":") for line in open("/proc/self/io"))["read_bytes"])
# decode steps feed seeded random tokens, as llama-bench's tg does: greedy decoding of a random-weight
# model repeats one token, which would route every step to the same experts
rng = random.Random(seed)
if batch == 1:
    def prefill():
        llm.eval(tokens)
    def step(i):
        llm.eval([rng.randrange(llm.n_vocab())])
else:
    # batch sequences decoded together: each step is one ubatch of `batch` tokens
    from zipmoe_py.bindings import llama_cpp as lc
    cp = lc.llama_context_default_params()
    cp.n_ctx = (n_prompt + n_gen) * batch + 64
    cp.n_batch = n_prompt * batch
    cp.n_ubatch = min(cp.n_batch, 128)  # compute buffers of a 128-token ubatch at most, whatever the batch
    cp.n_seq_max = batch
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(llm._model.model, cp)
    lb = lc.llama_batch_init(cp.n_batch, 0, batch)
    def decode(entries):
        lb.n_tokens = len(entries)
        for i, (tok, pos, seq) in enumerate(entries):
            lb.token[i], lb.pos[i], lb.n_seq_id[i], lb.seq_id[i][0] = tok, pos, 1, seq
            lb.logits[i] = i == len(entries) - 1
        assert lc.llama_decode(ctx, lb) == 0
    def prefill():
        decode([(tokens[(i + 7 * s) % n_prompt], i, s) for s in range(batch) for i in range(n_prompt)])
    def step(i):
        decode([(rng.randrange(llm.n_vocab()), n_prompt + i, s) for s in range(batch)])
t0 = time.perf_counter()
prefill()
ttft = time.perf_counter() - t0
prefill_stats = llm.zipmoe_stats()
llm.zipmoe_reset_stats()
decode_read0 = read_bytes()
t0 = time.perf_counter()
for i in range(n_gen):
    step(i)
tpot = (time.perf_counter() - t0) / n_gen
cache = _lib.llama_model_zipmoe_cache(llm._model.model)
activations = None
if cache:  # per served layer: in how many decode ubatches each expert was chosen (a profile)
    activations = [a for a in (_lib.cache_activations(cache, il) for il in range(4096)) if a is not None]
print(json.dumps({"load_s": t_load, "ttft_s": ttft, "tpot_s": tpot, "tok_per_s": batch / tpot, "batch": batch,
                  "read_bytes": read_bytes(), "decode_read_bytes": read_bytes() - decode_read0,
                  "decode_tokens": n_gen, "zipmoe_prefill": prefill_stats, "zipmoe": llm.zipmoe_stats(),
                  "activations": activations,
                  "status_kb": {k: int(v.split()[0]) for k, v in (l.split(":", 1) for l in open("/proc/self/status"))
                                if k in ("VmHWM", "RssAnon", "RssFile")}}))
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


def non_expert_bytes(zipmoe_path: Path) -> tuple[int, int]:
    """(all non-expert weights, those a decode step reads: all but the token embedding, of which it
    reads one row per token)."""
    from zipmoe_py import gguf_file

    header = gguf_file.read_header(zipmoe_path)
    weights = {t.name: t.nbytes() for t in header.tensors if not t.name.endswith(".zipmoe")}
    return sum(weights.values()), sum(n for name, n in weights.items() if name != "token_embd.weight")


def warm_page_cache(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def ensure_zipmoe(bf16: Path, out: Path, codec: str) -> Path:
    if not out.exists():
        from zipmoe_py import format as zformat

        print(f"making {out} ({codec}) from {bf16} ...", flush=True)
        zformat.repack(bf16, out, codec=codec)
    return out


SEED = 1234          # the decode steps' random tokens
PROFILE_SEED = 4321  # the plan variant's profiling run: another token stream than the one measured
VARIANTS = ("lru", "fifo", "marking", "lfu", "rank", "score", "pools", "plan")


def top_k(zipmoe_path: Path) -> int:
    from zipmoe_py import gguf_file

    header = gguf_file.read_header(zipmoe_path)
    arch = header.value("general.architecture")
    return int(header.value(f"{arch}.expert_used_count"))


def take_profile(zipmoe_path: Path, args, work_slots: int) -> dict:
    """zipmoe-profile's PROFILE of this workload (batch args.batch), from an uncapped run with every
    expert cached and another token stream, plus measured costs for the planner."""
    from zipmoe_py import profile as zprofile
    from zipmoe_py.plan_files import FORMAT_VERSION, PROFILE_FORMAT

    print("plan: profiling the workload (uncapped, another seed) and measuring u, v, c ...", flush=True)
    cmd = [sys.executable, "-c", PROBE, zipmoe_path, args.prompt_tokens, args.gen_tokens, args.threads,
           json.dumps({"zipmoe_budget": zipmoe_path.stat().st_size * 2}), args.batch, PROFILE_SEED]
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, cwd=tempfile.gettempdir())
    probe = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    counts = [a[0] for a in probe["activations"]]
    n_ubatches = probe["activations"][0][1]
    bytes_by_state, n_tensors, n_shards = zprofile.expert_bytes_by_pool(zipmoe_path)
    costs = zprofile.measure_costs(zipmoe_path, threads=args.threads)
    return {"format": PROFILE_FORMAT, "version": FORMAT_VERSION, "model": str(zipmoe_path),
            "n_layer_moe": len(counts), "n_expert": len(counts[0]), "n_expert_used": top_k(zipmoe_path),
            "expert_bytes": bytes_by_state, "n_tensors_per_expert": n_tensors, "n_shards": n_shards,
            "batches": {str(args.batch): {"n_ubatches": n_ubatches, "counts": counts}}, "costs": costs}


def zipmoe_options(variant: str, budget: int, args, work_slots: int, profile: dict | None, one_expert: int) -> dict:
    """Llama keyword arguments of a ZipMoE variant under an expert-cache budget (pools + working slots)."""
    from zipmoe_py import _lib, plan_files, plan_math, profile as zprofile

    opts = {"zipmoe_budget": budget, "zipmoe_direct_io": bool(args.direct_io)}
    if _is_lossy_variant(variant):  # LOSSY: smoe:ALPHA or buddy[:NAME=VALUE...], rank eviction
        profile = args.buddy_profile.resolve() if args.buddy_profile else None
        return {**opts, **parse_config(variant, profile)}
    if variant not in ("pools", "plan"):
        return {**opts, "zipmoe_eviction": variant}
    pool_budget = budget - work_slots * one_expert
    if profile is None:
        bytes_by_state, _, _ = zprofile.expert_bytes_by_pool(Path(args.zipmoe_resolved))
        n_moe = n_moe_layers(Path(args.zipmoe_resolved))
    else:
        bytes_by_state, n_moe = profile["expert_bytes"], profile["n_layer_moe"]
    if variant == "pools":
        # every pool an equal share of the memory, no planning
        pools = _lib.pool_names()
        caps = {p: max(0, pool_budget // len(pools) // (bytes_by_state[p] * n_moe)) for p in pools}
        return {**opts, "zipmoe_pools": caps, "zipmoe_work_slots": work_slots}
    counts = np.array(profile["batches"][str(args.batch)]["counts"])
    f = plan_math.rank_inclusion_probabilities(counts, profile["batches"][str(args.batch)]["n_ubatches"])
    f, k = plan_math.round_to_subset_size(f)
    c = profile["costs"]
    costs = plan_files.Costs(u_s=c["u_s"], v_s=c["v_s"], c_s=c["c_s"])
    result = plan_math.plan(f, k, pool_budget, bytes_by_state, _lib.pool_names(), costs, args.threads,
                            profile["n_shards"], profile["n_tensors_per_expert"], n_moe)
    print(f"plan for {pool_budget / 1e9:.2f} GB of pools: capacities {result.capacities} (per layer), "
          f"expected makespan {result.expected_makespan_s * 1e3:.2f} ms", flush=True)
    return {**opts, "zipmoe_pools": dict(result.capacities), "zipmoe_rank_delta": result.delta,
            "zipmoe_work_slots": work_slots}


def _is_lossy_variant(name: str) -> bool:
    """smoe:ALPHA or buddy[:NAME=VALUE...], as bench/accuracy_bench.py's configurations."""
    if not (name.startswith("smoe:") or name == "buddy" or name.startswith("buddy:")):
        return False
    try:
        parse_config(name)
    except ValueError:
        return False
    return True


def n_moe_layers(zipmoe_path: Path) -> int:
    from zipmoe_py import format as zformat

    with zformat.ZipMoEFile(zipmoe_path) as zf:
        return len(zf.moe_layers())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bf16", type=Path, required=True, help="BF16 GGUF (stock llama.cpp's input)")
    ap.add_argument("--zipmoe", type=Path, default=None, help="ZipMoE GGUF made from it (default: made beside it)")
    ap.add_argument("--raw", type=Path, default=None, help="ZipMoE GGUF with raw E-chunks (default: made beside it)")
    ap.add_argument("--caps", default="25,50,75", help="memory caps in %% of the BF16 model size (default: %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32,
                    help="decode steps (random tokens); TPOT is their mean time (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1,
                    help="sequences decoded together (each decode step is one ubatch of this many tokens); "
                         "tokens/s counts all of them, TPOT is the time of one step (default: %(default)s)")
    ap.add_argument("--runtime-allowance", default="400M",
                    help="memory kept for the runtime (Python, compute buffers, KV, staging) when sizing the "
                         "expert cache: budget = cap - non-expert weights a decode step reads (all but the token "
                         "embedding) - this (default: %(default)s)")
    ap.add_argument("--direct-io", action="store_true", help="ZipMoE reads chunks with O_DIRECT")
    ap.add_argument("--variants", "--eviction", dest="variants", default="rank",
                    help="ZipMoE configurations to run, comma-separated: the eviction policies lru, fifo, marking, "
                         "lfu, rank (one F pool of the whole budget); pools (the four pools F, C, S, E with equal "
                         "shares of the budget); plan (the pools and shares zipmoe-plan chooses from a profile of "
                         "this workload, taken in an uncapped run with another seed); smoe:ALPHA (LOSSY: SMoE's "
                         "expert-cache router at that alpha, rank eviction); buddy[:NAME=VALUE...] (LOSSY: BuddyMoE "
                         "with --buddy-profile and these parameters). Default: %(default)s; the "
                         "ratios printed use the first")
    ap.add_argument("--buddy-profile", type=Path, default=None,
                    help="the buddy profile of the ZipMoE GGUF for buddy variants (zipmoe-buddies)")
    ap.add_argument("--work-slots", type=int, default=None,
                    help="working slots of the pools and plan variants (default: top-k x batch, at most 64: one "
                         "pass per decode step; prefills run in more passes)")
    ap.add_argument("--systems", default="stock,zipmoe,raw", help="which systems to run (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/e2e_bench.json"))
    args = ap.parse_args()

    from zipmoe_py.options import parse_size

    bf16 = args.bf16.resolve()
    zipmoe = (args.zipmoe or ensure_zipmoe(bf16, bf16.with_suffix(".zipmoe.gguf"), "fhuf")).resolve()
    raw = None  # the raw-E-chunk ablation's file, made only when that system runs (as large as the model)
    if "raw" in args.systems.split(","):
        raw = (args.raw or ensure_zipmoe(bf16, bf16.with_suffix(".raw.gguf"), "raw")).resolve()
    args.zipmoe_resolved = str(zipmoe)
    model_bytes = bf16.stat().st_size
    fixed, fixed_read = non_expert_bytes(zipmoe)
    allowance = parse_size(args.runtime_allowance, "--runtime-allowance")
    from zipmoe_py import format as zformat

    with zformat.ZipMoEFile(zipmoe) as zf:
        one_expert = zf.expert_bytes().one_expert
    bw = json.loads(subprocess.run([sys.executable, str(CAPPED_RUN), "--disk-bw", str(zipmoe)], capture_output=True,
                                   text=True).stdout.strip().splitlines()[-1])
    print(f"model {model_bytes / 1e9:.2f} GB BF16 ({zipmoe.stat().st_size / 1e9:.2f} GB ZipMoE), non-expert weights "
          f"{fixed / 1e9:.2f} GB ({fixed_read / 1e9:.2f} GB read per token), one expert {one_expert / 1e6:.1f} MB, "
          f"O_DIRECT {bw['odirect_gbps']:.2f} GB/s", flush=True)

    # the compute floor: stock llama.cpp with the whole model in the page cache, no cap
    warm_page_cache(bf16)
    warm = subprocess.run([sys.executable, "-c", PROBE, *map(str, (bf16, args.prompt_tokens, args.gen_tokens,
                                                                    args.threads, "{}", args.batch, SEED))],
                          capture_output=True, text=True, cwd=tempfile.gettempdir())
    warm = json.loads([l for l in warm.stdout.splitlines() if l.startswith("{")][-1])
    compute_s = warm["tpot_s"]
    print(f"compute floor (stock, model in page cache, no cap): TPOT {compute_s * 1e3:.1f} ms", flush=True)

    rows = []
    systems = args.systems.split(",")
    evictions = args.variants.split(",")
    unknown = [e for e in evictions if e not in VARIANTS and not _is_lossy_variant(e)]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known are {', '.join(VARIANTS)}, smoe:ALPHA and buddy[:NAME=VALUE] (lossy)")
    if any(e.startswith("buddy") and _is_lossy_variant(e) for e in evictions) and args.buddy_profile is None:
        ap.error("buddy variants need --buddy-profile (zipmoe-buddies ZIPMOE.gguf ...)")
    k = top_k(zipmoe)
    work_slots = args.work_slots or min(64, k * args.batch)
    profile = None
    if "plan" in evictions:
        profile = take_profile(zipmoe, args, work_slots)
    for pct in [int(c) for c in args.caps.split(",")]:
        cap = model_bytes * pct // 100
        budget = max(cap - fixed_read - allowance, one_expert)
        runs = [(s, None) if s == "stock" else (s, e) for s in systems for e in (["-"] if s == "stock" else evictions)]
        for system, eviction in runs:
            label = system if len(evictions) == 1 or eviction is None else f"{system}/{eviction}"
            path = {"stock": bf16, "zipmoe": zipmoe, "raw": raw}[system]
            opts = {} if system == "stock" else zipmoe_options(eviction, budget, args, work_slots, profile, one_expert)
            cmd = [sys.executable, "-c", PROBE, path, args.prompt_tokens, args.gen_tokens, args.threads,
                   json.dumps(opts), args.batch, SEED]
            t = time.perf_counter()
            probe, capped = run_capped(cap, path, cmd)
            row = {"system": system, "eviction": eviction, "cap_pct": pct, "cap_bytes": cap,
                   "budget_bytes": None if system == "stock" else budget, "options": opts,
                   "wall_s": time.perf_counter() - t, "peak_bytes": capped.get("peak_bytes"), **probe}
            rows.append(row)
            if "error" in probe:
                print(f"{pct:>3}% {label:7s} FAILED: {probe['error'][-300:]}", flush=True)
                continue
            n_tok = probe["decode_tokens"]
            row["decode_read_gbps"] = probe["decode_read_bytes"] / (probe["tpot_s"] * n_tok) / 1e9
            z = probe.get("zipmoe") or {}
            extra = ""
            if z:
                # TPOT floor at the measured hit rate: max(compute, missed bytes / disk, decode work / threads)
                io_s = z["bytes_read"] / n_tok / (bw["odirect_gbps"] * 1e9)
                decode_s = (z["decode_ns"] + z["recover_ns"]) / 1e9 / n_tok / args.threads
                row["floor_s"] = max(compute_s, io_s, decode_s)
                row["floor_parts_s"] = {"compute": compute_s, "io": io_s, "decode": decode_s}
                row["io_gbps"] = z["bytes_read"] / z["io_ns"] if z["io_ns"] else None
                pooled = "".join(f" {p}{z[p.lower() + '_hits'] / n_tok:.1f}" for p in "CSE" if z[p.lower() + "_hits"])
                if z.get("substitution_tokens"):
                    pooled += f" LOSSY subst {z['substitutions'] / n_tok:.1f}/tok"
                extra = (f"  hit {z['hit_rate'] or 0:.2f}{pooled} slots {z['n_slots']}  floor {row['floor_s'] * 1e3:6.1f} ms "
                         f"(x{probe['tpot_s'] / row['floor_s']:.2f})  read {(row['io_gbps'] or 0):.2f} GB/s")
            print(f"{pct:>3}% {label:7s} TTFT {probe['ttft_s']:7.2f} s  TPOT {probe['tpot_s'] * 1e3:8.1f} ms  "
                  f"{probe['tok_per_s']:6.2f} tok/s  decode read {probe['decode_read_bytes'] / n_tok / 1e6:7.1f} MB/tok "
                  f"({row['decode_read_gbps']:.2f} GB/s)  peak {(capped.get('peak_bytes') or 0) / 1e9:5.2f} GB" + extra,
                  flush=True)
        by = {r["system"]: r for r in rows if r["cap_pct"] == pct and "tok_per_s" in r
              and r["eviction"] in (None, evictions[0])}
        if "stock" in by and "zipmoe" in by:
            print(f"{pct:>3}% ZipMoE / stock: {by['zipmoe']['tok_per_s'] / by['stock']['tok_per_s']:.2f}x"
                  + (f"; compressed / raw: {by['zipmoe']['tok_per_s'] / by['raw']['tok_per_s']:.2f}x" if "raw" in by else ""),
                  flush=True)

    result = {"bf16": str(bf16), "zipmoe": str(zipmoe), "raw": str(raw), "model_bytes": model_bytes,
              "non_expert_bytes": fixed, "non_expert_read_bytes": fixed_read, "one_expert_bytes": one_expert,
              "odirect_gbps": bw["odirect_gbps"], "compute_tpot_s": compute_s, "warm": warm,
              "threads": args.threads, "batch": args.batch, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
              "direct_io": args.direct_io, "variants": args.variants, "work_slots": work_slots, "profile": profile, "runtime_allowance": allowance, "machine": platform.platform(),
              "cpu_count": os.cpu_count(), "rows": rows,
              "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for system, eviction in runs:
            pts = [(r["cap_pct"], r["tok_per_s"]) for r in rows
                   if r["system"] == system and r["eviction"] == eviction and "tok_per_s" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system if eviction in (None, "-") or len(evictions) == 1
                        else f"{system}/{eviction}")
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
