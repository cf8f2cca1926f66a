"""ctypes declarations of ggml-zipmoe's public headers (ggml-zipmoe/include/: ggml-zipmoe.h, -policy.h, -serving.h,
-options.h, -test.h): the functions the Python layer and the tests call."""
from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Mapping, Sequence

from . import _paths
from .errors import ZipMoEError

c_uint8_p = ctypes.POINTER(ctypes.c_uint8)
c_uint16_p = ctypes.POINTER(ctypes.c_uint16)

# enum ggml_zipmoe_status
OK, ERR_ARG, ERR_NOMEM, ERR_CAPACITY, ERR_CORRUPT, ERR_IO, ERR_FORMAT, ERR_CHECKSUM = 0, -1, -2, -3, -4, -5, -6, -7
# enum ggml_zipmoe_codec
CODEC_RAW, CODEC_ZSTD, CODEC_LZ4, CODEC_LZ4HC, CODEC_HUF, CODEC_FHUF, CODEC_GHUF, CODEC_COUNT = range(8)

# GGML_ZIPMOE_CHUNK_ALIGNMENT (the newest file format the library reads: GGML_ZIPMOE_FORMAT_VERSION, ggml-zipmoe.h)
CHUNK_ALIGNMENT = 4096
# enum ggml_zipmoe_eviction (their names: eviction_names())
EVICT_LRU, EVICT_FIFO, EVICT_MARKING, EVICT_LFU, EVICT_RANK, EVICT_SCORE = range(6)
# enum ggml_zipmoe_rate: the scheduler's cost-model rates (their defaults: default_rate())
RATE_READ, RATE_DECODE, RATE_COMPUTE, RATE_TOUCH = range(4)
RATE_ORIGINS = ("given", "default", "measured")  # enum ggml_zipmoe_rate_origin
# enum ggml_zipmoe_open_flags
OPEN_DIRECT, OPEN_DIRECT_IF_SUPPORTED = 1, 2


class ChunkInfo(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint64), ("size", ctypes.c_uint64), ("first", ctypes.c_uint64),
                ("count", ctypes.c_uint64), ("checksum", ctypes.c_uint64), ("codec", ctypes.c_int32),
                ("shard", ctypes.c_int32)]


class CacheStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("fetch_calls", "expert_hits", "expert_misses", "bytes_read",
                                                     "io_ns", "decode_ns", "recover_ns", "fetch_ns",
                                                     "c_hits", "s_hits", "e_hits", "prefetch_hits",
                                                     "prefetch_bytes_read", "prefetch_bytes_used", "h2d_bytes",
                                                     "substitutions", "substitution_tokens", "lock_wait_ns", "plan_ns",
                                                     "fetch_work_ns", "read_wait_ns", "finish_wait_ns", "decode_faults",
                                                     "graph_ns", "graphs", "preload_experts", "preload_bytes_read",
                                                     "populate_bytes", "populate_ns", "migrate_experts",
                                                     "migrate_ns", "moved_page_bytes", "cpu_experts",
                                                     "device_experts", "device_ns")]


class BuddyParams(ctypes.Structure):
    _fields_ = [("tau", ctypes.c_float), ("temperature", ctypes.c_float), ("gamma", ctypes.c_float),
                ("beta", ctypes.c_float), ("rho", ctypes.c_int32), ("search", ctypes.c_int32), ("eta", ctypes.c_float)]


TAE_BINS = 1000  # GGML_ZIPMOE_TAE_BINS


class Memory(ctypes.Structure):
    _fields_ = [("available", ctypes.c_uint64), ("mem_available", ctypes.c_uint64), ("cgroup_limit", ctypes.c_uint64),
                ("cgroup_used", ctypes.c_uint64), ("cgroup_version", ctypes.c_int32), ("cgroup_path", ctypes.c_char * 512)]


class MemoryPlan(ctypes.Structure):
    """struct llama_zipmoe_memory_plan (llama.h of the fork), laid out as ggml_zipmoe_serving_plan."""
    _fields_ = [(name, ctypes.c_uint64) for name in ("available", "non_expert", "contexts", "cache_buffers", "margin",
                                                     "fits", "budget", "expert_bytes")] + \
               [(name, ctypes.c_int32) for name in ("n_contexts", "n_slots", "slot_capacity", "min_slots")] + \
               [("source", ctypes.c_char * 256), ("pools", ctypes.c_int32 * 4), ("pools_why", ctypes.c_char * 320)]


