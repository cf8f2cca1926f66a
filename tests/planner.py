"""The reference pool planner (ZipMoE paper section 3.4, Appendices C and D) in numpy: the algorithms
the runtime's C planner (ggml-zipmoe/src/policy/zipmoe-planner.c) is held to.

zipmoe-plan and a model loaded with no pool options run the C planner (zipmoe_py/plan_math.py calls
it); tests/test_default_pools.py and tests/test_planner.py check that it chooses as this module
does, and tests/test_planner.py checks this module against brute force. Like tests/sched_sim.py it is
test code: no module of zipmoe_py imports it.

The expert cache is split into pools holding experts in different compression states, in the
hierarchy F < C < S < E:

    F  full BF16 tensors                      a hit costs nothing
    C  compressed tensors (SM + E-chunks)     a hit costs decompression only
    S  sign+mantissa chunks (SM) only         a hit costs the E-chunk reads and decompression
    E  compressed exponent chunks only        a hit costs the SM read and decompression
    M  (virtual miss pool, the tail)          a miss costs both reads and decompression

The planner chooses the share of the memory budget of each pool in a chosen subset Lambda of
{F, C, S, E} (Algorithm 4) by minimising the expected makespan of a sparse layer:

1. plan_math.rank_inclusion_probabilities: the profiled activation counts become the rank-based
   marginal inclusion probabilities f_r (the probability that the r-th most popular expert of a
   layer is among the k experts a ubatch selects).
2. ipf: the modified iterative proportional fitting of eq. (24) turns f into the selection
   probabilities q_r such that independent Bernoulli(q_r) trials, conditioned on exactly k
   successes, select k-sets S with probability proportional to prod_{r in S} q_r/(1-q_r) and
   reproduce the marginals f. This is the maximum-entropy distribution over k-sets with marginals
   f (Theorem D.1).
3. hit_distribution (Algorithm 2): the Poisson-binomial distribution Phi of the number of hits in
   a rank interval.
4. estimate_makespan (Algorithm 3): the makespan of one hit pattern (h_F, h_C, h_S, h_E).
5. plan (Algorithm 4): a grid search over memory ratios; every configuration packs the pools onto
   consecutive rank intervals in hierarchy order and sums the makespan of every hit pattern h,
   weighted by P(h | k selected) = Phi_M(k_rem) / Phi_N(k) * prod_p Phi_p(h_p).

Ranks are 0-based: rank 0 is the most frequently activated expert of a layer. Pool capacities
S_p count experts per MoE layer (the paper's ranks are per sparse layer, and every layer gets the
same partition); the budget covers all MoE layers, so pool p holds S_p * n_layer_moe experts.
The runtime dispatches an expert of observed rank r to the first pool p of Lambda (in hierarchy
order) with r < tau_p = sum_{j <= p} S_j + delta; ranks beyond every threshold are not cached.

The pool names and their hierarchy order are C's (ggml_zipmoe_pool_name). The pool set, the grid
and the capacities of a grid point are zipmoe_py/plan_math.py's (the runtime's, defined once).
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from zipmoe_py import _lib
from zipmoe_py.plan_files import Costs, PlanResult
from zipmoe_py.plan_math import check_plan_arguments


# ---------------------------------------------------------------------------------------------
# Workload model: the modified IPF, the Poisson-binomial DP
# ---------------------------------------------------------------------------------------------

def hit_distribution(q: np.ndarray | Sequence[float]) -> np.ndarray:
    """Algorithm 2: Phi_S(h), h = 0..|S|, the probability of exactly h hits among independent
    Bernoulli(q_r) trials (a Poisson binomial distribution). Test-only, with expected_makespan_nested:
    plan runs interval_hit_table, Algorithm 2 for every rank interval at once.

    The paper's inner loop over h = |S| .. 1 updates in place from high to low so that each
    update reads the previous round's Phi(h - 1); the vector update below reads the previous
    round's values too.
    """
    probs = np.asarray(q, dtype=np.float64)
    phi = np.zeros(probs.size + 1)
    phi[0] = 1.0
    for q_r in probs:
        phi[1:] = phi[1:] * (1.0 - q_r) + phi[:-1] * q_r
        phi[0] *= 1.0 - q_r
    return phi


def conditional_inclusion_probabilities(q: np.ndarray, k: int) -> np.ndarray:
    """P(X_i = 1 | sum X = k) for independent X_i ~ Bernoulli(q_i): the f_i^(t) of eq. (24).

    f_i = w_i R(k-1, N \\ {i}) / R(k, N) with w_i = q_i / (1 - q_i); multiplying numerator and
    denominator by prod(1 - q) turns the elementary symmetric polynomials R into Poisson-binomial
    probabilities, which lie in [0, 1] and so neither overflow nor need rescaling. R(k-1, N \\ {i})
    comes from prefix and suffix DPs (sums of non-negative terms only, no cancelling
    subtraction), truncated at k hits.
    """
    n = q.size
    prefix = np.zeros((n + 1, k + 1))  # prefix[i, h]: P(h hits among the first i experts)
    suffix = np.zeros((n + 2, k + 1))  # suffix[i, h]: P(h hits among experts i .. n-1)
    prefix[0, 0] = suffix[n, 0] = 1.0
    for i in range(n):
        prefix[i + 1, 1:] = prefix[i, 1:] * (1.0 - q[i]) + prefix[i, :-1] * q[i]
        prefix[i + 1, 0] = prefix[i, 0] * (1.0 - q[i])
    for i in range(n - 1, -1, -1):
        suffix[i, 1:] = suffix[i + 1, 1:] * (1.0 - q[i]) + suffix[i + 1, :-1] * q[i]
        suffix[i, 0] = suffix[i + 1, 0] * (1.0 - q[i])
    # P(k-1 hits among the others of i) = sum_a prefix[i, a] * suffix[i+1, k-1-a]
    others = np.einsum("ia,ia->i", prefix[:n, :k], suffix[1:n + 1, k - 1::-1])
    return q * others / prefix[n, k]


def _normalized_selection_probabilities(log_weights: np.ndarray, k: int) -> np.ndarray:
    """q_i = c w_i / (1 + c w_i) with the scale c chosen so that sum(q) == k.

    Weights are defined up to a scale (BM94); every scale gives the same conditional
    distribution. Choosing sum(q) == k makes the unconditional expected count equal k, so
    Phi_N(k) is near its maximum and the DPs of Algorithm 2 stay well conditioned.
    """
    def excess(shift: float) -> tuple[float, float]:
        q = 1.0 / (1.0 + np.exp(-(log_weights + shift)))
        return float(q.sum()) - k, float((q * (1.0 - q)).sum())

    # Safeguarded Newton on the increasing function excess(log c), kept inside a bracket: at
    # `low` every q_i <= k/n, at `high` every q_i >= k/n.
    logit_mean = math.log(k / (log_weights.size - k))
    low, high = logit_mean - float(log_weights.max()), logit_mean - float(log_weights.min())
    shift = 0.5 * (low + high)
    for _ in range(200):
        value, slope = excess(shift)
        if abs(value) <= 1e-12 * k or high - low <= 1e-15 * max(1.0, abs(shift)):
            break  # any scale is exact for the conditional model; this one only has to be close
        if value > 0:
            high = shift
        else:
            low = shift
        step = shift - value / slope if slope > 0 else math.nan
        shift = step if low < step < high else 0.5 * (low + high)
    return 1.0 / (1.0 + np.exp(-(log_weights + shift)))


@dataclass(frozen=True)
class IPFResult:
    """The fitted selection model of eq. (24).

    selection_probabilities: q_r, the paper's P_N, by rank; conditioning independent
        Bernoulli(q_r) trials on exactly k successes gives inclusion probabilities f.
    weights: w_r = q_r / (1 - q_r), the BM94 weights (P(S) proportional to prod_{r in S} w_r),
        normalized so that sum(q) == k; 0 where f_r == 0, inf where f_r == 1.
    iterations: IPF iterations run.
    max_error: max_r |f_r^(t) - f_r| at the returned weights.
    """

    selection_probabilities: np.ndarray
    weights: np.ndarray
    iterations: int
    max_error: float


def ipf(f: np.ndarray | Sequence[float], k: int, tol: float = 1e-10, max_iter: int = 100_000,
        sum_tol: float = 1e-8) -> IPFResult:
    """The modified iterative proportional fitting of eq. (24) (BM94).

    Finds weights w such that choosing a k-set S with probability proportional to
    prod_{i in S} w_i (the conditional Bernoulli distribution, the maximum-entropy distribution
    with these marginals) has inclusion probabilities f. Starting from w^(0) = f it iterates
    w_i <- w_i * f_i / f_i^(t) until max_i |f_i^(t) - f_i| <= tol.

    The paper relates its selection probabilities q_r to the weights through
    lambda_i = log(q_i / (1 - q_i)) and P(S) proportional to exp(sum_{i in S} lambda_i) (proof of
    Theorem D.1, eq. (22)), so w_i is proportional to q_i / (1 - q_i), i.e.
    q_i = c w_i / (1 + c w_i); the scale c is fixed by sum(q) == k (see IPFResult).

    f_i == 0 (never selected) gives w_i = q_i = 0 and f_i == 1 (always selected) gives q_i = 1,
    w_i = inf; the IPF runs on the other experts with k reduced by the number of ones. Raises
    ValueError if f is infeasible: some f_i outside [0, 1], |sum f - k| > sum_tol * max(k, 1),
    or the fit not reaching tol in max_iter iterations. Within sum_tol the free marginals are
    rescaled to sum exactly to their share of k, since no distribution matches inconsistent
    targets (max_error is measured against the rescaled marginals).

    The iteration converges linearly; the error of an expert with f_i near 1 shrinks only by a
    factor of about f_i per iteration, so marginals like 0.999 take thousands of iterations.
    """
    targets = np.asarray(f, dtype=np.float64)
    n = targets.size
    if targets.ndim != 1 or n == 0:
        raise ValueError(f"the inclusion probabilities must be a non-empty list, got shape {targets.shape}")
    if not 1 <= k <= n:
        raise ValueError(f"k = {k} experts cannot be selected out of {n}")
    if not np.all(np.isfinite(targets)) or targets.min() < 0.0 or targets.max() > 1.0:
        raise ValueError("inclusion probabilities must lie in [0, 1]; "
                         f"got min {targets.min():.6g}, max {targets.max():.6g}")
    if abs(targets.sum() - k) > sum_tol * max(k, 1):
        raise ValueError(f"inclusion probabilities sum to {targets.sum():.12g}, not k = {k}: "
                         "every selection has exactly k experts")
    always, never = targets == 1.0, targets == 0.0
    free = ~(always | never)
    k_free = k - int(always.sum())
    q = np.where(always, 1.0, 0.0)
    weights = np.where(always, np.inf, 0.0)
    if not free.any():
        return IPFResult(q, weights, 0, 0.0)
    free_targets = targets[free]
    if not 0 < k_free < free_targets.size:
        raise ValueError(f"{int(always.sum())} experts have inclusion probability 1 and {free_targets.size} lie "
                         f"strictly between 0 and 1: no k = {k} selection matches them")
    free_targets = free_targets * (k_free / free_targets.sum())
    if free_targets.max() >= 1.0:
        raise ValueError("inclusion probabilities close to 1 do not sum to k consistently")
    log_weights = np.log(free_targets)  # w^(0) = f
    for iteration in range(max_iter + 1):
        q_free = _normalized_selection_probabilities(log_weights, k_free)
        fitted = conditional_inclusion_probabilities(q_free, k_free)
        error = float(np.abs(fitted - free_targets).max())
        if error <= tol:
            q[free] = q_free
            weights[free] = q_free / (1.0 - q_free)
            return IPFResult(q, weights, iteration, error)
        log_weights += np.log(free_targets) - np.log(fitted)
    raise ValueError(f"the modified IPF did not converge in {max_iter} iterations (max error {error:.3g} > {tol:g}); "
                     "the inclusion probabilities are too close to 0 or 1")


# ---------------------------------------------------------------------------------------------
# Algorithm 3: makespan of one hit pattern
# ---------------------------------------------------------------------------------------------

def _hits_tuple(hits: Mapping[str, int] | Sequence[int]) -> tuple[int, ...]:
    pools = _lib.pool_names()
    if isinstance(hits, Mapping):
        unknown = set(hits) - set(pools)
        if unknown:
            raise ValueError(f"unknown cache pools {sorted(unknown)}; the pools are {', '.join(pools)}")
        values = tuple(int(hits.get(p, 0)) for p in pools)
    else:
        values = tuple(int(h) for h in hits)
        if len(values) != len(pools):
            raise ValueError(f"a hit pattern has {len(pools)} counts (h_F, h_C, h_S, h_E), got {len(values)}")
    return values


def estimate_makespan(k: int, hits: Mapping[str, int] | Sequence[int], c: float, v: float, u: float,
                      threads: int, n_shards: int, n_tensors_per_expert: int) -> float:
    """Algorithm 3: the estimated makespan of a sparse layer for a hit pattern.

    k: experts selected; hits: (h_F, h_C, h_S, h_E) or a dict over the pools (missing pools 0);
    c: one E-chunk decompression delay; v: one E-chunk read delay; u: one SM-chunk read delay;
    threads: L decompression threads; n_shards: K E-chunks per tensor; n_tensors_per_expert: n.
    Reads of E-chunks are charged to the decompression threads too (the paper's heuristic in
    place of simulating Algorithm 1); the estimate is max(I/O time, decompression time / L).
    """
    h_f, h_c, h_s, h_e = _hits_tuple(hits)
    if min(h_f, h_c, h_s, h_e) < 0 or h_f + h_c + h_s + h_e > k:
        raise ValueError(f"hit pattern {(h_f, h_c, h_s, h_e)} is not possible with k = {k} selected experts")
    n, big_k = n_tensors_per_expert, n_shards
    n_sm = n * (k - (h_f + h_c + h_s))  # SM chunks to read: misses and E-pool hits
    n_e = n * big_k * (k - (h_f + h_c + h_e))  # E-chunks to read: misses and S-pool hits
    io_time = n_sm * u + n_e * v
    n_decode = n * big_k * (k - h_f)  # every expert not held in full is decompressed
    decompression_time = (n_e * v + n_decode * c) / threads
    return max(io_time, decompression_time)


@dataclass(frozen=True)
class HitPatterns:
    """Every possible hit pattern given k selected experts, with its Algorithm 3 makespan.

    hits: [P, 4] rows (h_F, h_C, h_S, h_E) with sum <= k; remaining: [P] k_rem = k - sum;
    makespan: [P] seconds.
    """

    k: int
    hits: np.ndarray
    remaining: np.ndarray
    makespan: np.ndarray


def hit_patterns(k: int, costs: Costs, threads: int, n_shards: int, n_tensors_per_expert: int) -> HitPatterns:
    """The hit patterns with at most k hits (the only ones of non-zero probability) and their
    makespans; they do not depend on the partition, so Algorithm 4 computes them once."""
    n_pools = len(_lib.pool_names())
    rows = [pattern for pattern in itertools.product(range(k + 1), repeat=n_pools) if sum(pattern) <= k]
    makespans = [estimate_makespan(k, pattern, costs.c_s, costs.v_s, costs.u_s, threads, n_shards,
                                   n_tensors_per_expert) for pattern in rows]
    hits = np.array(rows, dtype=np.intp)
    return HitPatterns(k=k, hits=hits, remaining=k - hits.sum(axis=1), makespan=np.array(makespans))


# ---------------------------------------------------------------------------------------------
# Algorithm 4: expected makespan of a partition, grid search
# ---------------------------------------------------------------------------------------------

def _pool_intervals(capacities: Mapping[str, int], n_expert: int) -> dict[str, tuple[int, int]]:
    """The rank interval [start, stop) of every pool, packed in hierarchy order, and of "M"."""
    intervals, start = {}, 0
    for pool in _lib.pool_names():
        stop = start + capacities.get(pool, 0)
        intervals[pool] = (start, stop)
        start = stop
    if start > n_expert:
        raise ValueError(f"the pools hold {start} experts per layer, more than the {n_expert} a layer has")
    intervals["M"] = (start, n_expert)
    return intervals


def interval_hit_table(q: np.ndarray, max_hits: int) -> np.ndarray:
    """Algorithm 2 for every rank interval at once: table[a, b, h] = Phi_[a, b)(h) for h <= max_hits.

    Running Algorithm 2 from rank a, its state after rank b - 1 is the distribution of the
    interval [a, b); one pass over the ranks advances the runs from every start together.
    table[0, N] is the global DP of Algorithm 4, line 13.
    """
    n = q.size
    table = np.zeros((n + 1, n + 1, max_hits + 1))
    table[np.arange(n + 1), np.arange(n + 1), 0] = 1.0  # empty intervals: no hits
    for b in range(n):
        previous = table[:b + 1, b]
        table[:b + 1, b + 1, 1:] = previous[:, 1:] * (1.0 - q[b]) + previous[:, :-1] * q[b]
        table[:b + 1, b + 1, 0] = previous[:, 0] * (1.0 - q[b])
    return table


def expected_makespan(interval_hits: np.ndarray, capacities: Mapping[str, int], patterns: HitPatterns) -> float:
    """Algorithm 4, lines 8-29, vectorised: the sum over hit patterns h of
    makespan(h) * Phi_M(k_rem) / Phi_N(k) * prod_p Phi_p(h_p).

    interval_hits: interval_hit_table(q, k); capacities: S_p per pool (missing pools hold
    nothing); patterns: hit_patterns(k, ...). The paper's four nested loops visit the patterns
    with k_rem >= 0, each Phi_p(h_p) with h_p <= k, so Phi truncated at k hits suffices; an
    interval shorter than h has Phi(h) = 0 there. expected_makespan_nested is the literal version.
    """
    n_expert, k = interval_hits.shape[0] - 1, patterns.k
    intervals = _pool_intervals(capacities, n_expert)
    probability = interval_hits[intervals["M"]][patterns.remaining]
    for column, pool in enumerate(_lib.pool_names()):
        probability = probability * interval_hits[intervals[pool]][patterns.hits[:, column]]
    return float(patterns.makespan @ probability / interval_hits[0, n_expert, k])


def expected_makespan_nested(q: np.ndarray, capacities: Mapping[str, int], k: int, costs: Costs, threads: int,
                             n_shards: int, n_tensors_per_expert: int) -> float:
    """Algorithm 4, lines 8-29, literally: untruncated Algorithm 2 per pool and four nested loops.

    Test-only: the reference the tests hold expected_makespan (what plan uses) to. Line 20
    (Algorithm 3) is evaluated after the k_rem < 0 test of lines 21-24, which discards its value
    anyway, since Algorithm 3 has no meaning for more than k hits. Phi_M(k_rem) is 0 when the
    miss pool has fewer than k_rem ranks.
    """
    intervals = _pool_intervals(capacities, q.size)
    pools = _lib.pool_names()
    phi = {p: hit_distribution(q[slice(*intervals[p])]) for p in (*pools, "M")}
    phi_n = hit_distribution(q)
    s_f, s_c, s_s, s_e = (intervals[p][1] - intervals[p][0] for p in pools)
    cost = 0.0
    for h_f in range(s_f + 1):
        for h_c in range(s_c + 1):
            for h_s in range(s_s + 1):
                for h_e in range(s_e + 1):
                    k_rem = k - (h_f + h_c + h_s + h_e)
                    if k_rem < 0:
                        break
                    delay = estimate_makespan(k, (h_f, h_c, h_s, h_e), costs.c_s, costs.v_s, costs.u_s, threads,
                                              n_shards, n_tensors_per_expert)
                    phi_m = phi["M"][k_rem] if k_rem < phi["M"].size else 0.0
                    cost += (delay * phi_m / phi_n[k] * phi["F"][h_f] * phi["C"][h_c] * phi["S"][h_s]
                             * phi["E"][h_e])
    return cost


def grid_points(n_pools: int, steps: int) -> Iterator[tuple[int, ...]]:
    """Every split of `steps` grid steps over n_pools pools, in the order Algorithm 4 visits them (C's
    walk in zipmoe-planner.c too): the first pool's largest share first, so all to the first pool first."""
    if n_pools == 1:
        yield (steps,)
        return
    for first in range(steps, -1, -1):
        for rest in grid_points(n_pools - 1, steps - first):
            yield (first, *rest)


