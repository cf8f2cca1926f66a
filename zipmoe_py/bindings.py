"""llama-cpp-python 0.3.36, bound to ZipMoE's libllama instead of a copy of its own.

llama-cpp-python loads its library once, at `import llama_cpp`, from
$LLAMA_CPP_LIB_PATH when set. Importing this module points it at our build; if
llama_cpp was imported earlier with another library, that cannot be undone in the
process, so we refuse with an error that says how to fix it.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from . import _lib, _paths
from .errors import ZipMoEError

GGUF_MAGIC = b"GGUF"


def _loaded_library_path(module) -> Path | None:
    lib = getattr(module, "_lib", None)
    name = getattr(lib, "_name", None)
    return Path(name).resolve() if name else None


def _import_llama_cpp():
    ours = _paths.shared_library("llama").resolve()
    already = sys.modules.get("llama_cpp.llama_cpp")
    if already is not None:
        loaded = _loaded_library_path(already)
        if loaded != ours:
            raise ZipMoEError(
                f"llama_cpp was already imported in this process with {loaded or 'an unknown library'}, "
                f"not ZipMoE's {ours}. Import zipmoe_py before llama_cpp, or start Python with "
                f"LLAMA_CPP_LIB_PATH={ours.parent}")
    else:
        env = os.environ.get("LLAMA_CPP_LIB_PATH")
        if env and Path(env).resolve() != ours.parent:
            raise ZipMoEError(
                f"LLAMA_CPP_LIB_PATH={env} points llama_cpp at another llama.cpp build; ZipMoE needs its own "
                f"({ours.parent}). Unset LLAMA_CPP_LIB_PATH or set it to that folder.")
        os.environ["LLAMA_CPP_LIB_PATH"] = str(ours.parent)
    import llama_cpp

    loaded = _loaded_library_path(llama_cpp.llama_cpp)
    if loaded != ours:
        raise ZipMoEError(f"llama_cpp loaded {loaded}, expected ZipMoE's {ours}")
    return llama_cpp


llama_cpp = _import_llama_cpp()


def check_model_file(model_path: str | os.PathLike) -> Path:
    """Fail early, naming the file, instead of deep inside llama.cpp's loader."""
    path = Path(model_path)
    if not path.exists():
        raise ZipMoEError(f"model file not found: {path}")
    if path.is_dir():
        raise ZipMoEError(f"model path is a folder, not a GGUF file: {path} "
                          "(a Hugging Face checkpoint must be converted first: zipmoe-convert DIR -o OUT.gguf)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ZipMoEError(f"cannot read model file {path}: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise ZipMoEError(f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    return path


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
               "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40,
               "TIB": 1 << 40}


def parse_size(value, what: str = "zipmoe_budget") -> int:
    """Bytes from an int or a string like "4G", "512M", "1.5GiB" (binary units)."""
    if isinstance(value, bool):
        raise ZipMoEError(f"{what} must be a size in bytes or like '4G', not {value!r}")
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number):]
        try:
            n = int(float(number) * _SIZE_UNITS[unit])
        except (ValueError, KeyError):
            raise ZipMoEError(f"{what} must be a size in bytes or like '4G', '512M', '1.5GiB'; got {value!r}") from None
    if n <= 0:
        raise ZipMoEError(f"{what} must be positive, got {value!r}")
    return n


