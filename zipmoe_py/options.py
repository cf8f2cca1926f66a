"""ZipMoE's options (budget, pools, eviction, ...) parsed into the KV overrides of the fork's model loader.

Pure option logic, shared by `Llama(...)` (bindings), zipmoe-chat and zipmoe-plan: it imports neither
llama_cpp (zipmoe_py.bindings) nor the planner, so parsing an option never loads libllama. The names C
owns (eviction policies, pools) come from libggml-zipmoe (_lib), loaded on first use.
"""
from __future__ import annotations

from pathlib import Path

from . import _lib
from .errors import ZipMoEError

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
        except (ValueError, KeyError, OverflowError):  # OverflowError: "inf"
            raise ZipMoEError(f"{what} must be a size in bytes or like '4G', '512M', '1.5GiB'; got {value!r}") from None
    if n <= 0:
        raise ZipMoEError(f"{what} must be positive, got {value!r}")
    if n > MAX_SIZE:
        raise ZipMoEError(f"{what} of {value!r} is beyond any machine's memory (at most {MAX_SIZE} bytes)")
    return n


# the loader's KV overrides are int64, and its counts int32 with these bounds (llama-zipmoe.cpp)
MAX_SIZE = (1 << 63) - 1
MAX_THREADS = 4096
MAX_SLOTS = 1 << 20


