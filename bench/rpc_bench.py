#!/usr/bin/env python3
"""Two small machines on one: stock llama.cpp's RPC against ZipMoE's, every layer on two rpc-servers
(loopback), each server under its own memory cap, in interleaved rounds.

    .venv/bin/python bench/rpc_bench.py --stock M-Q4_K_M.gguf [--zipmoe M.zipmoe.gguf]
        [--server-caps 3G,6G] [--budgets 3G=1536M,6G=3G] [--rounds 5] [--gen-tokens 64]
        [--out docs/benchmarks/rpc/rpc_X.json]

Per run: two `capped-run --mem CAP -- rpc-server -H 127.0.0.1 -p PORT -t 1` (../shared/tools/capped-run:
each its own memory cgroup, page cache included), then the client, uncapped, with the model evicted
from the page cache first: `llama-completion -m FILE --rpc A,B -ngl 99 -c CTX -t T -p PROMPT -n N
--temp 1 --seed S --ignore-eos -no-cnv -v`; ZipMoE's with ZIPMOE_BUDGET set to the cap's budget (an
rpc-server reports its machine's memory, not its cgroup's, so the default budget would overrun the
cap). TPOT is llama-completion's eval time per token, TTFT its load plus prompt eval time. Bytes sent
per token: what the servers' connections received (ss -ti, bytes_received) from the first generated
character on stdout to the last, over the decode steps between them (llama-completion's eval runs). Peak: each server's
cgroup peak. The O_DIRECT bandwidth of the disk is measured in the same invocation, before and after.
Cells: median (min-max) of the rounds. A system that fails at a cap is not run again at that cap.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from zipmoe_py.devtools.ports import free_port

from _common import (CAPPED_RUN, LOAD, PERF, PROMPT, last_stats, cell, counter_lines, disk_bw, llama_completion, parse_size,
                     run_facts, save, zipmoe_beside)


def rpc_server() -> Path:
    from zipmoe_py import _paths

    return _paths.program("ggml-rpc-server")




def descendants(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids + [d for k in kids for d in descendants(k)]


class Received:
    """bytes the servers listening on ports have received, over every connection seen so far (ss -ti: the
    kernel's tcp_info, whatever system call read them; a connection that closes keeps its last count)"""

    def __init__(self, ports: list[int]):
        self.ports, self.by_connection = ports, {}

    def sample(self) -> int:
        for port in self.ports:
            out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True,
                                 text=True).stdout
            # one connection per two lines: its addresses, then its tcp_info
            for addresses, info in re.findall(r"^\s*\d+\s+\d+\s+(\S+\s+\S+)\s*\n(.*)$", out, re.M):
                got = re.search(r"bytes_received:(\d+)", info)
                if got:
                    self.by_connection[addresses] = int(got.group(1))
        return sum(self.by_connection.values())


class Server:
    """an rpc-server under its own cap; pid: the rpc-server itself (capped-run's descendant)"""

    def __init__(self, cap: int):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, str(CAPPED_RUN), "--mem", str(cap), "--", str(rpc_server()),
                                      "-H", "127.0.0.1", "-p", str(self.port), "-t", "1"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise RuntimeError(f"rpc-server did not start: {self.proc.stderr.read()[-500:]}")
                time.sleep(0.1)
        self.pid = next(p for p in descendants(self.proc.pid) if "rpc-server" in Path(f"/proc/{p}/cmdline").read_text())

    def stop(self) -> dict:
        """the capped-run JSON (rc, peak_bytes) once the server is stopped"""
        alive = self.proc.poll() is None
        if alive:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        out, _ = self.proc.communicate(timeout=60)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        result = json.loads(lines[-1]) if lines else {}
        result["alive_at_end"] = alive
        return result


# system -> (which file, ZipMoE's environment beyond the budget); zipmoe-device-stores: zipmoe.device_stores
# on, host memory keeping compressed experts beside the first server's slots from the prompt on;
# zipmoe-cpu-compute: zipmoe.cpu_compute on, the client's CPU computing the misses the balancer gives it
# (zipmoe-stores-cpu: both);
# zipmoe-one-set: every layer's experts placed on the first server (-ot), so that one slot set there serves
# every layer and the second server's layers compute their experts on the first; its budget is half the cap's
# (a budget is the slots of every server, and here one server holds them all)
SYSTEMS = {"stock": ("stock", {}), "zipmoe": ("zipmoe", {}),
           "zipmoe-device-stores": ("zipmoe", {"ZIPMOE_DEVICE_STORES": "1"}),
           "zipmoe-cpu-compute": ("zipmoe", {"ZIPMOE_CPU_COMPUTE": "1"}),
           "zipmoe-stores-cpu": ("zipmoe", {"ZIPMOE_DEVICE_STORES": "1", "ZIPMOE_CPU_COMPUTE": "1"}),
           "zipmoe-one-set": ("zipmoe", {})}
EXPERTS_ON_FIRST_SERVER = {"zipmoe-one-set"}


