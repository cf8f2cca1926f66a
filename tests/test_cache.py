"""The expert cache of ggml-zipmoe, driven directly (as the graph's fetch and merge ops drive it).

A synthetic ZipMoE GGUF with known experts; slots are numpy arrays. Checks what the runtime
relies on: slots hold bit-exact experts, hits and LRU eviction, a pass never evicts what it
needs, passes split the distinct experts in ascending order and the merge picks each row from
its own pass, several threads fill the same slots as one, a fetch split into begin (reads start
on the cache's I/O thread) and end (decoding) with work in between, a begin left without its end
(a graph abort), the decoder cap, the activation counts for profiling, and a failure forgets the
slots it was filling.
"""
from __future__ import annotations

import ctypes
import mmap
import platform
import re
import sys
import threading
import time

import numpy as np
import pytest

from zipmoe_py import _lib
from zipmoe_py import format as zformat

from test_format import make_moe_gguf


def linux_at_least(version: tuple[int, int]) -> bool:
    """this is Linux at least major.minor"""
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return sys.platform.startswith("linux") and found is not None and tuple(map(int, found.groups())) >= version


def kernel_moves_pages() -> bool:
    """Linux 5.7+ moves private anonymous pages with MREMAP_DONTUNMAP (the cache probes it itself)"""
    return linux_at_least((5, 7))


class Cache:
    def __init__(self, path, n_slots, n_decoders=0, eviction=_lib.EVICT_LRU, rank_delta=0, pools=(0, 0, 0, 0),
                 rate_read=0.0, prefetch=0, lookahead=0, fresh_pages=False, movable_pages=False):
        """fresh_pages: slots in pages of their own, never touched (their first write faults); movable_pages
        (with fresh_pages): the cache may move store pages into them (slot_pages_movable)"""
        lib = self.lib = _lib.lib()
        self.maps = []
        self.zf = zformat.ZipMoEFile(path)  # must outlive the cache
        layers = self.zf.moe_layers()
        # the params hold the layer table C reads: kept as long as the cache
        params = self.params = _lib.CacheParams()
        params.file, params.n_slots, params.n_decoders = self.zf._handle, n_slots, n_decoders
        params.eviction, params.rank_delta = eviction, rank_delta
        params.pool_capacity[:] = pools
        params.rate_read = rate_read
        params.prefetch_experts = prefetch
        params.lookahead_experts = lookahead
        params.slot_pages_movable = int(movable_pages and fresh_pages)
        params.set_layers(layers)
        self.slots = []
        for k, tensor in enumerate(layers[min(layers)]):
            ne0, ne1, _ = self.zf.shape(self.zf.tensors[tensor])
            slots = np.zeros((n_slots, ne1 * ne0), np.uint16)
            if fresh_pages:
                self.maps.append(mmap.mmap(-1, slots.nbytes))
                slots = np.frombuffer(self.maps[-1], np.uint16).reshape(slots.shape)
            self.slots.append(slots)
            params.slot_data[k] = slots.ctypes.data
            params.slot_stride[k] = slots.strides[0]
        err = ctypes.create_string_buffer(512)
        self.handle = lib.ggml_zipmoe_cache_new(ctypes.byref(params), err, len(err))
        assert self.handle, err.value

    def fetch(self, layer, ids, pass_=0, nth=1):
        ids = np.ascontiguousarray(ids, np.int32)
        out = np.full(ids.shape, -1, np.int32)
        statuses = [None] * nth

        def work(ith):
            statuses[ith] = self.lib.ggml_zipmoe_cache_fetch(self.handle, layer, pass_, ids.ctypes.data,
                                                             ids.shape[1], ids.shape[0], ids.shape[1],
                                                             out.ctypes.data, ith, nth)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(nth)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(statuses)) == 1
        return statuses[0], out

    def fetch_passes(self, layer, ids, nth=1):
        """Every pass of a fetch, in order, as a graph runs them: yields (status, slot ids) of a pass
        before the next one runs (it may reuse the slots); a selection another pass computes has a
        negative slot id in this one."""
        n_passes = self.lib.ggml_zipmoe_cache_n_passes(self.handle, layer, np.size(ids))
        for p in range(n_passes):
            yield self.fetch(layer, ids, pass_=p, nth=nth)

    def begin(self, layer, ids, pass_=0):
        ids = np.ascontiguousarray(ids, np.int32)
        out = np.full(ids.shape, -1, np.int32)
        status = self.lib.ggml_zipmoe_cache_fetch_begin(self.handle, layer, pass_, ids.ctypes.data, ids.shape[1],
                                                        ids.shape[0], ids.shape[1], out.ctypes.data)
        return status, out

    def end(self, nth=1):
        """fetch_end from nth threads, the calling thread being thread 0 (as in a ggml graph)"""
        statuses = [None] * nth

        def work(ith):
            statuses[ith] = self.lib.ggml_zipmoe_cache_fetch_end(self.handle, ith, nth)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(1, nth)]
        for th in threads:
            th.start()
        work(0)
        for th in threads:
            th.join()
        assert len(set(statuses)) == 1
        return statuses[0]

    def prefetch(self, layer, ids):
        ids = np.ascontiguousarray(ids, np.int32)
        return self.lib.ggml_zipmoe_cache_prefetch(self.handle, layer, ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                                                   ids.shape[1], ids.shape[0], ids.shape[1])

    def wait_prefetched(self, n_bytes, timeout=10.0):
        """Until the I/O thread has read n_bytes for prefetches (it reads them in the background)."""
        deadline = time.monotonic() + timeout
        while self.stats()["prefetch_bytes_read"] < n_bytes:
            assert time.monotonic() < deadline, f"prefetch read {self.stats()['prefetch_bytes_read']} of {n_bytes} bytes"
            time.sleep(0.001)

    def stored_bytes(self, layer, experts):
        """Stored bytes (SM-chunk and E-chunks, all three kinds) of the given experts of a layer."""
        tensors = [self.zf.tensors[t] for t in self.zf.moe_layers()[layer]]
        return sum(c.size for t in tensors for e in experts for c in self.zf.chunks(t, e))

    def stats(self):
        return _lib.cache_stats(self.handle)

    def close(self):
        self.lib.ggml_zipmoe_cache_free(self.handle)
        self.zf.close()


