"""Several contexts on one ZipMoE model, decoding from several threads at once, get logits bit-identical
to each context run alone on the BF16 GGUF: at the smallest budget (one token's experts of a layer,
far below the contexts' combined working set), at half the experts, and while contexts come and go
and the cache is resized under the others.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from test_serve import PROMPTS, assert_slots_fit_the_budget, expert_geometry, load, logits_trace

N_WORKERS = 3
REPETITIONS = 3
N_DECODE = 8
TOP_K = {"qwen2moe": 4, "deepseek2": 6}
GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture(scope="module")
def alone(tiny_gguf):
    """Each prompt's trace on the BF16 GGUF, one context, nothing else running."""
    made = {}

    def get(arch):
        if arch not in made:
            llm = load(tiny_gguf(arch))
            made[arch] = [logits_trace(llm, [p], n_decode=N_DECODE) for p in PROMPTS]
            llm.close()
        return made[arch]

    return get


def decode_at_once(llm, want) -> list[str]:
    """N_WORKERS threads, each making, using and freeing its own context REPETITIONS times."""
    failures = []
    start = threading.Barrier(N_WORKERS)

    def worker(w):
        try:
            start.wait()
            for r in range(REPETITIONS):
                i = (w + r) % len(PROMPTS)
                got, tokens = logits_trace(llm, [PROMPTS[i]], n_decode=N_DECODE)
                if tokens != want[i][1] or not np.array_equal(got, want[i][0]):
                    rows = int((got != want[i][0]).any(axis=1).sum()) if got.shape == want[i][0].shape else "all"
                    failures.append(f"worker {w}, repetition {r}, prompt {i}: {rows} positions differ")
        except Exception as e:  # noqa: BLE001 - reported below, with the worker
            failures.append(f"worker {w}: {e!r}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(N_WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures


@pytest.mark.parametrize("budget_name", ["top-k", "half"])
@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
def test_contexts_decoding_at_once_match_each_alone(arch, budget_name, zipmoe_gguf, alone):
    path = zipmoe_gguf(arch)
    one, _, everything = expert_geometry(path)
    budget = {"top-k": TOP_K[arch] * one, "half": everything // 2}[budget_name]
    llm = load(path, zipmoe_budget=budget)
    try:
        failures = decode_at_once(llm, alone(arch))
        stats = llm.zipmoe_stats()
    finally:
        llm.close()
    assert not failures, "\n".join(failures)
    assert_slots_fit_the_budget(stats, budget, one)
    assert stats["expert_misses"] > 0 and stats["bytes_read"] > 0


def test_contexts_coming_and_going_resize_the_cache_under_the_others(zipmoe_gguf, alone):
    """A memory limit that holds every expert with one context and only top-k with two: the slot count
    changes whenever a worker makes or frees its context, while the others decode."""
    path = zipmoe_gguf("qwen2moe")

    def load_limited(limit):
        os.environ["ZIPMOE_MEM_LIMIT"] = str(limit)
        try:
            return load(path)
        finally:
            del os.environ["ZIPMOE_MEM_LIMIT"]

    # with zipmoe.mem_limit L, available = L - this process's resident memory when loading began
    probe = load_limited(8 * GIB)
    plan = probe.zipmoe_stats()["memory"]
    probe.close()
    resident_at_load = 8 * GIB - plan["available"]
    # room for one context (this Llama's) and half another: each worker's context shrinks the cache
    need = (plan["non_expert"] + plan["contexts"] * 3 // 2 + plan["cache_buffers"]
            + plan["expert_bytes"] * plan["slot_capacity"] + 64 * MIB)
    llm = load_limited(resident_at_load + need * 32 // 31)
    try:
        seen = set()
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                seen.add(llm.zipmoe_stats()["n_slots"])
                stop.wait(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            failures = decode_at_once(llm, alone("qwen2moe"))
        finally:
            stop.set()
            watcher.join()
    finally:
        llm.close()
    assert not failures, "\n".join(failures)
    assert min(seen) == TOP_K["qwen2moe"] and max(seen) > TOP_K["qwen2moe"], seen
