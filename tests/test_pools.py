"""The hierarchical cache pools of the expert cache (ZipMoE paper §3.2-3.4), driven directly.

Pools F (full, in slots), C (SM + E-chunks), S (SM-chunks) and E (E-chunks) with per-layer
capacities: each expert goes after use to the first active pool whose threshold exceeds its
runtime rank; a later fetch of an expert kept in C reads nothing, in S reads only its E-chunks, in
E only its SM-chunks. What matters most: the slots are bit-exact under every pool mix, every
recovery path (the exponents are decoded into the slot and recovered in place) and thread count,
and a failed fill leaves no store entry behind.
"""
from __future__ import annotations

import ctypes
import itertools
import time

import numpy as np
import pytest

from zipmoe_py import _lib, codec
from zipmoe_py.cli import _time_account
from zipmoe_py import format as zformat

from test_cache import Cache, assert_resident, corrupt_chunk, kernel_moves_pages, linux_at_least
from test_format import make_moe_gguf


def repacked_model(tmp, shape, layers=2):
    """a ZipMoE file of make_moe_gguf's layers in this shape, and its experts' BF16 values by (tensor, expert)"""
    src = make_moe_gguf(tmp / "src.gguf", shape=shape, layers=layers)
    path = tmp / "z.gguf"
    zformat.repack(src, path, shards=3)
    with zformat.ZipMoEFile(path) as zf:
        experts = {(t, e): zf.read_expert(t, e) for t in zf.tensors for e in range(zf.shape(t)[2])}
    return path, experts


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, experts = repacked_model(tmp_path_factory.mktemp("pools"), (67, 45, 8))
    with zformat.ZipMoEFile(path) as zf:
        sizes = {}
        for (layer, tensors), e in itertools.product(zf.moe_layers().items(), range(8)):
            refs = [zf.chunks(zf.tensors[t], e) for t in tensors]
            sizes[layer, e] = (sum(r[0].size for r in refs), sum(c.size for r in refs for c in r[1:]))
    return path, experts, sizes


@pytest.fixture
def make(model):
    caches = []

    def make_cache(n_slots, pools, rank_delta=0, n_decoders=0):
        caches.append(Cache(model[0], n_slots, n_decoders, _lib.EVICT_RANK, rank_delta, pools))
        return caches[-1]

    yield make_cache
    for c in caches:
        c.close()


def read_by(cache, layer, ids, experts=None):
    """(bytes read, stats delta) of one fetch, all its passes; with experts, each pass's slots are
    checked to hold them exactly"""
    before = cache.stats()
    for status, slots in cache.fetch_passes(layer, ids):
        assert status == 0, cache.lib.ggml_zipmoe_cache_error(cache.handle)
        if experts is not None:
            assert_resident(cache, experts, layer, ids, slots, this_pass_only=True)
    after = cache.stats()
    return after["bytes_read"] - before["bytes_read"], {k: after[k] - before[k] for k in
                                                        ("expert_hits", "c_hits", "s_hits", "e_hits", "expert_misses")}


def test_experts_are_dispatched_by_rank_and_a_pool_hit_reads_only_what_it_lacks(make, model):
    _, experts, sizes = model
    # one expert per layer in each pool; 2 served layers -> F takes 2 of the 6 slots
    cache = make(6, (1, 1, 1, 1))
    pools = cache.stats()["pools"]
    assert pools["F"]["experts"] == 2 and [pools[p]["experts"] for p in "CSE"] == [2, 2, 2]
    sm, e = sizes[0, 0]
    assert pools["S"]["entry_bytes"] >= sm and pools["C"]["entry_bytes"] >= sm + e
    # one ubatch: equal counts, ranks by id -> 0 to F, 1 to C, 2 to S, 3 to E, 4 nowhere; five
    # experts in passes of the four working slots
    assert cache.lib.ggml_zipmoe_cache_n_passes(cache.handle, 0, 5) == 2
    read, d = read_by(cache, 0, [[0, 1, 2, 3, 4]], experts)
    assert d["expert_misses"] == 5 and read == sum(sum(sizes[0, x]) for x in range(5))
    # push layer 0's working slots out with layer 1's experts (F keeps 0 of layer 0)
    read_by(cache, 1, [[0, 1, 2, 3, 4]])
    read_by(cache, 1, [[5, 6, 7]])
    read, d = read_by(cache, 0, [[0]])
    assert (read, d["expert_hits"]) == (0, 1)
    read, d = read_by(cache, 0, [[1]])
    assert (read, d["c_hits"]) == (0, 1)             # C: decompression only
    read, d = read_by(cache, 0, [[2]])
    assert (read, d["s_hits"]) == (sizes[0, 2][1], 1)  # S: the E-chunks only
    read, d = read_by(cache, 0, [[3]])
    assert (read, d["e_hits"]) == (sizes[0, 3][0], 1)  # E: the SM-chunks only
    read, d = read_by(cache, 1, [[4]])
    assert d["expert_misses"] == 1                      # rank 4 was kept nowhere
    for layer, ids in ((0, [[0, 1, 2, 3]]), (1, [[4]])):
        status, slots = cache.fetch(layer, ids)
        assert_resident(cache, experts, layer, ids, slots)


