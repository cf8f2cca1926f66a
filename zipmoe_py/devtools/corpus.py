"""The fixed natural-language corpora zipmoe-train-tiny trains on and zipmoe-buddies --corpus routes:
each split by document into train and held-out text, deterministically (see CORPORA). Needs nothing
beyond the standard library (the python-docs corpus needs the Debian package python3.11-doc).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ZipMoEError

PSF_LICENCE = "PSF License Agreement (Python Software Foundation)"
PYTHON_DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
PYTHON_DOCS_ENV = "ZIPMOE_PYTHON_DOCS"

CORPORA = {
    "python-docs": {"licence": PSF_LICENCE, "heldout_every": 20,
                    "source": "Python 3.11 documentation sources (*.rst.txt, Debian package python3.11-doc)"},
    "pydoc-topics": {"licence": PSF_LICENCE, "heldout_every": 10,
                     "source": "pydoc_data.topics.topics (Python standard library), topics in sorted key order"},
}


@dataclass
class Corpus:
    name: str
    train_text: str
    heldout_text: str
    train_documents: list[str]
    heldout_documents: list[str]

    def info(self) -> dict:
        spec = CORPORA[self.name]
        every = spec["heldout_every"]
        return {
            "name": self.name, "licence": spec["licence"], "source": spec["source"],
            "documents": len(self.train_documents) + len(self.heldout_documents),
            "train_documents": len(self.train_documents), "heldout_documents": len(self.heldout_documents),
            "heldout_rule": f"documents sorted by name; index % {every} == {every - 1} held out; "
                            "documents joined with a blank line",
            "heldout_names": list(self.heldout_documents),
            "train_bytes": len(self.train_text.encode("utf-8")),
            "heldout_bytes": len(self.heldout_text.encode("utf-8")),
            "train_sha256": _sha256(self.train_text), "heldout_sha256": _sha256(self.heldout_text),
        }


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def python_docs_dir() -> Path:
    return Path(os.environ.get(PYTHON_DOCS_ENV) or PYTHON_DOCS_DIR)


def corpus_documents(corpus: str) -> list[tuple[str, str]]:
    """The corpus as (name, text) pairs, sorted by name."""
    if corpus == "python-docs":
        folder = python_docs_dir()
        files = sorted(folder.rglob("*.rst.txt")) if folder.is_dir() else []
        if not files:
            raise ZipMoEError(
                f"corpus python-docs: {folder} {'holds no *.rst.txt files' if folder.is_dir() else 'is missing'}; "
                f"install the Python 3.11 documentation with `apt-get install python3.11-doc` "
                f"(or set {PYTHON_DOCS_ENV} to a folder of its _sources), or use --corpus pydoc-topics")
        docs = []
        for path in files:
            try:
                docs.append((path.relative_to(folder).as_posix(), path.read_text(encoding="utf-8")))
            except (OSError, UnicodeDecodeError) as e:
                raise ZipMoEError(f"corpus python-docs: cannot read {path}: {e}") from e
        return sorted(docs)
    if corpus == "pydoc-topics":
        from pydoc_data.topics import topics
        return [(key, topics[key]) for key in sorted(topics)]
    raise ZipMoEError(f"unknown corpus {corpus!r}; choose one of {', '.join(CORPORA)}")


def load_corpus(corpus: str) -> Corpus:
    """The corpus split by document into train and held-out text (fixed; see CORPORA)."""
    docs = corpus_documents(corpus)
    every = CORPORA[corpus]["heldout_every"]
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    held = [d for i, d in enumerate(docs) if i % every == every - 1]
    return Corpus(corpus, "\n\n".join(t for _, t in train), "\n\n".join(t for _, t in held),
                  [n for n, _ in train], [n for n, _ in held])


def heldout_text(corpus: str) -> str:
    """The held-out split of `corpus` as one string (what training.json's held-out metrics are on)."""
    return load_corpus(corpus).heldout_text
