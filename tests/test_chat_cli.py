"""zipmoe-chat's command line: -c as llama.cpp sizes it, llama.cpp's short letters, values
that start with -, and commands that are never sent to the model."""
from __future__ import annotations

import pytest

from zipmoe_py import cli, options

from conftest import EARLY, early_result, run, start_early, zipmoe_command

LONG_PROMPT = " ".join(["word"] * 300)

# llama.cpp's short flags (common/arg.cpp of the pinned upstream) and one long name of each
LLAMA_CPP_SHORT = {"-h": "--help", "-m": "--model", "-p": "--prompt", "-n": "--n-predict", "-c": "--ctx-size",
                   "-b": "--batch-size", "-ub": "--ubatch-size", "-t": "--threads", "-tb": "--threads-batch",
                   "-s": "--seed", "-ngl": "--n-gpu-layers", "-sys": "--system-prompt", "-f": "--file",
                   "-i": "--interactive", "-r": "--reverse-prompt", "-v": "--verbose", "-co": "--color",
                   "-fa": "--flash-attn", "-ctk": "--cache-type-k", "-ctv": "--cache-type-v", "-np": "--parallel",
                   "-ot": "--override-tensor", "-cmoe": "--cpu-moe", "-ncmoe": "--n-cpu-moe"}


def _chat(model, *args, stdin=b""):
    return run([zipmoe_command("zipmoe-chat"), model, "-n", 6, "--temp", 0, "-t", 2, *args], input=stdin)


def _error_lines(stderr: bytes) -> list[str]:
    return [line for line in stderr.decode().splitlines() if "error" in line]


def test_the_context_is_the_one_llama_cpp_makes_and_is_named(tiny_gguf):
    model = tiny_gguf("qwen2moe")
    # llama.cpp rounds -c 16 up to 256: a prompt past 16 tokens fits (llama-cpp-python's arrays used to
    # stay at 16: "could not broadcast input array from shape (5,) into shape (0,)")
    small = _chat(model, "-p", "Hello there friend", "-c", 16)
    assert small.returncode == 0, small.stderr.decode()[-2000:]
    assert small.stdout == _chat(model, "-p", "Hello there friend", "-c", 256, "-b", 16).stdout  # the same batches
    too_long = _chat(model, "-p", LONG_PROMPT, "-c", 16)
    assert too_long.returncode == 1
    assert _error_lines(too_long.stderr) == [
        "zipmoe-chat: error: the conversation does not fit the context of 256 tokens (-c 16 was raised to 256 by "
        f"llama.cpp, which rounds the context size up to a multiple of 256): it takes {_tokens(too_long)} tokens"]
    assert b"broadcast" not in too_long.stderr and b"Traceback" not in too_long.stderr
    exact = _chat(model, "-p", LONG_PROMPT, "-c", 256)  # -c as given
    assert exact.returncode == 1
    assert b"does not fit the context of 256 tokens (-c 256): it takes" in exact.stderr


def _tokens(proc) -> str:
    return proc.stderr.decode().rsplit("it takes ", 1)[1].split()[0]