class PlanParams(ctypes.Structure):
    """struct ggml_zipmoe_plan_params: the runtime's planner (Alg. 2-4 on given selection probabilities)."""
    _fields_ = [("n_expert", ctypes.c_int32), ("k", ctypes.c_int32), ("q", ctypes.POINTER(ctypes.c_double)),
                ("budget", ctypes.c_uint64), ("entry_bytes", ctypes.c_uint64 * 4), ("u", ctypes.c_double),
                ("v", ctypes.c_double), ("c", ctypes.c_double), ("threads", ctypes.c_int32),
                ("n_shards", ctypes.c_int32), ("n_tensors", ctypes.c_int32), ("n_layer", ctypes.c_int32),
                ("grid_steps", ctypes.c_int32)]


class PlanResult(ctypes.Structure):
    _fields_ = [("capacity", ctypes.c_int32 * 4), ("expected_makespan_s", ctypes.c_double),
                ("grid_share", ctypes.c_int32 * 4)]


class DefaultPools(ctypes.Structure):
    """struct ggml_zipmoe_default_pools: the pools a model loaded with no pool options gets."""
    _fields_ = [("capacity", ctypes.c_int32 * 4), ("n_slots", ctypes.c_int32), ("inclusive", ctypes.c_int32),
                ("expected_makespan_s", ctypes.c_double), ("f_only_makespan_s", ctypes.c_double),
                ("current_makespan_s", ctypes.c_double), ("refill_s", ctypes.c_double), ("why", ctypes.c_char * 320)]


class CacheParams(ctypes.Structure):
    _fields_ = [("file", ctypes.c_void_p), ("n_slots", ctypes.c_int32), ("slot_data", ctypes.c_void_p * 3),
                ("slot_stride", ctypes.c_size_t * 3), ("n_decoders", ctypes.c_int32), ("eviction", ctypes.c_int32),
                ("rank_delta", ctypes.c_int32), ("pool_capacity", ctypes.c_int32 * 4), ("rate_read", ctypes.c_double),
                ("rate_decode", ctypes.c_double), ("rate_compute", ctypes.c_double), ("n_layer", ctypes.c_int32),
                ("layer_tensors", ctypes.POINTER(ctypes.c_int32)), ("prefetch_experts", ctypes.c_int32),
                ("slot_memory", ctypes.c_int32), ("slot_fill", ctypes.c_void_p), ("slot_fill_data", ctypes.c_void_p),
                ("slot_write", ctypes.c_void_p), ("slot_sync", ctypes.c_void_p), ("lookahead_experts", ctypes.c_int32),
                ("slot_pages_movable", ctypes.c_int32)]

    def set_layers(self, moe_layers: Mapping[int, Sequence[int]]) -> None:
        """n_layer and layer_tensors from {layer: (gate, up, down) tensor indexes} (ZipMoEFile.moe_layers()),
        -1 for a layer without routed experts. The table stays referenced by these params: keep them
        while the cache lives."""
        n_layer = max(moe_layers, default=-1) + 1
        table = (ctypes.c_int32 * (3 * n_layer))(*[-1] * (3 * n_layer))
        for layer, tensors in moe_layers.items():
            table[3 * layer:3 * layer + 3] = list(tensors)
        self._layer_table = table
        self.n_layer, self.layer_tensors = n_layer, table


LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class ServingParams(ctypes.Structure):
    """struct ggml_zipmoe_serving_params (ggml-zipmoe-serving.h): slot sizing and the default pools."""
    _fields_ = [("file", ctypes.c_void_p), ("layer_tensors", ctypes.POINTER(ctypes.c_int32)),
                ("n_layer", ctypes.c_int32), ("n_expert_used", ctypes.c_int32), ("available", ctypes.c_uint64),
                ("mem_limit", ctypes.c_uint64), ("budget", ctypes.c_uint64), ("budget_name", ctypes.c_char_p),
                ("pools", ctypes.c_int32 * 4),
                ("work_slots", ctypes.c_int32), ("eviction", ctypes.c_int32), ("threads", ctypes.c_int32),
                ("auto_pools", ctypes.c_int32), ("device_stores", ctypes.c_int32), ("replan_tokens", ctypes.c_int32),
                ("log", LOG_FN),
                ("log_data", ctypes.c_void_p), ("available_source", ctypes.c_char_p)]


