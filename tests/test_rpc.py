"""llama.cpp's RPC backend with ZipMoE, on loopback: rpc-server (the fork's ggml-rpc-server, on the venv's
PATH) on 127.0.0.1, one then two; every layer offloaded to them (n_gpu_layers 99); the experts read,
decoded and recovered by the client, their slots in the first server's memory (SET_TENSOR), multiplied
there.

Exactness: the ZipMoE GGUF's logits bit-identical to the BF16 GGUF's with the same RPC setup (stock
llama.cpp's layers on the servers), both architectures, one and four sequences, budgets of one token's
experts per layer, half and all of them (tests/rpc_worker.py, in a child process: RPC devices are
registered once per process). A server killed mid-generation is an error naming it, from Python and from
llama-completion, not a hang or a crash.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zipmoe_py.devtools.ports import free_port
from zipmoe_py.gguf_file import read_metadata
from zipmoe_py.options import size_text

from conftest import run, zipmoe_command
from test_quantized import quant_models  # noqa: F401 (a fixture)
from test_serve import budget_of, expert_geometry

HERE = Path(__file__).resolve().parent
WORKER = HERE / "rpc_worker.py"




def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"rpc-server exited with {proc.returncode}: {proc.stderr.read()}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"rpc-server did not listen on 127.0.0.1:{port} in {timeout} s")


@pytest.fixture
def rpc_servers():
    """start(n) -> (the "host:port,..." of n new rpc-servers on loopback, their processes); stopped after."""
    started = []

    def start(n: int):
        procs, endpoints = [], []
        for _ in range(n):
            port = free_port()
            proc = subprocess.Popen([zipmoe_command("rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "GGML_NO_BACKTRACE": "1"})
            started.append(proc)
            wait_for_port(port, proc)
            procs.append(proc)
            endpoints.append(f"127.0.0.1:{port}")
        return ",".join(endpoints), procs

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def worker(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    return run([sys.executable, WORKER, *args], cwd=HERE, timeout=timeout, text=True,
               env={**os.environ, "GGML_NO_BACKTRACE": "1"})


@pytest.mark.parametrize("n_servers, n_seq", [(1, 1), (2, 4)])
def test_rpc_logits_are_bit_identical_to_stock_over_rpc(arch, n_servers, n_seq, tiny_gguf, zipmoe_gguf, rpc_servers):
    servers, _ = rpc_servers(n_servers)
    budgets = ("top-k", "everything") if n_seq == 1 else ("top-k", "half", "everything")
    proc = worker("exact", arch, tiny_gguf(arch), zipmoe_gguf(arch), servers, n_seq, *budgets)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    one, _, everything = expert_geometry(zipmoe_gguf(arch))
    for name in budgets:
        s = stats[name]
        # the slots hold what the budget does, on the server: every miss's BF16 crossed the network once
        assert s["n_slots"] == budget_of(zipmoe_gguf(arch), arch, name) // one, s["sets"]
        assert s["expert_misses"] > 0 and s["bytes_read"] > 0
        # every expert made full (a miss, or a hit in a host store) crossed the network once
        assert s["h2d_bytes"] == (s["expert_misses"] + s["c_hits"] + s["s_hits"] + s["e_hits"]) * one, (name, s["sets"])
    # fewer slots, more misses: the bytes sent follow the budget
    assert stats["top-k"]["h2d_bytes"] > stats["everything"]["h2d_bytes"]


def test_host_memory_keeps_compressed_experts_beside_a_servers_slots_from_the_prompt(arch, tiny_gguf, zipmoe_gguf,
                                                                                    rpc_servers):
    """Slots on the server, half the experts, zipmoe.device_stores on: from the first context on, host memory
    keeps the other experts compressed (ggml_zipmoe_cache_device_pools), seeded by the prompt's reads, and
    refills hit them instead of the disk; the logits stay stock's over RPC, bit for bit. (The exactness
    test above runs the default: one F pool on the server.)"""
    servers, _ = rpc_servers(1)
    proc = worker("device_pools", arch, tiny_gguf(arch), zipmoe_gguf(arch), servers)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    assert s["memory"]["pools"]["C"] > 0 and "host memory" in s["memory"]["pools_why"], s["memory"]
    assert s["c_hits"] + s["e_hits"] > 0, s


# both architectures, one and four sequences: in two runs
@pytest.mark.parametrize("arch, n_seq", [("qwen2moe", 4), ("deepseek2", 1)])
def test_the_cpu_computes_the_misses_the_balancer_gives_it_beside_a_servers_slots(arch, n_seq, tiny_gguf, zipmoe_gguf,
                                                                                   rpc_servers):
    """zipmoe.cpu_compute (SMoE Alg. 2): of a pass's missing experts, those the CPU-load balancer gives the
    CPU are recovered in host memory and computed by the client, never sent; the rest cross to the server.
    The server is a CPU too, so the logits are stock's over RPC, bit for bit."""
    servers, _ = rpc_servers(1)
    proc = worker("cpu_compute", arch, tiny_gguf(arch), zipmoe_gguf(arch), servers, n_seq)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    one, _, _ = expert_geometry(zipmoe_gguf(arch))
    assert s["cpu_experts"] > 0 and s["device_experts"] > 0 and s["device_ns"] > 0, s
    # every expert made full crossed the network once, but those the CPU computed
    made_full = s["expert_misses"] + s["c_hits"] + s["s_hits"] + s["e_hits"]
    assert s["h2d_bytes"] == (made_full - s["cpu_experts"]) * one, s
    # the balancer weighs the CPU's products at their time on the graphs' threads (1), not the load's
    # first measure on every core
    cores = os.cpu_count() or 1
    assert s["cpu_products_timed_on"] == ([[cores, False], [1, True]] if cores > 1 else [[1, False]]), s


