"""zipmoe-plan: ZipMoE's hierarchical cache-pool planner (paper section 3.4, Appendices C and D).

The expert cache is split into pools holding experts in different compression states, in the
hierarchy F < C < S < E:

    F  full BF16 tensors                      a hit costs nothing
    C  compressed tensors (SM + E-chunks)     a hit costs decompression only
    S  sign+mantissa chunks (SM) only         a hit costs the E-chunk reads and decompression
    E  compressed exponent chunks only        a hit costs the SM read and decompression
    M  (virtual miss pool, the tail)          a miss costs both reads and decompression

The planner chooses the share of the memory budget of each pool in a chosen subset Lambda of
{F, C, S, E} (Algorithm 4) by minimising the expected makespan of a sparse layer:

1. rank_inclusion_probabilities: the profiled activation counts become the rank-based marginal
   inclusion probabilities f_r (the probability that the r-th most popular expert of a layer is
   among the k experts a ubatch selects).
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

File formats (JSON; every file carries "format" and "version": 1)

PROFILE (written by zipmoe-profile):
    {"format": "zipmoe-profile", "version": 1,
     "model": str,                   # model name or path, for the record
     "n_layer_moe": int,             # number of sparse (MoE) layers
     "n_expert": int,                # routed experts per layer, N
     "n_expert_used": int,           # experts each token selects per layer, k
     "expert_bytes": {"F": int,      # one expert as full BF16 tensors
                      "C": int,      # one expert compressed: SM bytes + compressed E bytes
                      "S": int,      # one expert's SM chunks
                      "E": int},     # one expert's compressed E-chunks
     "n_tensors_per_expert": int,    # n, 3 (gate, up, down)
     "n_shards": int,                # K, E-chunks per tensor
     "batches": {"B": {"n_ubatches": int,   # ubatches of B tokens profiled
                       "counts": [[int] * n_expert] * n_layer_moe}}}
                                     # counts[l][e]: in how many ubatches expert e of MoE layer l
                                     # was selected by at least one token

COSTS (optional; measured delays of the target machine):
    {"format": "zipmoe-costs", "version": 1,
     "u_s": float,       # u: reading one tensor's SM chunk, seconds
     "v_s": float,       # v: reading one E-chunk, seconds
     "c_s": float,       # c: decompressing (and recovering) one E-chunk, seconds
     "threads": int}     # L: decompression threads
    Without a costs file the delays follow from the profile's expert_bytes and measured machine
    rates: O_DIRECT reads at 1.4 GB/s and fhuf decode + recover at 3.2 GB/s of BF16 output per
    core (default_costs). For an expert tensor of 2048x1408 BF16 with K = 5 shards compressing
    to 0.32 of their exponent bytes this gives u = 2.06 ms, v = 0.132 ms, c = 0.360 ms.

PLAN (written by zipmoe-plan, read by load_plan):
    {"format": "zipmoe-plan", "version": 1,
     "pools": ["F", ...],              # Lambda, in hierarchy order
     "ratios": {"F": float, ...},      # gamma_p for every pool in Lambda, summing to 1
     "capacities": {"F": int, ...},    # S_p, experts per MoE layer
     "thresholds": {"F": int, ...},    # tau_p = sum_{j <= p} S_j + delta, ranks are 0-based
     "delta": int,                     # the dispatch tolerance margin, in ranks
     "memory_bytes": {"F": int, ...},  # bytes pool p takes over all MoE layers
     "budget_bytes": int, "n_layer_moe": int, "n_expert": int, "k": int,
     "expected_makespan_s": float,     # the minimised expected makespan of one sparse layer
     "selection_probabilities": [float] * n_expert,   # q_r from the IPF, by rank
     "meta": {...}}                    # provenance: model, profile, batch size, costs, grid, ...
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ZipMoEError

POOLS = ("F", "C", "S", "E")  # the cache hierarchy F < C < S < E
PROFILE_FORMAT, COSTS_FORMAT, PLAN_FORMAT = "zipmoe-profile", "zipmoe-costs", "zipmoe-plan"
FORMAT_VERSION = 1

# Measured on the target machine; default_costs turns them into per-chunk delays.
DISK_BYTES_PER_S = 1.4e9  # O_DIRECT reads
DECODE_BF16_BYTES_PER_S = 3.2e9  # fhuf decode + recover, BF16 output bytes per core


# ---------------------------------------------------------------------------------------------
# Workload model: inclusion probabilities, the modified IPF, the Poisson-binomial DP
# ---------------------------------------------------------------------------------------------

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


def hit_distribution(q: np.ndarray | Sequence[float]) -> np.ndarray:
    """Algorithm 2: Phi_S(h), h = 0..|S|, the probability of exactly h hits among independent
    Bernoulli(q_r) trials (a Poisson binomial distribution).

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