def test_an_expert_moves_between_pools_as_its_rank_changes(make, model):
    _, experts, sizes = model
    cache = make(4, (0, 1, 0, 1))  # C and E, one each per layer; every slot a working slot
    read_by(cache, 0, [[0, 1]])  # 0 -> C, 1 -> E
    read_by(cache, 1, [[0, 1, 2, 3]])  # evict layer 0's slots
    read, d = read_by(cache, 0, [[1]])  # 1 now ranks first: E -> C
    assert d["e_hits"] == 1 and read == sizes[0, 1][0]
    read_by(cache, 1, [[0, 1, 2, 3]])
    read, d = read_by(cache, 0, [[1]])
    assert d["c_hits"] == 1 and read == 0
    read_by(cache, 1, [[0, 1, 2, 3]])
    # 1's promotion pushed 0 out of C: 0 kept its E-chunks in 1's old E entry, so only its SM-chunks are read
    read, d = read_by(cache, 0, [[0]], experts)
    assert d["e_hits"] == 1 and read == sizes[0, 0][0]
    read_by(cache, 1, [[0, 1, 2, 3]])
    read, d = read_by(cache, 0, [[0]])
    assert d["e_hits"] == 1 and read == sizes[0, 0][0]


def test_stores_that_hold_every_expert_stop_reading_under_even_routing(make, model):
    """Even routing moves ranks by noise, so experts cross the C / E line all the time. With room for
    every expert in C or E, none is ever pushed out of both: a promotion from E trades E parts with
    C's victim, and an expert whose rank falls stays in its store until a fill needs the entry. Once
    every expert has been read, nothing is read whole again, and every fill is exact."""
    _, experts, _ = model
    rng = np.random.default_rng(11)
    cache = make(4, (0, 5, 0, 3))  # 5 + 3 = the 8 experts of each layer; every slot a working slot
    for step in range(240):
        if step == 80:
            warm = cache.stats()
        layer = step % 2
        ids = rng.choice(8, size=(1, 3), replace=False)
        status, slots = cache.fetch(layer, ids)
        assert status == 0, cache.lib.ggml_zipmoe_cache_error(cache.handle)
        assert_resident(cache, experts, layer, ids, slots)
    after = cache.stats()
    assert after["expert_misses"] == warm["expert_misses"], (warm, after)
    assert after["e_hits"] > warm["e_hits"] and after["c_hits"] > warm["c_hits"]


def set_pools(cache, pools, n_slots):
    status = cache.lib.ggml_zipmoe_cache_set_pools(cache.handle, (ctypes.c_int32 * 4)(*pools), n_slots, 0)
    assert status == 0, cache.lib.ggml_zipmoe_cache_error(cache.handle)