def run_one(cap: int, model: Path, budget: int | None, args, extra_env: dict | None = None,
            experts_on_first_server: bool = False) -> dict:
    servers = [Server(cap), Server(cap)]
    endpoints = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    cmd = [sys.executable, str(CAPPED_RUN), "--mem", "64G", "--evict", str(model), "--", str(llama_completion()),
           "-m", str(model), "--rpc", endpoints, "-ngl", "99", "-c", str(args.ctx), "-t", str(args.threads), "-p",
           PROMPT, "-n", str(args.gen_tokens), "--temp", "1", "--seed", str(args.seed), "--ignore-eos", "-no-cnv",
           "-v"]
    if experts_on_first_server:  # the first server's buffer type, as ggml-rpc names it
        cmd[cmd.index("-v"):cmd.index("-v")] = ["-ot", rf"\.ffn_(up|down|gate)_exps=RPC0[127.0.0.1:{servers[0].port}]"]
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    if budget is not None:
        env["ZIPMOE_BUDGET"] = str(budget)
    env.update(extra_env or {})
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", env=env,
                            cwd=tempfile.gettempdir(), stdin=subprocess.DEVNULL)
    err_chunks: list[str] = []
    reader = threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()))
    reader.start()
    # the servers' bytes received when the first generated character appeared, and as the last did (the
    # connections close with the client); a token's traffic comes before its text
    first = last = None
    out, prompt_seen, sampled = "", False, 0.0
    received = Received([s.port for s in servers])
    while True:
        ch = proc.stdout.read(1)
        if not ch:
            break
        out += ch
        # llama-completion echoes the prompt first: the generated text starts after it
        if not prompt_seen and out.endswith(PROMPT[-20:]):
            prompt_seen = True
        elif prompt_seen and time.monotonic() - sampled > 0.02:
            last = received.sample()
            first = last if first is None else first
            sampled = time.monotonic()
    proc.wait()
    reader.join()
    stops = [s.stop() for s in servers]
    stderr = "".join(err_chunks)
    row = {"command": cmd[cmd.index("--") + 1:], "budget": budget, "env": extra_env or {}, "wall_s": time.perf_counter() - t,
           "rc": proc.returncode, "server_peak_bytes": [s.get("peak_bytes") for s in stops],
           "server_rc": [s.get("rc") for s in stops], "servers_alive": [s["alive_at_end"] for s in stops]}
    stats = last_stats(stderr)
    if stats:
        row["zipmoe_stats"] = stats
    perf = {kind: (float(ms), int(n)) for kind, ms, n in PERF.findall(stderr)}
    load = LOAD.findall(stderr)
    if proc.returncode != 0 or "eval" not in perf or not load or first is None:
        row["error"] = stderr[-1500:]
        return row
    ms, n = perf["eval"]
    row.update({"tpot_s": ms / 1e3 / n, "decode_tokens": n, "prompt_tokens": perf["prompt eval"][1],
                "prompt_s": perf["prompt eval"][0] / 1e3, "load_s": float(load[-1]) / 1e3,
                "sent_per_token": (last - first) / n, "sent_total": last})
    row["ttft_s"] = row["load_s"] + row["prompt_s"]
    return row


def how_failed(row: dict) -> str:
    killed = [i for i, rc in enumerate(row["server_rc"]) if rc in (-9, 137) or row["servers_alive"][i] is False]
    if killed:
        return f"server {', '.join(str(i + 1) for i in killed)} killed by its cap"
    return f"client rc {row['rc']}"


