#!/usr/bin/env python3
"""Stock llama.cpp against ZipMoE on the same quantized MoE GGUF, both through the fork's llama-completion
under memory caps, in interleaved rounds. Three systems: zipmoe and stock with no options and the CLI's
default context; stock-paged, stock with `--no-repack -c 4096`: on an AVX2 CPU stock copies the repacked
experts (Q4_K) out of the mapping into memory and clears the KV cache of the trained context
(DeepSeek-V2-Lite: 163,840 tokens, 4.9 GiB), so under a cap smaller than the model it is killed; with
the experts left in the mapping and the context at upstream fit's floor, it pages them, as stock
llama.cpp runs a model larger than memory. A fourth, zipmoe-before, runs the ZipMoE GGUF through another
build's llama-completion (--before), for a change's A/B; zipmoe-no-preload runs it with the preload off
(`--override-kv zipmoe.preload=bool:false`), the A/B of that default; zipmoe-one-f with one F pool
(`--override-kv zipmoe.auto_pools=bool:false`), the A/B of the default pools; zipmoe-no-repack with
`--no-repack` (slots in the plain CPU buffer: a miss is a copy, the products run ggml's plain kernels).

    .venv/bin/python bench/quant_bench.py --stock M-Q4_K_M.gguf [--zipmoe M-Q4_K_M.zipmoe.gguf]
        [--caps 4G,6G] [--rounds 5] [--gen-tokens 64] [--threads 2] [--out docs/benchmarks/quantized/quant_X.json]

Every run is `capped-run --mem CAP --evict FILE -- python -c IO_WRAPPER llama-completion -m FILE -p
PROMPT -n N --temp 1 --seed S --ignore-eos -no-cnv -t T -v` (../shared/tools/capped-run: a child memory
cgroup, page cache included, the model evicted from the page cache first). Rounds interleave: each
round runs every cap and system once. TPOT is llama-completion's own eval time per token; TTFT its
load time plus prompt eval time (a cold start); bytes read are the process's read_bytes from
/proc/self/io (the storage reads of llama-completion and everything it does: mmap faults, O_DIRECT
chunk reads), which IO_WRAPPER reads after llama-completion exits. The O_DIRECT bandwidth of the disk is
measured in the same invocation, before the first round and after the last. Cells: median (min-max)
of the rounds. A system that fails at a cap (stock with no options is killed by the cap) is not run
again at that cap in later rounds unless --rerun-failed is given: its failure is deterministic, and each
try costs a minute of loading. Saves --out (JSON, every run) and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import limits as machine
from _common import (ACCOUNT, CAPPED_RUN, COUNTERS, LOAD, PERF, PROMPT, last_stats, cell, counter_lines,
                     disk_bw, llama_completion, parse_size, round_order, run_facts, save, zipmoe_beside)

# runs the command, then prints this process's /proc/self/io, which counts the reaped child's reads too
IO_WRAPPER = ("import subprocess, sys; r = subprocess.run(sys.argv[1:]); "
              "print('IO ' + ' '.join(open('/proc/self/io').read().split()), file=sys.stderr); sys.exit(r.returncode)")


# system -> (which file, llama-completion's extra arguments)
# zipmoe-before: the ZipMoE GGUF through --before's llama-completion; zipmoe-no-preload, zipmoe-one-f: the preload
# off, one F pool instead of the default pools (A/Bs of those defaults)
SYSTEMS = {"stock": ("stock", []), "stock-paged": ("stock", ["--no-repack", "-c", "4096"]), "zipmoe": ("zipmoe", []),
           "zipmoe-before": ("zipmoe", []), "zipmoe-no-preload": ("zipmoe", ["--override-kv", "zipmoe.preload=bool:false"]),
           "zipmoe-one-f": ("zipmoe", ["--override-kv", "zipmoe.auto_pools=bool:false"]),
           "zipmoe-no-repack": ("zipmoe", ["--no-repack"])}


def round_bounds(limits: dict, zipmoe: Path, caps: list[int]) -> dict:
    """the bound of this round: the disk's read rates measured now (one round of limits.py's read patterns on
    the file's own chunks), the decode rates and compute floor of the --limits run; a row per cap (batch 1)"""
    reads = machine.read_rates(zipmoe, 1, limits["reads"]["volume_bytes"])
    rows = machine.bounds(limits["facts"], reads, limits["decode"], limits["floor"], caps, [1], limits["profile"],
                          limits["threads"], limits["overhead_bytes"], limits["prompt_tokens"], limits.get("fresh_memory"))
    kept = ("tpot_bound_s", "ttft_bound_s", "ttft_cpu_floor_s")
    return {"reads_gbps": {k: v["median"] for k, v in reads["gbps"].items()},
            "rows": {str(r["cap_bytes"]): {k: r[k] for k in kept if k in r} for r in rows}}


