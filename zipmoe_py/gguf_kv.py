"""Fast reader of a GGUF file's metadata key-values (not its tensors).

gguf-py's GGUFReader builds a numpy view per array element and takes close to a
minute on a 150k-token vocabulary; this reads the same header in well under a second.
Layout (GGUF v2/v3): magic "GGUF", u32 version, u64 n_tensors, u64 n_kv, then n_kv
entries of (string key, u32 type, value); strings are u64 length + UTF-8 bytes.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from .errors import ZipMoEError

_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ZipMoEError(f"{self.path}: GGUF header is truncated at byte {self.pos}")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALARS:
                fmt = _SCALARS[item_type]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(size * count)))
            return [self.value(item_type) for _ in range(count)]
        raise ZipMoEError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


def read_metadata(path: str | Path) -> dict:
    """Return {key: value} of a GGUF file's metadata."""
    path = Path(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _parse(_Cursor(data, path))


def _parse(cur: _Cursor) -> dict:
    path = cur.path
    if cur.take(4) != b"GGUF":
        raise ZipMoEError(f"{path} is not a GGUF file")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ZipMoEError(f"{path}: unsupported GGUF version {version}")
    cur.unpack("<Q")  # tensor count
    n_kv = cur.unpack("<Q")
    meta = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.unpack("<I"))
    return meta
