"""C's leftovers (cache/zipmoe-leftovers.c): a change of pools to one F pool keeps the C entries it does
not decode into F. An expert used again is decoded from its entry (a C hit, nothing read), bit-exact;
the entries go, weakest first, as the slots need their memory, their pages moving into the slots. On
the full Qwen1.5-MoE geometry the entries this change dropped were read again: 2.1 GB in 64 tokens at
20 GiB. Only where the slots take pages (slot_pages_movable, a kernel that moves pages)."""
from __future__ import annotations

import pytest

from zipmoe_py import _lib

from test_cache import Cache, kernel_moves_pages, linux_at_least
from test_pools import page_model, read_by, resident_during, set_pools_migrating  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not kernel_moves_pages(), reason="page moves need Linux 5.7+ (MREMAP_DONTUNMAP)")

N_EXPERT = 8


def rows_by_count(extra=0):
    """one ubatch of 4-expert rows in which expert e is chosen e + 1 + extra times: each expert used
    once (no migrant), its tokens telling them apart (expert 0 the weakest)"""
    left, rows = {e: e + 1 + extra for e in range(N_EXPERT)}, []
    while any(left.values()):
        row = sorted(left, key=lambda e: (-left[e], e))[:4]
        for e in row:
            left[e] -= 1
        rows.append(row)
    return rows


def every_expert_in_c(path, capacity, movable=True):
    """4 slots in use and C holding both layers' experts, layer 1's stronger than layer 0's"""
    cache = Cache(path, capacity, 0, _lib.EVICT_RANK, 0, (0, N_EXPERT, 0, 0), fresh_pages=True, movable_pages=movable)
    assert cache.lib.ggml_zipmoe_cache_set_n_slots(cache.handle, 4) == 0
    read_by(cache, 0, rows_by_count())
    read_by(cache, 1, rows_by_count(N_EXPERT))  # each above layer 0's strongest
    return cache


def strongest_first():
    """(layer, expert), the strongest first"""
    return [(1, e) for e in reversed(range(N_EXPERT))] + [(0, e) for e in reversed(range(N_EXPERT))]


def test_a_change_to_one_f_pool_decodes_cs_other_experts_on_use_reading_nothing(page_model):
    path, experts = page_model
    n_slots = 2 * N_EXPERT + 4  # room for every entry beside the slots in use
    cache = every_expert_in_c(path, n_slots)
    try:
        assert set_pools_migrating(cache, (0, 0, 0, 0), n_slots, 2) == 0  # each used once: no migrant
        assert cache.stats()["pools"]["C"]["experts"] == 0  # the pools are one F pool
        for layer, e in strongest_first():
            read, d = read_by(cache, layer, [[e]], experts)
            assert read == 0 and d["expert_misses"] == 0, (layer, e, d)
        total = cache.stats()
        assert total["c_hits"] > 0
        for layer, e in strongest_first():  # now in F: hits
            read, d = read_by(cache, layer, [[e]], experts)
            assert d["expert_hits"] == 1 and read == 0, (layer, e, d)
    finally:
        cache.close()


@pytest.mark.parametrize("n_slots", [8, 12, 14])
def test_the_weakest_entries_go_first_as_the_slots_need_their_memory(page_model, n_slots):
    """Fewer slots than every entry takes: the weakest entries go (at the change, and as slots fill);
    read strongest first, the experts still decoded from C are the strongest ones, the rest read, and
    every slot exact"""
    path, experts = page_model
    cache = every_expert_in_c(path, n_slots)
    try:
        set_pools_migrating(cache, (0, 0, 0, 0), n_slots, 2)
        held = []
        for layer, e in strongest_first():
            read, d = read_by(cache, layer, [[e]], experts)
            held.append(d["expert_misses"] == 0)  # in C, or (layer 1's last four) still in a slot
            assert d["expert_misses"] == 0 or read > 0, (layer, e, d)
        kept = sum(held)
        assert held == [True] * kept + [False] * (len(held) - kept), list(zip(strongest_first(), held))
        assert 0 < kept < len(held), held
        stats = cache.stats()
        assert stats["moved_page_bytes"] > 0
    finally:
        cache.close()


def test_the_entry_a_fill_decodes_from_is_not_the_one_given_back_for_its_slot(page_model):
    """16 slots: every entry stays at the change. Read weakest first, each expert is the weakest entry
    left when its slot needs pages: the entry given back must be another, never the one the fill
    decodes from (it read zeros: "corrupt compressed data")"""
    path, experts = page_model
    cache = every_expert_in_c(path, 16)
    try:
        set_pools_migrating(cache, (0, 0, 0, 0), 16, 2)
        c_hits = 0
        for layer, e in reversed(strongest_first()):
            read, d = read_by(cache, layer, [[e]], experts)
            c_hits += d["c_hits"]
        assert c_hits > 0
    finally:
        cache.close()


@pytest.mark.skipif(not linux_at_least((4, 0)), reason="resetting the peak resident set needs Linux 4.0+")
def test_the_slots_filling_past_the_leftovers_stay_within_the_memory_before_the_change(page_model):
    """12 slots (4 in use) and every entry: more than 12 slots' memory. Through the change and a fill of
    every slot, the entries given back make room: the peak stays at what the pools held before it (the
    slots' fills would add 8 slots' memory, 50 MB, had the entries stayed)"""
    path, experts = page_model
    cache = every_expert_in_c(path, 12)
    try:
        entry = cache.stats()["pools"]["C"]["entry_bytes"]

        def change_and_fill():
            set_pools_migrating(cache, (0, 0, 0, 0), 12, 2)
            for layer, e in strongest_first():
                read_by(cache, layer, [[e]])
        before, peak, after = resident_during(change_and_fill)
        assert peak <= before + 2 * entry, (before, peak, after, entry)
    finally:
        cache.close()


@pytest.mark.parametrize("then", ["re-plan", "fewer slots"])
def test_a_change_while_leftovers_drain_keeps_the_slots_exact(page_model, then):
    """a re-plan to F 2 / C 4 takes what C still holds by its own claims; fewer slots (another context)
    drop the leftovers. Either way every expert read after is exact."""
    path, experts = page_model
    n_slots = 2 * N_EXPERT + 4
    cache = every_expert_in_c(path, n_slots)
    try:
        set_pools_migrating(cache, (0, 0, 0, 0), n_slots, 2)
        read_by(cache, 1, [[7], [6]], experts)
        if then == "re-plan":
            set_pools_migrating(cache, (2, 4, 0, 0), 2 * 2 + 4, 2)
            assert cache.stats()["pools"]["C"]["experts"] == 2 * 4
        else:
            assert cache.lib.ggml_zipmoe_cache_set_n_slots(cache.handle, 6) == 0
        for layer in (0, 1):
            read_by(cache, layer, [list(range(0, 4)), list(range(4, 8))], experts)
    finally:
        cache.close()


def test_slots_that_take_no_pages_drop_c_at_the_change(page_model):
    """malloc'd slots: an entry given back could not become a slot's pages, so C goes as before"""
    path, experts = page_model
    n_slots = 2 * N_EXPERT + 4
    cache = every_expert_in_c(path, n_slots, movable=False)
    try:
        set_pools_migrating(cache, (0, 0, 0, 0), n_slots, 2)
        read, d = read_by(cache, 0, [[7]], experts)
        assert d["c_hits"] == 0 and read > 0, d
    finally:
        cache.close()