def test_a_re_plan_keeps_the_store_entries_that_still_fit(make, model):
    """A re-plan changes the pools; what the new stores can hold stays, so it is not read again: a store
    that shrinks keeps the entries the new pools send to it, one that grows keeps all of them."""
    _, experts, sizes = model
    cache = make(4, (0, 3, 0, 2))  # C 3 and E 2 per layer; every slot a working slot
    for layer in (0, 1):  # equal counts, ranks by id: 0, 1, 2 -> C; 3, 4 -> E
        read_by(cache, layer, [[0, 1, 2, 3, 4]])
    set_pools(cache, (0, 2, 0, 3), 4)  # C shrinks (ranks 0-1), E grows (ranks 2-4)
    pools = cache.stats()["pools"]
    assert [pools[p]["experts"] for p in "CE"] == [4, 6]
    for layer in (0, 1):  # the slots hold layer 1's experts: layer 0's come from the stores
        read, d = read_by(cache, layer, [[0, 1, 3, 4]], experts)
        assert (d["c_hits"], d["e_hits"], d["expert_misses"]) == (2, 2, 0), (layer, d)
        assert read == sizes[layer, 3][0] + sizes[layer, 4][0]  # the E hits' SM-chunks only
    read, d = read_by(cache, 0, [[2]], experts)  # rank 2 now goes to E: C's entry was not kept
    assert d["expert_misses"] == 1 and read == sum(sizes[0, 2])
    set_pools(cache, (0, 0, 0, 0), 4)  # one F pool: the stores are given up
    assert all(cache.stats()["pools"][p]["experts"] == 0 for p in "CSE")
    read, d = read_by(cache, 1, [[2, 5, 6, 7]], experts)  # in no slot, and the stores are gone
    assert d["expert_misses"] == 4 and read == sum(sum(sizes[1, x]) for x in (2, 5, 6, 7))


def set_pools_migrating(cache, pools, n_slots, n_threads):
    moved = ctypes.c_int32(-1)
    status = cache.lib.ggml_zipmoe_cache_set_pools_migrating(cache.handle, (ctypes.c_int32 * 4)(*pools), n_slots, 0,
                                                              n_threads, ctypes.byref(moved))
    assert status == 0, cache.lib.ggml_zipmoe_cache_error(cache.handle)
    return moved.value


# (pools after the re-plan, slots, layer 0's experts F takes, C's entries after it)
MIGRATIONS = [((2, 4, 0, 0), 2 * 2 + 3, [0, 1], 2 * 4), ((0, 0, 0, 0), 7, [0, 1, 2], 0)]


def in_store(pools, store):
    """pools packed as (F, C, S, E) with C's capacity in `store` ("C" or "S") instead"""
    return pools if store == "C" else (pools[0], 0, pools[1], pools[3])


@pytest.mark.parametrize("store", ["C", "S"])
@pytest.mark.parametrize("n_threads", [1, 3])
@pytest.mark.parametrize("pools, n_slots, moved, c_after", MIGRATIONS, ids=["F2C4", "one-F-pool"])
def test_a_re_plan_from_a_store_to_f_decodes_the_experts_from_it_instead_of_reading_them(make, model, n_threads,
                                                                                        pools, n_slots, moved,
                                                                                        c_after, store):
    """Every expert in C (or S); a re-plan to F 2 / C 4 (S 4), or to one F pool of 7 slots (3 a layer):
    layer 0's experts F now takes (in the store, in no slot) are decoded from their entries into slots,
    bit-exact, with nothing read from C and only the E-chunks from S (a fifth of a miss's bytes); then
    used, they are hits. The same change by set_pools drops those entries, and the experts are read
    again whole."""
    _, experts, sizes = model
    hits = {"C": "c_hits", "S": "s_hits"}[store]
    for migrate in (True, False):
        cache = make(7, in_store((0, 8, 0, 0), store))  # every expert in the store; every slot a working slot
        assert cache.lib.ggml_zipmoe_cache_set_n_slots(cache.handle, 4) == 0  # 4 in use until the re-plan
        for layer in (0, 1):
            read_by(cache, layer, [[0, 1, 2, 3], [4, 5, 6, 7]])
            read_by(cache, layer, [[1, 0, 2]])  # ranks: 0, 1, 2, then the rest by id
        # the slots hold layer 1's experts 0, 1, 2 and one more: layer 0's F experts are in the store only
        before = cache.stats()
        if migrate:
            assert set_pools_migrating(cache, in_store(pools, store), n_slots, n_threads) == len(moved)
        else:
            set_pools(cache, in_store(pools, store), n_slots)
        after = cache.stats()
        assert after["migrate_experts"] - before["migrate_experts"] == (len(moved) if migrate else 0)
        assert (after["migrate_ns"] > before["migrate_ns"]) == migrate
        assert (f"moved from C/S to F: {len(moved)} experts in " in _time_account(after, None)) == migrate  # --stats
        # no fetch counted, no activation counted (the ranks stay); read: S's E-chunks, the disk's bytes
        for name in ("fetch_calls", "expert_hits", "expert_misses", "c_hits", "s_hits", "decode_ns"):
            assert after[name] == before[name], name
        e_chunks = sum(sizes[0, e][1] for e in moved) if migrate and store == "S" else 0
        assert after["bytes_read"] - before["bytes_read"] == e_chunks
        assert after["pools"][store]["experts"] == c_after  # the store shrank to its new size
        read, d = read_by(cache, 0, [moved], experts)
        if migrate:
            assert (d["expert_hits"], d["expert_misses"], read) == (len(moved), 0, 0), d
        else:
            assert d["expert_misses"] == len(moved) and read == sum(sum(sizes[0, e]) for e in moved), d
        if c_after:  # the rest of the store is as a re-plan leaves it: ranks 2-5 of each layer, exact
            read, d = read_by(cache, 0, [[2, 3, 4, 5]], experts)
            assert d[hits] == 4 and read == (0 if store == "C" else sum(sizes[0, e][1] for e in (2, 3, 4, 5))), d
        cache.lib.ggml_zipmoe_cache_reset_stats(cache.handle)
        assert cache.stats()["migrate_experts"] == cache.stats()["migrate_ns"] == 0