@pytest.fixture
def setup(tmp_path):
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(67, 45, 6))
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=3)
    with zformat.ZipMoEFile(path) as zf:
        experts = {(t, e): zf.read_expert(t, e) for t in zf.tensors for e in range(zf.shape(t)[2])}
    caches = []

    def make(n_slots, n_decoders=0, eviction=_lib.EVICT_LRU, rank_delta=0, rate_read=0.0, prefetch=0, pools=(0, 0, 0, 0),
             lookahead=0, fresh_pages=False):
        caches.append(Cache(path, n_slots, n_decoders, eviction, rank_delta, pools, rate_read=rate_read,
                            prefetch=prefetch, lookahead=lookahead, fresh_pages=fresh_pages))
        return caches[-1]

    yield make, experts
    for c in caches:
        c.close()


def assert_resident(cache, experts, layer, ids, slot_ids, this_pass_only=False):
    """The slots hold the selections' experts bit-exactly; this_pass_only: one pass of several,
    whose other selections (negative slot ids) are not checked."""
    tensors = [cache.zf.tensors[t] for t in cache.zf.moe_layers()[layer]]
    for e, s in zip(np.asarray(ids).reshape(-1), np.asarray(slot_ids).reshape(-1)):
        if this_pass_only and s < 0:
            continue
        for k, tensor in enumerate(tensors):
            assert np.array_equal(cache.slots[k][s], experts[tensor, int(e)])