def parse_threads(value, what: str = "zipmoe_threads") -> int:
    """A count >= 0 (for zipmoe_threads, 0 means all of the graph's threads)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ZipMoEError(f"{what} must be a whole number >= 0; got {value!r}")
    return value


def parse_pools(value, what: str = "zipmoe_pools") -> dict:
    """The KV overrides zipmoe.pool_f, pool_c, pool_s, pool_e from {"F": 4, "C": 8} or "F=4,C=8"
    (experts per MoE layer of the pools F, C, S, E)."""
    if isinstance(value, str):
        items = [item.split("=", 1) for item in value.replace(" ", "").split(",") if item]
    elif isinstance(value, dict):
        items = list(value.items())
    else:
        raise ZipMoEError(f"{what} must be like 'F=4,C=8,E=2' or {{'F': 4, 'C': 8}}; got {value!r}")
    pools = {}
    for item in items:
        name, count = (item + [None])[:2] if isinstance(item, list) else item
        name = str(name).upper()
        try:
            count = int(count)
        except (TypeError, ValueError):
            count = -1
        if name not in _lib.POOLS or name in pools or count < 0:
            raise ZipMoEError(f"{what}: {value!r} must name each of the pools F, C, S, E at most once with a "
                              "count >= 0 of experts per MoE layer, like 'F=4,C=8,E=2'")
        pools[name] = count
    if not pools or not any(pools.values()):
        raise ZipMoEError(f"{what}: {value!r} holds no expert; give e.g. 'F=4,C=8,E=2'")
    return {f"zipmoe.pool_{p.lower()}": pools[p] for p in _lib.POOLS if p in pools}


def plan_overrides(plan_path) -> dict:
    """zipmoe.pools and zipmoe.rank_delta from a zipmoe-plan PLAN file."""
    from .planner import load_plan

    result, _ = load_plan(Path(plan_path))
    if not any(result.capacities.values()):
        raise ZipMoEError(f"{plan_path}: the plan keeps no expert in any pool (its budget is below one expert per layer)")
    return {**parse_pools(dict(result.capacities), f"{plan_path}: capacities"), "zipmoe.rank_delta": int(result.delta)}


def zipmoe_overrides(budget=None, direct_io: bool | None = None, threads=None, eviction=None,
                     rank_delta=None, pools=None, work_slots=None, plan=None, mem_limit=None,
                     preload: bool | None = None) -> dict:
    """The KV overrides that carry ZipMoE options to the fork's model loader (an option left None is
    not overridden: the loader then takes its ZIPMOE_* environment variable, else its default)."""
    out = {}
    if plan is not None and pools is not None:
        raise ZipMoEError("give zipmoe_plan or zipmoe_pools, not both (a plan sets the pools)")
    if plan is not None:
        out.update(plan_overrides(plan))
    if pools is not None:
        out.update(parse_pools(pools))
    if work_slots is not None:
        if isinstance(work_slots, bool) or not isinstance(work_slots, int) or work_slots < 1:
            raise ZipMoEError(f"zipmoe_work_slots must be a whole number >= 1; got {work_slots!r}")
        out["zipmoe.work_slots"] = work_slots
    if any(key.startswith("zipmoe.pool_") for key in out) and eviction not in (None, "rank"):
        raise ZipMoEError(f"pools dispatch experts by rank: zipmoe_eviction={eviction!r} cannot be used with them")
    if eviction is not None:
        if eviction not in _lib.EVICTION_POLICIES:
            raise ZipMoEError(f"zipmoe_eviction must be one of {', '.join(_lib.EVICTION_POLICIES)}; got {eviction!r}")
        out["zipmoe.eviction"] = eviction
    if rank_delta is not None:
        out["zipmoe.rank_delta"] = parse_threads(rank_delta, "zipmoe_rank_delta")
    if budget is not None:
        out["zipmoe.budget"] = parse_size(budget)
    if mem_limit is not None:
        out["zipmoe.mem_limit"] = parse_size(mem_limit, "zipmoe_mem_limit")
    if direct_io is not None:
        out["zipmoe.direct_io"] = bool(direct_io)
    if preload is not None:
        if not isinstance(preload, bool):
            raise ZipMoEError(f"zipmoe_preload must be True or False; got {preload!r}")
        out["zipmoe.preload"] = preload
    if threads is not None:
        out["zipmoe.threads"] = parse_threads(threads)
    return out


def _check_budget(path: Path, budget: int) -> None:
    """A budget below one expert (gate + up + down) cannot work: say so before llama.cpp's loader does."""
    from . import format as zformat

    try:
        zf = zformat.ZipMoEFile(path)
    except ZipMoEError:
        return  # not a ZipMoE GGUF: the budget does not apply
    with zf:
        shapes = {t: zf.shape(t) for t in zf.tensors}
    layer = next(iter(shapes)).split(".")[1] if shapes else None
    one = sum(s[0] * s[1] * 2 for t, s in shapes.items() if t.split(".")[1] == layer)
    if budget < one:
        raise ZipMoEError(f"zipmoe_budget of {budget} bytes cannot hold one expert of {path.name} "
                          f"({one} bytes: gate + up + down); give at least that, better a layer's top-k experts")


