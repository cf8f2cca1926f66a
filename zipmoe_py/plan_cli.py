"""zipmoe-plan: plan ZipMoE's expert-cache pools for a memory budget from a zipmoe-profile PROFILE.

Reads the PROFILE (and optionally a COSTS file), runs the runtime's planner (paper Algorithm 4, in
C: ggml_zipmoe_plan_fit and ggml_zipmoe_plan_pools, through zipmoe_py/plan_math.py) and writes a
PLAN; the three file formats are in docs/PLAN_FORMAT.md.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from . import _lib
from .errors import ZipMoEError
from .options import parse_size
from .plan_files import load_costs, load_profile, save_plan
from .plan_math import (debiased_rank_profile, default_costs, grid_steps, parse_pool_set, plan,
                        rank_inclusion_probabilities, round_to_subset_size)


def _batch_marginals(profile: dict, batch_size: int, path: Path) -> tuple[np.ndarray, int]:
    """(f, k) for one batch size of a validated profile."""
    batch = profile["batches"].get(str(batch_size))
    if batch is None:
        raise ZipMoEError(f"{path}: field 'batches' has no batch size {batch_size} "
                          f"(it has {', '.join(sorted(profile['batches'], key=int))})")
    f = rank_inclusion_probabilities(batch["counts"], batch["n_ubatches"])
    if batch_size == 1:
        # one token selects exactly n_expert_used distinct experts in every layer
        k = profile["n_expert_used"]
        if abs(f.sum() - k) > 1e-9 * k:
            raise ZipMoEError(f"{path}: field 'batches.1.counts' gives {f.sum():.6g} selected experts per ubatch "
                              f"on average, but one token selects n_expert_used={k}")
        # as the runtime's re-plan: a few ubatches' top ranks look hotter than they are
        return debiased_rank_profile(f, batch["n_ubatches"], k), k
    return round_to_subset_size(f)


def smallest_budget(expert_bytes: dict, pools: tuple[str, ...], n_layer_moe: int) -> tuple[int, str]:
    """(bytes, pool): the least budget that keeps one expert per MoE layer in the cheapest pool of
    Lambda (the planner's capacity of a pool is floor(share * budget / (its expert bytes * layers)))."""
    cheapest = min(pools, key=lambda p: (int(expert_bytes[p]), pools.index(p)))
    return int(expert_bytes[cheapest]) * n_layer_moe, cheapest


def size_text(n_bytes: int) -> str:
    """n_bytes as a --budget value, rounded up so that it still holds n_bytes: 1800 -> '1.76K'."""
    for unit, suffix in ((2**30, "G"), (2**20, "M"), (2**10, "K")):
        if n_bytes >= unit:
            hundredths = -(-n_bytes * 100 // unit)  # ceiling
            while True:
                text = f"{hundredths / 100:g}{suffix}"
                if parse_size(text, "--budget") >= n_bytes:
                    return text
                hundredths += 1
    return str(n_bytes)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="zipmoe-plan",
        description="Plan ZipMoE's expert cache pools (paper Algorithm 4): split a memory budget between pools "
                    "of full (F), compressed (C), sign+mantissa-only (S) and exponent-only (E) experts so that "
                    "the expected makespan of a sparse layer is minimal, under the maximum-entropy model of the "
                    "profiled expert activations. Writes a JSON plan (pool ratios, capacities per layer and the "
                    "dispatch thresholds); the file formats are described in docs/PLAN_FORMAT.md.")
    ap.add_argument("profile", type=Path, metavar="PROFILE.json",
                    help="activation profile written by zipmoe-profile (format 'zipmoe-profile')")
    ap.add_argument("--budget", required=True,
                    help="memory for the expert cache of all MoE layers together, bytes or like 4G, 512M, 1.5GiB")
    ap.add_argument("--pools", default=",".join(_lib.pool_names()),
                    help="the cache pools to use, comma separated, a subset of F,C,S,E (default: %(default)s): "
                         "F full BF16 experts, C compressed experts, S sign+mantissa chunks only, E compressed "
                         "exponent chunks only; the hierarchy order F,C,S,E applies whatever the order given")
    ap.add_argument("--costs", type=Path, default=None, metavar="COSTS.json",
                    help="measured delays (format 'zipmoe-costs': u_s SM-chunk read, v_s E-chunk read, c_s "
                         "E-chunk decompression, threads). Default: from the profile's expert sizes at the "
                         f"runtime's default rates, {_lib.default_rate(_lib.RATE_READ) / 1e9:.1f} GB/s O_DIRECT reads "
                         f"and {_lib.default_rate(_lib.RATE_DECODE) / 1e9:.1f} GB/s per core of decoded BF16")
    ap.add_argument("--threads", type=int, default=None, metavar="L",
                    help="decompression threads L of Algorithm 3 (default: the costs file's, else all cores)")
    ap.add_argument("--grid", type=float, default=0.05,
                    help="step of the memory ratios searched, dividing 1 (default: %(default)s)")
    ap.add_argument("--delta", type=int, default=0,
                    help="dispatch tolerance margin in ranks added to every threshold (default: %(default)s)")
    ap.add_argument("--batch-size", type=int, default=1, metavar="B",
                    help="plan for the profile's ubatches of B tokens (default: %(default)s); for B > 1 the "
                         "experts per ubatch k is the mean number of distinct experts its tokens select, rounded")
    ap.add_argument("-o", "--output", type=Path, required=True, metavar="PLAN.json", help="plan file to write")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.delta < 0:
        ap.error(f"--delta must be >= 0, got {args.delta}")
    if args.batch_size < 1:
        ap.error(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        budget = parse_size(args.budget, "--budget")
        try:
            pools = parse_pool_set(args.pools)
            grid_steps(args.grid)
        except ValueError as e:
            raise ZipMoEError(f"--pools/--grid: {e}") from None
        profile = load_profile(args.profile)
        least, cheapest = smallest_budget(profile["expert_bytes"], pools, profile["n_layer_moe"])
        if budget < least:
            ap.error(f"--budget {args.budget} ({budget} bytes) keeps no expert: the smallest budget that keeps one "
                     f"expert per MoE layer in the cheapest pool of {','.join(pools)} is {least} bytes "
                     f"(--budget {size_text(least)}: one {cheapest} expert of {profile['expert_bytes'][cheapest]} "
                     f"bytes in each of the {profile['n_layer_moe']} MoE layers of {args.profile})")
        f, k = _batch_marginals(profile, args.batch_size, args.profile)
        if args.costs is not None:
            costs, threads = load_costs(args.costs)
        else:
            costs = default_costs(profile["expert_bytes"], profile["n_tensors_per_expert"], profile["n_shards"])
            threads = os.cpu_count() or 1
        threads = args.threads or threads
        if not args.output.parent.exists():
            raise ZipMoEError(f"output folder does not exist: {args.output.parent}")
        try:
            result = plan(f, k, budget, profile["expert_bytes"], pools, costs, threads, profile["n_shards"],
                          profile["n_tensors_per_expert"], profile["n_layer_moe"], grid=args.grid, delta=args.delta)
        except ValueError as e:
            raise ZipMoEError(f"{args.profile}: batch size {args.batch_size}: {e}") from None
        if not any(result.capacities.values()):  # a plan that keeps nothing is refused by every loader
            raise ZipMoEError(f"the plan for --budget {args.budget} keeps no expert in any pool of "
                              f"{','.join(pools)} (keeping none has the least expected makespan under these "
                              f"costs); no plan written to {args.output}")
        meta = {"model": profile["model"], "profile": str(args.profile), "batch_size": args.batch_size,
                "grid": args.grid, "threads": threads,
                "n_shards": profile["n_shards"], "n_tensors_per_expert": profile["n_tensors_per_expert"],
                "expert_bytes": profile["expert_bytes"],
                "costs": {"u_s": costs.u_s, "v_s": costs.v_s, "c_s": costs.c_s,
                          "source": str(args.costs) if args.costs else "default"},
                "inclusion_probabilities": [float(x) for x in f]}
        save_plan(args.output, result, meta)
    except ZipMoEError as e:
        print(f"zipmoe-plan: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: k={result.k} of {result.n_expert} experts, budget {budget / 2**30:.3f} GiB over "
          f"{result.n_layer_moe} MoE layers, expected makespan {result.expected_makespan_s * 1e3:.3f} ms per layer")
    for pool in result.pools:
        print(f"  {pool}: ratio {result.ratios[pool]:.2f}, {result.capacities[pool]} experts per layer "
              f"({result.memory_bytes[pool] / 2**20:.1f} MiB), threshold {result.thresholds[pool]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
