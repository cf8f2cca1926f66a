"""The pool planner as zipmoe-plan runs it: the profile's statistics on the Python side, the search in C.

The planner (ZipMoE paper section 3.4, Algorithms 2-4) splits a memory budget between the cache
pools F, C, S, E so that the expected makespan of a sparse layer is minimal. Its search is the
runtime's own, ggml-zipmoe's zipmoe-planner.c: ggml_zipmoe_plan_fit (the modified IPF of eq. (24))
and ggml_zipmoe_plan_pools (the grid search), which a model loaded with no pool options runs too.
This module holds what the C planner takes as given:

- rank_inclusion_probabilities, round_to_subset_size: a PROFILE's counts -> the rank-based marginal
  inclusion probabilities f_r and the experts per ubatch k;
- default_costs: the delays of Algorithm 3 from the runtime's default rates, when no COSTS is given;
- parse_pool_set, grid_steps: the pools Lambda and the grid of shares;

and plan, which runs the C planner and returns the PLAN (plan_files.PlanResult).

tests/planner.py is the reference implementation in numpy that tests/test_default_pools.py and
tests/test_planner.py hold the C planner to; it imports the helpers here, and nothing here imports
it. Ranks are 0-based: rank 0 is the most frequently activated expert of a layer. The pool names,
their hierarchy order and the default rates are libggml-zipmoe's, read on first use, so importing
this module loads no library.
"""
from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import numpy as np

from . import _lib
from .plan_files import Costs, PlanResult


def rank_inclusion_probabilities(counts: np.ndarray | Sequence[Sequence[int]], n_ubatches: int) -> np.ndarray:
    """The rank-based marginal inclusion probability list f_r of a profile.

    counts[l][e] is in how many of n_ubatches ubatches expert e of MoE layer l was selected. Each
    layer's counts are sorted non-increasing (rank 0 first, expert identities dropped: the
    rank-based abstraction), divided by n_ubatches, and the per-layer lists are averaged. The
    average is the pooled estimate of a rank profile shared by all layers, with every layer
    weighted equally since every layer saw the same ubatches; Algorithm 4 takes one list F_N for
    the sparse layer it models. For ubatches of one token each layer's counts sum to
    k * n_ubatches, so sum(f) == k.
    """
    table = np.asarray(counts, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] == 0 or table.shape[1] == 0:
        raise ValueError(f"counts must be a non-empty [n_layer_moe, n_expert] table, got shape {table.shape}")
    if n_ubatches <= 0:
        raise ValueError(f"n_ubatches must be positive, got {n_ubatches}")
    if not np.all(np.isfinite(table)) or table.min() < 0 or table.max() > n_ubatches:
        raise ValueError(f"counts must lie in [0, n_ubatches={n_ubatches}]")
    ranked = -np.sort(-table, axis=1)
    return ranked.mean(axis=0) / n_ubatches


def round_to_subset_size(f: np.ndarray | Sequence[float]) -> tuple[np.ndarray, int]:
    """(f', k): k = round(sum f), and f' = min(1, c * f) with c chosen so that sum f' == k.

    With ubatches of B > 1 tokens a layer loads the union of the experts its tokens select, whose
    size varies, so sum(f) (its mean) is not an integer. The paper's model selects exactly k
    experts, so the planner takes k as the mean union size rounded and rescales f proportionally,
    capping at 1 (an expert whose scaled probability would exceed 1 is always selected).
    """
    marginals = np.asarray(f, dtype=np.float64)
    k = int(round(float(marginals.sum())))
    if k < 1:
        raise ValueError(f"the inclusion probabilities sum to {marginals.sum():.6g}: no expert is ever selected")
    if k > np.count_nonzero(marginals):
        raise ValueError(f"only {np.count_nonzero(marginals)} experts were ever selected, fewer than k = {k}")
    order = np.argsort(-marginals, kind="stable")
    ranked = marginals[order]
    tail_sums = np.cumsum(ranked[::-1])[::-1]  # tail_sums[j] = sum of ranked[j:]
    # Find the number j of capped experts: c = (k - j) / sum(ranked[j:]) must leave ranked[j] uncapped.
    for capped in range(k):
        scale = (k - capped) / tail_sums[capped]
        if scale * ranked[capped] <= 1.0:
            break
    out = np.minimum(1.0, scale * marginals)
    out[order[:capped]] = 1.0
    return out, k


