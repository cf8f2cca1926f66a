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


def test_smoe_replaces_experts_counts_them_and_reads_less(zipmoe_gguf, reference):
    arch = "qwen2moe"  # the lossy path's behaviour; both architectures' exactness is tested above
    path = zipmoe_gguf(arch)
    budget = budget_of(path, arch, "half")
    want, _ = reference(arch, 1)
    runs = {}
    for alpha in (None, 1.0):
        options = {} if alpha is None else {"zipmoe_substitution": "smoe", "zipmoe_smoe_alpha": alpha}
        # one F pool: the slots alone decide what is read, not pools (re)planned on rates measured in the run
        llm = load(path, zipmoe_budget=budget, zipmoe_auto_pools=False, **options)
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
    with pytest.raises(ZipMoEError, match="zipmoe_substitution must be one of none, smoe, buddy"):
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


# --- BuddyMoE -------------------------------------------------------------------------------------

def buddy_params(**changes):
    p = _lib.lib().ggml_zipmoe_buddy_default_params()
    for name, value in changes.items():
        setattr(p, name, value)
    return p


def buddy_route(scores, ids, resident, lists, layer_tau=0.0, **changes):
    """ggml_zipmoe_buddy_route on numpy arrays and buddy lists [[buddy, q], ...] per expert."""
    scores = np.ascontiguousarray(scores, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    resident = np.ascontiguousarray(resident, dtype=np.uint8)
    k_max = max(1, max((len(b) for b in lists), default=1))
    table = np.full((len(lists), k_max), -1, dtype=np.int32)
    q = np.zeros((len(lists), k_max), dtype=np.float32)
    for i, entries in enumerate(lists):
        for r, (b, v) in enumerate(entries):
            table[i, r], q[i, r] = b, v
    out = np.full_like(ids, -7)
    replaced = ctypes.c_int64(-1)
    params = buddy_params(**changes)
    status = _lib.lib().ggml_zipmoe_buddy_route(
        scores.ctypes.data, scores.shape[1], scores.shape[1], ids.ctypes.data, ids.shape[1], ids.shape[0],
        ids.shape[1], resident.ctypes.data, table.ctypes.data, q.ctypes.data, k_max, ctypes.c_float(layer_tau),
        ctypes.byref(params), out.ctypes.data, ctypes.byref(replaced))
    return out, replaced.value, status


def reference_buddy_route(scores, ids, resident, lists, tau, p):
    """BuddyMoE's gates (eqs. 1-3) and Alg. 1, written from the paper independently of the C."""
    scores = np.asarray(scores, dtype=np.float32).astype(np.float64)
    out = np.array(ids, dtype=np.int32)
    n_tokens, k = out.shape
    if p.rho == 0 or p.search == 0:
        return out, 0
    requested = set(out.ravel().tolist())
    missing = [e for e in requested if not resident[e]]
    if not missing or len(missing) / len(requested) >= np.float32(p.beta):
        return out, 0
    gate_tau = np.float32(p.tau) if p.tau >= 0 else np.float32(tau)
    replaced = 0
    for t in range(n_tokens):
        chosen = np.maximum(scores[t, out[t]], 0) ** (1.0 / float(np.float32(p.temperature)))
        if chosen.sum() <= 0:
            continue
        w = chosen / chosen.sum()
        tae = 0.0 if k < 2 else min(1.0, max(0.0, -sum(v * np.log(v) for v in w if v > 0) / np.log(k)))
        if not tae > gate_tau:
            continue
        top = sorted(w, reverse=True)
        if k > 1 and top[0] - top[1] >= np.float32(p.gamma):
            continue
        logs = np.log(np.where(scores[t] > 0, scores[t], 1e-30))
        sd = logs.std() if logs.std() > 0 else 1.0
        used, done = set(out[t].tolist()), 0
        for i in range(k):
            if done >= p.rho:
                break
            e = out[t, i]
            if resident[e]:
                continue
            candidates = [(b, v) for b, v in lists[e][:p.search] if resident[b] and b not in used]
            if not candidates:
                continue
            if p.eta == 0:
                best = candidates[0][0]
            else:
                psis = [v * (1 + float(np.float32(p.eta)) * (logs[b] - logs.mean()) / sd) for b, v in candidates]
                best = candidates[int(np.argmax(psis))][0]
            out[t, i] = best
            used.add(best)
            done += 1
        replaced += done
    return out, replaced


def test_buddy_route_replaces_a_missing_expert_with_its_first_resident_buddy():
    scores = [[0.3, 0.3, 0.3, 0.05, 0.05]]  # k = 3: an even split, TAE 1
    ids = [[0, 1, 2]]
    lists = [[(3, 0.5), (4, 0.3)], [(4, 0.6), (3, 0.2)], [], [], []]
    both = [0, 0, 1, 1, 1]  # 0 and 1 missing: 2 / 3 of the requested experts
    out, n, status = buddy_route(scores, ids, both, lists)
    assert status == 0 and n == 2 and out.tolist() == [[3, 4, 2]]
    # 3 is not resident: 0 takes its next buddy, 4; then 1's buddy 4 is taken (no duplicate) and 3 is missing
    out, n, _ = buddy_route(scores, ids, [0, 0, 1, 0, 1], lists)
    assert out.tolist() == [[4, 1, 2]] and n == 1
    # the budget rho, the TAE gate, the search limit H and the distribution gate beta
    assert buddy_route(scores, ids, both, lists, rho=1)[0].tolist() == [[3, 1, 2]]
    assert buddy_route(scores, ids, both, lists, rho=0)[1] == 0
    assert buddy_route(scores, ids, both, lists, layer_tau=1.0)[1] == 0  # the TAE gate at the layer's tau
    assert buddy_route(scores, ids, [0, 0, 1, 0, 1], lists, search=1)[0].tolist() == [[0, 4, 2]]
    assert buddy_route(scores, ids, both, lists, beta=0.7)[1] == 2
    assert buddy_route(scores, ids, both, lists, beta=0.6)[1] == 0
    assert buddy_route(scores, [[0, 1, 3]], [0, 0, 0, 0, 1], lists)[1] == 0  # every requested expert missing, beta 1
    # a peaky token (TAE about 0.31) is refused by the margin gate, and by the TAE gate above it
    peaky = [[0.9, 0.05, 0.03, 0.01, 0.01]]
    assert buddy_route(peaky, ids, both, lists, gamma=0.5)[1] == 0
    assert buddy_route(peaky, ids, both, lists, layer_tau=0.5)[1] == 0
    assert buddy_route(peaky, ids, both, lists, layer_tau=0.1)[1] == 2
    # a tau given overrides the layer's calibrated one (params' tau -1)
    assert buddy_route(peaky, ids, both, lists, layer_tau=0.5, tau=0.1)[1] == 2


@pytest.mark.parametrize("eta", [0.0, 0.5])
def test_buddy_route_matches_the_algorithm_on_random_batches(eta):
    rng = np.random.default_rng(11)
    total = 0
    for trial in range(300):
        n_expert = int(rng.integers(3, 40))
        k = int(rng.integers(1, min(8, n_expert) + 1))
        n_tokens = int(rng.integers(1, 6))
        logits = rng.normal(scale=float(rng.choice([0.3, 1.0, 3.0])), size=(n_tokens, n_expert))
        scores = (np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)).astype(np.float32)
        ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        resident = rng.random(n_expert) < float(rng.choice([0.2, 0.5, 0.8]))
        lists = []
        for i in range(n_expert):
            peers = [j for j in rng.permutation(n_expert).tolist() if j != i][:int(rng.integers(0, 8))]
            lists.append([(j, float(np.float32(rng.random()))) for j in peers])
        changes = dict(rho=int(rng.integers(0, 4)), search=int(rng.integers(0, 10)), eta=eta,
                       beta=float(rng.choice([0.3, 0.7, 1.0])), gamma=float(rng.choice([0.3, 1.0])),
                       temperature=float(rng.choice([0.8, 1.0, 1.2])), tau=float(rng.choice([-1.0, 0.2, 0.6])))
        tau = float(rng.choice([0.1, 0.5]))
        out, n, status = buddy_route(scores, ids, resident, lists, layer_tau=tau, **changes)
        want, want_n = reference_buddy_route(scores, ids, resident, lists, tau, buddy_params(**changes))
        assert status == 0
        assert n == want_n and (out == want).all(), (trial, out, want)
        for t in range(n_tokens):
            assert len(set(out[t].tolist())) == k
            assert all(resident[e] or e == ids[t, i] for i, e in enumerate(out[t]))  # substitutes are resident
        total += n
    assert total > 50


