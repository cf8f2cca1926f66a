"""Both tiny models generate through `Llama`, the fork's CLI and zipmoe-chat, and agree."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from zipmoe_py import ZipMoEError, _paths

from conftest import run, zipmoe_command

PROMPT = "The capital of France is"
N_GREEDY = 24
THREADS = 2


@pytest.fixture(scope="module")
def llms(tiny_gguf):
    from zipmoe_py import Llama

    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = Llama(model_path=str(tiny_gguf(arch)), n_ctx=512, n_threads=THREADS,
                               seed=1, verbose=False)
        return made[arch]

    return get


def greedy_tokens(llm, prompt: str, n: int) -> list[int]:
    llm.reset()
    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
    out = []
    for token in llm.generate(tokens, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if len(out) == n:
            break
    return out


def test_llama_api_completion_and_streaming_chat(arch, llms):
    llm = llms(arch)
    completion = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)
    assert completion["usage"]["completion_tokens"] == 8
    assert completion["usage"]["prompt_tokens"] >= 5
    chunks = list(llm.create_chat_completion(
        messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0.0, stream=True))
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    whole = llm.create_chat_completion(messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
                                       temperature=0.0)
    assert streamed == whole["choices"][0]["message"]["content"]


def test_llama_greedy_tokens_equal_the_forks_cli(arch, llms, tiny_gguf):
    llm = llms(arch)
    tokens = greedy_tokens(llm, PROMPT, N_GREEDY)
    assert len(tokens) == N_GREEDY
    assert len(set(tokens)) > 1, "a random model that repeats one token tests little"
    proc = run([_paths.program("llama-completion"), "-m", tiny_gguf(arch), "-p", PROMPT, "-n", N_GREEDY,
                "--temp", 0, "--repeat-penalty", 1.0, "--ignore-eos", "-no-cnv", "--no-display-prompt",
                "-t", THREADS, "-c", 512, "--no-warmup"], stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert proc.stdout == llm.detokenize(tokens) + b"\n\n"  # llama-completion ends with a blank line


def _chat(model, *args, stdin=b""):
    return run([zipmoe_command("zipmoe-chat"), model, "-n", 6, "--temp", 0, "-t", THREADS, "-c", 512, *args],
               input=stdin)


def test_zipmoe_chat_one_shot_matches_the_api(arch, llms, tiny_gguf):
    proc = _chat(tiny_gguf(arch), "-p", "Hello")
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    expected = llms(arch).create_chat_completion(messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=6, temperature=0.0)
    assert proc.stdout.decode() == expected["choices"][0]["message"]["content"] + "\n"


def test_zipmoe_chat_reads_turns_until_exit(tiny_gguf):
    model = tiny_gguf("qwen2moe")
    one_shot = _chat(model, "-p", "Hello")
    driven = _chat(model, stdin=b"Hello\n/exit\nnever answered\n")
    assert driven.returncode == 0, driven.stderr.decode()[-2000:]
    assert driven.stdout == one_shot.stdout
    two_turns = _chat(model, stdin=b"Hello\nAgain\n")
    assert two_turns.returncode == 0
    assert two_turns.stdout.startswith(one_shot.stdout) and len(two_turns.stdout) > len(one_shot.stdout)


def test_zipmoe_chat_names_a_conversation_longer_than_the_context(tiny_gguf):
    model = tiny_gguf("qwen2moe")
    long_prompt = " ".join(["word"] * 300)
    one_shot = _chat(model, "-p", long_prompt, "-c", "128")
    assert one_shot.returncode == 1
    # llama.cpp rounds -c up to a multiple of 256: the error names the context in effect, in its own words
    assert (b"zipmoe-chat: error: the conversation does not fit the context of 256 tokens (-c 128 was raised to 256 "
            b"by llama.cpp") in one_shot.stderr
    assert b"Traceback" not in one_shot.stderr and b"broadcast" not in one_shot.stderr
    assert b"llama-cpp-python" not in one_shot.stderr
    # interactive: the turn that does not fit is dropped, the chat goes on and /clear makes room
    driven = _chat(model, "-c", "128", stdin=f"{long_prompt}\n/clear\nHello\n".encode())
    assert driven.returncode == 0, driven.stderr.decode()[-2000:]
    assert b"this turn is dropped" in driven.stderr and b"Traceback" not in driven.stderr
    assert driven.stdout == _chat(model, "-c", "128", "-p", "Hello").stdout


def test_zipmoe_chat_help_explains_every_option():
    proc = run([zipmoe_command("zipmoe-chat"), "--help"])
    assert proc.returncode == 0
    for flag in (b"-p", b"-n", b"--temp", b"--seed", b"-t", b"--ctx-size", b"/exit", b"--budget", b"--direct-io",
                 b"--stats", b"--eviction", b"--plan", b"--pools", b"--work-slots", b"--zipmoe-threads",
                 b"--n-gpu-layers", b"--batch-size", b"--model"):
        assert flag in proc.stdout


def test_zipmoe_chat_on_a_zipmoe_gguf_under_a_budget_answers_like_bf16(tiny_gguf, tmp_path):
    from zipmoe_py import format as zformat

    model = tmp_path / "q.zipmoe.gguf"
    zformat.repack(tiny_gguf("qwen2moe"), model)
    want = _chat(tiny_gguf("qwen2moe"), "-p", "Hello")
    got = _chat(model, "-p", "Hello", "--budget", "64K", "--stats", "--direct-io")
    assert got.returncode == 0, got.stderr.decode()[-2000:]
    assert got.stdout == want.stdout
    assert b"[stats] this reply" in got.stderr and b"misses" in got.stderr and b"per token" in got.stderr
    bad = _chat(model, "-p", "Hello", "--budget", "lots")
    assert bad.returncode == 2 and b"argument --budget: must be a size in bytes" in bad.stderr  # before loading
    pooled = _chat(model, "-p", "Hello", "--pools", "C=2,E=4", "--work-slots", "4", "--stats")
    assert pooled.returncode == 0, pooled.stderr.decode()[-2000:]
    assert pooled.stdout == want.stdout and b"from pools C/S/E" in pooled.stderr
    bad = _chat(model, "-p", "Hello", "--pools", "F=1", "--plan", tmp_path / "plan.json")
    assert bad.returncode == 2 and b"not both" in bad.stderr
    # -ngl on a build without CUDA: nothing to offload to, the same answer from host slots
    offload = _chat(model, "-p", "Hello", "--budget", "64K", "-ngl", "99", "--stats")
    assert offload.returncode == 0, offload.stderr.decode()[-2000:]
    assert offload.stdout == want.stdout and b"to the slots' device" not in offload.stderr


def test_missing_and_invalid_model_files_are_named(tmp_path):
    from zipmoe_py import Llama

    missing = tmp_path / "missing.gguf"
    with pytest.raises(ZipMoEError, match="model file not found: .*missing.gguf"):
        Llama(model_path=str(missing))
    not_gguf = tmp_path / "weights.safetensors"
    not_gguf.write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ZipMoEError, match="weights.safetensors is not a GGUF file"):
        Llama(model_path=str(not_gguf))
    proc = run([zipmoe_command("zipmoe-chat"), missing, "-p", "hi"])
    assert proc.returncode == 1
    assert f"model file not found: {missing}".encode() in proc.stderr
    proc = run([zipmoe_command("zipmoe-chat"), tmp_path, "-p", "hi"])
    assert b"is a folder, not a GGUF file" in proc.stderr


def _python(code: str, cwd, **env):
    # run outside the source tree, whose zipmoe_py folder holds no build
    return run([sys.executable, "-c", code], env={**os.environ, **env}, cwd=cwd)


def test_llama_cpp_imported_with_another_library_is_refused(tmp_path):
    other = tmp_path / "other-lib"
    shutil.copytree(_paths.LIB_DIR, other)
    proc = _python("import llama_cpp\nimport zipmoe_py\nzipmoe_py.Llama", tmp_path, LLAMA_CPP_LIB_PATH=str(other))
    assert proc.returncode != 0
    err = proc.stderr.decode()
    assert "llama_cpp was already imported in this process with" in err and str(other) in err
    assert "Import zipmoe_py before llama_cpp" in err


def test_foreign_llama_cpp_lib_path_is_refused(tmp_path):
    proc = _python("import zipmoe_py\nzipmoe_py.Llama", tmp_path, LLAMA_CPP_LIB_PATH=str(tmp_path))
    assert proc.returncode != 0
    assert b"points llama_cpp at another llama.cpp build" in proc.stderr


def test_bindings_load_zipmoes_library(tmp_path):
    proc = _python("import zipmoe_py, llama_cpp\nzipmoe_py.Llama\n"
                   "print(llama_cpp.llama_cpp._lib._name)\nprint(llama_cpp.__version__)", tmp_path)
    assert proc.returncode == 0, proc.stderr.decode()
    lib, version = proc.stdout.decode().split()
    assert os.path.realpath(lib) == os.path.realpath(_paths.LIB_DIR / "libllama.so")
    assert version == "0.3.36"


def test_plain_llama_cpp_runs_zipmoe_bit_exact(tmp_path, tiny_gguf, zipmoe_gguf):
    """llama-cpp-python's own API with no zipmoe_py import and no LLAMA_CPP_LIB_PATH (setup.sh links
    llama_cpp/lib to ours): it loads ZipMoE's libllama, serves a ZipMoE GGUF under a budget given by
    the environment, and its logits equal the BF16 GGUF's bit for bit."""
    code = ("import sys, hashlib, numpy\n"
            "from llama_cpp import Llama, llama_cpp\n"
            "print(llama_cpp._lib._name)\n"
            "llm = Llama(model_path=sys.argv[1], n_ctx=64, logits_all=True, verbose=False)\n"
            "llm.eval(llm.tokenize(b'the quick brown fox jumps over the lazy dog'))\n"
            "print(hashlib.sha256(numpy.ascontiguousarray(llm.scores[:llm.n_tokens]).tobytes()).hexdigest())\n")
    environment = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    outputs = []
    for model, budget in ((tiny_gguf("qwen2moe"), None), (zipmoe_gguf("qwen2moe"), "40K")):
        env = {**environment, **({"ZIPMOE_BUDGET": budget} if budget else {})}
        proc = run([sys.executable, "-c", code, str(model)], env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        lib, digest = proc.stdout.decode().split()
        assert os.path.realpath(lib) == os.path.realpath(_paths.LIB_DIR / "libllama.so")
        outputs.append(digest)
    assert outputs[0] == outputs[1]


def test_a_context_llama_cpp_rounds_up_is_whole_in_python(zipmoe_gguf):
    """llama.cpp makes n_ctx=16 a 256-token context; Llama holds all of it (llama-cpp-python alone sizes
    its token array by the 16 asked for, and a longer prompt fails with a numpy broadcast error)."""
    from zipmoe_py import Llama

    path = str(zipmoe_gguf("qwen2moe"))
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    small = Llama(model_path=path, n_ctx=16, verbose=False)
    assert small.n_ctx() == 256 and len(small.input_ids) == 256
    got = small.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
    small.close()
    whole = Llama(model_path=path, n_ctx=256, verbose=False)
    want = whole.create_completion(prompt, max_tokens=4, temperature=0)["choices"][0]["text"]
    whole.close()
    assert got == want