def test_fetch_fills_slots_bit_exactly_and_counts_hits(setup):
    make, experts = setup
    cache = make(4)
    n_expert = cache.lib.ggml_zipmoe_cache_n_expert(cache.handle, 0)
    assert n_expert == 6 and cache.lib.ggml_zipmoe_cache_has_layer(cache.handle, 1)
    ids = [[0, 5]]
    status, slots = cache.fetch(0, ids)
    assert status == 0 and len(set(slots.reshape(-1))) == 2
    assert_resident(cache, experts, 0, ids, slots)
    status, again = cache.fetch(0, ids)
    assert np.array_equal(again, slots)
    s = cache.stats()
    assert (s["expert_misses"], s["expert_hits"], s["fetch_calls"]) == (2, 2, 2)
    # the same expert ids in another layer are other experts
    status, other = cache.fetch(1, ids)
    assert_resident(cache, experts, 1, ids, other)


def test_lru_evicts_the_least_recent_and_never_what_the_pass_needs(setup):
    make, experts = setup
    cache = make(3)
    cache.fetch(0, [[0, 1, 2]])
    cache.fetch(0, [[0]])                   # 0 is now the most recent
    status, slots = cache.fetch(0, [[3, 0]])  # evicts 1 (least recent), keeps 0
    assert status == 0
    assert_resident(cache, experts, 0, [[3, 0]], slots)
    before = cache.stats()["expert_misses"]
    cache.fetch(0, [[2]])
    assert cache.stats()["expert_misses"] == before  # 2 survived
    cache.fetch(0, [[1]])
    assert cache.stats()["expert_misses"] == before + 1  # 1 was the one evicted


def resident(cache, layer, expert) -> bool:
    """True if fetching the expert is a hit (the fetch itself then changes nothing but recency)."""
    misses = cache.stats()["expert_misses"]
    assert cache.fetch(layer, [[expert]])[0] == 0
    return cache.stats()["expert_misses"] == misses


def test_fifo_evicts_the_first_filled_even_if_just_used(setup):
    make, experts = setup
    cache = make(3, eviction=_lib.EVICT_FIFO)
    cache.fetch(0, [[0, 1, 2]])
    cache.fetch(0, [[0]])
    status, slots = cache.fetch(0, [[3]])
    assert status == 0
    assert_resident(cache, experts, 0, [[3]], slots)
    assert [resident(cache, 0, e) for e in (2, 1)] == [True, True]
    assert not resident(cache, 0, 0)


def test_lfu_evicts_the_least_often_chosen(setup):
    make, _ = setup
    cache = make(3, eviction=_lib.EVICT_LFU)
    for ids in ([[0, 1, 2]], [[0, 1]], [[0]], [[2]], [[2]]):  # chosen: 0 thrice, 1 twice, 2 thrice
        cache.fetch(0, ids)
    cache.fetch(0, [[3]])
    assert [resident(cache, 0, e) for e in (0, 2)] == [True, True]
    assert not resident(cache, 0, 1)


def test_rank_policy_evicts_experts_ranked_beyond_the_layers_share_first(setup):
    make, _ = setup
    cache = make(4, eviction=_lib.EVICT_RANK)  # 2 served layers: a share of 2 slots per layer
    for ids in ([[0, 1]], [[0, 1]], [[2]], [[3]]):  # ranks: 0, 1 (kept), 2, 3 (beyond the share)
        cache.fetch(0, ids)
    cache.fetch(0, [[4]])  # evicts 2 (beyond the share, then least often chosen, then least recent)
    assert [resident(cache, 0, e) for e in (0, 1, 3)] == [True, True, True]
    assert not resident(cache, 0, 2)
    # with a margin of 2 the same ranks all count as in the share: LFU then evicts the least often chosen
    wide = make(4, eviction=_lib.EVICT_RANK, rank_delta=2)
    for ids in ([[0, 1]], [[0, 1]], [[2]], [[3]], [[3]], [[4]]):
        wide.fetch(0, ids)
    assert [resident(wide, 0, e) for e in (0, 1, 3)] == [True, True, True]