def test_buddy_tae_is_the_normalized_entropy_of_the_chosen_scores():
    tae = _lib.lib().ggml_zipmoe_buddy_tae
    even = np.array([0.2, 0.2, 0.2], dtype=np.float32)
    assert tae(even.ctypes.data, 3, 1.0) == pytest.approx(1.0)
    skewed = np.array([0.7, 0.2, 0.1], dtype=np.float32)
    w = skewed / skewed.sum()
    assert tae(skewed.ctypes.data, 3, 1.0) == pytest.approx(-(w * np.log(w)).sum() / np.log(3), rel=1e-6)
    assert tae(skewed.ctypes.data, 3, 2.0) > tae(skewed.ctypes.data, 3, 1.0)  # a higher T flattens
    assert tae(skewed.ctypes.data, 1, 1.0) == 0.0


def test_buddy_lists_follow_the_cumulative_frequency_threshold():
    from zipmoe_py.buddies import buddy_lists, recall, tae_percentile

    m = np.array([[0, 6, 3, 1], [6, 0, 1, 1], [3, 1, 0, 0], [1, 1, 0, 0]], dtype=float)
    lists, qs = buddy_lists(m, np.array([5, 4, 2, 0]), cft=0.85, k_max=8, smoothing=0.0)
    assert lists[0] == [1, 2] and qs[0] == [6 / 10, 3 / 10]  # 0.6 < 0.85 <= 0.9
    assert lists[1] == [0, 2]  # q 0.75, then 2 before 3 on the tie
    assert lists[3] == []  # never chosen: no evidence, no list
    lists, _ = buddy_lists(m, np.array([5, 4, 2, 0]), cft=1.0, k_max=1, smoothing=0.0)
    assert [len(b) for b in lists] == [1, 1, 1, 0]  # K_max caps, every active expert keeps one
    assert recall(m, [[1], [0], [0], []]) == pytest.approx((6 + 6 + 3) / m.sum())
    hist = np.zeros(1000, dtype=np.uint64)
    hist[[100, 500, 900]] = [10, 80, 10]
    assert tae_percentile(hist, 10) == pytest.approx(0.101)
    assert tae_percentile(hist, 50) == pytest.approx(0.501)