def test_short_flags_mean_what_they_mean_to_llama_cpp(monkeypatch, capsys):
    ap = cli.build_parser()
    shorts = {s: a for a in ap._actions for s in a.option_strings if not s.startswith("--")}
    assert {"-m", "-p", "-n", "-c", "-b", "-t", "-s", "-ngl", "-sys"} <= set(shorts)
    for short, action in shorts.items():
        assert short in LLAMA_CPP_SHORT and LLAMA_CPP_SHORT[short] in action.option_strings, (short, action)
    assert all(s.startswith("--") for o in options.python_options() for s in ap._option_string_actions
               if ap._option_string_actions[s].dest == o.kwarg)  # the option table's flags are long only

    # -b is the batch size (llama.cpp's n_batch), not the expert-cache budget; -m is the model
    given = {}

    class Stop(Exception):
        pass

    def fake_llama(model_path, **kwargs):
        given.update(kwargs, model_path=model_path)
        raise Stop

    monkeypatch.setattr("zipmoe_py.bindings.Llama", fake_llama)
    with pytest.raises(Stop):
        cli.main(["-m", "some.gguf", "-b", "64", "--budget", "18K", "-p", "Hi"])
    assert given["model_path"] == "some.gguf" and given["n_batch"] == 64 and given["zipmoe_budget"] == 18 << 10
    given.clear()
    with pytest.raises(Stop):
        cli.main(["some.gguf", "-p", "Hi", "-sys", "be brief"])
    assert given["model_path"] == "some.gguf" and "n_batch" not in given  # llama-cpp-python's default
    given.clear()
    with pytest.raises(Stop):  # llama.cpp's placement flags reach Llama's keyword arguments
        cli.main(["some.gguf", "-p", "Hi", "-ngl", "99", "-ncmoe", "3", "-ot", r"blk\.7\.ffn_.*_exps=CPU"])
    assert given["n_cpu_moe"] == 3 and given["override_tensor"] == r"blk\.7\.ffn_.*_exps=CPU" and "cpu_moe" not in given
    for argv, message in ((["-b", "18K"], "argument -b/--batch-size: must be a whole number of tokens > 0 (the "
                                          "batch size, as llama.cpp's -b; the expert-cache budget is --budget); "
                                          "got '18K'"),
                          (["-b", "0"], "argument -b/--batch-size: must be a whole number of tokens > 0"),
                          (["-m", "a.gguf", "b.gguf"], "give the model once: -m a.gguf or b.gguf, not both")):
        with pytest.raises(SystemExit) as stop:
            cli.main([*argv, "-p", "Hi"])
        assert stop.value.code == 2
        assert message in capsys.readouterr().err


def test_a_value_may_start_with_a_dash(capsys):
    budget = options.find("budget")
    for argv in (["--budget", "-5G"], ["--budget=-5G"]):
        with pytest.raises(SystemExit) as stop:
            cli.main([*argv, "-p", "Hi"])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --budget: must be {budget.expects}; got '-5G'" in err, err
        assert "expected one argument" not in err
    ap = cli.build_parser()

    def parse(*argv):
        return ap.parse_args(cli.values_may_start_with_dash(ap, list(argv)))

    assert parse("-p", "-x").prompt == "-x"
    assert parse("--prompt", "-x", "-n", "-1").n_predict == -1
    assert parse("--system-prompt", "-be brief").system == "-be brief"
    assert parse("--buddy-tau", "-1").zipmoe_buddy_tau == -1.0
    assert parse("--budg", "1K").zipmoe_budget == 1024  # argparse's abbreviations still work
    with pytest.raises(SystemExit):
        parse("--budget", "--stats")  # a flag after a flag is still one
    assert "argument --budget: expected one argument" in capsys.readouterr().err
    # the console script reads sys.argv the same way
    proc = run([zipmoe_command("zipmoe-chat"), "--budget", "-5G", "-p", "Hi"])
    assert proc.returncode == 2 and f"must be {budget.expects}; got '-5G'".encode() in proc.stderr, proc.stderr


def test_commands_are_never_sent_to_the_model(tiny_gguf):
    model = tiny_gguf("qwen2moe")
    hello = _chat(model, "-p", "Hello")
    driven = _chat(model, stdin=b"/foo bar\n/HELP\nHello\n/bye\n")
    assert driven.returncode == 0, driven.stderr.decode()[-2000:]
    assert driven.stdout == hello.stdout  # only Hello was answered
    err = driven.stderr.decode()
    assert "zipmoe-chat: unknown command /foo; /help lists them" in err
    assert "zipmoe-chat: unknown command /HELP; /help lists them" in err
    assert "zipmoe-chat: unknown command /bye; /help lists them" in err
    # // sends a message that starts with /
    slashed = _chat(model, stdin=b"/help\n//foo\n")
    assert slashed.returncode == 0
    assert slashed.stdout == _chat(model, "-p", "/foo").stdout and slashed.stdout.strip()
    assert cli.HELP_TEXT in slashed.stderr.decode()


def test_gpu_layers_are_said_to_do_nothing_only_on_a_build_without_a_gpu(tiny_gguf):
    proc = _chat(tiny_gguf("qwen2moe"), "-p", "Hi", "-ngl", 99)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    warned = b"warning: -ngl 99 does nothing: this build has no GPU backend" in proc.stderr
    assert warned == (not cli._gpu_offload())  # a CUDA build offloads: no warning there