def test_marking_never_evicts_a_marked_expert_while_an_unmarked_one_is_resident(setup):
    make, _ = setup
    for seed_round in range(3):
        cache = make(3, eviction=_lib.EVICT_MARKING)
        for _ in range(seed_round):  # other random choices
            cache.fetch(1, [[0, 1, 2]])
            cache.fetch(1, [[3, 4, 5]])
        cache.fetch(0, [[0, 1, 2]])  # all marked
        cache.fetch(0, [[3]])        # a new phase: 3 replaces one of 0, 1, 2 and is marked
        cache.fetch(0, [[4]])        # must replace an unmarked one of 0, 1, 2, never 3
        assert resident(cache, 0, 3)


def test_passes_split_distinct_experts_in_ascending_order_and_merge_takes_rows_from_their_pass(setup):
    make, experts = setup
    cache = make(2)
    ids = np.array([[5, 0], [2, 5], [3, 0]], np.int32)  # distinct: 0 2 3 5 -> passes {0,2}, {3,5}, {}
    # the graph is built before the ids are known: passes for min(6 selections, 6 experts) / 2 slots
    assert cache.lib.ggml_zipmoe_cache_n_passes(cache.handle, 0, ids.size) == 3
    rows = []
    for p in range(3):
        status, slots = cache.fetch(0, ids, pass_=p)
        assert status == 0
        mine = [(t, k) for t in range(3) for k in range(2) if [(0, 2), (3, 5), ()][p].count(ids[t, k])]
        for t, k in mine:
            assert_resident(cache, experts, 0, [[ids[t, k]]], [[slots[t, k]]])
        # the others are not computed by this pass (ggml's mul_mat_id skips a negative id)
        others = [slots[t, k] for t in range(3) for k in range(2) if (t, k) not in mine]
        assert others == [-1] * len(others)  # GGML_ZIPMOE_NO_SLOT
        # a stand-in for the pass's product: the slot's first value, row by row
        rows.append(np.array([[[cache.slots[0][s][0]] * 4 for s in row] for row in slots], np.float32))
    acc = None
    for p in range(3):
        out = np.empty_like(rows[0])
        cache.lib.ggml_zipmoe_cache_merge_pass(cache.handle, 0, p, ids.ctypes.data, 2, 3, 2,
                                               None if acc is None else acc.ctypes.data, rows[p].ctypes.data,
                                               out.ctypes.data, 16, 16, 32)
        acc = out
    merged = acc
    want = np.array([[[experts["blk.0.ffn_gate_exps.weight", int(e)][0]] * 4 for e in row] for row in ids], np.float32)
    assert np.array_equal(merged, want)


def test_the_cost_model_measures_reads_and_decodes_unless_given(setup):
    make, experts = setup
    cache = make(3, fresh_pages=True)  # three slots: every fetch below misses
    defaults = {name: _lib.default_rate(r) for name, r in (("read", _lib.RATE_READ), ("decode", _lib.RATE_DECODE),
                                                           ("compute", _lib.RATE_COMPUTE), ("touch", _lib.RATE_TOUCH))}
    assert cache.stats()["rates"] == defaults  # nothing measured yet
    assert set(cache.stats()["rate_origins"].values()) == {"default"}
    bf16 = 2 * 67 * 45 * 3  # one expert's three tensors, BF16 bytes
    before, faulted, clean = cache.stats(), 0, 0
    read, decode = defaults["read"], defaults["decode"]
    # fresh slots first (their pages are touched for the first time), then slots freed by eviction
    for i, ids in enumerate([[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4], [5, 0]]):
        assert cache.fetch(0, [ids])[0] == 0
        after = cache.stats()
        # the first measurement replaces the default, then a running average moved by a quarter of
        # each fetch's own rate: stored bytes over read time; BF16 bytes over decode + recovery time
        now = (after["bytes_read"] - before["bytes_read"]) * 1e9 / (after["io_ns"] - before["io_ns"])
        read = now if i == 0 else 0.75 * read + 0.25 * now
        if after["decode_faults"] > before["decode_faults"]:  # the kernel's page clearing, not decoding
            faulted += 1
        else:
            spent = after["decode_ns"] + after["recover_ns"] - before["decode_ns"] - before["recover_ns"]
            now = len(ids) * bf16 * 1e9 / spent
            decode = now if clean == 0 else 0.75 * decode + 0.25 * now
            clean += 1
        assert after["rates"] == {"read": read, "decode": decode, "compute": defaults["compute"],
                                  "touch": defaults["touch"]}, i  # first writes: never measured
        assert after["rate_origins"] == {"read": "measured", "decode": "measured" if clean else "default",
                                         "compute": "default", "touch": "default"}, i
        before = after
    assert faulted >= 1 and clean >= 2  # the fresh slots' pages faulted; fetches into them again measured
    # a rate given in the params stays as given
    given = make(3, rate_read=5e8)
    for ids in ([0, 1, 2], [3, 4, 5], [0, 1, 2]):
        assert given.fetch(0, [ids])[0] == 0
    rates = given.stats()["rates"]
    assert rates["read"] == 5e8 and rates["decode"] != defaults["decode"]
    assert given.stats()["rate_origins"]["read"] == "given"
    assert given.lib.ggml_zipmoe_cache_rate_origin(given.handle, 9) == given.lib.ggml_zipmoe_cache_rate_origin(None, 0) == -1


