#!/usr/bin/env python3
"""What this machine allows a ZipMoE model under a memory cap: a lower bound on TPOT and TTFT from
rates measured in the same run.

    # the compute floor: stock llama.cpp on >= 3 resident truncations of the geometry (warm page cache)
    .venv/bin/python bench/limits.py floor bench/work/ds2.gguf bench/work/ds4.gguf bench/work/ds6.gguf \\
        --layers 27 --out bench/work/floor_ds27.json
    # the rates and the bound for a model, caps, a routing profile and batch sizes
    .venv/bin/python bench/limits.py bound bench/work/ds27.zipmoe.gguf --floor bench/work/floor_ds27.json \\
        --caps 12G,20G --profile uniform --batch 1,4 --out docs/benchmarks/bound/limits_ds27.json

Measured by `bound` (interleaved rounds, median and min-max):
  reads     O_DIRECT GB/s of the file's own chunks at the runtime's read sizes (one SM-chunk, or one
            tensor's E-chunks as one span, as zipmoe-fetch-io.c reads them), at queue depth 1 (the
            runtime's I/O thread) and at depths 2 and 4; and sequential 8 MiB reads
  decoding  decode + recover GB/s of BF16 output (the library's ggml_zipmoe_decode_expert on the
            file's own experts) on one thread, on --threads threads at once, and on one thread while
            the other cores run a memory-bound matrix-vector load (what the graph's products are)
  new memory GB/s of new anonymous memory made present, a write a page, on one thread (what the stores'
            pages cost on their first write; on a VM that hands freed memory back to its host, far
            more than zeroing them)
Taken from `floor`: the compute floor, a least-squares line through the resident TPOT (and prompt
time) of the truncations at the full model's layer count, with its residuals.

The bound. Per cap, the experts may use the cap less the non-expert weights and --overhead (compute
buffers, the KV of the tokens used, the process). The runtime's pool planner (ZipMoE Alg. 2-4,
ggml_zipmoe_plan_pools) then picks the best F/C/S/E mix for the routing profile with the measured
rates (reads at depth 1, decoding at the all-threads rate), and
  TPOT bound = MoE layers x the planner's expected makespan of a layer + the compute floor
(I/O, decoding and compute each perfectly overlapped within its part). A batch of B sequences
selects, per layer, the union of B tokens' experts: inclusion 1 - (1 - f)^B, rounded to a k-set
(zipmoe-plan's rule); its compute floor is the floor's line for that batch size (`floor --batch 1,4`
times resident steps of B sequences), else the batch-1 floor, which makes that bound looser. The profile is `uniform` (every expert k/N) or a zipmoe-profile PROFILE document.
  TTFT bound = the floor's prompt time + one read of the non-expert weights and of every expert the
               prompt needs (sum over ranks of 1 - (1 - f)^P, per MoE layer) at the sequential O_DIRECT
               rate: a cold start, as the benchmarks' TTFT (load + prompt) is.
  TTFT CPU floor = the floor's prompt time + every needed expert decoded once at the all-threads rate +
               the memory they are kept in (their stored bytes, at most the experts' budget) made present
               on all threads at the one-thread new-memory rate: work no overlap with the reads removes.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from _common import fit_line, parse_size, run_facts, save

SEQUENTIAL_READ = 8 << 20
DEPTHS = (1, 2, 4)
ALIGN = 4096  # GGML_ZIPMOE_CHUNK_ALIGNMENT: chunk offsets, and O_DIRECT's transfer unit here


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


# ---- reads ----

def chunk_reads(path: Path, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(offset, bytes) of the runtime's reads for n random expert tensors: per tensor its E-chunks as
    one span and its SM-chunk, both aligned as an O_DIRECT read transfers them"""
    from zipmoe_py import format as zformat

    rng = random.Random(seed)
    reads = []
    with zformat.ZipMoEFile(path) as zf:
        for _ in range(n):
            name = rng.choice(zf.tensors)
            sm, *e_chunks = zf.chunks(name, rng.randrange(zf.shape(name)[2]))
            lo = min(c.offset for c in e_chunks)
            hi = max(c.offset + c.size for c in e_chunks)
            for offset, size in ((lo, hi - lo), (sm.offset, sm.size)):
                if size > 0:
                    reads.append((offset - offset % ALIGN, -(-(size + offset % ALIGN) // ALIGN) * ALIGN))
    return reads


def timed_reads(path: Path, reads: list[tuple[int, int]], depth: int) -> float:
    """GB/s of these O_DIRECT reads, `depth` of them in flight (one thread each: pread drops the GIL)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        raise SystemExit(f"{path}: cannot be opened for direct I/O (O_DIRECT), which the runtime's reads use: {e}")
    pending = iter(reads)
    lock = threading.Lock()
    largest = max(size for _, size in reads)

    def worker():
        buf = mmap.mmap(-1, largest)  # page-aligned, as O_DIRECT wants
        view = memoryview(buf)
        while True:
            with lock:
                job = next(pending, None)
            if job is None:
                break
            os.preadv(fd, [view[:job[1]]], job[0])
        view.release()
        buf.close()

    try:
        threads = [threading.Thread(target=worker) for _ in range(depth)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(size for _, size in reads) / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


def sequential_reads(path: Path, volume: int, seed: int) -> list[tuple[int, int]]:
    size = path.stat().st_size
    start = random.Random(seed).randrange(0, max(1, size - volume)) // ALIGN * ALIGN
    return [(start + i, SEQUENTIAL_READ) for i in range(0, volume, SEQUENTIAL_READ) if start + i + SEQUENTIAL_READ <= size]


def read_rates(path: Path, rounds: int, volume: int) -> dict:
    """every read pattern once per round, round-robin: all see the disk's drift alike"""
    per_tensor = sum(size for _, size in chunk_reads(path, 4)) / 4
    n_tensors = max(4, int(volume / per_tensor))
    found: dict[str, list[float]] = {}
    for rnd in range(rounds):
        for depth in DEPTHS:
            reads = chunk_reads(path, n_tensors, seed=1000 * rnd + depth)
            found.setdefault(f"chunks_depth{depth}", []).append(timed_reads(path, reads, depth))
        found.setdefault("sequential", []).append(timed_reads(path, sequential_reads(path, volume, rnd), 1))
    sizes = chunk_reads(path, 64)
    return {"gbps": {k: spread(v) for k, v in found.items()},
            "mean_read_bytes": sum(s for _, s in sizes) / len(sizes), "volume_bytes": volume, "rounds": rounds}


# ---- decoding ----

def decode_jobs(path: Path, n: int, seed: int = 1):
    """n prepared decode + recover calls on random BF16 expert tensors of the file (bytes read buffered)"""
    from zipmoe_py import codec
    from zipmoe_py import format as zformat

    rng = random.Random(seed)
    decoder = codec.Decoder()
    jobs = []
    with zformat.ZipMoEFile(path) as zf, open(path, "rb") as f:
        split = [t for t in zf.tensors if not zf.is_raw(t)]
        if not split:
            return decoder, []
        for _ in range(n):
            name = rng.choice(split)
            sm, *e_chunks = zf.chunks(name, rng.randrange(zf.shape(name)[2]))
            blobs = [os.pread(f.fileno(), c.size, c.offset) for c in e_chunks]
            codecs = [zformat._lib.lib().ggml_zipmoe_codec_name(c.codec).decode() for c in e_chunks]
            plane = np.frombuffer(os.pread(f.fileno(), sm.size, sm.offset), np.uint8)
            jobs.append(codec.ExpertDecode(decoder, blobs, codecs, plane))
    for job in jobs:
        job()  # the outputs' first-touch page faults happen here, not in the timing
    return decoder, jobs


def decode_gbps(jobs_per_thread: list[list], seconds: float) -> float:
    """aggregate BF16 GB/s of threads each cycling through its own jobs for about `seconds`"""
    done = [0] * len(jobs_per_thread)

    def worker(i, jobs):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for job in jobs:
                job()
                done[i] += job.out.nbytes

    threads = [threading.Thread(target=worker, args=(i, jobs)) for i, jobs in enumerate(jobs_per_thread)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0) / 1e9


LOAD = """
import numpy as np, os, time
os.sched_setaffinity(0, {{{cpu}}})
a = np.ones(({rows}, 16384), np.float32)  # 512 MB by default: streamed from memory like a product's weights
x = np.ones(16384, np.float32)
end = time.time() + {seconds}
while time.time() < end:
    a @ x
"""


def decode_under_load(jobs: list, seconds: float, load_rows: int = 8192) -> float:
    """one thread's rate while every other core runs a matrix-vector load"""
    mine = os.sched_getaffinity(0)
    first, *others = sorted(mine)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    loads = [subprocess.Popen([sys.executable, "-c", LOAD.format(cpu=cpu, rows=load_rows, seconds=seconds + 3)], env=env)
             for cpu in others]
    time.sleep(1.5)  # the loads' matrices are allocated and streaming
    try:
        os.sched_setaffinity(0, {first})  # this thread, so the decoding thread it starts, keeps off the loads' cores
        return decode_gbps([jobs], seconds)
    finally:
        os.sched_setaffinity(0, mine)
        for p in loads:
            p.kill()
            p.wait()


def decode_rates(path: Path, threads: int, rounds: int, seconds: float, load_rows: int = 8192) -> dict:
    decoders, per_thread = zip(*[decode_jobs(path, 4, seed=1 + i) for i in range(threads)])
    if not per_thread[0]:
        return {"raw": True}  # stored raw (quantized): nothing to decode, a miss is a read and a copy
    found: dict[str, list[float]] = {}
    for _ in range(rounds):
        found.setdefault("one_thread", []).append(decode_gbps([per_thread[0]], seconds))
        found.setdefault("all_threads", []).append(decode_gbps(list(per_thread), seconds))
        found.setdefault("one_thread_under_load", []).append(decode_under_load(per_thread[0], seconds, load_rows))
    for d in decoders:
        d.close()
    return {"gbps": {k: spread(v) for k, v in found.items()}, "threads": threads, "rounds": rounds}


# ---- fresh memory ----

def fresh_memory_rate(volume: int) -> float:
    """GB/s at which one thread makes new anonymous memory present, a write a page: what the stores' pages
    cost on their first write (or the runtime's populator, ahead of it). A VM that hands freed memory back
    to its host (free page reporting) faults each page in on the host too."""
    buf = mmap.mmap(-1, volume)
    pages = np.frombuffer(buf, np.uint8)[::mmap.PAGESIZE]
    try:
        t0 = time.perf_counter()
        pages[:] = 1
        return volume / (time.perf_counter() - t0) / 1e9
    finally:
        del pages  # the view must go before the map closes
        buf.close()


# ---- the compute floor ----

def resident_times(gguf: Path, prompt_tokens: int, gen_tokens: int, threads: int, repetitions: int) -> dict:
    """stock llama.cpp's resident prompt time and TPOT on a truncation (llama-bench, page cache warm)"""
    from zipmoe_py import _paths

    with open(gguf, "rb", buffering=0) as f:  # warm: the floor is compute, not reads
        while f.read(64 << 20):
            pass
    cmd = [str(_paths.program("llama-bench")), "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(gen_tokens),
           "-t", str(threads), "-r", str(repetitions), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{gguf}: llama-bench failed (rc {proc.returncode}):\n{proc.stderr[-1500:]}")
    tests = json.loads(proc.stdout)
    prompt = next(t for t in tests if t["n_prompt"] > 0 and t["n_gen"] == 0)
    gen = next(t for t in tests if t["n_gen"] > 0 and t["n_prompt"] == 0)
    return {"prompt_s": [ns / 1e9 for ns in prompt["samples_ns"]],
            "tpot_s": [ns / 1e9 / gen_tokens for ns in gen["samples_ns"]], "command": cmd}


def resident_batch_tpot(gguf: Path, batch: int, prompt_tokens: int, gen_tokens: int, threads: int,
                        repetitions: int) -> dict:
    """stock llama.cpp's resident time of a decode step of `batch` sequences (one token of each, as
    llama-server -np decodes them) on a truncation, page cache warm; llama-bench decodes one sequence"""
    from zipmoe_py.bindings import Llama
    from zipmoe_py.bindings import llama_cpp as lc

    with open(gguf, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    llm = Llama(model_path=str(gguf), n_ctx=64, n_threads=threads, verbose=False)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = batch * (prompt_tokens + gen_tokens + 16)
    cparams.n_batch = cparams.n_ubatch = max(512, batch * prompt_tokens)
    cparams.n_seq_max = batch
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(llm._model.model, cparams)
    lots = lc.llama_batch_init(cparams.n_batch, 0, batch)
    rng = random.Random(0)
    n_vocab = llm.n_vocab()

    def decode(entries):  # (token, pos, seq)
        lots.n_tokens = len(entries)
        for i, (tok, pos, seq) in enumerate(entries):
            lots.token[i], lots.pos[i], lots.n_seq_id[i], lots.seq_id[i][0], lots.logits[i] = tok, pos, 1, seq, True
        if lc.llama_decode(ctx, lots) != 0:
            raise SystemExit(f"{gguf}: llama_decode failed")

    steps = []
    try:
        for _ in range(repetitions):
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            decode([(rng.randrange(n_vocab), pos, s) for s in range(batch) for pos in range(prompt_tokens)])
            start = time.perf_counter()
            for step in range(gen_tokens):
                decode([(rng.randrange(n_vocab), prompt_tokens + step, s) for s in range(batch)])
            steps.append((time.perf_counter() - start) / gen_tokens)
    finally:
        lc.llama_batch_free(lots)
        lc.llama_free(ctx)
        llm.close()
    return {"tpot_s": steps, "batch": batch}


def layer_count(gguf: Path) -> int:
    from zipmoe_py import gguf_file

    header = gguf_file.read_header(gguf)
    return int(header.value(f"{header.value('general.architecture')}.block_count"))


def floor_main(args) -> int:
    if len(args.truncations) < 3:
        print("note: fewer than 3 truncations: the line's residuals check nothing", file=sys.stderr)
    runs = []
    batches = [int(b) for b in args.batch.split(",")]
    for gguf in args.truncations:
        times = resident_times(gguf, args.prompt_tokens, args.gen_tokens, args.threads, args.repetitions)
        runs.append({"gguf": str(gguf), "layers": layer_count(gguf), **times})
        for batch in (b for b in batches if b > 1):
            found = resident_batch_tpot(gguf, batch, args.prompt_tokens, args.gen_tokens, args.threads,
                                        args.repetitions)
            runs[-1][f"tpot_s_batch{batch}"] = found["tpot_s"]
        print(f"{gguf.name}: {runs[-1]['layers']} layers, TPOT {statistics.median(times['tpot_s']) * 1e3:.1f} ms, "
              f"prompt of {args.prompt_tokens} {statistics.median(times['prompt_s']):.2f} s" +
              "".join(f", a step of {b} sequences {statistics.median(runs[-1][f'tpot_s_batch{b}']) * 1e3:.1f} ms"
                      for b in batches if b > 1), flush=True)
    result = {**run_facts(args.out), "full_layers": args.layers, "threads": args.threads,
              "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, "truncations": runs}
    for what in ["tpot_s", "prompt_s"] + [f"tpot_s_batch{b}" for b in batches if b > 1]:
        line = fit_line([(r["layers"], statistics.median(r[what])) for r in runs])
        line["floor_s"] = line["fixed_s"] + line["per_layer_s"] * args.layers
        result[what] = line
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    t = result["tpot_s"]
    print(f"TPOT floor at {args.layers} layers: {t['fixed_s'] * 1e3:.1f} + {t['per_layer_s'] * 1e3:.2f} ms x layers = "
          f"{t['floor_s'] * 1e3:.0f} ms; residuals {', '.join(f'{r * 1e3:+.1f}' for r in t['residuals_s'])} ms; "
          f"prompt floor {result['prompt_s']['floor_s']:.2f} s; saved {args.out}")
    for b in (b for b in batches if b > 1):
        s = result[f"tpot_s_batch{b}"]
        print(f"a step of {b} sequences: {s['floor_s'] * 1e3:.0f} ms at {args.layers} layers; residuals "
              f"{', '.join(f'{r * 1e3:+.1f}' for r in s['residuals_s'])} ms")
    return 0


# ---- the bound ----

def inclusion(profile: str, n_expert: int, k: int, batch: int) -> tuple[np.ndarray, int]:
    """(inclusion probabilities by rank, experts per layer) of a ubatch of `batch` sequences: a PROFILE's
    own counts for that batch size where it has them; else the union of `batch` tokens' selections,
    inclusion 1 - (1 - f)^B rounded to a k-set (zipmoe-plan's rule), from its batch-1 counts or uniform"""
    from zipmoe_py import plan_files
    from zipmoe_py.plan_cli import _batch_marginals
    from zipmoe_py.plan_math import round_to_subset_size

    if profile == "uniform":
        f = np.full(n_expert, k / n_expert)
    else:
        doc = plan_files.load_profile(Path(profile))
        if str(batch) in doc["batches"]:
            return _batch_marginals(doc, batch, Path(profile))
        f, k = _batch_marginals(doc, 1, Path(profile))
    if batch == 1:
        return f, k
    return round_to_subset_size(1.0 - (1.0 - np.minimum(f, 1.0)) ** batch)


def model_facts(path: Path) -> dict:
    """what the bound needs of a ZipMoE GGUF: geometry, entry sizes by pool, stored and non-expert bytes"""
    from zipmoe_py import format as zformat
    from zipmoe_py import gguf_file
    from zipmoe_py.profile import expert_bytes_by_pool

    header = gguf_file.read_header(path)
    arch = header.value("general.architecture")
    with zformat.ZipMoEFile(path) as zf:
        layers = zf.moe_layers()
        first = zf.tensors[next(iter(layers.values()))[0]]
        n_expert = zf.shape(first)[2]
        raw = any(zf.is_raw(t) for t in zf.tensors)
        one = zf.expert_bytes()
        stored = sum(c.size for t in zf.tensors for c in zf.chunks(t, 0)) / len(layers)  # one expert, all kinds
        shards = zf.shards
    if raw:
        pools, n_tensors = {"F": one.one_expert, "C": 0, "S": 0, "E": 0}, 3
    else:
        pools, n_tensors, shards = expert_bytes_by_pool(path)
    weights = sum(t.nbytes() for t in header.tensors if not t.name.endswith(".zipmoe"))
    return {"n_expert": n_expert, "k": int(header.value(f"{arch}.expert_used_count")), "n_layer_moe": len(layers),
            "raw": raw, "entry_bytes": pools, "n_tensors": n_tensors, "shards": shards,
            "stored_expert_bytes": stored, "sm_bytes": one.sm_chunks, "bf16_expert_bytes": one.one_expert,
            "non_expert_bytes": weights}


def costs_from_rates(facts: dict, read_bps: float, decode_bps_per_thread: float):
    """Alg. 3's delays: read one SM-chunk (u), one E-chunk (v), decode + recover one E-chunk (c)"""
    from zipmoe_py.plan_files import Costs

    n, k_shards = facts["n_tensors"], facts["shards"]
    if facts["raw"]:
        return Costs(u_s=facts["entry_bytes"]["F"] / n / read_bps, v_s=0.0, c_s=0.0)
    e_bytes = facts["stored_expert_bytes"] - facts["sm_bytes"]
    return Costs(u_s=facts["sm_bytes"] / n / read_bps, v_s=e_bytes / (n * k_shards) / read_bps,
                 c_s=facts["bf16_expert_bytes"] / (n * k_shards) / decode_bps_per_thread)


def implied_read_bytes(facts: dict, f: np.ndarray, capacities: dict) -> float:
    """stored bytes a token reads, as the pools imply for a routing profile: ranks in F and C read nothing,
    S reads the E-chunks, E the SM-chunks, ranks beyond every pool the whole stored expert"""
    sm = facts["sm_bytes"]
    per_rank = [0.0] * (capacities.get("F", 0) + capacities.get("C", 0)) + \
        [facts["stored_expert_bytes"] - sm] * capacities.get("S", 0) + [sm] * capacities.get("E", 0)
    cost = np.array((per_rank + [facts["stored_expert_bytes"]] * len(f))[:len(f)])
    return facts["n_layer_moe"] * float(np.sum(np.asarray(f) * cost))


def tpot_bound(facts: dict, f: np.ndarray, k: int, budget: int, costs, threads: int, compute_s: float) -> dict:
    from zipmoe_py.plan_math import plan

    if budget <= 0:
        return {"error": "the cap leaves nothing for the experts"}
    pools = ("F",) if facts["raw"] else ("F", "C", "S", "E")
    found = plan(f, k, budget, facts["entry_bytes"], pools, costs, threads, facts["shards"], facts["n_tensors"],
                 facts["n_layer_moe"], grid=0.05)
    experts_s = facts["n_layer_moe"] * found.expected_makespan_s
    return {"tpot_bound_s": experts_s + compute_s, "experts_s": experts_s, "compute_s": compute_s,
            "capacities": found.capacities, "expert_budget_bytes": budget}


def ttft_bound(facts: dict, f: np.ndarray, prompt_tokens: int, prompt_s: float, seq_bps: float, budget: int,
               decode_bps: float, fresh_bps: float, threads: int) -> dict:
    """a cold start: the non-expert weights and every expert the prompt needs read once, then the prompt's
    compute. Beside it the CPU's floor, which no overlap with the reads removes: the prompt's compute, every
    needed expert decoded once on all threads, and the memory they are kept in (at least their stored bytes,
    at most the experts' budget) made present for the first time, on all threads at one thread's rate."""
    needed = float(np.sum(1.0 - (1.0 - np.minimum(f, 1.0)) ** prompt_tokens)) * facts["n_layer_moe"]
    read_s = (facts["non_expert_bytes"] + needed * facts["stored_expert_bytes"]) / seq_bps
    decode_s = needed * facts["bf16_expert_bytes"] / decode_bps if decode_bps else 0.0
    fresh_s = min(max(budget, 0), needed * facts["stored_expert_bytes"]) / (fresh_bps * threads) if fresh_bps else 0.0
    return {"ttft_bound_s": prompt_s + read_s, "prompt_compute_s": prompt_s, "weight_reads_s": read_s,
            "experts_needed": needed, "ttft_cpu_floor_s": prompt_s + decode_s + fresh_s, "prompt_decode_s": decode_s,
            "fresh_memory_s": fresh_s}


def compute_floor(floor: dict | None, batch: int) -> tuple[float, str]:
    """(seconds, which) of a decode step's compute: the floor's own line for this batch size where it was
    measured (`floor --batch`), else the batch-1 floor, which understates a wider step's compute"""
    if not floor:
        return 0.0, "none"
    if f"tpot_s_batch{batch}" in floor:
        return floor[f"tpot_s_batch{batch}"]["floor_s"], f"batch {batch}"
    return floor["tpot_s"]["floor_s"], "batch 1"


def bounds(facts: dict, reads: dict, decode: dict, floor: dict | None, caps: list[int], batches: list[int],
           profile: str, threads: int, overhead: int, prompt_tokens: int, fresh: dict | None = None) -> list[dict]:
    """a row per (cap, batch): the TPOT bound at the runtime's queue depth and at the disk's best one,
    and (batch 1) the TTFT bound"""
    rate = {name: r["median"] * 1e9 for name, r in reads["gbps"].items()}
    best_depth = max((d for d in DEPTHS), key=lambda d: rate[f"chunks_depth{d}"])
    per_thread = 0.0 if decode.get("raw") else decode["gbps"]["all_threads"]["median"] * 1e9 / threads
    prompt_s = floor["prompt_s"]["floor_s"] if floor else 0.0
    rows = []
    for cap in caps:
        budget = cap - facts["non_expert_bytes"] - overhead
        for batch in batches:
            f, k = inclusion(profile, facts["n_expert"], facts["k"], batch)
            compute_s, compute_of = compute_floor(floor, batch)
            row = {"cap_bytes": cap, "batch": batch, "k": k, "compute_floor_of": compute_of}
            for label, depth in (("", 1), ("best_depth_", best_depth)):
                costs = costs_from_rates(facts, rate[f"chunks_depth{depth}"], per_thread or 1.0)
                found = tpot_bound(facts, f, k, budget, costs, threads, compute_s)
                row.update({f"{label}{key}": value for key, value in found.items()})
            row["best_depth"] = best_depth
            if batch == 1:
                fresh_bps = fresh["gbps"]["median"] * 1e9 if fresh else 0.0  # none: a JSON from before it was measured
                row.update(ttft_bound(facts, f, prompt_tokens, prompt_s, rate["sequential"], budget, per_thread * threads,
                                      fresh_bps, threads))
            rows.append(row)
    return rows


def markdown(result: dict) -> str:
    reads, decode = result["reads"]["gbps"], result["decode"]
    fmt = lambda r: f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"  # noqa: E731
    lines = [f"# What this machine allows: {Path(result['model']).name}", "",
             f"{result['date']}, build {result['build']}, {result['cpu_count']} cores; `{result['command']}`", "",
             "| measured (median, min-max of the rounds) | GB/s |", "| --- | --- |"]
    lines += [f"| O_DIRECT, the runtime's chunk reads, depth {d} | {fmt(reads[f'chunks_depth{d}'])} |" for d in DEPTHS]
    lines += [f"| O_DIRECT, sequential {SEQUENTIAL_READ >> 20} MiB reads | {fmt(reads['sequential'])} |"]
    if not decode.get("raw"):
        g = decode["gbps"]
        lines += [f"| decode + recover, 1 thread | {fmt(g['one_thread'])} |",
                  f"| decode + recover, {decode['threads']} threads | {fmt(g['all_threads'])} |",
                  f"| decode + recover, 1 thread beside a matrix-vector load | {fmt(g['one_thread_under_load'])} |"]
    if result.get("fresh_memory"):
        lines += [f"| new memory made present, 1 thread a page at a time | {fmt(result['fresh_memory']['gbps'])} |"]
    floor = result.get("floor")
    if floor:
        t = floor["tpot_s"]
        lines += ["", f"Compute floor ({floor['command']}): {t['floor_s'] * 1e3:.0f} ms at {floor['full_layers']} layers "
                  f"(residuals {', '.join(f'{r * 1e3:+.1f}' for r in t['residuals_s'])} ms at "
                  f"{', '.join(str(r['layers']) for r in floor['truncations'])} layers); prompt "
                  f"{floor['prompt_s']['floor_s']:.2f} s."]
    else:
        lines += ["", "No compute floor was given: the bounds below are the experts' part alone."]
    lines += ["", f"Profile: {result['profile']}; overhead beside the non-expert weights "
              f"{result['overhead_bytes'] / 2**30:.2f} GiB.", "",
              "| cap | batch | k | expert budget GiB | pools F/C/S/E per layer | experts ms | compute ms | "
              "TPOT bound ms | at depth d | TTFT bound s | TTFT CPU floor s (compute + decoding + new memory) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['cap_bytes'] / 2**30:.1f} GiB | {r['batch']} | {r['k']} | {r['error']} ||||||||")
            continue
        caps = "/".join(str(r["capacities"].get(p, 0)) for p in ("F", "C", "S", "E"))
        ttft = f"{r['ttft_bound_s']:.1f} | {r['ttft_cpu_floor_s']:.1f} ({r['prompt_compute_s']:.1f} + " \
               f"{r['prompt_decode_s']:.1f} + {r['fresh_memory_s']:.1f})" if "ttft_bound_s" in r else " |"
        lines.append(f"| {r['cap_bytes'] / 2**30:.1f} GiB | {r['batch']} | {r['k']} | {r['expert_budget_bytes'] / 2**30:.2f} | "
                     f"{caps} | {r['experts_s'] * 1e3:.0f} | {r['compute_s'] * 1e3:.0f} | {r['tpot_bound_s'] * 1e3:.0f} | "
                     f"{r['best_depth_tpot_bound_s'] * 1e3:.0f} (d={r['best_depth']}) | {ttft} |")
    return "\n".join(lines) + "\n"


def bound_main(args) -> int:
    facts = model_facts(args.model)
    floor = json.loads(args.floor.read_text()) if args.floor else None
    # the TTFT bound's prompt compute is the floor's, measured at the floor's prompt length
    if args.prompt_tokens is None:
        args.prompt_tokens = floor["prompt_tokens"] if floor else 44
    elif floor and args.prompt_tokens != floor["prompt_tokens"]:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: {args.floor} measured the prompt's floor at "
                         f"{floor['prompt_tokens']} tokens (run `limits.py floor --prompt-tokens {args.prompt_tokens}`)")
    if floor and floor.get("full_layers") != layer_count(args.model):
        raise SystemExit(f"{args.floor}: its floor is for {floor.get('full_layers')} layers, {args.model} has "
                         f"{layer_count(args.model)}")
    print(f"{args.model.name}: {facts['n_layer_moe']} MoE layers of {facts['n_expert']} experts (k={facts['k']}); "
          f"measuring reads ({args.rounds} rounds of {args.volume / 1e9:.1f} GB per pattern) and decoding ...", flush=True)
    reads = read_rates(args.model, args.rounds, args.volume)
    decode = decode_rates(args.model, args.threads, args.rounds, args.seconds)
    fresh = {"gbps": spread([fresh_memory_rate(args.volume) for _ in range(args.rounds)]), "volume_bytes": args.volume}
    rows = bounds(facts, reads, decode, floor, [parse_size(c) for c in args.caps.split(",")],
                  [int(b) for b in args.batch.split(",")], args.profile, args.threads, parse_size(args.overhead),
                  args.prompt_tokens, fresh)
    result = {**run_facts(args.out), "model": str(args.model), "profile": args.profile, "threads": args.threads,
              "overhead_bytes": parse_size(args.overhead), "prompt_tokens": args.prompt_tokens, "facts": facts,
              "reads": reads, "decode": decode, "fresh_memory": fresh, "floor": floor, "rows": rows}
    save(result, args.out, markdown)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    fl = sub.add_parser("floor", help="the compute floor from resident truncations (stock llama-bench)")
    fl.add_argument("truncations", nargs="+", type=Path, help="BF16 GGUFs of the geometry with fewer layers (>= 3)")
    fl.add_argument("--layers", type=int, required=True, help="the full model's layer count")
    fl.add_argument("--repetitions", type=int, default=5, help="llama-bench repetitions (default: %(default)s)")
    fl.add_argument("--gen-tokens", type=int, default=64, help="tokens per TPOT sample (default: %(default)s)")
    fl.add_argument("--batch", default="1",
                    help="sequences decoded together, e.g. 1,4: each size above 1 gets its own floor line, a "
                         "resident step of that many sequences (default: %(default)s)")
    fl.add_argument("--out", type=Path, required=True)
    bd = sub.add_parser("bound", help="measure the rates and compute the bounds for a ZipMoE GGUF")
    bd.add_argument("model", type=Path, help="the ZipMoE GGUF")
    bd.add_argument("--floor", type=Path, default=None, help="JSON of `limits.py floor` for this geometry")
    bd.add_argument("--caps", default="12G,20G", help="memory caps (default: %(default)s)")
    bd.add_argument("--batch", default="1", help="sequences decoded together (default: %(default)s)")
    bd.add_argument("--profile", default="uniform", help="uniform, or a zipmoe-profile PROFILE (default: %(default)s)")
    bd.add_argument("--overhead", default="512M",
                    help="memory beside the non-expert weights the experts cannot have (default: %(default)s)")
    bd.add_argument("--rounds", type=int, default=5, help="interleaved measuring rounds (default: %(default)s)")
    bd.add_argument("--volume", type=parse_size, default=parse_size("512M"),
                    help="bytes read per read pattern and round, and new memory made present per round (default: 512M)")
    bd.add_argument("--seconds", type=float, default=2.0, help="seconds per decoding measurement (default: %(default)s)")
    bd.add_argument("--out", type=Path, required=True)
    fl.add_argument("--prompt-tokens", type=int, default=44,
                    help="prompt length: the bench's prompt in the model's tokenizer (default: %(default)s)")
    bd.add_argument("--prompt-tokens", type=int, default=None,
                    help="prompt length of the TTFT bound (default: the floor's, else 44)")
    for p in (fl, bd):
        p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads (default: the cores, %(default)s)")
    args = ap.parse_args(argv)
    return floor_main(args) if args.what == "floor" else bound_main(args)


if __name__ == "__main__":
    sys.exit(main())
