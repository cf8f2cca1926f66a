#!/usr/bin/env python3
"""Two builds of the fork, same model, same cap, runs interleaved: is a change within noise?

    .venv/bin/python bench/ab_bench.py --before OLD/zipmoe_py/bin/llama-completion \
        [--after NEW/llama-completion] --bf16 M.gguf [--zipmoe M.zipmoe.gguf] [--cap 25] \
        [--contexts 256,default] [--rounds 3] [--out docs/benchmarks/cpu/ab.json]

The disk of a shared VM reads anywhere from 0.5 to 2.6 GB/s from one hour to the next, so
before/after numbers taken minutes apart are not comparable; here each round runs both builds
back to back, each run being bench/cli_bench.py's (capped-run: a child memory cgroup of CAP% of
the BF16 model, the model evicted from the page cache first; llama-completion with no ZipMoE
option, 32 tokens at temperature 1, 2 threads). A build of an older commit for --before:

    git worktree add /tmp/old REV && cmake -S /tmp/old -B /tmp/old/build -DCMAKE_BUILD_TYPE=Release \
        -DPython_EXECUTABLE=$PWD/.venv/bin/python && cmake --build /tmp/old/build -j2 && \
        cmake --install /tmp/old/build --component zipmoe --prefix /tmp/oldpkg
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import types
from pathlib import Path

import cli_bench


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="llama-completion of the build before the change")
    ap.add_argument("--after", type=Path, default=None,
                    help="llama-completion of the build after it (default: the one installed in this venv)")
    ap.add_argument("--bf16", type=Path, required=True, help="BF16 GGUF: the cap is a share of its size")
    ap.add_argument("--zipmoe", type=Path, default=None, help="its ZipMoE GGUF (default: M.zipmoe.gguf beside it)")
    ap.add_argument("--cap", type=int, default=25, help="memory cap in %% of the BF16 model (default: %(default)s)")
    ap.add_argument("--contexts", default="256,default", help="llama-completion's default context and/or "
                    "'256' (-c 256 -b 64) (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both builds (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/ab_bench.json"))
    args = ap.parse_args()
    builds = {"before": args.before, "after": args.after or cli_bench.llama_completion()}
    for name, prog in builds.items():
        if not prog.is_file():
            ap.error(f"--{name}: {prog} is not a file")
    # absolute: capped-run and the programs need not run in this folder
    model = (args.zipmoe or args.bf16.with_name(args.bf16.name.replace(".gguf", ".zipmoe.gguf"))).resolve()
    if not model.is_file():
        ap.error(f"--zipmoe: {model} is not a file")
    cap = args.bf16.stat().st_size * args.cap // 100
    run_args = types.SimpleNamespace(gen_tokens=32, seed=1234, threads=2)
    rows = []
    for rnd in range(args.rounds):
        for context in args.contexts.split(","):
            for name, prog in builds.items():
                cli_bench.llama_completion = lambda prog=prog: prog
                row = cli_bench.run_one(cap, model, run_args, context)
                row.update(build=name, round=rnd, context=context, cap_pct=args.cap)
                rows.append(row)
                print(f"round {rnd} ctx {context:7s} {name:6s} TPOT {row.get('tpot_s', float('nan')) * 1e3:7.1f} ms "
                      f"prompt {row.get('prompt_s', float('nan')):5.2f} s rc {row['rc']}", flush=True)
    for context in args.contexts.split(","):
        for name in builds:
            tpot = [r["tpot_s"] * 1e3 for r in rows if r["context"] == context and r["build"] == name and "tpot_s" in r]
            if tpot:
                print(f"ctx {context:7s} {name:6s} TPOT median {statistics.median(tpot):7.1f} ms "
                      f"(min {min(tpot):.1f}, max {max(tpot):.1f}, {len(tpot)} runs)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"builds": {k: str(v) for k, v in builds.items()}, "model": str(model),
                                    "runs": rows}, indent=1))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
