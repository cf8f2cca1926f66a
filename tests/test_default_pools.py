"""Default pools: the runtime's planner and the pools a model gets with no options.

- ggml_zipmoe_plan_pools (C, what the runtime runs) makes the same choice as tests/planner.py's plan
  (the reference) on uniform and on fitted, skewed selection probabilities.
- Loaded with no pool options, a ZipMoE model gets one F pool when every expert fits full; every
  expert in C (and some in F too) when the compressed ones fit, and then reads nothing after the
  preload; the planner's pools in between; one F pool with zipmoe_auto_pools=False. Logits stay
  bit-identical to the BF16 GGUF in every case, and zipmoe-chat --stats says which pools and why.
"""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

import planner  # the reference, tests/planner.py
from zipmoe_py import ZipMoEError, _lib
from zipmoe_py.options import size_text
from zipmoe_py.plan_files import Costs
from zipmoe_py.plan_math import round_to_subset_size

from conftest import run, zipmoe_command
from test_cache import kernel_moves_pages
from test_format import make_moe_gguf
from zipmoe_py import format as zformat
from test_serve import PROMPTS, TOP_K, expert_geometry, load, logits_trace

POOLS = ("F", "C", "S", "E")


def c_plan(q, k, budget, entry_bytes, costs, threads, n_shards, n_tensors, n_layer, grid_steps):
    params = _lib.PlanParams()
    params.n_expert, params.k, params.budget = len(q), k, budget
    values = (ctypes.c_double * len(q))(*q)
    params.q = values
    for i, pool in enumerate(POOLS):
        params.entry_bytes[i] = entry_bytes.get(pool, 0)
    params.u, params.v, params.c = costs.u_s, costs.v_s, costs.c_s
    params.threads, params.n_shards, params.n_tensors = threads, n_shards, n_tensors
    params.n_layer, params.grid_steps = n_layer, grid_steps
    result = _lib.PlanResult()
    assert _lib.lib().ggml_zipmoe_plan_pools(ctypes.byref(params), ctypes.byref(result)) == 0
    return dict(zip(POOLS, result.capacity)), result.expected_makespan_s


SIZES = {"F": 17_301_504, "C": 11_600_000, "S": 8_650_752, "E": 2_950_000}  # a DeepSeek-V2-Lite expert


@pytest.mark.parametrize("n_expert,k,skew", [(64, 6, None), (60, 4, None), (16, 4, 0.4), (64, 6, 1.5)])
@pytest.mark.parametrize("budget_experts", [20, 300, 900, 1500])
@pytest.mark.parametrize("pools", ["FCSE", "FC", "SE"])
def test_the_runtimes_planner_chooses_as_the_reference_does(n_expert, k, skew, budget_experts, pools):
    if skew is None:
        f = np.full(n_expert, k / n_expert)
        q = f  # uniform marginals are their own selection probabilities
    else:
        weights = np.random.default_rng(n_expert).gamma(skew, size=n_expert)
        f, _ = round_to_subset_size(k * weights / weights.sum())
        q = planner.ipf(f, k).selection_probabilities
    costs = Costs(u_s=4.1e-3, v_s=0.28e-3, c_s=0.36e-3)
    entry = {p: SIZES[p] for p in pools}
    budget = budget_experts * SIZES["F"]
    reference = planner.plan(f, k, budget, entry, tuple(pools), costs, threads=2, n_shards=5,
                             n_tensors_per_expert=3, n_layer_moe=26, grid=0.05)
    capacities, makespan = c_plan(q, k, budget, entry, costs, 2, 5, 3, 26, 20)
    assert capacities == {p: reference.capacities.get(p, 0) for p in POOLS}
    # float sums in another order: the same choice, the same value to rounding (not a lossless path)
    assert makespan == pytest.approx(reference.expected_makespan_s, rel=1e-9)


@pytest.mark.parametrize("n,k,skew", [(8, 2, 0.5), (60, 4, 0.3), (64, 6, 2.0), (16, 4, 0.15)])
def test_the_runtimes_ipf_fits_as_the_reference_does(n, k, skew):
    weights = np.sort(np.random.default_rng(n + k).gamma(skew, size=n))[::-1]
    f, _ = round_to_subset_size(k * weights / weights.sum())
    want = planner.ipf(f, k).selection_probabilities
    got = (ctypes.c_double * n)()
    assert _lib.lib().ggml_zipmoe_plan_fit((ctypes.c_double * n)(*f), n, k, got) == 0
    np.testing.assert_allclose(np.array(got), want, rtol=1e-7, atol=1e-12)  # an iterative fit: not a lossless path