@dataclass(frozen=True)
class Costs:
    """Average delays from offline profiling, seconds: u (read one tensor's SM chunk), v (read
    one E-chunk), c (decompress and recover one E-chunk)."""

    u_s: float
    v_s: float
    c_s: float


def default_costs(expert_bytes: Mapping[str, int], n_tensors_per_expert: int, n_shards: int) -> Costs:
    """Delays from the measured machine rates (DISK_BYTES_PER_S, DECODE_BF16_BYTES_PER_S) and the
    sizes of one expert: an SM chunk is expert_bytes["S"] / n, an E-chunk expert_bytes["E"] / (n K),
    and decompressing an E-chunk produces expert_bytes["F"] / (n K) bytes of BF16."""
    per_tensor = n_tensors_per_expert
    return Costs(u_s=expert_bytes["S"] / per_tensor / DISK_BYTES_PER_S,
                 v_s=expert_bytes["E"] / (per_tensor * n_shards) / DISK_BYTES_PER_S,
                 c_s=expert_bytes["F"] / (per_tensor * n_shards) / DECODE_BF16_BYTES_PER_S)


def _hits_tuple(hits: Mapping[str, int] | Sequence[int]) -> tuple[int, ...]:
    if isinstance(hits, Mapping):
        unknown = set(hits) - set(POOLS)
        if unknown:
            raise ValueError(f"unknown cache pools {sorted(unknown)}; the pools are {', '.join(POOLS)}")
        values = tuple(int(hits.get(p, 0)) for p in POOLS)
    else:
        values = tuple(int(h) for h in hits)
        if len(values) != len(POOLS):
            raise ValueError(f"a hit pattern has {len(POOLS)} counts (h_F, h_C, h_S, h_E), got {len(values)}")
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
    rows = [pattern for pattern in itertools.product(range(k + 1), repeat=len(POOLS)) if sum(pattern) <= k]
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
    for pool in POOLS:
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
    for column, pool in enumerate(POOLS):
        probability = probability * interval_hits[intervals[pool]][patterns.hits[:, column]]
    return float(patterns.makespan @ probability / interval_hits[0, n_expert, k])


def expected_makespan_nested(q: np.ndarray, capacities: Mapping[str, int], k: int, costs: Costs, threads: int,
                             n_shards: int, n_tensors_per_expert: int) -> float:
    """Algorithm 4, lines 8-29, literally: untruncated Algorithm 2 per pool and four nested loops.

    The reference for expected_makespan. Line 20 (Algorithm 3) is evaluated after the k_rem < 0
    test of lines 21-24, which discards its value anyway, since Algorithm 3 has no meaning for
    more than k hits. Phi_M(k_rem) is 0 when the miss pool has fewer than k_rem ranks.
    """
    intervals = _pool_intervals(capacities, q.size)
    phi = {p: hit_distribution(q[slice(*intervals[p])]) for p in (*POOLS, "M")}
    phi_n = hit_distribution(q)
    s_f, s_c, s_s, s_e = (intervals[p][1] - intervals[p][0] for p in POOLS)
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


