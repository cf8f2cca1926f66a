"""BF16 plane split/recovery and exponent codecs, over ggml-zipmoe (numpy in, numpy out)."""
from __future__ import annotations

import ctypes

import numpy as np

from . import _lib
from .errors import ZipMoEError

CODECS = {"raw": _lib.CODEC_RAW, "zstd": _lib.CODEC_ZSTD, "lz4": _lib.CODEC_LZ4,
          "lz4hc": _lib.CODEC_LZ4HC, "huf": _lib.CODEC_HUF, "fhuf": _lib.CODEC_FHUF,
          "ghuf": _lib.CODEC_GHUF}
DEFAULT_LEVELS = {"raw": 0, "zstd": 1, "lz4": 1, "lz4hc": 9, "huf": 0, "fhuf": 0, "ghuf": 0}


class CodecError(ZipMoEError):
    """A codec call failed; `status` is the ggml-zipmoe status code."""

    def __init__(self, what: str, status: int):
        super().__init__(f"{what}: {_lib.status_string(status)}")
        self.status = status


def _ptr(array: np.ndarray, ctype):
    return array.ctypes.data_as(ctypes.POINTER(ctype))


def _byte_view(data) -> np.ndarray:
    """The bytes of `data` (bytes-like or array) as a flat uint8 array, without copying when possible."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, np.uint8)
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def codec_id(name: str) -> int:
    try:
        return CODECS[name]
    except KeyError:
        raise ZipMoEError(f"unknown codec {name!r}; choose one of {', '.join(CODECS)}") from None


def split_bf16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BF16 bit patterns (uint16, any shape) -> (exponent bytes, sign+mantissa bytes), flat."""
    flat = np.ascontiguousarray(values, dtype=np.uint16).reshape(-1)
    exp = np.empty(flat.size, np.uint8)
    sm = np.empty(flat.size, np.uint8)
    _lib.lib().ggml_zipmoe_split_bf16(_ptr(flat, ctypes.c_uint16), flat.size, _ptr(exp, ctypes.c_uint8),
                                      _ptr(sm, ctypes.c_uint8))
    return exp, sm


