"""Every ZipMoE option reaches every tool: KV overrides, environment variables (the only way into
llama-bench), Python arguments, with KV override > environment > default; bad values name the option
and where it came from.
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess

import pytest

from zipmoe_py import ZipMoEError

from conftest import VENV_BIN, run
from test_serve import expert_geometry

PROMPT = "The capital of France is"


@pytest.fixture
def model(zipmoe_gguf):
    out = zipmoe_gguf("qwen2moe")
    return out, expert_geometry(out)[0]


def env(**values) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ZIPMOE_")}
    return {**clean, **{k: str(v) for k, v in values.items()}}


def slots_in_use(stderr: bytes) -> int:
    found = re.findall(rb"ZipMoE expert cache: (\d+) of (\d+) slots in use", stderr)
    assert found, stderr.decode()[-3000:]
    return int(found[0][0])


def completion(path, *args, environment=None) -> subprocess.CompletedProcess:
    return run([VENV_BIN / "llama-completion", "-m", path, "-p", PROMPT, "-n", 4, "--temp", 0, "-t", 2, "-no-cnv",
                "-c", 256, "-v", *args], env=environment or env(), stdin=subprocess.DEVNULL)


def test_environment_reaches_llama_completion_and_an_override_wins(model):
    path, one = model
    proc = completion(path, environment=env(ZIPMOE_BUDGET=7 * one))
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert slots_in_use(proc.stderr) == 7
    proc = completion(path, "--override-kv", f"zipmoe.budget=int:{5 * one}", environment=env(ZIPMOE_BUDGET=7 * one))
    assert proc.returncode == 0 and slots_in_use(proc.stderr) == 5
    # sizes with units as a string override, several options in one comma-separated override
    proc = completion(path, "--override-kv", f"zipmoe.budget=str:{6 * one // 1024}K,zipmoe.eviction=str:lfu,"
                                             "zipmoe.threads=int:1")
    assert proc.returncode == 0 and slots_in_use(proc.stderr) == 6, proc.stderr.decode()[-2000:]


def test_environment_reaches_llama_bench(model):
    """llama-bench has no --override-kv: the environment is how a benchmark runs ZipMoE at a budget."""
    path, one = model
    proc = run([VENV_BIN / "llama-bench", "-m", path, "-p", 8, "-n", 4, "-t", 2, "-r", 1, "-v"],
               env=env(ZIPMOE_BUDGET=9 * one, ZIPMOE_EVICTION="fifo"))
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert slots_in_use(proc.stderr) == 9
    assert b"tg4" in proc.stdout and b"pp8" in proc.stdout
    # llama-bench shows no load log unless -v, but its errors (patch 0017): why the model failed to load
    for verbose in (["-v"], []):
        bad = run([VENV_BIN / "llama-bench", "-m", path, "-p", 8, "-n", 4, "-r", 1, *verbose],
                  env=env(ZIPMOE_EVICTION="random"))
        assert bad.returncode != 0
        assert b"ZIPMOE_EVICTION (environment) must be one of lru, fifo, marking, lfu, rank, score; got 'random'" in (
            bad.stderr + bad.stdout)


def test_environment_reaches_llama_perplexity_which_matches_the_bf16_gguf(model, tiny_gguf, tmp_path):
    path, one = model
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 60)

    def perplexity(gguf, environment):
        proc = run([VENV_BIN / "llama-perplexity", "-m", gguf, "-f", text, "-c", 64, "-b", 64, "--chunks", 3, "-t", 2,
                    "-v"], env=environment, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        return proc, re.findall(rb"Final estimate: PPL = [0-9.]+ \+/- [0-9.]+", proc.stderr + proc.stdout)

    served, got = perplexity(path, env(ZIPMOE_BUDGET=6 * one))
    assert slots_in_use(served.stderr) == 6
    _, want = perplexity(tiny_gguf("qwen2moe"), env())
    assert got and got == want


@pytest.mark.parametrize("variable, value, message", [
    ("ZIPMOE_BUDGET", "lots", "ZIPMOE_BUDGET (environment) must be a size in bytes, or like 4G, 512M, 1.5GiB; got 'lots'"),
    ("ZIPMOE_BUDGET", "-2G", "ZIPMOE_BUDGET (environment) must be a size"),
    ("ZIPMOE_DIRECT_IO", "maybe", "ZIPMOE_DIRECT_IO (environment) must be true or false"),
    ("ZIPMOE_THREADS", "two", "ZIPMOE_THREADS (environment) must be a whole number of threads from 0 to 4096"),
    ("ZIPMOE_POOL_C", "-1", "ZIPMOE_POOL_C (environment) must be a whole number of experts per MoE layer from 0 to 1048576"),
    ("ZIPMOE_WORK_SLOTS", "0", "ZIPMOE_WORK_SLOTS (environment) must be a whole number of slots from 1 to 1048576"),
])
def test_bad_environment_values_are_named(model, variable, value, message):
    path, _ = model
    proc = completion(path, environment=env(**{variable: value}))
    assert proc.returncode != 0
    assert message.encode() in proc.stderr, proc.stderr.decode()[-2000:]


def test_bad_overrides_are_named(model):
    path, _ = model
    proc = completion(path, "--override-kv", "zipmoe.bogus=int:1")
    assert proc.returncode != 0 and b"unknown ZipMoE option 'zipmoe.bogus': known are zipmoe.budget" in proc.stderr
    proc = completion(path, "--override-kv", "zipmoe.budget=float:1.5")
    assert proc.returncode != 0
    assert b"--override-kv zipmoe.budget must be a size in bytes, or like 4G, 512M, 1.5GiB; got 1.5" in proc.stderr
    proc = completion(path, "--override-kv", "zipmoe.substitution=str:smoe", "--override-kv", "zipmoe.smoe_alpha=float:2")
    assert proc.returncode != 0 and b"--override-kv zipmoe.smoe_alpha must be a number from 0 to 1; got 2" in proc.stderr
    proc = completion(path, "--override-kv", "zipmoe.substitution=str:buddy-ish")
    assert proc.returncode != 0
    assert b"--override-kv zipmoe.substitution must be one of none, smoe, buddy (smoe and buddy are lossy); got 'buddy-ish'" in proc.stderr
    proc = completion(path, "--override-kv", "zipmoe.pool_f=int:2", environment=env(ZIPMOE_EVICTION="lru"))
    assert proc.returncode != 0 and b"zipmoe.pool_f needs zipmoe.eviction=rank" in proc.stderr


def test_python_arguments_override_the_environment_which_overrides_the_default(model):
    from zipmoe_py import Llama

    path, one = model
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("ZIPMOE_")}
    try:
        os.environ["ZIPMOE_BUDGET"] = str(3 * one)
        llm = Llama(model_path=str(path), n_ctx=128, verbose=False)
        assert llm.zipmoe_stats()["n_slots"] == 3
        llm.close()
        llm = Llama(model_path=str(path), n_ctx=128, verbose=False, zipmoe_budget=8 * one)
        assert llm.zipmoe_stats()["n_slots"] == 8
        llm.close()
        os.environ["ZIPMOE_BUDGET"] = "lots"
        # llama-cpp-python's ValueError, carrying the loader's reason though verbose=False silences the log
        with pytest.raises(ValueError, match=r"ZIPMOE_BUDGET \(environment\) must be a size in bytes.*got 'lots'"):
            Llama(model_path=str(path), n_ctx=128, verbose=False)
    finally:
        os.environ.pop("ZIPMOE_BUDGET", None)
        os.environ.update(saved)
    with pytest.raises(ZipMoEError, match="zipmoe_mem_limit"):
        Llama(model_path=str(path), n_ctx=128, verbose=False, zipmoe_mem_limit="lots")


def test_option_names_are_the_c_librarys():
    """ggml-zipmoe names the eviction policies and the pools; the Python options take them from it."""
    from zipmoe_py import _lib, cli, options

    assert _lib.eviction_names() == ("lru", "fifo", "marking", "lfu", "rank", "score")
    assert _lib.eviction_names()[_lib.EVICT_RANK] == "rank"
    assert _lib.pool_names() == ("F", "C", "S", "E")
    eviction = next(action for action in cli.build_parser()._actions if action.dest == "zipmoe_eviction")
    assert tuple(eviction.choices) == _lib.eviction_names()
    assert options.pool_overrides("e=2,F=1") == {"zipmoe.pool_f": 1, "zipmoe.pool_e": 2}
    with pytest.raises(ZipMoEError, match="zipmoe_eviction must be one of lru, fifo, marking, lfu, rank, score; got 'x'"):
        options.zipmoe_overrides(eviction="x")
    with pytest.raises(ZipMoEError, match="zipmoe_pools: 'F=1,X=2' must name each of the pools F, C, S, E"):
        options.pool_overrides("F=1,X=2")


def test_sizes_in_messages_keep_a_number_of_one_or_more_and_read_back_as_given():
    """One formatter (ggml_zipmoe_size_text) for every message: the unit keeps the number at 1 or more, so
    no budget reads "0.00 GiB", and the text parses back (as a SIZE option) to the size within its rounding."""
    from zipmoe_py import _lib, options

    said = {n: options.size_text(n) for n in (0, 1, 1023, 1024, 1536, (1 << 20) - 1, 1 << 20, 256 << 20,
                                               (1 << 30) - 1, 1 << 30, 5 << 29, 3 << 40)}
    assert said == {0: "0 bytes", 1: "1 byte", 1023: "1023 bytes", 1024: "1.0 KiB", 1536: "1.5 KiB",
                    (1 << 20) - 1: "1024.0 KiB", 1 << 20: "1.0 MiB", 256 << 20: "256.0 MiB",
                    (1 << 30) - 1: "1024.0 MiB", 1 << 30: "1.00 GiB", 5 << 29: "2.50 GiB", 3 << 40: "3072.00 GiB"}
    for n, text in said.items():
        if n >= 1024:
            assert abs(options.parse_size(text.replace(" ", "")) - n) <= 0.0051 * n, text
    buf = ctypes.create_string_buffer(4)  # a short buffer: cut, never overrun
    assert _lib.lib().ggml_zipmoe_size_text(1 << 30, buf, len(buf)) == b"1.0"


def test_the_loaders_reason_reaches_the_python_exception(model, tmp_path):
    from zipmoe_py import Llama
    from zipmoe_py.errors import ZipMoELoadError

    path, _ = model
    with pytest.raises(ZipMoELoadError, match=r"cannot load .*: --override-kv zipmoe.eviction must be one of lru"):
        Llama(model_path=str(path), n_ctx=128, verbose=False, kv_overrides={"zipmoe.eviction": "zzz"})
    with pytest.raises(ZipMoELoadError, match="hold 100000 experts per MoE layer, more than the 16 a layer of"):
        Llama(model_path=str(path), n_ctx=128, verbose=False, zipmoe_pools="F=100000")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ZipMoELoadError, match=f"cannot load {truncated}: .*(file bounds|truncated|beyond the end)"):
        Llama(model_path=str(truncated), n_ctx=128, verbose=False)
    # the log callback is llama-cpp-python's again afterwards, and a good load still works
    llm = Llama(model_path=str(path), n_ctx=128, verbose=False)
    assert llm.zipmoe_stats()["n_slots"] > 0
    llm.close()


@pytest.mark.parametrize("kwargs, message", [
    (dict(zipmoe_threads=10000), "zipmoe_threads must be a whole number of threads from 0 to 4096 .*got 10000"),
    (dict(zipmoe_rank_delta=2 ** 40), "zipmoe_rank_delta must be a whole number from 0 to 1048576"),
    (dict(zipmoe_work_slots=0), "zipmoe_work_slots must be a whole number of slots from 1 to 1048576; got 0"),
    (dict(zipmoe_pools={"F": 2.7}), "zipmoe_pools: F must be a whole number of experts per MoE layer from 0 to 1048576"),
    (dict(zipmoe_pools="F=2.7"), "zipmoe_pools: .* whole number"),
    (dict(zipmoe_direct_io="no"), "zipmoe_direct_io must be True or False; got 'no'"),
    (dict(zipmoe_budget=2 ** 70), "zipmoe_budget must be a size in bytes.*got 1180591620717411303424"),
    (dict(zipmoe_budget="inf"), "zipmoe_budget must be a size in bytes"),
    (dict(zipmoe_budget=float("inf")), "zipmoe_budget must be a size in bytes"),
    (dict(zipmoe_bugdet="1M"), "unknown option\\(s\\) zipmoe_bugdet; ZipMoE's options are zipmoe_auto_pools"),
    (dict(zipmoe_device_budgets="CUDA0"),
     "zipmoe_device_budgets must be like 'CUDA0=6G CPU=8G'.*got 'CUDA0': 'CUDA0' is not DEVICE=SIZE$"),
    (dict(zipmoe_device_budgets="CPU=1G cpu=2G"), "must be like.*: device cpu is named twice$"),
    (dict(zipmoe_device_budgets={"CPU": "lots"}),
     "must be like.*got 'CPU=lots': CPU's size lots is not a size like 20G or 512M$"),
    (dict(zipmoe_device_budgets="=4G"), "zipmoe_device_budgets must be like.*: '=4G' is not DEVICE=SIZE$"),
    (dict(zipmoe_device_budgets="CPU=0"), "must be like.*: CPU's size 0 is not more than 0$"),
    (dict(zipmoe_device_budgets="CPU=1G RPC0=-2G"), "must be like.*: RPC0's size -2G is not more than 0$"),
    (dict(zipmoe_device_budgets="CPU=99999999T"), "must be like.*: CPU's size 99999999T is too large$"),
    (dict(zipmoe_device_budgets="CPU=0.5"), "must be like.*: CPU's size 0.5 is less than a byte$"),
    (dict(zipmoe_device_budgets=" , "), "must be like.*: no device is named$"),
    (dict(zipmoe_device_budgets=42), "zipmoe_device_budgets must be like.*got 42"),
    (dict(n_cpu_moe=-1), "n_cpu_moe: -1 is not a whole number of layers"),
    (dict(override_tensor="blk"), "override_tensor: 'blk' is not PATTERN=BUFFER_TYPE"),
    (dict(override_tensor="exps=NOPE"), "override_tensor: unknown buffer type 'NOPE' in 'exps=NOPE'; available: CPU"),
    (dict(override_tensor=5), "override_tensor must be text, PATTERN=BUFFER_TYPE"),
    (dict(override_tensor="blk.[=CPU"), r"tensor override pattern 'blk\.\[' \(-ot, --override-tensor\): "),
])
def test_python_options_are_checked_before_the_loader(model, kwargs, message):
    from zipmoe_py import Llama

    with pytest.raises(ZipMoEError, match=message):
        Llama(model_path=str(model[0]), n_ctx=128, verbose=False, **kwargs)


def test_device_budgets_size_the_host_set_and_name_a_device_without_one(model):
    """A model on the CPU alone has one set, in host memory ("CPU"): device_budgets sizes it as a budget
    would, given as text, a dict or the environment; a device that holds no set is a load error naming it."""
    from zipmoe_py import Llama
    from zipmoe_py.errors import ZipMoELoadError

    path, one = model
    for given in (f"CPU={6 * one}", {"cpu": 6 * one}):
        llm = Llama(model_path=str(path), n_ctx=128, verbose=False, zipmoe_device_budgets=given)
        try:
            assert llm.zipmoe_stats()["slot_capacity"] == 6, given
        finally:
            llm.close()
    proc = completion(path, environment=env(ZIPMOE_DEVICE_BUDGETS=f"CPU={5 * one}"))
    assert proc.returncode == 0 and slots_in_use(proc.stderr) == 5
    assert b"of 5 slots in use, 0.1 MiB (zipmoe.device_budgets (CPU); available" in proc.stderr
    # the loader names the entry at fault, as Python does
    proc = completion(path, environment=env(ZIPMOE_DEVICE_BUDGETS="CPU=1G cpu=2G"))
    assert proc.returncode != 0 and b"ZIPMOE_DEVICE_BUDGETS (environment) must be like" in proc.stderr
    assert b"got 'CPU=1G cpu=2G': device cpu is named twice" in proc.stderr, proc.stderr[-2000:]
    with pytest.raises(ZipMoELoadError, match="zipmoe.device_budgets names CUDA0, which computes no MoE layer's "
                                              "experts here: the devices with expert slots are CPU"):
        Llama(model_path=str(path), n_ctx=128, verbose=False, zipmoe_device_budgets="CUDA0=1G")


def test_buddy_substitution_from_the_environment_needs_a_profile_too(model):
    from zipmoe_py import Llama

    saved = os.environ.get("ZIPMOE_SUBSTITUTION")
    os.environ["ZIPMOE_SUBSTITUTION"] = "buddy"
    try:
        with pytest.raises(ZipMoEError, match=r"ZIPMOE_SUBSTITUTION \(environment\) = 'buddy' needs zipmoe_buddy_profile"):
            Llama(model_path=str(model[0]), n_ctx=128, verbose=False)
    finally:
        os.environ.pop("ZIPMOE_SUBSTITUTION")
        if saved is not None:
            os.environ["ZIPMOE_SUBSTITUTION"] = saved
    with pytest.raises(ZipMoEError, match=r"kv_overrides\['zipmoe.substitution'\] = 'buddy' needs"):
        Llama(model_path=str(model[0]), n_ctx=128, verbose=False, kv_overrides={"zipmoe.substitution": "buddy"})


def test_a_budget_below_one_expert_is_the_loaders_one_check_named_as_given(model):
    from zipmoe_py import Llama
    from zipmoe_py.errors import ZipMoELoadError

    path, one = model
    said = rf"cannot load .*: {{}} of 1024 bytes cannot hold one expert \({one} bytes: gate \+ up \+ down\); give at least"
    with pytest.raises(ZipMoELoadError, match=said.format("zipmoe_budget")):
        Llama(model_path=str(path), n_ctx=128, verbose=False, zipmoe_budget="1K")
    with pytest.raises(ZipMoELoadError, match=said.format(r"zipmoe\.budget")):
        Llama(model_path=str(path), n_ctx=128, verbose=False, kv_overrides={"zipmoe.budget": 1024})


def test_a_llama_checks_its_arguments_once(model, monkeypatch):
    from zipmoe_py import Llama, bindings

    checked = []
    real = bindings._check_arguments
    monkeypatch.setattr(bindings, "_check_arguments", lambda *args: checked.append(args) or real(*args))
    path, one = model
    llm = Llama(model_path=str(path), n_ctx=128, verbose=False, zipmoe_budget=5 * one)
    assert len(checked) == 1 and not hasattr(llm, "_zipmoe_checked")
    llm.close()


def test_a_llama_pickles_with_its_options_and_gives_the_same_logits(model):
    import pickle

    import numpy as np

    from zipmoe_py import Llama

    path, one = model
    llm = Llama(model_path=str(path), n_ctx=128, verbose=False, logits_all=True, zipmoe_budget=5 * one,
                zipmoe_eviction="lfu")
    copy = pickle.loads(pickle.dumps(llm))
    assert copy.zipmoe_stats()["n_slots"] == 5 and copy.kv_overrides["zipmoe.eviction"] == "lfu"
    tokens = llm.tokenize(PROMPT.encode())
    llm.eval(tokens)
    copy.eval(tokens)
    assert np.array_equal(np.asarray(llm.scores[:len(tokens)]), np.asarray(copy.scores[:len(tokens)]))
    llm.close()
    copy.close()


def test_a_closed_llama_raises_instead_of_crashing(model, tmp_path):
    code = (f"from zipmoe_py import Llama, ZipMoEError\n"
            f"llm = Llama(model_path={str(model[0])!r}, n_ctx=128, verbose=False)\n"
            "llm.close()\n"
            "for call in (lambda: llm.eval([1, 2, 3]), llm.zipmoe_stats, lambda: llm('Hi', max_tokens=2),\n"
            "             lambda: llm.create_chat_completion([{'role': 'user', 'content': 'Hi'}]),\n"
            "             lambda: llm.tokenize(b'Hi'), lambda: llm.detokenize([1])):\n"
            "    try:\n"
            "        call()\n"
            "    except ZipMoEError as e:\n"
            "        assert 'was closed' in str(e), e\n"
            "    else:\n"
            "        raise SystemExit('no error')\n"
            "print('ok')\n")
    proc = run([VENV_BIN / "python", "-c", code], cwd=tmp_path)  # not the source tree's zipmoe_py
    assert proc.returncode == 0 and proc.stdout.strip() == b"ok", proc.stderr.decode()[-2000:]


def test_importing_zipmoe_py_first_gives_llama_cpp_our_library(tmp_path):
    """`import zipmoe_py, llama_cpp` (the order the docs give) loads ZipMoE's libllama, and Llama works after."""
    code = ("import zipmoe_py, llama_cpp\n"
            "from pathlib import Path\n"
            "from zipmoe_py import _paths, Llama\n"
            "assert Path(llama_cpp.llama_cpp._lib._name).resolve() == _paths.shared_library('llama').resolve()\n"
            "print('ok')\n")
    environment = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    proc = run([VENV_BIN / "python", "-c", code], cwd=tmp_path, env=environment)  # not the source tree
    assert proc.returncode == 0 and proc.stdout.strip() == b"ok", proc.stderr.decode()[-2000:]