class Llama(llama_cpp.Llama):
    """llama-cpp-python's `Llama`, unchanged in API, running on the ZipMoE fork.

    Extra keyword arguments, used when model_path is a ZipMoE GGUF (ignored otherwise). An option not
    given is taken from its environment variable (ZIPMOE_BUDGET, ZIPMOE_MEM_LIMIT, ZIPMOE_DIRECT_IO,
    ZIPMOE_THREADS, ZIPMOE_EVICTION, ZIPMOE_RANK_DELTA, ZIPMOE_POOL_F/C/S/E, ZIPMOE_WORK_SLOTS), else
    its default:
      zipmoe_budget:    bytes (or "4G", "512M") of expert slots; default: what the process may use
                        (its cgroup limits and MemAvailable) minus the non-expert weights, every
                        context's KV cache and compute buffers, the cache's own buffers and a margin,
                        at most every expert and at least one token's experts of a layer; sized
                        again whenever a context is made or freed. A budget that does not fit is
                        reduced, with a warning giving the numbers
      zipmoe_mem_limit: memory this process may use in all (bytes or "16G"), when it must share the
                        machine below what its cgroup and MemAvailable allow
      zipmoe_preload:   fill the expert slots when the first context is made, as a memory-mapped
                        model's populate does (default True; statistics do not count it)
      zipmoe_direct_io: True: read expert chunks with O_DIRECT (an error where the filesystem cannot);
                        False: through the page cache; default: O_DIRECT where the filesystem supports it
      zipmoe_threads:   how many of the graph's threads (n_threads) decode fetched experts; default
                        all (0). Reads run on the cache's own I/O thread either way.
      zipmoe_eviction:  which resident expert a miss replaces: "rank" (default; ZipMoE's rank
                        dispatch: experts ranked beyond their layer's share of the cache go first,
                        then the least often chosen), "lru", "fifo", "marking" (randomized
                        marking), "lfu" (least often chosen)
      zipmoe_rank_delta: the "rank" dispatch's tolerance margin delta (default 0, or the plan's)
      zipmoe_pools:     the hierarchical pools (ZipMoE §3.2), experts per MoE layer kept full (F),
                        compressed (C: SM + E-chunks), as SM-chunks (S) or as E-chunks (E), e.g.
                        "F=4,C=8,E=2" or {"F": 4, "C": 8}; default: one F pool of the whole budget
      zipmoe_plan:      a zipmoe-plan PLAN file: its pool capacities and delta (instead of zipmoe_pools)
      zipmoe_work_slots: with pools, the slots beyond F's where other experts are made full for a
                        pass (default 8; a ubatch choosing more distinct experts per layer than the
                        free slots runs in several passes)
    """

    def __new__(cls, model_path: str, *args, **kwargs):
        # checked before the object exists: llama_cpp.Llama.__del__ fails on a half-built instance
        check_model_file(model_path)
        options = zipmoe_overrides(kwargs.get("zipmoe_budget"), kwargs.get("zipmoe_direct_io"),
                                   kwargs.get("zipmoe_threads"), kwargs.get("zipmoe_eviction"),
                                   kwargs.get("zipmoe_rank_delta"), kwargs.get("zipmoe_pools"),
                                   kwargs.get("zipmoe_work_slots"), kwargs.get("zipmoe_plan"),
                                   kwargs.get("zipmoe_mem_limit"), kwargs.get("zipmoe_preload"))
        if "zipmoe.budget" in options:
            _check_budget(Path(model_path), options["zipmoe.budget"])
        return super().__new__(cls)

    def __init__(self, model_path: str, *args, zipmoe_budget=None, zipmoe_direct_io: bool | None = None,
                 zipmoe_threads: int | None = None, zipmoe_eviction: str | None = None,
                 zipmoe_rank_delta: int | None = None, zipmoe_pools=None, zipmoe_work_slots: int | None = None,
                 zipmoe_plan=None, zipmoe_mem_limit=None, zipmoe_preload: bool | None = None, **kwargs):
        overrides = dict(kwargs.pop("kv_overrides", None) or {})
        overrides.update(zipmoe_overrides(zipmoe_budget, zipmoe_direct_io, zipmoe_threads, zipmoe_eviction,
                                          zipmoe_rank_delta, zipmoe_pools, zipmoe_work_slots, zipmoe_plan,
                                          zipmoe_mem_limit, zipmoe_preload))
        if overrides:
            kwargs["kv_overrides"] = overrides
        super().__init__(model_path, *args, **kwargs)

    def eval(self, tokens):
        """llama-cpp-python's eval; an expert that cannot be fetched (I/O error, checksum mismatch,
        corrupt chunk) raises ZipMoEError naming layer, tensor, expert and chunk. The model and this
        object stay usable: the failed batch leaves nothing in the KV cache."""
        try:
            return super().eval(tokens)
        except RuntimeError as e:
            message = _lib.llama_zipmoe_last_error(self._ctx.ctx) if self._ctx is not None else ""
            if not message:
                raise
            self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
            raise ZipMoEError(message) from e

    def zipmoe_stats(self) -> dict | None:
        """Cumulative expert-cache statistics, or None for a model that is not a ZipMoE GGUF."""
        cache = _lib.llama_model_zipmoe_cache(self._model.model)
        if not cache:
            return None
        stats = _lib.cache_stats(cache)
        stats["memory"] = _lib.memory_plan(self._model.model)
        return stats

    def zipmoe_reset_stats(self) -> None:
        cache = _lib.llama_model_zipmoe_cache(self._model.model)
        if cache:
            _lib.lib().ggml_zipmoe_cache_reset_stats(cache)