def parse_count(value, what: str, high: int = MAX_SLOTS, low: int = 0) -> int:
    """A whole number from low to high (zipmoe_threads: 0 means all of the graph's threads;
    zipmoe_rank_delta; zipmoe_work_slots)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ZipMoEError(f"{what} must be a whole number from {low} to {high}; got {value!r}")
    return value


def parse_flag(value, what: str) -> bool:
    """True or False, nothing else: bool("no") would be True."""
    if not isinstance(value, bool):
        raise ZipMoEError(f"{what} must be True or False; got {value!r}")
    return value


def pool_overrides(value, what: str = "zipmoe_pools") -> dict:
    """The KV overrides zipmoe.pool_f, pool_c, pool_s, pool_e from {"F": 4, "C": 8} or "F=4,C=8"
    (experts per MoE layer of the pools F, C, S, E)."""
    if isinstance(value, str):
        items = [item.split("=", 1) for item in value.replace(" ", "").split(",") if item]
    elif isinstance(value, dict):
        items = list(value.items())
    else:
        raise ZipMoEError(f"{what} must be like 'F=4,C=8,E=2' or {{'F': 4, 'C': 8}}; got {value!r}")
    names = _lib.pool_names()
    pools = {}
    for item in items:
        name, count = (item + [None])[:2] if isinstance(item, list) else item
        name = str(name).upper()
        if isinstance(count, str) and count.isdigit():
            count = int(count)
        if isinstance(count, bool) or not isinstance(count, int):
            count = -1  # 2.7 experts, "x", None
        if name not in names or name in pools or not 0 <= count <= MAX_SLOTS:
            raise ZipMoEError(f"{what}: {value!r} must name each of the pools {', '.join(names)} at most once with a "
                              f"whole number from 0 to {MAX_SLOTS} of experts per MoE layer, like 'F=4,C=8,E=2'")
        pools[name] = count
    if not pools or not any(pools.values()):
        raise ZipMoEError(f"{what}: {value!r} holds no expert; give e.g. 'F=4,C=8,E=2'")
    return {f"zipmoe.pool_{p.lower()}": pools[p] for p in names if p in pools}


def plan_overrides(plan_path) -> dict:
    """zipmoe.pool_* and zipmoe.rank_delta from a zipmoe-plan PLAN file (docs/PLAN_FORMAT.md)."""
    from .plan_files import load_plan  # only when a plan is given

    result, _ = load_plan(Path(plan_path))
    if not any(result.capacities.values()):
        raise ZipMoEError(f"{plan_path}: the plan keeps no expert in any pool "
                          "(its budget is below one expert per layer)")
    return {**pool_overrides(dict(result.capacities), f"{plan_path}: capacities"),
            "zipmoe.rank_delta": int(result.delta)}


def zipmoe_overrides(budget=None, direct_io: bool | None = None, threads=None, eviction=None,
                     rank_delta=None, pools=None, work_slots=None, plan=None, mem_limit=None,
                     preload: bool | None = None, prefetch: bool | None = None, substitution=None,
                     smoe_alpha=None, buddy: dict | None = None, auto_pools: bool | None = None) -> dict:
    """The KV overrides that carry ZipMoE options to the fork's model loader (an option left None is
    not overridden: the loader then takes its ZIPMOE_* environment variable, else its default)."""
    out = {}
    if plan is not None and pools is not None:
        raise ZipMoEError("give zipmoe_plan or zipmoe_pools, not both (a plan sets the pools)")
    if plan is not None:
        out.update(plan_overrides(plan))
    if pools is not None:
        out.update(pool_overrides(pools))
    if work_slots is not None:
        out["zipmoe.work_slots"] = parse_count(work_slots, "zipmoe_work_slots", low=1)
    if any(key.startswith("zipmoe.pool_") for key in out) and eviction not in (None, "rank"):
        raise ZipMoEError(f"pools dispatch experts by rank: zipmoe_eviction={eviction!r} cannot be used with them")
    if eviction is not None:
        policies = _lib.eviction_names()
        if eviction not in policies:
            raise ZipMoEError(f"zipmoe_eviction must be one of {', '.join(policies)}; got {eviction!r}")
        out["zipmoe.eviction"] = eviction
    if rank_delta is not None:
        out["zipmoe.rank_delta"] = parse_count(rank_delta, "zipmoe_rank_delta")
    if budget is not None:
        out["zipmoe.budget"] = parse_size(budget)
    if mem_limit is not None:
        out["zipmoe.mem_limit"] = parse_size(mem_limit, "zipmoe_mem_limit")
    if direct_io is not None:
        out["zipmoe.direct_io"] = parse_flag(direct_io, "zipmoe_direct_io")
    if preload is not None:
        out["zipmoe.preload"] = parse_flag(preload, "zipmoe_preload")
    if auto_pools is not None:
        parse_flag(auto_pools, "zipmoe_auto_pools")
        if auto_pools and any(key.startswith("zipmoe.pool_") for key in out):
            raise ZipMoEError("zipmoe_auto_pools=True picks the pools: give it or zipmoe_pools/zipmoe_plan, not both")
        out["zipmoe.auto_pools"] = auto_pools
    if prefetch is not None:
        out["zipmoe.prefetch"] = parse_flag(prefetch, "zipmoe_prefetch")
    if threads is not None:
        out["zipmoe.threads"] = parse_count(threads, "zipmoe_threads", MAX_THREADS)
    out.update(substitution_overrides(substitution, smoe_alpha, buddy))
    return out


# BuddyMoE's parameters: keyword (zipmoe_buddy_NAME), KV override, kind and range
BUDDY_PARAMETERS = {
    "tau": ("zipmoe.buddy_tau", float, -1.0, 1.0),
    "temperature": ("zipmoe.buddy_temperature", float, 0.05, 20.0),
    "gamma": ("zipmoe.buddy_gamma", float, 0.0, 1.0),
    "beta": ("zipmoe.buddy_beta", float, 0.0, 1.0),
    "rho": ("zipmoe.buddy_rho", int, 0, 64),
    "search": ("zipmoe.buddy_search", int, 0, 1024),
    "eta": ("zipmoe.buddy_eta", float, 0.0, 10.0),
}


def substitution_overrides(substitution=None, smoe_alpha=None, buddy: dict | None = None) -> dict:
    """zipmoe.substitution, zipmoe.smoe_alpha and zipmoe.buddy_*: the opt-in LOSSY expert substitution.
    buddy: {NAME: value} of BUDDY_PARAMETERS (None values left out)."""
    out = {}
    if substitution is not None:
        names = _lib.substitution_names()
        if substitution not in names:
            raise ZipMoEError(f"zipmoe_substitution must be one of {', '.join(names)} (all but none are lossy); "
                              f"got {substitution!r}")
        out["zipmoe.substitution"] = substitution
    if smoe_alpha is not None:
        if isinstance(smoe_alpha, bool) or not isinstance(smoe_alpha, (int, float)) or not 0 <= smoe_alpha <= 1:
            raise ZipMoEError(f"zipmoe_smoe_alpha must be a number from 0 to 1; got {smoe_alpha!r}")
        if substitution not in (None, "smoe"):  # None: ZIPMOE_SUBSTITUTION may set it; the loader checks
            raise ZipMoEError("zipmoe_smoe_alpha is SMoE's parameter: give it with zipmoe_substitution='smoe'")
        out["zipmoe.smoe_alpha"] = float(smoe_alpha)
    for name, value in (buddy or {}).items():
        if value is None:
            continue
        key, kind, lo, hi = BUDDY_PARAMETERS[name]
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or
                                                                                      isinstance(value, int))
        if not number or not lo <= value <= hi or (name == "tau" and -1 < value < 0):
            what = "a whole number" if kind is int else "a number"
            extra = ", or -1 (the profile's calibrated tau)" if name == "tau" else ""
            raise ZipMoEError(f"zipmoe_buddy_{name} must be {what} from {lo:g} to {hi:g}{extra}; got {value!r}")
        if substitution not in (None, "buddy") and name != "temperature":
            raise ZipMoEError(f"zipmoe_buddy_{name} is BuddyMoE's parameter: give it with zipmoe_substitution='buddy'")
        out[key] = kind(value)
    return out


def check_budget(model_path: Path, budget: int) -> None:
    """A budget below one expert (gate + up + down) cannot work: say so before llama.cpp's loader does."""
    from . import format as zformat

    try:
        zf = zformat.ZipMoEFile(model_path)
    except ZipMoEError:
        return  # not a ZipMoE GGUF: the budget does not apply
    with zf:
        one = zf.expert_bytes().one_expert
    if budget < one:
        raise ZipMoEError(f"zipmoe_budget of {budget} bytes cannot hold one expert of {Path(model_path).name} "
                          f"({one} bytes: gate + up + down); give at least that, better a layer's top-k experts")
