"""How a Hugging Face MoE model routes, measured in transformers with forward hooks: per MoE layer, how well
layer l+1's experts are predicted from layer l's hidden states (prefetch recall), how concentrated its routing
is and how memoryful. bench/prefetch_recall.py is the command line (its docstring says what is measured and
how); the suite uses it on the tiny checkpoints (make_tiny's routers). Needs torch and transformers (the
`convert` extra)."""
from __future__ import annotations

import codecs
import contextlib
import io
import math
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


def load_model(checkpoint: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype)
    return model.eval()