def test_zipmoe_options_on_a_plain_gguf_are_said_to_do_nothing(tiny_gguf):
    """A budget on a GGUF that is not a ZipMoE GGUF bounds nothing: the user is told, not left to
    believe memory is bounded (Python's warning; llama.cpp's log for the environment and overrides)."""
    from zipmoe_py import Llama

    bf16 = tiny_gguf("qwen2moe")
    with pytest.warns(UserWarning, match=r"is not a ZipMoE GGUF: zipmoe_budget, zipmoe_prefetch do nothing"):
        llm = Llama(model_path=str(bf16), zipmoe_budget="40K", zipmoe_prefetch=True, n_ctx=64, verbose=False)
    llm.close()
    proc = completion(bf16, "--override-kv", "zipmoe.eviction=str:lfu", environment=env(ZIPMOE_BUDGET="18K"))
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert re.search(rb"is not a ZipMoE GGUF \(no zipmoe.format_version\): the ZipMoE options given "
                     rb"\((ZIPMOE_BUDGET, zipmoe.eviction|zipmoe.eviction, ZIPMOE_BUDGET)\) do nothing", proc.stderr)
    # and nothing is said when none was given
    assert b"not a ZipMoE GGUF" not in completion(bf16).stderr


def test_a_budget_from_the_environment_is_named_as_set(model):
    path, one = model
    proc = completion(path, environment=env(ZIPMOE_BUDGET="1K"))
    assert proc.returncode != 0
    assert b"ZIPMOE_BUDGET of 1024 bytes cannot hold one expert" in proc.stderr, proc.stderr.decode()[-2000:]


