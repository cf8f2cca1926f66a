"""What the bench scripts share: the capped runner, the benches' prompt, the patterns of llama-completion's
and the runtime's log lines, sizes, and how a result is saved. Every script imports from here (a script run
as `python bench/X.py` has bench/ on sys.path); nothing here imports a bench script or the tests, so the
scripts form no circle.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# ../shared/tools/capped-run: a child memory cgroup (page cache included), the model evicted from the page cache first
CAPPED_RUN = BENCH.parents[1] / "shared" / "tools" / "capped-run"

# 60 tokens or so with either tokenizer: the benchmark standard asks for a prompt of at least 40
PROMPT = ("In a mixture of experts model every token is routed to a few experts chosen by a small router, "
          "so most of the weights sit idle at any moment and can wait on disk until they are needed. A cache "
          "of the experts that were used recently, sized to the memory the machine has, keeps the hot ones at "
          "hand, and the rest are read when the router asks for them.")

# llama-completion's timings
PERF = re.compile(r"(prompt eval|eval) time =\s*([0-9.]+) ms /\s*(\d+) (?:tokens|runs)")
LOAD = re.compile(r"load time =\s*([0-9.]+) ms")
# the runtime's counters, logged when a context is freed: one line, or one per slot set named by its device
STATS = re.compile(r"ZipMoE expert cache so far: (.*)")
DEVICE_STATS = re.compile(r"ZipMoE expert cache of (\S+) so far: (.*)")


def last_stats(stderr: str) -> str | None:
    """The counters of the last context freed: its line, or each slot set's ("CPU: ... | CUDA0: ...")"""
    by_device = dict(DEVICE_STATS.findall(stderr))  # the last line of each device
    if by_device:
        return " | ".join(f"{device}: {text.strip()}" for device, text in by_device.items())
    stats = STATS.findall(stderr)
    return stats[-1].strip() if stats else None
# in those counters: MB read, and the I/O thread's, decode and recover times
COUNTERS = re.compile(r"([0-9.]+) MB read .*?io ([0-9.]+) ms, decode ([0-9.]+) ms, recover ([0-9.]+) ms")
# and the time account (docs/GUIDE.md, "Where a token's time goes"): fetch wall, thread 0 decoding, waiting
# for reads, graphs
ACCOUNT = re.compile(r"fetch wall ([0-9.]+) ms \(fetch lock [0-9.]+, plan [0-9.]+, thread 0 decoding ([0-9.]+), waiting "
                     r"for reads ([0-9.]+), waiting for the other threads [0-9.]+; \d+ page faults\); \d+ graphs, "
                     r"([0-9.]+) ms")


def parse_size(text: str) -> int:
    """Bytes of "4G", "512M", "1.5GiB" or a plain count (binary units): the runtime's own reading of a size
    (zipmoe_py.options.parse_size), which also takes 0 here (an --overhead of nothing). A ValueError for
    anything else, so that argparse's type= names the argument."""
    if text.strip() == "0":
        return 0
    from zipmoe_py import options
    from zipmoe_py.errors import ZipMoEError

    try:
        return options.parse_size(text, "a size")
    except ZipMoEError as e:
        raise ValueError(str(e)) from None


def disk_bw(path: Path) -> float:
    """the disk's O_DIRECT read rate in GB/s, as capped-run measures it on path"""
    out = subprocess.run([sys.executable, str(CAPPED_RUN), "--disk-bw", str(path)], capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["odirect_gbps"]


def llama_completion() -> Path:
    from zipmoe_py import _paths

    return _paths.program("llama-completion")


def zipmoe_beside(source: Path, given: Path | None) -> Path:
    """The ZipMoE GGUF given, or the one beside source (made from it when missing)."""
    zipmoe = given
    if zipmoe is None:
        zipmoe = source.with_suffix(".zipmoe.gguf")
        if not zipmoe.exists():
            from zipmoe_py import format as zformat

            print(f"making {zipmoe} from {source} ...", flush=True)
            zformat.repack(source, zipmoe)
    return zipmoe.resolve()


def round_order(systems: list[str], r: int, rotate: bool) -> list[str]:
    """the systems (or servers) of round r (0-based): as given, or started r places later"""
    shift = r % len(systems) if rotate else 0
    return systems[shift:] + systems[:shift]


def cell(values: list[float], fmt: str) -> str:
    """median (min-max) of values, or "failed" for none"""
    if not values:
        return "failed"
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def counter_lines(rows: list[dict], heading: str) -> list[str]:
    """ZipMoE's counters of each run (its log line when the context was freed), by cap and round"""
    counters = [(r["cap_bytes"], r["round"], r.get("system", ""), r["zipmoe_stats"]) for r in rows
                if r.get("zipmoe_stats")]
    if not counters:
        return []
    return ["", heading, ""] + [f"- {cap / (1 << 30):.0f} GiB, round {rnd}{f', {system}' if system else ''}: {text}"
                                for cap, rnd, system, text in counters]


def fit_line(points: list[tuple[int, float]]) -> dict:
    """least squares a + b L, with each point's residual"""
    n = len(points)
    mean_l = sum(p[0] for p in points) / n
    mean_t = sum(p[1] for p in points) / n
    var = sum((p[0] - mean_l) ** 2 for p in points)
    if var == 0:
        raise ValueError("the truncations need at least two different layer counts")
    slope = sum((p[0] - mean_l) * (p[1] - mean_t) for p in points) / var
    fixed = mean_t - slope * mean_l
    return {"fixed_s": fixed, "per_layer_s": slope,
            "residuals_s": [t - (fixed + slope * layers) for layers, t in points]}


def run_facts(out: Path) -> dict:
    """what every result records beside its rows: machine, date, build and the command that made it"""
    build = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           cwd=BENCH).stdout.strip()
    return {"machine": platform.platform(), "cpu_count": os.cpu_count(), "date": datetime.date.today().isoformat(),
            "build": build, "command": " ".join([Path(sys.executable).name, *sys.argv]), "out": str(out)}


def save(result: dict, out: Path, to_markdown) -> None:
    """the result as JSON at out, its Markdown table beside it (printed too)"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(to_markdown(result))
    print(out.with_suffix(".md").read_text())
