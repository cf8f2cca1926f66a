"""The cache planner. The reference (tests/planner.py) against brute force: the IPF against the
maximum-entropy distribution over k-sets, Algorithm 2 against enumeration, Algorithm 3 by hand,
Algorithm 4's vectorised sum against its literal loops and an exhaustive grid search. The runtime's
planner (C, through zipmoe_py/plan_math.py) against the reference: the same plans, from zipmoe-plan
too. The profile helpers (plan_math), the files (zipmoe_py/plan_files.py), the zipmoe-plan CLI
(zipmoe_py/plan_cli.py), that none of them loads llama_cpp and that no runtime module imports the
reference."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import planner  # the reference, tests/planner.py
from zipmoe_py import ZipMoEError, _lib, plan_cli, plan_files, plan_math
from zipmoe_py.plan_files import Costs

REPO = Path(__file__).resolve().parents[1]

TWO_KB_EXPERT = {"F": 2000, "C": 1300, "S": 1000, "E": 300}  # C = S + E, E compressed to 0.6 of the exponents


def random_marginals(rng: np.random.Generator, n: int, k: int, concentration: float, cap: float = 0.97) -> np.ndarray:
    """Inclusion probabilities summing to k, each below cap: a Dirichlet draw (small concentration:
    skewed, large: flat) scaled to k with the excess over cap spread over the others."""
    f = rng.dirichlet(np.full(n, concentration)) * k
    for _ in range(200):
        f = np.minimum(f, cap)
        f *= k / f.sum()
        if f.max() <= cap:
            break
    assert abs(f.sum() - k) < 1e-12 and f.max() < 1
    return f


def k_subsets(n: int, k: int) -> np.ndarray:
    """All k-subsets of range(n) as 0/1 rows."""
    rows = []
    for subset in itertools.combinations(range(n), k):
        row = np.zeros(n)
        row[list(subset)] = 1
        rows.append(row)
    return np.array(rows)


def max_entropy_distribution(f: np.ndarray, k: int) -> np.ndarray:
    """The maximum-entropy distribution over explicit k-subsets with marginals f, by damped Newton
    on the convex dual log sum_S exp(lambda . 1_S) - lambda . f (independent of the IPF)."""
    subsets = k_subsets(f.size, k)
    lam = np.zeros(f.size)

    def dual(lam):
        scores = subsets @ lam
        top = scores.max()
        return top + math.log(np.exp(scores - top).sum()) - lam @ f

    for _ in range(200):
        scores = subsets @ lam
        p = np.exp(scores - scores.max())
        p /= p.sum()
        marginals = subsets.T @ p
        gradient = marginals - f
        if np.abs(gradient).max() < 1e-14:
            break
        hessian = subsets.T @ (subsets * p[:, None]) - np.outer(marginals, marginals)
        # the dual is flat along lambda + t*1 (every subset has k members): least-squares step
        step = np.linalg.lstsq(hessian, -gradient, rcond=None)[0]
        size, value = 1.0, dual(lam)
        while dual(lam + size * step) > value + 1e-4 * size * (gradient @ step) and size > 1e-10:
            size /= 2
        lam = lam + size * step
    return p


def conditional_bernoulli(q: np.ndarray, k: int) -> np.ndarray:
    """P(S) proportional to prod_{i in S} q_i/(1-q_i) over explicit k-subsets."""
    subsets = k_subsets(q.size, k)
    weights = np.prod(np.where(subsets == 1, q / (1 - q), 1.0), axis=1)
    return weights / weights.sum()


# ----------------------------------------------------------------------------------------------- IPF

@pytest.mark.parametrize("n, k, concentration", [
    (8, 2, 0.3), (16, 3, 5.0), (32, 4, 0.2), (64, 6, 0.5), (64, 6, 50.0), (64, 8, 0.3), (48, 8, 1.0), (64, 1, 0.5)])
def test_ipf_reproduces_inclusion_probabilities(n, k, concentration):
    rng = np.random.default_rng(n * 100 + k)
    f = random_marginals(rng, n, k, concentration, cap=0.95)
    fit = planner.ipf(f, k, tol=1e-11)
    q = fit.selection_probabilities
    assert np.abs(planner.conditional_inclusion_probabilities(q, k) - f).max() < 1e-9
    assert fit.max_error < 1e-9 and fit.iterations < 2000
    assert abs(q.sum() - k) < 1e-9  # the normalization of the scale
    np.testing.assert_allclose(fit.weights, q / (1 - q))


def test_ipf_inclusion_probabilities_match_subset_enumeration():
    """The DP behind f^(t) (eq. 24) against sum over subsets containing i of P(S)."""
    rng = np.random.default_rng(1)
    f = random_marginals(rng, 9, 4, 0.5)
    q = planner.ipf(f, 4).selection_probabilities
    subsets = k_subsets(9, 4)
    np.testing.assert_allclose(subsets.T @ conditional_bernoulli(q, 4), f, atol=1e-12)


@pytest.mark.parametrize("n, k, seed", [(5, 2, 0), (6, 3, 1), (7, 2, 2), (8, 3, 3), (8, 1, 4), (8, 3, 5)])
def test_ipf_gives_the_maximum_entropy_distribution(n, k, seed):
    """Theorem D.1: the conditional Bernoulli distribution of the fitted q is the maximum-entropy
    distribution over k-subsets with marginals f."""
    f = random_marginals(np.random.default_rng(seed), n, k, 0.7 if seed % 2 else 3.0, cap=0.9)
    q = planner.ipf(f, k, tol=1e-13).selection_probabilities
    np.testing.assert_allclose(conditional_bernoulli(q, k), max_entropy_distribution(f, k), rtol=0, atol=1e-8)


def test_ipf_handles_certain_and_impossible_experts():
    f = np.array([1.0, 0.0, 0.6, 0.5, 0.4, 0.5, 0.0])
    fit = planner.ipf(f, 3)
    q = fit.selection_probabilities
    assert q[0] == 1.0 and q[1] == 0.0 and q[6] == 0.0
    assert math.isinf(fit.weights[0]) and fit.weights[1] == 0.0
    # the conditional distribution over 3-subsets, enumerated with q = 1 and q = 0 entries
    subsets = k_subsets(7, 3)
    probs = np.prod(np.where(subsets == 1, q, 1 - q), axis=1)
    np.testing.assert_allclose(subsets.T @ (probs / probs.sum()), f, atol=1e-10)
    assert planner.ipf([1.0, 1.0, 0.0], 2).iterations == 0


@pytest.mark.parametrize("f, k, message", [
    ([0.5, 0.5, 0.5], 2, "sum to 1.5"),
    ([1.2, 0.4, 0.4], 2, r"\[0, 1\]"),
    ([-0.1, 1.0, 1.1], 2, r"\[0, 1\]"),
    ([0.5, 0.5], 3, "cannot be selected"),
    ([1.0, 0.5, 0.5], 1, "sum to 2"),
    ([1.0, 1.0, 0.0, 0.0], 3, "sum to 2"),
])
def test_ipf_rejects_infeasible_marginals(f, k, message):
    with pytest.raises(ValueError, match=message):
        planner.ipf(f, k)


# ---------------------------------------------------------------------------------------- Algorithm 2

@pytest.mark.parametrize("n", [0, 1, 5, 12])
def test_hit_distribution_equals_enumeration(n):
    q = np.random.default_rng(n).uniform(0, 1, n)
    expected = np.zeros(n + 1)
    for outcome in itertools.product((0, 1), repeat=n):
        bits = np.array(outcome, dtype=bool)
        expected[bits.sum()] += np.prod(np.where(bits, q, 1 - q))
    np.testing.assert_allclose(planner.hit_distribution(q), expected, rtol=0, atol=1e-15)


def test_interval_hit_table_runs_algorithm_2_on_every_interval():
    q = np.random.default_rng(3).uniform(0, 1, 9)
    table = planner.interval_hit_table(q, 3)
    for start in range(10):
        for stop in range(start, 10):
            expected = np.zeros(4)
            full = planner.hit_distribution(q[start:stop])
            expected[:min(4, full.size)] = full[:4]
            np.testing.assert_allclose(table[start, stop], expected, atol=1e-15)


def test_conditional_hit_pattern_probability_equals_subset_enumeration():
    """Phi_M(k_rem) / Phi_N(k) * prod_p Phi_p(h_p) is the probability under P(S) of the hit pattern."""
    n, k = 8, 3
    f = random_marginals(np.random.default_rng(7), n, k, 0.6, cap=0.9)
    q = planner.ipf(f, k).selection_probabilities
    subsets, probs = k_subsets(n, k), conditional_bernoulli(q, k)
    bounds = {"F": (0, 2), "C": (2, 3), "S": (3, 5), "E": (5, 6), "M": (6, 8)}
    phi = {p: planner.hit_distribution(q[a:b]) for p, (a, b) in bounds.items()}
    phi_n = planner.hit_distribution(q)
    total = 0.0
    for pattern in itertools.product(*(range(b - a + 1) for p, (a, b) in bounds.items() if p != "M")):
        k_rem = k - sum(pattern)
        if not 0 <= k_rem <= 2:
            continue
        formula = phi["M"][k_rem] / phi_n[k] * math.prod(phi[p][h] for p, h in zip(_lib.pool_names(), pattern))
        counts = np.stack([subsets[:, a:b].sum(axis=1) for p, (a, b) in bounds.items() if p != "M"], axis=1)
        enumerated = probs[(counts == pattern).all(axis=1)].sum()
        assert formula == pytest.approx(enumerated, abs=1e-14)
        total += formula
    assert total == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------------------- Algorithm 3

def test_makespan_io_bound_by_hand():
    # n_SM = 3 (6 - 3) = 9, n_E = 3*5 (6 - 3) = 45: T_io = 9*2 + 45*0.1 = 22.5
    # n_D = 15 (6 - 1) = 75: T_decomp = (4.5 + 75*0.5) / 4 = 10.5
    hits = {"F": 1, "C": 1, "S": 1, "E": 1}
    assert planner.estimate_makespan(6, hits, 0.5, 0.1, 2.0, 4, 5, 3) == pytest.approx(22.5)
    assert planner.estimate_makespan(6, (1, 1, 1, 1), 0.5, 0.1, 2.0, 4, 5, 3) == pytest.approx(22.5)


def test_makespan_decompression_bound_by_hand():
    # k=4, h_C=2, h_E=1: n_SM = 2 (4 - 2) = 4, n_E = 2*3 (4 - 3) = 6: T_io = 4*1 + 6*1 = 10
    # n_D = 6 * 4 = 24: T_decomp = (6*1 + 24*2) / 2 = 27
    assert planner.estimate_makespan(4, {"C": 2, "E": 1}, 2.0, 1.0, 1.0, 2, 3, 2) == pytest.approx(27.0)
    assert planner.estimate_makespan(4, {"F": 4}, 2.0, 1.0, 1.0, 2, 3, 2) == 0.0
    # all misses: T_io = 2*4*1 + 24*1 = 32, T_decomp = (24 + 48) / 2 = 36
    assert planner.estimate_makespan(4, {}, 2.0, 1.0, 1.0, 2, 3, 2) == pytest.approx(36.0)


def test_makespan_rejects_impossible_patterns():
    with pytest.raises(ValueError, match="not possible"):
        planner.estimate_makespan(2, (1, 1, 1, 0), 1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="unknown cache pools"):
        planner.estimate_makespan(2, {"X": 1}, 1, 1, 1, 1, 1, 1)


# ---------------------------------------------------------------------------------------- Algorithm 4

@pytest.mark.parametrize("capacities", [
    {"F": 2, "C": 3, "S": 1, "E": 4}, {"F": 0, "C": 0, "S": 0, "E": 0}, {"F": 16}, {"C": 5, "E": 11},
    {"F": 1, "S": 7}, {"F": 3, "C": 3, "S": 3, "E": 3}])
def test_vectorised_expected_makespan_equals_nested_loops(capacities):
    n, k = 16, 4
    q = planner.ipf(random_marginals(np.random.default_rng(11), n, k, 0.4), k).selection_probabilities
    costs = Costs(u_s=2e-3, v_s=1.3e-4, c_s=3.6e-4)
    patterns = planner.hit_patterns(k, costs, 3, 5, 3)
    assert len(patterns.makespan) == math.comb(k + 4, 4)  # 4-tuples with sum <= k
    fast = planner.expected_makespan(planner.interval_hit_table(q, k), capacities, patterns)
    literal = planner.expected_makespan_nested(q, capacities, k, costs, 3, 5, 3)
    assert fast == pytest.approx(literal, rel=1e-12)


def plan_kwargs(**overrides) -> dict:
    kwargs = dict(k=2, budget_bytes=4 * 2000 * 3, expert_bytes=TWO_KB_EXPERT, pools="FCSE",
                  costs=Costs(u_s=1e-3, v_s=1e-4, c_s=1e-4), threads=4, n_shards=5, n_tensors_per_expert=3,
                  n_layer_moe=3, grid=0.25)
    kwargs.update(overrides)
    return kwargs


F8 = random_marginals(np.random.default_rng(5), 8, 2, 0.5, cap=0.9)

# the properties below hold for the reference and for the runtime's planner (C) alike
PLANNERS = [pytest.param(planner.plan, id="reference"), pytest.param(plan_math.plan, id="runtime")]


@pytest.mark.parametrize("plan", PLANNERS)
def test_plan_with_one_pool_gives_it_all_memory(plan):
    result = plan(F8, **plan_kwargs(pools=["F"], budget_bytes=10 * 2000 * 3 + 100))
    assert result.ratios == {"F": 1.0}
    assert result.capacities == {"F": 8}  # 10 fit, capped at the 8 experts of a layer
    assert result.thresholds == {"F": 8}
    result = plan(F8, **plan_kwargs(pools=["F"], budget_bytes=5 * 2000 * 3 - 1, delta=2))
    assert result.capacities == {"F": 4} and result.thresholds == {"F": 6} and result.delta == 2


@pytest.mark.parametrize("plan", PLANNERS)
@pytest.mark.parametrize("pools", ["FCSE", "FC", "CSE", "SE"])
@pytest.mark.parametrize("budget_experts", [1, 3, 6])
def test_plan_ratios_sum_to_one_within_budget(plan, pools, budget_experts):
    budget = budget_experts * 2000 * 3
    result = plan(F8, **plan_kwargs(pools=pools, budget_bytes=budget))
    assert result.pools == tuple(pools)
    assert sum(result.ratios.values()) == pytest.approx(1.0)
    assert sum(result.memory_bytes.values()) <= budget
    assert sum(result.capacities.values()) <= 8
    for pool in pools:
        assert result.capacities[pool] * TWO_KB_EXPERT[pool] * 3 <= result.ratios[pool] * budget
        assert result.memory_bytes[pool] == result.capacities[pool] * TWO_KB_EXPERT[pool] * 3
    assert list(result.thresholds.values()) == list(itertools.accumulate(result.capacities[p] for p in pools))


@pytest.mark.parametrize("plan", PLANNERS)
def test_plan_is_the_minimum_over_the_grid(plan):
    """Algorithm 4 against an exhaustive search with the literal nested loops."""
    kwargs = plan_kwargs(budget_bytes=3 * 2000 * 3)
    result = plan(F8, **kwargs)
    q = planner.ipf(F8, 2).selection_probabilities
    best = math.inf
    for shares in itertools.product(range(5), repeat=4):
        if sum(shares) != 4:
            continue
        capacities, free = {}, 8
        for pool, share in zip(_lib.pool_names(), shares):
            capacities[pool] = min(int(share / 4 * kwargs["budget_bytes"] // (TWO_KB_EXPERT[pool] * 3)), free)
            free -= capacities[pool]
        best = min(best, planner.expected_makespan_nested(q, capacities, 2, kwargs["costs"], 4, 5, 3))
    rel = 1e-12 if plan is planner.plan else 1e-9  # C sums in another order, on its own fit of q
    assert result.expected_makespan_s == pytest.approx(best, rel=rel)
    assert result.expected_makespan_s == pytest.approx(
        planner.expected_makespan_nested(q, result.capacities, 2, kwargs["costs"], 4, 5, 3), rel=rel)


@pytest.mark.parametrize("plan", PLANNERS)
def test_slow_disk_prefers_compressed_experts(plan):
    """Reads dominate and decompression is cheap: caching 1.5 compressed experts per full one wins."""
    costs = Costs(u_s=10e-3, v_s=2e-3, c_s=1e-5)
    result = plan(F8, **plan_kwargs(pools="FC", costs=costs, threads=8, budget_bytes=4 * 2000 * 3))
    assert result.ratios == {"F": 0.0, "C": 1.0} and result.capacities == {"F": 0, "C": 6}


@pytest.mark.parametrize("plan", PLANNERS)
def test_fast_disk_slow_decompression_prefers_full_experts(plan):
    """Decompressing costs more than reading: only full experts help."""
    costs = Costs(u_s=1e-5, v_s=1e-6, c_s=5e-3)
    result = plan(F8, **plan_kwargs(pools="FCSE", costs=costs, threads=1, budget_bytes=4 * 2000 * 3))
    assert result.ratios == {"F": 1.0, "C": 0.0, "S": 0.0, "E": 0.0} and result.capacities["F"] == 4


@pytest.mark.parametrize("plan", PLANNERS)
def test_plan_is_fast_for_64_experts(plan):
    import time

    f = random_marginals(np.random.default_rng(64), 64, 6, 0.5)
    started = time.perf_counter()
    expert = {"F": 3 * 2048 * 1408 * 2, "S": 3 * 2048 * 1408, "E": int(3 * 2048 * 1408 * 0.32)}
    expert["C"] = expert["S"] + expert["E"]
    result = plan(f, 6, 4 << 30, expert, "FCSE", plan_math.default_costs(expert, 3, 5), 8, 5, 3, 26, grid=0.05)
    assert time.perf_counter() - started < 5
    assert sum(result.memory_bytes.values()) <= 4 << 30


@pytest.mark.parametrize("plan", PLANNERS)
def test_plan_rejects_bad_arguments(plan):
    with pytest.raises(ValueError, match="grid step"):
        plan(F8, **plan_kwargs(grid=0.3))
    with pytest.raises(ValueError, match="pools"):
        plan(F8, **plan_kwargs(pools="FX"))
    with pytest.raises(ValueError, match="sum to 1.5"):
        plan([0.5, 0.5, 0.5], **plan_kwargs())  # k = 2: no selection probabilities give these marginals


def assert_same_plan(got, reference) -> None:
    """The runtime's plan is the reference's: every choice exactly; the expected makespan and the fitted
    selection probabilities to rounding, since C sums in another order and fits q with its own iterations
    (floating-point planning, not a lossless inference path)."""
    exact = ("pools", "ratios", "capacities", "thresholds", "delta", "memory_bytes", "budget_bytes", "n_layer_moe",
             "n_expert", "k")
    assert {name: getattr(got, name) for name in exact} == {name: getattr(reference, name) for name in exact}
    assert got.expected_makespan_s == pytest.approx(reference.expected_makespan_s, rel=1e-9)
    np.testing.assert_allclose(got.selection_probabilities, reference.selection_probabilities, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("n, k, concentration, budget_experts, pools, grid, delta", [
    (8, 2, 0.5, 3, "FCSE", 0.25, 0), (16, 4, 0.3, 7, "FCSE", 0.1, 1), (64, 6, 0.5, 20, "FCSE", 0.05, 0),
    (64, 6, 5.0, 40, "CSE", 0.05, 2), (60, 4, 0.2, 100, "FC", 0.1, 0), (32, 3, 1.0, 500, "FCSE", 0.05, 0)])
def test_the_runtimes_plan_is_the_references(n, k, concentration, budget_experts, pools, grid, delta):
    """plan_math.plan (C's grid search and IPF) and the reference give the same PLAN: pools, ratios (the
    grid point C reports), capacities, thresholds and memory
    exactly; the makespan and q to rounding (sums in another order, an iterative fit)."""
    f = random_marginals(np.random.default_rng(n + k), n, k, concentration, cap=0.95)
    kwargs = plan_kwargs(k=k, budget_bytes=budget_experts * 2000 * 3, pools=pools, grid=grid, delta=delta,
                         costs=Costs(u_s=4.1e-3, v_s=0.28e-3, c_s=0.36e-3), threads=2)
    runtime, reference = plan_math.plan(f, **kwargs), planner.plan(f, **kwargs)
    assert_same_plan(runtime, reference)


def test_grid_points_come_in_the_searchs_order():
    assert list(planner.grid_points(1, 3)) == [(3,)]
    assert list(planner.grid_points(2, 2)) == [(2, 0), (1, 1), (0, 2)]
    points = list(planner.grid_points(4, 20))
    assert len(points) == math.comb(23, 3) and points[0] == (20, 0, 0, 0) and points[-1] == (0, 0, 0, 20)
    assert all(sum(p) == 20 for p in points) and len(set(points)) == len(points)
    # packed in hierarchy order: half of 8 F experts' memory is 4 F; the other half fits 6 C, capped at
    # the 4 ranks F left
    assert planner.grid_capacities((2, 2, 0), "FCS", 4, 8 * 2000 * 3, TWO_KB_EXPERT, 3, 8) == \
        {"F": 4, "C": 4, "S": 0}


def test_round_to_subset_size():
    f, k = plan_math.round_to_subset_size([0.98, 0.5, 0.4, 0.35, 0.3, 0.1])  # sums to 2.63
    assert k == 3 and f.sum() == pytest.approx(3.0)
    # 0.98 * 3/2.63 > 1: capped, the others share the remaining 2 in proportion
    np.testing.assert_allclose(f, [1.0, *(2 / 1.65 * np.array([0.5, 0.4, 0.35, 0.3, 0.1]))])
    f, k = plan_math.round_to_subset_size([0.9, 0.8, 0.6, 0.5])  # sums to 2.8: scaled up, none capped
    assert k == 3 and np.allclose(f, np.array([0.9, 0.8, 0.6, 0.5]) * 3 / 2.8)


def test_default_costs_use_the_runtimes_default_rates():
    expert = {"F": 3 * 2048 * 1408 * 2, "C": 0, "S": 3 * 2048 * 1408, "E": int(3 * 2048 * 1408 * 0.32)}
    read, decode = _lib.default_rate(_lib.RATE_READ), _lib.default_rate(_lib.RATE_DECODE)
    costs = plan_math.default_costs(expert, 3, 5)
    assert costs.u_s == pytest.approx(2048 * 1408 / read)  # one tensor's SM-chunk
    assert costs.v_s == pytest.approx(int(3 * 2048 * 1408 * 0.32) / 15 / read)  # one E-chunk
    assert costs.c_s == pytest.approx(2048 * 1408 * 2 / 5 / decode)  # one E-chunk's BF16 output
    with pytest.raises(ZipMoEError, match="no such rate"):
        _lib.default_rate(99)


def test_rank_inclusion_probabilities_sorts_per_layer_and_averages():
    counts = [[0, 10, 4, 6], [8, 2, 10, 0]]
    np.testing.assert_allclose(plan_math.rank_inclusion_probabilities(counts, 10), [1.0, 0.7, 0.3, 0.0])


# ------------------------------------------------------------------------------------------------- files and CLI

def write_profile(path, **overrides):
    rng = np.random.default_rng(0)
    counts = []
    for _layer in range(2):  # 40 single-token ubatches, each selecting 2 of 8 experts
        row = np.zeros(8, dtype=int)
        for _ in range(40):
            row[rng.choice(8, size=2, replace=False, p=np.arange(8, 0, -1) / 36)] += 1
        counts.append(row.tolist())
    doc = {"format": "zipmoe-profile", "version": 1, "model": "tiny", "n_layer_moe": 2, "n_expert": 8,
           "n_expert_used": 2, "expert_bytes": TWO_KB_EXPERT, "n_tensors_per_expert": 3, "n_shards": 5,
           "batches": {"1": {"n_ubatches": 40, "counts": counts},
                       "4": {"n_ubatches": 10, "counts": [[10, 9, 8, 6, 5, 3, 2, 1], [9, 9, 9, 6, 4, 4, 2, 1]]}}}
    doc.update(overrides)
    path.write_text(json.dumps(doc))
    return path


def test_cli_writes_a_loadable_plan(tmp_path, capsys):
    profile = write_profile(tmp_path / "profile.json")
    out = tmp_path / "plan.json"
    assert plan_cli.main([str(profile), "--budget", "30K", "--grid", "0.25", "--threads", "2", "-o", str(out)]) == 0
    result, meta = plan_files.load_plan(out)
    assert result.pools == _lib.pool_names() and result.k == 2 and result.budget_bytes == 30 * 1024
    assert sum(result.memory_bytes.values()) <= 30 * 1024 and meta["threads"] == 2
    assert meta["costs"]["source"] == "default" and len(meta["inclusion_probabilities"]) == 8
    assert "expected makespan" in capsys.readouterr().out

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"format": "zipmoe-costs", "version": 1, "u_s": 0.01, "v_s": 0.002, "c_s": 1e-5,
                                 "threads": 8}))
    assert plan_cli.main([str(profile), "--budget", "24000", "--pools", "C,F", "--costs", str(costs),
                         "--batch-size", "4", "--grid", "0.5", "--delta", "1", "-o", str(out)]) == 0
    result, meta = plan_files.load_plan(out)
    assert result.pools == ("F", "C") and meta["batch_size"] == 4 and meta["threads"] == 8
    assert result.thresholds["C"] == result.capacities["F"] + result.capacities["C"] + 1


def routed_profile(path, n_expert: int, k: int, skew: float, seed: int, n_layer_moe: int = 3):
    """A PROFILE of n_layer_moe layers routing 200 single-token ubatches (k of n_expert experts each, by
    gamma(skew) weights: small skew, few popular experts) and 50 ubatches of 4 tokens."""
    rng = np.random.default_rng(seed)
    expert_bytes = {"F": 18432, "C": 12160, "S": 9216, "E": 2944}
    batches = {}
    for batch_size, n_ubatches in ((1, 200), (4, 50)):
        counts = []
        for _layer in range(n_layer_moe):
            weights = rng.gamma(skew, size=n_expert) + 1e-3
            row = np.zeros(n_expert, dtype=int)
            for _ in range(n_ubatches):
                chosen = set()
                for _token in range(batch_size):
                    chosen.update(rng.choice(n_expert, size=k, replace=False, p=weights / weights.sum()).tolist())
                row[list(chosen)] += 1
            counts.append(row.tolist())
        batches[str(batch_size)] = {"n_ubatches": n_ubatches, "counts": counts}
    doc = {"format": "zipmoe-profile", "version": 1, "model": "routed", "n_layer_moe": n_layer_moe,
           "n_expert": n_expert, "n_expert_used": k, "expert_bytes": expert_bytes, "n_tensors_per_expert": 3,
           "n_shards": 5, "batches": batches}
    path.write_text(json.dumps(doc))
    return doc


@pytest.mark.parametrize("n_expert, k, skew, batch_size, budget_experts, args", [
    (8, 2, 0.5, 1, 4, ["--grid", "0.25"]),
    (16, 4, 0.3, 1, 9, ["--pools", "F,C,E", "--delta", "1"]),
    (64, 6, 0.4, 1, 60, ["--grid", "0.05"]),
    (60, 4, 2.0, 4, 90, ["--grid", "0.1", "--pools", "S,E,C"]),
    (32, 2, 0.2, 1, 500, []),  # every expert fits full many times over: the first grid point keeps it
])
def test_zipmoe_plan_writes_the_references_plan(tmp_path, n_expert, k, skew, batch_size, budget_experts, args):
    """zipmoe-plan (the runtime's C planner) chooses the pools, ratios and capacities the reference
    planner (tests/planner.py) chooses for the same PROFILE, and writes the rest of the PLAN alike."""
    profile = routed_profile(tmp_path / "profile.json", n_expert, k, skew, seed=n_expert + k)
    budget = budget_experts * profile["expert_bytes"]["F"] * profile["n_layer_moe"]
    out = tmp_path / "plan.json"
    assert plan_cli.main([str(tmp_path / "profile.json"), "--budget", str(budget), "--threads", "2",
                          "--batch-size", str(batch_size), *args, "-o", str(out)]) == 0
    made, meta = plan_files.load_plan(out)

    batch = profile["batches"][str(batch_size)]
    f = plan_math.rank_inclusion_probabilities(batch["counts"], batch["n_ubatches"])
    # one token's profile comes debiased, as the runtime's re-plan takes its own
    f, planned_k = ((plan_math.debiased_rank_profile(f, batch["n_ubatches"], k), k) if batch_size == 1
                    else plan_math.round_to_subset_size(f))
    given = dict(zip(args[::2], args[1::2]))
    pools = plan_math.parse_pool_set(given.get("--pools", "F,C,S,E"))
    costs = plan_math.default_costs(profile["expert_bytes"], 3, 5)
    reference = planner.plan(f, planned_k, budget, profile["expert_bytes"], pools, costs, 2, 5, 3,
                             profile["n_layer_moe"], grid=float(given.get("--grid", 0.05)),
                             delta=int(given.get("--delta", 0)))
    assert_same_plan(made, reference)
    np.testing.assert_array_equal(meta["inclusion_probabilities"], f)  # what the planner was given


@pytest.mark.parametrize("args, overrides, needle", [
    (["--budget", "lots"], {}, "--budget"),
    (["--budget", "1M", "--pools", "F,Q"], {}, "pools"),
    (["--budget", "1M", "--batch-size", "2"], {}, "no batch size 2"),
    (["--budget", "1M"], {"n_expert": "8"}, "'n_expert'"),
    (["--budget", "1M"], {"expert_bytes": {"F": 1, "C": 1, "S": 1}}, "'expert_bytes'"),
    (["--budget", "1M"], {"format": "zipmoe-plan"}, "'format'"),
    (["--budget", "1M"], {"batches": {"1": {"n_ubatches": 40, "counts": [[1] * 8]}}}, "'batches.1.counts'"),
    (["--budget", "1M"], {"n_expert_used": 3}, "'batches.1.counts'"),
])
def test_cli_errors_name_the_culprit(tmp_path, capsys, args, overrides, needle):
    profile = write_profile(tmp_path / "profile.json", **overrides)
    assert plan_cli.main([str(profile), *args, "-o", str(tmp_path / "plan.json")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zipmoe-plan: error: ") and needle in err
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("budget, pools, least, cheapest", [
    ("0.5K", "F,C,S,E", 600, "E"),  # one E expert (300 bytes) in each of the 2 MoE layers
    ("599", "F,C,S,E", 600, "E"),
    ("2599", "C,F", 2600, "C"),  # the cheapest pool of the chosen set, not of all four
    ("3K", "F", 4000, "F"),
])
def test_cli_refuses_a_budget_that_keeps_no_expert(tmp_path, capsys, budget, pools, least, cheapest):
    """Below one expert per MoE layer in the cheapest chosen pool, no grid point keeps an expert: exit 2
    (a bad argument) naming --budget and the least budget, from the profile's expert sizes, and no plan
    written (zipmoe-chat --plan would refuse it)."""
    profile = write_profile(tmp_path / "profile.json")
    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as exit_:
        plan_cli.main([str(profile), "--budget", budget, "--pools", pools, "-o", str(out)])
    assert exit_.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert f"zipmoe-plan: error: --budget {budget} " in err and "keeps no expert" in err
    assert f"is {least} bytes" in err and f"one {cheapest} expert of {TWO_KB_EXPERT[cheapest]} bytes" in err
    suggested = re.search(r"\(--budget (\S+): ", err).group(1)
    assert plan_cli.parse_size(suggested, "--budget") >= least
    # the least budget itself plans, and the plan keeps an expert
    assert plan_cli.main([str(profile), "--budget", str(least), "--pools", pools, "-o", str(out)]) == 0
    result, _ = plan_files.load_plan(out)
    assert sum(result.capacities.values()) >= 1 and result.capacities[cheapest] >= 1


def test_size_text_rounds_up_to_a_budget_that_holds_the_bytes():
    for n in (1, 1023, 1024, 1025, 1800, 2600, 5 * 2**20 + 1, 3 * 2**30 - 7, 123456789):
        text = plan_cli.size_text(n)
        assert n <= plan_cli.parse_size(text, "--budget") <= n * 1.01 + 1, (n, text)


def test_cli_never_writes_a_plan_that_keeps_nothing(tmp_path, capsys, monkeypatch):
    """Whatever the planner returns, a plan with every capacity 0 is not written (every loader refuses it)."""
    profile = write_profile(tmp_path / "profile.json")
    out = tmp_path / "plan.json"
    real = plan_cli.plan

    def keeps_nothing(*args, **kwargs):
        result = real(*args, **kwargs)
        return dataclasses.replace(result, capacities={p: 0 for p in result.pools},
                                   thresholds={p: result.delta for p in result.pools},
                                   memory_bytes={p: 0 for p in result.pools})

    monkeypatch.setattr(plan_cli, "plan", keeps_nothing)
    assert plan_cli.main([str(profile), "--budget", "30K", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zipmoe-plan: error: ") and "--budget 30K keeps no expert" in err and not out.exists()


def test_cli_missing_or_broken_files(tmp_path, capsys):
    out = str(tmp_path / "plan.json")
    assert plan_cli.main([str(tmp_path / "nope.json"), "--budget", "1M", "-o", out]) == 1
    err = capsys.readouterr().err
    assert "profile file not found" in err and "nope.json" in err
    profile = write_profile(tmp_path / "profile.json")
    (tmp_path / "costs.json").write_text('{"format": "zipmoe-costs", "version": 1, "u_s": 1}')
    assert plan_cli.main([str(profile), "--budget", "1M", "--costs", str(tmp_path / "costs.json"), "-o", out]) == 1
    err = capsys.readouterr().err
    assert "costs.json" in err and "'v_s'" in err
    (tmp_path / "bad.json").write_text("{not json")
    assert plan_cli.main([str(tmp_path / "bad.json"), "--budget", "1M", "-o", out]) == 1
    assert "bad.json" in capsys.readouterr().err


def test_load_plan_validates_fields(tmp_path):
    result = plan_math.plan(F8, **plan_kwargs())
    path = tmp_path / "plan.json"
    plan_files.save_plan(path, result, {"model": "tiny"})
    loaded, meta = plan_files.load_plan(path)
    assert loaded == result and meta == {"model": "tiny"}
    saved = path.read_text()
    for change, message in [(lambda d: d["thresholds"].update(F=d["thresholds"]["F"] + 1), "field 'thresholds.F'"),
                            (lambda d: d.pop("selection_probabilities"), "'selection_probabilities' is missing"),
                            (lambda d: d["ratios"].update(F=0.9), "field 'ratios' must sum to 1"),
                            (lambda d: d.update(version=2), "field 'version'")]:
        doc = json.loads(saved)
        change(doc)
        path.write_text(json.dumps(doc))
        with pytest.raises(ZipMoEError, match=r"plan\.json: .*" + message):
            plan_files.load_plan(path)


def test_planning_and_loading_a_plan_import_no_llama_cpp(tmp_path):
    """zipmoe-plan and a plan's pools (options.plan_overrides) need neither llama_cpp nor libllama, and
    options and plan_files not the planner; importing loads no library at all (pool names and rates
    are read on first use)."""
    profile = write_profile(tmp_path / "profile.json")
    code = f"""
import sys
from zipmoe_py import options, plan_files
assert 'zipmoe_py.plan_math' not in sys.modules, "options or plan_files imported the planner"
import zipmoe_py.plan_math
assert 'llama_cpp' not in sys.modules and 'zipmoe_py.bindings' not in sys.modules
from zipmoe_py import _lib, plan_cli
assert _lib.lib.cache_info().currsize == 0, "importing loaded libggml-zipmoe"
assert plan_cli.main([{str(profile)!r}, "--budget", "30K", "-o", {str(tmp_path / "plan.json")!r}]) == 0
overrides = options.plan_overrides({str(tmp_path / "plan.json")!r})
assert set(overrides) <= {{'zipmoe.pool_f', 'zipmoe.pool_c', 'zipmoe.pool_s', 'zipmoe.pool_e', 'zipmoe.rank_delta'}}
assert 'llama_cpp' not in sys.modules and 'zipmoe_py.bindings' not in sys.modules
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_no_runtime_module_imports_the_test_references():
    """tests/planner.py and tests/sched_sim.py are what the runtime is tested against, not part of it."""
    import ast

    for path in sorted((REPO / "zipmoe_py").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            if isinstance(node, ast.ImportFrom):
                names.append(node.module or "")
            assert not {name.split(".")[-1] for name in names} & {"planner", "sched_sim"}, \
                f"{path.relative_to(REPO)}:{node.lineno} imports a test reference"


def test_the_format_specs_examples_are_what_the_tools_read_and_write(tmp_path):
    """docs/PLAN_FORMAT.md: each example passes its reader, and the PLAN example is zipmoe-plan's output
    for the PROFILE and COSTS examples (its floats shortened)."""
    spec = (REPO / "docs" / "PLAN_FORMAT.md").read_text()
    examples = {doc["format"]: doc for doc in map(json.loads, re.findall(r"```json\n(.*?)```", spec, flags=re.S))}
    assert set(examples) == {"zipmoe-profile", "zipmoe-costs", "zipmoe-plan"}
    for kind in examples:
        (tmp_path / f"{kind}.json").write_text(json.dumps(examples[kind]))
    plan_files.load_profile(tmp_path / "zipmoe-profile.json")
    assert plan_files.load_costs(tmp_path / "zipmoe-costs.json") == (Costs(0.0021, 0.00014, 0.00036), 2)
    documented, _ = plan_files.load_plan(tmp_path / "zipmoe-plan.json")
    assert plan_cli.main([str(tmp_path / "zipmoe-profile.json"), "--budget", "96K", "--costs",
                          str(tmp_path / "zipmoe-costs.json"), "--grid", "0.25", "-o", str(tmp_path / "plan.json")
                          ]) == 0
    made, _ = plan_files.load_plan(tmp_path / "plan.json")
    assert (made.pools, made.ratios, made.capacities, made.thresholds, made.memory_bytes, made.k) == (
        documented.pools, documented.ratios, documented.capacities, documented.thresholds, documented.memory_bytes,
        documented.k)
    assert made.expected_makespan_s == pytest.approx(documented.expected_makespan_s, rel=1e-3)
    np.testing.assert_allclose(made.selection_probabilities, documented.selection_probabilities, atol=1e-4)
