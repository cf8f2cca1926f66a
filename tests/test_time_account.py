"""Where a token's time goes: a fetch's wall time on the graph's critical path split into
waiting for the cache's lock, planning, thread 0's own decoding, waiting for reads and waiting for the
other threads; the graphs' whole time beside it; page faults while fetching. The parts are measured
from shared timestamps, so they add up to fetch_ns exactly."""
from __future__ import annotations

import ctypes
import time

import numpy as np

from conftest import run, zipmoe_command
from test_cache import Cache, linux_at_least
from test_format import make_moe_gguf
from test_serve import load
from zipmoe_py import _lib
from zipmoe_py import format as zformat

PARTS = ("lock_wait_ns", "plan_ns", "fetch_work_ns", "read_wait_ns", "finish_wait_ns")


def _fetch_some(cache: Cache, nth: int, steps: int = 12):
    rng = np.random.default_rng(3)
    layers = sorted(cache.zf.moe_layers())
    for step in range(steps):
        ids = np.stack([rng.choice(8, size=2, replace=False) for _ in range(2)]).astype(np.int32)
        status, _ = cache.fetch(layers[step % len(layers)], ids, nth=nth)
        assert status == _lib.OK


def test_the_parts_of_a_fetch_add_up_to_its_wall_time(tmp_path):
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(1031, 517, 8), layers=3)
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=4)
    cache = Cache(path, 3)
    lib = _lib.lib()
    try:
        for nth in (1, 3):
            _fetch_some(cache, nth)
            s = cache.stats()
            assert s["fetch_ns"] > 0 and sum(s[p] for p in PARTS) == s["fetch_ns"], s
            assert s["plan_ns"] > 0 and s["fetch_work_ns"] > 0
            cache.lib.ggml_zipmoe_cache_reset_stats(cache.handle)
            assert all(cache.stats()[p] == 0 for p in (*PARTS, "decode_faults", "graph_ns", "graphs"))
        # a slow disk: thread 0 alone has every SM-chunk to wait for
        lib.ggml_zipmoe_set_sm_read_delay_us(2000)
        try:
            _fetch_some(cache, 1, steps=6)
        finally:
            lib.ggml_zipmoe_set_sm_read_delay_us(0)
        s = cache.stats()
        assert s["read_wait_ns"] >= 6 * 2_000_000 * 0.9 and sum(s[p] for p in PARTS) == s["fetch_ns"], s
        lib.ggml_zipmoe_cache_count_graph(cache.handle, 5_000_000)
        assert cache.stats()["graphs"] == 1 and cache.stats()["graph_ns"] == 5_000_000
    finally:
        cache.close()


def test_a_models_graphs_are_counted_and_the_cli_reports_the_account(zipmoe_gguf):
    path = zipmoe_gguf("qwen2moe")
    llm = load(path)
    try:
        tokens = llm.tokenize(b"Where does the time go", add_bos=True, special=False)
        llm.eval(tokens)
        for _ in range(4):
            llm.eval([llm.sample(temp=0.0)])
        s = llm.zipmoe_stats()
    finally:
        llm.close()
    assert s["graphs"] == 5  # the prompt's ubatch, then one per token
    assert s["graph_ns"] > s["fetch_ns"] > 0 and sum(s[p] for p in PARTS) == s["fetch_ns"]
    chat = run([zipmoe_command("zipmoe-chat"), path, "-p", "Hi", "-n", 4, "--temp", 0, "-t", 2, "--stats"], text=True)
    assert chat.returncode == 0, chat.stderr[-2000:]
    line = next(line for line in chat.stderr.splitlines() if line.startswith("[stats] this reply"))
    assert "time (ms per token): graphs" in line and "waiting for reads" in line and "page faults" in line
    rates = next(line for line in chat.stderr.splitlines() if line.startswith("[stats] scheduler's cost model"))
    touch = _lib.default_rate(_lib.RATE_TOUCH) / 1e9
    assert f"first writes of new memory {touch:.2f} GB/s per thread (the default: not measured)" in rates, rates
    # each rate says where it comes from: the reads this run made measured the read rate; compute is never
    # measured, nor given here
    compute = _lib.default_rate(_lib.RATE_COMPUTE) / 1e9
    assert " GB/s (measured), decode " in rates and f"compute {compute:.2f} GB/s (the default: not measured)" in rates
    assert s["rate_origins"]["read"] == "measured" and s["rate_origins"]["touch"] == "default", s["rate_origins"]
    assert s["rate_origins"]["compute"] == "default" and s["rate_origins"]["decode"] in ("default", "measured")