@pytest.fixture(scope="module")
def buddy_profile(zipmoe_gguf, tmp_path_factory):
    from zipmoe_py.buddies import make_profile

    path = zipmoe_gguf("qwen2moe")
    text = " ".join(PROMPTS) * 12
    doc = make_profile(path, text, heldout=" ".join(reversed(PROMPTS)) * 4, threads=2, n_ctx=128)
    out = tmp_path_factory.mktemp("buddies") / "qwen2moe.buddies.json"
    import json
    out.write_text(json.dumps(doc))
    return path, out, doc


def test_the_routing_trace_counts_every_token_and_pair(buddy_profile):
    from zipmoe_py import Llama
    from zipmoe_py.buddies import _trace

    path, _, doc = buddy_profile
    traces, n_tokens = _trace(path, [" ".join(PROMPTS) * 3], 1.0, 0, 2, 64)
    for layer, tr in traces.items():
        assert tr["tokens"] == n_tokens > 0
        assert tr["activations"].sum() == n_tokens * 4  # top-4, counted per token
        assert (tr["coact"] == tr["coact"].T).all() and np.diag(tr["coact"]).sum() == 0
        assert np.allclose(tr["coact"].sum(axis=1), tr["activations"] * 3)  # each choice pairs with the 3 others
        assert (tr["coact_weighted"] <= tr["coact"]).all() and tr["coact_weighted"].sum() > 0
        assert tr["tae_hist"].sum() == n_tokens
    assert set(doc["layers"]) == {str(layer) for layer in traces}
    assert doc["heldout"]["recall"] is not None and 0 < doc["heldout"]["recall"] <= 1
    del Llama