class ServingInfo(ctypes.Structure):
    _fields_ = [("expert_bytes", ctypes.c_uint64), ("all_experts", ctypes.c_uint64),
                ("slot_ne", (ctypes.c_int64 * 2) * 3), ("n_moe_layers", ctypes.c_int32), ("max_expert", ctypes.c_int32),
                ("capacity", ctypes.c_int32), ("fewest", ctypes.c_int32), ("with_pools", ctypes.c_int32),
                ("raw", ctypes.c_int32), ("slot_bytes", ctypes.c_uint64 * 3), ("n_experts", ctypes.c_int32)]


class ServingDemand(ctypes.Structure):
    _fields_ = [("non_expert", ctypes.c_uint64), ("contexts", ctypes.c_uint64), ("n_contexts", ctypes.c_int32),
                ("n_threads_max", ctypes.c_int32), ("making", ctypes.c_int32)]


# enum ggml_zipmoe_expert_state
STATE_M, STATE_C, STATE_S, STATE_E, STATE_F = range(5)


class SchedTask(ctypes.Structure):
    _fields_ = [("expert", ctypes.c_int32), ("state", ctypes.c_int32), ("p", ctypes.c_double)]


class SchedParams(ctypes.Structure):
    _fields_ = [("u", ctypes.c_double), ("rho", ctypes.c_double), ("c", ctypes.c_double),
                ("n_shards", ctypes.c_int32), ("n_threads", ctypes.c_int32)]


class SchedOp(ctypes.Structure):
    _fields_ = [("task", ctypes.c_int32), ("chunk", ctypes.c_int32)]


class SchedResult(ctypes.Structure):
    _fields_ = [("io", ctypes.POINTER(SchedOp)), ("dec", ctypes.POINTER(SchedOp)),
                ("order", ctypes.POINTER(ctypes.c_int32)), ("block_start", ctypes.POINTER(ctypes.c_int32)),
                ("task_block", ctypes.POINTER(ctypes.c_int32)), ("n_io", ctypes.c_int32), ("n_dec", ctypes.c_int32),
                ("n_order", ctypes.c_int32), ("n_blocks", ctypes.c_int32)]


# ggml-zipmoe-options.h: enum ggml_zipmoe_option_type, ggml_zipmoe_option_surface, ggml_zipmoe_option_given
TYPE_SIZE, TYPE_BOOL, TYPE_INT, TYPE_REAL, TYPE_NAME, TYPE_POOLS, TYPE_PATH, TYPE_DEVICE_SIZES = range(8)
SURFACE_LOADER, SURFACE_PYTHON = 1, 2
GIVEN_TEXT, GIVEN_INT, GIVEN_REAL, GIVEN_BOOL = range(4)


class OptionDesc(ctypes.Structure):
    """struct ggml_zipmoe_option: one row of the option table."""
    _fields_ = [("name", ctypes.c_char_p), ("key", ctypes.c_char_p), ("env", ctypes.c_char_p),
                ("type", ctypes.c_int32), ("surfaces", ctypes.c_int32), ("min", ctypes.c_double),
                ("max", ctypes.c_double), ("also", ctypes.c_double), ("value", ctypes.c_double),
                ("unit", ctypes.c_char_p), ("note", ctypes.c_char_p), ("default_text", ctypes.c_char_p),
                ("help", ctypes.c_char_p), ("requires", ctypes.c_int32), ("requires_value", ctypes.c_int32)]


class OptionInput(ctypes.Structure):
    _fields_ = [("given", ctypes.c_int32), ("text", ctypes.c_char_p), ("i", ctypes.c_int64), ("f", ctypes.c_double)]


class OptionValue(ctypes.Structure):
    _fields_ = [("i", ctypes.c_int64), ("f", ctypes.c_double)]


