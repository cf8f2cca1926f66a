#!/usr/bin/env python3
"""What running one ZipMoE model's graphs one at a time costs: several contexts on one model decoding
at once, stock llama.cpp (BF16 GGUF, contexts compute in parallel) against ZipMoE (every expert in a
slot, so both compute the same; ZipMoE's graphs take turns).

    .venv/bin/python bench/concurrency_bench.py --bf16 M.gguf [--zipmoe M.zipmoe.gguf]
        [--contexts 2] [--threads 1,2] [--gen-tokens 32] [--out docs/benchmarks/server/concurrency.json]

For each threads-per-context setting: one context alone, then N contexts in N Python threads (ctypes
releases the GIL), each decoding --gen-tokens seeded random tokens after a short prompt; tokens/s
counts every context's tokens. No memory cap: the model and every expert stay in memory, which is
the case where taking turns costs most (nothing waits on the disk). Prints a table, saves --out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = r"""
import json, random, sys, threading, time
path, n_ctx_run, threads, n_gen, opts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
from zipmoe_py import Llama
from zipmoe_py.bindings import llama_cpp as lc
llm = Llama(model_path=path, n_ctx=256, n_threads=threads, verbose=False, **opts)
prompt = llm.tokenize(b"the model routes every token to a few experts", add_bos=True)

def make():
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 64, 64
    cp.n_threads = cp.n_threads_batch = threads
    return lc.llama_init_from_model(llm._model.model, cp)

def decode(ctx, batch, tokens, pos0):
    batch.n_tokens = len(tokens)
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = t, pos0 + i, 1, 0
        batch.logits[i] = i == len(tokens) - 1
    assert lc.llama_decode(ctx, batch) == 0

def worker(ctx, seed, out):
    batch = lc.llama_batch_init(64, 0, 1)
    rng = random.Random(seed)
    decode(ctx, batch, prompt, 0)
    t = time.perf_counter()
    for i in range(n_gen):
        decode(ctx, batch, [rng.randrange(llm.n_vocab())], len(prompt) + i)
    out.append(time.perf_counter() - t)
    lc.llama_batch_free(batch)

# warm up: every expert into its slot, weights into memory
ctxs = [make() for _ in range(n_ctx_run)]
w = []
worker(ctxs[0], 99, w)
for c in ctxs:
    lc.llama_memory_clear(lc.llama_get_memory(c), True)
times = []
threads_ = [threading.Thread(target=worker, args=(c, s, times)) for s, c in enumerate(ctxs)]
t0 = time.perf_counter()
for th in threads_: th.start()
for th in threads_: th.join()
wall = time.perf_counter() - t0
stats = llm.zipmoe_stats()
print(json.dumps({"wall_s": wall, "tok_per_s": n_ctx_run * n_gen / wall, "per_context_s": times,
                  "misses": stats["expert_misses"] if stats else None}))
"""


def probe(path: Path, n_ctx: int, threads: int, n_gen: int, opts: dict) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(path), str(n_ctx), str(threads), str(n_gen),
                           json.dumps(opts)], capture_output=True, text=True, cwd=tempfile.gettempdir())
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": proc.stderr[-1500:]}
    return json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bf16", type=Path, required=True)
    ap.add_argument("--zipmoe", type=Path, default=None, help="default: the .zipmoe.gguf beside --bf16 (made if missing)")
    ap.add_argument("--contexts", type=int, default=2, help="contexts decoding at once (default: %(default)s)")
    ap.add_argument("--threads", default="1,2", help="graph threads per context, comma-separated (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/server/concurrency.json"))
    args = ap.parse_args()
    bf16 = args.bf16.resolve()
    zipmoe = (args.zipmoe or bf16.with_suffix(".zipmoe.gguf")).resolve()
    if not zipmoe.exists():
        from zipmoe_py import format as zformat

        zformat.repack(bf16, zipmoe)
    everything = {"zipmoe_budget": zipmoe.stat().st_size * 4}  # every expert fits: compute only
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for system, path, opts in (("stock", bf16, {}), ("zipmoe", zipmoe, everything)):
            alone = probe(path, 1, threads, args.gen_tokens, opts)
            together = probe(path, args.contexts, threads, args.gen_tokens, opts)
            row = {"system": system, "threads_per_context": threads, "alone": alone, "together": together}
            rows.append(row)
            if "error" in alone or "error" in together:
                print(f"{system} x{threads}: FAILED {(alone.get('error') or together.get('error'))[-300:]}")
                continue
            print(f"{system:6s} {threads} thread(s)/context: alone {alone['tok_per_s']:6.2f} tok/s, "
                  f"{args.contexts} contexts at once {together['tok_per_s']:6.2f} tok/s in all "
                  f"({together['tok_per_s'] / alone['tok_per_s']:.2f}x)", flush=True)
    result = {"bf16": str(bf16), "zipmoe": str(zipmoe), "contexts": args.contexts, "gen_tokens": args.gen_tokens,
              "machine": platform.platform(), "cpu_count": os.cpu_count(), "rows": rows, "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
