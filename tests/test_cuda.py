"""Expert slots in CUDA memory (a ZIPMOE_CUDA=ON build on a machine with a GPU): logits bit-identical
to stock llama.cpp on CUDA running the BF16 GGUF with the same n_gpu_layers, so the same kernels run
after recovery. Both architectures, several budgets (one token's experts of a layer: several passes
per layer in a prefill), one and four sequences.

Without a CUDA GPU these tests skip: CI has none. There, test_build.py compiles the CUDA sources with
nvcc, and test_codec.py runs the kernel's index arithmetic ("cuda-grid") on every BF16 bit pattern.
"""
from __future__ import annotations

# libllama before llama.cpp's gguf-py (test_serve imports it): on the GPU machine's image, loading it
# after gguf-py's dependencies crashed std::regex in the tokenizer, before any ZipMoE code ran
import zipmoe_py.bindings  # noqa: F401  isort: skip

import threading

import numpy as np
import pytest

from zipmoe_py import _lib

from test_serve import budget_of, load, logits_trace, reference, trace_and_close  # noqa: F401 (reference: a fixture)

pytestmark = pytest.mark.skipif(_lib.lib().ggml_zipmoe_cuda_devices() == 0,
                                reason="needs a ZIPMOE_CUDA=ON build and a CUDA GPU (docs/CUDA.md)")

GPU_LAYERS = 99
PROMPTS = 4


@pytest.fixture(scope="module")
def cuda_reference(tiny_gguf):
    made = {}

    def get(arch, n_seq):
        if (arch, n_seq) not in made:
            llm = load(tiny_gguf(arch), n_gpu_layers=GPU_LAYERS)
            try:
                made[arch, n_seq] = logits_trace(llm, [p for p in _prompts()[:n_seq]])
            finally:
                llm.close()
        return made[arch, n_seq]

    return get


def _prompts():
    from test_serve import PROMPTS as prompts
    return prompts


@pytest.mark.parametrize("n_seq", [1, PROMPTS])
@pytest.mark.parametrize("budget_name", ["top-k", "half", "everything"])
def test_cuda_logits_are_bit_identical_to_stock_cuda(arch, n_seq, budget_name, zipmoe_gguf, cuda_reference):
    path = zipmoe_gguf(arch)
    want, want_tokens = cuda_reference(arch, n_seq)
    llm = load(path, n_gpu_layers=GPU_LAYERS, zipmoe_budget=budget_of(path, arch, budget_name))
    got, got_tokens, stats = trace_and_close(llm, n_seq)
    assert got_tokens == want_tokens
    differing = int((got != want).any(axis=1).sum())
    assert differing == 0, f"{differing} of {len(got)} positions differ from stock llama.cpp on CUDA"
    # the slots were filled through the GPU path: SM and exponent planes crossed to the device
    assert stats["expert_misses"] > 0 and stats["h2d_bytes"] > 0


@pytest.mark.parametrize("prefetch", [True, False])
def test_cuda_with_pools_and_prefetch_is_bit_identical(arch, prefetch, zipmoe_gguf, cuda_reference):
    """F slots in GPU memory, the C, S and E stores in host memory, the next layer read ahead."""
    path = zipmoe_gguf(arch)
    want, want_tokens = cuda_reference(arch, 1)
    llm = load(path, n_gpu_layers=GPU_LAYERS, zipmoe_pools="F=1,C=2,S=1,E=1", zipmoe_prefetch=prefetch)
    got, got_tokens, _ = trace_and_close(llm, 1)
    assert got_tokens == want_tokens and np.array_equal(got, want)


