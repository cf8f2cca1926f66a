#!/usr/bin/env python3
"""How well can layer l+1's routed experts be predicted before layer l+1's router runs?

A prefetcher that knows layer l+1's experts while layer l is still computing can read them from
disk (or decompress them) in the shadow of layer l. The cheapest predictor applies layer l+1's own
router (mlp.gate, GGUF ffn_gate_inp) to a hidden state that is already there, after layer l+1's
post_attention_layernorm weight (RMSNorm divides each token by a positive scalar, which never
changes a top-k, so only the weight vector matters). Two hidden states are tried:

  layer-input  (a): the residual entering layer l (before layer l's input_layernorm): known one
                    whole layer ahead;
  attn-output  (b): the residual leaving layer l's attention (h + attn_out, the input of layer l's
                    post_attention_layernorm): known while layer l's own experts run.

Ground truth is layer l+1's actual top-k (k = num_experts_per_tok) from its own router on its own
input; recall = |predicted & actual| / |actual|, against k / n_experts for a random guess. For each
MoE layer the script also reports how concentrated routing is (share of selections taken by the
most popular 25% / 50% of experts, normalised entropy of expert popularity) and how memoryful
(mean overlap of consecutive tokens' top-k sets), next to what an ideal uniform, memoryless router
gives on the same number of tokens (simulated), so "near-uniform" can be judged at a glance.

The model runs in transformers on the CPU (float32 by default), with forward hooks; only top-k
index sets are compared. It assumes greedy top-k routing (Qwen2-MoE; DeepSeek-V2-Lite's
topk_method "greedy"), where the top-k of the softmax scores is the top-k of the logits.

Text: --text FILE, or by default the Zen of Python (the `this` module, decoded) followed by the
module docstrings of argparse, json, subprocess, io, inspect, unittest and collections (English
prose with some code, present in every CPython install; exact words vary a little between Python
versions), cut to --tokens tokens. --random-tokens runs uniformly random token ids instead: routing
that follows the token alone is then as uniform as it can be, while on text the frequent words
("the", ",") keep their experts busier.

    .venv/bin/python bench/prefetch_recall.py --arch qwen2moe
    .venv/bin/python bench/prefetch_recall.py --arch deepseek2 --router uniform --json /tmp/ds-uniform.json
    .venv/bin/python bench/prefetch_recall.py --arch qwen2moe --real-widths --layers 3
    .venv/bin/python bench/prefetch_recall.py --checkpoint ~/models/Qwen1.5-MoE-A2.7B --text README.md

--arch makes a random-weight checkpoint with zipmoe_py.devtools.tiny.make_tiny in a temporary folder
(small widths unless --real-widths; --router uniform needs a zipmoe_py that has make_tiny's
router parameter). Small widths take ~10 s; qwen2moe --real-widths --layers 3 about a minute and
10.7 GB of memory in float32 (--dtype bfloat16 halves it). Under --router uniform the attention
output is scaled to nothing, so (a) and (b) coincide.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from zipmoe_py.devtools.routing import default_text, load_model, measure, random_tokens, tokenize


def print_table(result: dict, title: str) -> None:
    k, n = result["k"], result["n_experts"]
    print(f"{title}: {result['model_type']}, {result['n_layers']} layers, {result['n_tokens']} tokens, "
          f"top-{k} of {n} experts (random guess recall {result['random_recall']:.3f})")
    head = f"{'layer':>5}  {'recall(a)':>9}  {'recall(b)':>9}  {'top25%':>6}  {'top50%':>6}  {'entropy':>7}  {'consec':>6}  {'used':>4}"
    print(head)
    print("-" * len(head))

    def line(name, r):
        ra = f"{r['recall_layer_input']:.3f}" if "recall_layer_input" in r else "-"
        rb = f"{r['recall_attn_output']:.3f}" if "recall_attn_output" in r else "-"
        used = str(r.get("experts_used", ""))
        print(f"{name:>5}  {ra:>9}  {rb:>9}  {r['top25']:6.3f}  {r['top50']:6.3f}  {r['entropy']:7.3f}  "
              f"{r['consecutive_overlap']:6.3f}  {used:>4}")

    for r in result["layers"]:
        line(str(r["layer"]), r)
    print("-" * len(head))
    line("all", result["overall"])
    ref = result["uniform_reference"]
    print(f"{'ideal':>5}  {result['random_recall']:9.3f}  {result['random_recall']:9.3f}  {ref['top25']:6.3f}  "
          f"{ref['top50']:6.3f}  {ref['entropy']:7.3f}  {ref['consecutive_overlap']:6.3f}  {ref['experts_used']:4.0f}")
    print("(a) layer l+1's router on layer l's input residual; (b) on layer l's post-attention residual; "
          "ideal: a uniform memoryless router on as many tokens")
    if result["overall"]["self_check"] < 0.99:
        print(f"warning: the router re-computed from the post-attention residual agrees only "
              f"{result['overall']['self_check']:.3f} with the hooked router input", file=sys.stderr)


def make_checkpoint(arch: str, out_dir: Path, layers: int | None, real_widths: bool, router: str,
                    seed: int) -> Path:
    from zipmoe_py.devtools.tiny import ARCHITECTURES, make_tiny

    kwargs = {"seed": seed}
    if router != "random":  # only passed when asked: an older zipmoe_py has no such parameter
        kwargs["router"] = router
    if real_widths:
        return make_tiny(arch, out_dir, real_widths_layers=layers or 3, **kwargs)
    sizes = None
    if layers is not None:
        sizes = {"num_hidden_layers": layers}
        if "max_window_layers" in ARCHITECTURES[arch][2]:
            sizes["max_window_layers"] = layers
    return make_tiny(arch, out_dir, sizes=sizes, **kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="an existing Hugging Face MoE checkpoint folder")
    src.add_argument("--arch", choices=["qwen2moe", "deepseek2"],
                     help="make a random-weight checkpoint of this architecture with make_tiny")
    ap.add_argument("--layers", type=int, default=None,
                    help="with --arch: number of layers (default: make_tiny's, or 3 with --real-widths)")
    ap.add_argument("--real-widths", action="store_true",
                    help="with --arch: the real model's widths and expert counts (GBs; use few layers)")
    ap.add_argument("--router", choices=["random", "uniform"], default="random",
                    help="with --arch: make_tiny's router variant (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the weights (with --arch) and of --random-tokens (default: %(default)s)")
    text = ap.add_mutually_exclusive_group()
    text.add_argument("--text", type=Path, default=None,
                      help="UTF-8 text file to run (default: Zen of Python + stdlib module docstrings)")
    text.add_argument("--random-tokens", action="store_true",
                      help="uniformly random token ids instead of text (seeded by --seed): no word frequencies, "
                           "the input a random model's own sampling gives")
    ap.add_argument("--tokens", type=int, default=512, help="at most this many tokens of the text (default: %(default)s)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype the model runs in (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.checkpoint and (args.layers is not None or args.real_widths or args.router != "random"):
        ap.error("--layers, --real-widths and --router only apply with --arch")

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prefetch-recall-") as tmp:
        if args.checkpoint:
            checkpoint, title = args.checkpoint, str(args.checkpoint)
        else:
            checkpoint = make_checkpoint(args.arch, Path(tmp), args.layers, args.real_widths, args.router, args.seed)
            title = f"{args.arch} ({'real' if args.real_widths else 'small'} widths, router {args.router}, seed {args.seed})"
        if args.random_tokens:
            input_ids = random_tokens(checkpoint, args.tokens, args.seed)
        else:
            text = args.text.read_text(encoding="utf-8") if args.text else default_text()
            input_ids = tokenize(checkpoint, text, args.tokens)
        model = load_model(checkpoint, getattr(torch, args.dtype))
        result = measure(model, input_ids)
    text_name = "random tokens" if args.random_tokens else str(args.text) if args.text else "default"
    result.update({"source": title, "text": text_name, "dtype": args.dtype,
                   "seconds": round(time.perf_counter() - t0, 1)})
    print_table(result, title)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
