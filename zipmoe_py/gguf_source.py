"""A GGUF to read tensors from, whole or split: `M-00001-of-0000N.gguf` opens with its N - 1 siblings as one
model, as llama.cpp loads it. The merged header holds the first split's key-values without the `split.*`
keys (what is written from it is one file) and every split's tensors in order; tensor bytes are read from
the split that holds them."""
from __future__ import annotations

import mmap
import re
from pathlib import Path

from . import gguf_file as gf
from .errors import ZipMoEError

SPLIT_NAME = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def split_paths(path: Path, header: gf.Header) -> list[Path]:
    """The files of the model whose first file is path: [path] when it is not split."""
    count = header.value("split.count", 0)
    if not count or count == 1:
        return [path]
    match = SPLIT_NAME.fullmatch(path.name)
    if header.value("split.no", 0) != 0 or not match or int(match.group(2)) != 1:
        first = f"{match.group(1) if match else 'NAME'}-00001-of-{count:05d}.gguf"
        raise ZipMoEError(f"{path} is split {header.value('split.no', 0) + 1} of {count} of a model: give its first "
                          f"file, {first}")
    paths = [path.with_name(f"{match.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ZipMoEError(f"{path} is the first of {count} files of a split model; missing beside it: "
                          f"{', '.join(missing)}")
    return paths


class GGUFSource:
    """A GGUF (or a split one) open for reading: its merged header, and each tensor's bytes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        first = gf.read_header(self.path)
        self.paths = split_paths(self.path, first)
        self.headers = [first] + [gf.read_header(p) for p in self.paths[1:]]
        self._files, self._maps, self._where = [], [], {}
        try:
            for i, (p, h) in enumerate(zip(self.paths, self.headers)):
                if len(self.paths) > 1 and h.value("split.no") != i:
                    raise ZipMoEError(f"{p}: split.no is {h.value('split.no')}, its name says {i}")
                f = open(p, "rb")
                self._files.append(f)
                self._maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                for t in h.tensors:
                    if t.name in self._where:
                        raise ZipMoEError(f"{p}: tensor {t.name} is also in {self.paths[self._where[t.name][0]]}")
                    self._where[t.name] = (i, h.data_offset + t.offset)
        except BaseException:
            self.close()
            raise
        kv = {k: v for k, v in first.kv.items() if k not in SPLIT_KEYS}
        tensors = [t for h in self.headers for t in h.tensors]
        self.header = gf.Header(self.path, first.version, kv, tensors, first.data_offset, first.alignment,
                                {t.name: t for t in tensors})

    def read(self, t: gf.TensorInfo, start: int = 0, size: int | None = None) -> bytes:
        """Bytes [start, start + size) of tensor t (all of it by default), copied out of the map."""
        i, begin = self._where[t.name]
        size = t.nbytes() - start if size is None else size
        return self._maps[i][begin + start:begin + start + size]

    def close(self) -> None:
        for m in self._maps:
            m.close()
        for f in self._files:
            f.close()
        self._maps, self._files = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
