"""ggml_zipmoe_schedule, ZipMoE's cache-affinity scheduler (paper §3.3, Appendix A), against the
reference model in sched_sim.py: the same schedule as a Python Algorithm 1, the schedule's
structure, hand-worked blocks, argument checks, Lemma B.3, and ALG <= (3 - 1/L) OPT (Theorem 3.1)
against the exact optimum of many small instances (worst ratios printed with -s)."""
from __future__ import annotations

import ctypes
import math
import random

import pytest

import sched_sim as sim
from sched_sim import C, E, F, M, S
from zipmoe_py import _lib


@pytest.fixture(scope="module")
def lib():
    return _lib.lib()


def call(lib, tasks, n, K, L, u=1.0, rho=0.5, c=0.5, work_size=None, misalign=False, null=()):
    """Raw call: (status, result). `null` names the pointers to pass as NULL."""
    cap = max(len(tasks), 1)
    arr = (_lib.SchedTask * cap)(*[_lib.SchedTask(ex, st, p) for ex, st, p in tasks])
    params = _lib.SchedParams(u, rho, c, K, L)
    kk = K if 1 <= K <= 64 else 1  # past that only argument checks run
    res = _lib.SchedResult((_lib.SchedOp * (cap * (kk + 1)))(), (_lib.SchedOp * (cap * kk))(),
                           (ctypes.c_int32 * cap)(), (ctypes.c_int32 * (cap + 1))(), (ctypes.c_int32 * cap)())
    for name in null:
        if name in ("io", "dec", "order", "block_start", "task_block"):
            setattr(res, name, None)
    need = _lib.sched_work_size(max(n, 0), kk, max(L, 1))
    work = (ctypes.c_double * (need // 8 + 1))()
    ptr = ctypes.addressof(work) + (4 if misalign else 0)
    size = need if work_size is None else work_size
    status = lib.ggml_zipmoe_schedule(None if "tasks" in null else arr, n,
                                      None if "params" in null else ctypes.byref(params),
                                      None if "work" in null else ptr, size,
                                      None if "result" in null else ctypes.byref(res))
    return status, res


def schedule(lib, inst: sim.Instance) -> dict:
    status, r = call(lib, inst.tasks, inst.n, inst.K, inst.L, inst.u, inst.rho, inst.c)
    assert status == _lib.OK, _lib.status_string(status) if status else status
    starts = [r.block_start[b] for b in range(r.n_blocks + 1)]
    order = [r.order[i] for i in range(r.n_order)]
    return {"io": [(r.io[i].task, r.io[i].chunk) for i in range(r.n_io)],
            "dec": [(r.dec[i].task, r.dec[i].chunk) for i in range(r.n_dec)],
            "order": order, "blocks": [order[starts[b]:starts[b + 1]] for b in range(r.n_blocks)],
            "task_block": [r.task_block[j] for j in range(inst.n)]}


def random_instance(rng, n=(2, 4), K=(1, 3), L=(1, 3), max_reads=None, max_dec=None) -> sim.Instance:
    while True:
        n_tasks = rng.randint(*n)
        n_expert = rng.randint(1, max(n_tasks, 1))
        p = [0.0 if rng.random() < 0.05 else round(rng.uniform(0.01, 3.0), 3) for _ in range(n_expert)]
        tasks = []
        for _ in range(n_tasks):
            ex = rng.randrange(n_expert)
            tasks.append((ex, rng.randrange(5), p[ex]))
        c = 0.0 if rng.random() < 0.03 else round(rng.uniform(0.02, 2.0), 3)
        inst = sim.Instance(tuple(tasks), round(rng.uniform(0.05, 2.0), 3), round(rng.uniform(0.2, 1.0), 3), c,
                            rng.randint(*K), rng.randint(*L))
        if (max_reads is None or len(inst.reads()) <= max_reads) and (max_dec is None or len(inst.decompressions()) <= max_dec):
            return inst


#
# the C function is Algorithm 1 as sched_sim reads it, and its schedules have the paper's structure
#

def test_matches_the_reference_algorithm_1(lib):
    rng = random.Random(1)
    for _ in range(1500):
        inst = random_instance(rng, n=(0, 10), K=(1, 4), L=(1, 4))
        assert schedule(lib, inst) == sim.reference_schedule(inst), inst.describe()


def check_structure(inst: sim.Instance, out: dict):
    K, L = inst.K, inst.L
    # every required operation exactly once (simulate checks it too); F tasks have none
    assert sorted(out["io"]) == sorted(inst.reads()) and len(set(out["io"])) == len(out["io"])
    assert sorted(out["dec"]) == sorted(inst.decompressions()) and len(set(out["dec"])) == len(out["dec"])
    work = [j for j in range(inst.n) if inst.state(j) != F]
    assert sorted(out["order"]) == work
    for j in range(inst.n):
        assert (out["task_block"][j] == -1) == (inst.state(j) == F)
        if out["task_block"][j] >= 0:
            assert j in out["blocks"][out["task_block"][j]]
    assert all(out["blocks"])

    # blocks one after the other: E-chunks before SM-chunks, each in task order; decompressions in task order
    io_at = dec_at = 0
    type_1 = sim.priority_sorted(inst, [j for j in work if sim.is_type_1(inst.state(j))])
    type_2 = sim.priority_sorted(inst, [j for j in work if not sim.is_type_1(inst.state(j))])
    placed = []
    for b, blk in enumerate(out["blocks"]):
        bio = out["io"][io_at:io_at + sum(K * sim.reads_e(inst.state(j)) + sim.reads_sm(inst.state(j)) for j in blk)]
        io_at += len(bio)
        kinds = [ch > 0 for _, ch in bio]
        assert kinds == sorted(kinds, reverse=True), f"block {b}: an SM-chunk read before an E-chunk"
        assert bio == [(j, 1 + s) for j in blk if sim.reads_e(inst.state(j)) for s in range(K)] + \
                      [(j, 0) for j in blk if sim.reads_sm(inst.state(j))]
        assert out["dec"][dec_at:dec_at + K * len(blk)] == [(j, 1 + s) for j in blk for s in range(K)]
        dec_at += K * len(blk)

        # tasks are taken in priority order: the blocks so far hold a prefix of sigma_I and one of sigma_II
        placed += blk
        n_1 = sum(j in placed for j in type_1)
        n_2 = sum(j in placed for j in type_2)
        assert set(type_1[:n_1]) | set(type_2[:n_2]) == set(placed)
        # a block has a Type-I base while there is one left
        if any(j not in placed[:-len(blk)] for j in type_1):
            assert any(sim.is_type_1(inst.state(j)) for j in blk)

        # every block but the last is compute-dominant on the schedule so far
        if b < len(out["blocks"]) - 1:
            th = sim.run_threads(inst, out["io"][:io_at], out["dec"][:dec_at])
            assert sim.compute_dominant(inst, th, 1e-7 * (1 + th.io_end)), f"block {b} is not compute-dominant"


def test_schedule_structure(lib):
    rng = random.Random(2)
    for _ in range(800):
        inst = random_instance(rng, n=(1, 12), K=(1, 4), L=(1, 5))
        check_structure(inst, schedule(lib, inst))


def test_hand_worked_blocks(lib):
    # M task with bubbles (E-chunks in 0.5, c = 0.25): the C task fills them from the front
    inst = sim.Instance(((0, M, 1.0), (1, C, 0.5)), u=1.0, rho=1.0, c=0.25, K=2, L=2)
    out = schedule(lib, inst)
    assert out["blocks"] == [[1, 0]]
    assert out["io"] == [(0, 1), (0, 2), (0, 0)]
    assert out["dec"] == [(1, 1), (1, 2), (0, 1), (0, 2)]

    # an S task adds idle time wherever it goes: it falls back behind the Type-I task of larger p
    inst = sim.Instance(((0, M, 1.0), (1, S, 0.5)), u=1.0, rho=1.0, c=0.25, K=1, L=1)
    out = schedule(lib, inst)
    assert out["blocks"] == [[0, 1]]
    assert out["io"] == [(0, 1), (1, 1), (0, 0)]

    # c > u: each E task alone keeps the worker c - u >= rho*u/K behind the I/O thread
    inst = sim.Instance(((0, E, 1.0), (1, E, 2.0), (2, F, 5.0)), u=1.0, rho=0.5, c=2.0, K=1, L=1)
    out = schedule(lib, inst)
    assert out["blocks"] == [[1], [0]]
    assert out["task_block"] == [1, 0, -1]
    assert out["io"] == [(1, 0), (0, 0)]

    # no Type-I task: Type-II tasks still get scheduled, in blocks of their own
    inst = sim.Instance(((0, C, 1.0), (1, S, 2.0)), u=1.0, rho=0.5, c=1.0, K=2, L=2)
    out = schedule(lib, inst)
    assert sorted(out["order"]) == [0, 1]
    check_structure(inst, out)

    # sigma_I keeps an expert's tasks adjacent among equal p (c > u: one block per task shows it)
    inst = sim.Instance(((1, E, 1.0), (0, E, 1.0), (1, E, 1.0), (0, E, 1.0)), u=1.0, rho=0.5, c=2.0, K=1, L=1)
    assert schedule(lib, inst)["blocks"] == [[1], [3], [0], [2]]


def test_empty_and_all_full_hits(lib):
    assert schedule(lib, sim.Instance((), 1.0, 0.5, 0.5, 2, 2))["blocks"] == []
    status, r = call(lib, [], 0, 2, 2, null=("tasks", "work", "io", "dec", "order", "task_block"))
    assert status == _lib.OK and r.n_blocks == 0 and r.block_start[0] == 0
    out = schedule(lib, sim.Instance(((0, F, 1.0), (1, F, 2.0)), 1.0, 0.5, 0.5, 2, 2))
    assert out == {"io": [], "dec": [], "order": [], "blocks": [], "task_block": [-1, -1]}


def test_invalid_arguments(lib):
    ok = [(0, M, 1.0), (1, S, 2.0)]
    assert call(lib, ok, 2, 2, 2)[0] == _lib.OK
    bad = [
        dict(n=-1), dict(K=0), dict(K=-3), dict(L=0), dict(L=-1),
        dict(tasks=[(0, -1, 1.0), (1, S, 2.0)]), dict(tasks=[(0, 5, 1.0), (1, S, 2.0)]),
        dict(tasks=[(0, M, -1.0), (1, S, 2.0)]), dict(tasks=[(0, M, math.nan), (1, S, 2.0)]),
        dict(tasks=[(0, M, math.inf), (1, S, 2.0)]),
        dict(tasks=[(0, M, 1.0), (0, S, 2.0)]),  # one expert, two execution times
        dict(u=-1.0), dict(u=math.nan), dict(rho=-0.5), dict(rho=math.inf), dict(c=-1e-9), dict(c=math.nan),
        dict(K=1 << 30),  # n_tasks*(K + 1) overflows int32
        dict(misalign=True),
    ] + [dict(null=(name,)) for name in ("tasks", "params", "work", "result", "io", "dec")]
    for case in bad:
        kw = dict(tasks=ok, n=2, K=2, L=2)
        kw.update(case)
        if kw["K"] >= 1 << 30:
            kw["work_size"] = 1 << 40  # only the overflow check may fail
        assert call(lib, kw.pop("tasks"), kw.pop("n"), kw.pop("K"), kw.pop("L"), **kw)[0] == _lib.ERR_ARG, case
    need = _lib.sched_work_size(2, 2, 3)
    assert call(lib, ok, 2, 2, 3, work_size=need - 1)[0] == _lib.ERR_CAPACITY
    assert call(lib, ok, 2, 2, 3, work_size=need)[0] == _lib.OK


def test_the_block_outputs_are_optional_and_change_nothing(lib):
    # the expert cache reads only the reads and decompressions: order, block_start and task_block NULL
    tasks = [(0, M, 1.0), (1, S, 2.0), (2, E, 0.5), (3, F, 1.0)]
    full_status, full = call(lib, tasks, 4, 2, 2)
    status, bare = call(lib, tasks, 4, 2, 2, null=("order", "block_start", "task_block"))
    assert status == full_status == _lib.OK
    assert (bare.n_io, bare.n_dec, bare.n_order, bare.n_blocks) == (full.n_io, full.n_dec, full.n_order, full.n_blocks)
    ops = lambda r, name, n: [(getattr(r, name)[i].task, getattr(r, name)[i].chunk) for i in range(n)]
    assert ops(bare, "io", bare.n_io) == ops(full, "io", full.n_io)
    assert ops(bare, "dec", bare.n_dec) == ops(full, "dec", full.n_dec)


#
# the reference model itself
#

def test_optimal_search_equals_brute_force():
    rng = random.Random(3)
    for _ in range(120):
        inst = random_instance(rng, max_reads=5, max_dec=4)
        assert sim.optimal(inst) == pytest.approx(sim.brute_force(inst, "start"), rel=1e-9, abs=1e-12), inst.describe()


def test_waiting_can_beat_every_work_conserving_schedule():
    # why OPT is searched among start orders: the worker should idle until B's E-chunk arrives
    inst = sim.Instance(((0, C, 0.1), (1, S, 10.0)), u=1.0, rho=0.5, c=2.0, K=1, L=1)
    assert sim.brute_force(inst, "priority") == pytest.approx(14.0)
    assert sim.optimal(inst) == pytest.approx(12.6)


def test_priority_and_start_order_simulations_agree(lib):
    rng = random.Random(4)
    for _ in range(200):
        inst = random_instance(rng, n=(1, 8), K=(1, 4), L=(1, 4))
        out = schedule(lib, inst)
        run = sim.simulate(inst, out["io"], out["dec"])
        started = sorted((s, w, j, ch) for w, ops in enumerate(run.workers) for j, ch, s, _ in ops)
        again = sim.simulate(inst, out["io"], [(j, ch) for _, _, j, ch in started], mode="start")
        assert again.makespan == pytest.approx(run.makespan, rel=1e-12, abs=1e-12)


def test_paper_critical_path_is_not_a_bound_with_per_shard_decompression():
    # eq. (3) waits for all K E-chunks before decompressing: 1 + 2*0.25; shard by shard it is 1.25
    inst = sim.Instance(((0, S, 0.0),), u=1.0, rho=1.0, c=0.25, K=2, L=1)
    assert sim.paper_critical_path(inst, 0) == pytest.approx(1.5)
    assert sim.critical_path(inst, 0) == pytest.approx(1.25) == sim.optimal(inst)


#
# Lemma B.3 and Theorem 3.1
#

def test_alg_within_3_minus_1_over_L_of_opt(lib, record_property):
    rng = random.Random(5)
    worst, checked = {}, {}
    for _ in range(3000):
        inst = random_instance(rng, max_reads=8, max_dec=8)
        out = schedule(lib, inst)
        alg = sim.simulate(inst, out["io"], out["dec"]).makespan
        lb = sim.lower_bound(inst)
        opt = sim.optimal(inst, alg)
        assert lb <= opt * (1 + 1e-9) + 1e-12 and opt <= alg, inst.describe()
        assert alg >= lb * (1 - 1e-9)
        ratio = alg / opt if opt > 0 else 1.0
        assert ratio <= 3 - 1 / inst.L + 1e-9, (ratio, inst.describe())
        if ratio > worst.get(inst.L, (0.0, ""))[0]:
            worst[inst.L] = (ratio, inst.describe())
        checked[inst.L] = checked.get(inst.L, 0) + 1
    print("\nALG/OPT against the exact optimum (Theorem 3.1: at most 3 - 1/L):")
    for L, (ratio, desc) in sorted(worst.items()):
        print(f"  L={L}: {checked[L]} instances, worst {ratio:.4f} (bound {3 - 1 / L:.4f})  {desc}")
        record_property(f"worst_alg_over_opt_L{L}", round(ratio, 6))


def test_alg_at_least_lemma_b3_on_larger_instances(lib):
    rng = random.Random(6)
    for _ in range(600):
        inst = random_instance(rng, n=(1, 16), K=(1, 6), L=(1, 8))
        out = schedule(lib, inst)
        assert sim.simulate(inst, out["io"], out["dec"]).makespan >= sim.lower_bound(inst) * (1 - 1e-9), inst.describe()


@pytest.mark.parametrize("n", [2, 4, 6])
def test_bound_is_nearly_tight_for_one_worker(lib, n):
    # n E tasks of a cheap expert each form a compute-dominant block, so the C task of the costly
    # expert comes last: ALG = (2n + 1)c while OPT = (n + 1)c (+ the cheap expert), -> 2 = 3 - 1/L
    inst = sim.Instance(tuple([(0, E, 0.001)] * n + [(1, C, float(n))]), u=0.5, rho=0.01, c=1.0, K=1, L=1)
    out = schedule(lib, inst)
    assert out["blocks"] == [[j] for j in range(n + 1)]
    alg = sim.simulate(inst, out["io"], out["dec"]).makespan
    opt = sim.optimal(inst, alg)
    assert alg == pytest.approx(2 * n + 1) and opt == pytest.approx(n + 1.001)
    assert alg / opt < 2


@pytest.mark.parametrize("inst, ratio", [
    # the worst cases a hill climb over small instances found (ALG/OPT about 1.73 whatever L): a
    # compute-dominant Type-I block closes before a costly expert's cached tensor, or idle-neutral
    # cheap tasks go to the front of the block, ahead of the costly base
    (sim.Instance(((3, E, 0.041), (3, E, 0.041), (3, E, 0.041), (2, C, 3.783)), 0.843, 0.141, 0.628, 2, 1), 1.7336614),
    (sim.Instance(((0, E, 5.701), (1, M, 0.032), (1, M, 0.032), (1, C, 0.032)), 2.25, 0.268, 1.794, 1, 2), 1.7096895),
    (sim.Instance(((1, C, 6.377), (0, M, 0.01), (0, E, 0.01), (1, E, 6.377)), 2.079, 1.0, 1.282, 1, 3), 1.7355304),
])
def test_hill_climbed_worst_cases(lib, inst, ratio):
    out = schedule(lib, inst)
    alg = sim.simulate(inst, out["io"], out["dec"]).makespan
    assert alg / sim.optimal(inst, alg) == pytest.approx(ratio, rel=1e-6)
    assert ratio <= 3 - 1 / inst.L
