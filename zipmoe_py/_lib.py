"""ctypes declarations of ggml-zipmoe's public header (ggml-zipmoe/include/ggml-zipmoe.h), one to one."""
from __future__ import annotations

import ctypes
import functools

from . import _paths


@functools.lru_cache(maxsize=None)
def lib() -> ctypes.CDLL:
    handle = ctypes.CDLL(str(_paths.shared_library("ggml-zipmoe")))

    handle.ggml_zipmoe_version.argtypes = []
    handle.ggml_zipmoe_version.restype = ctypes.c_char_p
    handle.ggml_zipmoe_version_number.argtypes = []
    handle.ggml_zipmoe_version_number.restype = ctypes.c_int
    handle.ggml_zipmoe_build_info.argtypes = []
    handle.ggml_zipmoe_build_info.restype = ctypes.c_char_p
    return handle


def version() -> str:
    return lib().ggml_zipmoe_version().decode()


def version_number() -> int:
    return lib().ggml_zipmoe_version_number()


def build_info() -> str:
    return lib().ggml_zipmoe_build_info().decode()