_PROTOTYPES = {
    "ggml_zipmoe_version": (ctypes.c_char_p, []),
    "ggml_zipmoe_version_number": (ctypes.c_int, []),
    "ggml_zipmoe_build_info": (ctypes.c_char_p, []),
    "ggml_zipmoe_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    "ggml_zipmoe_split_bf16": (None, [c_uint16_p, ctypes.c_size_t, c_uint8_p, c_uint8_p]),
    "ggml_zipmoe_recover_bf16": (None, [c_uint8_p, c_uint8_p, ctypes.c_size_t, c_uint16_p]),
    "ggml_zipmoe_recover_impl": (ctypes.c_char_p, []),
    "ggml_zipmoe_recover_paths": (ctypes.c_char_p, []),
    "ggml_zipmoe_cuda_devices": (ctypes.c_int, []),
    "ggml_zipmoe_ghuf_decode_as_gpu": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]),
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
    "ggml_zipmoe_decode_expert": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int32),
                                                 ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                                                 ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
    "ggml_zipmoe_option_count": (ctypes.c_int, []),
    "ggml_zipmoe_option_at": (ctypes.POINTER(OptionDesc), [ctypes.c_int]),
    "ggml_zipmoe_option_find": (ctypes.c_int, [ctypes.c_char_p]),
    "ggml_zipmoe_option_choice": (ctypes.c_char_p, [ctypes.c_int, ctypes.c_int]),
    "ggml_zipmoe_option_expects": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_device_sizes_problem": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_size_text": (ctypes.c_char_p, [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_option_parse": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(OptionInput),
                                                ctypes.POINTER(OptionValue)]),
    "ggml_zipmoe_options_check": (ctypes.c_int, [ctypes.POINTER(OptionValue), ctypes.POINTER(ctypes.c_bool),
                                                 ctypes.c_bool, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_eviction_name": (ctypes.c_char_p, [ctypes.c_int]),
    "ggml_zipmoe_pool_name": (ctypes.c_char_p, [ctypes.c_int]),
    "ggml_zipmoe_substitution_name": (ctypes.c_char_p, [ctypes.c_int]),
    "ggml_zipmoe_balance_cpu_load": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_double, ctypes.c_double,
                                                      ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]),
    "ggml_zipmoe_smoe_route": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                              ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                              ctypes.c_float, ctypes.c_int, ctypes.c_void_p,
                                              ctypes.POINTER(ctypes.c_int64)]),
    "ggml_zipmoe_cache_set_substitution": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_float]),
    "ggml_zipmoe_buddy_default_params": (BuddyParams, []),
    "ggml_zipmoe_buddy_tae": (ctypes.c_float, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]),
    "ggml_zipmoe_buddy_route": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                               ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_float,
                                               ctypes.POINTER(BuddyParams), ctypes.c_void_p,
                                               ctypes.POINTER(ctypes.c_int64)]),
    "ggml_zipmoe_cache_set_buddies": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                     ctypes.c_int32, ctypes.c_float]),
    "ggml_zipmoe_cache_set_buddy_params": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(BuddyParams)]),
    "ggml_zipmoe_cache_trace_routing": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64]),
    "ggml_zipmoe_cache_get_routing_trace": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                           ctypes.POINTER(ctypes.c_uint64)]),
    "ggml_zipmoe_cache_get_substitution": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
                                                          ctypes.POINTER(ctypes.c_float)]),
    "ggml_zipmoe_cache_substitute": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                    ctypes.c_int64, ctypes.c_void_p]),
    "ggml_zipmoe_default_rate": (ctypes.c_double, [ctypes.c_int]),
    "ggml_zipmoe_cache_rate": (ctypes.c_double, [ctypes.c_void_p, ctypes.c_int]),
    "ggml_zipmoe_cache_rate_origin": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    "ggml_zipmoe_file_open": (ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_uint, ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_file_close": (None, [ctypes.c_void_p]),
    "ggml_zipmoe_file_path": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ggml_zipmoe_file_is_direct": (ctypes.c_int, [ctypes.c_void_p]),
    "ggml_zipmoe_cache_preload": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int32)]),
    "ggml_zipmoe_file_n_shards": (ctypes.c_int, [ctypes.c_void_p]),
    "ggml_zipmoe_file_n_tensors": (ctypes.c_int, [ctypes.c_void_p]),
    "ggml_zipmoe_file_max_chunk_size": (ctypes.c_size_t, [ctypes.c_void_p]),
    "ggml_zipmoe_file_tensor_name": (ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_int]),
    "ggml_zipmoe_file_tensor_layer": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    "ggml_zipmoe_file_tensor_shape": (None, [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]),
    "ggml_zipmoe_file_tensor_type": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    "ggml_zipmoe_file_tensor_expert_bytes": (ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_int]),
    "ggml_zipmoe_file_find_tensor": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p]),
    "ggml_zipmoe_file_chunk": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                              ctypes.POINTER(ChunkInfo)]),
    "ggml_zipmoe_file_describe_chunk": (None, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_file_chunk_buffer_size": (ctypes.c_size_t, [ctypes.c_void_p]),
    "ggml_zipmoe_file_read_chunk": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                   ctypes.c_void_p, ctypes.c_size_t]),
    "ggml_zipmoe_reader_new": (ctypes.c_void_p, [ctypes.c_void_p]),
    "ggml_zipmoe_reader_free": (None, [ctypes.c_void_p]),
    "ggml_zipmoe_read_expert": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]),
    "ggml_zipmoe_reader_error": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ggml_zipmoe_cache_new": (ctypes.c_void_p, [ctypes.POINTER(CacheParams), ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_cache_free": (None, [ctypes.c_void_p]),
    "ggml_zipmoe_cache_has_layer": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    "ggml_zipmoe_cache_n_expert": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int]),
    "ggml_zipmoe_cache_n_passes": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]),
    "ggml_zipmoe_cache_observe_scores": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                                         ctypes.c_int64, ctypes.c_int64]),
    "ggml_zipmoe_cache_fetch": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                               ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                               ctypes.c_int, ctypes.c_int]),
    "ggml_zipmoe_cache_fetch_begin": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]),
    "ggml_zipmoe_cache_fetch_end": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]),
    "ggml_zipmoe_cache_fetch_begin_cpu": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                         ctypes.c_void_p]),
    "ggml_zipmoe_cache_set_cpu_slots": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,
                                                       ctypes.c_double]),
    "ggml_zipmoe_cache_get_prefetch_recall": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int] +
                                              [ctypes.POINTER(ctypes.c_uint64)] * 3),
    "ggml_zipmoe_cache_prefetch": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int32),
                                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]),
    "ggml_zipmoe_cache_get_activations": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int,
                                                         ctypes.POINTER(ctypes.c_uint64),
                                                         ctypes.POINTER(ctypes.c_uint64)]),
    "ggml_zipmoe_cache_get_selections": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int] +
                                         [ctypes.POINTER(ctypes.c_uint64)] * 3),
    "ggml_zipmoe_cache_merge_pass": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                            ctypes.c_size_t]),
    "ggml_zipmoe_cache_n_slots": (ctypes.c_int32, [ctypes.c_void_p]),
    "ggml_zipmoe_cache_slot_capacity": (ctypes.c_int32, [ctypes.c_void_p]),
    "ggml_zipmoe_cache_set_n_slots": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32]),
    "ggml_zipmoe_cache_set_pools": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32,
                                                   ctypes.c_int]),
    "ggml_zipmoe_cache_set_pools_migrating": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32),
                                                             ctypes.c_int32, ctypes.c_int, ctypes.c_int,
                                                             ctypes.POINTER(ctypes.c_int32)]),
    "ggml_zipmoe_plan_pools": (ctypes.c_int, [ctypes.POINTER(PlanParams), ctypes.POINTER(PlanResult)]),
    "ggml_zipmoe_cache_default_pools": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32,
                                                       ctypes.c_int32, ctypes.c_double, ctypes.c_double,
                                                       ctypes.POINTER(ctypes.c_double), ctypes.POINTER(DefaultPools)]),
    "ggml_zipmoe_cache_device_pools": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int32,
                                                      ctypes.POINTER(DefaultPools)]),
    "ggml_zipmoe_plan_rank_bias": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32,
                                                  ctypes.POINTER(ctypes.c_double)]),
    "ggml_zipmoe_plan_debias_profile": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int32,
                                                       ctypes.POINTER(ctypes.c_double)]),
    "ggml_zipmoe_plan_fit": (ctypes.c_int, [ctypes.POINTER(ctypes.c_double), ctypes.c_int32, ctypes.c_int32,
                                            ctypes.POINTER(ctypes.c_double)]),
    "ggml_zipmoe_cache_extra_bytes": (ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_int]),
    "ggml_zipmoe_cache_cancel": (ctypes.c_int, [ctypes.c_void_p]),
    "ggml_zipmoe_memory_available": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_void_p]),
    "ggml_zipmoe_cache_pool_entries": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]),
    "ggml_zipmoe_cache_get_stats": (None, [ctypes.c_void_p, ctypes.POINTER(CacheStats)]),
    "ggml_zipmoe_cache_reset_stats": (None, [ctypes.c_void_p]),
    "ggml_zipmoe_cache_count_graph": (None, [ctypes.c_void_p, ctypes.c_uint64]),
    "ggml_zipmoe_cache_error": (ctypes.c_char_p, [ctypes.c_void_p]),
    "ggml_zipmoe_set_sm_read_delay_us": (None, [ctypes.c_uint]),
    "ggml_zipmoe_set_page_move_refusal": (None, [ctypes.c_int, ctypes.c_bool]),
    "ggml_zipmoe_serving_new": (ctypes.c_void_p, [ctypes.POINTER(ServingParams), ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_serving_free": (None, [ctypes.c_void_p]),
    "ggml_zipmoe_serving_get_info": (None, [ctypes.c_void_p, ctypes.POINTER(ServingInfo)]),
    "ggml_zipmoe_serving_fit_device": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint64,
                                                        ctypes.c_uint64, ctypes.c_int]),
    "ggml_zipmoe_serving_set_host_zero_slots": (None, [ctypes.c_void_p, ctypes.c_int32]),
    "ggml_zipmoe_serving_reserve_host": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p * 3, ctypes.c_size_t * 3,
                                                        ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_serving_set_cache": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p,
                                                     ctypes.c_size_t]),
    "ggml_zipmoe_serving_resize": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ServingDemand),
                                                  ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t]),
    "ggml_zipmoe_serving_observe": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]),
    "ggml_zipmoe_serving_observe_tokens": (None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]),
    "ggml_zipmoe_serving_get_plan": (None, [ctypes.c_void_p, ctypes.POINTER(MemoryPlan)]),
    "ggml_zipmoe_serving_auto_pools_active": (ctypes.c_int, [ctypes.c_void_p]),
    "ggml_zipmoe_schedule": (ctypes.c_int, [ctypes.POINTER(SchedTask), ctypes.c_int32, ctypes.POINTER(SchedParams),
                                            ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(SchedResult)]),
}


