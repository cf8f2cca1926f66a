"""Expert substitution (opt-in, LOSSY): SMoE's expert-cache router (SMoE Alg. 1 with its batch-aware
choice, 5.4) and the hook in the fetch path that applies it.

- ggml_zipmoe_smoe_route against an independent transcription of the algorithm, on hand-made cases
  and on random ones;
- the hook in the graph: off by default and at alpha 0 the logits are bit-identical to the BF16 GGUF;
  on, it replaces experts (the logits change), counts them, and labels them lossy;
- its options are checked, naming the option at fault.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from zipmoe_py import ZipMoEError, _lib

from test_serve import PROMPTS, budget_of, load, logits_trace, reference  # noqa: F401 (fixture)

ERR_ARG = -1


def route(scores, ids, resident, alpha, batch_aware=True):
    """ggml_zipmoe_smoe_route on numpy arrays: (new ids, replaced count, status)."""
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    resident = np.ascontiguousarray(resident, dtype=np.uint8)
    out = np.full_like(ids, -7)
    replaced = ctypes.c_int64(-1)
    status = _lib.lib().ggml_zipmoe_smoe_route(
        scores.ctypes.data, scores.shape[1], scores.shape[1], ids.ctypes.data, ids.shape[1], ids.shape[0],
        ids.shape[1], resident.ctypes.data, ctypes.c_float(alpha), int(batch_aware), out.ctypes.data,
        ctypes.byref(replaced))
    return out, replaced.value, status


def reference_route(scores, ids, resident, alpha, batch_aware=True):
    """SMoE's expert-cache router, written from the paper's text (5.1, 5.4) independently of the C."""
    scores = np.asarray(scores, dtype=np.float32).astype(np.float64)
    out = np.array(ids, dtype=np.int32)
    n_tokens, k = out.shape
    n_expert = scores.shape[1]
    if alpha == 0 or k >= n_expert:
        return out, 0
    beta = [sorted(scores[t], reverse=True)[k] for t in range(n_tokens)]
    top = {int(e) for t in range(n_tokens) for e in out[t] if scores[t, e] > (1 + alpha) * beta[t]}
    users = np.zeros(n_expert, dtype=int)
    for t in range(n_tokens):
        for e in out[t]:
            users[e] += 1
    replaced = 0
    for t in range(n_tokens):
        row = list(out[t])
        low = [(scores[t, e], -i, i) for i, e in enumerate(row)
               if not scores[t, e] > (1 + alpha) * beta[t] and not resident[e] and e not in top]
        alts = [(-(users[e] if batch_aware else 0), -scores[t, e], e) for e in range(n_expert)
                if e not in row and (1 - alpha) * beta[t] <= scores[t, e] < beta[t]
                and (resident[e] or e in top or (batch_aware and users[e] > 0))]
        low.sort()
        alts.sort()
        for (_, _, i), (_, _, e) in zip(low, alts):
            out[t, i] = e
            replaced += 1
    return out, replaced


def test_smoe_route_replaces_a_low_score_miss_with_a_resident_alternative():
    # k = 2; beta (the 3rd score) 0.20: top-score above 0.22 at alpha 0.1, alternatives in [0.18, 0.20)
    scores = [[0.30, 0.21, 0.20, 0.19, 0.05, 0.05]]
    ids = [[0, 1]]
    resident = [0, 0, 0, 1, 0, 0]
    out, replaced, status = route(scores, ids, resident, 0.1)
    assert status == 0 and replaced == 1
    assert out.tolist() == [[0, 3]]  # 1 (low-score, missing) -> 3 (resident, in range); 0 is top-score
    # the same low-score expert is kept when it is resident itself
    out, replaced, _ = route(scores, ids, [0, 1, 0, 1, 0, 0], 0.1)
    assert out.tolist() == [[0, 1]] and replaced == 0
    # no alternative in [(1 - alpha) beta, beta): 3 is resident but scores below 0.18 at alpha 0.01
    out, replaced, _ = route(scores, ids, resident, 0.01)
    assert out.tolist() == [[0, 1]] and replaced == 0
    # a larger alpha makes 0 low-score too (0.30 < 1.6 * 0.2) and admits 4 (0.05 >= 0.4 * 0.2 fails: no)
    out, replaced, _ = route(scores, ids, [0, 0, 0, 1, 1, 0], 0.6)
    assert replaced == 1 and sorted(out[0].tolist()) == [0, 3]  # the lower of 0 and 1 (1) gives way


def test_smoe_route_alpha_zero_and_dense_routing_change_nothing():
    rng = np.random.default_rng(1)
    scores = rng.random((9, 16), dtype=np.float32)
    ids = np.argsort(-scores, axis=1)[:, :4]
    out, replaced, status = route(scores, ids, np.ones(16), 0.0)
    assert status == 0 and replaced == 0 and (out == ids).all()
    out, replaced, _ = route(scores[:, :4], ids % 4, np.ones(4), 1.0)  # k == n_expert: nothing else to use
    assert replaced == 0 and (out == ids % 4).all()


def test_smoe_route_prefers_alternatives_the_batch_already_uses():
    # token 0 keeps its low-score 5 (no alternative in range), so 5 is read for it anyway; token 1's
    # low-score 2 may become resident 4 (the higher score) or 5 (chosen by token 0)
    scores = [[0.40, 0.05, 0.05, 0.05, 0.05, 0.10, 0.095],
              [0.40, 0.05, 0.21, 0.20, 0.19, 0.185, 0.01]]
    ids = [[0, 5], [0, 2]]
    resident = [1, 0, 0, 0, 1, 0, 0]
    out, replaced, _ = route(scores, ids, resident, 0.2, batch_aware=True)
    assert out.tolist() == [[0, 5], [0, 5]] and replaced == 1
    out, replaced, _ = route(scores, ids, resident, 0.2, batch_aware=False)
    assert out.tolist() == [[0, 5], [0, 4]] and replaced == 1  # Alg. 1 alone: resident or top-score only


@pytest.mark.parametrize("batch_aware", [True, False])
def test_smoe_route_matches_the_algorithm_on_random_batches(batch_aware):
    rng = np.random.default_rng(7)
    total = 0
    for trial in range(300):
        n_expert = int(rng.integers(3, 40))
        k = int(rng.integers(1, min(8, n_expert) + 1))
        n_tokens = int(rng.integers(1, 6))
        logits = rng.normal(size=(n_tokens, n_expert)).astype(np.float32)
        if trial % 5 == 0:
            logits = np.round(logits, 1)  # ties
        scores = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        resident = rng.random(n_expert) < 0.4
        alpha = float(rng.choice([0.0, 0.05, 0.2, 0.5, 1.0]))
        out, replaced, status = route(scores, ids, resident, alpha, batch_aware)
        want, want_replaced = reference_route(scores, ids, resident, alpha, batch_aware)
        assert status == 0
        assert replaced == want_replaced, trial
        assert (out == want).all(), (trial, out, want)
        for t in range(n_tokens):
            assert len(set(out[t].tolist())) == k  # never a duplicate within a token
        total += replaced
    assert total > 50  # the cases exercised substitution


def test_smoe_route_refuses_bad_arguments():
    scores = np.full((1, 4), 0.25, dtype=np.float32)
    assert route(scores, [[0, 1]], [0] * 4, 1.5)[2] == ERR_ARG
    assert route(scores, [[0, 1]], [0] * 4, -0.1)[2] == ERR_ARG
    assert route(scores, [[0, 4]], [0] * 4, 0.1)[2] == ERR_ARG  # id out of range
    assert route(scores, [[0, -1]], [0] * 4, 0.1)[2] == ERR_ARG


def test_substitution_is_off_by_default_and_alpha_zero_is_bit_identical(arch, zipmoe_gguf, reference):
    path = zipmoe_gguf(arch)
    budget = budget_of(path, arch, "top-k")
    want, want_tokens = reference(arch, 1)
    for options in ({}, {"zipmoe_substitution": "smoe", "zipmoe_smoe_alpha": 0.0}):
        llm = load(path, zipmoe_budget=budget, **options)
        try:
            got, got_tokens = logits_trace(llm, PROMPTS[:1])
            stats = llm.zipmoe_stats()
        finally:
            llm.close()
        assert got_tokens == want_tokens
        assert np.array_equal(got, want), f"{arch} {options}: logits differ"
        assert stats["substitutions"] == 0
        if options:
            assert stats["substitution"]["policy"] == "smoe" and stats["substitution"]["lossy"] is True
            assert stats["substitution_tokens"] > 0  # the hook ran, and replaced nothing
        else:
            assert stats["substitution"] == {"policy": "none", "lossy": False}
            assert stats["substitution_tokens"] == 0


def test_smoe_replaces_experts_counts_them_and_reads_less(arch, zipmoe_gguf, reference):
    path = zipmoe_gguf(arch)
    budget = budget_of(path, arch, "half")
    want, _ = reference(arch, 1)
    runs = {}
    for alpha in (None, 1.0):
        options = {} if alpha is None else {"zipmoe_substitution": "smoe", "zipmoe_smoe_alpha": alpha}
        llm = load(path, zipmoe_budget=budget, **options)
        try:
            got, _ = logits_trace(llm, PROMPTS[:1])
            runs[alpha] = (got, llm.zipmoe_stats())
        finally:
            llm.close()
    exact, lossless = runs[None]
    lossy_logits, lossy = runs[1.0]
    assert np.array_equal(exact, want)
    assert lossy["substitutions"] > 0 and lossy["substitution"]["per_token"] > 0
    assert not np.array_equal(lossy_logits, want)  # lossy: the replaced experts change the output
    assert lossy["expert_misses"] < lossless["expert_misses"]


def test_substitution_options_name_what_is_wrong(zipmoe_gguf, monkeypatch):
    path = zipmoe_gguf("qwen2moe")
    with pytest.raises(ZipMoEError, match="zipmoe_substitution must be one of none, smoe"):
        load(path, zipmoe_substitution="buddy-ish")
    with pytest.raises(ZipMoEError, match="zipmoe_smoe_alpha must be a number from 0 to 1"):
        load(path, zipmoe_substitution="smoe", zipmoe_smoe_alpha=1.5)
    with pytest.raises(ZipMoEError, match="needs|give it with"):
        load(path, zipmoe_substitution="none", zipmoe_smoe_alpha=0.2)
    # from the environment, checked by the loader (the error names the variable)
    monkeypatch.setenv("ZIPMOE_SMOE_ALPHA", "lots")
    monkeypatch.setenv("ZIPMOE_SUBSTITUTION", "smoe")
    with pytest.raises(ValueError):
        load(path)
    monkeypatch.setenv("ZIPMOE_SMOE_ALPHA", "0.3")
    monkeypatch.delenv("ZIPMOE_SUBSTITUTION")
    with pytest.raises(ValueError):
        load(path)
