#!/usr/bin/env python3
"""Accuracy harness: what a ZipMoE configuration costs in accuracy against the exact run.

    .venv/bin/python bench/accuracy_bench.py --model bench/work/trained/qwen2moe [--model ...]
        [--corpus python-docs | --text FILE] [--tokens 2048] [--window 256] [--ubatch 1]
        [--budgets 10,25,50] [--configs lossless,smoe:0,smoe:0.1,...] [--out docs/benchmarks/accuracy/accuracy.json]

A model is a trained Hugging Face checkpoint (zipmoe-train-tiny) or a BF16 GGUF; its BF16 GGUF and
ZipMoE GGUF are made beside --work when missing. The exact run is the BF16 GGUF on the same llama.cpp
(no expert cache). Every configuration runs the ZipMoE GGUF under an expert-cache budget of the given
percentages of all routed experts' bytes, on the same held-out tokens, cut into windows of --window
tokens evaluated from an empty KV cache, --ubatch tokens per llama_decode (1: every position is a
decode step, where SMoE substitutes; larger ubatches are prefill). Per configuration and budget:
- perplexity of the next token (and its delta to the exact run's),
- top-1 agreement: positions whose most likely next token is the exact run's,
- mean KL(exact || configuration) of the next-token distribution,
- whether every logit is bit-identical to the exact run's (lossless configurations must be: delta 0),
- the cache's misses, bytes read and substitutions per token, and the wall time per token (the tiny
  trained models are compute-bound: bench/e2e_bench.py measures speed on the bench models).
Configurations: "lossless" (the defaults) and "smoe:ALPHA" (LOSSY: zipmoe_substitution="smoe").
Prints a table and saves --out (JSON) and a Markdown table beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def parse_config(name: str, buddy_profile: Path | None = None) -> dict:
    """Llama keyword arguments of a configuration name: lossless, smoe:ALPHA, buddy[:NAME=VALUE...]
    (BuddyMoE's parameters, e.g. buddy:rho=2:tau=0.5)."""
    if name == "lossless":
        return {}
    if name == "buddy" or name.startswith("buddy:"):
        from zipmoe_py import options
        from zipmoe_py.errors import ZipMoEError

        buddy = [o.name[len("buddy_"):] for o in options.python_options()
                 if o.name.startswith("buddy_") and o.name != "buddy_profile"]
        out = {"zipmoe_substitution": "buddy", "zipmoe_buddy_profile": str(buddy_profile) if buddy_profile else None}
        for item in name.split(":")[1:]:
            key, _, value = item.partition("=")
            if key not in buddy:
                raise ValueError(f"unknown configuration {name!r}: {key!r} is not a BuddyMoE parameter "
                                 f"({', '.join(buddy)})")
            try:
                out[f"zipmoe_buddy_{key}"] = options.parse_value(options.find(f"buddy_{key}"), value)
            except ZipMoEError as e:
                raise ValueError(f"unknown configuration {name!r}: {e}") from None
        return out
    if name.startswith("smoe:"):
        try:
            alpha = float(name[5:])
        except ValueError:
            alpha = -1.0
        if 0 <= alpha <= 1:
            return {"zipmoe_substitution": "smoe", "zipmoe_smoe_alpha": alpha}
    raise ValueError(f"unknown configuration {name!r}: give lossless, smoe:ALPHA with ALPHA in [0, 1], or "
                     "buddy[:NAME=VALUE...]")


def log_softmax(logits: np.ndarray):
    """Next-token log-probabilities (torch float32: numpy float64 over a 150k vocabulary took ~30 s a run)."""
    import torch

    return torch.log_softmax(torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32)), dim=-1)


