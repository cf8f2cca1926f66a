"""Slots in a caller's device memory (GGML_ZIPMOE_SLOTS_DEVICE, the path every ggml backend but
ZipMoE's CUDA one takes: an rpc-server's, Vulkan, Metal): the library never touches the slot
addresses and hands every recovered shard to slot_write. Here the "device" is a numpy array behind
addresses that are not mapped at all, so a stray host access would crash the test; every fetch is
compared bit for bit with the same cache on host slots."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from zipmoe_py import _lib
from zipmoe_py import format as zformat

from test_cache import Cache
from test_format import make_moe_gguf

SLOTS_DEVICE = 2
WRITE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int32, ctypes.c_size_t,
                         ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)
SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
UNMAPPED = 0x7F00_0000_0000  # user address space no allocator hands out here


class DeviceCache:
    """The host cache's params with slot memory DEVICE: slot_data unmapped, writes into self.memory"""

    def __init__(self, host: Cache, fail_after: int | None = None, with_sync: bool = True):
        self.lib = _lib.lib()
        self.memory = [np.zeros(s.nbytes, np.uint8) for s in host.slots]
        self.stride = [s.strides[0] for s in host.slots]
        self.written = 0
        self.writes = 0
        self.syncs = 0
        self.fail_after = fail_after
        self.lock = threading.Lock()
        self.write_fn, self.sync_fn = WRITE(self._write), SYNC(self._sync)
        params = self.params = _lib.CacheParams.from_buffer_copy(host.params)
        for k in range(3):
            params.slot_data[k] = UNMAPPED + (k << 36)
        params.slot_memory = SLOTS_DEVICE
        params.slot_write = ctypes.cast(self.write_fn, ctypes.c_void_p)
        params.slot_sync = ctypes.cast(self.sync_fn, ctypes.c_void_p) if with_sync else None
        err = ctypes.create_string_buffer(1024)
        self.handle = self.lib.ggml_zipmoe_cache_new(ctypes.byref(params), err, len(err))
        assert self.handle, err.value

    def _write(self, user, kind, tensor, slot, offset, data, size, err, err_size):
        with self.lock:
            self.writes += 1
            if self.fail_after is not None and self.writes > self.fail_after:
                ctypes.memmove(err, b"the device went away\0", 21)
                return 1
            at = slot * self.stride[kind] + offset
            assert offset + size <= self.stride[kind] and at + size <= self.memory[kind].size
            ctypes.memmove(self.memory[kind].ctypes.data + at, data, size)
            self.written += size
        return 0

    def _sync(self, user, err, err_size):
        with self.lock:
            self.syncs += 1
        return 0

    def fetch(self, layer, ids, nth):
        ids = np.ascontiguousarray(ids, np.int32)
        out = np.full(ids.shape, -1, np.int32)
        statuses = [None] * nth

        def work(i):
            statuses[i] = self.lib.ggml_zipmoe_cache_fetch(self.handle, layer, 0, ids.ctypes.data, ids.shape[1],
                                                           ids.shape[0], ids.shape[1], out.ctypes.data, i, nth)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(nth)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(set(statuses)) == 1
        return statuses[0], out

    def same_as(self, host: Cache) -> bool:
        return all(np.array_equal(m, s.view(np.uint8).reshape(-1)) for m, s in zip(self.memory, host.slots))

    def close(self):
        self.lib.ggml_zipmoe_cache_free(self.handle)


def _run_both(host: Cache, dev: DeviceCache, steps: int, nth: int, n_expert: int, seed: int = 5):
    rng = np.random.default_rng(seed)
    layers = sorted(host.zf.moe_layers())
    for step in range(steps):
        layer = layers[step % len(layers)]
        ids = np.stack([rng.choice(n_expert, size=2, replace=False) for _ in range(1 + step % 3)]).astype(np.int32)
        status, want = host.fetch(layer, ids, nth=nth)
        assert status == _lib.OK
        got_status, got = dev.fetch(layer, ids, nth)
        assert got_status == _lib.OK, dev.lib.ggml_zipmoe_cache_error(dev.handle)
        assert np.array_equal(got, want)
        assert dev.same_as(host), f"the device's slots differ from the host's after fetch {step}"