# "re-planned after 16 decode steps (6 experts per MoE layer a step, 33606.7 MB read so far; ...": the experts
# part came with parallel steps (71dc6d2); the older form lacks it. One sequence's says "decode steps and the prompt
# before them", or, planned as a prompt ended, "after a prompt of N tokens" (0 decode steps)
REPLANNED = re.compile(r"re-planned after (?:(\d+) decode steps(?: and the prompt before them)?|a prompt of \d+ tokens) "
                       r"\((?:[^;()]*? a step, )?([0-9.]+) MB read so far[;)]")
POOLS = re.compile(r"pools (?:per MoE layer|re-planned after [^:]*): F (\d+), C (\d+), S (\d+), E (\d+)")


def steady_reads(row: dict) -> dict:
    """the reads per token after the re-plan (the steady state: the runtime's bytes_read when it re-planned and
    when the context was freed), and the pools in use then"""
    replanned = [REPLANNED.search(line) for line in row.get("zipmoe_log", [])]
    replanned = [m for m in replanned if m]
    total = COUNTERS.search(row.get("zipmoe_stats", ""))
    if not replanned or not total or row["decode_tokens"] <= int(replanned[0].group(1) or 0):
        return {}
    steps, so_far = int(replanned[0].group(1) or 0), float(replanned[0].group(2)) * 1e6
    found = {"steady_read_per_token": (float(total.group(1)) * 1e6 - so_far) / (row["decode_tokens"] - steps)}
    # the pools the context served with after the re-plan: the last plan logged before the context was freed
    freed = [i for i, line in enumerate(row["zipmoe_log"]) if "expert cache so far:" in line]
    pools = [POOLS.search(line) for line in row["zipmoe_log"][:freed[-1] if freed else None]]
    pools = [m for m in pools if m]
    if pools:
        found["steady_pools"] = dict(zip("FCSE", map(int, pools[-1].groups())))
    return found


def add_run_bounds(result: dict) -> None:
    """per ZipMoE run, the TPOT and TTFT bounds at the read rate the runtime itself saw during the run (its bytes
    read over its I/O thread's time in reads): this disk's rate drifts within minutes, so a rate measured before
    the round may not be the run's"""
    if "limits" not in result:
        return
    lim = result["limits"]
    for row in result["rows"]:
        found = COUNTERS.search(row.get("zipmoe_stats", ""))
        if "tpot_s" not in row or not found or float(found.group(2)) <= 0:
            continue
        rate = float(found.group(1)) * 1e6 / (float(found.group(2)) / 1e3) / 1e9
        reads = {"gbps": {**{f"chunks_depth{d}": {"median": rate} for d in machine.DEPTHS}, "sequential": {"median": rate}}}
        bound = machine.bounds(lim["facts"], reads, lim["decode"], lim["floor"], [row["cap_bytes"]], [1], lim["profile"],
                               lim["threads"], lim["overhead_bytes"], lim["prompt_tokens"])[0]
        if "tpot_bound_s" in bound:
            row["run_bound"] = {"read_gbps": rate, "tpot_bound_s": bound["tpot_bound_s"],
                                "ttft_bound_s": bound["ttft_bound_s"]}