@functools.lru_cache(maxsize=None)
def lib() -> ctypes.CDLL:
    # test-only: ZIPMOE_TEST_LIBGGML_ZIPMOE loads another build of the library (the sanitizer build
    # tests/test_sanitizers.py makes); users never set it
    override = os.environ.get("ZIPMOE_TEST_LIBGGML_ZIPMOE")
    handle = ctypes.CDLL(override or str(_paths.shared_library("ggml-zipmoe")))
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


def _enum_names(name_of) -> tuple[str, ...]:
    """The names a C enum's name function gives from value 0 up to its first NULL."""
    names = []
    while (name := name_of(len(names))) is not None:
        names.append(name.decode())
    return tuple(names)


@functools.cache
def substitution_names() -> tuple[str, ...]:
    """The expert substitution policies by enum value (ggml_zipmoe_substitution_name): none, smoe, buddy."""
    return _enum_names(lib().ggml_zipmoe_substitution_name)


def substitution(cache, stats: "CacheStats") -> dict:
    """The cache's substitution policy: {"policy": "none"} (lossless), or the lossy policy's name,
    parameter and counts (from stats, the cache's statistics), labelled lossy."""
    policy, alpha = ctypes.c_int(), ctypes.c_float()
    lib().ggml_zipmoe_cache_get_substitution(cache, ctypes.byref(policy), ctypes.byref(alpha))
    name = substitution_names()[policy.value]
    if name == "none":
        return {"policy": name, "lossy": False}
    tokens = stats.substitution_tokens
    out = {"policy": name, "lossy": True}
    if name == "smoe":
        out["alpha"] = round(alpha.value, 6)
    return {**out, "substitutions": stats.substitutions, "tokens": tokens,
            "per_token": stats.substitutions / tokens if tokens else 0.0}