def recover_bf16(exp: np.ndarray, sm: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(exponent bytes, sign+mantissa bytes) -> BF16 bit patterns (uint16), flat; into `out` if given.
    Test-only in Python (the runtime recovers in C, inside ExpertDecode's routine)."""
    exp = np.ascontiguousarray(exp, dtype=np.uint8).reshape(-1)
    sm = np.ascontiguousarray(sm, dtype=np.uint8).reshape(-1)
    if exp.size != sm.size:
        raise ZipMoEError(f"plane sizes differ: {exp.size} exponent bytes, {sm.size} sign+mantissa bytes")
    if out is None:
        out = np.empty(exp.size, np.uint16)
    elif out.dtype != np.uint16 or out.size != exp.size or not out.flags.c_contiguous:
        raise ZipMoEError(f"recovery output must be {exp.size} contiguous uint16 values")
    _lib.lib().ggml_zipmoe_recover_bf16(_ptr(exp, ctypes.c_uint8), _ptr(sm, ctypes.c_uint8), exp.size,
                                        _ptr(out, ctypes.c_uint16))
    return out


def recover_impl() -> str:
    return _lib.lib().ggml_zipmoe_recover_impl().decode()


def recover_paths() -> list[str]:
    """The BF16 recovery paths compiled in, best first ("avx512bw", "avx2", "scalar" on x86-64; "sve",
    "neon", "scalar" on AArch64), whether or not this CPU has them."""
    return _lib.lib().ggml_zipmoe_recover_paths().decode().split()


def supported_recover_paths() -> list[str]:
    """The compiled-in recovery paths this CPU runs, best first (scalar always last). Test-only: it
    forces each in turn (set_recover_impl) and restores the best."""
    names = [name for name in recover_paths() if _lib.lib().ggml_zipmoe_set_recover_impl(name.encode()) == _lib.OK]
    _lib.lib().ggml_zipmoe_set_recover_impl(None)
    return names


def set_recover_impl(name: str | None) -> None:
    """Test-only: force the process's BF16 recovery path (one of recover_paths(), or "cuda-grid": the CUDA
    kernel's index arithmetic on the host; None: the best available) so that tests and benchmarks compare
    them; CodecError where the CPU lacks it."""
    status = _lib.lib().ggml_zipmoe_set_recover_impl(None if name is None else name.encode())
    if status != _lib.OK:
        raise CodecError(f"recovery path {name!r} is not available on this CPU", status)


def checksum(data: bytes | np.ndarray) -> int:
    """XXH64 (seed 0) of the bytes, as recorded per chunk in a ZipMoE GGUF."""
    src = _byte_view(data)
    return _lib.lib().ggml_zipmoe_checksum(src.ctypes.data, src.size)


def compress(data: bytes | np.ndarray, codec: str, level: int | None = None) -> bytes:
    cid = codec_id(codec)
    src = _byte_view(data)
    level = DEFAULT_LEVELS[codec] if level is None else level
    bound = _lib.lib().ggml_zipmoe_compress_bound(cid, src.size)
    dst = np.empty(max(bound, 1), np.uint8)
    size = _lib.lib().ggml_zipmoe_compress(cid, level, src.ctypes.data, src.size, dst.ctypes.data, dst.size)
    if size < 0:
        raise CodecError(f"{codec} (level {level}) compression of {src.size} bytes", size)
    return dst[:size].tobytes()


def ghuf_decode_as_gpu(data: bytes, size: int) -> np.ndarray:
    """Test-only: a ghuf stream decoded the GPU's way on the host (ggml_zipmoe_ghuf_decode_as_gpu)."""
    src = np.frombuffer(data, np.uint8)
    out = np.empty(size, np.uint8)
    status = _lib.lib().ggml_zipmoe_ghuf_decode_as_gpu(src.ctypes.data, src.size, out.ctypes.data, size)
    if status != _lib.OK:
        raise CodecError(f"ghuf decoding (the GPU's way) of {src.size} bytes into {size}", status)
    return out


class Decoder:
    """A reusable decoder context (one per thread)."""

    def __init__(self):
        self._lib = _lib.lib()
        self._handle = self._lib.ggml_zipmoe_decoder_new()
        if not self._handle:
            raise CodecError("creating a decoder", _lib.ERR_NOMEM)

    def decompress(self, data: bytes, codec: str, size: int, out: np.ndarray | None = None) -> np.ndarray:
        """Decode to exactly `size` bytes (into `out`, contiguous uint8, if given); otherwise CodecError."""
        src = np.frombuffer(data, np.uint8)
        if out is None:
            out = np.empty(size, np.uint8)
        elif out.dtype != np.uint8 or out.size != size or not out.flags.c_contiguous:
            raise ZipMoEError(f"decompression output must be {size} contiguous bytes")
        status = self._lib.ggml_zipmoe_decompress(self._handle, codec_id(codec), src.ctypes.data, src.size,
                                                  out.ctypes.data, size)
        if status != _lib.OK:
            raise CodecError(f"{codec} decompression of {src.size} bytes into {size}", status)
        return out

    def close(self) -> None:
        if self._handle:
            self._lib.ggml_zipmoe_decoder_free(self._handle)
            self._handle = None

    def __del__(self):
        self.close()


class ExpertDecode:
    """A prepared ggml_zipmoe_decode_expert call: the K E-chunks (stored bytes) and the SM plane of
    one expert; calling it decodes and recovers the expert's BF16 values into `out`, shard by
    shard (each decoded in place in its own bytes of `out`), in one C call: the library's decode +
    recover routine that the expert cache runs. For timing and checking that routine: the codec
    bench, zipmoe-profile --costs and the tests."""

    def __init__(self, decoder: Decoder, chunks: list[bytes], codecs: list[str], sm: np.ndarray,
                 out: np.ndarray | None = None):
        k = len(chunks)
        if k < 1 or len(codecs) != k:
            raise ZipMoEError("an expert needs at least one E-chunk and one codec per chunk")
        self._decoder = decoder
        self._chunks = [np.frombuffer(c, np.uint8) for c in chunks]
        self._sm = np.ascontiguousarray(sm, dtype=np.uint8).reshape(-1)
        n = self._sm.size
        self.out = np.empty(n, np.uint16) if out is None else out
        if self.out.dtype != np.uint16 or self.out.size != n or not self.out.flags.c_contiguous:
            raise ZipMoEError(f"expert output must be {n} contiguous uint16 values")
        self._codecs = (ctypes.c_int32 * k)(*[codec_id(c) for c in codecs])
        self._ptrs = (ctypes.c_void_p * k)(*[c.ctypes.data for c in self._chunks])
        self._sizes = (ctypes.c_size_t * k)(*[c.size for c in self._chunks])
        self._args = (decoder._handle, k, self._codecs, self._ptrs, self._sizes, self._sm.ctypes.data, n,
                      self.out.ctypes.data)
        self._fn = _lib.lib().ggml_zipmoe_decode_expert

    def __call__(self) -> np.ndarray:
        status = self._fn(*self._args)
        if status != _lib.OK:
            raise CodecError(f"decoding an expert of {self._sm.size} values", status)
        return self.out
