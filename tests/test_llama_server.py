"""The fork's llama-server: several users at once on a ZipMoE GGUF.

What stays exact. llama-server gives no logits, but /completion's `n_probs` gives, for each generated
token, the log-probabilities of the top tokens computed from the raw logits (softmax over the whole
vocabulary, before any sampler), printed with round-trip precision: those of the ZipMoE GGUF, under a
budget that makes most selections read the file, must equal those of the same server on the BF16
GGUF bit for bit. The batches are made the same on both sides:
  - one slot (`-np 1`): the prompts of a request are served one after another;
  - four slots (`-np 4`): the four prompts of one request are posted to the server's queue together,
    so the server launches the four slots before it builds a batch: the prompts are evaluated in one
    batch and every generated token of the four sequences in one batch (asserted through /metrics'
    busy slots per decode). ZipMoE and BF16 then compute the same batches.
Requests from separate clients arrive at times the server does not control, so the batches they share
differ from run to run; for those the tests assert service (every request answered), not equality.
"""
from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest

from conftest import ARCHS
from llama_server import LlamaServer

HERE = Path(__file__).resolve().parent
BUDGET = "64K"  # a few slots of the tiny models' experts: most selections are read from the file
PROMPTS = ["Tell me a story.", "What is a mixture of experts?", "Count to five.", "Why is the sky blue?"]
# the heap that 8 requests take while served (their JSON, tokens, HTTP buffers, results)
REQUEST_HEAP = 8 << 20
EXACT = {"n_predict": 8, "temperature": 0, "n_probs": 5, "ignore_eos": True, "cache_prompt": False,
         "seed": 7}


def _completions(server: LlamaServer) -> list[dict]:
    status, reply = server.post("/completion", {"prompt": PROMPTS, **EXACT})
    assert status == 200, reply
    assert isinstance(reply, list) and len(reply) == len(PROMPTS)
    return [{"index": r["index"], "content": r["content"], "probs": r["completion_probabilities"]} for r in reply]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n_parallel, threads", [(1, 2), (4, 2), (4, 1)])
