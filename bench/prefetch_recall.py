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
import codecs
import contextlib
import io
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DOCSTRING_MODULES = ("argparse", "json", "subprocess", "io", "inspect", "unittest", "collections")


def default_text() -> str:
    """The Zen of Python plus a few stdlib module docstrings (see the module docstring)."""
    import importlib

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    parts = [codecs.decode(this.s, "rot13")]
    parts += [importlib.import_module(name).__doc__ or "" for name in DOCSTRING_MODULES]
    return "\n\n".join(parts)


def tokenize(checkpoint: Path, text: str, n_tokens: int) -> torch.Tensor:
    """(1, tokens) ids of the first n_tokens tokens of text, by the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(checkpoint)).encode(text)[:n_tokens]
    if len(ids) < 2:
        raise SystemExit("prefetch_recall: the text gives fewer than 2 tokens")
    return torch.tensor([ids])


def random_tokens(checkpoint: Path, n_tokens: int, seed: int) -> torch.Tensor:
    """(1, n_tokens) uniformly random ids of the checkpoint's tokenizer: no word frequencies, close
    to what a random-weight model's own sampling feeds it during decode."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(checkpoint)))
    return torch.randint(0, vocab, (1, n_tokens), generator=torch.Generator().manual_seed(seed))


@dataclass
class LayerStates:
    """What the hooks saw in one decoder layer, flattened to (tokens, hidden), float32."""
    layer_input: torch.Tensor | None = None    # residual entering the layer
    attn_residual: torch.Tensor | None = None  # h + attn_out: the post_attention_layernorm's input
    router_input: torch.Tensor | None = None   # the gate's input (None: a dense layer)


def _first_tensor(args, kwargs) -> torch.Tensor:
    x = args[0] if args else kwargs["hidden_states"]
    return x.detach().reshape(-1, x.shape[-1]).float().clone()


def moe_gate(layer) -> torch.nn.Module | None:
    """The router of a decoder layer, or None for a dense MLP (DeepSeek's first_k_dense_replace
    layers, Qwen's mlp_only_layers). Both architectures call it `gate` and keep `experts` beside it."""
    mlp = getattr(layer, "mlp", None)
    return mlp.gate if mlp is not None and hasattr(mlp, "gate") and hasattr(mlp, "experts") else None


