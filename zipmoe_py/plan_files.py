"""The planner's files: PROFILE (zipmoe-profile writes it), COSTS (measured delays) and PLAN
(zipmoe-plan writes it; Llama(zipmoe_plan=...) and zipmoe-chat --plan read it), their readers,
validators and writer, and the in-memory types of COSTS and PLAN. docs/PLAN_FORMAT.md specifies
every field. Readers raise ZipMoEError naming the file and the field at fault.

Imports neither llama_cpp nor the planner (zipmoe_py/plan_math.py): loading a plan is all a model
load needs. Pool names are C's (libggml-zipmoe, loaded on first use).
"""
from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import _lib
from .errors import ZipMoEError

PROFILE_FORMAT, COSTS_FORMAT, PLAN_FORMAT = "zipmoe-profile", "zipmoe-costs", "zipmoe-plan"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Costs:
    """The delays of Algorithm 3, seconds, from a COSTS file or plan_math.default_costs: u (read one
    tensor's SM chunk), v (read one E-chunk), c (decompress and recover one E-chunk)."""

    u_s: float
    v_s: float
    c_s: float


@dataclass(frozen=True)
class PlanResult:
    """A PLAN: the cache partition plan_math.plan (or the reference, tests/planner.py) chose.

    pools: Lambda in hierarchy order. ratios: gamma_p per pool of Lambda (sum 1). capacities:
    S_p, experts per MoE layer. thresholds: tau_p = sum_{j <= p} S_j + delta (0-based ranks).
    memory_bytes: what pool p takes over all MoE layers. expected_makespan_s: the minimised
    expected makespan of one sparse layer. selection_probabilities: the q_r the plan used.
    """

    pools: tuple[str, ...]
    ratios: dict[str, float]
    capacities: dict[str, int]
    thresholds: dict[str, int]
    delta: int
    memory_bytes: dict[str, int]
    budget_bytes: int
    n_layer_moe: int
    n_expert: int
    k: int
    expected_makespan_s: float
    selection_probabilities: tuple[float, ...]