@pytest.fixture
def slow_sm_reads():
    """SM-chunks read late: decoding threads meet shards whose exponents must be parked"""
    _lib.lib().ggml_zipmoe_set_sm_read_delay_us(3000)
    yield
    _lib.lib().ggml_zipmoe_set_sm_read_delay_us(0)


@pytest.mark.parametrize("codec,nth,pools,slow", [
    ("zstd", 1, (0, 0, 0, 0), False),
    ("huf", 3, (0, 0, 0, 0), True),
    ("ghuf", 2, (0, 0, 0, 0), True),
    ("huf", 2, (1, 1, 1, 1), True),
    ("fhuf", 4, (0, 0, 0, 0), False),
])
def test_device_slots_hold_what_host_slots_hold(tmp_path, request, codec, nth, pools, slow):
    """The same fetches (1-3 tokens, several threads, with and without the C/S/E stores) leave the
    device's slots byte for byte as the host's; with slow SM reads, shards decoded before their
    SM-chunk was read are parked in host memory and written once it is"""
    if slow:
        request.getfixturevalue("slow_sm_reads")
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(1031, 517, 8), layers=3)
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, codec=codec, shards=5)
    n_slots = 5 if any(pools) else 3
    host = Cache(path, n_slots, eviction=_lib.EVICT_RANK if any(pools) else _lib.EVICT_LRU, pools=pools)
    dev = DeviceCache(host)
    try:
        _run_both(host, dev, 24, nth, 8)
        stats = _lib.cache_stats(dev.handle)
        assert stats["h2d_bytes"] == dev.written > 0  # every recovered byte crossed once
        assert stats["expert_misses"] == host.stats()["expert_misses"]
        assert dev.syncs >= 24  # each decoding thread waits for its writes before the products run
    finally:
        dev.close()
        host.close()


def test_device_slots_of_a_quantized_file(tmp_path):
    """A quantized file's experts are stored raw: each share of their bytes is written as it is"""
    src = make_moe_gguf(tmp_path / "q.gguf", expert_dtype="q8_0", shape=(256, 45, 6), layers=2)
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=3)
    host = Cache(path, 4)
    dev = DeviceCache(host, with_sync=False)
    try:
        _run_both(host, dev, 12, 2, 6)
        assert dev.syncs == 0
    finally:
        dev.close()
        host.close()


def test_a_failed_slot_write_is_the_fetchs_error(tmp_path):
    """slot_write's failure fails the fetch with the file, tensor, expert and the caller's reason; the
    slots it was filling are forgotten, so the next fetch reads them again and the cache stays right"""
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(300, 200, 6), layers=2)
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=4)
    host = Cache(path, 4)
    dev = DeviceCache(host, fail_after=5)
    try:
        layer = min(host.zf.moe_layers())
        ids = np.array([[0, 1], [2, 3]], np.int32)
        status, _ = dev.fetch(layer, ids, 2)
        assert status != _lib.OK
        error = dev.lib.ggml_zipmoe_cache_error(dev.handle)
        error = error.decode() if isinstance(error, bytes) else error
        assert str(path) in error and "expert" in error and "blk." in error
        assert "writing its slot failed: the device went away" in error
        dev.fail_after = None
        status, want = host.fetch(layer, ids)
        got_status, got = dev.fetch(layer, ids, 2)
        assert got_status == status == _lib.OK and np.array_equal(got, want)
        assert dev.same_as(host)
    finally:
        dev.close()
        host.close()


def test_device_slot_memory_needs_slot_write(tmp_path):
    src = make_moe_gguf(tmp_path / "src.gguf")
    path = tmp_path / "z.gguf"
    zformat.repack(src, path)
    host = Cache(path, 2)
    try:
        params = _lib.CacheParams.from_buffer_copy(host.params)
        params.slot_memory = SLOTS_DEVICE
        err = ctypes.create_string_buffer(512)
        lib = _lib.lib()
        assert not lib.ggml_zipmoe_cache_new(ctypes.byref(params), err, len(err))
        assert b"slot_write" in err.value
        params.slot_memory = 7
        assert not lib.ggml_zipmoe_cache_new(ctypes.byref(params), err, len(err))
        assert b"slot_memory" in err.value
    finally:
        host.close()