def default_costs(expert_bytes: Mapping[str, int], n_tensors_per_expert: int, n_shards: int) -> Costs:
    """Delays from the runtime's default machine rates (ggml_zipmoe_default_rate: O_DIRECT reads,
    decode + recover of BF16 output per thread) and the sizes of one expert: an SM chunk is
    expert_bytes["S"] / n, an E-chunk expert_bytes["E"] / (n K), and decompressing an E-chunk
    produces expert_bytes["F"] / (n K) bytes of BF16."""
    read, decode = _lib.default_rate(_lib.RATE_READ), _lib.default_rate(_lib.RATE_DECODE)
    per_tensor = n_tensors_per_expert
    return Costs(u_s=expert_bytes["S"] / per_tensor / read,
                 v_s=expert_bytes["E"] / (per_tensor * n_shards) / read,
                 c_s=expert_bytes["F"] / (per_tensor * n_shards) / decode)


def parse_pool_set(text: str) -> tuple[str, ...]:
    """"F,C,S,E"-style pool list -> the set Lambda of pools, in hierarchy order; ValueError on unknown or
    repeated pools."""
    hierarchy = _lib.pool_names()
    names = [name.strip().upper() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in hierarchy]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"pools must be distinct names among {','.join(hierarchy)}, got {text!r}")
    return tuple(p for p in hierarchy if p in names)


def grid_steps(grid: float) -> int:
    """How many steps of `grid` make 1; ValueError unless it divides 1."""
    steps = round(1.0 / grid) if 0 < grid <= 1 else 0
    if steps < 1 or abs(steps * grid - 1.0) > 1e-9:
        raise ValueError(f"the grid step must divide 1 (like 0.1 or 0.05), got {grid}")
    return steps


def check_plan_arguments(pools: Sequence[str], grid: float, budget_bytes: int, expert_bytes: Mapping[str, int],
                         threads: int, n_shards: int, n_tensors_per_expert: int, n_layer_moe: int,
                         delta: int) -> tuple[tuple[str, ...], int]:
    """(the pools Lambda in hierarchy order, grid steps) of a plan's arguments; ValueError naming the
    argument the planner cannot take (the runtime's planner and the reference check alike)."""
    chosen = parse_pool_set(",".join(pools))
    steps = grid_steps(grid)
    if budget_bytes <= 0 or n_layer_moe <= 0 or threads <= 0 or n_shards <= 0 or n_tensors_per_expert <= 0:
        raise ValueError("budget_bytes, n_layer_moe, threads, n_shards and n_tensors_per_expert must be positive")
    if delta < 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    for pool in chosen:
        if int(expert_bytes.get(pool, 0)) <= 0:
            raise ValueError(f"expert_bytes[{pool!r}] must be a positive byte count")
    return chosen, steps


def debiased_rank_profile(f: np.ndarray | Sequence[float], n_steps: int, k: int) -> np.ndarray:
    """A rank profile counted over n_steps one-token steps, less the excess a uniform router's top ranks show
    over that many steps by chance (ggml_zipmoe_plan_debias_profile): a PROFILE has only total counts. The
    runtime's re-plan keeps its steps' counts in two halves and cross-fits them instead."""
    ranked = np.array(f, dtype=np.float64)
    if ranked.size == 0 or _lib.lib().ggml_zipmoe_plan_debias_profile(
            n_steps, ranked.size, k, ranked.ctypes.data_as(ctypes.POINTER(ctypes.c_double))) != _lib.OK:
        raise ValueError(f"a rank profile of {ranked.size} experts over {n_steps} steps cannot be debiased "
                         f"with k = {k}: the steps must be positive and 1 <= k <= the experts")
    return ranked