def markdown(result: dict) -> str:
    lines = [f"# {Path(result['out']).stem}", "",
             f"{result['date']}, build {result['build']}, client {result['threads']} threads, two rpc-servers of 1 "
             f"thread each on loopback, every layer offloaded (-ngl 99), context {result['ctx']}, "
             f"{result['rounds']} interleaved rounds, {result['gen_tokens']} generated tokens after a "
             f"{result['prompt_tokens']}-token prompt, page cache evicted before each run; O_DIRECT "
             f"{result['odirect_gbps_before']:.2f} GB/s before the first round, {result['odirect_gbps_after']:.2f} "
             f"after the last.", "",
             f"Stock: `{Path(result['stock']).name}` ({result['stock_bytes'] / 1e9:.2f} GB). ZipMoE: "
             f"`{Path(result['zipmoe']).name}` ({result['zipmoe_bytes'] / 1e9:.2f} GB).", "",
             "```", result["command"], "```", "",
             "| server cap | system | TPOT ms | TTFT s (load + prompt) | MB sent per token | server peaks GB | failed |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for cap in result["caps"]:
        for system in result.get("systems", ["stock", "zipmoe"]):
            mine = [r for r in result["rows"] if r["cap_bytes"] == cap and r["system"] == system]
            ok = [r for r in mine if "tpot_s" in r]
            bad = [r for r in mine if "tpot_s" not in r]
            name = system if system == "stock" or not mine else f"{system} (budget {mine[0]['budget'] / (1 << 30):.2f} GiB)"
            peaks = [max(p or 0 for p in r["server_peak_bytes"]) / 1e9 for r in ok]
            failed = f"{len(bad)} of {len(mine)}" + (f": {how_failed(bad[0])}" if bad else "")
            if bad and len(mine) < result["rounds"]:
                failed += ", not rerun"
            lines.append(f"| {cap / (1 << 30):.0f} GiB each | {name} | {cell([r['tpot_s'] * 1e3 for r in ok], '{:.0f}')} | "
                         f"{cell([r['ttft_s'] for r in ok], '{:.1f}')} | "
                         f"{cell([r['sent_per_token'] / 1e6 for r in ok], '{:.2f}')} | {cell(peaks, '{:.2f}')} | {failed} |")
    lines += counter_lines(result["rows"], "ZipMoE's counters when the context was freed (whole run; \"to the slots' "
                                           "device\": what was written to the slots, on the first server):")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stock", type=Path, required=True, help="the GGUF stock llama.cpp runs over RPC")
    ap.add_argument("--zipmoe", type=Path, default=None, help="its ZipMoE GGUF (default: made beside it)")
    ap.add_argument("--server-caps", default="3G,6G", help="each rpc-server's memory cap (default: %(default)s)")
    ap.add_argument("--budgets", default="3G=1536M,6G=3G",
                    help="ZipMoE's zipmoe.budget by server cap, CAP=BUDGET,... (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="tokens sampled at temperature 1 (default: %(default)s)")
    ap.add_argument("--ctx", type=int, default=1024, help="context size (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="client threads (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--systems", default="stock,zipmoe",
                    help=f"systems to run, of {', '.join(SYSTEMS)} (default: %(default)s; zipmoe-device-stores: "
                         "ZIPMOE_DEVICE_STORES=1, compressed experts kept in the client's memory beside the "
                         "server's slots from the prompt on)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/rpc/rpc_bench.json"))
    args = ap.parse_args()
    systems = args.systems.split(",")
    unknown = [x for x in systems if x not in SYSTEMS]
    if unknown:
        ap.error(f"--systems: unknown system '{unknown[0]}' (known: {', '.join(SYSTEMS)})")
    if args.rounds < 1 or args.gen_tokens < 2:
        ap.error("--rounds must be at least 1 and --gen-tokens at least 2")
    caps = [parse_size(c) for c in args.server_caps.split(",")]
    try:
        budgets = {parse_size(k): parse_size(v) for k, v in (b.split("=") for b in args.budgets.split(","))}
    except ValueError:
        ap.error(f"--budgets: '{args.budgets}' is not CAP=BUDGET,...")
    missing = [c for c in caps if c not in budgets]
    if missing:
        ap.error(f"--budgets gives no budget for the server cap {missing[0] / (1 << 30):g} GiB")

    stock = args.stock.resolve()
    zipmoe = zipmoe_beside(stock, args.zipmoe)
    files = {"stock": stock, "zipmoe": zipmoe}
    bw_before = disk_bw(zipmoe)
    print(f"{stock.name}: {stock.stat().st_size / 1e9:.2f} GB; O_DIRECT {bw_before:.2f} GB/s", flush=True)
    rows, failed = [], set()
    for rnd in range(args.rounds):
        for cap in caps:
            for system in systems:
                if (cap, system) in failed:
                    continue
                kind, extra_env = SYSTEMS[system]
                budget = budgets[cap] if kind == "zipmoe" else None
                if system in EXPERTS_ON_FIRST_SERVER:
                    budget //= 2
                row = {"round": rnd, "system": system, "cap_bytes": cap,
                       **run_one(cap, files[kind], budget, args, extra_env, system in EXPERTS_ON_FIRST_SERVER)}
                rows.append(row)
                tag = f"round {rnd} {cap / (1 << 30):.0f} GiB {system:20s}"
                if "error" in row:
                    failed.add((cap, system))
                    print(f"{tag} FAILED ({how_failed(row)}): {row['error'][-300:]}", flush=True)
                    continue
                print(f"{tag} TPOT {row['tpot_s'] * 1e3:7.1f} ms  TTFT {row['ttft_s']:6.1f} s  sent/token "
                      f"{row['sent_per_token'] / 1e6:8.2f} MB  server peaks "
                      f"{[round((p or 0) / 1e9, 2) for p in row['server_peak_bytes']]} GB", flush=True)
    bw_after = disk_bw(zipmoe)
    result = {"stock": str(stock), "zipmoe": str(zipmoe), "stock_bytes": stock.stat().st_size,
              "zipmoe_bytes": zipmoe.stat().st_size, "odirect_gbps_before": bw_before, "odirect_gbps_after": bw_after,
              "threads": args.threads, "ctx": args.ctx, "gen_tokens": args.gen_tokens, "rounds": args.rounds,
              "seed": args.seed, "prompt": PROMPT, "systems": systems,
              "prompt_tokens": next((r["prompt_tokens"] for r in rows if "prompt_tokens" in r), 0), "caps": caps,
              **run_facts(args.out), "rows": rows}
    save(result, args.out, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
