#!/usr/bin/env python3
"""Writes the fuzz harness's seed corpus: small valid inputs of each target, from which the fuzzer
mutates. Made afresh by tests/test_fuzz.py for each run (deterministic: fixed seeds), so no binary
file is committed; by hand:

    .venv/bin/python tests/fuzz/make_corpus.py OUT_DIR

file_*.bin: byte 0 (the parser target) + a ZipMoE GGUF of one MoE layer of 2 experts of 16 x 8
values, one per codec and shard count; dec_*.bin: the decoder target byte, the decoded size
(3 bytes LE) and one exponent plane compressed by that codec; regression-*.bin: every past finding,
from its hex text in regressions/.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

from zipmoe_py import _paths, codec
from zipmoe_py import format as zformat

def tiny_moe_gguf(path: Path, seed: int) -> None:
    gguf = _paths.import_gguf()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    w.add_block_count(1)
    for kind in ("gate", "up", "down"):
        values = (rng.normal(0, 0.02, size=(2, 8, 16)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        w.add_tensor(f"blk.0.ffn_{kind}_exps.weight", values, raw_shape=values.shape,
                     raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_corpus(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src.gguf"
        tiny_moe_gguf(src, 0)
        for name, shards in (("fhuf", 2), ("zstd", 1), ("raw", 3), ("huf", 2), ("lz4", 1)):
            packed = Path(tmp) / f"{name}.gguf"
            zformat.repack(src, packed, codec=name, shards=shards)
            (out / f"file_{name}_k{shards}.bin").write_bytes(b"\x00" + packed.read_bytes())
    rng = np.random.default_rng(1)
    plane = np.clip(rng.normal(120, 2, 3000), 0, 255).astype(np.uint8).tobytes()
    for name, cid in codec.CODECS.items():
        stored = codec.compress(plane, name)
        header = bytes([1 + 2 * cid]) + len(plane).to_bytes(3, "little")
        (out / f"dec_{name}.bin").write_bytes(header + stored)
    for found in sorted((Path(__file__).parent / "regressions").glob("*.hex")):
        (out / f"regression-{found.stem}.bin").write_bytes(bytes.fromhex("".join(found.read_text().split())))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_corpus.py OUT_DIR")
    write_corpus(Path(sys.argv[1]))
    print(f"wrote {len(list(Path(sys.argv[1]).iterdir()))} inputs to {sys.argv[1]}")