def routing_trace(cache, layer: int, n_expert: int) -> dict:
    """What ggml_zipmoe_cache_trace_routing recorded for a layer, as numpy arrays."""
    import numpy as np

    act = np.zeros(n_expert)
    coact = np.zeros((n_expert, n_expert))
    weighted = np.zeros((n_expert, n_expert))
    hist = np.zeros(TAE_BINS, dtype=np.uint64)
    n = ctypes.c_uint64()
    status = lib().ggml_zipmoe_cache_get_routing_trace(cache, layer, act.ctypes.data, coact.ctypes.data,
                                                        weighted.ctypes.data, hist.ctypes.data, ctypes.byref(n))
    if status != OK:
        raise ZipMoEError(f"layer {layer}: no routing trace ({status_string(status)})")
    return {"activations": act, "coact": coact, "coact_weighted": weighted, "tae_hist": hist, "tokens": n.value}


@functools.cache
def eviction_names() -> tuple[str, ...]:
    """The eviction policies by enum value (ggml_zipmoe_eviction_name): lru, fifo, marking, lfu, rank, score."""
    return _enum_names(lib().ggml_zipmoe_eviction_name)


@functools.cache
def pool_names() -> tuple[str, ...]:
    """The cache pools in hierarchy order (ggml_zipmoe_pool_name): F, C, S, E."""
    return _enum_names(lib().ggml_zipmoe_pool_name)