def test_the_runtimes_ipf_rejects_inconsistent_marginals():
    out = (ctypes.c_double * 4)()
    assert _lib.lib().ggml_zipmoe_plan_fit((ctypes.c_double * 4)(0.5, 0.5, 0.5, 0.1), 4, 2, out) != 0  # sum != k
    assert _lib.lib().ggml_zipmoe_plan_fit((ctypes.c_double * 4)(1.5, 0.5, 0.0, 0.0), 4, 2, out) != 0  # f > 1
    assert _lib.lib().ggml_zipmoe_plan_fit((ctypes.c_double * 4)(1.0, 1.0, 0.0, 0.0), 4, 2, out) == 0
    assert list(out) == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("steps,n,k", [(16, 64, 6), (16, 60, 4), (64, 64, 6), (500, 8, 2)])
def test_the_rank_bias_is_a_uniform_routers_excess_over_few_steps(steps, n, k):
    """A uniform router's rank profile over few steps looks concentrated by chance; the bias zipmoe-plan
    takes off is that excess, against a simulation of the router (k distinct experts of n per step)."""
    bias = (ctypes.c_double * n)()
    assert _lib.lib().ggml_zipmoe_plan_rank_bias(steps, n, k, bias) == 0
    rng = np.random.default_rng(steps * n + k)
    ranked = -np.sort(-rng.binomial(steps, k / n, size=(100000, n)), axis=1)
    # the model it computes (independent counts), against its simulation's error
    np.testing.assert_allclose(np.array(bias), ranked.mean(axis=0) / steps - k / n, atol=0.002)
    picks = rng.random((2000, steps, n)).argsort(axis=2)[:, :, :k]
    counts = np.zeros((2000, n))
    for rep in range(2000):
        counts[rep] = np.bincount(picks[rep].ravel(), minlength=n)
    simulated = -np.sort(-counts, axis=1).mean(axis=0) / steps - k / n
    # the router itself: one step's k experts are distinct, so its counts are weakly dependent, which the
    # model leaves out: it is off by up to 15% of k / n in the middle ranks, and closer at the top
    np.testing.assert_allclose(np.array(bias), simulated, atol=0.2 * k / n)
    assert abs(bias[0] - simulated[0]) < 0.05 * k / n
    assert bias[0] > 0.5 * k / n if steps == 16 else bias[0] > 0  # 16 steps: the top rank looks 1.5x as likely
    assert abs(sum(bias)) < 1e-9  # the counts' total is not biased
    assert _lib.lib().ggml_zipmoe_plan_rank_bias(0, n, k, bias) != 0
    assert _lib.lib().ggml_zipmoe_plan_rank_bias(steps, n, n + 1, bias) != 0


def test_zipmoe_plan_takes_a_profiles_rank_bias_off(tmp_path):
    """A uniform router's profile of few ubatches, sorted by rank, looks concentrated; zipmoe-plan takes the
    rank bias off: the profile comes out nearly flat, with the same sum k, and a
    long profile is left nearly as counted."""
    from zipmoe_py import plan_math
    from zipmoe_py.plan_cli import _batch_marginals

    n, k, steps = 64, 6, 16
    rng = np.random.default_rng(3)
    counts = np.zeros((4, n), dtype=np.int64)
    for layer in range(4):
        for _ in range(steps):
            counts[layer, rng.choice(n, k, replace=False)] += 1
    profile = {"n_expert_used": k, "batches": {"1": {"counts": counts.tolist(), "n_ubatches": steps}}}
    raw = plan_math.rank_inclusion_probabilities(counts, steps)
    f, got_k = _batch_marginals(profile, 1, tmp_path / "p.json")
    assert got_k == k and f.sum() == pytest.approx(k) and np.all(np.diff(f) <= 0)
    assert raw[0] > 2 * k / n and f[0] < 0.5 * raw[0]  # the top rank's chance excess is gone
    assert np.abs(f - k / n).max() < np.abs(raw - k / n).max() / 3
    many = plan_math.debiased_rank_profile(np.linspace(0.2, 0.0, n) * k / np.linspace(0.2, 0.0, n).sum(), 10**6, k)
    np.testing.assert_allclose(many, np.linspace(0.2, 0.0, n) * k / np.linspace(0.2, 0.0, n).sum(), atol=2e-3)
    with pytest.raises(ValueError, match="cannot be debiased"):
        plan_math.debiased_rank_profile(raw, 0, k)


