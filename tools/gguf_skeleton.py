#!/usr/bin/env python3
"""Carry a GGUF model where it cannot be made or copied: its header alone (metadata, tokenizer,
tensor table: a few MB) and, on the other side, a GGUF with the same header and fresh random weights.

    python tools/gguf_skeleton.py strip MODEL.gguf SKELETON.gguf [--layers N]   (also writes SKELETON.gguf.json)
    python tools/gguf_skeleton.py fill SKELETON.gguf MODEL.gguf [--seed N]

--layers N makes the header of a deeper model: the last layer's tensors repeated up to N layers
(the full DeepSeek-V2-Lite geometry's 27 from a 2-layer bench model, without writing its 31 GB; at
26 or 27 layers, which llama.cpp takes for DeepSeek-V2-Lite, the queries become Lite's single projection).
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


def strip(src: Path, dst: Path, layers: int | None = None) -> None:
    from zipmoe_py.gguf_file import read_header

    header = read_header(src)
    for t in header.tensors:
        if t.type not in TYPE_SIZE:
            raise SystemExit(f"{src}: tensor {t.name} has ggml type {t.type}; only F32 and BF16 can be filled")
    if layers is None:
        with open(src, "rb") as f:
            head = f.read(header.data_offset)
        tensors = [(t.name, t.type, t.offset, t.n_elements) for t in header.tensors]
        data_offset = header.data_offset
    else:
        head, tensors, data_offset = grown_header(src, header, layers)
    dst.write_bytes(head)
    table = {"data_offset": data_offset,
             "tensors": [{"name": name, "type": ty, "offset": offset, "n": n} for name, ty, offset, n in tensors]}
    Path(str(dst) + ".json").write_text(json.dumps(table))
    print(f"{dst}: header of {src}{f' grown to {layers} layers' if layers else ''} "
          f"({data_offset / 1e6:.1f} MB, {len(tensors)} tensors)")


def grown_header(src: Path, header, layers: int):
    """The header of src with its last layer's tensors repeated up to `layers` layers, every tensor laid
    out anew. Refuses per-layer metadata arrays, which repeating tensors cannot extend."""
    import struct

    from zipmoe_py.gguf_file import pack_kv, pack_tensor_info

    arch = header.value("general.architecture")
    key = f"{arch}.block_count"
    have = header.value(key)
    if not isinstance(have, int) or not 0 < have < layers:
        raise SystemExit(f"{src}: {key} is {have!r}; --layers {layers} must be more than it")
    for name, kv in header.kv.items():
        if isinstance(kv.value, list) and len(kv.value) == have and name.startswith(f"{arch}."):
            raise SystemExit(f"{src}: {name} holds a value per layer; --layers cannot extend it")
    last = f"blk.{have - 1}."
    shapes = [(t.name, t.dims, t.type) for t in header.tensors]
    shapes += [(f"blk.{layer}." + t.name[len(last):], t.dims, t.type)
               for layer in range(have, layers) for t in header.tensors if t.name.startswith(last)]
    kv_raw = {name: pack_kv(key, kv.type, layers) if name == key else kv.raw for name, kv in header.kv.items()}
    if arch == "deepseek2" and layers in DEEPSEEK2_LITE_LAYERS and f"{arch}.attention.q_lora_rank" in kv_raw:
        shapes, kv_raw = lite_attention(shapes, kv_raw)
    align = header.alignment
    infos, end = [], 0
    for name, dims, ty in shapes:
        infos.append((name, dims, ty, end))
        end += (int(np.prod(dims)) * TYPE_SIZE[ty] + align - 1) // align * align
    head = (b"GGUF" + struct.pack("<IQQ", header.version, len(infos), len(kv_raw)) + b"".join(kv_raw.values())
            + b"".join(pack_tensor_info(*info) for info in infos))
    data_offset = (len(head) + align - 1) // align * align
    head += bytes(data_offset - len(head))
    tensors = [(name, ty, offset, int(np.prod(dims))) for name, dims, ty, offset in infos]
    return head, tensors, data_offset


# llama.cpp (src/models/deepseek2.cpp) takes a DeepSeek-V2 of 26 or 27 layers for DeepSeek-V2-Lite, whose
# queries have one projection (attn_q) and no q_lora_rank; a shallower bench model has the LoRA pair
DEEPSEEK2_LITE_LAYERS = (26, 27)


def lite_attention(shapes, kv_raw):
    """DeepSeek-V2-Lite's attention from the full one's: attn_q (n_embd x the q_b projection's outputs) for
    attn_q_a, its norm and attn_q_b; no q_lora_rank."""
    q_b = {name: dims for name, dims, _ in shapes if name.endswith(".attn_q_b.weight")}
    out = []
    for name, dims, ty in shapes:
        if name.endswith(".attn_q_a.weight"):
            out.append((name.replace(".attn_q_a.", ".attn_q."), [dims[0], q_b[name.replace("_q_a.", "_q_b.")][1]], ty))
        elif not name.endswith((".attn_q_a_norm.weight", ".attn_q_b.weight")):
            out.append((name, dims, ty))
    return out, {k: v for k, v in kv_raw.items() if k != "deepseek2.attention.q_lora_rank"}


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
    s.add_argument("--layers", type=int, default=None,
                   help="repeat the last layer's tensors up to this many layers (default: MODEL's own)")
    f = sub.add_parser("fill", help="write a GGUF with the skeleton's header and random weights")
    f.add_argument("src", type=Path)
    f.add_argument("dst", type=Path)
    f.add_argument("--seed", type=int, default=1234, help="random seed (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.cmd == "strip":
        strip(args.src, args.dst, args.layers)
    else:
        fill(args.src, args.dst, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
