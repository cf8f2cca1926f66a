"""Errors, not aborts: a chunk that cannot be used while serving stops the decode with an error that
names layer, tensor, expert and chunk; the process, the model and the context stay usable, and a later
decode that needs no bad chunk is bit-identical to the BF16 GGUF.
"""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from zipmoe_py import ZipMoEError, _lib, _paths
from zipmoe_py import format as zformat

from conftest import run

THREADS = 2
CLEAN_PROMPT = "Hi"
N_DECODE = 3


@pytest.fixture
def models(tiny_gguf, zipmoe_gguf):
    """arch -> (BF16 GGUF, clean ZipMoE GGUF)."""
    return lambda arch: (tiny_gguf(arch), zipmoe_gguf(arch))


def load(path, **opts):
    from zipmoe_py import Llama

    return Llama(model_path=str(path), n_ctx=256, n_threads=THREADS, verbose=False, **opts)


def greedy_logits(llm, prompt: str, n_decode: int = N_DECODE) -> np.ndarray:
    """Raw float32 bits of the last position's logits after the prompt and after each greedy step."""
    from zipmoe_py.bindings import llama_cpp as lc

    def last():
        return np.ctypeslib.as_array(lc.llama_get_logits_ith(llm._ctx.ctx, -1), (llm.n_vocab(),)).copy()

    llm.reset()
    llm.eval(llm.tokenize(prompt.encode(), add_bos=True))
    rows = [last()]
    for _ in range(n_decode):
        llm.eval([int(np.argmax(rows[-1]))])
        rows.append(last())
    return np.stack(rows).view(np.uint32)


def used_experts(path, prompt: str) -> dict[int, set[int]]:
    """layer -> experts the router chose for the prompt and its greedy steps (every expert cached, through the
    fetch ops, which count them: resident views would leave them out)."""
    llm = load(path, zipmoe_budget=1 << 30, zipmoe_resident_views=False)
    try:
        greedy_logits(llm, prompt)
        cache = _lib.llama_model_zipmoe_cache(llm._model.model)
        used = {}
        for il in range(64):
            got = _lib.cache_activations(cache, il)
            if got is not None:
                used[il] = {e for e, n in enumerate(got[0]) if n}
        return used
    finally:
        llm.close()


def corrupt(path, out, tensor: str, experts, chunk: int, at=lambda ref: ref.offset + ref.size // 2,
            bit: int = 0x10) -> None:
    """A copy of path with one bit flipped in chunk `chunk` (0: SM, 1 + k: E-chunk k) of each listed expert."""
    data = bytearray(path.read_bytes())
    with zformat.ZipMoEFile(path) as zf:
        experts = range(zf.shape(tensor)[2]) if experts is None else experts
        for e in experts:
            data[at(zf.chunks(tensor, e)[chunk])] ^= bit
    out.write_bytes(bytes(data))


@pytest.mark.parametrize("arch", ["qwen2moe", "deepseek2"])
def test_a_corrupt_chunk_raises_and_a_later_decode_is_exact(arch, models, tmp_path):
    bf16, clean = models(arch)
    used = used_experts(clean, CLEAN_PROMPT)
    # an expert the clean prompt never needs, in the first MoE layer that has one
    layer, expert = next((il, e) for il, es in sorted(used.items()) for e in range(64) if e not in es
                         and e < zformat.ZipMoEFile(clean).shape(f"blk.{il}.ffn_up_exps.weight")[2])
    bad = tmp_path / "bad.gguf"
    corrupt(clean, bad, f"blk.{layer}.ffn_up_exps.weight", [expert], chunk=2)  # E-chunk of shard 1

    reference = load(bf16)
    want = greedy_logits(reference, CLEAN_PROMPT)
    reference.close()

    llm = load(bad, zipmoe_budget=1 << 30)
    try:
        # a prompt long enough to route to every expert of the layer sooner or later
        words = "one two three four five six seven eight nine ten apple river stone cloud".split() * 8
        with pytest.raises(ZipMoEError) as info:
            llm.eval(llm.tokenize(" ".join(words).encode(), add_bos=True))
        message = str(info.value)
        assert f"checksum mismatch in layer {layer}, tensor blk.{layer}.ffn_up_exps.weight, expert {expert}, " \
               "E-chunk (shard 1)" in message, message
        assert str(bad) in message
        assert llm.n_tokens < len(words)  # the failed batch is not counted as evaluated
        # the same model and context go on, bit-exact, with a prompt that needs no corrupt chunk
        got = greedy_logits(llm, CLEAN_PROMPT)
        assert np.array_equal(got, want)
        # and the bad expert still fails, every time, without a stale slot hiding it
        with pytest.raises(ZipMoEError, match=f"expert {expert}, E-chunk"):
            llm.eval(llm.tokenize(" ".join(words).encode(), add_bos=True))
    finally:
        llm.close()