@dataclass(frozen=True)
class PlanResult:
    """The chosen cache partition.

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


def parse_pools(text: str) -> tuple[str, ...]:
    """"F,C,S,E"-style pool list -> the pools in hierarchy order; ValueError on unknown or repeated pools."""
    names = [name.strip().upper() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in POOLS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"pools must be distinct names among {','.join(POOLS)}, got {text!r}")
    return tuple(p for p in POOLS if p in names)


def _grid_points(n_pools: int, steps: int) -> Iterator[tuple[int, ...]]:
    """Every split of `steps` grid steps over n_pools pools, starting with all to the first pool."""
    if n_pools == 1:
        yield (steps,)
        return
    for first in range(steps, -1, -1):
        for rest in _grid_points(n_pools - 1, steps - first):
            yield (first, *rest)


def _grid_steps(grid: float) -> int:
    steps = round(1.0 / grid) if 0 < grid <= 1 else 0
    if steps < 1 or abs(steps * grid - 1.0) > 1e-9:
        raise ValueError(f"the grid step must divide 1 (like 0.1 or 0.05), got {grid}")
    return steps


def plan(f: np.ndarray | Sequence[float], k: int, budget_bytes: int, expert_bytes: Mapping[str, int],
         pools: Sequence[str], costs: Costs, threads: int, n_shards: int, n_tensors_per_expert: int,
         n_layer_moe: int, grid: float = 0.1, delta: int = 0) -> PlanResult:
    """Algorithm 4: the memory ratios of the pools Lambda minimising the expected makespan.

    f: rank-based inclusion probabilities (sum k); budget_bytes: memory for the expert cache of
    all n_layer_moe MoE layers; expert_bytes[p]: bytes of one expert in pool p's state;
    pools: Lambda; costs, threads (L), n_shards (K), n_tensors_per_expert (n): as in Algorithm 3;
    grid: the step of the memory ratios (must divide 1); delta: the dispatch tolerance in ranks.

    Each grid point gamma gives S_p = floor(gamma_p * budget / (expert_bytes[p] * n_layer_moe))
    experts per layer; packing in hierarchy order caps a pool at the ranks the earlier pools
    left, so the pools never hold more than the n_expert experts of a layer. Ties keep the
    earlier grid point, the first being all memory in the first pool of Lambda (the paper's
    initial gamma = (1, 0, 0, 0) when F is in Lambda).
    """
    chosen = parse_pools(",".join(pools))
    steps = _grid_steps(grid)
    if budget_bytes <= 0 or n_layer_moe <= 0 or threads <= 0 or n_shards <= 0 or n_tensors_per_expert <= 0:
        raise ValueError("budget_bytes, n_layer_moe, threads, n_shards and n_tensors_per_expert must be positive")
    if delta < 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    for pool in chosen:
        if int(expert_bytes.get(pool, 0)) <= 0:
            raise ValueError(f"expert_bytes[{pool!r}] must be a positive byte count")
    q = ipf(f, k).selection_probabilities  # Algorithm 4, line 4
    n_expert = q.size
    interval_hits = interval_hit_table(q, k)  # Algorithm 2 for every interval a pool or M can take
    patterns = hit_patterns(k, costs, threads, n_shards, n_tensors_per_expert)
    cost_of: dict[tuple[int, ...], float] = {}  # grid points often floor to the same capacities
    best: tuple[float, tuple[int, ...], dict[str, int]] | None = None
    for point in _grid_points(len(chosen), steps):
        capacities, free_ranks = {}, n_expert
        for pool, share in zip(chosen, point):
            fits = share * budget_bytes // (steps * int(expert_bytes[pool]) * n_layer_moe)
            capacities[pool] = min(fits, free_ranks)
            free_ranks -= capacities[pool]
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


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

def _read_json(path: Path, kind: str, expected_format: str) -> dict:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ZipMoEError(f"{kind} file not found: {path}") from None
    except OSError as e:
        raise ZipMoEError(f"cannot read {kind} file {path}: {e.strerror or e}") from None
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


def _pool_bytes(doc: Mapping, name: str, path: Path, pools: Sequence[str], check, what: str) -> dict:
    table = _require(doc, name, lambda v: isinstance(v, dict), "an object keyed by pool", path)
    if set(table) != set(pools):
        raise ZipMoEError(f"{path}: field '{name}' must have the keys {', '.join(pools)}, got {', '.join(table)}")
    for pool in pools:
        _require(table, pool, check, what, path, prefix=f"{name}.")
    return {pool: table[pool] for pool in pools}


def load_profile(path: Path) -> dict:
    """A validated PROFILE document (module docstring); ZipMoEError naming the file and field."""
    doc = _read_json(path, "profile", PROFILE_FORMAT)
    _require(doc, "model", lambda v: isinstance(v, str), "a string", path)
    n_layer_moe = _require(doc, "n_layer_moe", _positive_int, "a positive integer", path)
    n_expert = _require(doc, "n_expert", _positive_int, "a positive integer", path)
    _require(doc, "n_expert_used", lambda v: _positive_int(v) and v <= n_expert,
             f"an integer in 1..n_expert={n_expert}", path)
    _pool_bytes(doc, "expert_bytes", path, POOLS, _positive_int, "a positive integer (bytes)")
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
    """Write a PLAN file (module docstring) for `result`, with `meta` (JSON-serialisable
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
    pools = _require(doc, "pools", lambda v: isinstance(v, list) and v and all(p in POOLS for p in v)
                     and list(v) == [p for p in POOLS if p in v],
                     f"a non-empty list of distinct pools among {list(POOLS)}, in that order", path)
    n_layer_moe = _require(doc, "n_layer_moe", _positive_int, "a positive integer", path)
    n_expert = _require(doc, "n_expert", _positive_int, "a positive integer", path)
    k = _require(doc, "k", lambda v: _positive_int(v) and v <= n_expert, f"an integer in 1..{n_expert}", path)
    budget = _require(doc, "budget_bytes", _positive_int, "a positive integer", path)
    delta = _require(doc, "delta", lambda v: _is_int(v) and v >= 0, "a non-negative integer", path)
    ratios = _pool_bytes(doc, "ratios", path, pools, lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]")
    if abs(sum(ratios.values()) - 1.0) > 1e-9:
        raise ZipMoEError(f"{path}: field 'ratios' must sum to 1, got {sum(ratios.values()):.12g}")
    non_negative = (lambda v: _is_int(v) and v >= 0)
    capacities = _pool_bytes(doc, "capacities", path, pools, non_negative, "a non-negative integer")
    if sum(capacities.values()) > n_expert:
        raise ZipMoEError(f"{path}: field 'capacities' holds {sum(capacities.values())} experts per layer, "
                          f"more than n_expert={n_expert}")
    thresholds = _pool_bytes(doc, "thresholds", path, pools, non_negative, "a non-negative integer")
    expected = dict(zip(pools, itertools.accumulate(capacities[p] for p in pools)))
    for pool in pools:
        if thresholds[pool] != expected[pool] + delta:
            raise ZipMoEError(f"{path}: field 'thresholds.{pool}' must be the capacities up to {pool} plus delta, "
                              f"{expected[pool] + delta}, got {thresholds[pool]}")
    memory = _pool_bytes(doc, "memory_bytes", path, pools, non_negative, "a non-negative integer")
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


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _batch_marginals(profile: dict, batch_size: int, path: Path) -> tuple[np.ndarray, int]:
    """(f, k) for one batch size of a validated profile."""
    batch = profile["batches"].get(str(batch_size))
    if batch is None:
        raise ZipMoEError(f"{path}: field 'batches' has no batch size {batch_size} "
                          f"(it has {', '.join(sorted(profile['batches'], key=int))})")
    f = rank_inclusion_probabilities(batch["counts"], batch["n_ubatches"])
    if batch_size == 1:
        # one token selects exactly n_expert_used distinct experts in every layer
        k = profile["n_expert_used"]
        if abs(f.sum() - k) > 1e-9 * k:
            raise ZipMoEError(f"{path}: field 'batches.1.counts' gives {f.sum():.6g} selected experts per ubatch "
                              f"on average, but one token selects n_expert_used={k}")
        return f, k
    return round_to_subset_size(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="zipmoe-plan",
        description="Plan ZipMoE's expert cache pools (paper Algorithm 4): split a memory budget between pools "
                    "of full (F), compressed (C), sign+mantissa-only (S) and exponent-only (E) experts so that "
                    "the expected makespan of a sparse layer is minimal, under the maximum-entropy model of the "
                    "profiled expert activations. Writes a JSON plan (pool ratios, capacities per layer and the "
                    "dispatch thresholds); the file formats are described in zipmoe_py/planner.py.")
    ap.add_argument("profile", type=Path, metavar="PROFILE.json",
                    help="activation profile written by zipmoe-profile (format 'zipmoe-profile')")
    ap.add_argument("--budget", required=True,
                    help="memory for the expert cache of all MoE layers together, bytes or like 4G, 512M, 1.5GiB")
    ap.add_argument("--pools", default=",".join(POOLS),
                    help="the cache pools to use, comma separated, a subset of F,C,S,E (default: %(default)s): "
                         "F full BF16 experts, C compressed experts, S sign+mantissa chunks only, E compressed "
                         "exponent chunks only; the hierarchy order F,C,S,E applies whatever the order given")
    ap.add_argument("--costs", type=Path, default=None, metavar="COSTS.json",
                    help="measured delays (format 'zipmoe-costs': u_s SM-chunk read, v_s E-chunk read, c_s "
                         "E-chunk decompression, threads). Default: from the profile's expert sizes at 1.4 GB/s "
                         "O_DIRECT reads and 3.2 GB/s per core of decoded BF16")
    ap.add_argument("--threads", type=int, default=None, metavar="L",
                    help="decompression threads L of Algorithm 3 (default: the costs file's, else all cores)")
    ap.add_argument("--grid", type=float, default=0.05,
                    help="step of the memory ratios searched, dividing 1 (default: %(default)s)")
    ap.add_argument("--delta", type=int, default=0,
                    help="dispatch tolerance margin in ranks added to every threshold (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=1, metavar="B",
                    help="plan for the profile's ubatches of B tokens (default: %(default)s); for B > 1 the "
                         "experts per ubatch k is the mean number of distinct experts its tokens select, rounded")
    ap.add_argument("-o", "--output", type=Path, required=True, metavar="PLAN.json", help="plan file to write")
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.delta < 0:
        ap.error(f"--delta must be >= 0, got {args.delta}")
    if args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        from .bindings import parse_size

        budget = parse_size(args.budget, "--budget")
        try:
            pools = parse_pools(args.pools)
            _grid_steps(args.grid)
        except ValueError as e:
            raise ZipMoEError(f"--pools/--grid: {e}") from None
        profile = load_profile(args.profile)
        f, k = _batch_marginals(profile, args.batch_size, args.profile)
        if args.costs is not None:
            costs, threads = load_costs(args.costs)
        else:
            costs = default_costs(profile["expert_bytes"], profile["n_tensors_per_expert"], profile["n_shards"])
            threads = os.cpu_count() or 1
        threads = args.threads or threads
        if not args.output.parent.exists():
            raise ZipMoEError(f"output folder does not exist: {args.output.parent}")
        try:
            result = plan(f, k, budget, profile["expert_bytes"], pools, costs, threads, profile["n_shards"],
                          profile["n_tensors_per_expert"], profile["n_layer_moe"], grid=args.grid, delta=args.delta)
        except ValueError as e:
            raise ZipMoEError(f"{args.profile}: batch size {args.batch_size}: {e}") from None
        meta = {"model": profile["model"], "profile": str(args.profile), "batch_size": args.batch_size,
                "grid": args.grid, "threads": threads,
                "n_shards": profile["n_shards"], "n_tensors_per_expert": profile["n_tensors_per_expert"],
                "expert_bytes": profile["expert_bytes"],
                "costs": {"u_s": costs.u_s, "v_s": costs.v_s, "c_s": costs.c_s,
                          "source": str(args.costs) if args.costs else "default"},
                "inclusion_probabilities": [float(x) for x in f]}
        save_plan(args.output, result, meta)
    except ZipMoEError as e:
        print(f"zipmoe-plan: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: k={result.k} of {result.n_expert} experts, budget {budget / 2**30:.3f} GiB over "
          f"{result.n_layer_moe} MoE layers, expected makespan {result.expected_makespan_s * 1e3:.3f} ms per layer")
    for pool in result.pools:
        print(f"  {pool}: ratio {result.ratios[pool]:.2f}, {result.capacities[pool]} experts per layer "
              f"({result.memory_bytes[pool] / 2**20:.1f} MiB), threshold {result.thresholds[pool]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
