#!/usr/bin/env python3
"""The fork's llama-completion as a user runs it: stock llama.cpp on the BF16 GGUF against ZipMoE on
the ZipMoE GGUF, no ZipMoE options at all, under memory caps of 25 / 50 / 75% of the BF16 model.

    .venv/bin/python bench/cli_bench.py --bf16 M.gguf [--zipmoe M.zipmoe.gguf] [--caps 25,50,75]
        [--contexts default,256] [--gen-tokens 32] [--threads 2] [--out docs/benchmarks/cpu/cli_bench.json]

Every run is `capped-run --mem CAP --evict FILE -- llama-completion -m FILE -p PROMPT -n N --temp 1
--seed S --ignore-eos -no-cnv -t T -v [CONTEXT]` (-v: the runtime's counters are logged when the context is freed; ../shared/tools/capped-run: a child memory cgroup,
page cache included; the model evicted from the page cache first). CONTEXT is llama-completion's
default (8192 tokens, batch 2048) or `-c 256 -b 64`. TPOT is llama-completion's own "eval time" per
token; a run that fails or is killed is recorded as such. The O_DIRECT bandwidth of the disk is
measured in the same run. Prints a table, saves --out (JSON), a Markdown table and a PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import CAPPED_RUN, PERF, last_stats, disk_bw, llama_completion, zipmoe_beside

PROMPT = ("In a mixture of experts model every token is routed to a few experts chosen by a small router, "
          "so most of the weights sit idle at any moment and can wait on disk until they are needed.")
CONTEXTS = {"default": [], "256": ["-c", "256", "-b", "64"]}
# systems beyond stock and zipmoe (the defaults): one ZipMoE option changed through its environment variable
SYSTEM_ENV = {"zipmoe-prefetch": {"ZIPMOE_PREFETCH": "1"}, "zipmoe-noprefetch": {"ZIPMOE_PREFETCH": "0"},
              "zipmoe-fpool": {"ZIPMOE_AUTO_POOLS": "0"}}


def run_one(cap: int, model: Path, args, context: str, env: dict | None = None) -> dict:
    cmd = [sys.executable, str(CAPPED_RUN), "--mem", str(cap), "--evict", str(model), "--",
           str(llama_completion()), "-m", str(model), "-p", PROMPT, "-n", str(args.gen_tokens), "--temp", "1",
           "--seed", str(args.seed), "--ignore-eos", "-no-cnv", "-t", str(args.threads), "-v", *CONTEXTS[context]]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=tempfile.gettempdir(),
                          stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})
    row = {"command": cmd[cmd.index("--") + 1:], "env": env or {}, "wall_s": time.perf_counter() - t}
    stats = last_stats(proc.stderr)
    if stats:
        row["zipmoe_stats"] = stats  # the runtime's counters when the run ended: where the time went
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    capped = json.loads(lines[-1]) if lines else {}
    row.update({"rc": capped.get("rc", proc.returncode), "peak_bytes": capped.get("peak_bytes")})
    perf = {kind: (float(ms), int(n)) for kind, ms, n in PERF.findall(proc.stderr)}
    if row["rc"] != 0 or "eval" not in perf:
        row["error"] = proc.stderr[-1500:]
        return row
    ms, n = perf["eval"]
    row.update({"tpot_s": ms / 1e3 / n, "decode_tokens": n})
    if "prompt eval" in perf:
        row.update({"prompt_s": perf["prompt eval"][0] / 1e3, "prompt_tokens": perf["prompt eval"][1]})
    for line in proc.stderr.splitlines():
        if ("ZipMoE expert cache:" in line or "ZipMoE expert cache pools" in line or "ZipMoE pools re-planned" in line
                or "memory is short" in line
                or "does not fit" in line or "ZipMoE preloaded" in line):
            row.setdefault("zipmoe_log", []).append(line.strip())
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bf16", type=Path, required=True, help="BF16 GGUF (stock llama.cpp's input)")
    ap.add_argument("--zipmoe", type=Path, default=None, help="ZipMoE GGUF made from it (default: made beside it)")
    ap.add_argument("--caps", default="25,50,75", help="memory caps in %% of the BF16 model (default: %(default)s)")
    ap.add_argument("--contexts", default="default,256",
                    help="llama-completion context settings: default (its own: 8192 tokens, batch 2048) and/or "
                         "256 (-c 256 -b 64) (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=32, help="tokens sampled at temperature 1 (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--systems", default="stock,zipmoe",
                    help=f"stock, zipmoe and/or {', '.join(SYSTEM_ENV)} (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/cpu/cli_bench.json"))
    args = ap.parse_args()

    bf16 = args.bf16.resolve()
    zipmoe = zipmoe_beside(bf16, args.zipmoe)
    bad = [s for s in args.systems.split(",") if s not in ("stock", "zipmoe", *SYSTEM_ENV)]
    if bad:
        ap.error(f"--systems: unknown {bad}; known are stock, zipmoe, {', '.join(SYSTEM_ENV)}")
    contexts = args.contexts.split(",")
    unknown = [c for c in contexts if c not in CONTEXTS]
    if unknown:
        ap.error(f"--contexts: unknown {unknown}; known are {', '.join(CONTEXTS)}")
    model_bytes = bf16.stat().st_size
    bw = disk_bw(zipmoe)
    print(f"{bf16.name}: {model_bytes / 1e9:.2f} GB BF16, {zipmoe.stat().st_size / 1e9:.2f} GB ZipMoE; "
          f"O_DIRECT {bw:.2f} GB/s; {args.threads} threads, {args.gen_tokens} sampled tokens", flush=True)

    rows = []
    for context in contexts:
        for pct in [int(c) for c in args.caps.split(",")]:
            cap = model_bytes * pct // 100
            for system in args.systems.split(","):
                path = bf16 if system == "stock" else zipmoe
                row = {"system": system, "context": context, "cap_pct": pct, "cap_bytes": cap,
                       **run_one(cap, path, args, context, SYSTEM_ENV.get(system))}
                rows.append(row)
                if "error" in row:
                    print(f"ctx {context:>7} {pct:>3}% {system:7s} FAILED (rc {row['rc']}): {row['error'][-300:]}",
                          flush=True)
                    continue
                print(f"ctx {context:>7} {pct:>3}% {system:7s} TPOT {row['tpot_s'] * 1e3:8.1f} ms  "
                      f"prompt {row.get('prompt_s', 0):6.2f} s  peak {(row['peak_bytes'] or 0) / 1e9:5.2f} GB  "
                      f"wall {row['wall_s']:6.1f} s", flush=True)
            pair = {r["system"]: r for r in rows if r["context"] == context and r["cap_pct"] == pct}
            if "tpot_s" in pair.get("stock", {}) and "tpot_s" in pair.get("zipmoe", {}):
                print(f"ctx {context:>7} {pct:>3}% ZipMoE TPOT / stock TPOT: "
                      f"{pair['zipmoe']['tpot_s'] / pair['stock']['tpot_s']:.2f}", flush=True)

    result = {"bf16": str(bf16), "zipmoe": str(zipmoe), "model_bytes": model_bytes,
              "zipmoe_bytes": zipmoe.stat().st_size, "odirect_gbps": bw, "threads": args.threads,
              "gen_tokens": args.gen_tokens, "seed": args.seed, "prompt": PROMPT, "machine": platform.platform(),
              "cpu_count": os.cpu_count(), "rows": rows, "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result, contexts))
    plot(result, contexts, args.out.with_suffix(".png"))
    print(f"saved {args.out} and its .md and .png")
    return 0


def markdown(result: dict, contexts: list[str]) -> str:
    lines = [f"`{result['command']}`", "",
             f"{Path(result['bf16']).name}: {result['model_bytes'] / 1e9:.2f} GB BF16, "
             f"{result['zipmoe_bytes'] / 1e9:.2f} GB ZipMoE; O_DIRECT {result['odirect_gbps']:.2f} GB/s measured in "
             f"the run; {result['threads']} threads; {result['gen_tokens']} tokens sampled at temperature 1.", "",
             "| context | cap | system | TPOT ms | stock TPOT / TPOT | prompt eval s | peak GB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    systems = list(dict.fromkeys(r["system"] for r in result["rows"]))
    for context in contexts:
        for pct in sorted({r["cap_pct"] for r in result["rows"]}):
            rows = {r["system"]: r for r in result["rows"] if r["context"] == context and r["cap_pct"] == pct}
            stock = rows.get("stock", {}).get("tpot_s")
            label = "default (8192)" if context == "default" else f"-c {context} -b 64"
            for system in systems:
                r = rows.get(system)
                if r is None:
                    continue
                if "tpot_s" not in r:
                    lines.append(f"| {label} | {pct}% | {system} | failed (rc {r['rc']}) | | | |")
                    continue
                speedup = f"{stock / r['tpot_s']:.2f}x" if stock else ""
                lines.append(f"| {label} | {pct}% | {system} | {r['tpot_s'] * 1e3:.0f} | {speedup} | "
                             f"{r.get('prompt_s', 0):.2f} | {(r.get('peak_bytes') or 0) / 1e9:.2f} |")
    counters = [(r["system"], r["context"], r["cap_pct"], r["zipmoe_stats"]) for r in result["rows"] if r.get("zipmoe_stats")]
    if counters:
        lines += ["", "The runtime's counters when the context was freed (whole run: prompt and generation):", ""]
        lines += [f"- {system}, {context}, {pct}%: {text}" for system, context, pct, text in counters]
    return "\n".join(lines) + "\n"


def plot(result: dict, contexts: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install '.[bench]')")
        return
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 3.8), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for system in dict.fromkeys(r["system"] for r in result["rows"]):
            pts = [(r["cap_pct"], r["tpot_s"] * 1e3) for r in result["rows"]
                   if r["system"] == system and r["context"] == context and "tpot_s" in r]
            if pts:
                names = {"stock": "stock llama.cpp", "zipmoe": "ZipMoE", "zipmoe-prefetch": "ZipMoE, prefetch",
                         "zipmoe-noprefetch": "ZipMoE, no prefetch", "zipmoe-fpool": "ZipMoE, one F pool"}
                ax.plot(*zip(*sorted(pts)), marker="o", label=names.get(system, system))
        ax.set_title("default context" if context == "default" else f"-c {context} -b 64")
        ax.set_xlabel("memory cap, % of the BF16 model")
        ax.set_ylabel("TPOT, ms (lower is better)")
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(f"llama-completion, no ZipMoE options: {Path(result['bf16']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