def test_the_low_level_api_gets_a_status_and_the_message(models, tmp_path):
    from zipmoe_py.bindings import llama_cpp as lc

    _, clean = models("qwen2moe")
    bad = tmp_path / "bad.gguf"
    corrupt(clean, bad, "blk.0.ffn_down_exps.weight", None, chunk=0, at=lambda ref: ref.offset, bit=0x01)
    llm = load(bad)
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 128, 128, THREADS, THREADS
    ctx = lc.llama_init_from_model(llm._model.model, cp)
    batch = lc.llama_batch_init(8, 0, 1)
    try:
        toks = llm.tokenize(b"Hello there", add_bos=True)
        batch.n_tokens = len(toks)
        for i, t in enumerate(toks):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = t, i, 1, 0, True
        for _ in range(2):  # the same failure again: nothing was left half-done
            rc = lc.llama_decode(ctx, batch)
            assert rc != 0
            message = _lib.llama_zipmoe_last_error(ctx)
            assert re.search(r"checksum mismatch in layer 0, tensor blk\.0\.ffn_down_exps\.weight, expert \d+, SM-chunk",
                             message), message
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        llm.close()


def test_the_fork_cli_exits_with_the_message_not_a_signal(models, tmp_path):
    _, clean = models("qwen2moe")
    bad = tmp_path / "bad.gguf"
    corrupt(clean, bad, "blk.1.ffn_gate_exps.weight", None, chunk=3, at=lambda ref: ref.offset + 1, bit=0x80)
    proc = run([_paths.program("llama-completion"), "-m", bad, "-p", "Hello", "-n", 4, "--temp", 0, "-t", THREADS,
                "-no-cnv"], stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode > 0, f"ended by signal {-proc.returncode}" if proc.returncode < 0 else "no error"
    assert b"ZipMoE: " in proc.stderr and b"layer 1, tensor blk.1.ffn_gate_exps.weight, expert " in proc.stderr
    assert b"E-chunk (shard 2)" in proc.stderr
    assert b"GGML_ABORT" not in proc.stderr and b"backtrace" not in proc.stderr.lower()
    # llama-perplexity too: the run stops with the message and a failing exit status (patch 0013)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    proc = run([_paths.program("llama-perplexity"), "-m", bad, "-f", text, "-c", 64, "-b", 64, "--chunks", 2,
                "-t", THREADS], stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 1, proc.stderr.decode()[-2000:]
    assert b"layer 1, tensor blk.1.ffn_gate_exps.weight, expert " in proc.stderr + proc.stdout


def test_no_ggml_abort_is_left_in_the_fetch_path():
    """The glue and the cache stop a graph through its abort callback; nothing they run on file contents,
    a budget or an option calls GGML_ABORT, abort() or exit()."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "ggml-zipmoe"
    sources = [*root.glob("src/**/*.c"), *root.glob("llama/*.cpp")]
    assert len(sources) > 20  # every folder of src/ is looked at
    for source in sources:
        # a static_assert is checked by the compiler, never at run time
        text = source.read_text().replace("static_assert(", "")
        for bad in ("GGML_ABORT(", "GGML_ASSERT(", "abort()", "exit(", "assert("):
            assert bad not in text, f"{source.name} calls {bad}"


def test_verbose_false_keeps_llama_cpps_warnings_quiet_and_shows_its_errors(models, tmp_path):
    """llama-cpp-python maps ggml's log levels by an older numbering: with verbose=False llama.cpp's
    warnings were printed and its errors hidden. A failed fetch raises ZipMoEError; the warning that
    follows it in llama.cpp ("removing memory module entries") stays quiet, and the error is shown."""
    _, clean = models("qwen2moe")
    bad = tmp_path / "bad.gguf"
    corrupt(clean, bad, "blk.0.ffn_down_exps.weight", None, chunk=0, at=lambda ref: ref.offset, bit=0x01)
    script = (
        "from zipmoe_py import Llama, ZipMoEError\n"
        f"llm = Llama(model_path={str(bad)!r}, n_ctx=128, n_threads=2, verbose=False)\n"
        "try:\n"
        "    llm.eval(llm.tokenize(b'Hello there', add_bos=True))\n"
        "except ZipMoEError as e:\n"
        "    print('raised:', e)\n"
        "llm.close()\n")
    proc = run([sys.executable, "-c", script], cwd=tmp_path)
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0 and "raised:" in out and "checksum mismatch" in out, out + err
    assert "removing memory module entries" not in err, err
    assert "llama_model_loader" not in err and "print_info" not in err, err  # no info chatter


def test_the_fork_cli_always_prints_why_it_could_not_load(tmp_path):
    """llama-completion's log is written by a thread: a failed load returned from main with its error still
    queued, and the user who mistyped a path saw nothing in about a third of the runs. Every run says it."""
    missing = tmp_path / "missing.gguf"
    unreadable = tmp_path / "unreadable.gguf"
    unreadable.write_bytes(b"GGUF" + bytes(60))
    for path in [missing] * 16 + [unreadable] * 8:
        proc = run([_paths.program("llama-completion"), "-m", path, "-p", "Hi", "-n", 4, "-no-cnv"],
                   stdin=subprocess.DEVNULL, timeout=60)
        assert proc.returncode == 1, proc.returncode
        assert str(path).encode() in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-1000:]