def test_cuda_host_stores_beside_gpu_slots_are_bit_identical(arch, tiny_gguf, zipmoe_gguf):
    """A quarter of the experts in GPU slots, zipmoe.device_stores on: host memory keeps the other experts
    compressed (C/E stores) from the prompt's reads on, and refills from them cross to the GPU; one
    sequence decoded 48 steps, logits stock's on CUDA bit for bit."""
    n_decode = 48
    llm = load(tiny_gguf(arch), n_gpu_layers=GPU_LAYERS)
    try:
        want, want_tokens = logits_trace(llm, _prompts()[:1], n_decode=n_decode)
    finally:
        llm.close()
    path = zipmoe_gguf(arch)
    llm = load(path, n_gpu_layers=GPU_LAYERS, zipmoe_budget=budget_of(path, arch, "half") // 2,
               zipmoe_device_stores=True)
    try:
        got, got_tokens = logits_trace(llm, _prompts()[:1], n_decode=n_decode)
        stats = llm.zipmoe_stats()
    finally:
        llm.close()
    assert got_tokens == want_tokens and np.array_equal(got, want)
    pools = stats["memory"]["pools"], stats["memory"]["pools_why"]
    assert pools[0]["C"] > 0 and "host memory" in pools[1], pools
    assert stats["c_hits"] + stats["e_hits"] > 0 and stats["h2d_bytes"] > 0, stats


def test_cuda_preload_is_bit_identical_and_uses_resident_views(arch, zipmoe_gguf, cuda_reference):
    """Every expert preloaded into GPU slots: resident views (on by default with GPU slots) run stock's
    graph on the slots in place, with no fetch op at all."""
    path = zipmoe_gguf(arch)
    want, want_tokens = cuda_reference(arch, PROMPTS)
    llm = load(path, n_gpu_layers=GPU_LAYERS, zipmoe_budget=budget_of(path, arch, "everything"), zipmoe_preload=True)
    got, got_tokens, stats = trace_and_close(llm, PROMPTS)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert stats["fetch_calls"] == 0 and stats["bytes_read"] == 0 and stats["preload_experts"] > 0


def test_cuda_preload_without_resident_views_is_bit_identical(arch, zipmoe_gguf, cuda_reference, monkeypatch):
    """The same with resident views off: every product goes through the fetch op, which finds every
    expert in its slot."""
    monkeypatch.setenv("ZIPMOE_RESIDENT_VIEWS", "0")
    path = zipmoe_gguf(arch)
    want, want_tokens = cuda_reference(arch, PROMPTS)
    llm = load(path, n_gpu_layers=GPU_LAYERS, zipmoe_budget=budget_of(path, arch, "everything"), zipmoe_preload=True)
    got, got_tokens, stats = trace_and_close(llm, PROMPTS)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert stats["fetch_calls"] > 0 and stats["expert_misses"] == 0


def test_cpu_layers_keep_host_slots_beside_a_gpu(arch, zipmoe_gguf, reference):
    """n_gpu_layers 0 on a CUDA build: slots in host memory, the CPU path's logits as on the CPU."""
    path = zipmoe_gguf(arch)
    want, want_tokens = reference(arch, 1)
    llm = load(path, n_gpu_layers=0, zipmoe_budget=budget_of(path, arch, "half"))
    got, got_tokens, stats = trace_and_close(llm, 1)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert stats["h2d_bytes"] == 0


@pytest.mark.parametrize("n_seq", [1, PROMPTS])
@pytest.mark.parametrize("budget_name", ["top-k", "half", "everything"])
def test_cuda_n_cpu_moe_gives_a_set_per_device_bit_identical(arch, n_seq, budget_name, tiny_gguf, zipmoe_gguf):
    """-ngl 99 --n-cpu-moe 3: the first three layers' experts in host memory (a host slot set, computed
    on the CPU as stock does), the others' slots in VRAM; logits bit-identical to stock with the same flags."""
    from zipmoe_py.slot_sets import caches, served_layers

    llm = load(tiny_gguf(arch), n_gpu_layers=GPU_LAYERS, n_cpu_moe=3)
    try:
        want, want_tokens = logits_trace(llm, _prompts()[:n_seq])
    finally:
        llm.close()
    path = zipmoe_gguf(arch)
    llm = load(path, n_gpu_layers=GPU_LAYERS, n_cpu_moe=3, zipmoe_budget=budget_of(path, arch, budget_name))
    sets = {device: served_layers(cache) for device, cache in caches(llm._model.model)}
    got, got_tokens, stats = trace_and_close(llm, n_seq)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert sorted(sets) == ["CPU", "CUDA0"] and max(sets["CPU"]) < 3 <= min(sets["CUDA0"]), sets
    assert stats["h2d_bytes"] > 0
    plans = {s["device"]: s["memory"] for s in stats["sets"]}  # each sized from its own device's memory
    assert plans["CUDA0"]["source"] == "CUDA0's free memory" and plans["CPU"]["source"] != plans["CUDA0"]["source"]