@torch.no_grad()
def capture_states(model, input_ids: torch.Tensor) -> list[LayerStates]:
    """One forward pass of the decoder stack (no lm_head), recording each layer's input, its
    post-attention residual and its router input through forward pre-hooks."""
    layers = model.model.layers
    states = [LayerStates() for _ in layers]
    handles = []

    def keep(i, field):
        def hook(module, args, kwargs):
            setattr(states[i], field, _first_tensor(args, kwargs))
        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(keep(i, "layer_input"), with_kwargs=True))
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
            keep(i, "attn_residual"), with_kwargs=True))
        gate = moe_gate(layer)
        if gate is not None:
            handles.append(gate.register_forward_pre_hook(keep(i, "router_input"), with_kwargs=True))
    try:
        model.model(input_ids=input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return states


def router_topk(x: torch.Tensor, gate_weight: torch.Tensor, k: int,
                norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """(tokens, k) expert ids that a router with gate_weight (n_experts, hidden) picks for x. With
    norm_weight, x is taken as a raw residual and multiplied by the RMSNorm weight first (the
    per-token 1/rms factor is left out: a positive scale per token keeps every top-k)."""
    if norm_weight is not None:
        x = x * norm_weight.float()
    logits = x @ gate_weight.float().t()
    return torch.topk(logits, k, dim=-1).indices


def recall(predicted: torch.Tensor, actual: torch.Tensor) -> float:
    """Mean over tokens of |predicted & actual| / |actual| for (tokens, k) id sets."""
    hits = (predicted.unsqueeze(-1) == actual.unsqueeze(-2)).any(-1).sum(-1)
    return float(hits.float().mean() / actual.shape[-1])


def routing_stats(topk: torch.Tensor, n_experts: int) -> dict:
    """Concentration and memory of one layer's routing, from its (tokens, k) expert ids.

    top25 / top50: share of all selections taken by the most popular 25% / 50% of the experts
    (0.25 / 0.50 when every expert is picked equally often); entropy: entropy of the popularity
    distribution over log(n_experts) (1 = uniform); consecutive_overlap: mean |S_t & S_t-1| / k over
    consecutive tokens (k / n_experts for a memoryless router, 1 when every token repeats the last
    one's experts)."""
    counts = torch.bincount(topk.reshape(-1), minlength=n_experts).double()
    ranked = counts.sort(descending=True).values
    total = counts.sum()
    p = counts / total
    entropy = float(-(p[p > 0] * p[p > 0].log()).sum() / math.log(n_experts))
    overlap = recall(topk[1:], topk[:-1]) if topk.shape[0] > 1 else float("nan")
    return {
        "top25": float(ranked[:max(1, round(n_experts * 0.25))].sum() / total),
        "top50": float(ranked[:max(1, round(n_experts * 0.50))].sum() / total),
        "entropy": entropy,
        "consecutive_overlap": overlap,
        "experts_used": int((counts > 0).sum()),
    }


def uniform_reference(n_tokens: int, n_experts: int, k: int, draws: int = 20, seed: int = 0) -> dict:
    """routing_stats of an ideal uniform, memoryless router (each token a uniformly random k-set),
    averaged over draws: on a few hundred tokens even that one is not exactly 25% / 1.0, from
    sampling noise alone."""
    gen = torch.Generator().manual_seed(seed)
    runs = [routing_stats(torch.rand(n_tokens, n_experts, generator=gen).topk(k, dim=-1).indices, n_experts)
            for _ in range(draws)]
    return {key: sum(r[key] for r in runs) / draws for key in runs[0]}


def measure(model, input_ids: torch.Tensor) -> dict:
    """Per-layer prefetch recall (variants a and b) and routing statistics of a loaded HF MoE model
    on input_ids (1, tokens). Returns a JSON-able dict."""
    cfg = model.config
    k = cfg.num_experts_per_tok
    states = capture_states(model, input_ids)
    layers = model.model.layers
    per_layer, n_experts = [], None
    for i, layer in enumerate(layers):
        gate = moe_gate(layer)
        if gate is None:
            continue
        w = gate.weight.detach()
        n_experts = w.shape[0]
        actual = router_topk(states[i].router_input, w, k)
        # The predictors' own arithmetic, fed this layer's real post-attention residual, must give
        # the router's answer back: checks the hooks and the norm-weight shortcut.
        self_check = recall(router_topk(states[i].attn_residual, w, k, layer.post_attention_layernorm.weight), actual)
        row = {"layer": i, "n_experts": n_experts, "self_check": self_check, **routing_stats(actual, n_experts)}
        if i > 0:
            norm_w = layer.post_attention_layernorm.weight
            row["recall_layer_input"] = recall(router_topk(states[i - 1].layer_input, w, k, norm_w), actual)
            row["recall_attn_output"] = recall(router_topk(states[i - 1].attn_residual, w, k, norm_w), actual)
        per_layer.append(row)
    if not per_layer:
        raise SystemExit("prefetch_recall: the model has no MoE layer")
    predicted = [r for r in per_layer if "recall_layer_input" in r]

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows) if rows else float("nan")

    n_tokens = input_ids.shape[1]
    return {
        "model_type": cfg.model_type, "n_layers": len(layers), "n_tokens": n_tokens, "k": k,
        "n_experts": n_experts, "random_recall": k / n_experts,
        "overall": {
            "recall_layer_input": mean(predicted, "recall_layer_input"),
            "recall_attn_output": mean(predicted, "recall_attn_output"),
            **{key: mean(per_layer, key) for key in ("top25", "top50", "entropy", "consecutive_overlap", "self_check")},
        },
        "uniform_reference": uniform_reference(n_tokens, n_experts, k),
        "layers": per_layer,
    }


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


def load_model(checkpoint: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype)
    return model.eval()


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
