"""SMoE's CPU-load balancer (Algorithm 2, its section 5.4), behind zipmoe.cpu_compute: of the experts a
device lacks, which are copied to it and which the CPU computes where they are held.

ggml_zipmoe_balance_cpu_load against a transcription of the paper's pseudocode, on hand-made cases and
random ones; its arguments checked. (The path through the graph, bit-exact where the device is a CPU:
tests/test_rpc.py.)
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from zipmoe_py import _lib


def balance(batch, t_load, t_cpu, max_cpu=1 << 30):
    """(on_cpu flags as a list, the count returned)"""
    batch = np.ascontiguousarray(batch, dtype=np.int32)
    work = np.zeros(max(1, len(batch)), dtype=np.int32)
    on_cpu = np.full(max(1, len(batch)), 7, dtype=np.uint8)
    n = _lib.lib().ggml_zipmoe_balance_cpu_load(batch.ctypes.data, len(batch), t_load, t_cpu, max_cpu,
                                                work.ctypes.data, on_cpu.ctypes.data)
    return [int(v) for v in on_cpu[:len(batch)]], n


def algorithm_2(batch, t_load, t_cpu, max_cpu=1 << 30):
    """The paper's Algorithm 2, line by line: U_batch sorted by B_i descending, two pointers, C_load and
    C_cpu; the CPU's slots bound L_cpu (past it, the rest are loaded)."""
    order = sorted(range(len(batch)), key=lambda i: (-batch[i], i))
    c_cpu = c_load = 0.0
    l, r = 0, len(order) - 1
    l_cpu = []
    while l <= r:
        if c_load <= c_cpu or len(l_cpu) >= max_cpu:
            c_load += t_load
            l += 1
        else:
            c_cpu += batch[order[r]] * t_cpu
            l_cpu.append(order[r])
            r -= 1
    return [int(i in l_cpu) for i in range(len(batch))]


def test_a_decode_steps_misses_go_to_the_cpu_while_it_is_cheaper():
    # one token each: a load costs 10, the CPU 2 a token: one load, then the CPU takes the rest until its
    # time passes the load's
    assert balance([1, 1, 1, 1], 10.0, 2.0) == ([0, 1, 1, 1], 3)
    assert algorithm_2([1, 1, 1, 1], 10.0, 2.0) == [0, 1, 1, 1]
    # the CPU slower than a copy: it takes one, once the load's time passes its zero
    assert balance([1, 1, 1, 1], 1.0, 5.0)[1] == 1


def test_the_largest_batches_are_loaded_and_the_smallest_computed_on_the_cpu():
    on_cpu, n = balance([30, 1, 8, 2], 4.0, 1.0)
    assert on_cpu == algorithm_2([30, 1, 8, 2], 4.0, 1.0)
    assert on_cpu[0] == 0 and on_cpu[1] == 1  # 30 tokens load; 1 token computes where it is held


def test_no_measured_cost_and_no_slots_give_nothing_to_the_cpu():
    assert balance([1, 1, 1], 0.0, 1.0) == ([0, 0, 0], 0)  # a load costing nothing is always taken
    assert balance([1, 1, 1], 10.0, 1.0, max_cpu=0) == ([0, 0, 0], 0)
    assert balance([1, 1, 1, 1, 1], 100.0, 1.0, max_cpu=2)[1] == 2
    assert balance([], 1.0, 1.0) == ([], 0)


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_match_the_papers_algorithm(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    batch = [int(b) for b in rng.integers(0, 64, size=n)]
    t_load, t_cpu = float(rng.uniform(0, 20)), float(rng.uniform(0, 5))
    max_cpu = int(rng.integers(0, n + 2))
    on_cpu, count = balance(batch, t_load, t_cpu, max_cpu)
    assert on_cpu == algorithm_2(batch, t_load, t_cpu, max_cpu)
    assert count == sum(on_cpu) <= max_cpu


@pytest.mark.parametrize("batch, t_load, t_cpu", [([1, -1], 1.0, 1.0), ([1], -1.0, 1.0), ([1], 1.0, math.nan),
                                                   ([1], math.inf, 1.0)])
def test_bad_arguments_are_refused(batch, t_load, t_cpu):
    assert balance(batch, t_load, t_cpu)[1] == -1