def test_several_threads_fill_the_same_slots_as_one(setup):
    make, experts = setup
    ids = [[0, 1, 2, 3, 4, 5]]
    one = make(6)
    _, slots_one = one.fetch(0, ids, nth=1)
    three = make(6)
    status, slots_three = three.fetch(0, ids, nth=3)
    assert status == 0 and np.array_equal(slots_one, slots_three)
    assert_resident(three, experts, 0, ids, slots_three)
    assert three.stats()["bytes_read"] == one.stats()["bytes_read"] > 0


def test_begin_starts_the_reads_and_end_decodes_them_into_the_slots(setup):
    make, experts = setup
    cache = make(6)
    ids = [[0, 1, 2], [3, 4, 5]]
    status, slots = cache.begin(0, ids)
    assert status == 0 and sorted(set(slots.reshape(-1))) == list(range(6))
    # the graph's other work runs here; the I/O thread reads meanwhile (more tasks than staging buffers)
    deadline = time.monotonic() + 5
    while cache.stats()["bytes_read"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert cache.stats()["bytes_read"] > 0  # read before end was called
    assert cache.end(nth=2) == 0
    assert_resident(cache, experts, 0, ids, slots)
    # a second fetch of the same experts is all hits and reads nothing
    read = cache.stats()["bytes_read"]
    status, again = cache.begin(0, ids)
    assert status == 0 and cache.end(nth=2) == 0 and np.array_equal(again, slots)
    assert cache.stats()["bytes_read"] == read and cache.stats()["expert_hits"] == 6


def test_a_begin_without_its_end_is_drained_by_the_next_begin(setup):
    make, experts = setup
    cache = make(2)
    status, _ = cache.begin(0, [[0, 1]])  # the graph stops here (an abort callback)
    assert status == 0
    status, slots = cache.begin(0, [[2]])
    assert status == 0 and cache.end() == 0
    assert_resident(cache, experts, 0, [[2]], slots)
    # the abandoned fetch's slots were never decoded: 0 and 1 must miss again, not hit garbage
    misses = cache.stats()["expert_misses"]
    status, slots = cache.fetch(0, [[0, 1]])
    assert status == 0 and cache.stats()["expert_misses"] == misses + 2
    assert_resident(cache, experts, 0, [[0, 1]], slots)


def test_a_decoder_cap_below_the_graph_threads_fills_the_same_slots(setup):
    make, experts = setup
    ids = [[0, 1, 2, 3, 4, 5]]
    capped = make(6, n_decoders=1)
    status, slots = capped.fetch(0, ids, nth=3)
    assert status == 0
    assert_resident(capped, experts, 0, ids, slots)


def test_activation_counts_give_each_experts_ubatches(setup):
    make, _ = setup
    cache = make(2)
    for ids in ([[0, 1], [1, 2]], [[1, 5]], [[5, 0]]):
        for p in range(cache.lib.ggml_zipmoe_cache_n_passes(cache.handle, 0, np.size(ids))):
            assert cache.fetch(0, ids, pass_=p)[0] == 0
    counts, n_ubatches = _lib.cache_activations(cache.handle, 0)
    assert n_ubatches == 3 and counts == [2, 2, 1, 0, 0, 2]  # passes > 0 are not counted again
    assert _lib.cache_activations(cache.handle, 1) == ([0] * 6, 0)
    assert _lib.cache_activations(cache.handle, 9) is None
    cache.lib.ggml_zipmoe_cache_reset_stats(cache.handle)
    assert _lib.cache_activations(cache.handle, 0) == ([0] * 6, 0)


def test_out_of_range_ids_unserved_layers_and_unknown_policies_are_errors(setup, tmp_path):
    make, _ = setup
    with pytest.raises(AssertionError, match="unknown eviction policy"):
        make(2, eviction=9)
    cache = make(2)
    status, _ = cache.fetch(0, [[6]])
    assert status == _lib.ERR_ARG and b"outside 0..5" in cache.lib.ggml_zipmoe_cache_error(cache.handle)
    status, _ = cache.fetch(7, [[0]])
    assert status == _lib.ERR_ARG



def _cache_new_error(path, layers, slot_memory=0) -> str:
    """ggml_zipmoe_cache_new's message for a layer table; asserts that it refused."""
    lib = _lib.lib()
    with zformat.ZipMoEFile(path) as zf:
        params = _lib.CacheParams()
        slots = np.zeros(1 << 16, np.uint16)
        params.file, params.n_slots, params.slot_memory = zf._handle, 2, slot_memory
        for k in range(3):
            params.slot_data[k], params.slot_stride[k] = slots.ctypes.data, 0
        params.set_layers(layers)
        err = ctypes.create_string_buffer(512)
        handle = lib.ggml_zipmoe_cache_new(ctypes.byref(params), err, len(err))
        if handle:
            lib.ggml_zipmoe_cache_free(handle)
        assert not handle
        return err.value.decode()


def test_the_layer_table_is_checked_and_its_faults_named(tmp_path):
    """The caller maps layers to tensors (the library knows no tensor names): an index outside the
    file and a layer with one kind missing are refused, naming the layer."""
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(67, 45, 6))
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=3)
    with zformat.ZipMoEFile(path) as zf:
        layers = zf.moe_layers()
    gate, up, down = layers[0]
    assert "layer 0's up tensor index 99 is not a repacked tensor" in _cache_new_error(path, {0: (gate, 99, down)})
    assert "layer 0 has 2 of the 3 routed-expert tensors" in _cache_new_error(path, {0: (gate, -1, down)})