def test_a_budget_reduced_to_fit_is_said_without_verbose(zipmoe_gguf):
    """The README says a budget that does not fit is reduced, with a warning: zipmoe-chat says so without
    --verbose too, as llama-completion does, in the loader's words (the numbers)."""
    proc = _chat(zipmoe_gguf("qwen2moe"), "-p", "Hi", "--budget", "10M", "--mem-limit", "1M")
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    warnings = [line for line in proc.stderr.decode().splitlines() if line.startswith("zipmoe-chat: warning: ")]
    assert any("zipmoe.budget of 10.0 MiB does not fit: available" in line for line in warnings), proc.stderr.decode()[-2000:]
    assert b"UserWarning" not in proc.stderr and b"warnings.warn" not in proc.stderr


def test_options_on_a_plain_gguf_are_named_as_flags(tiny_gguf):
    """A ZipMoE flag on a plain GGUF does nothing: said in zipmoe-chat's words (--budget), not as a raw Python
    warning naming the keyword argument."""
    proc = _chat(tiny_gguf("qwen2moe"), "-p", "Hi", "--budget", "256K")
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert b"zipmoe-chat: warning: " in proc.stderr and b"is not a ZipMoE GGUF: --budget does nothing" in proc.stderr
    assert b"UserWarning" not in proc.stderr and b"zipmoe_budget" not in proc.stderr


def _first_demo_chat(cache):
    """zipmoe-chat with no model and an empty cache: it trains the demo (two minutes on one core)."""
    import os

    return start_early(cache, [zipmoe_command("zipmoe-chat"), "-p", "What is a mixture of experts?", "-n", 32,
                               "--temp", 0], env={**os.environ, "XDG_CACHE_HOME": str(cache)})


EARLY["test_chat_cli.py::test_the_demo_model_answers_in_words"] = _first_demo_chat


def test_the_demo_model_answers_in_words():
    """With no model, zipmoe-chat makes the demo (trained once, with a progress bar) and answers what it was
    taught, in words, through the expert cache; a second run uses the file made by the first."""
    import os

    code, stdout, stderr, cache = early_result("test_chat_cli.py::test_the_demo_model_answers_in_words", timeout=900)
    assert code == 0, stderr.decode()[-2000:]
    assert b"training the demo model" in stderr and b"400/400" in stderr
    assert stdout.decode().startswith("A mixture of experts is a model in which a small router sends every "
                                      "token to a few of many experts"), stdout
    again = run([zipmoe_command("zipmoe-chat"), "-p", "What does the budget option do?", "-n", 24, "--temp", 0],
                env={**os.environ, "XDG_CACHE_HOME": str(cache)}, timeout=300)
    assert again.returncode == 0 and b"training" not in again.stderr, again.stderr.decode()[-2000:]
    assert again.stdout.decode().startswith("The budget option sets the memory for the expert slots"), again.stdout


def test_stats_name_each_slot_set_and_give_the_host_sets_memory(zipmoe_gguf, capsys):
    """--stats with slot sets on several devices: a line per set (device, layers, slots, the memory its slots
    were sized from: a device set's its device's), and the host set's whole plan and pools."""
    from zipmoe_py import Llama
    from zipmoe_py.options import size_text

    llm = Llama(model_path=str(zipmoe_gguf("qwen2moe")), n_ctx=128, n_threads=2, verbose=False, zipmoe_budget="64K")
    try:
        llm.create_completion("Hi", max_tokens=2)
        stats = llm.zipmoe_stats()
    finally:
        llm.close()
    host = stats["sets"][0]
    device = dict(host, device="CUDA0", layers=[5, 6, 7],
                  memory=dict(host["memory"], available=8 << 30, non_expert=3 << 30, fits=5 << 30,
                              source="CUDA0's free memory"))

    class TwoSets:
        def zipmoe_stats(self):
            return dict(stats, sets=[device, dict(host, layers=[0, 1, 2, 4])])

    cli._print_stats(TwoSets(), None, 2)
    err = capsys.readouterr().err
    assert "[stats] slot set in CUDA0 memory: MoE layers 5-7, " in err
    assert "available 8.00 GiB (CUDA0's free memory) - its other weights, KV cache and compute buffers, a reserve and " \
           "zero slots 3.00 GiB = 5.00 GiB for slots" in err, err
    assert f"[stats] slot set in host memory: MoE layers 0-2, 4, {host['n_slots']} slots in use" in err
    assert err.count("[stats] memory:") == 1 and f"available {size_text(host['memory']['available'])}" in err