def implied_reads(limits: dict, pools: dict) -> float:
    """the stored bytes a token reads with these pools, for the routing profile of the --limits run"""
    f, _ = machine.inclusion(limits["profile"], limits["facts"]["n_expert"], limits["facts"]["k"], 1)
    return machine.implied_read_bytes(limits["facts"], f, pools)


def run_one(cap: int, model: Path, extra: list[str], args, program: Path | None = None) -> dict:
    cmd = [sys.executable, str(CAPPED_RUN), "--mem", str(cap), "--evict", str(model), "--", sys.executable, "-c",
           IO_WRAPPER, str(program or llama_completion()), "-m", str(model), "-p", PROMPT, "-n", str(args.gen_tokens), "--temp",
           "1", "--seed", str(args.seed), "--ignore-eos", "-no-cnv", "-t", str(args.threads), "-v", *extra]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=tempfile.gettempdir(),
                          stdin=subprocess.DEVNULL)
    row = {"command": cmd[cmd.index("--") + 4:], "wall_s": time.perf_counter() - t}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    capped = json.loads(lines[-1]) if lines else {}
    row.update({"rc": capped.get("rc", proc.returncode), "peak_bytes": capped.get("peak_bytes")})
    stats = last_stats(proc.stderr)
    if stats:
        row["zipmoe_stats"] = stats
    # the runtime's own lines: memory plan, pools chosen and re-planned, preload
    row["zipmoe_log"] = [line.strip() for line in proc.stderr.splitlines() if "ZipMoE" in line][:60]
    io = [line.split()[1:] for line in proc.stderr.splitlines() if line.startswith("IO ")]
    if io:
        fields = dict(zip(io[-1][::2], io[-1][1::2]))
        row["read_bytes"] = int(fields.get("read_bytes:", 0))
    perf = {kind: (float(ms), int(n)) for kind, ms, n in PERF.findall(proc.stderr)}
    load = LOAD.findall(proc.stderr)
    if row["rc"] != 0 or "eval" not in perf or "prompt eval" not in perf or not load:
        row["error"] = proc.stderr[-1500:]
        return row
    ms, n = perf["eval"]
    row.update({"tpot_s": ms / 1e3 / n, "decode_tokens": n, "prompt_tokens": perf["prompt eval"][1],
                "prompt_s": perf["prompt eval"][0] / 1e3, "load_s": float(load[-1]) / 1e3})
    row["ttft_s"] = row["load_s"] + row["prompt_s"]
    row.update(steady_reads(row))
    if "read_bytes" in row:
        row["read_per_token"] = row["read_bytes"] / (n + 1)  # the first token comes from the prompt's pass
    return row


def optional_cell(values: list[float], fmt: str = "{:.2f}") -> str:
    """a cell of a column only some systems have: empty where this one has none"""
    return cell(values, fmt) if values else ""


def failed_words(mine: list[dict], ok: list[dict], rounds: int) -> str:
    """The failed column: how many runs failed and how; "not rerun" when later rounds skipped the system."""
    bad = [r for r in mine if r not in ok]
    if not bad:
        return f"0 of {len(mine)}"
    rc = bad[0]["rc"]
    how = "killed by the cap (SIGKILL)" if rc in (-9, 137, 247) else f"rc {rc}"
    return f"{len(bad)} of {len(mine)}: {how}" + (", not rerun" if len(mine) < rounds else "")


def stock_size(result: dict) -> str:
    return f"{result['stock_bytes'] / 1e9:.2f} GB" if result["stock_bytes"] is not None else "not present: no stock system ran"