def test_several_override_kv_flags_all_apply(model):
    """README: several --override-kv add up (llama.cpp keeps each), as one comma-separated value does."""
    path, one = model
    budget = f"zipmoe.budget=int:{5 * one}"
    proc = completion(path, "--override-kv", budget)
    # 5 slots hold too few experts to preload: the preload says so
    assert proc.returncode == 0 and slots_in_use(proc.stderr) == 5 and b"ZipMoE preload: nothing loaded" in proc.stderr
    proc = completion(path, "--override-kv", budget, "--override-kv", "zipmoe.preload=bool:false")
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert slots_in_use(proc.stderr) == 5 and b"ZipMoE preload" not in proc.stderr


def test_a_zipmoe_model_reports_the_parameters_of_its_bf16_original(tiny_gguf, zipmoe_gguf):
    """The chunk tensors hold stored bytes, not parameters: the count is the model's (llama-bench,
    n_params), the same as its BF16 GGUF's; and llama-bench names the build."""
    from zipmoe_py import Llama

    counts = []
    for path in (tiny_gguf("qwen2moe"), zipmoe_gguf("qwen2moe")):
        llm = Llama(model_path=str(path), n_ctx=64, verbose=False)
        counts.append(llm._model.n_params())
        llm.close()
    assert counts[0] == counts[1]
    proc = run([VENV_BIN / "llama-bench", "-m", zipmoe_gguf("qwen2moe"), "-p", 0, "-n", 1, "-t", 2, "-r", 1],
               env=env())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert re.search(rb"build: \w+-zipmoe", proc.stdout + proc.stderr), (proc.stdout + proc.stderr).decode()[-500:]