def run_windows(path: Path, windows: list[list[int]], ubatch: int, threads: int, options: dict) -> dict:
    """Logits of every position of every window (raw float32), the cache's statistics and the time."""
    from zipmoe_py import Llama

    window = max(len(w) for w in windows)
    llm = Llama(model_path=str(path), n_ctx=window, n_batch=ubatch, n_ubatch=ubatch, logits_all=True,
                n_threads=threads, n_threads_batch=threads, verbose=False, **options)
    try:
        llm.zipmoe_reset_stats()
        logits = []
        t0 = time.perf_counter()
        for w in windows:
            llm.reset()
            llm.eval(w)
            logits.append(np.array(llm.scores[:len(w)], dtype=np.float32))
        seconds = time.perf_counter() - t0
        return {"logits": logits, "stats": llm.zipmoe_stats(), "seconds": seconds}
    finally:
        llm.close()


def compare(exact: list[np.ndarray], got: list[np.ndarray], windows: list[list[int]]) -> dict:
    """Perplexity, top-1 agreement with the exact run and mean KL(exact || got) over the next-token
    predictions of every window (the last position of a window predicts nothing). Sums in float64
    over float32 log-probabilities; a window whose logits are bit-identical contributes its exact
    values (delta 0) without being recomputed."""
    import torch

    nll_exact = nll_got = kl = agree = n = 0.0
    identical = True
    for ref, out, w in zip(exact, got, windows):
        same = np.array_equal(ref.view(np.uint32), out.view(np.uint32))
        identical &= same
        targets = torch.tensor(w[1:])
        rows = torch.arange(len(targets))
        lp_ref = log_softmax(ref[:-1])
        nll_ref = -lp_ref[rows, targets].double().sum().item()
        nll_exact += nll_ref
        n += len(targets)
        if same:
            nll_got += nll_ref
            agree += len(targets)
            continue
        lp_out = log_softmax(out[:-1])
        nll_got += -lp_out[rows, targets].double().sum().item()
        kl += (lp_ref.exp() * (lp_ref - lp_out)).sum(dim=-1).double().sum().item()
        agree += (lp_ref.argmax(dim=-1) == lp_out.argmax(dim=-1)).sum().item()
    ppl_exact, ppl = float(np.exp(nll_exact / n)), float(np.exp(nll_got / n))
    return {"positions": int(n), "ppl": ppl, "ppl_exact": ppl_exact, "ppl_delta": ppl - ppl_exact,
            "top1_agreement": float(agree / n), "kl_mean": 0.0 if identical else float(max(kl / n, 0.0)),
            "bit_identical": bool(identical)}


