#!/usr/bin/env python3
"""Conversion bench: HF checkpoint -> ZipMoE GGUF (the default) against HF -> plain BF16 GGUF,
on a multi-GB checkpoint with the real widths of Qwen1.5-MoE-A2.7B (60 experts of 2048 x 1408,
vocab 151936) or DeepSeek-V2-Lite, and fewer layers.

    .venv/bin/python bench/convert_bench.py [--arch qwen2moe] [--layers 4] [--workdir bench/work]

Each conversion runs as the user would run it (`zipmoe-convert DIR -o OUT [--bf16]`), with
the checkpoint evicted from the page cache first; runs alternate, best of --repeats kept.
Target: ZipMoE conversion at most 1.5x the plain BF16 conversion. Prints a table and saves
bench/results/convert_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from zipmoe_py import _paths  # noqa: F401  (fails early, clearly, without an installed build)
from zipmoe_py.devtools.tiny import make_tiny


def evict(path: Path) -> None:
    for f in ([path] if path.is_file() else sorted(path.iterdir())):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(cmd: list) -> float:
    start = time.perf_counter()
    proc = subprocess.run([str(c) for c in cmd], capture_output=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"convert_bench: {' '.join(map(str, cmd))} failed:\n{proc.stderr.decode()[-3000:]}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["qwen2moe", "deepseek2"], default="qwen2moe")
    ap.add_argument("--layers", type=int, default=4, help="layers of the real-width checkpoint (default: %(default)s)")
    ap.add_argument("--workdir", type=Path, default=Path("bench/work"), help="where the checkpoint and outputs go")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each conversion, best kept (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/convert_bench.json"))
    args = ap.parse_args()

    bindir = Path(sys.executable).parent
    convert = bindir / "zipmoe-convert"
    hf = args.workdir / f"{args.arch}-{args.layers}L-hf"
    if not (hf / "model.safetensors").exists():
        print(f"making a real-width {args.arch} checkpoint with {args.layers} layers in {hf} ...", flush=True)
        t = time.perf_counter()
        make_tiny(args.arch, hf, real_widths_layers=args.layers)
        print(f"  made in {time.perf_counter() - t:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in hf.iterdir())
    bf16_out, zipmoe_out = args.workdir / "bf16.gguf", args.workdir / "zipmoe.gguf"
    times = {"bf16": [], "zipmoe": []}
    for r in range(args.repeats):
        for kind, cmd in (("bf16", [convert, hf, "-o", bf16_out, "--bf16", "-q"]),
                          ("zipmoe", [convert, hf, "-o", zipmoe_out, "-q"])):
            evict(hf)
            took = timed(cmd)
            times[kind].append(took)
            print(f"  run {r + 1}: {kind:6s} {took:7.1f} s", flush=True)
    best = {k: min(v) for k, v in times.items()}
    result = {
        "arch": args.arch, "layers": args.layers, "checkpoint_bytes": size,
        "bf16_gguf_bytes": bf16_out.stat().st_size, "zipmoe_gguf_bytes": zipmoe_out.stat().st_size,
        "seconds": times, "best_seconds": best, "zipmoe_over_bf16": best["zipmoe"] / best["bf16"],
        "target": "<= 1.5", "cpu_count": os.cpu_count(), "machine": platform.platform(),
        "commands": [f"zipmoe-convert {hf} -o {bf16_out} --bf16 -q", f"zipmoe-convert {hf} -o {zipmoe_out} -q"],
    }
    print(f"checkpoint {size / 1e9:.2f} GB; BF16 GGUF {result['bf16_gguf_bytes'] / 1e9:.2f} GB in {best['bf16']:.1f} s; "
          f"ZipMoE GGUF {result['zipmoe_gguf_bytes'] / 1e9:.2f} GB in {best['zipmoe']:.1f} s; "
          f"ratio {result['zipmoe_over_bf16']:.2f}x (target <= 1.5x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
