"""The expert cache's reads ahead, driven directly: a prefetch of predicted experts, and a layer's
next pass read while this one decodes and computes. What was read ahead is taken like a store hit,
nothing is read twice, a misprediction is read and wasted, and a corrupt chunk read ahead is named
by the fetch that needs it. Uses test_cache's synthetic file, Cache and checks.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from zipmoe_py import _lib

from test_cache import Cache, assert_resident, corrupt_chunk, setup  # noqa: F401 (setup: a fixture)


def test_a_prefetch_is_read_ahead_and_the_fetch_takes_it_instead_of_reading(setup):
    make, experts = setup
    cache = make(3, prefetch=2)
    assert cache.prefetch(1, [[2, 4]]) == _lib.OK
    cache.wait_prefetched(cache.stored_bytes(1, [2, 4]))
    read = cache.stats()["bytes_read"]
    status, slots = cache.fetch(1, [[4, 2]])
    assert status == 0
    assert_resident(cache, experts, 1, [[4, 2]], slots)
    s = cache.stats()
    assert s["bytes_read"] == read and s["expert_misses"] == 2  # a miss of the cache, served by the prefetch
    assert s["prefetch_hits"] == 2 and s["prefetch_bytes_used"] == s["prefetch_bytes_read"] == read
    r = s["prefetch_recall"]
    assert (r["predicted"], r["actual"], r["correct"]) == (2, 2, 2) and list(r["layers"]) == [1]

    # a misprediction is read and wasted; the fetch reads what it needs itself
    assert cache.prefetch(0, [[0, 1]]) == _lib.OK
    cache.wait_prefetched(read + cache.stored_bytes(0, [0, 1]))
    status, slots = cache.fetch(0, [[5]])
    assert status == 0
    assert_resident(cache, experts, 0, [[5]], slots)
    s = cache.stats()
    assert s["prefetch_hits"] == 2 and s["prefetch_bytes_used"] == read
    assert s["bytes_read"] == s["prefetch_bytes_read"] + cache.stored_bytes(0, [5])
    assert s["prefetch_recall"]["layers"][0] == {"predicted": 2, "actual": 1, "correct": 0, "recall": 0.0}

    # experts already in a slot are not read again
    before = cache.stats()["prefetch_bytes_read"]
    assert cache.prefetch(0, [[5]]) == _lib.OK
    time.sleep(0.05)
    assert cache.stats()["prefetch_bytes_read"] == before

    # bad predictions are refused, and so is a cache made without prefetch
    assert cache.prefetch(0, [[6]]) == _lib.ERR_ARG and cache.prefetch(2, [[0]]) == _lib.ERR_ARG
    assert make(3).prefetch(0, [[0]]) == _lib.ERR_ARG


@pytest.mark.parametrize("pools", [(0, 0, 0, 0), (1, 1, 1, 1)])
def test_prefetches_interleaved_with_fetches_never_change_what_the_slots_hold(setup, pools):
    """Predictions right, wrong and partial, fetched at once or after the reads, with and without
    pools (whose S and E stores leave a prefetch half an expert to read), from 1 and 2 threads."""
    make, experts = setup
    kwargs = {"eviction": _lib.EVICT_RANK, "pools": pools} if any(pools) else {}
    cache = make(5 if any(pools) else 3, prefetch=2, **kwargs)
    status, slots = cache.fetch(1, [[0, 1]])  # before any prefetch: nothing to take
    assert status == 0
    assert_resident(cache, experts, 1, [[0, 1]], slots)
    rng = np.random.default_rng(3)
    for step in range(120):
        layer = step % 2
        actual = rng.choice(6, size=2, replace=False)
        predicted = actual if rng.random() < 0.5 else rng.choice(6, size=2, replace=False)
        assert cache.prefetch(layer, [predicted]) == _lib.OK
        if rng.random() < 0.5:
            time.sleep(0.002)
        status, slots = cache.fetch(layer, [actual], nth=1 + step % 2)
        assert status == 0
        assert_resident(cache, experts, layer, [actual], slots)
    s = cache.stats()
    assert s["prefetch_hits"] > 0 and 0 < s["prefetch_bytes_used"] <= s["prefetch_bytes_read"]


def test_the_next_pass_is_read_ahead_while_this_one_computes(setup):
    """A ubatch whose experts take several passes: at each pass the cache knows the next one's experts
    (all ids are given) and reads what it lacks into a bank after this pass's own reads; the next
    pass takes it as a prefetch, and nothing is read twice."""
    make, experts = setup
    cache = make(2, lookahead=2)  # a pass of 2 experts: 6 chosen take 3 passes
    ids = [[0, 1, 2], [3, 4, 5]]
    read_so_far = 0
    for p in range(cache.lib.ggml_zipmoe_cache_n_passes(cache.handle, 1, 6)):
        status, slots = cache.fetch(1, ids, pass_=p)
        assert status == 0
        assert_resident(cache, experts, 1, ids, slots, this_pass_only=True)
        read_so_far += cache.stored_bytes(1, [2 * p, 2 * p + 1])
        if p < 2:  # the next pass's two experts, read in the background
            cache.wait_prefetched(cache.stored_bytes(1, [2 * p + 2, 2 * p + 3]) + cache.stats()["prefetch_bytes_used"])
    s = cache.stats()
    assert s["prefetch_hits"] == 4 and s["expert_misses"] == 6
    assert s["bytes_read"] == read_so_far == cache.stored_bytes(1, range(6))
    assert s["prefetch_bytes_used"] == s["prefetch_bytes_read"] == cache.stored_bytes(1, range(2, 6))
    assert s["prefetch_recall"]["predicted"] == 0  # no prediction was made: nothing to score
    assert cache.prefetch(1, [[0]]) == _lib.ERR_ARG  # and none can be without prefetch_experts


@pytest.mark.parametrize("pools", [(0, 0, 0, 0), (1, 1, 1, 1)])
def test_passes_read_ahead_in_any_timing_never_change_what_the_slots_hold(setup, pools):
    """Multi-pass fetches with the next pass read ahead, taken at once or after the reads, mixed with
    one-pass fetches and predictions, with and without pools, from 1 and 2 threads."""
    make, experts = setup
    kwargs = {"eviction": _lib.EVICT_RANK, "pools": pools} if any(pools) else {}
    cache = make(4 if any(pools) else 2, prefetch=1, lookahead=2, **kwargs)
    rng = np.random.default_rng(5)
    for step in range(80):
        layer = step % 2
        ids = [rng.choice(6, size=2, replace=False) for _ in range(int(rng.integers(1, 4)))]
        if rng.random() < 0.3:
            assert cache.prefetch(layer, [rng.choice(6, size=1)]) == _lib.OK
        for status, slots in cache.fetch_passes(layer, ids, nth=1 + step % 2):
            assert status == 0
            assert_resident(cache, experts, layer, ids, slots, this_pass_only=True)
            if rng.random() < 0.5:
                time.sleep(0.002)
    s = cache.stats()
    assert s["prefetch_hits"] > 0 and 0 < s["prefetch_bytes_used"] <= s["prefetch_bytes_read"]


def test_a_corrupt_chunk_read_ahead_is_named_by_the_fetch(tmp_path):
    path = corrupt_chunk(tmp_path, "blk.0.ffn_up_exps.weight", 1, 2)
    cache = Cache(path, 2, prefetch=2)
    try:
        assert cache.prefetch(0, [[1, 0]]) == _lib.OK
        time.sleep(0.1)
        status, _ = cache.fetch(0, [[1]])
        assert status == _lib.ERR_CHECKSUM
        assert (b"checksum mismatch in layer 0, tensor blk.0.ffn_up_exps.weight, expert 1, E-chunk (shard 1)"
                in cache.lib.ggml_zipmoe_cache_error(cache.handle))
        status, _ = cache.fetch(0, [[0]])
        assert status == 0
    finally:
        cache.close()
