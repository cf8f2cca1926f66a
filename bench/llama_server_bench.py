#!/usr/bin/env python3
"""Servers under a memory cap with 1, 4 and 8 concurrent clients: zipmoe-server (llama-cpp-python's,
one request at a time), the fork's llama-server with -np 8 on the ZipMoE GGUF, and the same
llama-server on the BF16 GGUF (stock llama.cpp's path: the patches change nothing for a GGUF that is
not a ZipMoE GGUF). With --before, "llama-server zipmoe-before" is the ZipMoE GGUF through another
build's llama-server (its bin/ beside its lib/), for a change's A/B.

    .venv/bin/python bench/llama_server_bench.py --zipmoe M.zipmoe.gguf --bf16 M-bf16.gguf --cap 4G \\
        [--clients 1 4 8] [--max-tokens 16] [--rounds 1] [--out docs/benchmarks/server/llama_server_qwen6.json]

Each server runs under `capped-run --mem CAP --evict MODEL` (../shared/tools/capped-run: a memory
cgroup, page cache included; the model evicted first). Once it answers, one warm-up request, then for
each client count N: N OpenAI clients released together by a barrier, each sending one chat completion
(max_tokens, temperature 0, prompts differing). Per level: the wall time, throughput (completion tokens
over the wall time), p50 and p95 latency, failures, and the server's own timings of each request
(llama-server's `timings`: its decode time per token, which for parallel sequences is the time of a
step they share, prompts excluded). For ZipMoE, the expert cache's counters from /metrics over the
level (where its wall time went: graphs, fetch waits by part, reads) and the server log's pool and
re-plan lines (the servers run with -lv 4 for them). The server's anonymous memory (RssAnon) is sampled
every 0.2 s: its peak while serving and after the SIGTERM, and the OOM killer's kills meanwhile (dmesg).
Rounds repeat the servers in turn (interleaved). The disk's O_DIRECT read bandwidth is
measured in the same invocation.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import openai

from zipmoe_py.devtools.ports import free_port

from _common import CAPPED_RUN, round_order

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROMPTS = ["Tell me a story.", "What is a mixture of experts?", "Count to five.", "Name a colour.",
           "Why is the sky blue?", "Write a haiku about disks.", "Explain caching in one sentence.",
           "List three prime numbers."]




def server_command(kind: str, args, port: int) -> tuple[list[str], Path]:
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if kind == "zipmoe-server":
        return [str(BIN / "zipmoe-server"), "--model", str(args.zipmoe), "--model_alias", "m",
                "--n_ctx", str(args.n_ctx), "--verbose", "false", *host], args.zipmoe
    model = args.bf16 if kind == "llama-server bf16" else args.zipmoe
    program = args.before if kind == "llama-server zipmoe-before" else BIN / "llama-server"
    return [str(program), "-m", str(model), "-np", str(max(args.clients)),
            "-c", str(args.n_ctx * max(args.clients)), "--no-warmup", "--metrics", "-lv", "4", *host], model


ZIPMOE_METRIC = re.compile(r'^zipmoe:(\w+)(?:\{\w+="(\w+)"\})? ([0-9.e+-]+)$', re.M)


def zipmoe_metrics(url: str) -> dict[str, float]:
    """the expert cache's counters and gauges from /metrics ({} for a model that is not a ZipMoE GGUF)"""
    try:
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    except Exception:
        return {}
    return {f"{name}.{label}" if label else name: float(value) for name, label, value in ZIPMOE_METRIC.findall(text)}


def counters_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """what the counters (names ending in _total) added between two scrapes"""
    return {k: after[k] - before.get(k, 0.0) for k in after if "_total" in k}


# the pools planned and re-planned (-lv 4 shows libllama's information lines)
LOG_LINES = re.compile(r"ZipMoE (?:expert cache pools|expert cache: \d+ of|pools re-planned)[^\n]*")


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    start = time.monotonic()
    while time.monotonic() < start + timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        for route in ("/health", "/v1/models"):
            try:
                if urllib.request.urlopen(url + route, timeout=2).status == 200:
                    return
            except Exception:
                pass
        time.sleep(0.5)
    raise RuntimeError("server did not answer")


def wait_gone(port: int, timeout: float = 300) -> None:
    """until the server on port has exited: a server of 16 GiB takes seconds to give its memory back after
    capped-run returns, and the next server would size its caches for what was left"""
    start = time.monotonic()
    while subprocess.run(["pgrep", "-f", f"[-]-port {port}"], capture_output=True).returncode == 0:
        if time.monotonic() > start + timeout:
            raise RuntimeError(f"the server on port {port} did not exit within {timeout:.0f} s")
        time.sleep(0.5)


