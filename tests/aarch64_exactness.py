"""Exactness on AArch64, run under qemu-user by tests/test_aarch64.py (its name keeps the host's pytest
from collecting it): the ZipMoE GGUF against the BF16 GGUF on the same aarch64 build, through
test_serve's logit trace (every logit of every prompt position and greedy decode step, as raw bits,
four sequences decoded together).

A budget of one token's experts per layer (several passes per layer in the prefill: the most misses,
passes and merges), with two graph threads, on a CPU whose recovery path is NEON. Eight decode steps
instead of test_serve's 32: emulation is slow, and the steps after the first eight run the same code.
Half and all of the experts, and one graph thread, are left to the host's tests (test_serve): they
change which of the cache's paths run, none of which holds code of the CPU's own; all of them and
one thread took 190 of this test's 370 s emulated (2026-12-01), half about 25 s of the suite's
(2026-12-04).

SVE recovery in the graph is served once, on one sequence: under qemu 7.2 the graph's BF16 products
run about 25 times slower in threads that also run SVE recovery (one trace: graph 108 s against 4.0 s
with NEON recovery, of which recovery itself 35 ms; 2026-12-03): the full matrix on SVE takes 11
minutes emulated on 2 cores. Recovery's SVE code itself is checked on every BF16 bit pattern and odd length by
the C-level tests on qemu's "max" CPU.
"""
from __future__ import annotations

import os
import platform

import pytest

from test_serve import PROMPTS, assert_same_trace, budget_of, load, logits_trace, served_trace
from zipmoe_py import codec

N_DECODE = 8
CASES = [(2, "top-k")]


@pytest.fixture(autouse=True)
def recovery_path_of_this_cpu():
    """The recovery path test_aarch64 chose the emulated CPU for (ZIPMOE_EXPECTED_RECOVERY)."""
    assert platform.machine() == "aarch64"
    assert codec.recover_impl() == os.environ["ZIPMOE_EXPECTED_RECOVERY"]


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    made = {}

    def get(arch: str, threads: int, prompts: tuple[str, ...] = tuple(PROMPTS)):
        if (arch, threads, prompts) not in made:
            llm = load(tiny_gguf(arch), threads)
            try:
                made[arch, threads, prompts] = logits_trace(llm, list(prompts), N_DECODE, threads)
            finally:
                llm.close()
        return made[arch, threads, prompts]

    return get


def assert_served_like_the_bf16_gguf(path, arch, threads, budget_name, prompts, reference):
    want, want_tokens = reference(arch, threads, tuple(prompts))
    got, got_tokens, stats = served_trace(path, budget_of(path, arch, budget_name), prompts, N_DECODE, threads)
    assert_same_trace(got, got_tokens, want, want_tokens, "the BF16 GGUF on aarch64")
    assert stats["expert_misses"] > 0 and stats["bytes_read"] > 0


@pytest.mark.parametrize("threads, budget_name", CASES)
def test_logits_on_aarch64_are_bit_identical_to_the_bf16_gguf(arch, threads, budget_name, zipmoe_gguf, reference):
    assert_served_like_the_bf16_gguf(zipmoe_gguf(arch), arch, threads, budget_name, PROMPTS, reference)


def test_sve_recovery_in_the_graph_is_bit_identical(zipmoe_gguf, reference):
    """One sequence at the smallest budget: the most misses per token, in several passes per layer."""
    assert_served_like_the_bf16_gguf(zipmoe_gguf("deepseek2"), "deepseek2", 2, "top-k", PROMPTS[2:3], reference)
