"""ZipMoE: lossless BF16 Mixture-of-Experts inference under a memory budget.

`from zipmoe_py import Llama` gives llama-cpp-python's `Llama` API running on the
ZipMoE build of llama.cpp. The bindings load on first use of `Llama`, so the
converter and other tools work without loading the library.
"""
from __future__ import annotations

from .errors import ZipMoEError, ZipMoELoadError

__version__ = "0.1.0"
__all__ = ["Llama", "ZipMoEError", "ZipMoELoadError", "__version__"]


def __getattr__(name: str):
    if name == "Llama":
        from .bindings import Llama

        return Llama
    raise AttributeError(f"module 'zipmoe_py' has no attribute {name!r}")