@pytest.mark.parametrize("tokens_of_experts", [1, 2])
def test_cuda_n_cpu_moe_long_prompt_offloaded_is_bit_identical(arch, tokens_of_experts, tiny_gguf, zipmoe_gguf):
    """A prompt of 32 tokens or more: ggml runs the host layers' products on the GPU (its offload of a large
    batch's products on host weights, copying the experts they use). The host set holds one or two tokens'
    experts, so its passes give the other selections zero slots, which the offload's copy takes as any
    expert: no abort, logits stock's with the same flags."""
    from test_serve import TOP_K, expert_geometry

    prompt = " ".join(_prompts()) * 4
    llm = load(tiny_gguf(arch), n_gpu_layers=GPU_LAYERS, n_cpu_moe=3)
    try:
        assert len(llm.tokenize(prompt.encode())) >= 64
        want, want_tokens = logits_trace(llm, [prompt])
    finally:
        llm.close()
    path = zipmoe_gguf(arch)
    one, _, _ = expert_geometry(path)
    llm = load(path, n_gpu_layers=GPU_LAYERS, n_cpu_moe=3,
               zipmoe_device_budgets={"CPU": tokens_of_experts * TOP_K[arch] * one})
    try:
        got, got_tokens = logits_trace(llm, [prompt])
        stats = llm.zipmoe_stats()
    finally:
        llm.close()
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert stats["expert_misses"] > 0


def test_cuda_cpu_compute_gives_the_cpu_misses_and_stays_close_to_stock(arch, tiny_gguf, zipmoe_gguf, cuda_reference):
    """zipmoe.cpu_compute on a GPU (opt-in, SMoE Alg. 2): VRAM slots for one token's experts, the host stores
    on; once a copy to the GPU is measured the balancer gives the CPU some misses. The CPU rounds as the
    GPU does not, so this is the one CUDA test that is not bit-exact by design: the prompt's logits agree
    with stock on CUDA to the rounding of its products (1e-3 of their range), and it runs without error."""
    want, _ = cuda_reference(arch, 1)
    path = zipmoe_gguf(arch)
    llm = load(path, n_gpu_layers=GPU_LAYERS, zipmoe_budget=budget_of(path, arch, "top-k"), zipmoe_cpu_compute=True,
               zipmoe_device_stores=True)
    got, _, stats = trace_and_close(llm, 1)
    assert stats["cpu_experts"] > 0 and stats["device_experts"] > 0, stats
    first = slice(0, 1)  # the first position: before any token choice could differ
    scale = float(np.abs(want[first]).max())
    assert np.isfinite(got).all() and np.allclose(got[first], want[first], rtol=0, atol=1e-3 * scale)


def test_cuda_phase2_ghuf_is_bit_identical_and_sends_compressed_exponents(arch, tiny_gguf, zipmoe_gguf, cuda_reference,
                                                                         tmp_path):
    """Phase 2: E-chunks in the GPU layout cross compressed and are decoded on the GPU: the same
    logits as stock on CUDA, fewer bytes to the GPU than phase 1 (which sends decoded exponents)."""
    from zipmoe_py import format as zformat

    ghuf = tmp_path / f"{arch}.ghuf.zipmoe.gguf"
    zformat.repack(tiny_gguf(arch), ghuf, codec="ghuf")
    want, want_tokens = cuda_reference(arch, PROMPTS)
    h2d = {}
    for name, path in (("phase1", zipmoe_gguf(arch)), ("phase2", ghuf)):
        llm = load(path, n_gpu_layers=GPU_LAYERS, zipmoe_budget=budget_of(path, arch, "top-k"))
        got, got_tokens, stats = trace_and_close(llm, PROMPTS)
        assert got_tokens == want_tokens and np.array_equal(got, want), name
        h2d[name] = (stats["h2d_bytes"], stats["expert_misses"])
    assert h2d["phase1"][1] == h2d["phase2"][1]  # the same experts fetched
    assert h2d["phase2"][0] < 0.85 * h2d["phase1"][0]