def _read_json(path: Path, kind: str, expected_format: str) -> dict:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ZipMoEError(f"{kind} file not found: {path}") from None
    except OSError as e:
        raise ZipMoEError(f"cannot read {kind} file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ZipMoEError(f"{path}: not a {kind} file (binary, not JSON text)") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ZipMoEError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ZipMoEError(f"{path}: a {kind} file holds a JSON object")
    if doc.get("format") != expected_format:
        raise ZipMoEError(f"{path}: field 'format' must be {expected_format!r}, got {doc.get('format')!r}")
    if doc.get("version") != FORMAT_VERSION:
        raise ZipMoEError(f"{path}: field 'version' must be {FORMAT_VERSION}, got {doc.get('version')!r}")
    return doc


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _require(doc: Mapping, name: str, check, what: str, path: Path, prefix: str = ""):
    """doc[name] if check(it) holds, else a ZipMoEError naming the file and field."""
    field = f"{prefix}{name}"
    if name not in doc:
        raise ZipMoEError(f"{path}: field '{field}' is missing")
    if not check(doc[name]):
        raise ZipMoEError(f"{path}: field '{field}' must be {what}, got {doc[name]!r:.80}")
    return doc[name]


def _positive_int(value) -> bool:
    return _is_int(value) and value > 0


def _pool_table(doc: Mapping, name: str, path: Path, pools: Sequence[str], check, what: str) -> dict:
    """doc[name], an object with exactly the keys `pools`, each value passing check."""
    table = _require(doc, name, lambda v: isinstance(v, dict), "an object keyed by pool", path)
    if set(table) != set(pools):
        raise ZipMoEError(f"{path}: field '{name}' must have the keys {', '.join(pools)}, got {', '.join(table)}")
    for pool in pools:
        _require(table, pool, check, what, path, prefix=f"{name}.")
    return {pool: table[pool] for pool in pools}


def load_profile(path: Path) -> dict:
    """A validated PROFILE document (docs/PLAN_FORMAT.md); ZipMoEError naming the file and field."""
    doc = _read_json(path, "profile", PROFILE_FORMAT)
    _require(doc, "model", lambda v: isinstance(v, str), "a string", path)
    n_layer_moe = _require(doc, "n_layer_moe", _positive_int, "a positive integer", path)
    n_expert = _require(doc, "n_expert", _positive_int, "a positive integer", path)
    _require(doc, "n_expert_used", lambda v: _positive_int(v) and v <= n_expert,
             f"an integer in 1..n_expert={n_expert}", path)
    _pool_table(doc, "expert_bytes", path, _lib.pool_names(), _positive_int, "a positive integer (bytes)")
    _require(doc, "n_tensors_per_expert", _positive_int, "a positive integer", path)
    _require(doc, "n_shards", _positive_int, "a positive integer", path)
    batches = _require(doc, "batches", lambda v: isinstance(v, dict) and v, "a non-empty object keyed by batch size",
                       path)
    for size, batch in batches.items():
        prefix = f"batches.{size}."
        if not (size.isdigit() and int(size) > 0):
            raise ZipMoEError(f"{path}: field 'batches' keys are batch sizes like \"1\", got {size!r}")
        if not isinstance(batch, dict):
            raise ZipMoEError(f"{path}: field 'batches.{size}' must be an object")
        n_ubatches = _require(batch, "n_ubatches", _positive_int, "a positive integer", path, prefix)
        _require(batch, "counts",
                 lambda rows: isinstance(rows, list) and len(rows) == n_layer_moe and all(
                     isinstance(row, list) and len(row) == n_expert
                     and all(_is_int(c) and 0 <= c <= n_ubatches for c in row) for row in rows),
                 f"n_layer_moe={n_layer_moe} lists of n_expert={n_expert} integers in 0..n_ubatches={n_ubatches}",
                 path, prefix)
    return doc


def load_costs(path: Path) -> tuple[Costs, int]:
    """A validated COSTS file -> (Costs, threads); ZipMoEError naming the file and field."""
    doc = _read_json(path, "costs", COSTS_FORMAT)
    positive = (lambda v: _is_number(v) and v > 0)
    delays = {name: float(_require(doc, name, positive, "a positive number of seconds", path))
              for name in ("u_s", "v_s", "c_s")}
    threads = _require(doc, "threads", _positive_int, "a positive integer", path)
    return Costs(**delays), threads


def save_plan(path: Path, result: PlanResult, meta: Mapping) -> None:
    """Write a PLAN file (docs/PLAN_FORMAT.md) for `result`, with `meta` (JSON-serialisable
    provenance) under "meta"."""
    doc = {"format": PLAN_FORMAT, "version": FORMAT_VERSION, "pools": list(result.pools),
           "ratios": result.ratios, "capacities": result.capacities, "thresholds": result.thresholds,
           "delta": result.delta, "memory_bytes": result.memory_bytes, "budget_bytes": result.budget_bytes,
           "n_layer_moe": result.n_layer_moe, "n_expert": result.n_expert, "k": result.k,
           "expected_makespan_s": result.expected_makespan_s,
           "selection_probabilities": list(result.selection_probabilities), "meta": dict(meta)}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load_plan(path: Path) -> tuple[PlanResult, dict]:
    """A validated PLAN file -> (PlanResult, meta); ZipMoEError naming the file and field."""
    doc = _read_json(path, "plan", PLAN_FORMAT)
    hierarchy = _lib.pool_names()
    pools = _require(doc, "pools", lambda v: isinstance(v, list) and v and all(p in hierarchy for p in v)
                     and list(v) == [p for p in hierarchy if p in v],
                     f"a non-empty list of distinct pools among {list(hierarchy)}, in that order", path)
    n_layer_moe = _require(doc, "n_layer_moe", _positive_int, "a positive integer", path)
    n_expert = _require(doc, "n_expert", _positive_int, "a positive integer", path)
    k = _require(doc, "k", lambda v: _positive_int(v) and v <= n_expert, f"an integer in 1..{n_expert}", path)
    budget = _require(doc, "budget_bytes", _positive_int, "a positive integer", path)
    delta = _require(doc, "delta", lambda v: _is_int(v) and v >= 0, "a non-negative integer", path)
    ratios = _pool_table(doc, "ratios", path, pools, lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]")
    if abs(sum(ratios.values()) - 1.0) > 1e-9:
        raise ZipMoEError(f"{path}: field 'ratios' must sum to 1, got {sum(ratios.values()):.12g}")
    non_negative = (lambda v: _is_int(v) and v >= 0)
    capacities = _pool_table(doc, "capacities", path, pools, non_negative, "a non-negative integer")
    if sum(capacities.values()) > n_expert:
        raise ZipMoEError(f"{path}: field 'capacities' holds {sum(capacities.values())} experts per layer, "
                          f"more than n_expert={n_expert}")
    thresholds = _pool_table(doc, "thresholds", path, pools, non_negative, "a non-negative integer")
    expected = dict(zip(pools, itertools.accumulate(capacities[p] for p in pools)))
    for pool in pools:
        if thresholds[pool] != expected[pool] + delta:
            raise ZipMoEError(f"{path}: field 'thresholds.{pool}' must be the capacities up to {pool} plus delta, "
                              f"{expected[pool] + delta}, got {thresholds[pool]}")
    memory = _pool_table(doc, "memory_bytes", path, pools, non_negative, "a non-negative integer")
    if sum(memory.values()) > budget:
        raise ZipMoEError(f"{path}: field 'memory_bytes' totals {sum(memory.values())}, over budget_bytes={budget}")
    makespan = _require(doc, "expected_makespan_s", lambda v: _is_number(v) and v >= 0, "a non-negative number", path)
    selection = _require(doc, "selection_probabilities",
                         lambda v: isinstance(v, list) and len(v) == n_expert
                         and all(_is_number(x) and 0 <= x <= 1 for x in v),
                         f"a list of n_expert={n_expert} probabilities", path)
    meta = _require(doc, "meta", lambda v: isinstance(v, dict), "an object", path)
    result = PlanResult(pools=tuple(pools), ratios={p: float(ratios[p]) for p in pools}, capacities=capacities,
                        thresholds=thresholds, delta=delta, memory_bytes=memory, budget_bytes=budget,
                        n_layer_moe=n_layer_moe, n_expert=n_expert, k=k, expected_makespan_s=float(makespan),
                        selection_probabilities=tuple(float(x) for x in selection))
    return result, meta
