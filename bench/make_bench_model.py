#!/usr/bin/env python3
"""Make an end-to-end bench model: a Hugging Face checkpoint with a real model's widths and
expert counts but fewer layers (random N(0, 0.02) BF16 weights, real tokenizer), converted to a
BF16 GGUF by the pinned llama.cpp converter; the checkpoint is deleted afterwards.

    .venv/bin/python bench/make_bench_model.py qwen2moe --layers 6 -o bench/work/qwen6.gguf
    .venv/bin/python bench/make_bench_model.py deepseek2 --layers 6 -o bench/work/ds6.gguf

qwen2moe at 6 layers is the model of ../shared/DESIGN.md section 8 (8.1 GB); deepseek2 at 6
layers (layer 0 dense, q_lora_rank set) is 6.8 GB. bench/e2e_bench.py makes the ZipMoE files
from the BF16 GGUF.

--router uniform makes the worst case for every expert cache: near-uniform, memoryless routing
(random weights alone route to a small, stable set of experts per layer). Same draws otherwise;
attention output projections are scaled down and the routers' rows made orthonormal, see
zipmoe_py/devtools/tiny.py ROUTERS; bench/prefetch_recall.py measures the routing of either.

    .venv/bin/python bench/make_bench_model.py qwen2moe --layers 6 --router uniform -o bench/work/qwen6-uniform.gguf
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arch", choices=["qwen2moe", "deepseek2"])
    ap.add_argument("--layers", type=int, default=6, help="number of layers (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router", choices=["random", "uniform"], default="random",
                    help="random: weights as drawn; uniform: near-uniform, memoryless routing (default: %(default)s)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="BF16 GGUF to write")
    args = ap.parse_args()

    from zipmoe_py.devtools.tiny import make_tiny

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out.parent, prefix=".hf-") as tmp:
        t = time.perf_counter()
        make_tiny(args.arch, Path(tmp), seed=args.seed, real_widths_layers=args.layers, router=args.router)
        print(f"checkpoint in {time.perf_counter() - t:.0f} s", flush=True)
        t = time.perf_counter()
        convert = shutil.which("zipmoe-convert", path=str(Path(sys.executable).parent)) or "zipmoe-convert"
        subprocess.run([convert, tmp, "--bf16", "-o", str(args.out)], check=True)
        print(f"BF16 GGUF {args.out} ({args.out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
