"""llama.cpp's tensor placement flags from Python: override_tensor (-ot PATTERN=BUFFER_TYPE,...),
n_cpu_moe (--n-cpu-moe N) and cpu_moe (--cpu-moe), which llama-cpp-python 0.3.36 lacks. They become
llama_model_params.tensor_buft_overrides exactly as common/arg.cpp builds them, so that a model is placed
as llama.cpp's programs place it; a ZipMoE model's expert slots follow the same placement, layer by layer.
"""
from __future__ import annotations

import ctypes

from .devices import _ggml
from .errors import ZipMoEError

# the keyword arguments of Llama (and the options of zipmoe-chat and the server) that place tensors:
# llama.cpp's -ot, --n-cpu-moe and --cpu-moe, in tensor_overrides' order
PLACEMENT_KWARGS = ("override_tensor", "n_cpu_moe", "cpu_moe")

# common/common.h: LLM_FFN_EXPS_REGEX, and llm_ffn_block_regex's "blk\.N" before it
EXPERTS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class TensorOverride(ctypes.Structure):
    """struct llama_model_tensor_buft_override (llama.h)"""
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _buffer_types() -> dict[str, int]:
    """Every device's buffer type by its name ("CPU", "CUDA0", "RPC0[host:port]"), as common/arg.cpp lists them."""
    lib = _ggml()
    for name, restype, argtypes in (("ggml_backend_dev_count", ctypes.c_size_t, []),
                                    ("ggml_backend_dev_get", ctypes.c_void_p, [ctypes.c_size_t]),
                                    ("ggml_backend_dev_buffer_type", ctypes.c_void_p, [ctypes.c_void_p]),
                                    ("ggml_backend_buft_name", ctypes.c_char_p, [ctypes.c_void_p])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    found = {}
    for i in range(lib.ggml_backend_dev_count()):
        buft = lib.ggml_backend_dev_buffer_type(lib.ggml_backend_dev_get(i))
        if buft:
            found[lib.ggml_backend_buft_name(buft).decode()] = buft
    return found


def tensor_overrides(override_tensor: str | None = None, n_cpu_moe: int | None = None,
                     cpu_moe: bool | None = None) -> list[tuple[str, str]]:
    """(pattern, buffer type name) pairs in llama.cpp's order (-ot's, then --cpu-moe's, then --n-cpu-moe's);
    a ZipMoEError naming the argument for a malformed entry or an unknown buffer type."""
    pairs = []
    known = None
    if override_tensor is not None and not isinstance(override_tensor, str):
        raise ZipMoEError(f"override_tensor must be text, PATTERN=BUFFER_TYPE[,...]; got {override_tensor!r}")
    for entry in (e for e in (override_tensor or "").split(",") if e.strip()):
        pattern, sep, buft = entry.partition("=")
        if not sep or not pattern or not buft:
            raise ZipMoEError(f"override_tensor: '{entry}' is not PATTERN=BUFFER_TYPE (e.g. 'blk\\.0\\.ffn_.*_exps=CPU')")
        known = known if known is not None else _buffer_types()
        if buft not in known:
            raise ZipMoEError(f"override_tensor: unknown buffer type '{buft}' in '{entry}'; available: "
                              f"{', '.join(sorted(known))}")
        pairs.append((pattern, buft))
    if cpu_moe:
        pairs.append((EXPERTS_REGEX, "CPU"))
    if n_cpu_moe is not None:
        if isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, int) or n_cpu_moe < 0:
            raise ZipMoEError(f"n_cpu_moe: {n_cpu_moe!r} is not a whole number of layers (0 or more)")
        pairs += [(rf"blk\.{i}{EXPERTS_REGEX}", "CPU") for i in range(n_cpu_moe)]
    return pairs


def override_array(pairs: list[tuple[str, str]]):
    """The NULL-terminated llama_model_tensor_buft_override array for pairs (None for none); keep it alive
    while the model loads."""
    if not pairs:
        return None
    known = _buffer_types()  # the CPU device's is ggml_backend_cpu_buffer_type(), --n-cpu-moe's
    array = (TensorOverride * (len(pairs) + 1))()
    for i, (pattern, buft) in enumerate(pairs):
        array[i].pattern = pattern.encode()
        array[i].buft = known[buft]
    return array
