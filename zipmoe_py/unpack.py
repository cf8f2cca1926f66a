"""The way back: a ZipMoE GGUF -> the plain GGUF it was made from.

Every tensor gets its source's name, type, shape and bytes: repacked BF16 experts decoded and recovered by
the C reader (every chunk's checksum checked), raw ones copied, every other tensor copied. Every metadata
key-value of the source is copied byte for byte, in its order; ZipMoE's keys and its `general.alignment`
are left out, so tensors are laid out at GGUF's default alignment (32), as llama.cpp's converter and
llama-quantize write them. A source without its own `general.alignment` (the usual case) comes back byte
for byte. The output appears complete or not at all.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from . import format as zformat
from . import gguf_file as gf
from .errors import ZipMoEError

PLAIN_ALIGNMENT = gf.DEFAULT_ALIGNMENT


def _align(x: int) -> int:
    return (x + PLAIN_ALIGNMENT - 1) // PLAIN_ALIGNMENT * PLAIN_ALIGNMENT


def _source_tensors(zf: zformat.ZipMoEFile) -> list[tuple[str, list[int], int, int, str | None]]:
    """(name, dims, type, nbytes, expert tensor or None) of the source's tensors, in file order."""
    by_blob = {zformat.blob_name(t): t for t in zf.tensors}
    out = []
    for t in zf.header.tensors:
        expert = by_blob.get(t.name)
        if expert is None:
            out.append((t.name, t.dims, t.type, t.nbytes(), None))
            continue
        dims, ggml_type = zf.shape(expert), zf.type(expert)
        nbytes = gf.TensorInfo(expert, dims, ggml_type, 0).nbytes()
        out.append((expert, dims, ggml_type, nbytes, expert))
    return out


def _header_bytes(header: gf.Header, tensors: list) -> bytes:
    kvs = [kv.raw for key, kv in header.kv.items() if not key.startswith("zipmoe.") and key != "general.alignment"]
    infos, offset = [], 0
    for name, dims, ggml_type, nbytes, _ in tensors:
        infos.append(gf.pack_tensor_info(name, dims, ggml_type, offset))
        offset = _align(offset + nbytes)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return head + b"\0" * (_align(len(head)) - len(head))


def unpack(src: str | Path, dst: str | Path, progress=None) -> Path:
    """Write the plain GGUF the ZipMoE GGUF src was made from to dst; progress, if given, is called with the
    bytes written so far."""
    src, dst = Path(src), Path(dst)
    partial = dst.with_name(dst.name + ".partial")
    with zformat.ZipMoEFile(src) as zf:
        header = zf.header
        tensors = _source_tensors(zf)
        try:
            with open(src, "rb") as fin, mmap.mmap(fin.fileno(), 0, access=mmap.ACCESS_READ) as smap, \
                    open(partial, "wb") as out:
                out.write(_header_bytes(header, tensors))
                base, done = out.tell(), 0
                for (name, dims, _, nbytes, expert), t in zip(tensors, header.tensors):
                    out.write(b"\0" * (_align(out.tell() - base) - (out.tell() - base)))
                    start = out.tell()
                    if expert is None:
                        begin = header.data_offset + t.offset
                        out.write(smap[begin:begin + nbytes])
                    else:
                        for e in range(dims[2]):
                            out.write(zf.read_expert(expert, e).tobytes())
                    if out.tell() - start != nbytes:
                        raise ZipMoEError(f"{src}: tensor {name} came out at another size than its shape gives")
                    done += nbytes
                    if progress:
                        progress(done)
                out.write(b"\0" * (_align(out.tell() - base) - (out.tell() - base)))
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, dst)
        finally:
            if partial.exists():
                partial.unlink()
    return dst


def is_zipmoe(path: str | Path) -> bool:
    return "zipmoe.format_version" in gf.read_header(path).kv
