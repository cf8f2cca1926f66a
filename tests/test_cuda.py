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


def test_cuda_preload_is_bit_identical(arch, zipmoe_gguf, cuda_reference):
    path = zipmoe_gguf(arch)
    want, want_tokens = cuda_reference(arch, PROMPTS)
    llm = load(path, n_gpu_layers=GPU_LAYERS, zipmoe_budget=budget_of(path, arch, "half"), zipmoe_preload=True)
    got, got_tokens, _ = trace_and_close(llm, PROMPTS)
    assert got_tokens == want_tokens and np.array_equal(got, want)


def test_cpu_layers_keep_host_slots_beside_a_gpu(arch, zipmoe_gguf, reference):
    """n_gpu_layers 0 on a CUDA build: slots in host memory, the CPU path's logits as on the CPU."""
    path = zipmoe_gguf(arch)
    want, want_tokens = reference(arch, 1)
    llm = load(path, n_gpu_layers=0, zipmoe_budget=budget_of(path, arch, "half"))
    got, got_tokens, stats = trace_and_close(llm, 1)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert stats["h2d_bytes"] == 0