def test_the_runtimes_planner_rejects_bad_params():
    params = _lib.PlanParams()
    result = _lib.PlanResult()
    assert _lib.lib().ggml_zipmoe_plan_pools(ctypes.byref(params), ctypes.byref(result)) != 0
    params.n_expert, params.k, params.budget, params.threads, params.n_shards = 8, 9, 1000, 1, 1
    params.n_tensors, params.n_layer, params.grid_steps = 3, 1, 10
    params.entry_bytes[0] = 100
    assert _lib.lib().ggml_zipmoe_plan_pools(ctypes.byref(params), ctypes.byref(result)) != 0  # k > N
    params.k = 2
    assert _lib.lib().ggml_zipmoe_plan_pools(ctypes.byref(params), ctypes.byref(result)) == 0
    assert result.capacity[0] == 8  # 1000 bytes hold every expert of the one layer
    bad_q = (ctypes.c_double * 8)(*([0.25] * 7 + [1.5]))
    params.q = bad_q
    assert _lib.lib().ggml_zipmoe_plan_pools(ctypes.byref(params), ctypes.byref(result)) != 0


def pooled_run(path, budget, n_seq: int = 2, while_decoding: list | None = None, **options):
    """(logits, statistics after the context is freed); while_decoding gets the statistics before it is"""
    llm = load(path, zipmoe_budget=budget, zipmoe_preload=True, **options)
    try:
        logits, _ = logits_trace(llm, PROMPTS[:n_seq], before_free=(
            None if while_decoding is None else lambda: while_decoding.append(llm.zipmoe_stats())))
        return logits, llm.zipmoe_stats()
    finally:
        llm.close()


@pytest.fixture(scope="module")
def references(tiny_gguf):
    made = {}

    def get(arch, n_seq: int = 2):
        if (arch, n_seq) not in made:
            llm = load(tiny_gguf(arch))
            made[arch, n_seq] = logits_trace(llm, PROMPTS[:n_seq])[0]
            llm.close()
        return made[arch, n_seq]
    return get


def test_every_compressed_expert_fits_nothing_is_read_after_the_preload(arch, zipmoe_gguf, references, first_plan):
    path = zipmoe_gguf(arch)
    one, n_expert, everything = expert_geometry(path)
    logits, stats = pooled_run(path, int(everything * 0.9))
    memory = stats["memory"]
    assert memory["pools"]["C"] == n_expert and memory["pools"]["S"] == memory["pools"]["E"] == 0
    assert memory["pools"]["F"] >= 1 and "every compressed expert fits" in memory["pools_why"]
    assert stats["expert_misses"] == 0 and stats["bytes_read"] == 0
    assert stats["c_hits"] > 0 and stats["expert_hits"] > 0
    np.testing.assert_array_equal(logits, references(arch))


