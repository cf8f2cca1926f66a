"""The expert cache of ggml-zipmoe, driven directly (as the graph's fetch and merge ops drive it).

A synthetic ZipMoE GGUF with known experts; slots are numpy arrays. Checks what the runtime
relies on: slots hold bit-exact experts, hits and LRU eviction, a pass never evicts what it
needs, passes split the distinct experts in ascending order and the merge picks each row from
its own pass, several threads fill the same slots as one, and a failure forgets the slots it
was filling.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from zipmoe_py import _lib
from zipmoe_py import format as zformat

from test_format import make_moe_gguf

KINDS = ("gate", "up", "down")


class Cache:
    def __init__(self, path, n_slots):
        lib = self.lib = _lib.lib()
        err = ctypes.create_string_buffer(512)
        self.file = lib.ggml_zipmoe_file_open(str(path).encode(), 0, err, len(err))
        assert self.file, err.value
        self.shapes = {}
        for i in range(lib.ggml_zipmoe_file_n_tensors(self.file)):
            ne = (ctypes.c_int64 * 3)()
            lib.ggml_zipmoe_file_tensor_shape(self.file, i, ne)
            self.shapes[lib.ggml_zipmoe_file_tensor_name(self.file, i).decode()] = list(ne)
        params = _lib.CacheParams()
        params.file, params.n_slots = self.file, n_slots
        self.slots = []
        for k, kind in enumerate(KINDS):
            ne0, ne1, _ = self.shapes[f"blk.0.ffn_{kind}_exps.weight"]
            slots = np.zeros((n_slots, ne1 * ne0), np.uint16)
            self.slots.append(slots)
            params.slot_data[k] = slots.ctypes.data
            params.slot_stride[k] = slots.strides[0]
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

    def stats(self):
        return _lib.cache_stats(self.handle)

    def close(self):
        self.lib.ggml_zipmoe_cache_free(self.handle)
        self.lib.ggml_zipmoe_file_close(self.file)


@pytest.fixture
def setup(tmp_path):
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(67, 45, 6))
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=3)
    with zformat.ZipMoEFile(path) as zf:
        experts = {(t, e): zf.read_expert(t, e) for t in zf.tensors for e in range(zf.shape(t)[2])}
    caches = []

    def make(n_slots):
        caches.append(Cache(path, n_slots))
        return caches[-1]

    yield make, experts
    for c in caches:
        c.close()


def assert_resident(cache, experts, layer, ids, slot_ids):
    for e, s in zip(np.asarray(ids).reshape(-1), np.asarray(slot_ids).reshape(-1)):
        for k, kind in enumerate(KINDS):
            assert np.array_equal(cache.slots[k][s], experts[f"blk.{layer}.ffn_{kind}_exps.weight", int(e)])


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


def test_out_of_range_ids_and_unserved_layers_are_errors(setup):
    make, _ = setup
    cache = make(2)
    status, _ = cache.fetch(0, [[6]])
    assert status == _lib.ERR_ARG and b"outside 0..5" in cache.lib.ggml_zipmoe_cache_error(cache.handle)
    status, _ = cache.fetch(7, [[0]])
    assert status == _lib.ERR_ARG


def test_a_failed_fill_is_named_and_its_slot_forgotten(tmp_path):
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(67, 45, 6))
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=3)
    with zformat.ZipMoEFile(path) as zf:
        ref = zf.chunks("blk.0.ffn_up_exps.weight", 1)[2]
    data = bytearray(path.read_bytes())
    data[ref.offset] ^= 0x01
    path.write_bytes(bytes(data))
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
