#!/usr/bin/env python3
"""The fork's llama-server at a tight expert budget: is a request's speed steady, and do parallel slots
thrash a budget that holds fewer than several tokens' experts?

    .venv/bin/python bench/server_budget_bench.py --model M.zipmoe.gguf [--budgets 256K all] [--rounds 5]
        [--out docs/benchmarks/server/server_budget_qwen_tiny.json]

For each budget (ZIPMOE_BUDGET; "all" for every expert), one llama-server with -np 4 on 127.0.0.1:
- solo: the same 64-token completion --rounds times, one after another: the server's decode ms per token
  (its `timings.predicted_per_token_ms`) and each request's wall time;
- four clients at once, --rounds times: four different 64-token completions released together, the wall
  time of all four;
- four one after another, --rounds times: the same four completions in turn, the wall time of all four.
Rounds of the concurrent and sequential cases alternate. The model is evicted from the page cache before each
server starts, and the disk's O_DIRECT rate is measured in the same invocation. Prints and saves medians with
min-max (JSON and Markdown beside it). Temperature 0, fixed seeds, n_predict exact (ignore_eos).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

from _common import cell, disk_bw, run_facts, save

from zipmoe_py import _paths
from zipmoe_py.devtools.ports import free_port

PROMPTS = ["Tell me a story about a lighthouse.", "What is a mixture of experts?", "Count from one to ten.",
           "Why is the sky blue?"]


def complete(url: str, prompt: str, n: int) -> dict:
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "seed": 1, "ignore_eos": True,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as r:
        result = json.loads(r.read())
    result["wall_s"] = time.monotonic() - start
    return result


def start_server(model: Path, budget: str, threads: int) -> tuple[subprocess.Popen, str]:
    evict(model)
    port = free_port()
    env = dict(os.environ)
    if budget != "all":
        env["ZIPMOE_BUDGET"] = budget
    proc = subprocess.Popen([str(_paths.program("llama-server")), "-m", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "-np", "4", "-c", "4096", "-t", str(threads)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"llama-server exited with {proc.returncode}"
        try:
            if json.loads(urllib.request.urlopen(url + "/health", timeout=2).read()).get("status") == "ok":
                return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("llama-server did not become ready in 300 s")


def evict(path: Path) -> None:
    """path out of the page cache, so that a server starts as from a cold disk"""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def four_at_once(url: str, n: int) -> float:
    barrier = threading.Barrier(len(PROMPTS) + 1)
    errors: list[BaseException] = []

    def client(prompt: str):
        barrier.wait()
        try:
            complete(url, prompt, n)
        except BaseException as e:  # noqa: BLE001 (reported after the round)
            errors.append(e)

    threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.monotonic()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.monotonic() - start


def one_after_another(url: str, n: int) -> float:
    start = time.monotonic()
    for p in PROMPTS:
        complete(url, p, n)
    return time.monotonic() - start


def measure(model: Path, budget: str, rounds: int, threads: int) -> dict:
    proc, url = start_server(model, budget, threads)
    try:
        complete(url, PROMPTS[0], 4)  # warm-up
        solo = [complete(url, PROMPTS[0], 64) for _ in range(rounds)]
        together, in_turn = [], []
        for r in range(rounds):
            if r % 2 == 0:
                together.append(four_at_once(url, 64))
                in_turn.append(one_after_another(url, 64))
            else:
                in_turn.append(one_after_another(url, 64))
                together.append(four_at_once(url, 64))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"budget": budget, "load_average_after": os.getloadavg()[0],
            "solo_ms_per_token": [s["timings"]["predicted_per_token_ms"] for s in solo],
            "solo_wall_s": [s["wall_s"] for s in solo],
            "four_at_once_s": together, "four_in_turn_s": in_turn}


def to_markdown(result: dict) -> str:
    lines = [f"# llama-server at a tight budget ({result['date']}, build {result['build']})", "",
             f"`{result['command']}`", "",
             f"{result['rounds']} rounds each, -np 4, {result['threads']} threads; median (min-max); 1-minute load "
             f"average {result['load_average_before']:.2f} before, "
             + ", ".join(f"{r['load_average_after']:.2f}" for r in result["rows"]) + " after each budget", "",
             f"disk {result['disk_gbps']:.2f} GB/s O_DIRECT, measured in the run; the model evicted before each server",
             "",
             "| budget | one 64-token request, ms/token | 4 clients x 64 at once, s | the same 4 in turn, s |",
             "| --- | --- | --- | --- |"]
    for row in result["rows"]:
        lines.append(f"| {row['budget']} | {cell(row['solo_ms_per_token'], '{:.1f}')} | "
                     f"{cell(row['four_at_once_s'], '{:.2f}')} | {cell(row['four_in_turn_s'], '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a ZipMoE GGUF")
    ap.add_argument("--budgets", nargs="+", default=["256K", "all"], help="ZIPMOE_BUDGET values; all: every expert")
    ap.add_argument("--rounds", type=int, default=5, help="repeats of each case (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/server/server_budget.json"),
                    help="JSON result; the Markdown table goes beside it")
    args = ap.parse_args()
    disk = disk_bw(args.model)
    load_before = os.getloadavg()[0]  # another process on the cores shows as spread: say so beside the numbers
    rows = [measure(args.model, b, args.rounds, args.threads) for b in args.budgets]
    save({**run_facts(args.out), "model": str(args.model), "rounds": args.rounds, "threads": args.threads,
          "load_average_before": load_before, "disk_gbps": disk, "rows": rows}, args.out, to_markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
