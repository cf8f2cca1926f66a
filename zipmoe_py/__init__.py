"""ZipMoE: lossless BF16 Mixture-of-Experts inference under a memory budget.

`from zipmoe_py import Llama` gives llama-cpp-python's `Llama` API running on the
ZipMoE build of llama.cpp. The bindings load on first use of `Llama`, so the
converter and other tools work without loading the library.
"""
from __future__ import annotations

import os as _os
import sys as _sys

from . import _paths
from .errors import ZipMoEError, ZipMoELoadError

# `import zipmoe_py, llama_cpp` must give llama_cpp our libllama: llama-cpp-python reads
# LLAMA_CPP_LIB_PATH once, when it is imported. Nothing is loaded here; bindings checks the choice.
if "llama_cpp" not in _sys.modules and "LLAMA_CPP_LIB_PATH" not in _os.environ and _paths.LIB_DIR.is_dir():
    _os.environ["LLAMA_CPP_LIB_PATH"] = str(_paths.LIB_DIR)

__version__ = "0.1.0"
__all__ = ["Llama", "ZipMoEError", "ZipMoELoadError", "__version__"]


def __getattr__(name: str):
    if name == "Llama":
        from .bindings import Llama

        return Llama
    raise AttributeError(f"module 'zipmoe_py' has no attribute {name!r}")