def test_a_re_plan_decodes_into_f_only_the_experts_c_holds_that_were_used_again(make, model):
    """Every expert in C; a change to F 4 / C 2: of layer 0's four experts F now takes, C holds three
    used twice and one used once (expert 3; a prompt selects most experts once). The three are decoded
    into slots; expert 3 is dropped and read on its next use. Decoding every expert a prompt had used
    took most of a change's time on the full Qwen1.5-MoE geometry at 20 GiB (589 experts, for the few a
    layer its decode steps chose)."""
    _, experts, sizes = model
    cache = make(4 * 2 + 3, (0, 8, 0, 0))
    assert cache.lib.ggml_zipmoe_cache_set_n_slots(cache.handle, 4) == 0
    for layer in (0, 1):
        read_by(cache, layer, [[0, 1, 2, 3], [4, 5, 6, 7]])
        read_by(cache, layer, [[1, 0, 2]])  # ranks: 0, 1, 2 (used twice), then the rest by id (once)
    # layer 1's experts 0, 1, 2 are in slots: only layer 0's are decoded from C
    assert set_pools_migrating(cache, (4, 2, 0, 0), 4 * 2 + 3, 2) == 3
    read, d = read_by(cache, 0, [[0, 1, 2]], experts)
    assert (d["expert_hits"], d["expert_misses"], read) == (3, 0, 0), d
    read, d = read_by(cache, 0, [[3]], experts)  # not moved, not kept: read again, exact
    assert d["expert_misses"] == 1 and read == sum(sizes[0, 3]), d
    assert cache.stats()["pools"]["C"]["experts"] == 2 * 2


@pytest.fixture(scope="module")
def page_model(tmp_path_factory):
    """experts of 2 MiB tensors plus a row: a slot's tensor holds about one 2 MiB block, and a block may
    straddle two slots"""
    return repacked_model(tmp_path_factory.mktemp("pages"), (1024, 1025, 8))


def every_expert_in_c(path, movable, store="C"):
    """a cache of 7 slots (4 in use) in pages of their own, C (or S) holding every expert of both layers, ranked"""
    cache = Cache(path, 7, 0, _lib.EVICT_RANK, 0, in_store((0, 8, 0, 0), store), fresh_pages=True,
                  movable_pages=movable)
    assert cache.lib.ggml_zipmoe_cache_set_n_slots(cache.handle, 4) == 0
    for layer in (0, 1):
        read_by(cache, layer, [[0, 1, 2, 3], [4, 5, 6, 7]])
        read_by(cache, layer, [[1, 0, 2]])
    return cache


