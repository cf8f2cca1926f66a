"""Faults injected into expert chunk reads: every read of a generation in turn fails (EIO), comes back
short, or comes back with a flipped bit. Each fault is an error naming layer, tensor, expert and
chunk; the process goes on, and once the fault is gone the same request gives bit-exact logits. A
fault in a read ahead (a prompt's next pass, read while this one computes) is no error: the pass
reads that chunk again itself, and the generation is bit-exact.

The injector is tests/fault_shim.c, a test-only LD_PRELOAD shim over pread(2), compiled here.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from test_server import Server

HERE = Path(__file__).resolve().parent
NAMED = re.compile(r"layer \d+, tensor blk\.\d+\.ffn_(gate|up|down)_exps\.weight, expert \d+, "
                   r"(SM-chunk|E-chunk \(shard \d+\))")
REASONS = {"eio": "Input/output error", "short": "is truncated", "flip": "checksum mismatch"}


def _env(shim: Path, control: Path, model: Path) -> dict:
    return {**os.environ, "LD_PRELOAD": str(shim), "ZIPMOE_FAULT_CONTROL": str(control),
            "ZIPMOE_FAULT_MATCH": model.name}


# the in-process sweep: runs in a child process, since LD_PRELOAD applies from a process's start
SWEEP = textwrap.dedent('''
    import ctypes, json, sys
    import numpy as np
    from zipmoe_py import Llama, ZipMoEError

    model, control, kinds, points = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
    shim = ctypes.CDLL(None)
    shim.zipmoe_fault_reads.restype = shim.zipmoe_fault_fired.restype = ctypes.c_long
    # a few experts of budget, no preload: a generation reads experts all along
    llm = Llama(model_path=model, n_ctx=256, n_threads=2, zipmoe_budget="100K", zipmoe_preload=False, verbose=False)
    prompt = llm.tokenize(b"The experts of a mixture are read from the disk when the router picks them")
    steps = [prompt] + [[t] for t in llm.tokenize(b" one two three", add_bos=False)]

    def generate():
        """the prompt, then one token at a time: the logits of every step"""
        llm.reset()
        out = []
        for tokens in steps:
            llm.eval(tokens)
            out.append(np.array(llm.scores[llm.n_tokens - 1], copy=True))
        return out

    seq = 0
    def arm(at, kind):
        global seq
        seq += 1
        with open(control, "w") as f:
            f.write(f"{seq} {at} {kind}")

    arm(0, "eio")
    reference = generate()
    # reads ahead make the count vary with timing (how much of a bank is read before its pass takes it):
    # the fewest of five generations is the last point swept (a generation that falls short runs again;
    # with the fewest of three, the full suite once had three tries in a row fall short of DeepSeek's last)
    per_run = None
    for _ in range(5):
        before = shim.zipmoe_fault_reads()
        generate()
        n = shim.zipmoe_fault_reads() - before
        per_run = n if per_run is None else min(per_run, n)
    results = {"reads_per_generation": per_run, "faults": []}
    # the sweep's own generations may read fewer still (the full suite once saw Qwen's 565th read, the
    # fewest of five generations, missed by five tries in a row): its last point is a tenth short of it
    last = max(1, per_run - per_run // 10)
    for kind in kinds:
        for at in sorted(set(range(1, last + 1, max(1, last // points))) | {last}):
            # a generation that read fewer than `at` chunks (timing: 4732-4745 of DeepSeek's, one machine)
            # never reached the fault: it is run again, up to four times, with the fault armed afresh
            for _ in range(5):
                fired, reads = shim.zipmoe_fault_fired(), shim.zipmoe_fault_reads()
                arm(at, kind)
                error, exact_during = None, False
                try:
                    exact_during = all(np.array_equal(a, b) for a, b in zip(generate(), reference))
                except ZipMoEError as e:
                    error = str(e)
                if shim.zipmoe_fault_fired() > fired or shim.zipmoe_fault_reads() - reads >= at:
                    break
            arm(0, kind)
            exact = all(np.array_equal(a, b) for a, b in zip(generate(), reference))
            results["faults"].append({"kind": kind, "at": at, "fired": shim.zipmoe_fault_fired() - fired,
                                      "error": error, "exact_during": exact_during, "exact_after": exact})
    print(json.dumps(results))
''')


# sweep points per kind: DeepSeek-V2's 26 MoE layers make ~8x the reads of Qwen's 4, each generation slower
@pytest.mark.parametrize("arch, points", [("qwen2moe", 25), ("deepseek2", 4)])
def test_every_read_of_a_generation_fails_in_turn_and_is_named(shim, zipmoe_gguf, tmp_path, arch, points):
    model, control = zipmoe_gguf(arch), tmp_path / "control"
    control.write_text("")
    proc = subprocess.run([sys.executable, "-c", SWEEP, str(model), str(control), "eio,short,flip", str(points)],
                          capture_output=True, text=True, timeout=900, env=_env(shim, control, model), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["reads_per_generation"] > 20  # the budget makes the generation read all along
    faults = results["faults"]
    assert len(faults) >= 3 * points
    absorbed = [f for f in faults if f["error"] is None]
    assert len(absorbed) <= len(faults) // 3, absorbed  # most reads are a pass's own
    for f in faults:
        assert f["fired"] == 1, f  # the sweep stays within the generation's reads
        if f["error"] is None:  # it hit a read ahead: read again by the pass, the generation exact
            assert f["exact_during"], f
        else:
            assert NAMED.search(f["error"]) and model.name in f["error"], f
            assert REASONS[f["kind"]] in f["error"], f
        assert f["exact_after"], f
    print(f"\n{arch}: {results['reads_per_generation']} chunk reads per generation; {len(faults)} faults "
          f"injected (eio, short, flip), each named, each followed by bit-exact logits")


def test_faults_through_the_server_are_named_and_serving_goes_on(shim, zipmoe_gguf, tmp_path):
    model, control = zipmoe_gguf("qwen2moe"), tmp_path / "control"
    control.write_text("")
    env = _env(shim, control, model)
    saved = dict(os.environ)
    os.environ.update(env)  # the server started below inherits the injector
    try:
        server = Server("--model", str(model), "--model_alias", "tiny", "--n_ctx", "256", "--zipmoe_budget", "100K",
                        "--zipmoe_preload", "false", "--verbose", "false")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        clean = server.chat("Tell me about disks.", max_tokens=8)
        for seq, (at, kind) in enumerate([(1, "eio"), (7, "short"), (30, "flip"), (90, "eio")], start=1):
            control.write_text(f"{seq} {at} {kind}")
            status, reply = server.post("/v1/chat/completions", json.dumps({
                "messages": [{"role": "user", "content": "Tell me about disks."}], "max_tokens": 8,
                "temperature": 0}).encode())
            assert status == 500, reply
            message = reply["error"]["message"]
            assert NAMED.search(message) and REASONS[kind] in message, message
            control.write_text(f"{seq} 0 {kind}")
            assert server.chat("Tell me about disks.", max_tokens=8) == clean
        assert json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=10).read())["data"]
    finally:
        server.close()