def peer_of(systems) -> str:
    """the system ZipMoE's speed-up is against: stock as it pages a model larger than memory; without stock, the
    build before (--before), ZipMoE with the preload off, or with one F pool"""
    for peer in ("stock-paged", "stock", "zipmoe-before", "zipmoe-no-preload", "zipmoe-one-f"):
        if peer in systems:
            return peer
    return "stock"


def bound_columns(result: dict, cap: int, ok: list[dict]) -> str:
    """TPOT / bound and the bounds of bench/limits.py for this cap (batch 1), and where the runs' graph time
    went (the runtime's account, whole run: compute outside fetches, waiting for reads, thread 0 decoding).
    A run measured with its round's read rates is divided by its own round's bound; the bound cells are then
    the rounds' median (min-max)."""
    if "limits" not in result:
        return ""
    bound = next((r for r in result["limits"]["rows"] if r["cap_bytes"] == cap and r["batch"] == 1), None)
    if bound is None or "tpot_bound_s" not in bound:
        return " | | | |"
    tpot_bounds = [r.get("round_bound", bound)["tpot_bound_s"] for r in ok]
    ttft_bounds = [r.get("round_bound", bound)["ttft_bound_s"] for r in ok]
    found = [ACCOUNT.search(r.get("zipmoe_stats", "")) for r in ok]
    # (fetch wall, thread 0 decoding, waiting for reads, graphs) in seconds
    account = [[float(x) / 1e3 for x in m.groups()] for m in found if m]
    parts = [[a[3] - a[0] for a in account], [a[2] for a in account], [a[1] for a in account]]
    where = " / ".join(cell(values, "{:.1f}") for values in parts) if account else ""
    return (f" {cell([b * 1e3 for b in tpot_bounds], '{:.0f}')} | "
            f"{cell([r['tpot_s'] / b for r, b in zip(ok, tpot_bounds)], '{:.2f}')} | {cell(ttft_bounds, '{:.1f}')} | "
            f"{cell([r['ttft_s'] / b for r, b in zip(ok, ttft_bounds)], '{:.2f}')} | {where}")