def test_an_unreachable_rpc_server_is_an_error_naming_it(zipmoe_gguf):
    port = free_port()  # nothing listens there
    code = ("import sys; from zipmoe_py import Llama, ZipMoEError\n"
            "try:\n    Llama(model_path=sys.argv[1], rpc_servers=sys.argv[2], n_gpu_layers=99, verbose=False)\n"
            "except ZipMoEError as e:\n    print('error:', e); sys.exit(0)\nsys.exit(1)\n")
    proc = run([sys.executable, "-c", code, zipmoe_gguf("qwen2moe"), f"127.0.0.1:{port}"], text=True, cwd=HERE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"RPC server 127.0.0.1:{port} cannot be reached" in proc.stdout
    for bad in ("localhost", "127.0.0.1:notaport", "127.0.0.1:0"):
        proc = run([sys.executable, "-c", code, zipmoe_gguf("qwen2moe"), bad], text=True, cwd=HERE)
        assert proc.returncode == 0 and f"'{bad}' is not HOST:PORT" in proc.stdout, proc.stdout + proc.stderr
    # the fork's programs: an argument error, not an abort
    proc = run([zipmoe_command("llama-completion"), "-m", zipmoe_gguf("qwen2moe"), "--rpc", f"127.0.0.1:{port}",
                "-ngl", "99", "-p", "hi", "-n", "1", "-no-cnv"], text=True, timeout=120,
               env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert proc.returncode not in (0, -signal.SIGABRT, -signal.SIGSEGV), proc.stderr[-2000:]
    assert f"RPC server 127.0.0.1:{port}: cannot be reached" in proc.stderr
    for bad in ("localhost", "127.0.0.1:notaport"):  # upstream aborted on an endpoint it could not parse
        proc = run([zipmoe_command("llama-completion"), "-m", zipmoe_gguf("qwen2moe"), "--rpc", bad, "-ngl", "99",
                    "-p", "hi", "-n", "1", "-no-cnv"], text=True, timeout=120, env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
        assert f"RPC server {bad}: cannot be reached, is not HOST:PORT" in proc.stderr


def _kill_after_steps(proc: subprocess.Popen, server: subprocess.Popen, steps: int, timeout: float = 300) -> str:
    """Reads proc's stdout until it has printed `steps` lines, kills server, and returns all of stdout."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if len(lines) == steps:
            server.kill()
            server.wait()
            break
    out, err = proc.communicate(timeout=timeout)  # a hang fails here
    return "".join(lines) + out, err


@pytest.mark.parametrize("n_servers", [1, 2])
def test_an_rpc_server_dying_mid_generation_is_a_clear_error(n_servers, zipmoe_gguf, rpc_servers):
    servers, procs = rpc_servers(n_servers)
    victim = servers.split(",")[-1]
    proc = subprocess.Popen([sys.executable, WORKER, "die", zipmoe_gguf("qwen2moe"), servers], cwd=HERE, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    try:
        out, err = _kill_after_steps(proc, procs[-1], 3)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-1000:] + err[-3000:]
    error = [line for line in out.splitlines() if line.startswith("error:")]
    assert error and f"RPC server {victim}" in error[0] and "connection lost" in error[0], out[-1000:]


def test_llama_completion_with_a_dying_rpc_server_ends_with_the_error(zipmoe_gguf, rpc_servers):
    servers, procs = rpc_servers(1)
    proc = subprocess.Popen([zipmoe_command("llama-completion"), "-m", zipmoe_gguf("qwen2moe"), "--rpc", servers,
                             "-ngl", "99", "-p", "hi", "-n", "100000", "--ignore-eos", "-no-cnv", "-t", "1"],
                            # a random seed's text: a tiny model's token pieces need not be whole UTF-8
                            text=True, errors="replace", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    try:
        got = ""
        while len(got) < 20:  # some generated text, then the server goes
            char = proc.stdout.read(1)
            assert char, proc.stderr.read()[-3000:]
            got += char
        procs[0].kill()
        procs[0].wait()
        _, err = proc.communicate(timeout=120)  # a hang fails here
    finally:
        proc.kill()
    # an error exit (no abort, no silent SIGPIPE) that says what happened
    assert proc.returncode not in (0, -signal.SIGPIPE, -signal.SIGABRT, -signal.SIGSEGV), (proc.returncode, err[-3000:])
    assert f"RPC server {servers}" in err and "connection lost" in err, err[-3000:]


def test_rpc_server_is_on_the_path():
    proc = run([zipmoe_command("rpc-server"), "--help"], text=True)
    assert proc.returncode == 0 and "--port" in proc.stderr + proc.stdout


def test_zipmoe_chat_over_rpc_answers_as_it_does_alone(zipmoe_gguf, rpc_servers):
    servers, _ = rpc_servers(1)
    chat = [zipmoe_command("zipmoe-chat"), zipmoe_gguf("qwen2moe"), "-p", "Hi", "-n", 8, "--temp", 0, "-t", 2]
    alone = run(chat, text=True, cwd=HERE)
    over_rpc = run([*chat, "--rpc", servers, "-ngl", 99], text=True, cwd=HERE,
                   env={**os.environ, "GGML_NO_BACKTRACE": "1"})
    assert alone.returncode == 0 and over_rpc.returncode == 0, alone.stderr[-2000:] + over_rpc.stderr[-2000:]
    assert over_rpc.stdout == alone.stdout and alone.stdout.strip()
    assert "does nothing" not in over_rpc.stderr  # -ngl has somewhere to go
    unreachable = run([*chat, "--rpc", f"127.0.0.1:{free_port()}", "-ngl", 99], text=True, cwd=HERE)
    assert unreachable.returncode != 0 and "Traceback" not in unreachable.stderr
    assert "--rpc: RPC server 127.0.0.1:" in unreachable.stderr and "cannot be reached" in unreachable.stderr


def test_a_port_that_is_not_an_rpc_server_is_an_error_naming_it_not_a_hang(zipmoe_gguf, tmp_path):
    """A port that accepts connections but never answers the handshake (another program's, here a socket
    that listens and reads nothing): the handshake's wait is bounded, and the error names the endpoint. The
    fork's CLI and zipmoe-chat wait on it at once (the wait is 10 s)."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        endpoint = f"127.0.0.1:{mute.getsockname()[1]}"
        env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
        started = time.monotonic()
        with open(tmp_path / "cli.err", "w") as err:  # a file: a pipe left undrained while chat runs would fill
            cli = subprocess.Popen([zipmoe_command("llama-completion"), "-m", str(zipmoe_gguf("qwen2moe")), "--rpc",
                                    endpoint, "-ngl", "99", "-p", "Hello", "-n", "4", "-no-cnv"],
                                   stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL, env=env)
        chat = run([zipmoe_command("zipmoe-chat"), zipmoe_gguf("qwen2moe"), "-p", "Hi", "-n", 4, "--rpc", endpoint,
                    "-ngl", 99], text=True, cwd=HERE, timeout=120, env=env)
        cli.wait(timeout=120)
        cli_err = (tmp_path / "cli.err").read_text()
        assert cli.returncode not in (0, -signal.SIGABRT, -signal.SIGSEGV), cli_err[-2000:]
        assert f"RPC server {endpoint}: the handshake failed" in cli_err, cli_err[-2000:]
        assert time.monotonic() - started < 60
        assert chat.returncode not in (0, -signal.SIGABRT, -signal.SIGSEGV) and "Traceback" not in chat.stderr
        assert endpoint in chat.stderr and "handshake" in chat.stderr, chat.stderr[-2000:]


PLACEMENTS = {"n_cpu_moe": {"n_cpu_moe": 3},
              "override_tensor": {"override_tensor": r"blk\.(2|5|6)\.ffn_(up|down|gate)_exps=CPU"}}


# both architectures, both ways of keeping experts on the client, one and four sequences: in two runs
@pytest.mark.parametrize("arch, where, n_seq", [("qwen2moe", "n_cpu_moe", 1), ("deepseek2", "override_tensor", 4)])
def test_each_layers_slots_are_where_stock_puts_its_experts_and_bit_identical(arch, where, n_seq, tiny_gguf,
                                                                              zipmoe_gguf, rpc_servers):
    """Two rpc-servers take every layer (n_gpu_layers 99), some layers' experts kept in host memory (llama.cpp's
    --n-cpu-moe, -ot): a slot set per device, each MoE layer's slots on the device stock's loader gave that
    layer's experts (its debug log), and every logit bit-identical to stock with the same placement."""
    servers, _ = rpc_servers(2)
    budgets = ("top-k", "half", "everything") if n_seq == 4 else ("top-k", "everything")
    proc = worker("placement", arch, tiny_gguf(arch), zipmoe_gguf(arch), servers, n_seq,
                  json.dumps(PLACEMENTS[where]), *budgets)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    one, _, _ = expert_geometry(zipmoe_gguf(arch))
    for name in budgets:
        run_ = out["runs"][name]
        slots = {int(layer): device for layer, device in run_["slots"].items()}
        assert slots and all(slots[layer] == out["stock"][str(layer)] for layer in slots), (name, slots, out["stock"])
        # one set per device stock computes experts on: host memory (some layers' experts kept there) and a server
        assert sorted(run_["sets"]) == sorted(set(slots.values())) and "CPU" in slots.values(), run_["sets"]
        assert any(device.startswith("RPC") for device in run_["sets"]), run_["sets"]
        assert run_["n_slots"] * one <= budget_of(zipmoe_gguf(arch), arch, name) + 3 * one
        assert run_["h2d_bytes"] > 0  # the servers' misses crossed the network


def test_quantized_slots_per_device_are_bit_identical(quant_models, rpc_servers):
    """The same on a Q4_K_M file (Q4_K and Q6_K experts stored raw): the host set in the buffer type stock
    gives experts overridden to the CPU (ggml-cpu's repacking one for Q4_K on x86), a server's set in its memory."""
    stock, zipmoe = quant_models("qwen2moe", "Q4_K_M")
    servers, _ = rpc_servers(2)
    proc = worker("placement", "qwen2moe", stock, zipmoe, servers, 4, json.dumps({"n_cpu_moe": 1}),
                  "top-k", "everything")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, run_ in out["runs"].items():
        slots = {int(layer): device for layer, device in run_["slots"].items()}
        assert slots == {int(k): v for k, v in out["stock"].items() if int(k) in slots}, (name, slots, out["stock"])
        assert slots[0] == "CPU" and slots[1].startswith("RPC"), slots


def test_device_budgets_size_each_servers_set(zipmoe_gguf, rpc_servers):
    """zipmoe.device_budgets gives each server's set its own slots, sized from and reported as that server's
    memory; one below a token's experts is warned of; a device that holds no set is an error naming it and
    the devices that do."""
    servers, _ = rpc_servers(2)
    one, _, _ = expert_geometry(zipmoe_gguf("qwen2moe"))
    proc = worker("device_budgets", zipmoe_gguf("qwen2moe"), servers, f"RPC0={3 * one} rpc1={7 * one}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["slots"] == {"RPC0": 3, "RPC1": 7}
    for device in ("RPC0", "RPC1"):
        plan = out["memory"][device]
        assert plan["source"] == f"{device}'s free memory" and plan["contexts"] == plan["margin"] == 0, plan
        assert plan["fits"] == plan["available"] - plan["non_expert"] and plan["non_expert"] > 0, plan
    top_k = read_metadata(zipmoe_gguf("qwen2moe"))["qwen2moe.expert_used_count"]
    short = [w for w in out["warnings"] if "fewer than the" in w]
    assert len(short) == 1 and f"zipmoe.device_budgets (RPC0) of {size_text(3 * one)} holds 3 expert(s), fewer " \
        f"than the {top_k} a token selects" in short[0], out["warnings"]
    # /metrics: each cache's series labelled with its device, a metric's lines together under one # TYPE
    lines = out["metrics"].splitlines()
    hits = [i for i, line in enumerate(lines) if line.startswith("zipmoe:expert_misses_total")]
    assert [lines[i].split(" ")[0] for i in hits] == ['zipmoe:expert_misses_total{device="RPC0"}',
                                                      'zipmoe:expert_misses_total{device="RPC1"}'], hits
    assert hits[1] == hits[0] + 1 and lines.count("# TYPE zipmoe:expert_misses_total counter") == 1
    proc = worker("device_budgets", zipmoe_gguf("qwen2moe"), servers, "RPC0=1G CUDA3=2G")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    error = json.loads(proc.stdout.strip().splitlines()[-1])["error"]
    assert "zipmoe_device_budgets names CUDA3" in error and "are RPC0, RPC1" in error, error
