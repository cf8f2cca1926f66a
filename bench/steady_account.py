#!/usr/bin/env python3
"""Where a decode step's time goes once the pools are steady: the runtime's own counters between two
decode steps, per step. Run it under a cap, as a sighting (one run; the whole-run account of a bench
row mixes in the prompt, which decodes every expert once):

    ../shared/tools/capped-run --mem 20G --evict bench/work/qwen24u.zipmoe.gguf -- \\
        .venv/bin/python bench/steady_account.py bench/work/qwen24u.zipmoe.gguf

Prints the wall time per step and each counter of zipmoe_stats() that moved, per step (the *_ns
counters in ms: fetch_ns is thread 0's time in the fetch ops, graph_ns the graphs' wall time, so
graph_ns - fetch_ns is the graphs' compute outside them; decode_ns and recover_ns sum every
decoding thread's time), and the process's user and system CPU seconds and page faults per step.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

from _common import PROMPT  # the benches' prompt, so a step here is a step of their rows


def snapshot(llm) -> dict:
    stats = {k: v for k, v in llm.zipmoe_stats().items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    ru = resource.getrusage(resource.RUSAGE_SELF)
    stats.update(user_s=ru.ru_utime, system_s=ru.ru_stime, minor_faults=ru.ru_minflt, major_faults=ru.ru_majflt,
                 wall_s=time.perf_counter())
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a ZipMoE GGUF")
    ap.add_argument("--prompt", default=PROMPT, help="the prompt (default: the benches' 77-token prompt)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps sampled at temperature 1 (default: %(default)s)")
    ap.add_argument("--from-step", type=int, default=16,
                    help="the first step counted: the pools settle before it (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="context tokens (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    if not args.model.is_file():
        ap.error(f"{args.model}: no such file")
    if not 0 <= args.from_step < args.steps - 1:
        ap.error(f"--from-step must lie in [0, --steps - 1): {args.from_step}")

    from zipmoe_py import Llama

    llm = Llama(model_path=str(args.model), n_threads=args.threads, n_threads_batch=args.threads, n_ctx=args.ctx,
                seed=args.seed, verbose=False)
    if llm.zipmoe_stats() is None:
        print(f"{args.model}: not a ZipMoE GGUF", file=sys.stderr)
        return 2
    llm.eval(llm.tokenize(args.prompt.encode()))
    first = None
    for step in range(args.steps):
        token = llm.sample(temp=1.0)
        if step == args.from_step:
            first = snapshot(llm)
        llm.eval([token])
    last = snapshot(llm)
    steps = args.steps - args.from_step
    print(f"{args.model.name}: steps {args.from_step}-{args.steps - 1}, per step")
    print(f"  {'wall ms':24s} {(last['wall_s'] - first['wall_s']) * 1e3 / steps:10.1f}")
    for key in sorted(last):
        moved = last[key] - first[key]
        if key == "wall_s" or key.endswith("rate") or not moved:  # a ratio is not a counter
            continue
        value = moved / steps / 1e6 if key.endswith("_ns") else moved / steps
        print(f"  {key.removesuffix('_ns') + (' ms' if key.endswith('_ns') else ''):24s} {value:10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
