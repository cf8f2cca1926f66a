"""The compute floor of a model too big for this machine, from truncations of it that fit.

bench/limits.py floor measures it directly (stock llama-bench on >= 3 resident truncations, with the
line's residuals); this script fits the same line through bench/cli_bench.py runs of truncations.

A decode step's time with every weight resident is a fixed part (embedding, output head, sampling)
plus one part per layer, and every MoE layer of a bench model has the same shapes. So the floor of
the full model is the straight line through the resident TPOTs of truncations (same geometry,
fewer layers; bench/make_bench_model.py --layers L) at its layer count. Each truncation is run by
bench/cli_bench.py with a cap that does not bind (250% of the model), stock and ZipMoE (every
expert preloaded); this script fits and extrapolates their JSON:

    .venv/bin/python bench/make_bench_model.py deepseek2 --layers 4 -o bench/work/ds4.gguf
    .venv/bin/python bench/cli_bench.py --bf16 bench/work/ds4.gguf --caps 250 --contexts 256 \\
        --gen-tokens 16 --systems stock,zipmoe,stock,zipmoe --out bench/work/floor_ds4.json
    (the same with --layers 10)
    .venv/bin/python bench/compute_floor.py bench/work/floor_ds4.json bench/work/floor_ds10.json \\
        --layers 27 --out docs/benchmarks/bound/compute_floor_ds27.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from _common import fit_line


def layers_of(run: dict) -> int:
    """The truncation's layer count, from the GGUF's name (make_bench_model's dsN / qwenN) or the field."""
    if "layers" in run:
        return int(run["layers"])
    match = re.search(r"(\d+)(?:u|-uniform)?\.gguf$", run["bf16"])
    if not match:
        raise SystemExit(f"{run['bf16']}: cannot tell its layer count from the name; add \"layers\" to the JSON")
    return int(match.group(1))


def best_tpot(run: dict, system: str) -> float:
    times = [r["tpot_s"] for r in run["rows"] if r["system"] == system and "tpot_s" in r]
    if not times:
        raise SystemExit(f"{run['bf16']}: no {system} run with a TPOT")
    return min(times)  # the floor: the least disturbed run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="cli_bench JSON of resident truncations (cap 250%%)")
    ap.add_argument("--layers", type=int, required=True, help="layer count of the full model")
    ap.add_argument("--out", type=Path, default=None, help="write the fit and the floor here (JSON)")
    args = ap.parse_args()
    runs = [json.loads(p.read_text()) for p in args.runs]
    result = {"full_layers": args.layers, "truncations": [], "command": " ".join(["bench/compute_floor.py", *sys.argv[1:]])}
    for run in runs:
        result["truncations"].append({"bf16": run["bf16"], "layers": layers_of(run),
                                      "stock_tpot_s": best_tpot(run, "stock"), "zipmoe_tpot_s": best_tpot(run, "zipmoe")})
    for system in ("stock", "zipmoe"):
        line = fit_line([(t["layers"], t[f"{system}_tpot_s"]) for t in result["truncations"]])
        result[system] = {**line, "floor_s": line["fixed_s"] + line["per_layer_s"] * args.layers}
    for t in result["truncations"]:
        print(f"{Path(t['bf16']).name}: {t['layers']} layers, resident TPOT stock {t['stock_tpot_s'] * 1e3:.1f} ms, "
              f"ZipMoE {t['zipmoe_tpot_s'] * 1e3:.1f} ms")
    for system in ("stock", "zipmoe"):
        r = result[system]
        print(f"{system}: {r['fixed_s'] * 1e3:.1f} ms + {r['per_layer_s'] * 1e3:.2f} ms x layers -> "
              f"{r['floor_s'] * 1e3:.0f} ms at {args.layers} layers")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