def _set_cpu_slots(lib, handle, cpu, t_cpu):
    data = (ctypes.c_void_p * 3)(*[c.ctypes.data for c in cpu])
    stride = (ctypes.c_size_t * 3)(*[c.strides[0] for c in cpu])
    return lib.ggml_zipmoe_cache_set_cpu_slots(handle, data, stride, len(cpu[0]), t_cpu)


@pytest.mark.parametrize("quantized", [False, True])
def test_experts_the_balancer_gives_the_cpu_are_recovered_in_host_slots_and_never_sent(tmp_path, quantized):
    """zipmoe.cpu_compute's fetch (ggml_zipmoe_cache_fetch_begin_cpu): once a copy to the device has been
    measured, SMoE's CPU-load balancer gives missing experts to the CPU (a CPU that costs next to nothing
    here): they are recovered, byte for byte as a host cache's slot holds them, into the CPU's slots, take
    no device slot and are never written to the device; the rest are, as without it"""
    kind = dict(expert_dtype="q8_0", shape=(256, 45, 8)) if quantized else dict(shape=(1031, 517, 8))
    src = make_moe_gguf(tmp_path / "src.gguf", layers=2, **kind)
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=3)
    host = Cache(path, 8)  # every expert of a layer: a slot to compare each with
    base = Cache(path, 4)
    dev = DeviceCache(base)
    lib = dev.lib
    cpu = [np.zeros((3,) + s.shape[1:], s.dtype) for s in host.slots]
    try:
        assert _set_cpu_slots(lib, host.handle, cpu, 1e-12) == _lib.ERR_ARG  # host slots: the CPU has them all
        assert b"host memory" in lib.ggml_zipmoe_cache_error(host.handle)
        assert lib.ggml_zipmoe_cache_set_cpu_slots(dev.handle, None, None, -1, 0.0) == _lib.ERR_ARG
        assert _set_cpu_slots(lib, dev.handle, cpu, 1e-12) == _lib.OK
        layer = sorted(host.zf.moe_layers())[0]
        for step, ids in enumerate(([0, 1], [2, 3], [4, 5], [6, 7], [0, 5])):
            ids = np.array([ids], np.int32)
            slot_ids, cpu_ids = np.full(ids.shape, -9, np.int32), np.full(ids.shape, -9, np.int32)
            written, before = dev.written, _lib.cache_stats(dev.handle)
            assert lib.ggml_zipmoe_cache_fetch_begin_cpu(dev.handle, layer, 0, ids.ctypes.data, 2, 1, 2,
                                                         slot_ids.ctypes.data, cpu_ids.ctypes.data) == _lib.OK
            assert lib.ggml_zipmoe_cache_fetch_end(dev.handle, 0, 1) == _lib.OK, lib.ggml_zipmoe_cache_error(dev.handle)
            status, host_ids = host.fetch(layer, ids)
            assert status == _lib.OK
            after = _lib.cache_stats(dev.handle)
            if step == 0:  # no copy measured yet: every expert goes to the device
                assert (cpu_ids == -1).all() and (slot_ids >= 0).all()
                continue
            # a copy measured: the first missing expert is loaded, the CPU (~0 s a token) takes the other
            assert after["expert_misses"] - before["expert_misses"] == 2
            assert (slot_ids >= 0).sum() == 1 and (cpu_ids >= 0).sum() == 1 and ((slot_ids >= 0) ^ (cpu_ids >= 0)).all()
            for j in np.flatnonzero(cpu_ids[0] >= 0):
                for k in range(3):
                    assert np.array_equal(cpu[k][cpu_ids[0, j]], host.slots[k][host_ids[0, j]]), (step, j, k)
            assert after["cpu_experts"] - before["cpu_experts"] == 1
            if not quantized:  # the loaded expert's BF16 alone crossed
                assert dev.written - written == sum(dev.stride)
        stats = _lib.cache_stats(dev.handle)
        assert stats["cpu_experts"] == 4 and stats["device_experts"] == 6 and stats["device_ns"] > 0
        assert lib.ggml_zipmoe_cache_set_cpu_slots(dev.handle, None, None, 0, 0.0) == _lib.OK  # off
    finally:
        dev.close()
        base.close()
        host.close()