@functools.cache
def default_rate(rate: int) -> float:
    """ggml_zipmoe_default_rate: bytes per second the runtime's cost model assumes when not told,
    for RATE_READ (O_DIRECT reads), RATE_DECODE (decode + recover, BF16 output bytes per thread),
    RATE_COMPUTE (an expert's products per token, its BF16 weight bytes) or RATE_TOUCH (first writes
    of new memory per thread, never measured)."""
    value = lib().ggml_zipmoe_default_rate(rate)
    if not value > 0:
        raise ZipMoEError(f"ggml_zipmoe_default_rate({rate}) gave {value}: no such rate in this libggml-zipmoe")
    return value


@functools.lru_cache(maxsize=None)
def _libllama() -> ctypes.CDLL:
    handle = ctypes.CDLL(str(_paths.shared_library("llama")))
    handle.llama_model_zipmoe_cache.restype = ctypes.c_void_p
    handle.llama_model_zipmoe_cache.argtypes = [ctypes.c_void_p]
    handle.llama_zipmoe_last_error.restype = ctypes.c_char_p
    handle.llama_zipmoe_last_error.argtypes = [ctypes.c_void_p]
    handle.llama_model_zipmoe_memory_plan.restype = ctypes.c_bool
    handle.llama_model_zipmoe_memory_plan.argtypes = [ctypes.c_void_p, ctypes.POINTER(MemoryPlan)]
    # a cache per device (zipmoe_py/slot_sets.py)
    for name, restype, argtypes in (("llama_model_zipmoe_n_caches", ctypes.c_int32, [ctypes.c_void_p]),
                                    ("llama_model_zipmoe_cache_at", ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_int32]),
                                    ("llama_model_zipmoe_cache_device", ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_int32]),
                                    ("llama_model_zipmoe_cache_memory_plan", ctypes.c_bool,
                                     [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(MemoryPlan)])):
        getattr(handle, name).restype, getattr(handle, name).argtypes = restype, argtypes
    return handle


def memory_plan(model, cache_index: int | None = None) -> dict | None:
    """How the expert cache of a llama-cpp-python model wrapper (or llama_model pointer) was last
    sized: fits = available - non_expert - contexts - cache_buffers - margin; None if not ZipMoE.
    cache_index: that cache's (llama_model_zipmoe_cache_memory_plan), else the host memory's."""
    ptr = getattr(model, "model", model)
    ptr = ctypes.cast(ptr, ctypes.c_void_p).value if ptr is not None else None
    plan = MemoryPlan()
    lib = _libllama()
    if not ptr or not (lib.llama_model_zipmoe_memory_plan(ptr, ctypes.byref(plan)) if cache_index is None else
                       lib.llama_model_zipmoe_cache_memory_plan(ptr, cache_index, ctypes.byref(plan))):
        return None
    out = {name: getattr(plan, name) for name, _ in MemoryPlan._fields_}
    out["source"] = plan.source.decode(errors="replace")
    out["pools"] = dict(zip(pool_names(), plan.pools))
    out["pools_why"] = plan.pools_why.decode(errors="replace")
    return out


def memory_available(root: str | None = None) -> dict:
    """ggml_zipmoe_memory_available: what this process may still take, and which limit says so.
    root is test-only: a folder standing in for / (the runtime probes the real one, in C)."""
    mem = Memory()
    status = lib().ggml_zipmoe_memory_available(root.encode() if root else None, ctypes.byref(mem))
    out = {name: getattr(mem, name) for name, _ in Memory._fields_}
    out["cgroup_path"] = mem.cgroup_path.decode()
    out["status"] = status
    return out


def llama_zipmoe_last_error(ctx) -> str:
    """Why the last llama_decode of a llama_context failed fetching an expert ("" if it did not)."""
    ptr = ctypes.cast(ctx, ctypes.c_void_p).value if ctx is not None else None
    return (_libllama().llama_zipmoe_last_error(ptr) or b"").decode(errors="replace") if ptr else ""


def llama_model_zipmoe_cache(model) -> int | None:
    """The ggml_zipmoe_cache of a llama-cpp-python model wrapper (its .model pointer), or None."""
    ptr = getattr(model, "model", model)
    ptr = ctypes.cast(ptr, ctypes.c_void_p).value if ptr is not None else None
    return _libllama().llama_model_zipmoe_cache(ptr) if ptr else None


