#!/usr/bin/env python3
"""Carry a GGUF model where it cannot be made or copied: its header alone (metadata, tokenizer,
tensor table: a few MB) and, on the other side, a GGUF with the same header and fresh random weights.

    python tools/gguf_skeleton.py strip MODEL.gguf SKELETON.gguf   (also writes SKELETON.gguf.json)
    python tools/gguf_skeleton.py fill SKELETON.gguf MODEL.gguf [--seed N]

strip needs the installed zipmoe_py (run it with the venv's Python); fill needs only NumPy.

Used for the GPU machine (docs/CUDA.md), which reaches no package registry and takes a small
working tree: the tests' tiny models are made here, stripped, carried and filled there. Norm
weights are filled with ones, every other tensor with N(0, 0.02), in the tensor's own type (F32 or
BF16); the file is then a valid model of the same architecture, not the original's weights.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

GGML_TYPE_F32, GGML_TYPE_BF16 = 0, 30
TYPE_SIZE = {GGML_TYPE_F32: 4, GGML_TYPE_BF16: 2}
POOL = 1 << 24  # tensors larger than this many values are filled from a reused pool of draws


def strip(src: Path, dst: Path) -> None:
    from zipmoe_py.gguf_file import read_header

    header = read_header(src)
    with open(src, "rb") as f:
        dst.write_bytes(f.read(header.data_offset))
    table = {"data_offset": header.data_offset,
             "tensors": [{"name": t.name, "type": t.type, "offset": t.offset, "n": t.n_elements} for t in header.tensors]}
    for t in header.tensors:
        if t.type not in TYPE_SIZE:
            raise SystemExit(f"{src}: tensor {t.name} has ggml type {t.type}; only F32 and BF16 can be filled")
    Path(str(dst) + ".json").write_text(json.dumps(table))
    print(f"{dst}: header of {src} ({header.data_offset / 1e6:.1f} MB, {len(header.tensors)} tensors)")


def to_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def fill(src: Path, dst: Path, seed: int) -> None:
    table = json.loads(Path(str(src) + ".json").read_text())
    data_offset = table["data_offset"]
    rng = np.random.default_rng(seed)
    head = src.read_bytes()
    if len(head) != data_offset:
        raise SystemExit(f"{src} is not the skeleton its .json describes ({len(head)} bytes, not {data_offset})")
    end = 0
    pool = {}
    with open(dst, "wb") as out:
        out.write(head)
        for t in sorted(table["tensors"], key=lambda t: t["offset"]):
            out.seek(data_offset + t["offset"])
            n = t["n"]
            if t["name"].endswith("norm.weight"):
                values = np.ones(n, np.float32)
                out.write(values.tobytes() if t["type"] == GGML_TYPE_F32 else to_bf16(values).tobytes())
            elif n <= POOL:
                values = rng.normal(0, 0.02, n).astype(np.float32)
                out.write(values.tobytes() if t["type"] == GGML_TYPE_F32 else to_bf16(values).tobytes())
            else:
                # a bench model's GBs: windows of one pool of draws at random starts (disk speed, not RNG speed)
                if t["type"] not in pool:
                    draws = rng.normal(0, 0.02, 2 * POOL).astype(np.float32)
                    pool[t["type"]] = draws if t["type"] == GGML_TYPE_F32 else to_bf16(draws)
                left = n
                while left > 0:
                    start = int(rng.integers(0, POOL))
                    take = min(left, POOL)
                    out.write(pool[t["type"]][start:start + take].tobytes())
                    left -= take
            end = max(end, t["offset"] + n * TYPE_SIZE[t["type"]])
        out.truncate(data_offset + end)
    print(f"{dst}: {len(table['tensors'])} tensors filled ({dst.stat().st_size / 1e6:.1f} MB)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("strip", help="write the header of MODEL.gguf alone")
    s.add_argument("src", type=Path)
    s.add_argument("dst", type=Path)
    f = sub.add_parser("fill", help="write a GGUF with the skeleton's header and random weights")
    f.add_argument("src", type=Path)
    f.add_argument("dst", type=Path)
    f.add_argument("--seed", type=int, default=1234, help="random seed (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.cmd == "strip":
        strip(args.src, args.dst)
    else:
        fill(args.src, args.dst, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
