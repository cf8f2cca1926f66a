"""Serving (ggml-zipmoe-serving.h), driven without llama.cpp: the slots a process reserves, the slots
in use for the memory left beside the other weights and the contexts, given pools that do not fit,
and the default pools planned again from the routing of decode steps.

The same object sizes every Llama (tests/test_memory.py checks the numbers it reports there); here
its arithmetic is checked against the rules written out, with the memory given rather than measured.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from zipmoe_py import _lib
from zipmoe_py import format as zformat

from test_format import make_moe_gguf

MIB = 1 << 20
N_EXPERT = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving")
    src = make_moe_gguf(tmp / "src.gguf", shape=(67, 45, N_EXPERT), layers=3)
    path = tmp / "z.gguf"
    zformat.repack(src, path, shards=2)
    return path


class Serving:
    """A serving object on a ZipMoE GGUF, its log lines kept, and the cache it sizes."""

    def __init__(self, path, available, n_expert_used=2, budget=0, pools=(0, 0, 0, 0), work_slots=4,
                 eviction=_lib.EVICT_RANK, auto_pools=True, replan_tokens=0):
        self.lib = _lib.lib()
        self.zf = zformat.ZipMoEFile(path)
        self.logs: list[tuple[int, str]] = []
        self._log = _lib.LOG_FN(lambda level, text, _: self.logs.append((level, text.decode())))
        layers = self.zf.moe_layers()
        n_layer = max(layers) + 1
        self.table = (ctypes.c_int32 * (3 * n_layer))(*[-1] * (3 * n_layer))
        for layer, tensors in layers.items():
            self.table[3 * layer:3 * layer + 3] = list(tensors)
        p = self.params = _lib.ServingParams()
        p.file, p.layer_tensors, p.n_layer, p.n_expert_used = self.zf._handle, self.table, n_layer, n_expert_used
        p.available, p.budget, p.work_slots, p.eviction = available, budget, work_slots, eviction
        p.pools[:] = pools
        p.auto_pools, p.replan_tokens, p.log = int(auto_pools), replan_tokens, self._log
        self.err = ctypes.create_string_buffer(2048)
        self.handle = self.lib.ggml_zipmoe_serving_new(ctypes.byref(p), self.err, len(self.err))
        self.cache = None

    @property
    def error(self) -> str:
        return self.err.value.decode()

    def info(self) -> _lib.ServingInfo:
        info = _lib.ServingInfo()
        self.lib.ggml_zipmoe_serving_get_info(self.handle, ctypes.byref(info))
        return info

    def make_cache(self, rate_read=0.0, rate_decode=0.0, movable_pages=True) -> None:
        """reserves the host slots and makes the cache on them, as the loader does (rates given: plans
        that do not follow this machine's; movable_pages: the slots, the serving's own mapping, may take
        store pages, as the loader lets them)"""
        data, stride = (ctypes.c_void_p * 3)(), (ctypes.c_size_t * 3)()
        assert self.lib.ggml_zipmoe_serving_reserve_host(self.handle, data, stride, self.err, len(self.err)) == 0
        cp = self.cache_params = _lib.CacheParams()
        cp.file, cp.n_slots, cp.eviction = self.zf._handle, self.info().capacity, self.params.eviction
        cp.pool_capacity[:] = list(self.params.pools)
        cp.n_layer, cp.layer_tensors = self.params.n_layer, self.table
        cp.slot_data[:], cp.slot_stride[:] = list(data), list(stride)
        cp.rate_read, cp.rate_decode = rate_read, rate_decode
        cp.slot_pages_movable = int(movable_pages)
        self.cache = self.lib.ggml_zipmoe_cache_new(ctypes.byref(cp), self.err, len(self.err))
        assert self.cache, self.error
        status = self.lib.ggml_zipmoe_serving_set_cache(self.handle, self.cache, 0, self.err, len(self.err))
        assert status == 0, self.error

    def resize(self, non_expert=0, contexts=0, n_contexts=1, threads=1, making=True) -> tuple[int, int]:
        d = _lib.ServingDemand(non_expert, contexts, n_contexts, threads, int(making))
        changed = ctypes.c_int(-1)
        status = self.lib.ggml_zipmoe_serving_resize(self.handle, ctypes.byref(d), ctypes.byref(changed), self.err,
                                                      len(self.err))
        return status, changed.value

    def plan(self) -> _lib.MemoryPlan:
        plan = _lib.MemoryPlan()
        self.lib.ggml_zipmoe_serving_get_plan(self.handle, ctypes.byref(plan))
        return plan

    def n_slots(self) -> int:
        return self.lib.ggml_zipmoe_cache_n_slots(self.cache)

    def decode_step(self, ids_by_layer) -> None:
        """one graph: a fetch of each layer's ids ([n_tokens][n_used]), every pass"""
        for layer, ids in ids_by_layer.items():
            ids = np.ascontiguousarray(ids, np.int32)
            out = np.empty_like(ids)
            for p in range(self.lib.ggml_zipmoe_cache_n_passes(self.cache, layer, ids.size)):
                assert self.lib.ggml_zipmoe_cache_fetch(self.cache, layer, p, ids.ctypes.data, ids.shape[1],
                                                        ids.shape[0], ids.shape[1], out.ctypes.data, 0, 1) == 0

    def observe(self, n_tokens: int = 1, n_seqs: int = 1, tokens=None) -> int:
        """after a graph of n_tokens tokens of n_seqs sequences, as llama_zipmoe::finish_compute calls it: the
        ubatch's token ids first (None: told none, as for embeddings)"""
        if tokens is not None:
            ids = np.ascontiguousarray(tokens, np.int32)
            assert ids.size == n_tokens
            self.lib.ggml_zipmoe_serving_observe_tokens(self.handle, ids.ctypes.data, n_tokens, n_seqs)
        return self.lib.ggml_zipmoe_serving_observe(self.handle, n_tokens, n_seqs)

    def close(self) -> None:
        if self.cache:
            self.lib.ggml_zipmoe_cache_free(self.cache)
        if self.handle:
            self.lib.ggml_zipmoe_serving_free(self.handle)
        self.zf.close()


