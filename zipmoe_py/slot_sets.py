"""A ZipMoE model's expert caches, one per device that computes some MoE layer's experts (llama.h's
llama_model_zipmoe_n_caches): a model on the CPU alone has one; -ngl with --n-cpu-moe, or RPC servers,
give one per device, each with its slots in that device's memory. Statistics of the whole model sum them."""
from __future__ import annotations

import ctypes

from . import _lib
from ._lib import _libllama

MAX_LAYERS = 4096  # served layers are looked up by index; models have far fewer


def _model_pointer(model):
    ptr = getattr(model, "model", model)
    return ctypes.cast(ptr, ctypes.c_void_p).value if ptr is not None else None


def caches(model) -> list[tuple[str, int]]:
    """(device, ggml_zipmoe_cache) of each expert cache of a llama-cpp-python model wrapper (or llama_model
    pointer), in the order of their first layers; [] for a model that is not a ZipMoE GGUF."""
    ptr = _model_pointer(model)
    if not ptr:
        return []
    lib = _libllama()
    return [(lib.llama_model_zipmoe_cache_device(ptr, i).decode(), lib.llama_model_zipmoe_cache_at(ptr, i))
            for i in range(lib.llama_model_zipmoe_n_caches(ptr))]


def served_layers(cache) -> list[int]:
    return [layer for layer in range(MAX_LAYERS) if _lib.lib().ggml_zipmoe_cache_has_layer(cache, layer)]


def cache_of_layer(model, layer: int) -> int | None:
    """The cache serving a layer's experts, or None."""
    for _, cache in caches(model):
        if _lib.lib().ggml_zipmoe_cache_has_layer(cache, layer):
            return cache
    return None


_SUMMED = tuple(name for name, _ in _lib.CacheStats._fields_) + ("n_slots", "slot_capacity")


def model_stats(model) -> dict | None:
    """The statistics of every cache of the model (zipmoe_stats): counters, slots and pool experts summed
    over the caches, the rest (rates, substitution) the first cache's; "sets" gives each cache's device,
    layers, slots and memory plan. None for a model that is not a ZipMoE GGUF."""
    found = caches(model)
    if not found:
        return None
    per_cache = [_lib.cache_stats(cache) for _, cache in found]
    out = dict(per_cache[0])
    for name in _SUMMED:
        out[name] = sum(s[name] for s in per_cache)
    for pool, entry in out["pools"].items():
        out["pools"][pool] = dict(entry, experts=sum(s["pools"][pool]["experts"] for s in per_cache))
    lookups = sum(out[k] for k in ("expert_hits", "c_hits", "s_hits", "e_hits", "expert_misses"))
    out["hit_rate"] = out["expert_hits"] / lookups if lookups else None
    recall = {k: sum(s["prefetch_recall"].get(k, 0) for s in per_cache) for k in ("predicted", "actual", "correct")}
    recall["recall"] = recall["correct"] / recall["actual"] if recall["actual"] else None
    recall["layers"] = {layer: r for s in per_cache for layer, r in s["prefetch_recall"]["layers"].items()}
    out["prefetch_recall"] = recall
    out["sets"] = [{"device": device, "layers": served_layers(cache), "n_slots": s["n_slots"],
                    "slot_capacity": s["slot_capacity"], "memory": _lib.memory_plan(model, i)}
                   for i, ((device, cache), s) in enumerate(zip(found, per_cache))]
    return out


def reset_stats(model) -> None:
    for _, cache in caches(model):
        _lib.lib().ggml_zipmoe_cache_reset_stats(cache)
