#!/usr/bin/env python3
"""Write a random-weight GGUF at a real model's full geometry in a llama-quantize file type, without ever
making the BF16 model (Qwen3-30B-A3B is 61 GB in BF16: with its Q4_K_M and ZipMoE files it does not fit
this disk).

    .venv/bin/python bench/make_random_gguf.py qwen3moe --type Q4_K_M -o bench/work/qwen3-30b-Q4_K_M.gguf
    .venv/bin/python bench/make_random_gguf.py qwen3moe --layers 24 -o bench/work/qwen3-24-bf16.gguf
    .venv/bin/python bench/make_random_gguf.py gptoss --mxfp4 -o bench/work/gptoss-20b-mxfp4.gguf
    .venv/bin/python bench/make_random_gguf.py bench/work/qwen3-30b-Q4_K_M.gguf --every 8 -o bench/work/floor/qwen3-6.gguf

Two small templates made by the real tools decide everything but the weights:
- shapes and metadata: zipmoe-make-tiny's checkpoint at the real widths with its leading dense layers and one
  more, converted by the pinned llama.cpp converter (tokenizer, hyperparameters, tensor names and shapes);
- tensor types (--type): the same architecture at the real layer and expert counts but 256 wide (every K-quant
  block divides it, so no tensor falls back to another type), quantized by the fork's llama-quantize: the type
  llama-quantize gives each tensor depends on its name, layer, the expert count and the GQA ratio, all kept.
Without --type every tensor keeps the converter's type (BF16, F32, and MXFP4 experts with --mxfp4).

Weights: norms 1, biases 0, other F32/F16/BF16 tensors N(0, 0.02) as zipmoe-make-tiny draws them; quantized
tensors random blocks whose scales are set so that values spread about as N(0, 0.02) does; --router as
zipmoe-make-tiny's. Layer i takes the shape template's layer min(i, last).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STD = 0.02
# per block type: (block bytes, {byte offset of an f16 scale: its value}); other bytes are random. Scales
# chosen so a block's values have a spread near STD with random quants.
F16_SCALES = {
    "Q4_0": (18, {0: 0.004}), "Q4_1": (20, {0: 0.002, 2: -0.015}), "Q5_0": (22, {0: 0.002}),
    "Q5_1": (24, {0: 0.001, 2: -0.015}), "Q8_0": (34, {0: 3e-4}), "Q2_K": (84, {80: 4e-4, 82: 6e-4}),
    "Q3_K": (110, {108: 2e-4}), "Q4_K": (144, {0: 1e-4, 2: 7.5e-4}), "Q5_K": (176, {0: 5e-5, 2: 7.5e-4}),
    "Q6_K": (210, {208: 2e-5}), "IQ4_NL": (18, {0: 3e-4}), "IQ4_XS": (136, {0: 3e-4}),
}
MXFP4_E8M0 = 120  # 2^-7: FP4 values up to 6 give weights up to 0.047


def converted(tiny_arch: str, out: Path, gguf: Path, **make_tiny_args) -> Path:
    from zipmoe_py.devtools.tiny import make_tiny

    make_tiny(tiny_arch, out, **make_tiny_args)
    convert = Path(sys.executable).parent / "zipmoe-convert"
    subprocess.run([str(convert), str(out), "--bf16", "--quiet", "-o", str(gguf)], check=True)
    return gguf


def type_template_sizes(real: dict, layers: int) -> dict:
    """The real config 256 wide: real layer and expert counts and GQA ratio, every width a K-quant block."""
    heads, kv = real.get("num_attention_heads", 8), real.get("num_key_value_heads") or real.get("num_attention_heads", 8)
    sizes = {"num_hidden_layers": layers, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8,
             "num_key_value_heads": max(1, 8 * kv // heads), "head_dim": 32}
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in real:
            sizes[key] = 256
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "first_k_dense_replace", "layer_types"):
        if key in real:
            sizes[key] = real[key] if key != "layer_types" else (real[key] * layers)[:layers]
    return sizes


def layer_of(name: str) -> tuple[int | None, str]:
    m = re.match(r"blk\.(\d+)\.(.*)", name)
    return (int(m[1]), m[2]) if m else (None, name)


def random_data(t, type_name: str, rng: np.random.Generator, router: str = "random") -> np.ndarray:
    """t's data (a gguf_file.TensorInfo). router "uniform" as zipmoe-make-tiny's: attention output projections
    scaled by UNIFORM_ATTN_OUTPUT_SCALE (a block type's scales may round to zero), routers' rows orthonormal
    with one norm, so that routing is a near-uniform hash of each token."""
    from zipmoe_py.devtools.tiny import UNIFORM_ATTN_OUTPUT_SCALE

    name, n_elements = t.name, t.n_elements
    scale = UNIFORM_ATTN_OUTPUT_SCALE if router == "uniform" and ".attn_output." in name else 1.0
    if type_name in ("F32", "F16", "BF16"):
        if name.endswith("norm.weight"):
            values = np.ones(n_elements, np.float32)
        elif name.endswith(".bias"):
            values = np.zeros(n_elements, np.float32)
        else:
            values = rng.standard_normal(n_elements, np.float32) * np.float32(STD * scale)
            if router == "uniform" and name.endswith("ffn_gate_inp.weight") and t.dims[1] <= t.dims[0]:
                rows = values.reshape(t.dims[1], t.dims[0])
                norm = np.linalg.norm(rows, axis=1).mean()
                values = (np.linalg.qr(rows.T)[0].T * norm).astype(np.float32).ravel()
        if type_name == "F32":
            return values
        if type_name == "F16":
            return values.astype(np.float16)
        return (values.view(np.uint32) >> 16).astype(np.uint16)  # BF16 by truncation
    data = np.frombuffer(bytearray(rng.bytes(t.nbytes())), np.uint8)
    if type_name == "MXFP4":
        data.reshape(-1, 17)[:, 0] = MXFP4_E8M0 + round(np.log2(scale))
        return data
    if type_name not in F16_SCALES:
        raise SystemExit(f"make_random_gguf: {name}: no random blocks for type {type_name} "
                         f"(known: F32, F16, BF16, MXFP4, {', '.join(F16_SCALES)})")
    block, scales = F16_SCALES[type_name]
    blocks = data.reshape(-1, block)
    for offset, value in scales.items():
        blocks[:, offset:offset + 2] = np.frombuffer(np.float16(value * scale).tobytes(), np.uint8)
    return data


def grown(tensors: list, layers: int, shape_layers: int) -> list:
    """The shape template's tensors with layer i taken from its layer min(i, last)."""
    from zipmoe_py import gguf_file as gf

    out = [t for t in tensors if layer_of(t.name)[0] is None]
    for i in range(layers):
        out += [gf.TensorInfo(f"blk.{i}.{rest}", t.dims, t.type, 0) for t in tensors
                for j, rest in [layer_of(t.name)] if j == min(i, shape_layers - 1)]
    return out


def header(kv: list[bytes], tensors: list, alignment: int) -> tuple[bytes, list]:
    """The GGUF header (v3) of these key-value entries and tensors (laid out in order), and the laid-out infos."""
    from zipmoe_py import gguf_file as gf

    infos, offset = [], 0
    for t in tensors:
        info = gf.TensorInfo(t.name, t.dims, t.type, offset)
        gf.expert_row_bytes(info)  # a row is whole blocks of its type
        infos.append(info)
        offset += -(-info.nbytes() // alignment) * alignment
    head = b"GGUF" + np.array([3], "<u4").tobytes() + np.array([len(infos), len(kv)], "<u8").tobytes()
    head += b"".join(kv) + b"".join(gf.pack_tensor_info(t.name, t.dims, t.type, t.offset) for t in infos)
    return head + bytes(-len(head) % alignment), infos


def emit(out: Path, head: bytes, infos: list, alignment: int, data_of) -> None:
    """Write the file through OUT.partial, tensor by tensor (data_of(info) -> bytes-like), with progress."""
    partial = out.with_name(out.name + ".partial")
    total = sum(t.nbytes() for t in infos)
    start, done = time.perf_counter(), 0
    with open(partial, "wb") as f:
        f.write(head)
        for n, t in enumerate(infos):
            data = data_of(t)
            assert len(memoryview(data).cast("B")) == t.nbytes(), t.name
            f.write(data)
            f.write(bytes(-t.nbytes() % alignment))
            done += t.nbytes()
            if n % 32 == 31 or n == len(infos) - 1:
                print(f"\r{done / 1e9:.1f} of {total / 1e9:.1f} GB, {time.perf_counter() - start:.0f} s", end="", flush=True)
    print()
    os.replace(partial, out)


def write_random(out: Path, shape_gguf: Path, type_gguf: Path | None, layers: int, seed: int, router: str) -> None:
    from zipmoe_py import gguf_file as gf

    shapes = gf.read_header(shape_gguf)
    types = gf.read_header(type_gguf) if type_gguf else shapes
    arch = shapes.value("general.architecture")
    shape_layers = shapes.value(f"{arch}.block_count")
    order = types.tensors if type_gguf else grown(shapes.tensors, layers, shape_layers)
    overrides = {f"{arch}.block_count": (gf.T_U32, layers)}
    if type_gguf:
        overrides["general.file_type"] = (gf.T_U32, types.value("general.file_type"))
        overrides["general.quantization_version"] = (gf.T_U32, types.value("general.quantization_version", 2))
    kv = [v.raw for k, v in shapes.kv.items() if k not in overrides]
    kv += [gf.pack_kv(k, vt, v) for k, (vt, v) in overrides.items()]

    tensors = []
    for t in order:
        i, rest = layer_of(t.name)
        source = shapes.by_name.get(t.name if i is None else f"blk.{min(i, shape_layers - 1)}.{rest}")
        if source is None:
            raise SystemExit(f"make_random_gguf: {t.name} of the type template has no tensor in the shape template")
        tensors.append(gf.TensorInfo(t.name, source.dims, t.type, 0))
    head, infos = header(kv, tensors, shapes.alignment)
    rng = np.random.default_rng(seed)
    emit(out, head, infos, shapes.alignment,
         lambda t: random_data(t, gf.ggml_type_name(t.type), rng, router))


def write_thinned(out: Path, source: Path, every: int) -> None:
    """Layers 0, every, 2 x every, ... of source, renumbered: a truncation with the full model's per-layer types
    (llama-quantize's choice depends on a layer's place in the whole model), for bench/limits.py floor."""
    from zipmoe_py import gguf_file as gf
    from zipmoe_py.gguf_source import GGUFSource

    full = gf.read_header(source)
    arch = full.value("general.architecture")
    kept = range(0, full.value(f"{arch}.block_count"), every)
    renamed = {f"blk.{i}.": f"blk.{j}." for j, i in enumerate(kept)}
    tensors, sources = [], {}
    for t in full.tensors:
        i, rest = layer_of(t.name)
        if i is None or i in kept:
            name = t.name if i is None else renamed[f"blk.{i}."] + rest
            tensors.append(gf.TensorInfo(name, t.dims, t.type, 0))
            sources[name] = t
    kv = [v.raw for k, v in full.kv.items() if k != f"{arch}.block_count"]
    kv.append(gf.pack_kv(f"{arch}.block_count", gf.T_U32, len(kept)))
    head, infos = header(kv, tensors, full.alignment)
    with GGUFSource(source) as src:
        emit(out, head, infos, full.alignment, lambda t: src.read(sources[t.name]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arch", help="a zipmoe-make-tiny architecture (qwen3moe, gptoss, ...), or a GGUF to thin (--every)")
    ap.add_argument("-o", "--out", type=Path, required=True, help="GGUF to write")
    ap.add_argument("--layers", type=int, default=None, help="layer count (default: the real model's)")
    ap.add_argument("--type", default=None, help="a llama-quantize file type, e.g. Q4_K_M (default: the converter's types)")
    ap.add_argument("--mxfp4", action="store_true", help="experts in MXFP4, as the published checkpoint stores them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--router", choices=["random", "uniform"], default="random",
                    help="random: weights as drawn; uniform: near-uniform, memoryless routing, as zipmoe-make-tiny "
                         "--router uniform (default: %(default)s)")
    ap.add_argument("--every", type=int, default=None,
                    help="with a GGUF: keep layers 0, EVERY, 2 x EVERY, ... (the floor's truncations)")
    args = ap.parse_args()

    from zipmoe_py import _paths
    from zipmoe_py.devtools.tiny import ARCHITECTURES

    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.arch.endswith(".gguf"):
        if not args.every:
            ap.error("a GGUF to thin needs --every")
        write_thinned(args.out, Path(args.arch), args.every)
        print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")
        return 0
    real = ARCHITECTURES[args.arch][1]
    if "text_config" in real:
        ap.error(f"{args.arch}: a checkpoint with a vision tower; its text model's geometry is another architecture's")
    layers = args.layers or real["num_hidden_layers"]
    with tempfile.TemporaryDirectory(dir=args.out.parent, prefix=".templates-") as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        shape_layers = real.get("first_k_dense_replace", 0) + 1
        shape = converted(args.arch, tmp / "shape", tmp / "shape.gguf", real_widths_layers=shape_layers,
                          mxfp4=args.mxfp4)
        type_gguf = None
        if args.type:
            bf16 = converted(args.arch, tmp / "types", tmp / "types-bf16.gguf",
                             sizes=type_template_sizes(real, layers), mxfp4=args.mxfp4)
            type_gguf = tmp / "types.gguf"
            quantize = subprocess.run([str(_paths.program("llama-quantize")), str(bf16), str(type_gguf), args.type],
                                      capture_output=True, text=True)
            if quantize.returncode:
                raise SystemExit(f"make_random_gguf: llama-quantize {args.type} failed:\n{quantize.stderr[-2000:]}")
        print(f"templates in {time.perf_counter() - t:.0f} s", flush=True)
        write_random(args.out, shape, type_gguf, layers, args.seed, args.router)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
