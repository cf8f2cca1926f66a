#!/usr/bin/env python3
"""zipmoe-server under concurrent load: N OpenAI clients sending M chat completions each, all at once,
against one live server on 127.0.0.1 serving a ZipMoE GGUF.

    .venv/bin/python bench/server_load_bench.py --model M.zipmoe.gguf [--budget 2G] [--clients 8]
        [--requests 4] [--max-tokens 16] [--n-ctx 1024] [--port P] [--out docs/benchmarks/server/server_load.json]
        [--extra SERVER_FLAG ...]

Starts the installed zipmoe-server (the one beside this Python) and waits for /v1/models (up to 600 s:
large models load slowly). With the real openai client, at temperature 0: one warm-up request, then
each prompt alone, one after another (its solo answer and solo latency), then --clients threads
released together by a barrier, client i sending --requests requests, request j with prompt
(i + j) % len(PROMPTS). Records each request's latency, error and answer, and the server's peak VmRSS
(sampled every 50 ms). Every answer must equal its prompt's solo answer: a mismatch is a bug, printed
and reported by a nonzero exit status after the results are saved (as is any failed request).
Prints a table, saves --out (JSON) and the same name with .md (a small table and the command).
--extra takes the rest of the command line, so give it last.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import openai

# the live-server helper the suite uses too: this bench needs the [test] extra anyway (openai)
from zipmoe_py.devtools.live_server import SERVER, Server

ALIAS = "bench"
LOAD_TIMEOUT_S = 600
PROMPTS = ["Tell me a story.", "What is a mixture of experts?", "Count to five.", "Name a colour.",
           "Why is the sky blue?", "Write a haiku about disks.", "Explain caching in one sentence.",
           "List three prime numbers."]


def mem_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


def chat(client: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[str, int, float]:
    """(answer, completion tokens, latency s) of one chat completion at temperature 0."""
    t = time.perf_counter()
    r = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=max_tokens, temperature=0)
    latency = time.perf_counter() - t
    return r.choices[0].message.content, (r.usage.completion_tokens if r.usage else 0), latency


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_load(server: Server, client: openai.OpenAI, n_clients: int, n_requests: int, max_tokens: int) -> dict:
    records: list[dict] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n_clients + 1)
    peak = [server.rss()]
    done = threading.Event()

    def watch_rss():
        while not done.wait(0.05):
            try:
                peak[0] = max(peak[0], server.rss())
            except (AssertionError, OSError):  # the server exited: its failure shows in the requests
                return

    def worker(i: int):
        barrier.wait()
        for j in range(n_requests):
            index = (i + j) % len(PROMPTS)
            rec = {"client": i, "request": j, "prompt_index": index}
            t = time.perf_counter()
            try:
                rec["answer"], rec["completion_tokens"], rec["latency_s"] = chat(client, PROMPTS[index], max_tokens)
            except Exception as e:  # counted as a failure, reported with the others
                rec["latency_s"], rec["error"] = time.perf_counter() - t, repr(e)
            with lock:
                records.append(rec)

    watcher = threading.Thread(target=watch_rss, daemon=True)
    watcher.start()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n_clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    records.sort(key=lambda r: (r["client"], r["request"]))
    return {"records": records, "wall_s": wall, "peak_rss": peak[0]}


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a ZipMoE GGUF")
    ap.add_argument("--budget", default=None, help="--zipmoe_budget for the server (default: the server's)")
    ap.add_argument("--clients", type=int, default=8, help="client threads at once (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=4, help="requests per client (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens per request (default: %(default)s)")
    ap.add_argument("--n-ctx", type=int, default=1024, help="the server's --n_ctx (default: %(default)s)")
    ap.add_argument("--port", type=int, default=None, help="default: a free one")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/server/server_load.json"))
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                    help="more zipmoe-server flags: the rest of the command line")
    args = ap.parse_args()
    model = args.model.resolve()
    if not model.is_file():
        ap.error(f"no such model: {model}")
    if not SERVER.exists():
        ap.error(f"{SERVER} is not installed")
    server_args = ["--model", str(model), "--model_alias", ALIAS, "--n_ctx", str(args.n_ctx), "--verbose", "false"]
    if args.budget is not None:
        server_args += ["--zipmoe_budget", args.budget]
    server_args += args.extra

    print(f"starting: zipmoe-server {shlex.join(server_args)}", flush=True)
    try:
        server = Server(*server_args, port=args.port, ready_timeout=LOAD_TIMEOUT_S)
    except AssertionError as e:  # its message holds the server's log
        print(e, file=sys.stderr)
        return 1
    load_s = server.load_s
    try:
        print(f"server ready in {load_s:.1f} s", flush=True)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            chat(client, "warm-up", args.max_tokens)
            solo = [chat(client, p, args.max_tokens) for p in PROMPTS]
        except Exception as e:
            print(f"solo requests failed: {e!r}\n--- server log ---\n{server.log}", file=sys.stderr)
            return 1
        print(f"solo: {len(PROMPTS)} prompts, p50 {statistics.median(s[2] for s in solo):.2f} s; "
              f"load: {args.clients} clients x {args.requests} requests ...", flush=True)
        load = run_load(server, client, args.clients, args.requests, args.max_tokens)
        try:
            zipmoe = server.get("/zipmoe/stats").get("zipmoe")
        except Exception as e:  # the stats are extra: report the load regardless
            print(f"GET /zipmoe/stats failed: {e!r}", file=sys.stderr)
            zipmoe = None
    finally:
        server.close()

    records = load["records"]
    failures = [r for r in records if "error" in r]
    answered = [r for r in records if "error" not in r]
    mismatches = [r for r in answered if r["answer"] != solo[r["prompt_index"]][0]]
    latencies = sorted(r["latency_s"] for r in answered)
    solo_latencies = sorted(s[2] for s in solo)
    tokens = sum(r["completion_tokens"] for r in answered)
    memory = zipmoe.get("memory") if isinstance(zipmoe, dict) else None
    sizing = None
    if isinstance(memory, dict) and all(k in memory for k in ("non_expert", "contexts", "cache_buffers", "budget")):
        sizing = memory["non_expert"] + memory["contexts"] + memory["cache_buffers"] + memory["budget"]
    wall = load["wall_s"]
    summary = {
        "clients": args.clients,
        "requests_per_client": args.requests,
        "requests": len(records),
        "failures": len(failures),
        "answers_equal_to_solo": len(answered) - len(mismatches),
        "mismatches": len(mismatches),
        "p50_latency_s": statistics.median(latencies) if latencies else None,
        "p95_latency_s": percentile(latencies, 0.95),
        "max_latency_s": latencies[-1] if latencies else None,
        "wall_s": wall,
        "requests_per_s": len(answered) / wall if wall > 0 else None,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "solo_p50_latency_s": statistics.median(solo_latencies),
        "peak_rss_mib": load["peak_rss"] / 2**20,
        "sizing_mib": sizing / 2**20 if sizing is not None else None,
        "server_load_s": load_s,
    }
    result = {
        "summary": summary,
        "model": str(model),
        "model_bytes": model.stat().st_size,
        "budget": args.budget,
        "max_tokens": args.max_tokens,
        "n_ctx": args.n_ctx,
        "extra": args.extra,
        "server_command": server.cmd,
        "zipmoe_memory": memory,
        "zipmoe_stats": zipmoe,
        "machine": {"node": platform.node(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "mem_total_bytes": mem_total()},
        "prompts": PROMPTS,
        "solo": [{"prompt_index": i, "answer": a, "completion_tokens": n, "latency_s": s}
                 for i, (a, n, s) in enumerate(solo)],
        "records": records,
        "command": sys.argv,
    }

    rows = [
        ("clients x requests", f"{args.clients} x {args.requests} = {len(records)}"),
        ("failures", str(len(failures))),
        ("answers equal to solo", f"{summary['answers_equal_to_solo']} / {len(answered)}"),
        ("latency p50 / p95 / max s", f"{fmt(summary['p50_latency_s'])} / {fmt(summary['p95_latency_s'])} / "
                                      f"{fmt(summary['max_latency_s'])}"),
        ("solo latency p50 s", fmt(summary["solo_p50_latency_s"])),
        ("wall s", fmt(wall)),
        ("requests/s", fmt(summary["requests_per_s"])),
        ("generated tokens/s", f"{fmt(summary['tokens_per_s'], '.1f')} ({tokens} tokens)"),
        ("peak RSS MiB", fmt(summary["peak_rss_mib"], ".0f")),
        ("sizing MiB", fmt(summary["sizing_mib"], ".0f")),
        ("server load s", fmt(load_s, ".1f")),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"\nzipmoe-server load: {model.name} ({model.stat().st_size / 2**20:.1f} MiB), "
          f"budget {args.budget or 'default'}, max_tokens {args.max_tokens}, n_ctx {args.n_ctx}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if memory is not None:
        print(f"  {'zipmoe.memory':<{width}}  {json.dumps(memory)}")
    for r in failures:
        print(f"FAILED client {r['client']} request {r['request']}: {r['error']}", file=sys.stderr)
    for r in mismatches:
        print(f"MISMATCH client {r['client']} request {r['request']} prompt {PROMPTS[r['prompt_index']]!r}:\n"
              f"  solo:  {solo[r['prompt_index']][0]!r}\n  under load: {r['answer']!r}", file=sys.stderr)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    md = args.out.with_suffix(".md")
    machine = result["machine"]
    mem = machine["mem_total_bytes"]
    md.write_text(
        f"`{shlex.join(sys.argv)}`\n\n"
        f"{model.name}: {model.stat().st_size / 2**20:.1f} MiB ZipMoE GGUF; budget {args.budget or 'default'}; "
        f"max_tokens {args.max_tokens}, n_ctx {args.n_ctx}, temperature 0; {machine['node']}, "
        f"{machine['cpu_count']} CPUs, {fmt(mem / 2**30 if mem else None, '.0f')} GiB memory.\n\n"
        "| clients x requests | failures | = solo | p50 s | p95 s | max s | solo p50 s | req/s | tok/s "
        "| peak RSS MiB | sizing MiB |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        f"| {args.clients} x {args.requests} | {len(failures)} | {summary['answers_equal_to_solo']}/{len(answered)} "
        f"| {fmt(summary['p50_latency_s'])} | {fmt(summary['p95_latency_s'])} | {fmt(summary['max_latency_s'])} "
        f"| {fmt(summary['solo_p50_latency_s'])} | {fmt(summary['requests_per_s'])} "
        f"| {fmt(summary['tokens_per_s'], '.1f')} | {fmt(summary['peak_rss_mib'], '.0f')} "
        f"| {fmt(summary['sizing_mib'], '.0f')} |\n")
    print(f"saved {args.out} and {md}")
    return 1 if failures or mismatches else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # main's finally has stopped the server
        print("interrupted: server stopped, nothing saved", file=sys.stderr)
        sys.exit(130)