@pytest.fixture
def serving(model):
    made = []

    def make(**kwargs):
        kwargs.setdefault("available", 1 << 30)
        made.append(Serving(model, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_the_geometry_and_the_slots_to_reserve_follow_budget_memory_and_pools(serving):
    info = serving().info()
    assert (info.n_moe_layers, info.max_expert) == (3, N_EXPERT)
    assert info.expert_bytes == 3 * 67 * 45 * 2 and info.all_experts == 3 * N_EXPERT * info.expert_bytes
    # ample memory: every expert, no more
    assert info.capacity == 3 * N_EXPERT and not info.with_pools
    # a budget of 5.5 experts: 5 slots
    assert serving(budget=int(5.5 * info.expert_bytes)).info().capacity == 5
    # memory for 4.9 experts: 4; for none, still one token's experts of a layer
    assert serving(available=int(4.9 * info.expert_bytes)).info().capacity == 4
    assert serving(available=1, n_expert_used=3).info().capacity == 3
    # pools: F's experts in every layer plus the working slots
    given = serving(pools=(2, 1, 0, 0), work_slots=3).info()
    assert given.with_pools and given.capacity == 2 * 3 + 3


def test_options_the_file_cannot_serve_are_refused_with_the_numbers(serving, model):
    too_many = serving(pools=(4, 3, 2, 0))
    assert not too_many.handle
    assert "(F 4, C 3, S 2, E 0) hold 9 experts per MoE layer, more than the 8 a layer of" in too_many.error
    assert str(model) in too_many.error
    tiny = serving(budget=100)
    assert not tiny.handle and "zipmoe.budget of 100 bytes cannot hold one expert (18090 bytes" in tiny.error


def sizing_rule(s: Serving, available: int, non_expert: int, contexts: int, threads: int = 1) -> int:
    """the slots in use the rules give with one F pool (ggml-zipmoe-serving.h)"""
    info = s.info()
    own = s.lib.ggml_zipmoe_cache_extra_bytes(s.cache, threads)
    margin = 64 * MIB + available // 32
    fits = max(0, available - (non_expert + contexts + own + margin))
    return min(info.capacity, max(info.fewest, fits // info.expert_bytes))


def test_the_slots_in_use_are_what_the_memory_left_holds_and_shrink_and_grow_with_contexts(serving):
    available = 256 * MIB
    s = serving(available=available, eviction=_lib.EVICT_LRU)  # LRU: one F pool, no default pools
    s.make_cache()
    info = s.info()
    assert s.n_slots() == info.fewest == 2  # until a context says what is left
    own = s.lib.ggml_zipmoe_cache_extra_bytes(s.cache, 1)
    room = available - 64 * MIB - available // 32 - own  # what slots could take with nothing else
    # a context that leaves 5.5 experts
    contexts = room - 10 * MIB - int(5.5 * info.expert_bytes)
    assert s.resize(non_expert=10 * MIB, contexts=contexts) == (0, 1)
    assert s.n_slots() == 5 == sizing_rule(s, available, 10 * MIB, contexts)
    plan = s.plan()
    assert (plan.n_slots, plan.slot_capacity, plan.min_slots, plan.n_contexts) == (5, info.capacity, 2, 1)
    assert plan.fits == room - 10 * MIB - contexts and plan.cache_buffers == own and plan.source == b"given"
    assert plan.pools_why.startswith(b"one F pool: pools dispatch by rank, and zipmoe.eviction is lru")
    assert any("ZipMoE expert cache: 5 of 24 slots in use" in text for _, text in s.logs)
    # the context freed: every expert; asked again, nothing changes
    assert s.resize(non_expert=10 * MIB, contexts=0, n_contexts=0, making=False) == (0, 1)
    assert s.n_slots() == info.capacity
    assert s.resize(non_expert=10 * MIB, contexts=0, n_contexts=0, making=False) == (0, 0)
    # no room at all: the fewest, with a warning that names the sums
    assert s.resize(contexts=available) == (0, 1) and s.n_slots() == 2
    level, text = s.logs[-2]
    assert level == 1 and text.startswith("memory is short for the ZipMoE expert cache: available 256.0 MiB (given)")
    assert text.endswith("(a smaller context, -c or n_ctx, leaves more)")
    # a context freed with memory still short: said once, when the context was made, not again
    warned = len([1 for level, _ in s.logs if level == 1])
    assert s.resize(contexts=available, making=False) == (0, 0)
    assert len([1 for level, _ in s.logs if level == 1]) == warned


def test_a_budget_that_does_not_fit_is_cut_with_a_warning(serving):
    available = 256 * MIB
    probe = serving(available=available)
    expert = probe.info().expert_bytes
    s = serving(available=available, budget=10 * expert, eviction=_lib.EVICT_LRU)
    s.make_cache()
    own = s.lib.ggml_zipmoe_cache_extra_bytes(s.cache, 1)
    contexts = available - 64 * MIB - available // 32 - own - int(4.5 * expert)
    assert s.resize(contexts=contexts) == (0, 1) and s.n_slots() == 4
    assert any(level == 1 and "zipmoe.budget of" in text and "does not fit: available" in text and
               "using 4 slots" in text for level, text in s.logs)


def test_given_pools_that_do_not_fit_fail_a_new_context_but_not_a_freed_one(serving):
    s = serving(available=256 * MIB, pools=(2, 2, 0, 0), work_slots=2)
    s.make_cache()
    capacity = s.info().capacity
    assert s.resize(contexts=256 * MIB) == (_lib.ERR_ARG, 0)
    assert s.error.startswith("the ZipMoE pools need") and "only 0 bytes is left: available 256.0 MiB" in s.error
    assert s.resize(contexts=256 * MIB, making=False)[0] == 0
    assert s.n_slots() == capacity and list(s.plan().pools) == [2, 2, 0, 0]
    assert s.plan().pools_why.startswith(b"the pools given")


def test_the_default_pools_are_planned_again_from_decode_steps_only(serving):
    s = serving(available=256 * MIB, replan_tokens=3)
    s.make_cache()
    assert s.resize()[0] == 0
    layers = s.zf.moe_layers()
    replanned = [text for _, text in s.logs if "re-planned" in text]
    assert not replanned
    # a prompt beside a decoding sequence, or two tokens of one sequence (a prompt): never counted as decode
    # steps (and after a graph of several sequences, no re-plan after a prompt)
    for n_tokens, n_seqs in [(3, 2)] * 4 + [(2, 1)] * 4:
        s.decode_step({layer: [[0, 1], [2, 3], [4, 5]][:n_tokens] for layer in layers})
        assert s.observe(n_tokens, n_seqs) == 0
    assert not [text for _, text in s.logs if "re-planned" in text]
    # five one-token steps, skewed to experts 0 and 1: the pools are planned once more, after 3
    for step in range(5):
        s.decode_step({layer: [[0, 1]] if step % 2 == 0 else [[0, 2]] for layer in layers})
        s.observe()
    replanned = [text for _, text in s.logs if "re-planned" in text]
    assert len(replanned) == 1 and replanned[0].startswith("ZipMoE pools re-planned after 3 decode steps (2 experts "
                                                           "per MoE layer a step")
    # kept or changed; kept, it says what the change would have read again against what it would gain
    kept = "): kept, the change to F " in replanned[0]
    assert kept == (" s to fill, " in replanned[0]) and (kept or " per MoE layer, " in replanned[0]), replanned[0]
    # and again each time the counted steps double: a change must repay its reads within the steps seen
    for step in range(5, 12):
        s.decode_step({layer: [[0, 1]] if step % 2 == 0 else [[0, 2]] for layer in layers})
        s.observe()
    replanned = [text for _, text in s.logs if "re-planned" in text]
    assert [text.split(" decode steps")[0].split("after ")[1] for text in replanned] == ["3", "6", "12"]


def test_one_sequences_prompt_is_counted_token_by_token_and_plans_at_its_first_decode_step(serving):
    """One sequence's tokens are its steps, its prompt's included: the cache counts each layer's even and
    odd tokens apart, and a prompt of zipmoe.replan_tokens tokens or more plans the pools from them as
    it ends, before the first decode step (the full Qwen1.5-MoE geometry at 20 GiB spent 2.5 s of 13.6
    decoding from C until the re-plan at 8 steps, and a change at the first decode step put its fills
    into the timed tokens)."""
    s = serving(available=256 * MIB, replan_tokens=8)
    s.make_cache()
    assert s.resize()[0] == 0
    layers = s.zf.moe_layers()
    first = next(iter(layers))
    # a prompt of 9 tokens: expert 0 chosen by every one, 1 by the even tokens, 2 by the odd
    prompt = [[0, 1] if t % 2 == 0 else [0, 2] for t in range(9)]
    s.decode_step({layer: prompt for layer in layers})
    s.observe(9, 1)
    even, odd, n_tokens = _lib.cache_selections(s.cache, first)
    assert n_tokens == 9 and even[:3] == [5, 5, 0] and odd[:3] == [4, 0, 4] and sum(even[3:] + odd[3:]) == 0
    assert _lib.cache_activations(s.cache, first) == ([1, 1, 1] + [0] * (len(even) - 3), 1)  # ubatches
    # planned as the prompt ends, from its tokens
    [replanned] = [text for _, text in s.logs if "re-planned" in text]
    assert replanned.startswith("ZipMoE pools re-planned after a prompt of 9 tokens (2 experts per MoE layer a "
                                "step"), replanned
    # the first decode step plans nothing more; then at zipmoe.replan_tokens decode steps, as without the prompt
    for _ in range(8):
        s.decode_step({layer: [[0, 1]] for layer in layers})
        s.observe()
    replanned = [text.split(" (")[0] for _, text in s.logs if "re-planned" in text]
    assert replanned == ["ZipMoE pools re-planned after a prompt of 9 tokens",
                         "ZipMoE pools re-planned after 8 decode steps"], replanned
    assert _lib.cache_selections(s.cache, first)[2] == 17
    # a prompt shorter than zipmoe.replan_tokens: the first re-plan waits for the decode steps
    t = serving(available=256 * MIB, replan_tokens=8)
    t.make_cache()
    assert t.resize()[0] == 0
    t.decode_step({layer: [[0, 1]] * 6 for layer in layers})
    t.observe(6, 1)
    for step in range(8):
        t.decode_step({layer: [[0, 1]] for layer in layers})
        t.observe()
        assert bool([text for _, text in t.logs if "re-planned" in text]) == (step == 7)


def test_re_plans_after_the_first_take_the_decode_steps_alone(serving):
    """A prompt's tokens are no independent draws (a token repeated routes alike): the uniform
    Qwen1.5-MoE geometry's prompt read z = 14-23 and its pools were planned on that. The re-plan after
    the prompt plans from its tokens; from zipmoe.replan_tokens decode steps on, the steps alone make
    the profile and say whether the routing is even."""
    s = serving(available=256 * MIB, replan_tokens=8)
    s.make_cache()
    assert s.resize()[0] == 0
    layers = s.zf.moe_layers()
    s.decode_step({layer: [[0, 1]] * 24 for layer in layers})  # one pair, over and over
    s.observe(24, 1)
    for step in range(8):  # every expert twice
        s.decode_step({layer: [[2 * (step % 4), 2 * (step % 4) + 1]] for layer in layers})
        s.observe()
    first, eighth = [text for _, text in s.logs if "re-planned" in text]
    assert "after a prompt of 24 tokens" in first and "against a uniform router's)" in first, first
    assert "planned again after 8 (" in first, first
    assert "after 8 decode steps" in eighth and "against a uniform router's, so planned for the built-in profile" in eighth


def test_a_freed_context_leaves_the_default_pools_as_they_are(serving):
    """A context freed (it detaches before its buffers go) changes no pools: a change writes memory at
    once, which the freed context still holds; the next context made plans for the memory left."""
    available = 256 * MIB
    s = serving(available=available)
    s.make_cache(rate_read=1e6)  # a slow disk: experts kept compressed beat reading them again
    expert, own = s.info().expert_bytes, s.lib.ggml_zipmoe_cache_extra_bytes(s.cache, 1)
    contexts = available - 64 * MIB - available // 32 - own - 16 * expert  # room for 16 experts: C 5, E 1
    assert s.resize(contexts=contexts)[0] == 0
    pools, n = list(s.plan().pools), s.n_slots()
    assert any(pools[1:]), (pools, s.plan().pools_why)  # default pools in use, compressed experts among them
    assert s.resize(contexts=0, n_contexts=0, making=False) == (0, 0)
    assert list(s.plan().pools) == pools and s.n_slots() == n
    status, _ = s.resize(contexts=0, n_contexts=1)  # a context made: planned for all the memory left
    assert status == 0 and (list(s.plan().pools), s.n_slots()) != (pools, n)


def test_a_router_that_keeps_to_its_experts_is_planned_one_f_pool_that_never_misses(serving):
    """The profile is cross-fitted (experts ranked by one half of the steps, their rates read from the
    other): a router that chose experts 0 and 1 at every step has no tail, so one F pool of a few experts
    per layer expects nothing to read. Taking a uniform router's chance excess off the top ranks instead
    gave the never-chosen ranks a share, and one F pool misses on them."""
    available = 256 * MIB
    s = serving(available=available, replan_tokens=8)
    s.make_cache(rate_read=1e6)  # a slow disk: anything one F pool is expected to read weighs
    expert, own = s.info().expert_bytes, s.lib.ggml_zipmoe_cache_extra_bytes(s.cache, 1)
    contexts = available - 64 * MIB - available // 32 - own - 16 * expert  # room for 16 experts of 24
    assert s.resize(contexts=contexts)[0] == 0
    assert any(s.plan().pools[1:]), s.plan().pools_why  # the built-in profile's pools to start with
    layers = s.zf.moe_layers()
    for _ in range(8):
        s.decode_step({layer: [[0, 1]] for layer in layers})
        s.observe()
    [replanned] = [text for _, text in s.logs if "re-planned" in text]
    assert "one F pool: the planner (observed profile" in replanned and "expects 0.00 ms per layer" in replanned, replanned


def test_parallel_sequences_decoding_are_decode_steps_planned_for_their_union(serving):
    s = serving(available=256 * MIB, replan_tokens=3)
    s.make_cache()
    assert s.resize()[0] == 0
    layers = s.zf.moe_layers()
    # two sequences, a token each: the steps count, and the plan is for the union of their selections
    for step in range(3):
        s.decode_step({layer: [[0, 1], [2 + step, 5]] for layer in layers})
        s.observe(2, 2)
    [replanned] = [text for _, text in s.logs if "re-planned" in text]
    assert replanned.startswith("ZipMoE pools re-planned after 3 decode steps (4 experts per MoE layer a step")
    # a step that selects more than k experts per token of it is no decode step (the fetch saw a prompt)
    t = serving(available=256 * MIB, replan_tokens=1)
    t.make_cache()
    assert t.resize()[0] == 0
    t.decode_step({layer: [[0, 1], [2, 3]] for layer in layers})
    t.observe(1, 1)
    assert not [text for _, text in t.logs if "re-planned" in text]


def test_a_null_or_empty_table_is_an_error_not_a_crash(model):
    lib = _lib.lib()
    err = ctypes.create_string_buffer(256)
    assert not lib.ggml_zipmoe_serving_new(None, err, len(err)) and b"no file or no layer table" in err.value
    with zformat.ZipMoEFile(model) as zf:
        table = (ctypes.c_int32 * 3)(-1, -1, -1)
        p = _lib.ServingParams()
        p.file, p.layer_tensors, p.n_layer, p.available = zf._handle, table, 1, 1 << 30
        assert not lib.ggml_zipmoe_serving_new(ctypes.byref(p), err, len(err))
        assert b"no layer has repacked gate, up and down experts" in err.value


def test_host_zero_slots_are_reserved_after_the_slots_and_read_as_zeros(serving):
    """Beside a GPU the host slots' passes may name zero slots after them (a product ggml offloads):
    each kind's reservation holds them, readable, zero, and apart from the next kind's slots."""
    s = serving(budget=64 * 1024)
    s.lib.ggml_zipmoe_serving_set_host_zero_slots(s.handle, 4)
    data, stride = (ctypes.c_void_p * 3)(), (ctypes.c_size_t * 3)()
    assert s.lib.ggml_zipmoe_serving_reserve_host(s.handle, data, stride, s.err, len(s.err)) == 0
    capacity = s.info().capacity
    for k in range(3):
        zero_start = data[k] + capacity * stride[k]
        assert k == 2 or zero_start + 4 * stride[k] <= data[k + 1]
        ctypes.memset(data[k], 0x5A, capacity * stride[k])  # the slots written: the zero slots stay zero
        assert ctypes.string_at(zero_start, 4 * stride[k]) == bytes(4 * stride[k])


def test_pools_given_beyond_the_budget_are_refused_per_layer_as_given(serving):
    s = serving(budget=18 * 1024, pools=(2, 0, 0, 0), work_slots=8, eviction=_lib.EVICT_RANK)
    data, stride = (ctypes.c_void_p * 3)(), (ctypes.c_size_t * 3)()
    assert s.lib.ggml_zipmoe_serving_reserve_host(s.handle, data, stride, s.err, len(s.err)) == 0
    cp = s.cache_params = _lib.CacheParams()
    cp.file, cp.n_slots, cp.eviction = s.zf._handle, s.info().capacity, _lib.EVICT_RANK
    cp.pool_capacity[:] = [2, 0, 0, 0]
    cp.n_layer, cp.layer_tensors = s.params.n_layer, s.table
    cp.slot_data[:], cp.slot_stride[:] = list(data), list(stride)
    s.cache = s.lib.ggml_zipmoe_cache_new(ctypes.byref(cp), s.err, len(s.err))
    assert s.cache, s.error
    assert s.lib.ggml_zipmoe_serving_set_cache(s.handle, s.cache, 0, s.err, len(s.err)) == _lib.ERR_ARG
    assert s.error == ("zipmoe.pool_* and zipmoe.work_slots need 247.3 KiB: F 2 per MoE layer x 3 layers x 17.7 KiB "
                       "= 106.0 KiB, 8 working slots x 17.7 KiB = 141.3 KiB (C, S, E: none), more than "
                       "zipmoe.budget's 18.0 KiB; give a budget of at least 247.3 KiB, or fewer pool experts or "
                       "working slots")



def test_slots_on_an_integrated_gpu_count_only_the_memory_the_process_may_take(serving):
    """A Jetson's GPU memory is the host's: ggml reports all of MemAvailable free there, but the process's
    own limit (here 6.5 experts) bounds the slots; a discrete GPU's free memory is its own."""
    one = serving().info().expert_bytes
    device_free, reserve = 20 * one, one
    discrete = serving(available=int(6.5 * one))
    assert discrete.lib.ggml_zipmoe_serving_fit_device(discrete.handle, b"CUDA0", device_free, reserve, 0) == 19
    assert not any("shares the host's memory" in text for _, text in discrete.logs)
    integrated = serving(available=int(6.5 * one))
    assert integrated.lib.ggml_zipmoe_serving_fit_device(integrated.handle, b"CUDA0", device_free, reserve, 1) == 5
    assert any(level == 0 and "CUDA0 shares the host's memory" in text and "counted (given)" in text
               for level, text in integrated.logs), integrated.logs


def default_pools_at(make, budget: int) -> tuple[list[int], str]:
    """the default pools a context gets under zipmoe.budget = budget (and why)"""
    s = make(budget=budget)
    s.make_cache()
    assert s.resize()[0] == 0, s.error
    return list(s.plan().pools), s.plan().pools_why.decode()


def lowest_budget(make, holds) -> int:
    """the smallest budget short of every expert full whose default pools' reason satisfies holds (monotone in
    the budget), by bisection"""
    info = make().info()
    lo, hi = 0, info.expert_bytes * info.max_expert * info.n_moe_layers - 1
    assert holds(default_pools_at(make, hi)[1])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(default_pools_at(make, mid)[1]) else (mid, hi)
    return hi


def test_short_of_every_compressed_expert_each_is_kept_compressed_in_c_or_as_its_e_chunks(serving):
    k = 2
    inclusive = lowest_budget(serving, lambda why: why.startswith("every compressed expert fits"))
    assert default_pools_at(serving, inclusive)[0][1] == N_EXPERT
    # a byte less: C keeps all but one expert per layer, E the E-chunks of that one: nothing is missed
    pools, why = default_pools_at(serving, inclusive - 1)
    assert pools == [0, N_EXPERT - 1, 0, 1]
    assert why.startswith("every expert kept compressed: C holds 7 per layer, E the E-chunks of the other 1")
    # down to k experts per layer left to E (a token reads at most k SM-chunks a layer); below, the planner
    kept = lowest_budget(serving, lambda why: why.startswith(("every expert kept compressed", "every compressed")))
    assert default_pools_at(serving, kept)[0] == [0, N_EXPERT - k, 0, k]
    pools, why = default_pools_at(serving, kept - 1)
    assert not why.startswith("every expert kept compressed") and pools != [0, N_EXPERT - k - 1, 0, k + 1]


def test_a_change_declined_for_its_cost_is_planned_again_where_it_would_repay(serving):
    """A re-plan that declines a change only because it would not repay within the steps seen plans again
    once they reach the steps it would repay in (a ski rental's break-even), not at twice them; the
    change, from every expert in C, then decodes the experts F takes from their C entries. Slots that take
    no store pages: the new slots' first writes are part of the cost, and with a fast decode (given) they
    are most of it."""
    inclusive = lowest_budget(serving, lambda why: why.startswith("every compressed expert fits"))
    s = serving(budget=inclusive, replan_tokens=4)
    s.make_cache(rate_read=1e9, rate_decode=1e10, movable_pages=False)  # given rates (touch: the default)
    assert s.resize()[0] == 0 and s.plan().pools[1] == N_EXPERT
    layers = s.zf.moe_layers()
    for step in range(12):
        s.decode_step({layer: [[0, 1]] if step % 2 == 0 else [[0, 2]] for layer in layers})
        s.observe()
    first, second = [text for _, text in s.logs if "re-planned" in text][:2]
    assert first.startswith("ZipMoE pools re-planned after 4 decode steps") and "): kept, the change to F " in first
    repaid = int(first.split("repaid in ")[1].split()[0])  # rounded up
    again = int(first.split("planned again after ")[1].split()[0])
    # at the steps it repays in: at least an eighth more than seen (one, here), at most twice
    assert 4 < repaid < 8 and again == max(repaid, 5), first
    assert second.startswith(f"ZipMoE pools re-planned after {again} decode steps") and "kept" not in second, second
    moved = int(second.split(" experts moved from C/S to F")[0].rsplit(" ", 1)[1])
    assert moved > 0 and "ms per layer with the pools before" in second, second


@pytest.mark.parametrize("routing,even", [("every expert in turn", True), ("experts 0 and 1 only", False)])
def test_routing_as_even_as_a_uniform_routers_is_planned_for_the_built_in_profile(serving, routing, even):
    s = serving(available=256 * MIB, replan_tokens=4)
    s.make_cache()
    assert s.resize()[0] == 0
    layers = s.zf.moe_layers()
    for step in range(4):
        pair = [2 * step, 2 * step + 1] if even else [0, 1]
        s.decode_step({layer: [pair] for layer in layers})
        s.observe()
    [replanned] = [text for _, text in s.logs if "re-planned" in text]
    z = float(replanned.split("routing z = ")[1].split()[0])
    # every expert chosen exactly once: z is as low as it goes; one pair always: far beyond the 3 of noise
    assert (z < 0) if even else (z > 3)
    assert ("so planned for the built-in profile" in replanned) == even


def _prompt_replan(serving, selections, tokens, chunks=1):
    """the re-plan after one sequence's prompt (its selections, the same at every layer) told in `chunks`
    ubatches with its token ids (None: told none), the last of them reaching zipmoe.replan_tokens; its log
    line"""
    s = serving(available=256 * MIB, replan_tokens=len(selections))
    s.make_cache()
    assert s.resize()[0] == 0
    layers = s.zf.moe_layers()
    bounds = np.linspace(0, len(selections), chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:]):
        s.decode_step({layer: selections[a:b] for layer in layers})
        s.observe(int(b - a), 1, None if tokens is None else tokens[a:b])
    [replanned] = [text for _, text in s.logs if "re-planned" in text]
    return replanned


def test_a_prompts_repeated_tokens_are_discounted_before_its_routing_is_called_uneven(serving):
    """A token repeated routes alike, so a prompt's counts are clusters, not independent draws: the 77-token
    bench prompt (each token 2.09 times on average) read z = 28.7 on DeepSeek-V2-Lite's uniform router, and
    pools planned on that decoded 1.2 times slower than the built-in profile's. The re-plan after a prompt
    divides the chi-square by the tokens' mean multiplicity (sum of m^2 over the tokens)."""
    # one token ten times choosing experts 0 and 1, six others one pair each: uneven counts, but from seven
    # distinct tokens, as even as a uniform router's could be
    pairs = [[0, 1]] * 10 + [[2, 3], [4, 5], [6, 7], [2, 4], [3, 5], [6, 7]]
    tokens = [7] * 10 + [11, 12, 13, 14, 15, 16]
    order = np.random.default_rng(0).permutation(len(pairs))
    pairs, tokens = [pairs[i] for i in order], [tokens[i] for i in order]
    told = _prompt_replan(serving, pairs, tokens)
    z = float(told.split("routing z = ")[1].split()[0])
    effect = (10 * 10 + 6) / 16
    assert f"with the prompt's repeated tokens discounted (design effect {effect:.2f}) against a uniform " \
           "router's, so planned for the built-in profile" in told and z < 3, told
    # the same counts told no token ids (a prompt of embeddings): independent draws, uneven
    untold = _prompt_replan(serving, pairs, None)
    z_untold = float(untold.split("routing z = ")[1].split()[0])
    assert "design effect" not in untold and "so planned for the built-in profile" not in untold and z_untold > 3
    # distinct tokens throughout: nothing discounted, the same z as told none
    distinct = _prompt_replan(serving, pairs, list(range(100, 116)))
    assert "design effect" not in distinct and distinct.split("routing z = ")[1].split()[0] == f"{z_untold:.1f}"


def test_the_design_effect_counts_every_ubatch_of_a_long_prompt(serving):
    """A prompt of 600 tokens over three ubatches, 300 ids twice each, re-planned at the third (the table of
    ids grows past its first 256 cells): a design effect of exactly 2. Several sequences in a ubatch end the counting (no
    re-plan after a prompt then), and a decode step's re-plan discounts nothing."""
    pairs = [[(2 * t) % N_EXPERT, (2 * t + 1) % N_EXPERT] for t in range(600)]
    told = _prompt_replan(serving, pairs, [t % 300 for t in range(600)], chunks=3)
    assert told.startswith("ZipMoE pools re-planned after a prompt of 600 tokens") and "(design effect 2.00)" in told
    s = serving(available=256 * MIB, replan_tokens=4)
    s.make_cache()
    assert s.resize()[0] == 0
    layers = s.zf.moe_layers()
    s.decode_step({layer: [[0, 1], [0, 1]] for layer in layers})
    s.observe(2, 2, [5, 5])  # two sequences' prompts of one token each
    for step in range(4):
        s.decode_step({layer: [[0, 1]] for layer in layers})
        s.observe(1, 1, [5])
    [replanned] = [text for _, text in s.logs if "re-planned" in text]
    assert replanned.startswith("ZipMoE pools re-planned after 4 decode steps (") and "design effect" not in replanned