def _kernel_populates() -> bool:
    """MADV_POPULATE_WRITE (Linux 5.14): without it the stores' pages are faulted in where first written"""
    return linux_at_least((5, 14))


def test_the_stores_pages_faulted_in_ahead_are_counted(tmp_path):
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(1031, 517, 8), layers=3)
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=4)
    # a C store of 4 experts a layer: the populator has pages to fault in
    cache = Cache(path, 10, eviction=_lib.EVICT_RANK, pools=(2, 4, 0, 0))
    try:
        _fetch_some(cache, 2)
        # the populator runs beside the fetches: wait until it has done and its count holds still
        deadline = time.monotonic() + 30
        while _kernel_populates() and time.monotonic() < deadline:
            seen = cache.stats()["populate_bytes"]
            time.sleep(0.5)
            if seen > 0 and cache.stats()["populate_bytes"] == seen:
                break
        s = cache.stats()
        if _kernel_populates():
            c_store = 3 * 4 * (1031 * 517 * 3) * 2  # 12 entries of at most a whole BF16 expert
            assert 0 < s["populate_bytes"] <= c_store and s["populate_bytes"] % 4096 == 0, s
            assert s["populate_ns"] > 0
        else:
            assert s["populate_bytes"] == s["populate_ns"] == 0
        cache.lib.ggml_zipmoe_cache_reset_stats(cache.handle)
        assert cache.stats()["populate_bytes"] == cache.stats()["populate_ns"] == 0
    finally:
        cache.close()


def _quiet_populate_bytes(cache: Cache, deadline_s: float = 30) -> int:
    """the stores' populated bytes once the populator has caught up (its count holds still)"""
    seen, deadline = -1, time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        now = cache.stats()["populate_bytes"]
        if now == seen:
            return now
        seen = now
        time.sleep(0.5)
    return seen


def test_the_populator_runs_free_until_an_entry_is_taken_then_keeps_a_window_past_the_fills(tmp_path):
    """A C store of 12 entries (2 experts a layer, 6 layers), made with the cache (the model loading): the
    populator faults all of it in. Once an entry is taken, a store grown to 48 entries (8 a layer) is
    faulted in only two layers' entries (16) past the entries taken, until the fills take more. The full
    Qwen1.5-MoE geometry at 20 GiB, faulting whole stores in, zeroed 16 GB for 7.6 GB of fills on a core
    the graph needed. Without MADV_POPULATE_WRITE (Linux before 5.14) there is no populator: nothing is
    faulted in ahead, the fills fault their own pages."""
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(1031, 517, 8), layers=6)
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, shards=4)
    cache = Cache(path, 10, eviction=_lib.EVICT_RANK, pools=(0, 2, 0, 0))
    try:
        entry = cache.stats()["pools"]["C"]["entry_bytes"]
        if not _kernel_populates():
            _fetch_some(cache, 2)
            assert cache.stats()["populate_bytes"] == 0
            return
        loaded = _quiet_populate_bytes(cache)  # nothing taken yet: the whole store
        assert 11 * entry < loaded <= 12 * entry, (loaded, entry)
        layers = sorted(cache.zf.moe_layers())
        status, _ = cache.fetch(layers[0], np.array([[0, 1]], dtype=np.int32), nth=2)
        assert status == _lib.OK
        assert cache.lib.ggml_zipmoe_cache_set_pools(cache.handle, (ctypes.c_int32 * 4)(0, 8, 0, 0), 10, 0) == 0
        grown = _quiet_populate_bytes(cache) - loaded  # the window past the 12 entries it had
        assert 0 < grown <= 16 * entry + 4096, (grown, entry)
        for layer in layers:  # every entry taken: the whole store, and no more
            status, _ = cache.fetch(layer, np.arange(8, dtype=np.int32).reshape(1, 8), nth=2)
            assert status == _lib.OK
        whole = _quiet_populate_bytes(cache)
        assert 40 * entry < whole <= 48 * entry, (whole, entry)
    finally:
        cache.close()