def one_level(client: openai.OpenAI, n: int, max_tokens: int) -> dict:
    latencies, tokens, errors, timings = [], [], [], []
    barrier = threading.Barrier(n)

    def run(i: int):
        barrier.wait()
        t = time.perf_counter()
        try:
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                               max_tokens=max_tokens, temperature=0)
            latencies.append(time.perf_counter() - t)
            tokens.append(r.usage.completion_tokens)
            timing = (r.model_extra or {}).get("timings") or {}
            if timing.get("predicted_n"):
                timings.append({k: timing.get(k) for k in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms")})
        except Exception as e:  # counted as a failure
            errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    latencies.sort()
    return {"clients": n, "wall_s": wall, "tokens": sum(tokens), "tok_per_s": sum(tokens) / wall,
            "p50_s": statistics.median(latencies) if latencies else None,
            "p95_s": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else None,
            "failures": len(errors), "errors": errors[:3], "timings": timings,
            # the server's decode time per token of a request: a step of the sequences decoding together
            "step_ms": statistics.median(x["predicted_ms"] / x["predicted_n"] for x in timings) if timings else None}


def oom_kills() -> int | None:
    """processes the kernel's OOM killer has ended since boot (dmesg), or None where the log is not readable"""
    out = subprocess.run(["dmesg"], capture_output=True, text=True)
    return out.stdout.count("Killed process") if out.returncode == 0 else None


class MemoryWatch:
    """The server's anonymous memory (RssAnon) every 0.2 s, on a thread: its peak while serving, at the
    SIGTERM and after it (a change of pools, or the shutdown, that writes memory past the cap's is ended by
    the OOM killer), and whether the kernel's OOM killer ended a process meanwhile."""

    def __init__(self, port: int, program: str):
        self.port, self.program, self.samples, self.term_at, self.pid = port, program, [], None, None
        self.kills_before = oom_kills()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()

    def poll(self):
        while not self.stop.is_set():
            try:
                if self.pid is None:
                    self.pid = self.find_server()
                with open(f"/proc/{self.pid}/status") as f:
                    kib = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
                self.samples.append((time.monotonic(), kib << 10))
            except (OSError, TypeError, StopIteration, ValueError):
                pass
            self.stop.wait(0.2)

    def find_server(self) -> int | None:
        """the process with the port whose program is named as the server's (capped-run, which starts it, has
        both in its command line too, and the venv's llama-server is a script that runs the package's)"""
        found = subprocess.run(["pgrep", "-f", f"[-]-port {self.port}"], capture_output=True, text=True).stdout
        for pid in map(int, found.split()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if Path(f.read().split(b"\0")[0].decode()).name == Path(self.program).name:
                        return pid
            except OSError:
                pass
        return None

    def report(self) -> dict:
        self.stop.set()
        self.thread.join()
        after = oom_kills()
        gib = lambda xs: max(xs) / 2 ** 30 if xs else None
        serving = [b for t, b in self.samples if self.term_at is None or t < self.term_at]
        ending = [b for t, b in self.samples if self.term_at is not None and t >= self.term_at]
        return {"peak_anon_gib": gib(serving), "anon_at_term_gib": serving[-1] / 2 ** 30 if serving else None,
                "peak_anon_after_term_gib": gib(ending),
                "oom_kills": None if after is None or self.kills_before is None else after - self.kills_before}


def bench_server(kind: str, args) -> dict:
    port = free_port()
    cmd, model = server_command(kind, args, port)
    capped = [sys.executable, str(CAPPED_RUN), "--mem", args.cap, "--evict", str(model), "--"]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([*capped, *cmd], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    memory = MemoryWatch(port, cmd[0])
    try:
        t = time.perf_counter()
        wait_ready(url, proc)
        load_s = time.perf_counter() - t
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        one_level(client, 1, 4)  # warm-up
        levels = []
        for n in args.clients:
            before = zipmoe_metrics(url)
            levels.append(one_level(client, n, args.max_tokens))
            if before:
                after = zipmoe_metrics(url)
                levels[-1]["zipmoe"] = counters_between(before, after)
                levels[-1]["pools"] = {k.split(".")[1]: int(v) for k, v in after.items() if k.startswith("pool_experts.")}
    finally:
        memory.term_at = time.monotonic()
        subprocess.run(["pkill", "-TERM", "-f", f"[-]-port {port}"], check=False)  # the server, not capped-run
        proc.wait(timeout=120)
        wait_gone(port)
        log.seek(0)
        lines = LOG_LINES.findall(log.read())
        log.close()
        watched = memory.report()
    return {"server": kind, "load_s": load_s, "levels": levels, "zipmoe_log": lines, "memory": watched}


def summarize(runs: list[dict]) -> list[dict]:
    """Per server and client count: the median over rounds (min and max of throughput), failures summed."""
    rows = []
    for kind in dict.fromkeys(r["server"] for r in runs):
        levels = [lv for r in runs if r["server"] == kind for lv in r["levels"]]
        for n in dict.fromkeys(lv["clients"] for lv in levels):
            at = [lv for lv in levels if lv["clients"] == n]
            tps = [lv["tok_per_s"] for lv in at]
            steps = [lv["step_ms"] for lv in at if lv.get("step_ms")]
            rows.append({"server": kind, "clients": n, "rounds": len(at), "tok_per_s": statistics.median(tps),
                         "tok_per_s_min": min(tps), "tok_per_s_max": max(tps),
                         "step_ms": statistics.median(steps) if steps else None,
                         "step_ms_min": min(steps) if steps else None, "step_ms_max": max(steps) if steps else None,
                         "account": account(at),
                         **{f"{q}_s{suffix}": f([lv[f"{q}_s"] for lv in at if lv[f"{q}_s"] is not None])
                            for q in ("p50", "p95") for suffix, f in (("", statistics.median), ("_min", min),
                                                                     ("_max", max))},
                         "failures": sum(lv["failures"] for lv in at), **memory_summary(runs, kind)})
    return rows


def memory_summary(runs: list[dict], kind: str) -> dict:
    """a server's peak anonymous memory over its rounds (median, min, max) and the OOM kills during them"""
    watched = [r["memory"] for r in runs if r["server"] == kind and r.get("memory")]
    peaks = [m["peak_anon_gib"] for m in watched if m["peak_anon_gib"] is not None]
    kills = [m["oom_kills"] for m in watched if m["oom_kills"] is not None]
    return {"peak_anon_gib": statistics.median(peaks) if peaks else None,
            "peak_anon_gib_min": min(peaks) if peaks else None, "peak_anon_gib_max": max(peaks) if peaks else None,
            "oom_kills": sum(kills) if kills else None}


ACCOUNT = [("graph_seconds_total", "graphs s"), ("fetch_wait_seconds_total", "fetch wait s"),
           ("fetch_wait_part_seconds_total.reads", "waiting for reads s"),
           ("fetch_wait_part_seconds_total.decode", "decode+recover on the path s"),
           ("fetch_wait_part_seconds_total.plan", "plan s"), ("fetch_wait_part_seconds_total.lock", "lock s"),
           ("fetch_wait_part_seconds_total.threads", "threads s"), ("read_seconds_total", "I/O thread reading s"),
           ("bytes_read_total", "bytes read"), ("expert_misses_total", "misses"), ("graphs_total", "graphs")]


def account(levels: list[dict]) -> dict[str, float] | None:
    """the ZipMoE counters over a level, medians over its rounds (None for a server without them)"""
    have = [lv["zipmoe"] for lv in levels if lv.get("zipmoe")]
    if not have:
        return None
    return {label: statistics.median(z.get(name, 0.0) for z in have) for name, label in ACCOUNT}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zipmoe", type=Path, required=True, help="the ZipMoE GGUF")
    ap.add_argument("--bf16", type=Path, help="its BF16 GGUF (stock's path); needed by the server 'llama-server bf16' "
                    "only (the disk's rate is measured on it, else on --zipmoe)")
    ap.add_argument("--cap", required=True, help="memory cap of each server, e.g. 4G")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=512, help="context per client (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--servers", nargs="+", default=["zipmoe-server", "llama-server zipmoe", "llama-server bf16"],
                    help="of zipmoe-server, 'llama-server zipmoe', 'llama-server zipmoe-before' (needs --before), "
                         "'llama-server bf16'; each round runs them in this order")
    ap.add_argument("--rotate", action="store_true",
                    help="start each round one server later (round 2 runs the second server first, ...): on the "
                         "bench VM the first server of a round ran 4-8%% slower")
    ap.add_argument("--before", type=Path, default=None,
                    help="llama-server of another build (its bin/ beside its lib/): the server 'llama-server zipmoe-before'")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    known = {"zipmoe-server", "llama-server zipmoe", "llama-server zipmoe-before", "llama-server bf16"}
    if set(args.servers) - known:
        ap.error(f"--servers: unknown {', '.join(sorted(set(args.servers) - known))} (known: {', '.join(sorted(known))})")
    if "llama-server zipmoe-before" in args.servers and (args.before is None or not args.before.is_file()):
        ap.error("--servers 'llama-server zipmoe-before' needs --before PATH, another build's llama-server")
    if "llama-server bf16" in args.servers and (args.bf16 is None or not args.bf16.is_file()):
        ap.error("--servers 'llama-server bf16' needs --bf16 PATH, the BF16 GGUF")
    return args


def main() -> int:
    args = parse_args()
    bw = subprocess.run([sys.executable, str(CAPPED_RUN), "--disk-bw", str(args.bf16 or args.zipmoe)], capture_output=True,
                        text=True)
    runs = []
    for r in range(args.rounds):
        for position, kind in enumerate(round_order(args.servers, r, args.rotate)):
            print(f"round {r + 1}: {kind} ...", flush=True)
            res = bench_server(kind, args)
            res["round"], res["position"] = r + 1, position + 1
            runs.append(res)
            for lv in res["levels"]:
                if lv["p50_s"] is None:  # every request failed: say why, and go on
                    print(f"  {lv['clients']} clients: every request failed: {lv['errors']}", flush=True)
                    continue
                print(f"  {lv['clients']} clients: {lv['tok_per_s']:.2f} tok/s, p50 {lv['p50_s']:.1f} s, "
                      f"p95 {lv['p95_s']:.1f} s, failures {lv['failures']}", flush=True)
            m = res["memory"]
            if m["peak_anon_gib"] is not None:
                after = f"{m['peak_anon_after_term_gib']:.2f}" if m["peak_anon_after_term_gib"] is not None else "-"
                print(f"  anonymous memory: peak {m['peak_anon_gib']:.2f} GiB, {m['anon_at_term_gib']:.2f} at the "
                      f"SIGTERM, peak after it {after}; OOM kills {m['oom_kills']}", flush=True)
            # the runs so far, should the bench be stopped before its table
            args.out.with_suffix(".partial.json").write_text(json.dumps(runs, indent=1) + "\n")
    out = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
           "build": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                   text=True).stdout.strip(),
           "disk_bw": bw.stdout.strip(), "cap": args.cap, "max_tokens": args.max_tokens, "rounds": args.rounds,
           "runs": runs}
    out["summary"] = summarize(runs)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    args.out.with_suffix(".partial.json").unlink(missing_ok=True)
    table = ["| server | clients | tok/s median (min-max) | decode ms per step median (min-max) | p50 latency s median "
             "(min-max) | p95 latency s median (min-max) | failures | peak anonymous GiB median (min-max) | OOM kills |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in out["summary"]:
        step = (f"{row['step_ms']:.0f} ({row['step_ms_min']:.0f}-{row['step_ms_max']:.0f})" if row["step_ms"]
                else "-")
        peak = (f"{row['peak_anon_gib']:.2f} ({row['peak_anon_gib_min']:.2f}-{row['peak_anon_gib_max']:.2f})"
                if row["peak_anon_gib"] is not None else "-")
        table.append(f"| {row['server']} | {row['clients']} | {row['tok_per_s']:.2f} ({row['tok_per_s_min']:.2f}-"
                     f"{row['tok_per_s_max']:.2f}) | {step} | {row['p50_s']:.1f} ({row['p50_s_min']:.1f}-"
                     f"{row['p50_s_max']:.1f}) | {row['p95_s']:.1f} ({row['p95_s_min']:.1f}-{row['p95_s_max']:.1f}) | "
                     f"{row['failures']} | {peak} | {'-' if row['oom_kills'] is None else row['oom_kills']} |")
    accounts = [row for row in out["summary"] if row["account"]]
    if accounts:
        labels = [label for _, label in ACCOUNT]
        table += ["", "Where a level's time went (ZipMoE's counters over the level, medians over rounds):", "",
                  "| server | clients | " + " | ".join(labels) + " |", "| --- | --- | " + "--- | " * len(labels)]
        for row in accounts:
            table.append(f"| {row['server']} | {row['clients']} | " +
                         " | ".join(f"{row['account'][label]:.4g}" for label in labels) + " |")
    md = args.out.with_suffix(".md")
    md.write_text(f"# {args.out.stem}\n\n{out['date']}, build {out['build']}, cap {args.cap} bytes, "
                  f"{args.rounds} interleaved round(s), {args.max_tokens} tokens per request; disk: {out['disk_bw']}\n\n"
                  f"```\n{out['command']}\n```\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))
    print(f"wrote {args.out} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