def test_buddy_with_rho_zero_or_tau_one_is_bit_identical_and_on_it_replaces(buddy_profile, reference):
    path, profile, _ = buddy_profile
    want, want_tokens = reference("qwen2moe", 1)
    budget = budget_of(path, "qwen2moe", "half")
    for params in ({"zipmoe_buddy_rho": 0}, {"zipmoe_buddy_tau": 1.0}):
        llm = load(path, zipmoe_budget=budget, zipmoe_substitution="buddy", zipmoe_buddy_profile=str(profile), **params)
        try:
            got, got_tokens = logits_trace(llm, PROMPTS[:1])
            stats = llm.zipmoe_stats()
        finally:
            llm.close()
        assert np.array_equal(got, want) and got_tokens == want_tokens, params
        assert stats["substitutions"] == 0 and stats["substitution_tokens"] > 0
    llm = load(path, zipmoe_budget=budget, zipmoe_substitution="buddy", zipmoe_buddy_profile=str(profile),
               zipmoe_buddy_tau=0.0)
    try:
        got, _ = logits_trace(llm, PROMPTS[:1])
        stats = llm.zipmoe_stats()
    finally:
        llm.close()
    assert stats["substitution"]["policy"] == "buddy" and stats["substitution"]["lossy"] is True
    assert stats["substitutions"] > 0 and not np.array_equal(got, want)


def test_buddy_profiles_are_checked_against_their_model(buddy_profile, zipmoe_gguf, tmp_path):
    import json

    path, profile, doc = buddy_profile
    other = zipmoe_gguf("deepseek2")
    with pytest.raises(ZipMoEError, match="was made for model 'qwen2moe.zipmoe.gguf'.*not deepseek2.zipmoe.gguf"):
        load(other, zipmoe_substitution="buddy", zipmoe_buddy_profile=str(profile))
    with pytest.raises(ZipMoEError, match="needs zipmoe_buddy_profile"):
        load(path, zipmoe_substitution="buddy")
    with pytest.raises(ZipMoEError, match="zipmoe_buddy_rho must be a whole number of replacements per token from 0 to 64"):
        load(path, zipmoe_substitution="buddy", zipmoe_buddy_profile=str(profile), zipmoe_buddy_rho=1.5)
    bad = dict(doc)
    bad["layers"] = {**doc["layers"], "0": {**doc["layers"]["0"], "buddies": [[99]] * 16}}
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(bad))
    with pytest.raises(ZipMoEError, match="layer 0 is malformed"):
        load(path, zipmoe_substitution="buddy", zipmoe_buddy_profile=str(broken))
    broken.write_text("{")
    with pytest.raises(ZipMoEError, match="is not JSON"):
        load(path, zipmoe_substitution="buddy", zipmoe_buddy_profile=str(broken))
    broken.write_text(json.dumps({"format": "zipmoe-plan"}))
    with pytest.raises(ZipMoEError, match="is not a buddy profile"):
        load(path, zipmoe_substitution="buddy", zipmoe_buddy_profile=str(broken))