def markdown(result: dict) -> str:
    systems = result.get("systems", list(SYSTEMS))
    peer = peer_of(systems)
    limits = "limits" in result
    lines = [f"# {Path(result['out']).stem}", "",
             f"{result['date']}, build {result['build']}, {result['threads']} threads, {result['rounds']} interleaved "
             f"rounds, {result['gen_tokens']} generated tokens after a {result['prompt_tokens']}-token prompt, the "
             f"CLI's default context, page cache evicted before each run; O_DIRECT "
             f"{result['odirect_gbps_before']:.2f} GB/s before the first round, {result['odirect_gbps_after']:.2f} "
             f"after the last.", "",
             f"Stock: `{Path(result['stock']).name}` ({stock_size(result)}). ZipMoE: "
             f"`{Path(result['zipmoe']).name}` ({result['zipmoe_bytes'] / 1e9:.2f} GB).", "",
             "```", result["command"], "```", "",
             f"| cap | system | TPOT ms | {peer} TPOT / TPOT | TTFT s (load + prompt) | GB read per token | "
             "peak GB | failed | steady GB read per token (after the re-plan) | / the pools' implied | the run's own read GB/s | "
             "TPOT / bound at it | TTFT / bound at it |" + (" TPOT bound ms | TPOT / bound | TTFT bound s | TTFT / bound | graphs s: compute / "
                                     "waiting for reads / decoding |" if limits else ""),
             "| --- " * (18 if limits else 13) + "|"]
    if limits:
        lines[6:6] = [f"Bounds: `{result['limits']['command']}` ({result['limits']['date']}, build "
                      f"{result['limits']['build']}; profile {result['limits']['profile']}).", ""]
        if result["limits"]["prompt_tokens"] != result["prompt_tokens"]:
            lines[8:8] = [f"**The TTFT bound is for a {result['limits']['prompt_tokens']}-token prompt; these runs' prompt "
                          f"had {result['prompt_tokens']} tokens.**", ""]
    for cap in result["caps"]:
        rows = [r for r in result["rows"] if r["cap_bytes"] == cap]
        for system in systems:
            mine = [r for r in rows if r["system"] == system]
            ok = [r for r in mine if "tpot_s" in r]
            tpot = [r["tpot_s"] * 1e3 for r in ok]
            # per round, the peer's TPOT over this system's: the ratio's own median and spread
            by_round = {r["round"]: r["tpot_s"] for r in rows if r["system"] == peer and "tpot_s" in r}
            ratio = [by_round[r["round"]] / r["tpot_s"] for r in ok if r["round"] in by_round]
            lines.append(f"| {cap / (1 << 30):.0f} GiB | {system} | {cell(tpot, '{:.0f}')} | "
                         f"{cell(ratio, '{:.2f}') if system == 'zipmoe' and by_round else ''} | "
                         f"{cell([r['ttft_s'] for r in ok], '{:.1f}')} | "
                         f"{cell([r['read_per_token'] / 1e9 for r in ok if 'read_per_token' in r], '{:.2f}')} | "
                         f"{cell([(r['peak_bytes'] or 0) / 1e9 for r in ok], '{:.2f}')} | "
                         f"{failed_words(mine, ok, result['rounds'])} | "
                         f"{optional_cell([r['steady_read_per_token'] / 1e9 for r in ok if 'steady_read_per_token' in r])} | "
                         f"{optional_cell([r['steady_read_per_token'] / r['implied_read_per_token'] for r in ok if r.get('implied_read_per_token')])} |"
                         f" {optional_cell([r['run_bound']['read_gbps'] for r in ok if 'run_bound' in r])} | "
                         f"{optional_cell([r['tpot_s'] / r['run_bound']['tpot_bound_s'] for r in ok if 'run_bound' in r])} | "
                         f"{optional_cell([r['ttft_s'] / r['run_bound']['ttft_bound_s'] for r in ok if 'ttft_bound_s' in r.get('run_bound', {})])} |"
                         + (bound_columns(result, cap, ok) + " |" if limits and system.startswith("zipmoe") and ok else
                            " | | | | |" if limits else ""))
    lines += counter_lines(result["rows"], "ZipMoE's counters when the context was freed (whole run), by cap and round:")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stock", type=Path, required=True,
                    help="the GGUF (quantized or BF16) stock llama.cpp runs; may be absent when no stock system runs")
    ap.add_argument("--zipmoe", type=Path, default=None, help="its ZipMoE GGUF (default: made beside it)")
    ap.add_argument("--caps", default="4G,6G", help="memory caps (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=64, help="tokens sampled at temperature 1 (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/quantized/quant_bench.json"))
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"which of {', '.join(SYSTEMS)} to run, in this order in each round (default: %(default)s)")
    ap.add_argument("--limits", type=Path, default=None,
                    help="bench/limits.py bound JSON for this model and these caps: adds TPOT / bound and TTFT / bound")
    ap.add_argument("--before", type=Path, default=None,
                    help="llama-completion of another build (its bin/ beside its lib/): the zipmoe-before system")
    ap.add_argument("--rotate", action="store_true",
                    help="start each round one system later (round 2 runs the second system first, ...): on the bench "
                         "VM a cap's first run was up to 20%% slower than its second")
    ap.add_argument("--rerun-failed", action="store_true",
                    help="run a system again at a cap where it failed in an earlier round (default: skip it)")
    args = ap.parse_args()
    if args.rounds < 1 or args.gen_tokens < 1:
        ap.error("--rounds and --gen-tokens must be at least 1")

    systems = args.systems.split(",")
    if not systems or any(s not in SYSTEMS for s in systems):
        ap.error(f"--systems: '{args.systems}' is not a list of {', '.join(SYSTEMS)}")
    if ("zipmoe-before" in systems) != (args.before is not None):
        ap.error("--before and the zipmoe-before system go together")
    stock = args.stock.resolve()
    zipmoe = zipmoe_beside(stock, args.zipmoe)
    caps = [parse_size(c) for c in args.caps.split(",")]
    limits = json.loads(args.limits.read_text()) if args.limits else None
    bw_before = disk_bw(zipmoe)
    if not stock.exists() and any(SYSTEMS[s][0] == "stock" for s in systems):
        ap.error(f"--stock: {stock} does not exist")
    stock_bytes = stock.stat().st_size if stock.exists() else None  # only the stock systems read it
    print(f"{stock.name}: {stock_size({'stock_bytes': stock_bytes})}; ZipMoE {zipmoe.stat().st_size / 1e9:.2f} GB; "
          f"O_DIRECT {bw_before:.2f} GB/s", flush=True)
    rows = []
    files = {"stock": stock, "zipmoe": zipmoe}
    failed: set[tuple[int, str]] = set()
    partial = args.out.with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    for rnd in range(args.rounds):
        bound = round_bounds(limits, zipmoe, caps) if limits else None
        if bound:
            print(f"round {rnd}: O_DIRECT chunk reads {bound['reads_gbps']['chunks_depth1']:.2f} GB/s, sequential "
                  f"{bound['reads_gbps']['sequential']:.2f}; bounds " + ", ".join(
                      f"{int(c) / (1 << 30):.0f} GiB {b.get('tpot_bound_s', 0) * 1e3:.0f} ms"
                      for c, b in bound["rows"].items()), flush=True)
        for cap in caps:
            for system in round_order(systems, rnd, args.rotate):
                which, extra = SYSTEMS[system]
                if (cap, system) in failed and not args.rerun_failed:
                    continue
                row = {"round": rnd, "system": system, "cap_bytes": cap,
                       **({"round_bound": {"reads_gbps": bound["reads_gbps"], **bound["rows"][str(cap)]}} if bound else {}),
                       **run_one(cap, files[which], extra, args, args.before if system == "zipmoe-before" else None)}
                if limits and "steady_pools" in row:
                    row["implied_read_per_token"] = implied_reads(limits, row["steady_pools"])
                rows.append(row)
                # every run as it ends: a bench cut short keeps what it measured
                partial.write_text(json.dumps({**run_facts(args.out), "rows": rows}, indent=2) + "\n")
                if "error" in row:
                    failed.add((cap, system))
                    print(f"round {rnd} {cap / (1 << 30):.0f} GiB {system:11s} FAILED (rc {row['rc']}): "
                          f"{row['error'][-300:]}", flush=True)
                    continue
                print(f"round {rnd} {cap / (1 << 30):.0f} GiB {system:11s} TPOT {row['tpot_s'] * 1e3:8.1f} ms  "
                      f"TTFT {row['ttft_s']:6.1f} s  read/token {row.get('read_per_token', 0) / 1e9:6.2f} GB  "
                      f"peak {(row['peak_bytes'] or 0) / 1e9:5.2f} GB", flush=True)
    bw_after = disk_bw(zipmoe)
    prompt_tokens = next((r["prompt_tokens"] for r in rows if "prompt_tokens" in r), 0)
    result = {"stock": str(stock), "zipmoe": str(zipmoe), "stock_bytes": stock_bytes,
              "zipmoe_bytes": zipmoe.stat().st_size, "odirect_gbps_before": bw_before, "odirect_gbps_after": bw_after,
              "threads": args.threads, "gen_tokens": args.gen_tokens, "rounds": args.rounds, "seed": args.seed,
              "prompt": PROMPT, "prompt_tokens": prompt_tokens, "caps": caps, "systems": systems,
              **({"before": str(args.before)} if args.before else {}),
              **({"limits": limits} if limits else {}), **run_facts(args.out), "rows": rows}
    add_run_bounds(result)
    save(result, args.out, markdown)
    partial.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