def fit_selection_probabilities(f: np.ndarray | Sequence[float], k: int) -> np.ndarray:
    """The runtime's modified IPF (ggml_zipmoe_plan_fit, eq. (24)): selection probabilities q_r whose
    conditional Bernoulli distribution on k-sets has the inclusion probabilities f."""
    marginals = np.ascontiguousarray(f, dtype=np.float64)
    n = marginals.size
    q = (ctypes.c_double * n)()
    given = marginals.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
    if n == 0 or _lib.lib().ggml_zipmoe_plan_fit(given, n, k, q) != _lib.OK:
        raise ValueError(f"no selection probabilities reproduce these inclusion probabilities with k = {k}: "
                         f"each must lie in [0, 1] and they must sum to k (they sum to {marginals.sum():.12g}), "
                         "fewer than k of them 1 and more than k non-zero; or the modified IPF did not converge")
    return np.array(q)


def plan(f: np.ndarray | Sequence[float], k: int, budget_bytes: int, expert_bytes: Mapping[str, int],
         pools: Sequence[str], costs: Costs, threads: int, n_shards: int, n_tensors_per_expert: int,
         n_layer_moe: int, grid: float = 0.1, delta: int = 0) -> PlanResult:
    """Algorithm 4 by the runtime's C planner: the memory ratios of the pools Lambda minimising the
    expected makespan of a sparse layer.

    f: rank-based inclusion probabilities (sum k), fitted to selection probabilities by
    ggml_zipmoe_plan_fit; budget_bytes: memory for the expert cache of all n_layer_moe MoE layers;
    expert_bytes[p]: bytes of one expert in pool p's state; pools: Lambda; costs, threads (L),
    n_shards (K), n_tensors_per_expert (n): as in Algorithm 3; grid: the step of the memory ratios
    (must divide 1); delta: the dispatch tolerance in ranks, added to every threshold. ValueError
    for arguments the planner cannot take.

    Where partitions have exactly the same expected makespan (without F, say, when decompression
    bounds every hit pattern) the rounding of the sums picks one, and C sums in another order than
    the reference (tests/planner.py): their plans can then differ, at the same expected makespan.
    """
    chosen, steps = check_plan_arguments(pools, grid, budget_bytes, expert_bytes, threads, n_shards,
                                         n_tensors_per_expert, n_layer_moe, delta)
    q = fit_selection_probabilities(f, k)
    params = _lib.PlanParams(n_expert=q.size, k=k, budget=budget_bytes, u=costs.u_s, v=costs.v_s, c=costs.c_s,
                             threads=threads, n_shards=n_shards, n_tensors=n_tensors_per_expert,
                             n_layer=n_layer_moe, grid_steps=steps)
    selection = (ctypes.c_double * q.size)(*q)
    params.q = selection
    for i, pool in enumerate(_lib.pool_names()):
        params.entry_bytes[i] = int(expert_bytes[pool]) if pool in chosen else 0  # 0: not in Lambda
    found = _lib.PlanResult()
    if _lib.lib().ggml_zipmoe_plan_pools(ctypes.byref(params), ctypes.byref(found)) != _lib.OK:
        raise ValueError(f"the planner refuses these inputs (k = {k} of {q.size} experts, budget {budget_bytes}, "
                         f"{n_layer_moe} MoE layers): no k-set of experts can be selected, or a size is out of range")
    capacities = {p: int(found.capacity[_lib.pool_names().index(p)]) for p in chosen}
    thresholds, ranks = {}, 0
    for pool in chosen:
        ranks += capacities[pool]
        thresholds[pool] = ranks + delta
    return PlanResult(
        pools=chosen, ratios={p: found.grid_share[_lib.pool_names().index(p)] / steps for p in chosen}, capacities=capacities,
        thresholds=thresholds, delta=delta,
        memory_bytes={p: capacities[p] * int(expert_bytes[p]) * n_layer_moe for p in chosen},
        budget_bytes=budget_bytes, n_layer_moe=n_layer_moe, n_expert=q.size, k=k,
        expected_makespan_s=float(found.expected_makespan_s), selection_probabilities=tuple(float(x) for x in q))