def test_buddy_profiles_take_an_alpha_per_layer(zipmoe_gguf):
    from zipmoe_py.buddies import make_profile

    path = zipmoe_gguf("qwen2moe")
    doc = make_profile(path, " ".join(PROMPTS) * 6, cft=[0.3, 1.0, 1.0, 1.0], threads=2, n_ctx=128)
    sizes = {layer: entry["list_size"]["mean"] for layer, entry in doc["layers"].items()}
    assert doc["layers"]["0"]["cft"] == 0.3 and sizes["0"] < sizes["1"]
    with pytest.raises(ZipMoEError, match="--cft gives 2 values for the model's 4 MoE layers"):
        make_profile(path, "text", cft=[0.5, 0.5])


def test_zipmoe_buddies_help_says_the_profile_goes_to_the_output_file():
    from zipmoe_py.buddies import build_parser

    ap = build_parser()
    text = " ".join(ap.format_help().split())
    assert "beside the model" not in text
    assert "written to the JSON file -o names" in text and "-o PROFILE.json, --output PROFILE.json" in text
    with pytest.raises(SystemExit) as exit_:  # -o is required
        ap.parse_args(["model.gguf", "--text", "calib.txt"])
    assert exit_.value.code == 2


def test_zipmoe_buddies_refuses_an_empty_text_naming_it(zipmoe_gguf, tmp_path, capsys):
    from zipmoe_py.buddies import main

    model = zipmoe_gguf("qwen2moe")
    out = tmp_path / "buddies.json"
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(PROMPTS))
    for args, named in ((["--text", "/dev/null"], "the calibration text (/dev/null) is empty"),
                        (["--text", str(empty)], f"the calibration text ({empty}) is empty"),
                        (["--text", str(calib), "--heldout", str(empty)], f"the held-out text ({empty}) is empty")):
        assert main([str(model), *args, "-o", str(out)]) == 1, args
        err = capsys.readouterr().err
        assert err.startswith("zipmoe-buddies: error: ") and named in err, err
        assert "traced" not in err and not out.exists()  # refused before the model runs
    with pytest.raises(SystemExit) as exit_:  # no calibration token at all
        main([str(model), "--text", str(calib), "--max-tokens", "0", "-o", str(out)])
    assert exit_.value.code == 2 and "--max-tokens must be >= 1" in capsys.readouterr().err


def test_zipmoe_buddies_refuses_a_text_that_routes_no_token(tmp_path, capsys, monkeypatch):
    """A text that yields no routed token (too short, or all of it tokenizing to nothing) gives no buddy
    lists and no tau: refused naming the text, calibration and held-out alike, and no profile written."""
    from zipmoe_py import buddies

    def trace_of(n_tokens):
        def trace(model, texts, temperature, warmup, threads, n_ctx):
            n = 4
            layer = {"activations": np.zeros(n) + n_tokens, "coact": np.ones((n, n)) - np.eye(n),
                     "coact_weighted": np.ones((n, n)) - np.eye(n), "tae_hist": np.zeros(_lib.TAE_BINS, np.uint64),
                     "tokens": n_tokens}
            return {0: layer, 1: dict(layer)}, n_tokens
        return trace

    monkeypatch.setattr(buddies, "_trace", trace_of(0))
    with pytest.raises(ZipMoEError, match=r"the calibration text \(calib\.txt\) gives 0 tokens and no token was "
                                          r"routed: it is too short to route any token"):
        buddies.make_profile(tmp_path / "model.gguf", "x", text_name="calib.txt")
    calib = tmp_path / "calib.txt"
    calib.write_text("\u200b")
    out = tmp_path / "buddies.json"
    assert buddies.main([str(tmp_path / "model.gguf"), "--text", str(calib), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"the calibration text ({calib}) gives 0 tokens" in err and not out.exists()

    calls = []

    def calibration_routes_heldout_does_not(*args):
        calls.append(args)
        return trace_of(3 if len(calls) == 1 else 0)(*args)

    monkeypatch.setattr(buddies, "_trace", calibration_routes_heldout_does_not)
    with pytest.raises(ZipMoEError, match=r"the held-out text \(held\.txt\) gives 0 tokens"):
        buddies.make_profile(tmp_path / "model.gguf", "some text", heldout="y", text_name="calib.txt",
                             heldout_name="held.txt")