def _cudart():
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("cudart") or "/usr/local/cuda/lib64/libcudart.so"
    rt = ctypes.CDLL(name)
    rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    rt.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    rt.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    rt.cudaFree.argtypes = [ctypes.c_void_p]
    return rt


@pytest.mark.parametrize("codec", ["fhuf", "ghuf"])  # phase 1: exponents decoded on the CPU; phase 2: on the GPU
@pytest.mark.parametrize("nth", [1, 4])
@pytest.mark.parametrize("pools", [(0, 0, 0, 0), (1, 2, 1, 1)])
def test_cache_with_gpu_slots_fills_them_as_a_host_cache_does(codec, nth, pools, tmp_path):
    """The cache alone (no ggml): the same fetches on host slots and on slots in GPU memory, every
    slot compared bit for bit after each fetch; odd shapes, shards, threads and pools."""
    import ctypes

    from test_cache import Cache
    from test_format import make_moe_gguf
    from zipmoe_py import format as zformat

    rt = _cudart()
    src = make_moe_gguf(tmp_path / "src.gguf", shape=(1031, 517, 8), layers=3)
    path = tmp_path / "z.gguf"
    zformat.repack(src, path, codec=codec, shards=5)
    n_slots = 5 if any(pools) else 3
    eviction = _lib.EVICT_RANK if any(pools) else _lib.EVICT_LRU
    host = Cache(path, n_slots, eviction=eviction, pools=pools)
    # the same cache on device memory: its params with the slot pointers swapped
    dev_ptrs, lib = [], _lib.lib()
    params = _lib.CacheParams.from_buffer_copy(host.params)
    for k, slots in enumerate(host.slots):
        ptr = ctypes.c_void_p()
        assert rt.cudaMalloc(ctypes.byref(ptr), slots.nbytes) == 0
        assert rt.cudaMemset(ptr, 0, slots.nbytes) == 0
        dev_ptrs.append(ptr)
        params.slot_data[k] = ptr.value
    params.slot_memory = 1
    err = ctypes.create_string_buffer(1024)
    dev = lib.ggml_zipmoe_cache_new(ctypes.byref(params), err, len(err))
    assert dev, err.value
    try:
        rng = np.random.default_rng(5)
        layers = sorted(host.zf.moe_layers())
        for step in range(30):
            layer = layers[step % len(layers)]
            ids = np.stack([rng.choice(8, size=2, replace=False) for _ in range(1 + step % 2)]).astype(np.int32)
            status, want = host.fetch(layer, ids, nth=nth)
            assert status == _lib.OK
            got = np.full(ids.shape, -1, np.int32)
            statuses = [None] * nth

            def work(i):
                statuses[i] = lib.ggml_zipmoe_cache_fetch(dev, layer, 0, ids.ctypes.data, ids.shape[1], ids.shape[0],
                                                          ids.shape[1], got.ctypes.data, i, nth)

            threads = [threading.Thread(target=work, args=(i,)) for i in range(nth)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            assert statuses == [_lib.OK] * nth, lib.ggml_zipmoe_cache_error(dev)
            assert np.array_equal(got, want)
            for k, slots in enumerate(host.slots):
                back = np.empty_like(slots)
                assert rt.cudaMemcpy(back.ctypes.data, dev_ptrs[k], slots.nbytes, 2) == 0  # device to host
                assert np.array_equal(back, slots), f"slot tensor {k} differs after fetch {step}"
        stats = _lib.cache_stats(dev)
        assert stats["h2d_bytes"] > 0
    finally:
        lib.ggml_zipmoe_cache_free(dev)
        for ptr in dev_ptrs:
            rt.cudaFree(ptr)
