#!/usr/bin/env python3
"""The routing profile of a ZipMoE GGUF whose experts are stored raw (a quantized model), for bench/limits.py
bound --profile. zipmoe-profile refuses such a file (there are no pools to plan for zipmoe-plan); the bound
still needs how often each expert is chosen. This runs zipmoe-profile's own recording on it and writes every
pool's expert size as the one slot's size (the bound plans one F pool for a raw file).

    .venv/bin/python bench/raw_routing_profile.py bench/work/qwen3-30b-Q4_K_M.zipmoe.gguf -t 2 \\
        -o docs/benchmarks/bound/limits_profile_qwen3q4.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="ZipMoE GGUF with raw (quantized) experts")
    ap.add_argument("--prompts", type=Path, default=BENCH / "profile_prompts.txt",
                    help="one prompt per line (default: bench/profile_prompts.txt)")
    ap.add_argument("-n", "--tokens", type=int, default=32, help="greedy decode steps per prompt (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()

    from zipmoe_py import format as zformat, profile

    with zformat.ZipMoEFile(args.model) as zf:
        if not all(zf.is_raw(t) for t in zf.tensors):
            raise SystemExit(f"{args.model}: its experts are not stored raw: use zipmoe-profile")
        slot = zf.expert_bytes().one_expert
    profile.expert_bytes_by_pool = lambda path: ({p: slot for p in "FCSE"}, len(zformat.EXPERT_KINDS), 1)
    doc = profile.profile(args.model, profile.read_prompts(args.prompts), [1], args.tokens, threads=args.threads)
    args.output.write_text(json.dumps(doc) + "\n")
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
