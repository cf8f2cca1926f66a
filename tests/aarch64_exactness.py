"""Exactness on AArch64, run under qemu-user by tests/test_aarch64.py (its name keeps the host's pytest
from collecting it): the ZipMoE GGUF against the BF16 GGUF on the same aarch64 build, through
test_serve's logit trace (every logit of every prompt position and greedy decode step, as raw bits,
four sequences decoded together).

Budgets of one token's experts per layer (several passes per layer in the prefill) and half of them,
with two graph threads. Eight decode steps instead of test_serve's 32: emulation is slow, and the steps
after the first eight run the same code. All of the experts, and one graph thread, are left to the
host's tests (test_serve): they change which of the cache's paths run, none of which holds code of the
CPU's own, and took 190 of this test's 370 s emulated (2026-12-01).
"""
from __future__ import annotations

import platform

import pytest

from test_serve import PROMPTS, assert_same_trace, budget_of, load, logits_trace, served_trace

N_DECODE = 8
CASES = [(2, "top-k"), (2, "half")]


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    made = {}

    def get(arch: str, threads: int):
        if (arch, threads) not in made:
            llm = load(tiny_gguf(arch), threads)
            try:
                made[arch, threads] = logits_trace(llm, PROMPTS, N_DECODE, threads)
            finally:
                llm.close()
        return made[arch, threads]

    return get


@pytest.mark.parametrize("threads, budget_name", CASES)
def test_logits_on_aarch64_are_bit_identical_to_the_bf16_gguf(arch, threads, budget_name, zipmoe_gguf, reference):
    assert platform.machine() == "aarch64"
    path = zipmoe_gguf(arch)
    want, want_tokens = reference(arch, threads)
    got, got_tokens, stats = served_trace(path, budget_of(path, arch, budget_name), PROMPTS, N_DECODE, threads)
    assert_same_trace(got, got_tokens, want, want_tokens, "the BF16 GGUF on aarch64")
    assert stats["expert_misses"] > 0 and stats["bytes_read"] > 0
