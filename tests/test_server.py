"""zipmoe-server: llama-cpp-python's OpenAI server on the fork, driven by the real OpenAI client.

A live server on 127.0.0.1 (the installed zipmoe-server command) serving a tiny Qwen2-MoE ZipMoE
GGUF from an expert budget of a few experts, so that every request reads experts from the file.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from zipmoe_py.devtools.live_server import SERVER, Server, free_port as _free_port

BUDGET = "100K"  # 5 slots of this model's 18 KiB experts: most selections are read from the file
# the server's own memory besides the model's (Python, FastAPI, uvicorn, llama-cpp-python): the
# README's "Serve" section states it
SERVER_OVERHEAD = 300 << 20
PROMPTS = ["Tell me a story.", "What is a mixture of experts?", "Count to five.", "Name a colour.",
           "Why is the sky blue?", "Write a haiku about disks."]


@pytest.fixture(scope="module")
def server(zipmoe_gguf):
    s = Server("--model", str(zipmoe_gguf("qwen2moe")), "--model_alias", "tiny", "--n_ctx", "512",
               "--zipmoe_budget", BUDGET, "--verbose", "false")
    yield s
    s.close()
    assert s.proc.returncode is not None


def test_chat_completion_models_and_zipmoe_stats(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    stats = server.get("/zipmoe/stats")
    assert stats["model"] == "tiny"
    zipmoe = stats["zipmoe"]
    assert zipmoe["n_slots"] == 5 and zipmoe["memory"]["budget"] == 100 * 1024
    assert zipmoe["expert_misses"] > 0 and zipmoe["bytes_read"] > 0  # served from the file, under budget


def test_streaming_gives_the_same_text_as_one_response(server):
    whole = server.chat(PROMPTS[0], max_tokens=16)
    stream = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                   max_tokens=16, temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(pieces) > 2 and "".join(pieces) == whole


def test_concurrent_clients_get_the_answers_they_get_alone(server):
    """4 clients x 3 requests at once: every one answered, each answer at temperature 0 the one the same
    request gets alone, the server's memory within the model's sizing + its overhead."""
    server.chat("warm-up")
    alone = {p: server.chat(p) for p in PROMPTS}
    results, latencies, errors = [], [], []
    peak = [server.rss()]
    done = threading.Event()

    def watch_rss():
        while not done.wait(0.05):
            peak[0] = max(peak[0], server.rss())

    def client(i: int):
        for j in range(3):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            t = time.perf_counter()
            try:
                results.append((prompt, server.chat(prompt)))
                latencies.append(time.perf_counter() - t)
            except Exception as e:  # reported below, with the others
                errors.append(repr(e))

    watcher = threading.Thread(target=watch_rss)
    watcher.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    done.set()
    watcher.join()
    assert errors == [] and len(results) == 12
    for prompt, answer in results:
        assert answer == alone[prompt], prompt
    latencies.sort()
    p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]
    memory = server.get("/zipmoe/stats")["zipmoe"]["memory"]
    sizing = memory["non_expert"] + memory["contexts"] + memory["cache_buffers"] + memory["budget"]
    print(f"\nload: 4 clients x 3 requests, 0 failures, p50 {statistics.median(latencies):.2f} s, "
          f"p95 {p95:.2f} s, peak RSS {peak[0] / 2**20:.0f} MiB (sizing {sizing / 2**20:.0f} MiB)")
    assert peak[0] <= sizing + SERVER_OVERHEAD


@pytest.mark.parametrize("body, field", [
    (b"{not json", None),
    (b'{"messages": "hello"}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', "max_tokens"),
    (b'[1, 2]', None),
    (b'{"messages": [{"role": "user", "content": null}]}', "messages.0.content"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -3}', "temperature"),
])
def test_malformed_requests_get_a_400_and_serving_goes_on(server, body, field):
    status, reply = server.post("/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] == field
    assert server.chat("Still there?", max_tokens=4)


def test_a_config_file_sets_zipmoe_options_per_model(zipmoe_gguf, tmp_path):
    config = tmp_path / "server.yaml"
    port = _free_port()
    config.write_text(f"host: 127.0.0.1\nport: {port}\nmodels:\n  - model: {zipmoe_gguf('qwen2moe')}\n"
                      f"    model_alias: tiny\n    n_ctx: 256\n    verbose: false\n    zipmoe_budget: 60K\n"
                      f"    zipmoe_eviction: lru\n")
    s = Server("--config_file", str(config), port=port)  # the file's settings replace the flags
    try:
        assert s.chat("Hello", max_tokens=4)
        stats = s.get("/zipmoe/stats")["zipmoe"]
        assert stats["n_slots"] == 3 and stats["memory"]["budget"] == 60 * 1024
    finally:
        s.close()


@pytest.mark.parametrize("route, body, field", [
    ("/v1/completions", b'{"prompt": "", "max_tokens": 4}', "prompt"),
    ("/v1/completions", b'{"prompt": ["a", "b"], "max_tokens": 4}', "prompt"),
    ("/v1/embeddings", b'{"input": "hello"}', "input"),
])
def test_what_llama_cpp_pythons_server_answered_with_an_empty_500_is_a_400_naming_it(server, route, body, field):
    status, reply = server.post(route, body)
    assert status == 400 and reply["error"]["param"] == field and reply["error"]["message"], reply
    assert server.chat("Name a colour.", max_tokens=4)


def test_a_request_waits_for_a_running_stream_instead_of_cutting_it_off(server):
    """llama-cpp-python's default interrupts a stream when another request arrives (its client then
    gets no finish_reason): here the second waits, and both finish."""
    stream = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                   max_tokens=24, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    other = []
    t = threading.Thread(target=lambda: other.append(server.chat("Count to five.", max_tokens=4)))
    t.start()
    rest = list(chunks)
    t.join()
    finishes = [c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] and other and other[0]


def test_stats_do_not_load_another_model_of_a_config_file(zipmoe_gguf, tmp_path):
    """With two models, /zipmoe/stats reports the one in use: it neither loads the default one nor
    resets the counters of the one in use."""
    config = tmp_path / "server.yaml"
    port = _free_port()
    model = zipmoe_gguf("qwen2moe")
    config.write_text(f"host: 127.0.0.1\nport: {port}\nmodels:\n"
                      f"  - {{model: {model}, model_alias: first, n_ctx: 256, verbose: false, zipmoe_budget: 60K}}\n"
                      f"  - {{model: {model}, model_alias: second, n_ctx: 256, verbose: false, zipmoe_budget: 80K}}\n")
    s = Server("--config_file", str(config), port=port)
    try:
        s.client.chat.completions.create(model="second", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        first_look, second_look = s.get("/zipmoe/stats"), s.get("/zipmoe/stats")
        assert first_look["model"] == second_look["model"] == "second"
        assert second_look["zipmoe"]["expert_misses"] == first_look["zipmoe"]["expert_misses"] > 0
    finally:
        s.close()


@pytest.mark.parametrize("args, message", [
    (["--zipmoe_budget", "lots"], "zipmoe_budget"),
    (["--zipmoe_eviction", "random"], "zipmoe_eviction"),
])
def test_a_bad_option_stops_the_server_with_a_message_naming_it(zipmoe_gguf, args, message):
    proc = subprocess.run([str(SERVER), "--model", str(zipmoe_gguf("qwen2moe")), "--port", str(_free_port()), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_models_are_not_locked_by_default():
    """llama-cpp-python's server locks models unless told not to; a lock of a ZipMoE file would read
    and pin every expert chunk (the loader refuses it anyway, with a warning)."""
    from zipmoe_py.server import ZipMoEModelSettings

    assert ZipMoEModelSettings(model="m.gguf").use_mlock is False


def test_placement_settings_reach_llama(zipmoe_gguf):
    """n_cpu_moe, cpu_moe, override_tensor and rpc_servers are zipmoe_py.Llama's keyword arguments (llama.cpp's
    --n-cpu-moe, --cpu-moe, -ot, --rpc); a model made with them serves."""
    from zipmoe_py.placement import PLACEMENT_KWARGS
    from zipmoe_py.server import ZipMoEModelSettings, ZipMoELlamaProxy, zipmoe_kwargs

    assert set(PLACEMENT_KWARGS) <= set(ZipMoEModelSettings.model_fields)
    assert "cpu_moe" not in zipmoe_kwargs(ZipMoEModelSettings(model="m.gguf"))  # its default places nothing
    settings = ZipMoEModelSettings(model=str(zipmoe_gguf("qwen2moe")), n_cpu_moe=2, cpu_moe=True,
                                   override_tensor=r"blk\.0\.ffn_.*_exps=CPU", zipmoe_budget="64K", n_ctx=256)
    kwargs = zipmoe_kwargs(settings)
    assert kwargs["n_cpu_moe"] == 2 and kwargs["cpu_moe"] is True and "rpc_servers" not in kwargs
    llm = ZipMoELlamaProxy.load_llama_from_model_settings(settings)
    try:
        assert llm.create_completion("Hi", max_tokens=2)["choices"][0]["text"] is not None
        assert [s["device"] for s in llm.zipmoe_stats()["sets"]] == ["CPU"]
    finally:
        llm.close()


def test_a_missing_model_file_is_named(tmp_path):
    proc = subprocess.run([str(SERVER), "--model", str(tmp_path / "nope.gguf"), "--port", str(_free_port())],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "nope.gguf" in proc.stderr and "Traceback" not in proc.stderr


def _readme_serve_blocks() -> tuple[str, str]:
    """The README's "Serve" example: the command that starts the server, and the client."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    found = re.search(r"<!--[^>]*test_server\.py[^>]*-->\s*```bash\n(.*?)```\s*```python\n(.*?)```", readme, re.S)
    assert found, "README.md lost its Serve example"
    return found.group(1), found.group(2)


def test_the_readme_serve_example_runs_as_written(zipmoe_gguf):
    command, client = _readme_serve_blocks()
    command = command.strip()
    assert command.startswith(".venv/bin/zipmoe-server ") and command.endswith("&")
    port = str(_free_port())
    args = command.removeprefix(".venv/bin/zipmoe-server ").rstrip("&").split()
    args = [str(zipmoe_gguf("qwen2moe")) if a == "/tmp/tiny-qwen.gguf" else a for a in args]
    port_at = args.index("--port") + 1
    assert args[port_at] == "8000" and "127.0.0.1:8000" in client
    del args[port_at - 1:port_at + 1], args[args.index("--host"):args.index("--host") + 2]
    s = Server(*args, port=int(port))  # adds --host 127.0.0.1 --port PORT
    try:
        proc = subprocess.run([sys.executable, "-c", client.replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip()
    finally:
        s.close()