def grid_capacities(point: Sequence[int], pools: Sequence[str], steps: int, budget_bytes: int,
                    expert_bytes: Mapping[str, int], n_layer_moe: int, n_expert: int) -> dict[str, int]:
    """S_p of a grid point: floor(share_p * budget / (steps * expert_bytes[p] * n_layer_moe)) experts per
    layer, packed in hierarchy order, each pool capped at the ranks the earlier pools left."""
    capacities, free_ranks = {}, n_expert
    for pool, share in zip(pools, point):
        fits = share * budget_bytes // (steps * int(expert_bytes[pool]) * n_layer_moe)
        capacities[pool] = min(fits, free_ranks)
        free_ranks -= capacities[pool]
    return capacities


def plan(f: np.ndarray | Sequence[float], k: int, budget_bytes: int, expert_bytes: Mapping[str, int],
         pools: Sequence[str], costs: Costs, threads: int, n_shards: int, n_tensors_per_expert: int,
         n_layer_moe: int, grid: float = 0.1, delta: int = 0) -> PlanResult:
    """Algorithm 4: the memory ratios of the pools Lambda minimising the expected makespan.

    f: rank-based inclusion probabilities (sum k); budget_bytes: memory for the expert cache of
    all n_layer_moe MoE layers; expert_bytes[p]: bytes of one expert in pool p's state;
    pools: Lambda; costs, threads (L), n_shards (K), n_tensors_per_expert (n): as in Algorithm 3;
    grid: the step of the memory ratios (must divide 1); delta: the dispatch tolerance in ranks.

    Each grid point gamma gives S_p = floor(gamma_p * budget / (expert_bytes[p] * n_layer_moe))
    experts per layer (grid_capacities); packing in hierarchy order caps a pool at the
    ranks the earlier pools left, so the pools never hold more than the n_expert experts of a
    layer. Ties keep the earlier grid point (grid_points' order), the first being all
    memory in the first pool of Lambda (the paper's initial gamma = (1, 0, 0, 0) when F is in Lambda).
    """
    chosen, steps = check_plan_arguments(pools, grid, budget_bytes, expert_bytes, threads, n_shards,
                                         n_tensors_per_expert, n_layer_moe, delta)
    q = ipf(f, k).selection_probabilities  # Algorithm 4, line 4
    n_expert = q.size
    interval_hits = interval_hit_table(q, k)  # Algorithm 2 for every interval a pool or M can take
    patterns = hit_patterns(k, costs, threads, n_shards, n_tensors_per_expert)
    cost_of: dict[tuple[int, ...], float] = {}  # grid points often floor to the same capacities
    best: tuple[float, tuple[int, ...], dict[str, int]] | None = None
    for point in grid_points(len(chosen), steps):
        capacities = grid_capacities(point, chosen, steps, budget_bytes, expert_bytes, n_layer_moe, n_expert)
        key = tuple(capacities.values())
        if key not in cost_of:
            cost_of[key] = expected_makespan(interval_hits, capacities, patterns)
        if best is None or cost_of[key] < best[0]:
            best = (cost_of[key], point, capacities)
    cost, point, capacities = best
    thresholds, ranks = {}, 0
    for pool in chosen:
        ranks += capacities[pool]
        thresholds[pool] = ranks + delta
    return PlanResult(
        pools=chosen, ratios={p: share / steps for p, share in zip(chosen, point)}, capacities=capacities,
        thresholds=thresholds, delta=delta,
        memory_bytes={p: capacities[p] * int(expert_bytes[p]) * n_layer_moe for p in chosen},
        budget_bytes=budget_bytes, n_layer_moe=n_layer_moe, n_expert=n_expert, k=k,
        expected_makespan_s=cost, selection_probabilities=tuple(float(x) for x in q))