def corrupt_chunk(tmp_path, tensor: str, expert: int, chunk: int, byte: int = 0, flip: int = 0x01):
    """A repacked test file (3 shards, 6 experts) with one bit of one stored chunk flipped."""
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(67, 45, 6))
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=3)
    with zformat.ZipMoEFile(path) as zf:
        ref = zf.chunks(tensor, expert)[chunk]
    data = bytearray(path.read_bytes())
    data[ref.offset + byte] ^= flip
    path.write_bytes(bytes(data))
    return path


def test_a_failed_fill_is_named_and_its_slot_forgotten(tmp_path):
    path = corrupt_chunk(tmp_path, "blk.0.ffn_up_exps.weight", 1, 2)
    cache = Cache(path, 2)
    try:
        for nth in (1, 2):
            status, _ = cache.fetch(0, [[1]], nth=nth)
            assert status == _lib.ERR_CHECKSUM  # not a hit on a half-filled slot the second time
            assert (b"checksum mismatch in layer 0, tensor blk.0.ffn_up_exps.weight, expert 1, E-chunk (shard 1)"
                    in cache.lib.ggml_zipmoe_cache_error(cache.handle))
        assert cache.stats()["expert_misses"] == 2 and cache.stats()["expert_hits"] == 0
        status, _ = cache.fetch(0, [[0, 2]])
        assert status == 0
    finally:
        cache.close()