def test_responses_equal_the_bf16_servers_for_the_same_batches(arch, n_parallel, threads, tiny_gguf, zipmoe_gguf):
    args = ("-np", n_parallel, "-t", threads, "-c", 1024, "--metrics", "--no-warmup")
    with LlamaServer(tiny_gguf(arch), *args) as stock:
        want = _completions(stock)
        stock_busy = stock.metrics()["llamacpp:n_busy_slots_per_decode"]
    with LlamaServer(zipmoe_gguf(arch), *args, env={"ZIPMOE_BUDGET": BUDGET}) as zipmoe:
        got = _completions(zipmoe)
        metrics = zipmoe.metrics()
    assert metrics["zipmoe:expert_misses_total"] > metrics["zipmoe:expert_hits_total"]  # the file is read
    # the batches: one sequence per decode with one slot, the four together with four
    assert metrics["llamacpp:n_busy_slots_per_decode"] == stock_busy == (1 if n_parallel == 1 else 4)
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
def test_four_sequences_decoding_together_re_plan_the_pools_and_stay_equal(arch, tiny_gguf, zipmoe_gguf):
    """A server decoding four sequences at once counts its steps (one token of each) toward the re-plan,
    which plans for the union of their experts; the responses stay those of the BF16 server."""
    from test_serve import TOP_K, expert_geometry

    _, _, everything = expert_geometry(zipmoe_gguf(arch))
    args = ("-np", 4, "-t", 2, "-c", 1024, "--metrics", "--no-warmup", "-lv", 4)
    with LlamaServer(tiny_gguf(arch), *args) as stock:
        want = _completions(stock)
    env = {"ZIPMOE_BUDGET": str(everything // 2), "ZIPMOE_REPLAN_TOKENS": "4"}
    with LlamaServer(zipmoe_gguf(arch), *args, env=env) as zipmoe:
        got = _completions(zipmoe)
        metrics = zipmoe.metrics()
        log = zipmoe.log
    replans = [line for line in log.splitlines() if "ZipMoE pools re-planned" in line]
    # after 4 counted steps, then each time they double, or where a change declined for its cost would repay
    steps = [int(line.split("re-planned after ")[1].split()[0]) for line in replans]
    said = [int(line.split("planned again after ")[1].split()[0]) if "planned again after " in line else 2 * n
            for line, n in zip(replans, steps)]
    assert steps[0] == 4 and steps[1:] == said[:-1] and all(n < m <= 2 * n for n, m in zip(steps, said)), replans
    per_step = int(replans[0].split("decode steps (")[1].split()[0])
    assert TOP_K[arch] < per_step <= 4 * TOP_K[arch], replans[0]  # the union of four sequences' experts
    assert all(f'zipmoe:pool_experts{{pool="{p}"}}' in metrics for p in "FCSE")
    assert got == want


def test_zipmoe_options_reach_it_through_the_environment_and_override_kv(zipmoe_gguf):
    model = zipmoe_gguf("qwen2moe")
    with LlamaServer(model, "--metrics", "-c", 512, env={"ZIPMOE_BUDGET": "40K"}) as by_env:
        slots_env = by_env.metrics()["zipmoe:slot_capacity"]
    with LlamaServer(model, "--metrics", "-c", 512, "--override-kv", "zipmoe.budget=str:40K") as by_kv:
        slots_kv = by_kv.metrics()["zipmoe:slot_capacity"]
    with LlamaServer(model, "--metrics", "-c", 512, env={"ZIPMOE_BUDGET": "80K"}) as larger:
        slots_larger = larger.metrics()["zipmoe:slot_capacity"]
    assert slots_env == slots_kv < slots_larger


def test_metrics_count_the_expert_cache_and_a_bf16_model_has_none(tiny_gguf, zipmoe_gguf):
    with LlamaServer(zipmoe_gguf("deepseek2"), "--metrics", "-c", 512, env={"ZIPMOE_BUDGET": BUDGET}) as server:
        before = server.metrics()
        status, _ = server.post("/completion", {"prompt": "Hello", "n_predict": 4})
        assert status == 200
        after = server.metrics()
        text = server.get_text("/metrics")
    assert after["zipmoe:fetches_total"] > before["zipmoe:fetches_total"]
    assert after["zipmoe:bytes_read_total"] > before["zipmoe:bytes_read_total"] > 0  # the prompt's fetches too
    assert after["zipmoe:slots_in_use"] <= after["zipmoe:slot_capacity"]
    assert after["zipmoe:substitutions_total"] == 0  # lossless by default
    assert "# TYPE zipmoe:expert_misses_total counter" in text and 'zipmoe:store_hits_total{pool="C"}' in text
    # where the time went: the graphs, and the fetches' wait by part, which add up to it (to the nanosecond)
    assert after["zipmoe:graphs_total"] > before["zipmoe:graphs_total"]
    assert after["zipmoe:graph_seconds_total"] > after["zipmoe:fetch_wait_seconds_total"] > 0

    def ns(line: str) -> int:
        whole, frac = line.rsplit(" ", 1)[1].split(".")
        return int(whole) * 1_000_000_000 + int(frac)

    parts = [ns(line) for line in text.splitlines() if line.startswith("zipmoe:fetch_wait_part_seconds_total{")]
    total = next(ns(line) for line in text.splitlines() if line.startswith("zipmoe:fetch_wait_seconds_total "))
    assert len(parts) == 5 and sum(parts) == total
    with LlamaServer(tiny_gguf("deepseek2"), "--metrics", "-c", 512) as plain:
        assert not any(name.startswith("zipmoe:") for name in plain.metrics())


@pytest.fixture(scope="module")
def loaded(zipmoe_gguf):
    """A ZipMoE server with four slots under a small budget, for the load and fault tests."""
    with LlamaServer(zipmoe_gguf("qwen2moe"), "-np", 4, "-c", 2048, "--metrics",
                     env={"ZIPMOE_BUDGET": BUDGET}) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield server


def _chat(server: LlamaServer, prompt: str, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion through the OpenAI client."""
    kwargs = dict(model="m", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0)
    if not stream:
        r = server.client.chat.completions.create(**kwargs)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", None
    for chunk in server.client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_eight_concurrent_clients_streaming_and_not_all_answered(loaded):
    """8 clients x 3 requests at once, half of them streamed: every one finished."""
    _chat(loaded, "warm-up", stream=False)
    results, errors = [], []
    barrier = threading.Barrier(8)

    def client(i: int):
        barrier.wait()
        for j in range(3):
            try:
                results.append(_chat(loaded, PROMPTS[(i + j) % len(PROMPTS)], stream=(i + j) % 2 == 0))
            except Exception as e:  # reported below, with the others
                errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(results) == 24
    assert all(finish in ("length", "stop") and text for text, finish in results)
    assert loaded.metrics()["llamacpp:n_busy_slots_per_decode"] > 1  # they shared batches


def test_a_client_that_leaves_mid_stream_does_not_stop_the_others(loaded):
    conn = http.client.HTTPConnection("127.0.0.1", loaded.port, timeout=60)
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the stream has begun
    conn.close()  # gone mid-stream
    text, finish = _chat(loaded, "Name a colour.", stream=True)
    assert text and finish == "length"


@pytest.mark.parametrize("body, field", [
    (b"{not json", None),
    (b'{"messages": "hello"}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}', "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"prompt": "hi"}', "messages"),
])
def test_bad_requests_get_a_4xx_and_serving_goes_on(loaded, body, field):
    status, reply = loaded.post("/v1/chat/completions", body)
    assert 400 <= status < 500, reply
    if field:
        assert field in json.dumps(reply)
    assert _chat(loaded, "Name a colour.", stream=False)[0]


@pytest.mark.parametrize("kind, reason", [("eio", "Input/output error"), ("flip", "checksum mismatch")])
def test_a_chunk_that_cannot_be_read_fails_that_request_naming_it_and_serving_goes_on(
        shim, zipmoe_gguf, tmp_path, kind, reason):
    model = tmp_path / "faulty.zipmoe.gguf"
    shutil.copyfile(zipmoe_gguf("qwen2moe"), model)
    control = tmp_path / "control"
    control.write_text("0 0 eio")
    env = {"LD_PRELOAD": str(shim), "ZIPMOE_FAULT_CONTROL": str(control), "ZIPMOE_FAULT_MATCH": model.name,
           "ZIPMOE_BUDGET": BUDGET}
    with LlamaServer(model, "-c", 512, "--no-warmup", env=env) as server:
        control.write_text(f"1 2 {kind}")  # the second chunk read from now on
        status, reply = server.post("/completion", {"prompt": "Hello there", "n_predict": 4})
        assert status == 500, reply
        message = reply["error"]["message"]
        assert reason in message and "layer" in message and "expert" in message, message
        status, reply = server.post("/completion", {"prompt": "Hello again", "n_predict": 4})
        assert status == 200 and reply["tokens_predicted"] == 4


def test_memory_under_load_stays_within_the_sizing(zipmoe_gguf):
    """Peak RSS while 4 slots serve 8 prompts: what the process holds once loaded and idle, plus no more
    than what /metrics says the sizing counts (the non-expert weights, which serving touches page by
    page, the contexts' KV caches and compute buffers, the cache's buffers, the expert budget) and the
    requests' own heap (REQUEST_HEAP). The server's own memory (code, tokenizer, HTTP threads, web UI),
    which the sizing does not count, is in the idle RSS."""
    with LlamaServer(zipmoe_gguf("qwen2moe"), "-np", 4, "-c", 1024, "--metrics",
                     env={"ZIPMOE_BUDGET": BUDGET}) as server:
        time.sleep(0.5)
        idle = server.rss()
        peak, done = [idle], threading.Event()

        def watch():
            while not done.wait(0.02):
                peak[0] = max(peak[0], server.rss())

        watcher = threading.Thread(target=watch)
        watcher.start()
        status, _ = server.post("/completion", {"prompt": PROMPTS * 2, "n_predict": 16, "ignore_eos": True})
        done.set()
        watcher.join()
        assert status == 200
        m = server.metrics()
    part = {p: m[f'zipmoe:memory_bytes{{part="{p}"}}'] for p in
            ("available", "non_expert", "contexts", "cache_buffers", "margin", "fits", "budget")}
    assert part["fits"] == part["available"] - part["non_expert"] - part["contexts"] - part["cache_buffers"] \
        - part["margin"]
    assert part["budget"] == 64 * 1024 and m["zipmoe:contexts"] == 1
    served = part["non_expert"] + part["contexts"] + part["cache_buffers"] + part["budget"]
    print(f"\nidle RSS {idle / 2**20:.1f} MiB, peak {peak[0] / 2**20:.1f} MiB: grew "
          f"{(peak[0] - idle) / 2**20:.1f} MiB; sized for serving {served / 2**20:.1f} MiB "
          f"(non-expert {part['non_expert'] / 2**20:.1f}, contexts {part['contexts'] / 2**20:.1f}, cache buffers {part['cache_buffers'] / 2**20:.1f}, "
          f"budget {part['budget'] / 2**20:.2f})")
    assert peak[0] - idle <= served + REQUEST_HEAP


def test_the_web_ui_answers_a_message_in_headless_chromium(zipmoe_gguf, tmp_path):
    """llama-server's built-in web UI on a ZipMoE model, in a real browser: a message typed and sent
    gets a reply from the model. Needs Debian's chromium and chromium-driver (setup.sh --dev)."""
    from ui_check import chat_in_the_web_ui

    with LlamaServer(zipmoe_gguf("qwen2moe"), "-c", 1024, "-n", 16, "--metrics",
                     env={"ZIPMOE_BUDGET": BUDGET}) as server:
        page = chat_in_the_web_ui(server.url, "Hello", tmp_path / "ui.png")
        served = server.metrics()
    assert "16 tokens" in page  # the reply, whole: -n 16 tokens
    assert served["llamacpp:tokens_predicted_total"] == 16 and served["zipmoe:expert_misses_total"] > 0
    assert (tmp_path / "ui.png").stat().st_size > 10_000


def test_the_readme_serve_example_runs_as_written(zipmoe_gguf):
    import re
    import sys

    readme = (HERE.parent / "README.md").read_text()
    found = re.search(r"<!--[^>]*test_llama_server\.py[^>]*-->\s*```bash\n(.*?)```\s*```python\n(.*?)```", readme, re.S)
    assert found, "README.md lost its llama-server example"
    command, client = found.group(1).strip(), found.group(2)
    assert command.startswith("ZIPMOE_BUDGET=256K .venv/bin/llama-server ") and command.endswith("&")
    args = command.removeprefix("ZIPMOE_BUDGET=256K .venv/bin/llama-server ").rstrip("&").split()
    assert args[:2] == ["-m", "/tmp/tiny-qwen.gguf"] and args[-4:] == ["--host", "127.0.0.1", "--port", "8080"]
    assert "127.0.0.1:8080" in client
    with LlamaServer(zipmoe_gguf("qwen2moe"), *args[2:-4], env={"ZIPMOE_BUDGET": "256K"}) as server:
        proc = subprocess.run([sys.executable, "-c", client.replace("127.0.0.1:8080", f"127.0.0.1:{server.port}")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip()
        assert server.metrics()["zipmoe:expert_misses_total"] > 0