def cache_stats(cache) -> dict:
    stats = CacheStats()
    lib().ggml_zipmoe_cache_get_stats(cache, ctypes.byref(stats))
    out = {name: getattr(stats, name) for name, _ in CacheStats._fields_}
    out["n_slots"] = lib().ggml_zipmoe_cache_n_slots(cache)
    out["slot_capacity"] = lib().ggml_zipmoe_cache_slot_capacity(cache)
    entry = ctypes.c_size_t()
    out["pools"] = {name: {"experts": lib().ggml_zipmoe_cache_pool_entries(cache, i, ctypes.byref(entry)),
                           "entry_bytes": entry.value} for i, name in enumerate(pool_names())}
    lookups = out["expert_hits"] + out["c_hits"] + out["s_hits"] + out["e_hits"] + out["expert_misses"]
    # hit_rate: found full in a slot; store hits still decode (C) or read half (S, E)
    out["hit_rate"] = out["expert_hits"] / lookups if lookups else None
    out["prefetch_recall"] = prefetch_recall(cache)
    out["substitution"] = substitution(cache, stats)  # "lossy": True whenever a policy replaces experts
    # the scheduler's cost model now (bytes/s): measured on this machine unless given
    rates = (("read", RATE_READ), ("decode", RATE_DECODE), ("compute", RATE_COMPUTE), ("touch", RATE_TOUCH))
    out["rates"] = {name: lib().ggml_zipmoe_cache_rate(cache, rate) for name, rate in rates}
    # where each comes from: "given", "default" (not measured) or "measured"
    out["rate_origins"] = {name: RATE_ORIGINS[lib().ggml_zipmoe_cache_rate_origin(cache, rate)] for name, rate in rates}
    return out


def prefetch_recall(cache) -> dict:
    """How well the next-layer prediction named the experts routers chose: totals and per layer
    (layers with predictions only), each {predicted, actual, correct, recall}."""
    def one(layer):
        vals = [ctypes.c_uint64() for _ in range(3)]
        if lib().ggml_zipmoe_cache_get_prefetch_recall(cache, layer, *[ctypes.byref(v) for v in vals]) != OK:
            return None
        predicted, actual, correct = (v.value for v in vals)
        return {"predicted": predicted, "actual": actual, "correct": correct,
                "recall": correct / actual if actual else None}

    out = one(-1) or {}
    # served layers need not be contiguous (DeepSeek's layer 0 is dense); models have far fewer
    layers = {layer: one(layer) for layer in range(1024) if lib().ggml_zipmoe_cache_has_layer(cache, layer)}
    out["layers"] = {layer: r for layer, r in layers.items() if r is not None and r["actual"]}
    return out


def cache_activations(cache, layer: int) -> tuple[list[int], int] | None:
    """(ubatches that chose each expert, ubatches run) of a served layer since the last stats reset;
    None if the cache does not serve the layer."""
    n_expert = lib().ggml_zipmoe_cache_n_expert(cache, layer)
    if n_expert <= 0:
        return None
    counts = (ctypes.c_uint64 * n_expert)()
    n_ubatches = ctypes.c_uint64()
    if lib().ggml_zipmoe_cache_get_activations(cache, layer, counts, ctypes.byref(n_ubatches)) != OK:
        return None
    return list(counts), n_ubatches.value


def cache_selections(cache, layer: int) -> tuple[list[int], list[int], int] | None:
    """(the layer's even tokens that chose each expert, its odd tokens', tokens run) of a served layer
    since the last stats reset; None if the cache does not serve the layer."""
    n_expert = lib().ggml_zipmoe_cache_n_expert(cache, layer)
    if n_expert <= 0:
        return None
    even, odd = (ctypes.c_uint64 * n_expert)(), (ctypes.c_uint64 * n_expert)()
    n_tokens = ctypes.c_uint64()
    if lib().ggml_zipmoe_cache_get_selections(cache, layer, even, odd, ctypes.byref(n_tokens)) != OK:
        return None
    return list(even), list(odd), n_tokens.value


def sched_work_size(n_tasks: int, n_shards: int, n_threads: int) -> int:
    """GGML_ZIPMOE_SCHED_WORK_SIZE: workspace bytes of ggml_zipmoe_schedule. Test-only: the tests drive
    the scheduler directly (the runtime's cache sizes its own workspace in C)."""
    return 8 * (n_tasks * n_shards + n_threads) + 4 * (3 * n_tasks * n_shards + 4 * n_tasks)