def test_between_the_planner_picks_the_pools_and_stays_exact(arch, zipmoe_gguf, references, first_plan):
    path = zipmoe_gguf(arch)
    one, n_expert, everything = expert_geometry(path)
    logits, stats = pooled_run(path, everything // 2)
    memory = stats["memory"]
    assert "planner (uniform profile" in memory["pools_why"]
    if any(memory["pools"][p] for p in "CSE"):
        assert stats["c_hits"] + stats["s_hits"] + stats["e_hits"] > 0
        from zipmoe_py import format as zformat

        with zformat.ZipMoEFile(path) as zf:
            n_moe = len(zf.moe_layers())
        assert memory["n_slots"] == memory["pools"]["F"] * n_moe + 8  # 8 working slots by default
    np.testing.assert_array_equal(logits, references(arch))


def test_short_of_every_compressed_expert_c_and_e_keep_each_compressed_and_stay_exact(arch, zipmoe_gguf, references, first_plan):
    """A byte short of every compressed expert in C (and the working slots): C keeps all but one per layer, E
    that one's E-chunks, and a token reads at most its SM-chunks. The budget is found as the runtime sizes it."""
    from test_serving import Serving, default_pools_at, lowest_budget

    path = zipmoe_gguf(arch)
    made = []

    def make(**kwargs):
        kwargs.setdefault("available", 1 << 30)
        made.append(Serving(path, n_expert_used=TOP_K[arch], work_slots=8, **kwargs))
        return made[-1]
    try:
        inclusive = lowest_budget(make, lambda why: why.startswith("every compressed expert fits"))
        n_expert = made[0].info().max_expert
        assert default_pools_at(make, inclusive - 1)[0] == [0, n_expert - 1, 0, 1]
    finally:
        for s in made:
            s.close()
    logits, stats = pooled_run(path, inclusive - 1)
    memory = stats["memory"]
    assert [memory["pools"][p] for p in POOLS] == [0, n_expert - 1, 0, 1]
    assert memory["pools_why"].startswith("every expert kept compressed")
    assert stats["c_hits"] > 0
    np.testing.assert_array_equal(logits, references(arch))


def test_one_f_pool_when_every_expert_fits_or_when_turned_off(arch, zipmoe_gguf, references):
    path = zipmoe_gguf(arch)
    _, _, everything = expert_geometry(path)
    logits, stats = pooled_run(path, everything)
    assert not any(stats["memory"]["pools"].values())
    assert "every expert fits full" in stats["memory"]["pools_why"]
    np.testing.assert_array_equal(logits, references(arch))
    logits, stats = pooled_run(path, int(everything * 0.9), zipmoe_auto_pools=False)
    assert not any(stats["memory"]["pools"].values()) and "auto_pools is off" in stats["memory"]["pools_why"]
    assert stats["c_hits"] == 0
    np.testing.assert_array_equal(logits, references(arch))


@pytest.fixture
def first_plan(monkeypatch):
    """the pools planned at load kept (zipmoe.replan_tokens 0): what a test of the first plan looks at"""
    monkeypatch.setenv("ZIPMOE_REPLAN_TOKENS", "0")


@pytest.mark.parametrize("n_seq", [1, 2])
def test_pools_are_planned_again_from_the_routing_seen_and_stay_exact(arch, n_seq, zipmoe_gguf, references,
                                                                       monkeypatch):
    """After zipmoe.replan_tokens decode steps (one token of each sequence: one decoding, or two in
    parallel) the default pools are planned from those steps' routing, and changed if the expected gain
    repays the reads the change costs; 0 keeps the first plan."""
    path = zipmoe_gguf(arch)
    _, _, everything = expert_geometry(path)
    monkeypatch.setenv("ZIPMOE_REPLAN_TOKENS", "8")
    seen = []
    logits, stats = pooled_run(path, everything // 2, n_seq=n_seq, while_decoding=seen)
    why = seen[0]["memory"]["pools_why"]  # after the re-plans at 8 and 16 steps: planned, or kept, on the routing seen
    assert "the planner (observed profile" in why or "(kept after a re-plan from the observed profile" in why, why
    np.testing.assert_array_equal(logits, references(arch, n_seq))
    monkeypatch.setenv("ZIPMOE_REPLAN_TOKENS", "0")
    seen = []
    logits, stats = pooled_run(path, everything // 2, n_seq=n_seq, while_decoding=seen)
    assert "uniform profile" in seen[0]["memory"]["pools_why"] and "re-plan" not in seen[0]["memory"]["pools_why"]
    np.testing.assert_array_equal(logits, references(arch, n_seq))


def test_a_re_plan_that_moves_experts_from_c_to_f_decodes_them_from_c_and_stays_exact(zipmoe_gguf, references,
                                                                                      monkeypatch):
    """Budgets where a re-plan after 4 decode steps changes the first plan's pools (C and E) to F, C and
    E, or to one F pool: the experts C holds that F now takes are decoded from their C entries into
    slots during the change (ggml_zipmoe_cache_set_pools_migrating), not read again; the logits stay
    bit-exact. The re-plan follows the rates measured on this machine (on the tiny model, 0.02-0.03 GB/s
    reads: per-read overhead), so which budgets change is the machine's (CI's counted no move at 0.65 and
    0.8 when one F pool, all pools 0, was not counted as F; here 0.8 goes to one F pool)."""
    path = zipmoe_gguf("deepseek2")
    _, _, everything = expert_geometry(path)
    monkeypatch.setenv("ZIPMOE_REPLAN_TOKENS", "4")
    moved = 0
    for share in (0.5, 0.65, 0.8):
        seen = []
        logits, stats = pooled_run(path, int(everything * share), n_seq=2, while_decoding=seen)
        np.testing.assert_array_equal(logits, references("deepseek2", 2))
        pools = seen[0]["memory"]["pools"]
        if pools["F"] > 0 or not any(pools.values()):  # F pools, or one F pool
            moved += seen[0]["migrate_experts"]
            assert (seen[0]["migrate_ns"] > 0) == (seen[0]["migrate_experts"] > 0)
    assert moved > 0  # at least one of the budgets moved experts from C to F


def test_auto_pools_is_checked_against_the_other_pool_options(zipmoe_gguf):
    from zipmoe_py.options import zipmoe_overrides

    with pytest.raises(ZipMoEError, match="zipmoe_auto_pools must be True or False"):
        zipmoe_overrides(auto_pools="yes")
    with pytest.raises(ZipMoEError, match="zipmoe_auto_pools is for the default pools"):
        zipmoe_overrides(pools="F=2,C=4", auto_pools=True)
    assert zipmoe_overrides(auto_pools=False) == {"zipmoe.auto_pools": False}


def test_chat_stats_say_which_pools_and_why(zipmoe_gguf, first_plan):
    # the first plan's (a re-plan at the reply's first decode step may change it: its prompt is long enough)
    path = zipmoe_gguf("qwen2moe")
    _, _, everything = expert_geometry(path)
    out = run([zipmoe_command("zipmoe-chat"), str(path), "--budget", str(int(everything * 0.9)), "-p", "Hello",
               "-n", "4", "--stats"])
    err = out.stderr.decode(errors="replace")
    assert out.returncode == 0, err
    assert "[stats] pools per MoE layer: F " in err and "C 16" in err
    assert "every compressed expert fits" in err
    out = run([zipmoe_command("zipmoe-chat"), str(path), "--no-auto-pools", "--pools", "F=1,C=2", "-p", "Hi"])
    assert out.returncode != 0 and "--auto-pools is for the default pools" in out.stderr.decode(errors="replace")


def fill_c(handle, cache, moe_layers, selections):
    """each MoE layer in turn fetches each of selections (one token each) through the bare cache"""
    for layer in sorted(moe_layers):
        for ids in selections:
            ids = np.ascontiguousarray([ids], np.int32)
            out = np.full(ids.shape, -1, np.int32)
            assert handle.ggml_zipmoe_cache_fetch(cache, layer, 0, ids.ctypes.data, ids.shape[1], 1, ids.shape[1],
                                                  out.ctypes.data, 0, 1) == 0, handle.ggml_zipmoe_cache_error(cache)


@contextlib.contextmanager
def rank_cache(path, n_slots: int = 40, movable_pages: bool = False):
    """A bare cache on path's MoE layers (rank eviction, host slots): (cache, handle, moe_layers).
    movable_pages: the slots in mappings of their own, which may take store pages."""
    import mmap

    from zipmoe_py import format as zformat

    with zformat.ZipMoEFile(path) as zf:
        moe_layers = zf.moe_layers()
    handle = _lib.lib()
    err = ctypes.create_string_buffer(1024)
    file = handle.ggml_zipmoe_file_open(str(path).encode(), 0, err, 1024)
    assert file, err.value
    one, _, _ = expert_geometry(path)
    size = n_slots * one // 3 + 64
    maps = [mmap.mmap(-1, size) for _ in range(3)] if movable_pages else []
    buffers = [(ctypes.c_char * size).from_buffer(m) for m in maps] or \
              [ctypes.create_string_buffer(size) for _ in range(3)]
    params = _lib.CacheParams()
    params.file, params.n_slots, params.eviction = file, n_slots, 4
    params.slot_pages_movable = int(movable_pages)
    for k in range(3):
        params.slot_data[k] = ctypes.addressof(buffers[k])
        params.slot_stride[k] = one // 3
    params.set_layers(moe_layers)
    cache = handle.ggml_zipmoe_cache_new(ctypes.byref(params), err, 1024)
    try:
        assert cache, err.value
        yield cache, handle, moe_layers
    finally:
        if cache:
            handle.ggml_zipmoe_cache_free(cache)
        handle.ggml_zipmoe_file_close(file)
        del buffers  # the views before their maps
        for m in maps:
            m.close()


def test_set_pools_names_what_is_wrong(zipmoe_gguf):
    """The cache's reconfiguration refuses bad capacities with a message, and leaves the cache usable."""
    path = zipmoe_gguf("qwen2moe")  # 4 MoE layers
    one, n_expert, _ = expert_geometry(path)
    with rank_cache(path) as (cache, handle, moe_layers):
        assert len(moe_layers) == 4
        negative = (ctypes.c_int32 * 4)(0, -1, 0, 0)
        assert handle.ggml_zipmoe_cache_set_pools(cache, negative, 10, 0) != 0
        assert b"pool C's capacity is negative" in handle.ggml_zipmoe_cache_error(cache)
        no_work_slot = (ctypes.c_int32 * 4)(10, 4, 0, 0)  # F 10 per layer x 4 layers = 40 slots: none to work in
        assert handle.ggml_zipmoe_cache_set_pools(cache, no_work_slot, 40, 0) != 0
        assert b"working slot" in handle.ggml_zipmoe_cache_error(cache)
        too_many = (ctypes.c_int32 * 4)(1, 4, 0, 0)
        assert handle.ggml_zipmoe_cache_set_pools(cache, too_many, 41, 0) != 0
        good = (ctypes.c_int32 * 4)(2, n_expert, 0, 0)
        assert handle.ggml_zipmoe_cache_set_pools(cache, good, 16, 1) == 0
        size = ctypes.c_size_t()
        assert handle.ggml_zipmoe_cache_pool_entries(cache, 1, ctypes.byref(size)) == n_expert * 4
        assert handle.ggml_zipmoe_cache_pool_entries(cache, 0, None) == 8
        choice = _lib.DefaultPools()
        assert handle.ggml_zipmoe_cache_default_pools(cache, 1 << 40, 6, 2, 8, 0, 0, None, ctypes.byref(choice)) == 0
        assert list(choice.capacity) == [0, 0, 0, 0]
        every = size_text(one * n_expert * len(moe_layers)).encode()
        assert b"one F pool: every expert fits full (%s of 1024.00 GiB)" % every in choice.why, choice.why
        # a budget of 3 slots: said in slots, beside what pools would need (4 MoE layers, 8 working slots), and
        # its size in the unit that keeps a number of one or more (a tiny model's budget once read "0.00 GiB")
        assert handle.ggml_zipmoe_cache_default_pools(cache, 3 * one, 2, 2, 8, 0, 0, None, ctypes.byref(choice)) == 0
        assert list(choice.capacity) == [0, 0, 0, 0]
        assert b"one F pool: %s holds 3 full experts, too few for pools, which need more than 8 working slots and " \
               b"one expert per MoE layer in F (12)" % size_text(3 * one).encode() in choice.why, choice.why
        assert b"0.00 GiB" not in choice.why


def test_a_change_of_pools_costs_rank_by_rank_what_it_reads_decodes_and_touches(zipmoe_gguf, tmp_path):
    """refill_s, rank by rank from the cache's pools to the chosen ones: an expert dropped beyond every new
    pool costs nothing up front (its next use is a miss, as the new pools' makespan counts it); one that
    changes pool is read whole on its next use, and, bound for F, decoded; from C or S to host slots, the
    change decodes those the store holds that were used again (S's after reading their E-chunks), and the
    others' next use, if any, is a miss; the
    slots those fills write past those in use are written for the first time at the touch rate, but for
    the pages the stores give up, where the slots take them. The re-plan weighs it against the expected gain."""
    path = zipmoe_gguf("qwen2moe")
    one, n_expert, _ = expert_geometry(path)
    touch = _lib.default_rate(_lib.RATE_TOUCH)
    with rank_cache(path) as (cache, handle, moe_layers):
        layers = len(moe_layers)
        choice = _lib.DefaultPools()

        def plan(read, decode=1e9):
            budget = (8 + 2 * layers) * one  # F or little else: C-heavy pools must shrink
            assert handle.ggml_zipmoe_cache_default_pools(cache, budget, 2, 2, 8, read, decode, None,
                                                          ctypes.byref(choice)) == 0
            return list(choice.capacity), choice.n_slots, choice.refill_s

        # the plan for this budget: one F pool of 16 slots, 4 experts per layer
        pools, n_slots, _ = plan(1e9)
        assert pools == [0, 0, 0, 0] and n_slots == 4 * layers
        # from one F pool of 40 slots (10 per layer): what it drops goes nowhere, nothing to fill
        assert plan(1e9)[2] == 0.0
        # from every expert in C (8 slots in use), C holding none: F's experts are read on their next use
        # (a miss, which the new pools' makespan leaves out as it does a dropped expert's), nothing up front
        assert handle.ggml_zipmoe_cache_set_pools(cache, (ctypes.c_int32 * 4)(0, n_expert, 0, 0), 8, 0) == 0
        assert plan(1e9)[2] == 0.0
        # C holding experts 0-3 of each layer, used twice, and the last two layers' in the 8 slots: the
        # others F takes are decoded from C on 2 threads, and 8 of the slots past those in use touched
        # by them; the rest of C goes nowhere
        fill_c(handle, cache, moe_layers, [[0, 1, 2, 3]] * 2)
        from_c = plan(1e9)[2]
        assert from_c == 0.0 + float(4 * one) * (layers - 2) / (1e9 * 2) + 8 * one / (touch * 2)
        # the same from S: decoded as from C, after reading their E-chunks (compressed exponents, less
        # than half the SM-chunks, half an expert's BF16 bytes, that a miss reads as well)
        assert handle.ggml_zipmoe_cache_set_pools(cache, (ctypes.c_int32 * 4)(0, 0, n_expert, 0), 8, 0) == 0
        fill_c(handle, cache, moe_layers, [[0, 1, 2, 3]] * 2)
        e_chunks = (plan(1e9)[2] - from_c) * 1e9
        assert 0 < e_chunks < 0.5 * (one / 2) * 4 * (layers - 2), e_chunks
        # from F 2 and the rest in E (16 slots in use): F's 2 stay, the next 2 are read whole on their next
        # use (a change keeps an entry only in its own pool), SM-chunks (half an expert's BF16 bytes) and
        # E-chunks, and decoded; no new slots. From S (keeping what it held): its E-chunks, less
        decoded = float(2 * one) * layers / (5e8 * 2)
        costs = []
        for store in (2, 3):
            pools = [2, 0, 0, 0]
            pools[store] = n_expert - 2
            assert handle.ggml_zipmoe_cache_set_pools(cache, (ctypes.c_int32 * 4)(*pools), 16, 0) == 0
            costs.append(plan(1e9, decode=5e8)[2])
        assert (costs[1] - decoded) * 1e9 > one * layers and 0 < costs[0] < costs[1]
        # from the plan's own pools: nothing changes
        assert handle.ggml_zipmoe_cache_set_pools(cache, (ctypes.c_int32 * 4)(0, 0, 0, 0), n_slots, 0) == 0
        assert plan(1e9)[2] == 0.0

    # slots that take the pages of the entries the stores give up, whole 2 MiB blocks (experts of 2 MiB
    # tensors): from every expert in C to one F pool, the new slots' first writes are those C's entries
    # spare not, each a block less than its size
    src = make_moe_gguf(tmp_path / "big.gguf", shape=(1024, 1024, 8))
    path = tmp_path / "big.zipmoe.gguf"
    zformat.repack(src, path, shards=3)
    one, n_expert, _ = expert_geometry(path)
    with rank_cache(path, movable_pages=True) as (cache, handle, moe_layers):
        layers = len(moe_layers)
        pools, n_slots, _ = plan(1e9)
        assert pools == [0, 0, 0, 0] and n_slots > 8  # one F pool, n_slots // layers per layer
        assert handle.ggml_zipmoe_cache_set_pools(cache, (ctypes.c_int32 * 4)(0, n_expert, 0, 0), 8, 0) == 0
        # C holding every expert, each used twice, and the last layer's eight in the slots
        fill_c(handle, cache, moe_layers, [[0, 1, 2, 3], [4, 5, 6, 7]] * 2)
        entry_c = ctypes.c_size_t()
        handle.ggml_zipmoe_cache_pool_entries(cache, 1, ctypes.byref(entry_c))
        spared = n_expert * layers * (entry_c.value - (2 << 20)) if kernel_moves_pages() else 0
        assert spared > 0 or not kernel_moves_pages()
        migrants = n_slots // layers * (layers - 1)
        touched = max(0, min(n_slots - 8, migrants) * one - spared)  # none here: C gives up more than they take
        assert plan(1e9)[2] == 0.0 + float(migrants * one) / (1e9 * 2) + touched / (touch * 2)


def test_device_pools_keep_compressed_experts_in_host_memory_beside_device_slots(zipmoe_gguf):
    """Slots in a device's memory (a GPU, an rpc-server): its slots are F and working slots, and host
    memory keeps the other experts compressed, all in C where they fit, else C and the E-chunks of the
    rest, else E-chunks alone; one F pool where every expert fits the device or nothing fits the host."""
    path = zipmoe_gguf("qwen2moe")  # 4 MoE layers
    one, n_expert, _ = expert_geometry(path)
    work = 8
    with rank_cache(path) as (cache, handle, moe_layers):
        layers = len(moe_layers)
        # the entries' sizes, as the cache makes them
        assert handle.ggml_zipmoe_cache_set_pools(cache, (ctypes.c_int32 * 4)(1, 1, 0, 1), 12, 0) == 0
        entry_c, entry_e = ctypes.c_size_t(), ctypes.c_size_t()
        handle.ggml_zipmoe_cache_pool_entries(cache, 1, ctypes.byref(entry_c))
        handle.ggml_zipmoe_cache_pool_entries(cache, 3, ctypes.byref(entry_e))
        c, e = entry_c.value, entry_e.value
        assert 0 < e < c < one

        def pools(n_device_slots, host_bytes):
            choice = _lib.DefaultPools()
            assert handle.ggml_zipmoe_cache_device_pools(cache, n_device_slots, host_bytes, work, ctypes.byref(choice)) == 0
            return list(choice.capacity), choice.n_slots, choice.why.decode()

        f = 2
        device = work + f * layers + 1  # one slot past F's: a ninth working slot
        rest = n_expert - f
        got, n, why = pools(device, rest * c * layers)
        assert got == [f, rest, 0, 0] and n == device and "nothing after its first use" in why, why
        # a byte short of all in C: C as many as leave room for the E-chunks of the others
        got, _, why = pools(device, rest * c * layers - 1)
        assert got == [f, rest - 1, 0, 1] and "at most its SM-chunks" in why, why
        # room for E-chunks alone
        got, _, why = pools(device, rest * e * layers)
        assert got == [f, 0, 0, rest], why
        got, _, why = pools(device, (rest - 1) * e * layers)
        assert got == [f, 0, 0, rest - 1] and "the experts not kept in full" in why, why
        # one F pool: nothing fits the host, every expert fits the device, too few device slots
        assert pools(device, e * layers - 1)[0] == [0, 0, 0, 0]
        assert "holds no compressed expert" in pools(device, e * layers - 1)[2]
        got, n, why = pools(n_expert * layers, 1 << 40)
        assert got == [0, 0, 0, 0] and n == n_expert * layers and "hold every expert" in why
        got, _, why = pools(work + layers - 1, 1 << 40)
        assert got == [0, 0, 0, 0] and "too few for pools" in why, why
        assert handle.ggml_zipmoe_cache_device_pools(cache, 20, 0, 0, ctypes.byref(_lib.DefaultPools())) != 0


def test_pools_on_an_observed_profile_must_beat_one_f_pool_by_a_tenth(zipmoe_gguf):
    """On an observed profile the planner's makespan leaves out what pools cost beyond it (the stores' first
    writes, decoding on the graph's threads, a change's migration), so pools must expect a tenth less than
    one F pool; within that, one F pool. The built-in profile keeps the plain comparison."""
    path = zipmoe_gguf("qwen2moe")
    one, n_expert, _ = expert_geometry(path)
    with rank_cache(path) as (cache, handle, moe_layers):
        layers = len(moe_layers)
        choice = _lib.DefaultPools()
        within_a_tenth = 0
        for skew in np.linspace(0.0, 3.0, 13):
            f = np.exp(-skew * np.arange(n_expert) / n_expert)
            f = np.minimum(f * 2 / f.sum(), 1.0)
            f *= 2 / f.sum()
            profile = (ctypes.c_double * n_expert)(*f)
            for per_layer in (3, 4, 5, 6):
                for read in (2e8, 1e9):
                    budget = (8 + per_layer * layers) * one
                    assert handle.ggml_zipmoe_cache_default_pools(cache, budget, 2, 2, 8, read, 1e9, profile,
                                                                  ctypes.byref(choice)) == 0
                    pools = any(choice.capacity[1:])
                    if pools:
                        assert choice.expected_makespan_s <= 0.9 * choice.f_only_makespan_s, choice.why
                    elif choice.expected_makespan_s < choice.f_only_makespan_s:
                        # the planner's pools were better, not by a tenth: one F pool, and the reason says so
                        within_a_tenth += 1
                        assert b"pools no better by a tenth" in choice.why, choice.why
        assert within_a_tenth > 0