def ensure_ggufs(model: Path, work: Path) -> tuple[Path, Path]:
    """(BF16 GGUF, ZipMoE GGUF) of a trained checkpoint folder or a BF16 GGUF, made when missing."""
    from zipmoe_py import format as zformat

    if model.is_dir():
        work.mkdir(parents=True, exist_ok=True)
        bf16 = work / f"{model.name}-bf16.gguf"
        stamp = (model / "model.safetensors").stat().st_mtime
        if not bf16.exists() or bf16.stat().st_mtime < stamp:
            convert = Path(sys.executable).parent / "zipmoe-convert"
            proc = subprocess.run([str(convert), str(model), "-o", str(bf16), "--bf16", "--quiet"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"converting {model} failed:\n{proc.stderr[-2000:]}")
    else:
        bf16 = model
    zipmoe = bf16.with_name(bf16.name.replace("-bf16.gguf", "").replace(".gguf", "") + ".zipmoe.gguf")
    if not zipmoe.exists() or zipmoe.stat().st_mtime < bf16.stat().st_mtime:
        zformat.repack(bf16, zipmoe)
    return bf16, zipmoe


def all_experts_bytes(zipmoe: Path) -> int:
    from zipmoe_py import format as zformat

    with zformat.ZipMoEFile(zipmoe) as zf:
        return zf.expert_bytes().all_experts


def held_out_tokens(bf16: Path, text: str, n_tokens: int) -> list[int]:
    from zipmoe_py import Llama

    llm = Llama(model_path=str(bf16), vocab_only=True, verbose=False)
    try:
        tokens = llm.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        llm.close()
    if len(tokens) < n_tokens:
        raise SystemExit(f"the held-out text has {len(tokens)} tokens, fewer than --tokens {n_tokens}")
    return tokens[:n_tokens]


def ensure_buddy_profile(zipmoe: Path, calibration: str, heldout: str, args) -> Path:
    """The model's BuddyMoE profile, made from the calibration text when missing (zipmoe-buddies)."""
    from zipmoe_py.buddies import make_profile

    out = zipmoe.with_name(zipmoe.name.replace(".zipmoe.gguf", "") + ".buddies.json")
    if not out.exists() or out.stat().st_mtime < zipmoe.stat().st_mtime:
        doc = make_profile(zipmoe, calibration, heldout=heldout[:200_000], threads=args.threads, text_name=args.calibration_name,
                           progress=lambda m: print(f"  buddies: {m}", flush=True))
        out.write_text(json.dumps(doc) + "\n")
    return out


def bench_model(model: Path, text: str, args) -> dict:
    bf16, zipmoe = ensure_ggufs(model, args.work)
    profile = None
    if any(c.startswith("buddy") for c in args.configs):
        profile = ensure_buddy_profile(zipmoe, args.calibration, text, args)
    tokens = held_out_tokens(bf16, text, args.tokens)
    windows = [tokens[i:i + args.window] for i in range(0, len(tokens) - 1, args.window)]
    windows = [w for w in windows if len(w) > 1]
    exact = run_windows(bf16, windows, args.ubatch, args.threads, {})
    everything = all_experts_bytes(zipmoe)
    rows = []
    print(f"{model}: {len(tokens)} held-out tokens in {len(windows)} windows; exact run "
          f"{exact['seconds'] / len(tokens) * 1e3:.2f} ms/token", flush=True)
    for pct in args.budgets:
        budget = max(1, everything * pct // 100)
        for config in args.configs:
            got = run_windows(zipmoe, windows, args.ubatch, args.threads,
                              {"zipmoe_budget": budget, **parse_config(config, profile)})
            s = got["stats"]
            row = {"config": config, "lossy": config != "lossless" and s["substitution"]["lossy"],
                   "budget_pct": pct, "budget_bytes": budget, **compare(exact["logits"], got["logits"], windows),
                   "ms_per_token": got["seconds"] / len(tokens) * 1e3,
                   "misses_per_token": s["expert_misses"] / len(tokens),
                   "mb_read_per_token": s["bytes_read"] / len(tokens) / 1e6,
                   "hit_rate": s["hit_rate"],
                   "substitutions_per_token": s["substitutions"] / len(tokens)}
            rows.append(row)
            print(f"  {pct:>3}% {config:10s} ppl {row['ppl']:9.3f} (exact {row['ppl_exact']:.3f}, "
                  f"d {row['ppl_delta']:+.3f})  top-1 {row['top1_agreement']:.4f}  KL {row['kl_mean']:.5f}  "
                  f"{'bit-identical' if row['bit_identical'] else 'differs':13s}  misses/tok "
                  f"{row['misses_per_token']:5.2f}  subst/tok {row['substitutions_per_token']:5.2f}  "
                  f"hit {row['hit_rate'] or 0:.2f}", flush=True)
            if config == "lossless" and not row["bit_identical"]:
                print("  ERROR: a lossless configuration differs from the exact run", flush=True)
    training = None
    if model.is_dir() and (model / "training.json").exists():
        training = json.loads((model / "training.json").read_text())
    buddy = json.loads(profile.read_text()) if profile else None
    return {"model": str(model), "bf16": str(bf16), "zipmoe": str(zipmoe), "tokens": len(tokens),
            "buddy_profile": None if buddy is None else {
                "path": str(profile), "made_with": buddy["made_with"], "heldout_recall": buddy["heldout"],
                "list_size": {layer: v["list_size"] for layer, v in buddy["layers"].items()},
                "tau": {layer: v["tau"] for layer, v in buddy["layers"].items()}},
            "windows": len(windows), "all_experts_bytes": everything,
            "exact_ms_per_token": exact["seconds"] / len(tokens) * 1e3, "training": training, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# Accuracy harness: {', '.join(Path(m['model']).name for m in result['models'])}", "",
             f"Command: `{result['command']}`", "",
             f"{result['tokens']} held-out tokens ({result['text']}), windows of {result['window']}, "
             f"{result['ubatch']} token(s) per decode. Deltas against the exact run (the BF16 GGUF, no expert "
             "cache). LOSSY rows replace experts; lossless rows must be bit-identical.", ""]
    for m in result["models"]:
        lines += [f"## {Path(m['model']).name}", "",
                  "| budget | config | ppl | d ppl | top-1 agree | KL | bit-identical | misses/tok | subst/tok | hit rate |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        for r in m["rows"]:
            label = r["config"] + (" (LOSSY)" if r["lossy"] else "")
            lines.append(f"| {r['budget_pct']}% | {label} | {r['ppl']:.3f} | {r['ppl_delta']:+.4f} | "
                         f"{r['top1_agreement']:.4f} | {r['kl_mean']:.5f} | {'yes' if r['bit_identical'] else 'no'} | "
                         f"{r['misses_per_token']:.2f} | {r['substitutions_per_token']:.2f} | {r['hit_rate'] or 0:.2f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, action="append", required=True,
                    help="a trained HF checkpoint folder (zipmoe-train-tiny) or a BF16 GGUF; repeat for several")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--corpus", default="python-docs",
                     help="held-out split of zipmoe-train-tiny's corpus (default: %(default)s)")
    src.add_argument("--text", type=Path, default=None, help="a text file to evaluate on instead")
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens evaluated (default: %(default)s)")
    ap.add_argument("--window", type=int, default=256, help="tokens per window, from an empty KV cache (default: %(default)s)")
    ap.add_argument("--ubatch", type=int, default=1,
                    help="tokens per llama_decode; 1 makes every position a decode step (default: %(default)s)")
    ap.add_argument("--budgets", default="10,25,50",
                    help="expert-cache budgets, %% of all routed experts' bytes (default: %(default)s)")
    ap.add_argument("--configs", default="lossless,smoe:0,smoe:0.05,smoe:0.1,smoe:0.2,smoe:0.5,smoe:1",
                    help="configurations: lossless, smoe:ALPHA, buddy[:NAME=VALUE...] (BuddyMoE with its "
                         "parameters, e.g. buddy:rho=2:tau=0.5; its profile is made from the calibration text "
                         "when missing) (default: %(default)s)")
    ap.add_argument("--calibration-tokens", type=int, default=50_000,
                    help="about this many tokens of the corpus's train split make the buddy profiles "
                         "(default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=REPO / "bench" / "work" / "accuracy",
                    help="folder for the converted GGUFs (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "accuracy.json")
    args = ap.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]
    args.configs = args.configs.split(",")
    for config in args.configs:
        try:
            parse_config(config)
        except ValueError as e:
            ap.error(str(e))
    if args.window < 2 or args.tokens < 2 or args.ubatch < 1:
        ap.error("--window and --tokens must be >= 2, --ubatch >= 1")
    from zipmoe_py.devtools.corpus import load_corpus

    corpus = load_corpus(args.corpus)
    train_text, held_text = corpus.train_text, corpus.heldout_text
    args.calibration = train_text[: args.calibration_tokens * 4]
    args.calibration_name = f"train split of {args.corpus}"
    if args.text is not None:
        text, text_name = args.text.read_text(), str(args.text)
    else:
        text, text_name = held_text, f"held-out split of {args.corpus}"
    result = {"command": " ".join(["bench/accuracy_bench.py"] + sys.argv[1:]), "text": text_name,
              "tokens": args.tokens, "window": args.window, "ubatch": args.ubatch, "threads": args.threads,
              "machine": platform.platform(), "cpu_count": os.cpu_count(), "models": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for m in args.model:  # saved after each model: a long run stopped keeps the models it finished
        result["models"].append(bench_model(m, text, args))
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(result))
    models = result["models"]
    print(f"saved {args.out} and {args.out.with_suffix('.md')}")
    bad = [r for m in models for r in m["rows"] if r["config"] == "lossless" and not r["bit_identical"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
