"""On-demand expert serving: logits bit-identical to the BF16 GGUF the ZipMoE GGUF was made from.

Every logit of every position (prefill and 32 greedy decode steps; one sequence and four
parallel ones) is compared as raw float32 bits, at expert-cache budgets from one layer's top-k
experts (several passes per layer when a ubatch selects more experts than there are slots)
through everything-fits.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

from zipmoe_py import ZipMoEError, _paths
from zipmoe_py import format as zformat

from conftest import run

N_DECODE = 32
THREADS = 2
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Mixture of experts models route each token",
           "1 2 3 4 5 6 7 8 9 10 11 12"]


def expert_geometry(path) -> tuple[int, int, int]:
    """(bytes of one expert's gate + up + down, experts per layer, bytes of all experts)."""
    with zformat.ZipMoEFile(path) as zf:
        sizes = zf.expert_bytes()
        n_expert = zf.shape(zf.tensors[0])[2]
    return sizes.one_expert, n_expert, sizes.all_experts


TOP_K = {"qwen2moe": 4, "deepseek2": 6}


def budget_of(path, arch: str, name: str) -> int:
    """The test budgets: one token's experts of a layer ("top-k"), half of all experts, all of them."""
    one, _, everything = expert_geometry(path)
    return {"top-k": TOP_K[arch] * one, "half": everything // 2, "everything": everything}[name]


def assert_slots_fit_the_budget(stats: dict, budget: int, one: int) -> None:
    """One F pool takes every slot the budget holds; the default pools (tests/test_default_pools.py)
    take fewer, beside their stores, and serve from them."""
    if any(stats["memory"]["pools"].values()):
        assert stats["n_slots"] * one <= budget and stats["c_hits"] + stats["s_hits"] + stats["e_hits"] > 0
    else:
        assert stats["n_slots"] == budget // one


def trace_and_close(llm, n_seq: int):
    """logits_trace of the first n_seq prompts, and the cache's statistics after it; closes llm."""
    try:
        got, got_tokens = logits_trace(llm, PROMPTS[:n_seq])
        return got, got_tokens, llm.zipmoe_stats()
    finally:
        llm.close()


def load(path, threads: int = THREADS, **zipmoe_options):
    """A model served on demand: no preload unless asked, so that every budget's misses, reads and passes
    run (test_preload_fills_the_slots_and_stays_bit_identical covers the preload)."""
    from zipmoe_py import Llama

    if str(path).endswith(".zipmoe.gguf"):
        zipmoe_options.setdefault("zipmoe_preload", False)
    return Llama(model_path=str(path), n_ctx=512, n_threads=threads, verbose=False, **zipmoe_options)


def logits_trace(llm, prompts: list[str], n_decode: int = N_DECODE, threads: int = THREADS,
                 before_free=None) -> tuple[np.ndarray, list[list[int]]]:
    """Logits (raw float32) of every prompt position and n_decode greedy steps, sequences decoded together;
    before_free(), if given, is called once they are, before the context is freed."""
    from zipmoe_py.bindings import llama_cpp as lc

    model = llm._model.model
    n_vocab = llm.n_vocab()
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 512, 512, 512
    cparams.n_seq_max = len(prompts)
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cparams)
    assert ctx, "llama_init_from_model failed"
    batch = lc.llama_batch_init(512, 0, len(prompts))
    rows, generated = [], [[] for _ in prompts]
    try:
        def decode(entries):  # entries: (token, pos, seq)
            batch.n_tokens = len(entries)
            for i, (tok, pos, seq) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, True
            assert lc.llama_decode(ctx, batch) == 0
            out = []
            for i in range(len(entries)):
                ptr = lc.llama_get_logits_ith(ctx, i)
                out.append(np.ctypeslib.as_array(ptr, (n_vocab,)).copy())
            return out

        tokens = [llm.tokenize(p.encode(), add_bos=True, special=False) for p in prompts]
        entries = [(tok, pos, s) for s, toks in enumerate(tokens) for pos, tok in enumerate(toks)]
        logits = decode(entries)
        rows += logits
        last = {}
        for (_, _, s), row in zip(entries, logits):
            last[s] = row
        pos = [len(t) for t in tokens]
        for _ in range(n_decode):
            step = []
            for s in range(len(prompts)):
                tok = int(np.argmax(last[s]))
                generated[s].append(tok)
                step.append((tok, pos[s], s))
                pos[s] += 1
            logits = decode(step)
            rows += logits
            last = dict(enumerate(logits))
        if before_free is not None:
            before_free()
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    return np.stack(rows).view(np.uint32), generated


def served_trace(path, budget: int, prompts: list[str], n_decode: int = N_DECODE, threads: int = THREADS):
    """(logits, tokens, stats): logits_trace of the ZipMoE GGUF at path served under budget, and the cache's
    statistics after it; the model closed."""
    llm = load(path, threads, zipmoe_budget=budget)
    try:
        got, got_tokens = logits_trace(llm, prompts, n_decode, threads)
        return got, got_tokens, llm.zipmoe_stats()
    finally:
        llm.close()


def assert_same_trace(got, got_tokens, want, want_tokens, against: str) -> None:
    """Every logit of every position equal as raw bits, and so the same greedy tokens."""
    assert got_tokens == want_tokens
    assert got.shape == want.shape
    differing = int((got != want).any(axis=1).sum())
    assert differing == 0, f"{differing} of {len(got)} positions differ from {against}"


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    made = {}

    def get(arch, n_seq):
        if (arch, n_seq) not in made:
            llm = load(tiny_gguf(arch))
            made[arch, n_seq] = logits_trace(llm, PROMPTS[:n_seq])
            llm.close()
        return made[arch, n_seq]

    return get


@pytest.mark.parametrize("n_seq", [1, 4])
@pytest.mark.parametrize("budget_name", ["top-k", "half", "everything"])
def test_logits_are_bit_identical_to_the_bf16_gguf(arch, n_seq, budget_name, zipmoe_gguf, reference):
    path = zipmoe_gguf(arch)
    one, _, _ = expert_geometry(path)
    top_k = TOP_K[arch]
    budget = budget_of(path, arch, budget_name)
    want, want_tokens = reference(arch, n_seq)
    got, got_tokens, stats = trace_and_close(load(path, zipmoe_budget=budget), n_seq)
    assert_same_trace(got, got_tokens, want, want_tokens, "the BF16 GGUF")
    assert_slots_fit_the_budget(stats, budget, one)
    assert stats["expert_misses"] > 0 and stats["bytes_read"] > 0
    if budget_name == "top-k":
        # a prefill of this many tokens selects more experts per layer than there are slots: several passes ran
        assert stats["fetch_calls"] > stats["expert_misses"] / top_k


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("budget_name", ["top-k", "half"])
def test_prefetch_on_and_off_are_bit_identical(arch, prefetch, budget_name, zipmoe_gguf, reference):
    """The next layer's predicted experts are read ahead or not (the default): the same logits, and
    with it on, the prediction is scored at every MoE layer after the first. Either way a prompt's
    next pass is read ahead (no prediction: its ids are known), which scores nothing."""
    path = zipmoe_gguf(arch)
    llm = load(path, zipmoe_budget=budget_of(path, arch, budget_name), zipmoe_prefetch=prefetch)
    got, got_tokens, stats = trace_and_close(llm, 1)
    want, want_tokens = reference(arch, 1)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    recall = stats["prefetch_recall"]
    assert stats["prefetch_bytes_used"] <= stats["prefetch_bytes_read"]
    if prefetch:
        with zformat.ZipMoEFile(path) as zf:
            moe_layers = sorted(zf.moe_layers())
        assert sorted(recall["layers"]) == moe_layers[1:]
        assert 0 < recall["actual"] and recall["correct"] <= recall["actual"]
    else:
        assert recall["actual"] == 0 and recall["predicted"] == 0


@pytest.mark.parametrize("budget_name", ["top-k", "half", "everything"])
def test_preload_fills_the_slots_and_stays_bit_identical(arch, budget_name, zipmoe_gguf, reference):
    """The default: where the slots in use hold every expert, the first context fills them (each layer its
    share, experts in id order), uncounted by the statistics, and nothing is read after it: the graphs use
    the slots in place (resident views, the default), with no fetch; under a smaller budget it loads nothing
    (a prompt reads the experts it needs)."""
    path = zipmoe_gguf(arch)
    llm = load(path, zipmoe_budget=budget_of(path, arch, budget_name), zipmoe_preload=True)
    try:
        before = llm.zipmoe_stats()
        got, got_tokens = logits_trace(llm, PROMPTS[:4])
        after = llm.zipmoe_stats()
    finally:
        llm.close()
    want, want_tokens = reference(arch, 4)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert before["expert_hits"] == before["expert_misses"] == before["bytes_read"] == before["fetch_calls"] == 0
    if budget_name == "everything":
        assert after["expert_misses"] == 0 and after["bytes_read"] == 0 and after["fetch_calls"] == 0
        assert before["preload_experts"] > 0 and before["preload_bytes_read"] > 0
    else:
        assert before["preload_experts"] == before["preload_bytes_read"] == 0
        assert after["expert_misses"] > 0


def test_one_decoding_thread_is_bit_identical_too(arch, zipmoe_gguf, reference):
    """zipmoe_threads caps the graph threads that decode; the I/O thread reads either way."""
    path = zipmoe_gguf(arch)
    one, _, _ = expert_geometry(path)
    top_k = TOP_K[arch]
    llm = load(path, zipmoe_budget=top_k * one, zipmoe_threads=1)
    try:
        got, got_tokens = logits_trace(llm, PROMPTS[:4])
    finally:
        llm.close()
    want, want_tokens = reference(arch, 4)
    assert got_tokens == want_tokens and np.array_equal(got, want)


@pytest.mark.parametrize("n_seq", [1, 4])
def test_passes_run_as_a_gpu_runs_them_are_bit_identical(arch, n_seq, zipmoe_gguf, reference, monkeypatch):
    """Beside a GPU, ggml runs a large batch's products on host slots there (its offload), where no id skips
    a row: the selections outside a pass take zero slots after the host slots, and the merge drops their
    rows. ZIPMOE_TEST_OFFLOADED_PASSES runs that path on the CPU, the zero slots' rows computed."""
    monkeypatch.setenv("ZIPMOE_TEST_OFFLOADED_PASSES", "1")
    path = zipmoe_gguf(arch)
    want, want_tokens = reference(arch, n_seq)
    got, got_tokens, stats = trace_and_close(load(path, zipmoe_budget=budget_of(path, arch, "top-k")), n_seq)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert stats["fetch_calls"] > stats["expert_misses"] / TOP_K[arch]  # several passes ran


@pytest.mark.parametrize("eviction", ["lru", "fifo", "marking", "lfu", "score"])
def test_every_eviction_policy_is_bit_identical(eviction, zipmoe_gguf, reference):
    """The policy only decides which slot a miss takes: output must not change (rank, the default: the
    test above)."""
    path = zipmoe_gguf("qwen2moe")
    _, _, everything = expert_geometry(path)
    llm = load(path, zipmoe_budget=everything // 3, zipmoe_eviction=eviction)
    try:
        got, got_tokens = logits_trace(llm, PROMPTS[:4])
        stats = llm.zipmoe_stats()
    finally:
        llm.close()
    want, want_tokens = reference("qwen2moe", 4)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert stats["expert_hits"] > 0 and stats["expert_misses"] > 0


POOL_MIXES = {"C": "C=4", "F+S+E": "F=2,S=3,E=3", "F+C+S+E": "F=1,C=2,S=2,E=2"}


@pytest.mark.parametrize("mix", POOL_MIXES)
def test_every_pool_mix_is_bit_identical(arch, mix, zipmoe_gguf, reference):
    """Experts decoded from the C, S and E stores (and read in Algorithm 1's order) give the same logits;
    the working slots are just the top-k, so a prefill runs in several passes per layer."""
    path = zipmoe_gguf(arch)
    top_k = TOP_K[arch]
    llm = load(path, zipmoe_pools=POOL_MIXES[mix], zipmoe_work_slots=top_k)
    try:
        got, got_tokens = logits_trace(llm, PROMPTS[:4])
        stats = llm.zipmoe_stats()
    finally:
        llm.close()
    want, want_tokens = reference(arch, 4)
    assert got_tokens == want_tokens
    differing = int((got != want).any(axis=1).sum())
    assert differing == 0, f"{differing} of {len(got)} positions differ from the BF16 GGUF"
    capacities = dict(item.split("=") for item in POOL_MIXES[mix].split(","))
    with zformat.ZipMoEFile(path) as zf:
        n_moe = len(zf.moe_layers())
    for pool in "CSE":
        want_entries = int(capacities.get(pool, 0)) * n_moe
        assert stats["pools"][pool]["experts"] == want_entries
        assert (stats[f"{pool.lower()}_hits"] > 0) == (want_entries > 0), (pool, stats)
    assert stats["n_slots"] == int(capacities.get("F", 0)) * n_moe + top_k


def test_pool_options_are_checked(zipmoe_gguf, tiny_gguf, tmp_path):
    path = zipmoe_gguf("qwen2moe")
    for bad in ["F=2,X=1", "F=-1", "F", "F=0", {"F": "many"}, 7, "F=1,F=2"]:
        with pytest.raises(ZipMoEError, match="pools"):
            load(path, zipmoe_pools=bad)
    with pytest.raises(ZipMoEError, match="zipmoe_pools needs zipmoe_eviction=rank"):
        load(path, zipmoe_pools="F=2", zipmoe_eviction="lru")
    with pytest.raises(ZipMoEError, match="zipmoe_work_slots"):
        load(path, zipmoe_pools="F=2", zipmoe_work_slots=0)
    with pytest.raises(ZipMoEError, match="not both"):
        load(path, zipmoe_pools="F=2", zipmoe_plan=tmp_path / "plan.json")
    with pytest.raises(ZipMoEError, match="plan.json"):
        load(path, zipmoe_plan=tmp_path / "plan.json")
    # the loader checks the pools against the budget once it knows the stores' entry sizes
    one, _, _ = expert_geometry(path)
    common = [_paths.program("llama-completion"), "-p", PROMPTS[0], "-n", 8, "--temp", 0, "--seed", 1, "-no-cnv",
              "-t", THREADS]
    pools = ["--override-kv", "zipmoe.pool_f=int:2", "--override-kv", "zipmoe.pool_c=int:4"]
    over = run(common + ["-m", path, *pools, "--override-kv", f"zipmoe.budget=int:{4 * one}"], stdin=subprocess.DEVNULL)
    assert over.returncode != 0 and b"more than zipmoe.budget" in over.stderr, over.stderr.decode()[-2000:]
    # and the CLI runs the same pools, bit-exact, when no budget limits them
    want = run(common + ["-m", tiny_gguf("qwen2moe")], stdin=subprocess.DEVNULL)
    got = run(common + ["-m", path, *pools], stdin=subprocess.DEVNULL)
    assert got.returncode == 0 and got.stdout == want.stdout, got.stderr.decode()[-2000:]


def test_fork_cli_with_warmup_matches_the_bf16_gguf_at_the_smallest_budget(arch, tiny_gguf, zipmoe_gguf):
    """llama-completion's warmup selects every expert of every layer: it must fit a top-k budget too."""
    path = zipmoe_gguf(arch)
    one, _, _ = expert_geometry(path)
    top_k = TOP_K[arch]
    cmd = [_paths.program("llama-completion"), "-p", PROMPTS[0], "-n", 16, "--temp", 0, "-t", THREADS,
           "-no-cnv", "--seed", 1]
    want = run(cmd + ["-m", tiny_gguf(arch)], stdin=subprocess.DEVNULL)
    got = run(cmd + ["-m", path, "--override-kv", f"zipmoe.budget=int:{top_k * one}"], stdin=subprocess.DEVNULL)
    assert want.returncode == 0 and got.returncode == 0, got.stderr.decode()[-2000:]
    assert got.stdout == want.stdout
    too_small = run(cmd + ["-m", path, "--override-kv", "zipmoe.budget=int:4096"], stdin=subprocess.DEVNULL)
    assert too_small.returncode != 0
    assert b"zipmoe.budget of 4096 bytes cannot hold one expert" in too_small.stderr


def test_repeated_decoding_hits_the_cache_when_everything_fits(zipmoe_gguf):
    path = zipmoe_gguf("qwen2moe")
    _, _, everything = expert_geometry(path)
    llm = load(path, zipmoe_budget=everything)
    try:
        logits_trace(llm, PROMPTS[:1], n_decode=4)
        first = llm.zipmoe_stats()
        llm.zipmoe_reset_stats()
        logits_trace(llm, PROMPTS[:1], n_decode=4)
        second = llm.zipmoe_stats()
    finally:
        llm.close()
    assert first["expert_misses"] > 0
    assert second["expert_misses"] == 0 and second["expert_hits"] > 0 and second["bytes_read"] == 0
    assert second["hit_rate"] == 1.0


def test_plain_bf16_gguf_has_no_expert_cache(tiny_gguf):
    llm = load(tiny_gguf("qwen2moe"))
    try:
        assert llm.zipmoe_stats() is None
    finally:
        llm.close()


def test_bad_budgets_thread_counts_and_policies_are_clear_errors(zipmoe_gguf):
    path = zipmoe_gguf("qwen2moe")
    for bad in ["lots", "-1G", 0, True, "1K"]:
        with pytest.raises(ZipMoEError, match="zipmoe_budget"):
            load(path, zipmoe_budget=bad)
    for bad in [-1, 1.5, "two", True, 4097]:  # text that is a whole number is taken, as from the environment
        with pytest.raises(ZipMoEError, match="zipmoe_threads"):
            load(path, zipmoe_threads=bad)
    with pytest.raises(ZipMoEError, match="zipmoe_eviction must be one of lru, fifo, marking, lfu, rank, score"):
        load(path, zipmoe_eviction="random")


MEMORY_PROBE = """
import json, sys
from zipmoe_py import Llama
mlock = len(sys.argv) > 3 and sys.argv[3] == "mlock"  # llama-cpp-python's server locks by default
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False, use_mmap=mlock, use_mlock=mlock,
            **({"zipmoe_budget": int(sys.argv[2])} if len(sys.argv) > 2 else {}))
llm.create_completion("The capital of France is", max_tokens=16, temperature=0.0)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"peak_rss": int(status["VmHWM"].split()[0]) * 1024, "stats": llm.zipmoe_stats()}))
"""


def test_resident_memory_stays_within_the_budget(tmp_path_factory):
    """Peak RSS with ZipMoE = the BF16 model's peak without its experts + budget + a small overhead.

    The model is expert-heavy (60 experts of 64 x 1408 per tensor, 4 layers: 130 MB of experts
    against 39 MB of embeddings) so that the experts' absence is visible. The overhead allowance
    is the documented one (ggml-zipmoe.h): the fetch's staging ring (8 expert tensors' stored
    chunks) and per graph thread a decoder with one decoded shard, plus 8 MiB for the chunk
    index, decoder tables, the I/O thread and allocator slack.
    """
    from zipmoe_py.convert import convert_to_bf16_gguf
    from zipmoe_py.devtools.tiny import make_tiny

    work = tmp_path_factory.mktemp("memory")
    make_tiny("qwen2moe", work / "hf", sizes={"moe_intermediate_size": 1408, "num_experts": 60})
    bf16 = convert_to_bf16_gguf(work / "hf", work / "bf16.gguf", quiet=True)
    zipmoe = work / "zipmoe.gguf"
    zformat.repack(bf16, zipmoe)
    one, n_expert, everything = expert_geometry(zipmoe)
    assert n_expert == 60 and everything > 100e6
    budget = 8 * one

    def probe(*args):
        import json
        import sys

        proc = run([sys.executable, "-c", MEMORY_PROBE, *args], cwd=work)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        return json.loads(proc.stdout.decode().strip().splitlines()[-1])

    plain = probe(bf16)
    served = probe(zipmoe, budget)
    assert served["stats"]["n_slots"] == 8
    n = 64 * 1408  # values per expert tensor
    staging = 8 * (n + 5 * (n // 5 + 4096))  # SM region + K aligned E-chunk regions (at most raw size each)
    allowance = staging + THREADS * (n // 5 + 1) + 8 * 2**20
    limit = plain["peak_rss"] - everything + budget + allowance
    print(f"\nmemory: BF16 peak {plain['peak_rss'] / 2**20:.1f} MiB, experts {everything / 2**20:.1f} MiB, budget {budget / 2**20:.2f} MiB, ZipMoE peak {served['peak_rss'] / 2**20:.1f} MiB, limit {limit / 2**20:.1f} MiB")
    assert served["peak_rss"] <= limit, (
        f"peak RSS {served['peak_rss'] / 2**20:.1f} MiB > BF16 peak {plain['peak_rss'] / 2**20:.1f} MiB "
        f"- experts {everything / 2**20:.1f} MiB + budget {budget / 2**20:.1f} MiB + overhead {allowance / 2**20:.1f} MiB")
    # asked to lock the model (mmap + mlock), the loader locks none of it: a lock would pin the chunks
    locked = probe(zipmoe, budget, "mlock")
    assert locked["peak_rss"] <= limit, f"with use_mlock, peak RSS {locked['peak_rss'] / 2**20:.1f} MiB > {limit / 2**20:.1f} MiB"


def test_a_corrupt_chunk_met_while_serving_stops_with_its_name(zipmoe_gguf, tmp_path):
    """Corruption found after load (the index is fine, a chunk's bytes are not): no wrong output, a named error."""
    path = zipmoe_gguf("qwen2moe")
    bad = tmp_path / "bad.gguf"
    data = bytearray(path.read_bytes())
    with zformat.ZipMoEFile(path) as zf:
        _, n_expert, _ = expert_geometry(path)
        tensor = "blk.0.ffn_up_exps.weight"
        refs = [zf.chunks(tensor, e)[2] for e in range(n_expert)]  # E-chunk (shard 1) of every expert
    for ref in refs:
        data[ref.offset + ref.size // 2] ^= 0x04
    bad.write_bytes(bytes(data))
    proc = run([_paths.program("llama-completion"), "-m", bad, "-p", PROMPTS[0], "-n", 4, "--temp", 0, "-t", THREADS,
                "-no-cnv", "--no-warmup"], stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert b"ZipMoE: " in proc.stderr
    assert b"checksum mismatch in layer 0, tensor blk.0.ffn_up_exps.weight, expert " in proc.stderr
    assert b", E-chunk (shard 1)" in proc.stderr


def test_ghuf_files_serve_bit_identical_on_the_cpu(arch, tiny_gguf, reference, tmp_path):
    """The GPU's layout (codec ghuf, format version 2) decoded by the CPU's path: the same logits."""
    path = tmp_path / f"{arch}.ghuf.zipmoe.gguf"
    zformat.repack(tiny_gguf(arch), path, codec="ghuf")
    got, got_tokens, stats = trace_and_close(load(path, zipmoe_budget=budget_of(path, arch, "top-k")), 1)
    want, want_tokens = reference(arch, 1)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    assert stats["expert_misses"] > 0


@pytest.mark.parametrize("budget_name, views", [("everything", "1"), ("half", "1"), ("everything", "0")])
def test_resident_views_use_the_slots_in_place_and_stay_bit_identical(arch, budget_name, views, zipmoe_gguf, reference,
                                                                     monkeypatch):
    """zipmoe.resident_views (on by default): once a preload left every expert resident in order, the graph
    is stock's on views of the slots, with no fetch at all; when they do not all fit, or with the option off,
    the fetch serves as before, finding every expert in its slot."""
    monkeypatch.setenv("ZIPMOE_RESIDENT_VIEWS", views)
    path = zipmoe_gguf(arch)
    llm = load(path, zipmoe_budget=budget_of(path, arch, budget_name), zipmoe_preload=True)
    got, got_tokens, stats = trace_and_close(llm, 4)
    want, want_tokens = reference(arch, 4)
    assert got_tokens == want_tokens and np.array_equal(got, want)
    if budget_name == "everything" and views == "1":
        assert stats["fetch_calls"] == 0 and stats["bytes_read"] == 0
    elif budget_name == "everything":
        assert stats["fetch_calls"] > 0 and stats["expert_misses"] == 0
    else:
        assert stats["fetch_calls"] > 0
