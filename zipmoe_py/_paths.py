"""Where the installed pieces of ZipMoE live inside the package."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .errors import ZipMoEError

PACKAGE_DIR = Path(__file__).resolve().parent
LIB_DIR = PACKAGE_DIR / "lib"            # libllama, libggml*, libggml-zipmoe (RPATH $ORIGIN)
BIN_DIR = PACKAGE_DIR / "bin"            # llama-completion, llama-bench, upstream test programs
LLAMA_CPP_DIR = PACKAGE_DIR / "_llama_cpp"  # vendored converter, gguf-py, vocab GGUFs, pin

_REINSTALL = "reinstall with `bash tools/setup.sh` (or `pip install .`) from the ZipMoE source tree"


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        if (PACKAGE_DIR.parent / "pyproject.toml").exists():
            raise ZipMoEError(f"{what} not found: Python imported zipmoe_py from the source tree "
                              f"({PACKAGE_DIR}), which holds no build; run from another folder, or run "
                              "the tests with .venv/bin/pytest (python -m pytest puts the source tree first)")
        raise ZipMoEError(f"{what} not found at {path}: the ZipMoE build is incomplete; {_REINSTALL}")
    return path


def shared_library(name: str) -> Path:
    """Path of lib<name>.so shipped with the package."""
    return _require(LIB_DIR / f"lib{name}.so", f"shared library lib{name}.so")


def program(name: str) -> Path:
    """Path of a program built with the fork (llama-completion, llama-bench, ...)."""
    return _require(BIN_DIR / name, f"program {name}")


def converter_script() -> Path:
    return _require(LLAMA_CPP_DIR / "convert_hf_to_gguf.py", "llama.cpp's convert_hf_to_gguf.py")


def vendored_vocab(filename: str) -> Path:
    return _require(LLAMA_CPP_DIR / "models" / filename, f"vocab GGUF {filename}")


def import_gguf():
    """Import the gguf-py that ships with the pinned llama.cpp (not a PyPI gguf)."""
    gguf_py = str(_require(LLAMA_CPP_DIR / "gguf-py", "llama.cpp's gguf-py"))
    if gguf_py not in sys.path:
        sys.path.insert(0, gguf_py)
    module = importlib.import_module("gguf")
    if not str(Path(module.__file__).resolve()).startswith(str(Path(gguf_py).resolve())):
        raise ZipMoEError(f"a different gguf package ({module.__file__}) was imported before ZipMoE's "
                          f"({gguf_py}); import zipmoe_py first or uninstall the other gguf")
    return module