@pytest.mark.parametrize("store", ["C", "S"])
@pytest.mark.parametrize("movable", [True, False], ids=["movable", "malloc"])
@pytest.mark.parametrize("pools, n_slots, moved, c_after", MIGRATIONS, ids=["F2C4", "one-F-pool"])
def test_a_migration_moves_the_pages_the_stores_give_up_into_the_slots_it_fills(page_model, pools, n_slots, moved,
                                                                                 c_after, movable, store):
    """Slots in a mapping of their own (slot_pages_movable): the change's new slots (4 to 6, empty) take
    the pages of the C (or S) entries it gives up, every whole 2 MiB block within them (as huge pages,
    which a move of less would split), instead of faulting new ones; the experts decoded over them, and
    the store's kept entries, stay bit-exact. Slots the cache may not move pages into (malloc'd memory,
    say) move none."""
    path, experts = page_model
    cache = every_expert_in_c(path, movable, store)
    try:
        before = cache.stats()
        assert set_pools_migrating(cache, in_store(pools, store), n_slots, 2) == len(moved)
        block = 2 << 20
        whole = 0  # the whole blocks within slots 4 to 6, kind by kind
        for slots in cache.slots:
            base, stride = slots.ctypes.data, slots.strides[0]
            lo, hi = -(-(base + 4 * stride) // block) * block, (base + 7 * stride) // block * block
            whole += max(0, hi - lo)
        assert whole >= 6 * block  # three slots of 2 MiB and a row hold two or three blocks a kind
        expected = whole if movable and kernel_moves_pages() else 0
        assert cache.stats()["moved_page_bytes"] - before["moved_page_bytes"] == expected
        if expected:
            assert f"{expected / 1e6:.1f} MB of the stores' pages moved into their slots" in _time_account(cache.stats(), None)
        read, d = read_by(cache, 0, [moved], experts)  # decoded over the moved pages: exact
        assert (d["expert_hits"], d["expert_misses"], read) == (len(moved), 0, 0), d
        if c_after:  # the store's entries kept past the pages it gave up: exact
            read, d = read_by(cache, 0, [[2, 3, 4, 5]], experts)
            assert d[store.lower() + "_hits"] == 4, d
        read, d = read_by(cache, 1, [[5, 6, 7]], experts)  # filled later, into the slots left: exact
        assert read > 0 or d["c_hits"] > 0, d
    finally:
        cache.close()


@pytest.mark.skipif(not kernel_moves_pages(), reason="page moves need Linux 5.7+ (MREMAP_DONTUNMAP)")
@pytest.mark.parametrize("allowed, taken_down", [(0, True), (1, False), (2, True)],
                         ids=["first-refused-block-taken-down", "second-refused", "third-refused-block-taken-down"])
def test_a_page_move_the_kernel_refuses_leaves_the_moves_before_it_and_the_slots_exact(page_model, allowed,
                                                                                      taken_down):
    """A move the kernel refuses (its map count at the limit): the moves before it stand, the pages left
    go back to the system as without moves, and the slots they would have filled are written in place.
    Where the kernel took the slots' block down before refusing, the cache maps it again, empty: no
    fetch fails, every expert stays bit-exact."""
    path, experts = page_model
    pools, n_slots, moved, _ = MIGRATIONS[1]  # C gives up all its entries: more blocks than are refused
    cache = every_expert_in_c(path, True)
    try:
        before = cache.stats()
        cache.lib.ggml_zipmoe_set_page_move_refusal(allowed, taken_down)
        try:
            assert set_pools_migrating(cache, pools, n_slots, 2) == len(moved)
        finally:
            cache.lib.ggml_zipmoe_set_page_move_refusal(-1, False)
        assert cache.stats()["moved_page_bytes"] - before["moved_page_bytes"] == allowed * (2 << 20)
        read, d = read_by(cache, 0, [moved], experts)  # decoded into slots over moved, mapped-again and own pages
        assert (d["expert_hits"], d["expert_misses"], read) == (len(moved), 0, 0), d
        for layer in (0, 1):  # the rest read again into every slot: exact
            read_by(cache, layer, [[3, 4, 5, 6, 7]], experts)
            read_by(cache, layer, [[6, 7, 0, 1, 2]], experts)
    finally:
        cache.close()


def resident_during(call):
    """(resident bytes before, at the peak during, after) call(): the process's high-water mark reset first"""
    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from what is resident now (Linux 4.0+)
    before = status("VmRSS")
    call()
    return before, status("VmHWM"), status("VmRSS")


@pytest.mark.skipif(not linux_at_least((4, 0)), reason="resetting the peak resident set needs Linux 4.0+")
@pytest.mark.parametrize("store", ["C", "S"])
@pytest.mark.parametrize("movable", [True, False], ids=["movable", "malloc"])
def test_a_migration_stays_within_the_memory_of_the_pools_before_or_after_it(tmp_path, movable, store):
    """Memory through a change of pools stays within what the pools take before it or after it, but for
    one layer's experts decoded into F before their C entries go. C's last shrink copies the entries it
    keeps from its tail into the holes the migrated experts left (given back, so faulted in again), and
    gives the tail's pages back as it goes: holding the whole tail until the copies were done went 2.4
    GB over at 20 GiB with four DeepSeek-V2-Lite sequences, and the memory cap ended the server."""
    n_layer, n_expert, f = 4, 16, 4
    path, experts = repacked_model(tmp_path, (1024, 1025, n_expert), layers=n_layer)  # 2 MiB tensors
    n_slots = f * n_layer + 4
    cache = Cache(path, n_slots, 0, _lib.EVICT_RANK, 0, in_store((0, n_expert, 0, 0), store), fresh_pages=True,
                  movable_pages=movable)
    try:
        assert cache.lib.ggml_zipmoe_cache_set_n_slots(cache.handle, 4) == 0
        for layer in range(n_layer):  # the store's entries in this order: each layer's hot experts first
            for first in range(0, n_expert, 4):
                read_by(cache, layer, [list(range(first, first + 4))])
            read_by(cache, layer, [list(range(f))])
        stats = cache.stats()
        entry, slot = stats["pools"][store]["entry_bytes"], stats["pools"]["F"]["entry_bytes"]
        # F takes each layer's hot experts: holes at the front of each layer's entries, the last layer's
        # cold ones in the tail that the copies fill them from
        after_pools = in_store((f, n_expert - f, 0, 0), store)
        before, peak, after = resident_during(lambda: set_pools_migrating(cache, after_pools, n_slots, 2))
        assert peak <= max(before, after) + f * slot + 2 * entry, (before, peak, after, f * slot, entry)
        for layer in range(n_layer):  # and exact
            read_by(cache, layer, [list(range(f)), list(range(f, 2 * f))], experts)
    finally:
        cache.close()


def populated(cache, deadline_s=60.0):
    """waits for the stores' populator (MADV_POPULATE_WRITE on a helper thread) to stop faulting pages in"""
    seen, quiet = -1, 0
    deadline = time.monotonic() + deadline_s
    while quiet < 3 and time.monotonic() < deadline:
        now = cache.stats()["populate_bytes"]
        quiet = quiet + 1 if now == seen else 0
        seen = now
        time.sleep(0.1)


@pytest.mark.skipif(not linux_at_least((4, 0)), reason="resetting the peak resident set needs Linux 4.0+")
def test_a_change_from_f_to_c_gives_the_slots_up_before_c_grows(tmp_path):
    """A change that gives F's slots up for more C entries gives the slots' pages back before C grows: its
    new entries are faulted in at once. Four DeepSeek-V2-Lite sequences at 20 GiB changing from F 20 / C 27
    to more C (F 14 / C 36, as other runs proposed, adds 2.7 GB of C for 2.5 GB of slots) gave the slots back
    only after the change, and the memory cap ended the server."""
    n_layer, n_expert, f_before, c_before, f_after, c_after = 4, 16, 8, 4, 2, 14
    path, experts = repacked_model(tmp_path, (1024, 1025, n_expert), layers=n_layer)  # 2 MiB tensors
    cache = Cache(path, f_before * n_layer + 4, 0, _lib.EVICT_RANK, 0, (f_before, c_before, 0, 0), fresh_pages=True,
                  movable_pages=True)
    try:
        for layer in range(n_layer):
            for first in range(0, f_before + c_before, 4):
                read_by(cache, layer, [list(range(first, first + 4))])
        populated(cache)
        stats = cache.stats()
        slot, entry = stats["pools"]["F"]["entry_bytes"], stats["pools"]["C"]["entry_bytes"]
        assert stats["n_slots"] == f_before * n_layer + 4, stats

        def change():
            set_pools_migrating(cache, (f_after, c_after, 0, 0), f_after * n_layer + 4, 2)
            populated(cache)
        before, peak, after = resident_during(change)
        grown, given_up = (c_after - c_before) * n_layer * entry, (f_before - f_after) * n_layer * slot
        assert grown > 0.9 * given_up  # the change's two halves are alike: their order decides the peak
        assert peak <= before + max(0, grown - given_up) + slot + 2 * entry, (before, peak, after, grown, given_up)
        for layer in range(n_layer):  # and exact
            read_by(cache, layer, [list(range(4)), list(range(4, 8))], experts)
    finally:
        cache.close()


def test_slots_stay_bit_exact_across_re_plans(make, model):
    """Entries kept, moved within their store or dropped by one re-plan after another: every fill is exact."""
    _, experts, _ = model
    rng = np.random.default_rng(5)
    cache = make(7, (1, 1, 1, 1))
    popularity = rng.permutation(1.0 / np.arange(1, 9) ** 0.8)
    popularity /= popularity.sum()
    kept_hits = 0
    for step in range(120):
        if step % 15 == 14:
            pools = POOL_MIXES[int(rng.integers(len(POOL_MIXES)))]
            before = cache.stats()
            set_pools(cache, pools, 2 * pools[0] + 3)
        layer = step % 2
        ids = rng.choice(8, size=(1, 3), replace=False, p=popularity)
        status, slots = cache.fetch(layer, ids)
        assert status == 0, cache.lib.ggml_zipmoe_cache_error(cache.handle)
        assert_resident(cache, experts, layer, ids, slots)
        if step % 15 == 14:
            after = cache.stats()
            kept_hits += sum(after[f"{p}_hits"] - before[f"{p}_hits"] for p in "cse")
    assert kept_hits > 0  # some fill right after a re-plan came from an entry it kept


POOL_MIXES = [(0, 2, 0, 0), (0, 0, 2, 0), (0, 0, 0, 2), (1, 1, 0, 0), (1, 0, 1, 1), (1, 1, 1, 1), (2, 1, 2, 1)]


@pytest.mark.parametrize("pools", POOL_MIXES, ids=lambda p: "".join(f"{n}{c}" for n, c in zip("FCSE", p) if c))
@pytest.mark.parametrize("nth", [1, 3])
def test_slots_stay_bit_exact_under_every_pool_mix(make, model, pools, nth):
    _, experts, _ = model
    rng = np.random.default_rng(sum(pools) * 7 + nth)
    cache = make(2 * pools[0] + 3, pools, rank_delta=int(rng.integers(0, 2)))  # one pass per ubatch
    popularity = rng.permutation(1.0 / np.arange(1, 9) ** 0.8)  # Zipf-like: ranks settle, every rank recurs
    popularity /= popularity.sum()
    for step in range(80):
        layer = step % 2  # the other layer's experts push this one's out of the working slots
        ids = rng.choice(8, size=(1, 3), replace=False, p=popularity)
        status, slots = cache.fetch(layer, ids, nth=nth)
        assert status == 0, cache.lib.ggml_zipmoe_cache_error(cache.handle)
        assert_resident(cache, experts, layer, ids, slots)
    s = cache.stats()
    for p, n in zip("CSE", pools[1:]):
        assert (s[f"{p.lower()}_hits"] > 0) == (n > 0), (p, s)


@pytest.mark.parametrize("impl", codec.supported_recover_paths())
def test_in_place_recovery_is_exact_on_every_recovery_path(make, model, impl):
    lib = _lib.lib()
    assert lib.ggml_zipmoe_set_recover_impl(impl.encode()) == 0
    try:
        _, experts, _ = model
        cache = make(5, (1, 1, 1, 1))
        for ids in ([[0, 1, 2, 3]], [[4, 5, 6, 7]], [[1, 2, 3]], [[0, 7]]):
            computed = np.zeros(np.size(ids), int)
            for status, slots in cache.fetch_passes(0, ids, nth=2):
                assert status == 0
                assert_resident(cache, experts, 0, ids, slots, this_pass_only=True)
                computed += slots.reshape(-1) >= 0
            assert (computed == 1).all()  # each selection in exactly one pass
    finally:
        lib.ggml_zipmoe_set_recover_impl(None)


def test_a_wide_ubatch_runs_in_passes_of_the_working_slots_and_keeps_every_f_expert(make, model):
    _, experts, _ = model
    # F 2 per layer (4 slots), 2 working slots; C holds the rest of each layer
    cache = make(6, (2, 6, 0, 0))
    for layer in (0, 1):
        read_by(cache, layer, [[0, 1]], experts)
    assert cache.lib.ggml_zipmoe_cache_n_passes(cache.handle, 0, 8) == 4
    assert cache.lib.ggml_zipmoe_cache_n_passes(cache.handle, 0, 2) == 1
    # a prompt-like ubatch of layer 0 selecting all 8 experts: 4 passes, every row computed once
    ids = np.array([[0, 1], [2, 3], [4, 5], [6, 7], [7, 2]])
    computed, n_passes = np.zeros(ids.size, int), 0
    for status, slots in cache.fetch_passes(0, ids):
        assert status == 0
        assert_resident(cache, experts, 0, ids, slots, this_pass_only=True)
        computed += slots.reshape(-1) >= 0
        n_passes += 1
    assert n_passes == 4 and (computed == 1).all()
    # no expert of F was evicted for it: both layers' F experts are still hits, nothing read
    for layer in (0, 1):
        read, d = read_by(cache, layer, [[0, 1]], experts)
        assert (read, d["expert_hits"]) == (0, 2)


def test_pool_configurations_that_cannot_work_are_refused(model):
    path = model[0]
    with pytest.raises(AssertionError, match="at least one must be a working slot"):
        Cache(path, 4, 0, _lib.EVICT_RANK, 0, (2, 1, 0, 0))
    with pytest.raises(AssertionError, match="the eviction policy must be rank"):
        Cache(path, 4, 0, _lib.EVICT_LRU, 0, (1, 1, 0, 0))
    with pytest.raises(AssertionError, match="negative"):
        Cache(path, 4, 0, _lib.EVICT_RANK, 0, (1, -1, 0, 0))


def test_a_failed_fill_keeps_no_store_entry(tmp_path):
    path = corrupt_chunk(tmp_path, "blk.0.ffn_down_exps.weight", 1, 3, byte=5, flip=0x10)
    cache = Cache(path, 3, 0, _lib.EVICT_RANK, 0, (0, 2, 0, 0))  # expert 1 would go to C
    try:
        status, _ = cache.fetch(0, [[0, 1]], nth=2)
        assert status == _lib.ERR_CHECKSUM
        assert b"expert 1, E-chunk (shard 2)" in cache.lib.ggml_zipmoe_cache_error(cache.handle)
        before = cache.stats()
        status, _ = cache.fetch(0, [[1]])
        assert status == _lib.ERR_CHECKSUM  # read again, not decoded from a half-kept entry
        assert cache.stats()["c_hits"] == before["c_hits"]
    finally:
        cache.close()


def test_an_e_chunk_that_fails_during_a_migration_from_s_stops_it_and_names_the_chunk(tmp_path):
    """A migration from S reads its experts' E-chunks from disk, so a fill can fail there (a chunk
    corrupted after S took the expert's SM-chunks): the change still stands (OK, the new pools), the
    error names the chunk, the experts moved before it stay exact, and the one that failed is read
    again on its next use, failing again rather than serving a half-filled slot."""
    path, experts = repacked_model(tmp_path, (67, 45, 8))
    cache = Cache(path, 7, 0, _lib.EVICT_RANK, 0, (0, 0, 8, 0))
    try:
        assert cache.lib.ggml_zipmoe_cache_set_n_slots(cache.handle, 4) == 0
        for layer in (0, 1):
            read_by(cache, layer, [[0, 1, 2, 3], [4, 5, 6, 7]])
            read_by(cache, layer, [[1, 0, 2]])  # ranks: 0, 1, 2 (used twice), then the rest by id
        with zformat.ZipMoEFile(path) as zf:
            ref = zf.chunks("blk.0.ffn_up_exps.weight", 1)[2]  # expert 1's second E-chunk
        with open(path, "r+b") as f:
            f.seek(ref.offset + 3)
            byte = f.read(1)[0]
            f.seek(ref.offset + 3)
            f.write(bytes([byte ^ 0x10]))
        moved = set_pools_migrating(cache, (0, 0, 0, 0), 7, 2)  # one F pool: 0, 1, 2 of layer 0 bound for F
        assert moved < 3
        assert b"layer 0, tensor blk.0.ffn_up_exps.weight, expert 1, E-chunk" in \
            cache.lib.ggml_zipmoe_cache_error(cache.handle)
        assert cache.stats()["pools"]["S"]["experts"] == 0  # the new pools, whatever the failure left
        status, _ = cache.fetch(0, [[1]])
        assert status == _lib.ERR_CHECKSUM
        read, d = read_by(cache, 0, [[0, 2]], experts)  # moved or read again: exact either way
        assert d["expert_misses"] + d["expert_hits"] == 2, d
    finally:
        cache.close()