def test_gpu_slots_are_refused_by_a_build_without_cuda_and_bad_memory_kinds_named(tmp_path):
    """slot_memory CUDA on host pointers: a build without CUDA says it needs one (a CUDA build says
    the pointers are not device memory); an unknown kind is named."""
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(67, 45, 6))
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=3)
    with zformat.ZipMoEFile(path) as zf:
        layers = zf.moe_layers()
    msg = _cache_new_error(path, layers, slot_memory=1)
    if _lib.lib().ggml_zipmoe_cuda_devices() == 0:
        assert "need a ZipMoE build with CUDA" in msg or "CUDA error" in msg
    else:
        assert "not CUDA device memory" in msg
    assert "slot_memory is not host, CUDA or a device's" in _cache_new_error(path, layers, slot_memory=7)


def test_score_eviction_keeps_the_experts_the_router_scores_highest(tmp_path):
    """SMoE's score-based eviction (ggml_zipmoe_cache_observe_scores): the victim is the resident expert
    with the lowest mean gate score over its layer's recent iterations, not the least recently used;
    the window forgets; scores for other policies, or of the wrong shape, change nothing or are refused."""
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(67, 45, 4))
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=3)

    def observe(cache, layer, scores):
        scores = np.ascontiguousarray(np.atleast_2d(scores), np.float32)
        return cache.lib.ggml_zipmoe_cache_observe_scores(cache.handle, layer, scores.ctypes.data, scores.shape[1],
                                                          scores.shape[0], scores.shape[1])

    def misses(cache):
        return _lib.cache_stats(cache.handle)["expert_misses"]

    for policy, kept in ((_lib.EVICT_SCORE, 1), (_lib.EVICT_LRU, 0)):
        cache = Cache(path, 2, eviction=policy)
        assert observe(cache, 0, [[0.1, 0.7, 0.1, 0.1]]) == _lib.OK  # expert 1 scores high, 0 low
        assert cache.fetch(0, [[1]])[0] == _lib.OK
        assert cache.fetch(0, [[0]])[0] == _lib.OK                   # LRU would now evict 1
        assert cache.fetch(0, [[2]])[0] == _lib.OK                   # a miss needs a victim
        before = misses(cache)
        assert cache.fetch(0, [[kept]])[0] == _lib.OK
        assert misses(cache) == before, f"policy {policy} evicted expert {kept}"
    # the window forgets: after 16 iterations of expert 1 far ahead, 16 with expert 0 a little ahead (a
    # sum over all 32 would still keep 1)
    cache = Cache(path, 2, eviction=_lib.EVICT_SCORE)
    for _ in range(16):
        observe(cache, 0, [[0.0, 1.0, 0.0, 0.0]])
    for _ in range(16):
        observe(cache, 0, [[0.4, 0.1, 0.25, 0.25], [0.2, 0.3, 0.25, 0.25]])  # two tokens: means 0.3 and 0.2
    cache.fetch(0, [[0]])
    cache.fetch(0, [[1]])
    cache.fetch(0, [[2]])
    before = misses(cache)
    cache.fetch(0, [[0]])
    assert misses(cache) == before
    assert observe(cache, 0, [[0.5, 0.5]]) == _lib.ERR_ARG              # not the layer's expert count
    assert observe(cache, 9, [[0.1, 0.7, 0.1, 0.1]]) == _lib.ERR_ARG    # not a served layer
    lru = Cache(path, 2, eviction=_lib.EVICT_LRU)
    assert observe(lru, 0, [[0.1, 0.7, 0.1, 0.1]]) == _lib.OK          # another policy: nothing to do
