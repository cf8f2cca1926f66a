"""The ZipMoE GGUF format (docs/FORMAT.md): repack a BF16 GGUF, read chunks back, verify.

Repacking streams tensor by tensor through a fixed-size header: every value in the
header has a fixed width, so a placeholder header is written first and rewritten in
place once the chunk index is known. Memory stays bounded by a few experts per thread.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _lib
from . import codec as _codec
from . import families
from . import gguf_file as gf
from .errors import ZipMoEError
from .gguf_source import GGUFSource

FORMAT_VERSION = 1  # what files without codec ghuf are written as, so that older readers keep reading them
GHUF_FORMAT_VERSION = 2  # version 2 adds codec ghuf (docs/FORMAT.md)
RAW_FORMAT_VERSION = 3  # version 3 adds raw experts of any other ggml type (quantized, F16, F32)
CHUNK_ALIGNMENT = 4096
# a routed expert's tensors, in ggml-zipmoe's kind order (slot_data[k], layer_tensors[3 * layer + k])
EXPERT_KINDS = ("gate", "up", "down")
EXPERT_TENSOR = re.compile(rf"^blk\.(\d+)\.ffn_({'|'.join(EXPERT_KINDS)})_exps\.weight$")
BF16_BYTES = 2  # bytes of one BF16 value
DEFAULT_CODEC, DEFAULT_SHARDS = "fhuf", 5
CHECKSUM = "xxh64"


def blob_name(tensor_name: str) -> str:
    return tensor_name[: -len(".weight")] + ".zipmoe"


def _key(tensor: str, what: str) -> str:
    return f"zipmoe.tensor.{tensor}.{what}"


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    return [(k * n // shards, (k + 1) * n // shards) for k in range(shards)]


def _align(x: int, a: int = CHUNK_ALIGNMENT) -> int:
    return (x + a - 1) // a * a


@dataclass
class TensorStats:
    name: str
    layer: int
    bf16_bytes: int = 0  # its experts' bytes as served (BF16; a raw tensor's own type)
    stored_bytes: int = 0
    exp_histogram: np.ndarray = field(default_factory=lambda: np.zeros(256, np.int64))
    raw: bool = False  # stored raw (not BF16): no exponents


@dataclass
class RepackResult:
    path: Path
    tensors: list[TensorStats]

    def per_layer(self) -> list[dict]:
        """Exponent entropy H, achieved ratio and the bound (8 + H) / 16, per layer (its BF16 tensors)."""
        rows = {}
        for t in self.tensors:
            if t.raw:
                continue
            row = rows.setdefault(t.layer, {"layer": t.layer, "bf16": 0, "stored": 0, "hist": np.zeros(256, np.int64)})
            row["bf16"] += t.bf16_bytes
            row["stored"] += t.stored_bytes
            row["hist"] += t.exp_histogram
        out = []
        for layer in sorted(rows):
            r = rows[layer]
            p = r["hist"][r["hist"] > 0] / r["hist"].sum()
            h = float(-(p * np.log2(p)).sum())
            out.append({"layer": layer, "exp_entropy_bits": h, "ratio": r["stored"] / r["bf16"],
                        "bound": (8 + h) / 16})
        return out


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round F32 to BF16 bit patterns as llama.cpp and its converter do: nearest even, NaNs kept quiet."""
    u = np.ascontiguousarray(values, np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u.astype(np.uint64) + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


def _raw_expert(data: bytes, shards: int):
    """A raw expert's chunks: its bytes as chunk 0 (the SM-chunk's place), then K empty E-chunks."""
    raw = _codec.CODECS["raw"]
    return [(data, raw)] + [(b"", raw)] * shards, np.zeros(256, np.int64)


def _compress_expert(values: np.ndarray, codec: str, level: int | None, shards: int):
    """One expert's chunks: [(bytes, codec id)], SM first; plus its exponent histogram."""
    if values.dtype == np.float32:
        values = f32_to_bf16(values)
    exp, sm = _codec.split_bf16(values)
    chunks = [(sm.tobytes(), _codec.CODECS["raw"])]
    for lo, hi in shard_bounds(exp.size, shards):
        blob = _codec.compress(exp[lo:hi], codec, level)
        if len(blob) >= hi - lo:  # the codec would not shrink it: store raw
            chunks.append((exp[lo:hi].tobytes(), _codec.CODECS["raw"]))
        else:
            chunks.append((blob, _codec.CODECS[codec]))
    return chunks, np.bincount(exp, minlength=256)


def _source_experts(src: Path, header) -> list:
    """The routed-expert tensors of src, checked: a GGUF not yet ZipMoE, 3-D experts of a type ggml knows."""
    if "zipmoe.format_version" in header.kv:
        raise ZipMoEError(f"{src} is already a ZipMoE GGUF")
    experts = [t for t in header.tensors if EXPERT_TENSOR.match(t.name)]
    if not experts:
        raise ZipMoEError(f"{src} has no routed-expert tensors (blk.N.ffn_{{gate,up,down}}_exps.weight)")
    unserved = families.unserved_tensors(t.name for t in header.tensors)
    if unserved:
        raise ZipMoEError(f"{src}: {families.unserved_message(unserved)}; nothing was written")
    for t in experts:
        if len(t.dims) != 3:
            raise ZipMoEError(f"{src}: expert tensor {t.name} has shape {t.dims}, expected [n_embd, n_ff, n_expert]")
        gf.expert_row_bytes(t)  # a type ggml knows, whole blocks per row
    return experts


@dataclass
class _RepackLayout:
    """The output's header: the source's metadata and ZipMoE's, each expert tensor's served type and chunk
    index, then the tensor infos. Every number has a fixed width, so a header of placeholder offsets has the
    final one's length."""
    header: object  # gguf_file's header of the source
    experts: list
    codec: str
    level: int | None
    shards: int
    f32_to_bf16_experts: bool

    def __post_init__(self):
        # the type each expert tensor is served as: BF16 (split, F32 too when asked to round), or its own (raw)
        self.served = {t.name: gf.GGML_TYPE_BF16 if t.type == gf.GGML_TYPE_BF16 or
                       (t.type == gf.GGML_TYPE_F32 and self.f32_to_bf16_experts) else t.type for t in self.experts}
        self.raw_tensors = {name for name, typ in self.served.items() if typ != gf.GGML_TYPE_BF16}
        self.version = RAW_FORMAT_VERSION if self.raw_tensors else \
            GHUF_FORMAT_VERSION if self.codec == "ghuf" else FORMAT_VERSION
        self.expert_names = {t.name for t in self.experts}
        self.n_chunks = {t.name: t.dims[2] * (1 + self.shards) for t in self.experts}

    def kv_bytes(self, index: dict) -> bytes:
        header, codec = self.header, self.codec
        out = [kv.raw for key, kv in header.kv.items() if key != "general.alignment"]
        out.append(gf.pack_kv("general.alignment", gf.T_U32, CHUNK_ALIGNMENT))
        out.append(gf.pack_kv("zipmoe.format_version", gf.T_U32, self.version))
        out.append(gf.pack_kv("zipmoe.shards", gf.T_U32, self.shards))
        out.append(gf.pack_kv("zipmoe.codec", gf.T_STRING, codec))
        out.append(gf.pack_kv("zipmoe.codec_level", gf.T_I32,
                              _codec.DEFAULT_LEVELS[codec] if self.level is None else self.level))
        out.append(gf.pack_kv("zipmoe.checksum", gf.T_STRING, CHECKSUM))
        out.append(gf.pack_kv("zipmoe.chunk_alignment", gf.T_U32, CHUNK_ALIGNMENT))
        out.append(gf.pack_kv("zipmoe.tensors", gf.T_ARRAY, [t.name for t in self.experts], gf.T_STRING))
        for t in self.experts:
            offsets, sizes, codecs, sums = index.get(t.name) or ([0] * self.n_chunks[t.name],) * 4
            out.append(gf.pack_kv(_key(t.name, "type"), gf.T_U32, self.served[t.name]))
            out.append(gf.pack_kv(_key(t.name, "shape"), gf.T_ARRAY, t.dims, gf.T_U64))
            out.append(gf.pack_kv(_key(t.name, "chunk_offset"), gf.T_ARRAY, offsets, gf.T_U64))
            out.append(gf.pack_kv(_key(t.name, "chunk_size"), gf.T_ARRAY, sizes, gf.T_U64))
            out.append(gf.pack_kv(_key(t.name, "chunk_codec"), gf.T_ARRAY, codecs, gf.T_U8))
            out.append(gf.pack_kv(_key(t.name, "chunk_checksum"), gf.T_ARRAY, sums, gf.T_U64))
        return b"".join(out)

    def header_bytes(self, index: dict, infos: list[tuple[str, list[int], int, int]]) -> bytes:
        header = self.header
        n_kv = len(header.kv) - ("general.alignment" in header.kv) + 8 + 6 * len(self.experts)
        head = b"GGUF" + struct.pack("<IQQ", 3, len(infos), n_kv) + self.kv_bytes(index)
        head += b"".join(gf.pack_tensor_info(*info) for info in infos)
        return head + b"\0" * (_align(len(head)) - len(head))

    def header_length(self) -> int:
        """The header's length, from placeholder infos"""
        placeholder = [(blob_name(t.name), [0], gf.GGML_TYPE_I8, 0) if t.name in self.expert_names
                       else (t.name, t.dims, t.type, 0) for t in self.header.tensors]
        return len(self.header_bytes({}, placeholder))


def _pad(out, base: int) -> int:
    """out padded to CHUNK_ALIGNMENT from base; its position from base"""
    rel = out.tell() - base
    if rel % CHUNK_ALIGNMENT:
        out.write(b"\0" * (CHUNK_ALIGNMENT - rel % CHUNK_ALIGNMENT))
        rel = out.tell() - base
    return rel


def _copy_tensor(source: GGUFSource, out, t) -> None:
    """A tensor that is not a routed expert, copied as it is, 64 MiB at a time"""
    nbytes = t.nbytes()
    for off in range(0, nbytes, 64 << 20):
        out.write(source.read(t, off, min(nbytes - off, 64 << 20)))


def _write_expert_tensor(t, layout: _RepackLayout, source: GGUFSource, out, pool, on_expert) -> tuple:
    """Expert tensor t's chunks (decoded by pool's threads, written in order, each aligned in its chunk
    tensor); on_expert(source bytes) after each expert. Returns its TensorStats, its chunk index
    (offsets, sizes, codecs, checksums) and the chunk tensor's size."""
    n = t.dims[0] * t.dims[1]
    layer = int(EXPERT_TENSOR.match(t.name).group(1))
    raw = t.name in layout.raw_tensors
    one = gf.expert_row_bytes(t) * t.dims[1]  # one expert's bytes in the source
    st = TensorStats(t.name, layer, bf16_bytes=(one if raw else BF16_BYTES * n) * t.dims[2], raw=raw)
    offsets, sizes, codecs, sums = [], [], [], []
    dtype = np.float32 if t.type == gf.GGML_TYPE_F32 else np.uint16

    def expert(e):
        # a copy, not a view: no view may outlive the mmap, even when an error unwinds
        data = source.read(t, e * one, one)
        if raw:
            return _raw_expert(data, layout.shards)
        return _compress_expert(np.frombuffer(data, dtype), layout.codec, layout.level, layout.shards)

    blob_start = out.tell()
    # map() keeps results in order; the window of experts in flight stays near the pool's workers
    for chunks, hist in pool.map(expert, range(t.dims[2])):
        st.exp_histogram += hist
        for blob, cid in chunks:
            rel = _pad(out, blob_start)
            out.write(blob)
            offsets.append(rel)
            sizes.append(len(blob))
            codecs.append(cid)
            sums.append(_codec.checksum(blob))
        on_expert(one)
    st.stored_bytes = sum(sizes)
    return st, (offsets, sizes, codecs, sums), out.tell() - blob_start


def _write_repacked(source: GGUFSource, layout: _RepackLayout, partial: Path, workers: int,
                    progress) -> list[TensorStats]:
    """The ZipMoE GGUF written to partial: a placeholder header, every tensor (experts repacked by workers
    threads), then the header with the chunk index."""
    stats: list[TensorStats] = []
    index: dict[str, tuple[list, list, list, list]] = {}
    infos = []
    done = 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress:
            progress(done)

    head_len = layout.header_length()
    with open(partial, "wb") as out, concurrent.futures.ThreadPoolExecutor(workers) as pool:
        out.write(b"\0" * head_len)
        for t in source.header.tensors:
            pos = _pad(out, head_len)
            if t.name not in layout.expert_names:
                _copy_tensor(source, out, t)
                infos.append((t.name, t.dims, t.type, pos))
                advance(t.nbytes())
                continue
            st, index[t.name], blob_size = _write_expert_tensor(t, layout, source, out, pool, advance)
            infos.append((blob_name(t.name), [blob_size], gf.GGML_TYPE_I8, pos))
            stats.append(st)
        head = layout.header_bytes(index, infos)
        assert len(head) == head_len, "ZipMoE header length changed between placeholder and final"
        out.seek(0)
        out.write(head)
        out.flush()
        os.fsync(out.fileno())
    return stats


def repack(src: str | Path, dst: str | Path, codec: str = DEFAULT_CODEC, level: int | None = None,
           shards: int = DEFAULT_SHARDS, threads: int | None = None, progress=None,
           f32_to_bf16_experts: bool = False) -> RepackResult:
    """Write the ZipMoE GGUF of the GGUF src to dst (atomically: dst appears complete or not at all).

    BF16 routed experts are split (exponents compressed); experts of any other type (quantized, F16,
    F32) are stored raw, as they are. progress, if given, is called with the number of source bytes
    done after each step. f32_to_bf16_experts rounds F32 routed experts to BF16 instead (lossy, so
    never implicit).
    """
    src, dst = Path(src), Path(dst)
    _codec.codec_id(codec)
    if not 1 <= shards <= 64:
        raise ZipMoEError(f"--shards must be between 1 and 64, got {shards}")

    partial = dst.with_name(dst.name + ".partial")
    with GGUFSource(src) as source:  # checked before anything is written
        layout = _RepackLayout(source.header, _source_experts(src, source.header), codec, level, shards,
                               f32_to_bf16_experts)
        try:
            stats = _write_repacked(source, layout, partial, threads or os.cpu_count() or 1, progress)
            # the output path only ever holds a complete file that reads back: every chunk checked and decoded
            verify(partial)
            os.replace(partial, dst)
        finally:
            if partial.exists():
                partial.unlink()
    return RepackResult(dst, stats)


# ---- reading (ggml-zipmoe's C reader: the same code the runtime uses) ----

@dataclass(frozen=True)
class ExpertBytes:
    """Sizes of the routed experts of a ZipMoE GGUF as served (BF16, or a raw tensor's own type), from
    their shapes and types. One expert's are a slot's: by kind, the largest over the MoE layers (the
    runtime's slots are shared by all layers; a quantized file may use another type in some layers)."""

    by_kind: dict[str, int]  # one expert's tensor of each kind (gate, up, down)
    one_expert: int          # one expert: gate + up + down
    all_experts: int         # every routed expert of every MoE layer
    sm_chunks: int = 0       # one expert's SM-chunks, stored raw (a raw tensor's: its bytes), by kind the largest


@dataclass
class ChunkRef:
    tensor: str
    layer: int
    expert: int
    shard: int | None  # None for the SM-chunk
    offset: int        # absolute file offset
    size: int
    codec: int
    checksum: int
    decoded_size: int

    def describe(self) -> str:
        what = "SM-chunk" if self.shard is None else f"E-chunk (shard {self.shard})"
        return f"layer {self.layer}, tensor {self.tensor}, expert {self.expert}, {what}"


class ZipMoEFile:
    """A ZipMoE GGUF opened with ggml-zipmoe: its validated chunk index, chunk and expert reads."""

    def __init__(self, path: str | Path, direct_io: bool = False):
        self.path = Path(path)
        self._handle = self._reader = None
        self._lib = _lib.lib()
        err = ctypes.create_string_buffer(1024)
        self._handle = self._lib.ggml_zipmoe_file_open(os.fsencode(self.path), _lib.OPEN_DIRECT if direct_io else 0,
                                                       err, len(err))
        if not self._handle:
            raise ZipMoEError(err.value.decode(errors="replace"))
        self.shards = self._lib.ggml_zipmoe_file_n_shards(self._handle)
        self.tensors: list[str] = [self._lib.ggml_zipmoe_file_tensor_name(self._handle, i).decode()
                                   for i in range(self._lib.ggml_zipmoe_file_n_tensors(self._handle))]
        self._index = {name: i for i, name in enumerate(self.tensors)}
        self._header = None
        self._moe_layers: dict[int, tuple[int, int, int]] | None = None

    @property
    def header(self) -> gf.Header:
        """The full GGUF header (all metadata and tensor infos), parsed on first use."""
        if self._header is None:
            self._header = gf.read_header(self.path)
        return self._header

    def close(self):
        if self._reader:
            self._lib.ggml_zipmoe_reader_free(self._reader)
            self._reader = None
        if self._handle:
            self._lib.ggml_zipmoe_file_close(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def _tensor_index(self, tensor: str) -> int:
        if self._handle is None:
            raise ZipMoEError(f"{self.path} is closed")
        try:
            return self._index[tensor]
        except KeyError:
            raise ZipMoEError(f"{self.path}: tensor {tensor} is not in the ZipMoE index") from None

    def shape(self, tensor: str) -> list[int]:
        ne = (ctypes.c_int64 * 3)()
        self._lib.ggml_zipmoe_file_tensor_shape(self._handle, self._tensor_index(tensor), ne)
        return list(ne)

    def moe_layers(self) -> dict[int, tuple[int, int, int]]:
        """{layer: (gate, up, down)}: the indexes in self.tensors (ggml-zipmoe's repacked tensor
        indexes) of each MoE layer's routed-expert tensors blk.{layer}.ffn_{kind}_exps.weight, by layer."""
        if self._moe_layers is None:
            kinds: dict[int, dict[str, int]] = {}
            for index, name in enumerate(self.tensors):
                match = EXPERT_TENSOR.match(name)
                if match is None:
                    raise ZipMoEError(f"{self.path}: tensor {name} in the ZipMoE index is not a routed-expert tensor "
                                      "blk.N.ffn_{gate,up,down}_exps.weight")
                kinds.setdefault(int(match.group(1)), {})[match.group(2)] = index
            for layer, found in kinds.items():
                missing = [kind for kind in EXPERT_KINDS if kind not in found]
                if missing:
                    raise ZipMoEError(f"{self.path}: MoE layer {layer} has no tensor "
                                      f"blk.{layer}.ffn_{missing[0]}_exps.weight")
            self._moe_layers = {layer: tuple(kinds[layer][kind] for kind in EXPERT_KINDS) for layer in sorted(kinds)}
        return dict(self._moe_layers)

    def type(self, tensor: str) -> int:
        """The ggml type the tensor is served as: BF16 (split) or its own (stored raw)."""
        return self._lib.ggml_zipmoe_file_tensor_type(self._handle, self._tensor_index(tensor))

    def is_raw(self, tensor: str) -> bool:
        return self.type(tensor) != gf.GGML_TYPE_BF16

    def tensor_expert_bytes(self, tensor: str) -> int:
        """One expert of the tensor in its served type."""
        return self._lib.ggml_zipmoe_file_tensor_expert_bytes(self._handle, self._tensor_index(tensor))

    def expert_bytes(self) -> ExpertBytes:
        """Bytes of one routed expert as served (by kind and in all: a slot's) and of every routed expert."""
        layers = self.moe_layers()
        if not layers:
            raise ZipMoEError(f"{self.path}: the ZipMoE index holds no routed-expert tensor")
        sizes = [self._lib.ggml_zipmoe_file_tensor_expert_bytes(self._handle, i) for i in range(len(self.tensors))]
        sm = [size if self.is_raw(name) else size // BF16_BYTES for name, size in zip(self.tensors, sizes)]
        by_kind = {kind: max(sizes[tensors[k]] for tensors in layers.values()) for k, kind in enumerate(EXPERT_KINDS)}
        sm_chunks = sum(max(sm[tensors[k]] for tensors in layers.values()) for k in range(len(EXPERT_KINDS)))
        return ExpertBytes(by_kind=by_kind, one_expert=sum(by_kind.values()), sm_chunks=sm_chunks,
                           all_experts=sum(size * self.shape(name)[2] for name, size in zip(self.tensors, sizes)))

    def chunks(self, tensor: str, expert: int) -> list[ChunkRef]:
        t = self._tensor_index(tensor)
        layer = self._lib.ggml_zipmoe_file_tensor_layer(self._handle, t)
        refs = []
        for c in range(1 + self.shards):
            info = _lib.ChunkInfo()
            if self._lib.ggml_zipmoe_file_chunk(self._handle, t, expert, c, ctypes.byref(info)) != _lib.OK:
                raise ZipMoEError(f"{self.path}: tensor {tensor} has no expert {expert}")
            refs.append(ChunkRef(tensor, layer, expert, None if info.shard < 0 else info.shard, info.offset,
                                 info.size, info.codec, info.checksum, info.count))
        return refs

    def read_at(self, offset: int, size: int) -> bytes:
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), size, offset)

    def read_expert(self, tensor: str, expert: int) -> np.ndarray:
        """The expert's BF16 bit patterns (uint16, flat), or a raw tensor's expert bytes (uint8): every
        chunk checked, decoded and recovered in C."""
        t = self._tensor_index(tensor)
        shape = self.shape(tensor)
        if not 0 <= expert < shape[2]:
            raise ZipMoEError(f"{self.path}: tensor {tensor} has no expert {expert}")
        if self._reader is None:
            self._reader = self._lib.ggml_zipmoe_reader_new(self._handle)
            if not self._reader:
                raise ZipMoEError(f"{self.path}: out of memory for a reader")
        if self.is_raw(tensor):
            out = np.empty(self.tensor_expert_bytes(tensor), np.uint8)
        else:
            out = np.empty(shape[0] * shape[1], np.uint16)
        status = self._lib.ggml_zipmoe_read_expert(self._reader, t, expert, out.ctypes.data)
        if status != _lib.OK:
            raise ZipMoEError(f"{self.path}: {self._lib.ggml_zipmoe_reader_error(self._reader).decode()}")
        return out


def verify(path: str | Path, against: str | Path | None = None, progress=None) -> dict:
    """Decode every expert (checksums checked); with `against`, compare all tensors bit for bit.

    Raises ZipMoEError naming the first corrupt chunk or differing tensor; returns counts.
    """
    counts = {"tensors": 0, "experts": 0, "chunks": 0, "other_tensors": 0}
    with ZipMoEFile(path) as zf:
        unserved = families.unserved_tensors(t.name for t in zf.header.tensors)
        if unserved:
            raise ZipMoEError(f"{path}: {families.unserved_message(unserved)}; no program loads this file")
        ref = GGUFSource(against) if against else None
        ref_header = ref.header if ref else None
        try:
            done = 0
            for tensor in zf.tensors:
                shape = zf.shape(tensor)
                served = zf.type(tensor)
                ref_t = None
                if ref_header is not None:
                    ref_t = ref_header.by_name.get(tensor)
                    # the source's type, or F32 that was rounded to BF16 at repacking
                    if ref_t is None or ref_t.dims != shape or not (ref_t.type == served or (
                            served == gf.GGML_TYPE_BF16 and ref_t.type == gf.GGML_TYPE_F32)):
                        raise ZipMoEError(f"{against} has no {gf.ggml_type_name(served)} tensor {tensor} of shape "
                                          f"{shape}")
                    one = gf.expert_row_bytes(ref_t) * shape[1]  # one expert's bytes in the source
                for e in range(shape[2]):
                    values = zf.read_expert(tensor, e)
                    expected = None
                    if ref_t is not None:
                        expected = np.frombuffer(ref.read(ref_t, e * one, one), values.dtype
                                                 if ref_t.type == served else np.float32)  # a copy, not a view
                        if ref_t.type != served:
                            expected = f32_to_bf16(expected)  # an F32 source was rounded at repacking
                    if expected is not None and not np.array_equal(values, expected):
                        raise ZipMoEError(f"{path}: layer {EXPERT_TENSOR.match(tensor).group(1)}, tensor {tensor}, "
                                          f"expert {e} differs from {against}")
                    counts["experts"] += 1
                    counts["chunks"] += 1 + zf.shards
                    done += values.nbytes
                    if progress:
                        progress(done)
                counts["tensors"] += 1
            if ref_header is not None:
                names = set(zf.tensors)
                for t in ref_header.tensors:
                    if t.name in names:
                        continue
                    mine = zf.header.by_name.get(t.name)
                    if mine is None or mine.dims != t.dims or mine.type != t.type:
                        raise ZipMoEError(f"{path}: tensor {t.name} is missing or has another shape/type than in {against}")
                    a = ref.read(t)
                    if zf.read_at(zf.header.data_offset + mine.offset, len(a)) != a:
                        raise ZipMoEError(f"{path}: tensor {t.name} differs from {against}")
                    counts["other_tensors"] += 1
        finally:
            if ref is not None:
                ref.close()
    return counts
