"""ctypes declarations of ggml-zipmoe's public header (ggml-zipmoe/include/ggml-zipmoe.h), one to one."""
from __future__ import annotations

import ctypes
import functools

from . import _paths

c_uint8_p = ctypes.POINTER(ctypes.c_uint8)
c_uint16_p = ctypes.POINTER(ctypes.c_uint16)

# enum ggml_zipmoe_status
OK, ERR_ARG, ERR_NOMEM, ERR_CAPACITY, ERR_CORRUPT = 0, -1, -2, -3, -4
# enum ggml_zipmoe_codec
CODEC_RAW, CODEC_ZSTD, CODEC_LZ4, CODEC_LZ4HC, CODEC_HUF, CODEC_COUNT = range(6)

_PROTOTYPES = {
    "ggml_zipmoe_version": (ctypes.c_char_p, []),
    "ggml_zipmoe_version_number": (ctypes.c_int, []),
    "ggml_zipmoe_build_info": (ctypes.c_char_p, []),
    "ggml_zipmoe_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    "ggml_zipmoe_split_bf16": (None, [c_uint16_p, ctypes.c_size_t, c_uint8_p, c_uint8_p]),
    "ggml_zipmoe_recover_bf16": (None, [c_uint8_p, c_uint8_p, ctypes.c_size_t, c_uint16_p]),
    "ggml_zipmoe_recover_impl": (ctypes.c_char_p, []),
    "ggml_zipmoe_set_recover_impl": (ctypes.c_int, [ctypes.c_char_p]),
    "ggml_zipmoe_codec_name": (ctypes.c_char_p, [ctypes.c_int]),
    "ggml_zipmoe_compress_bound": (ctypes.c_size_t, [ctypes.c_int, ctypes.c_size_t]),
    "ggml_zipmoe_compress": (ctypes.c_int64, [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_void_p, ctypes.c_size_t]),
    "ggml_zipmoe_decoder_new": (ctypes.c_void_p, []),
    "ggml_zipmoe_decoder_free": (None, [ctypes.c_void_p]),
    "ggml_zipmoe_decompress": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_void_p, ctypes.c_size_t]),
    "ggml_zipmoe_checksum": (ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]),
}


@functools.lru_cache(maxsize=None)
def lib() -> ctypes.CDLL:
    handle = ctypes.CDLL(str(_paths.shared_library("ggml-zipmoe")))
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(handle, name)
        fn.restype, fn.argtypes = restype, argtypes
    return handle


def version() -> str:
    return lib().ggml_zipmoe_version().decode()


def version_number() -> int:
    return lib().ggml_zipmoe_version_number()


def build_info() -> str:
    return lib().ggml_zipmoe_build_info().decode()


def status_string(status: int) -> str:
    return lib().ggml_zipmoe_status_string(status).decode()
