"""zipmoe-train-tiny: small MoE checkpoints in the real target architectures, trained on text.

zipmoe-make-tiny's checkpoints carry random weights: their routing is an artefact of the draw
(see tiny.ROUTERS). An accuracy harness that measures lossy expert substitution needs models whose
routing was learned. This module writes the same checkpoint skeleton (make_tiny: the real config
keys sized down, the real tokenizer), then trains the model from transformers' own classes on a
fixed natural-language corpus, deterministically, and overwrites model.safetensors with the
trained weights (BF16, same tensor names). Results are cached by everything they depend on.

Corpora (split by document, fixed; see CORPORA):
  python-docs   the Python 3.11 documentation's reStructuredText sources (Debian python3.11-doc)
  pydoc-topics  pydoc_data.topics.topics from Python's standard library (always present)

Besides the checkpoint, OUT_DIR gets training.json (the report: corpus, hyperparameters, loss,
held-out perplexity against an add-one unigram baseline, routing statistics of the trained and of
the randomly initialised model) and routing.json (per-layer expert co-activation counts).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

from ..errors import ZipMoEError, require_extra
from .corpus import CORPORA, PYTHON_DOCS_ENV, Corpus, heldout_text, load_corpus  # noqa: F401 (heldout_text: its API)
from .tiny import ARCHITECTURES, make_tiny, tiny_config
from .train_report import TRAIN_FORMAT, WARMUP_FRACTION, training_report


# Steps of a default run: about 5 minutes of training on 2 cores. Measured on the 2-core AMD EPYC
# (AVX2) development machine, batch 8 x 256 tokens, 2 threads, machine otherwise idle: 1.88 s/step
# for qwen2moe, 2.39 s/step for deepseek2 (the 64 x 152k / 102k vocabulary head is most of it,
# even fused, see head_loss; the MoE bodies are small). Held-out evaluation (100k tokens) and the
# routing statistics add about 1.5 minutes. Fewer steps do not learn enough: 90 steps of qwen2moe
# left the held-out perplexity near the unigram baseline's (1334 vs 1425); 165 steps reach 670.
DEFAULT_STEPS = {"deepseek2": 125, "qwen2moe": 165}
DEFAULTS = {"seq_len": 256, "batch": 8, "lr": 3e-3, "balance": 0.01, "threads": 2,
            "eval_tokens": 100_000, "routing_tokens": 8192}
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01
FINAL_LR_FRACTION = 0.10
GRAD_CLIP = 1.0
EVAL_BATCH = 8  # windows per forward pass in evaluation and routing statistics

CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "model.safetensors")


def _log(msg: str) -> None:
    print(f"zipmoe-train-tiny: {msg}", file=sys.stderr, flush=True)


def tokenize(tokenizer_json: Path, text: str):
    """Token ids of text (no special tokens added) as a 1-D int64 tensor."""
    import torch
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------
# router taps: the MoE layers' routing, for the balance loss and the statistics

def moe_gates(model) -> list[tuple[int, object]]:
    """(layer index, router module) of every MoE layer. qwen2moe: mlp.gate, an nn.Linear whose output
    is the router logits. deepseek2: mlp.gate, a DeepseekV2MoEGate whose output is (top-k ids,
    top-k weights); its logits are F.linear(input, gate.weight) in float32 (as it computes them)."""
    gates = []
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            gates.append((i, mlp.gate))
    if not gates:
        raise ZipMoEError(f"{type(model).__name__}: no MoE layer (mlp.gate with mlp.experts) found")
    return gates


class RouterTap:
    """Forward hooks on the routers. Each forward of the model appends, per MoE layer in order,
    (router logits (tokens, n_expert) float32, selected experts (tokens, top_k))."""

    def __init__(self, model, top_k: int, with_logits: bool = True):
        self.top_k, self.with_logits = top_k, with_logits
        self.records: list[tuple[object, object]] = []
        self.layers = [i for i, _ in moe_gates(model)]
        self._handles = [gate.register_forward_hook(self._hook) for _, gate in moe_gates(model)]

    def _hook(self, module, args, output):
        import torch
        import torch.nn.functional as F

        x = args[0]
        if isinstance(output, tuple):  # DeepseekV2MoEGate: (topk_idx, topk_weight)
            selected = output[0]
            logits = F.linear(x.reshape(-1, x.shape[-1]).float(), module.weight.float()) if self.with_logits else None
        else:  # nn.Linear router (Qwen2Moe): the logits themselves
            logits = output.reshape(-1, output.shape[-1]).float()
            selected = torch.topk(logits, self.top_k, dim=-1).indices  # the block's own choice
        self.records.append((logits, selected.reshape(-1, self.top_k)))

    def take(self) -> list[tuple[object, object]]:
        records, self.records = self.records, []
        return records

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def balance_loss(records, n_expert: int):
    """Switch-Transformer load-balancing loss, summed over MoE layers: per layer
    n_expert * sum_e f_e * mean(P_e), f_e the fraction of the top-k selections that go to e, P the
    router's softmax. 1 per layer when balanced."""
    import torch

    total = 0.0
    for logits, selected in records:
        probs = logits.softmax(dim=-1)
        counts = torch.bincount(selected.reshape(-1), minlength=n_expert).float()
        frac = counts / counts.sum()
        total = total + n_expert * (frac * probs.mean(dim=0)).sum()
    return total


def _n_expert(config) -> int:
    return int(getattr(config, "n_routed_experts", None) or config.num_experts)


def _windows(token_ids, seq_len: int) -> list:
    """Non-overlapping windows of seq_len tokens (the last one shorter if the ids do not divide)."""
    return [token_ids[i:i + seq_len] for i in range(0, len(token_ids), seq_len) if len(token_ids[i:i + seq_len]) >= 2]


def _batches(windows: list, size: int):
    """Consecutive windows of equal length, up to size at a time."""
    batch: list = []
    for w in windows:
        if batch and (len(batch) == size or len(w) != len(batch[0])):
            yield batch
            batch = []
        batch.append(w)
    if batch:
        yield batch


def routing_stats(model, token_ids, n_tokens: int, seq_len: int = DEFAULTS["seq_len"]) -> dict:
    """Routing statistics of `model` on the first n_tokens of token_ids (1-D ints), run as
    non-overlapping windows of seq_len tokens. Per MoE layer: popularity (fraction of the top-k
    selections each expert receives), its normalised entropy (1 = uniform), the most popular
    expert's share, and co-activation: counts[i][j] = tokens that selected both i and j (diagonal:
    tokens that selected i), summarised as the mean lift P(i,j) / (P(i) P(j)) of the top 10% of
    expert pairs (i < j; 1 = independent). "coactivation_counts" holds the matrices."""
    import torch

    ids = torch.as_tensor(token_ids, dtype=torch.long)[:n_tokens]
    config = model.config
    n_expert, top_k = _n_expert(config), int(config.num_experts_per_tok)
    tap = RouterTap(model, top_k, with_logits=False)
    selections: list[list] = [[] for _ in tap.layers]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in _batches(_windows(ids, seq_len), EVAL_BATCH):
                model.model(input_ids=torch.stack(batch), use_cache=False)
                for li, (_, selected) in enumerate(tap.take()):
                    selections[li].append(selected)
    finally:
        tap.close()
        model.train(was_training)

    layers, counts_out = [], []
    for layer, sel in zip(tap.layers, selections):
        sel = torch.cat(sel)
        n_tok = sel.shape[0]
        onehot = torch.zeros(n_tok, n_expert, dtype=torch.float64)
        onehot.scatter_(1, sel, 1.0)
        co = (onehot.t() @ onehot).round().long()  # (E, E); diagonal: tokens per expert
        per_expert = co.diagonal().double()
        pop = per_expert / per_expert.sum()
        nz = pop[pop > 0]
        entropy = float(-(nz * nz.log()).sum() / math.log(n_expert))
        lifts = []
        for i in range(n_expert):
            for j in range(i + 1, n_expert):
                if per_expert[i] > 0 and per_expert[j] > 0:
                    lifts.append(float(co[i, j]) * n_tok / float(per_expert[i] * per_expert[j]))
        lifts.sort(reverse=True)
        top = lifts[:max(1, round(0.1 * len(lifts)))] if lifts else [float("nan")]
        layers.append({"layer": layer, "popularity": [round(float(p), 6) for p in pop],
                       "entropy": round(entropy, 6), "top1_share": round(float(pop.max()), 6),
                       "coactivation_top10pct_lift": round(sum(top) / len(top), 6)})
        counts_out.append(co.tolist())
    mean = lambda key: round(sum(x[key] for x in layers) / len(layers), 6)  # noqa: E731
    return {"tokens": int(len(ids)), "seq_len": seq_len, "n_expert": n_expert, "top_k": top_k,
            "summary": {"entropy_mean": mean("entropy"), "top1_share_mean": mean("top1_share"),
                        "coactivation_top10pct_lift_mean": mean("coactivation_top10pct_lift"),
                        "uniform_top1_share": round(1 / n_expert, 6)},
            "layers": layers, "coactivation_counts": counts_out}


# ----------------------------------------------------------------------------------------------
# evaluation

HEAD_CHUNK = 256  # rows of the vocabulary head computed at a time


@functools.cache
def _head_loss_function():
    """Mean cross-entropy of lm_head(h) against targets, computed HEAD_CHUNK rows at a time with its
    gradient formed in the same pass (softmax - one-hot; never a (tokens, vocab) tensor): the value
    and gradients of F.cross_entropy(h @ w.T, targets), about twice as fast on CPU, where the
    64 x 100k-152k head is most of a tiny model's cost and a 1.2 GB logits tensor mostly page faults."""
    import torch

    class HeadLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, w, targets):
            n = h.shape[0]
            buf = torch.empty(min(HEAD_CHUNK, n), w.shape[0], dtype=torch.float32)
            dh, dw = torch.empty_like(h), torch.zeros_like(w)
            total = torch.zeros((), dtype=torch.float64)
            for s in range(0, n, HEAD_CHUNK):
                hc, tc = h[s:s + HEAD_CHUNK], targets[s:s + HEAD_CHUNK]
                b = buf[:hc.shape[0]]
                torch.mm(hc, w.t(), out=b)  # logits
                top = b.max(dim=1, keepdim=True).values
                picked = b.gather(1, tc[:, None])
                b.sub_(top).exp_()
                norm = b.sum(dim=1, keepdim=True)
                total += (norm.log() + top - picked).double().sum()
                b.div_(norm)  # softmax
                b[torch.arange(hc.shape[0]), tc] -= 1.0  # d(loss sum)/d(logits)
                dw.addmm_(b.t(), hc)
                torch.mm(b, w, out=dh[s:s + HEAD_CHUNK])
            ctx.save_for_backward(dh, dw)
            ctx.n = n
            return (total / n).float()

        @staticmethod
        def backward(ctx, grad):
            dh, dw = ctx.saved_tensors
            scale = grad / ctx.n
            return dh * scale, dw * scale, None

    return HeadLoss


def head_loss(h, w, targets):
    """Mean next-token cross-entropy of logits h @ w.T (h: (tokens, hidden), w: lm_head.weight)."""
    return _head_loss_function().apply(h, w, targets)


def _head_nll_sum(h, w, targets) -> float:
    """Summed cross-entropy of logits h @ w.T, without gradients, HEAD_CHUNK rows at a time."""
    import torch

    total = 0.0
    for s in range(0, h.shape[0], HEAD_CHUNK):
        logits = h[s:s + HEAD_CHUNK] @ w.t()
        tc = targets[s:s + HEAD_CHUNK]
        total += float((torch.logsumexp(logits, dim=1) - logits.gather(1, tc[:, None])[:, 0]).double().sum())
    return total


def heldout_nll(model, token_ids, seq_len: int) -> tuple[float, int]:
    """Mean next-token NLL (nats) over non-overlapping windows of seq_len tokens (each window's first
    token is context only), and the number of tokens predicted."""
    import torch

    total, count = 0.0, 0
    model.eval()
    w = model.lm_head.weight
    with torch.no_grad():
        for batch in _batches(_windows(torch.as_tensor(token_ids), seq_len), EVAL_BATCH):
            x = torch.stack(batch)
            hidden = model.model(input_ids=x, use_cache=False).last_hidden_state[:, :-1].float()
            total += _head_nll_sum(hidden.reshape(-1, hidden.shape[-1]), w.float(), x[:, 1:].reshape(-1))
            count += x[:, 1:].numel()
    return total / count, count


def unigram_nll(train_ids, token_ids, vocab_size: int, seq_len: int) -> float:
    """Add-one smoothed unigram (counts from train_ids) on the tokens heldout_nll predicts."""
    import torch

    counts = torch.bincount(torch.as_tensor(train_ids), minlength=vocab_size).double() + 1.0
    logp = counts.log() - counts.sum().log()
    targets = torch.cat([w[1:] for w in _windows(torch.as_tensor(token_ids), seq_len)])
    return float(-logp[targets].mean())


# ----------------------------------------------------------------------------------------------
# training

def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to 10% of lr."""
    warmup = max(1, math.ceil(WARMUP_FRACTION * steps))
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_root() -> Path:
    base = os.environ.get("ZIPMOE_CACHE_DIR")
    if base:
        return Path(base) / "trained"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zipmoe" / "trained"


def _hyperparameters(steps, seed, seq_len, batch, lr, balance, threads, eval_tokens, routing_tokens) -> dict:
    return {"steps": steps, "seed": seed, "seq_len": seq_len, "batch": batch, "lr": lr, "betas": list(BETAS),
            "weight_decay": WEIGHT_DECAY, "weight_decay_on": "matrices and embeddings (not norms, biases)",
            "warmup_fraction": WARMUP_FRACTION, "final_lr_fraction": FINAL_LR_FRACTION, "grad_clip": GRAD_CLIP,
            "balance": balance, "balance_loss": "Switch-Transformer load balancing, summed over MoE layers",
            "threads": threads, "eval_tokens": eval_tokens, "routing_tokens": routing_tokens, "dropout": 0.0,
            "optimizer": "AdamW", "dtype": "float32 (saved as bfloat16)"}


def _cache_key(arch: str, corpus_info: dict, hyper: dict) -> tuple[str, dict]:
    import torch
    import transformers

    from .. import _paths

    inputs = {"train_format": TRAIN_FORMAT, "arch": arch, "config": tiny_config(arch),
              "vocab_gguf_sha256": _file_sha256(_paths.vendored_vocab(ARCHITECTURES[arch][0])),
              "corpus": corpus_info["name"], "train_sha256": corpus_info["train_sha256"],
              "heldout_sha256": corpus_info["heldout_sha256"], "hyperparameters": hyper,
              "torch": torch.__version__, "transformers": transformers.__version__}
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16], inputs


def _copy_checkpoint(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file():
            shutil.copyfile(f, dst / f.name)
            (dst / f.name).chmod(0o644)


def _check_options(arch, corpus, steps, seq_len, batch, lr, balance, threads, eval_tokens, routing_tokens):
    if arch not in ARCHITECTURES:
        raise ZipMoEError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if corpus not in CORPORA:
        raise ZipMoEError(f"unknown corpus {corpus!r} (--corpus); choose one of {', '.join(CORPORA)}")
    for name, value, low in (("--steps", steps, 1), ("--seq-len", seq_len, 2), ("--batch", batch, 1),
                             ("--threads", threads, 1), ("--eval-tokens", eval_tokens, 2),
                             ("--routing-tokens", routing_tokens, 2)):
        if value < low:
            raise ZipMoEError(f"{name} must be at least {low}, got {value}")
    if not lr > 0:
        raise ZipMoEError(f"--lr must be positive, got {lr}")
    if not balance >= 0:
        raise ZipMoEError(f"--balance must not be negative, got {balance}")


def train(arch: str, out_dir, corpus: str = "python-docs", steps: int | None = None, seed: int = 0,
          seq_len: int = DEFAULTS["seq_len"], batch: int = DEFAULTS["batch"], lr: float = DEFAULTS["lr"],
          balance: float = DEFAULTS["balance"], threads: int = DEFAULTS["threads"],
          eval_tokens: int = DEFAULTS["eval_tokens"], routing_tokens: int = DEFAULTS["routing_tokens"],
          use_cache: bool = True, progress: bool = True) -> dict:
    """Train a tiny `arch` model on `corpus` and write the checkpoint, training.json and routing.json
    into out_dir. Returns the report (training.json's content, plus "from_cache": whether it was
    copied from the cache rather than trained)."""
    require_extra("convert", "training a tiny checkpoint")
    steps = DEFAULT_STEPS.get(arch, 1) if steps is None else steps
    _check_options(arch, corpus, steps, seq_len, batch, lr, balance, threads, eval_tokens, routing_tokens)
    out_dir = Path(out_dir)
    data = load_corpus(corpus)
    info = data.info()
    hyper = _hyperparameters(steps, seed, seq_len, batch, lr, balance, threads, eval_tokens, routing_tokens)
    key, key_inputs = _cache_key(arch, info, hyper)

    root = cache_root()
    cached = root / key
    if use_cache and (cached / "training.json").is_file():
        _copy_checkpoint(cached, out_dir)
        report = json.loads((out_dir / "training.json").read_text())
        if progress:
            _log(f"cache hit: copied {cached} (key {key}) to {out_dir}; not trained")
        return {**report, "from_cache": True}

    if use_cache:
        root.mkdir(parents=True, exist_ok=True)
        work = root / f".tmp-{key}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
    else:
        work = out_dir
    try:
        report = _train_into(work, arch, data, info, hyper, key, key_inputs, progress)
        if use_cache:
            try:
                os.rename(work, cached)
            except OSError:  # another process finished the same key first: keep its copy
                shutil.rmtree(work, ignore_errors=True)
            _copy_checkpoint(cached, out_dir)
            if progress:
                _log(f"cached as {cached}")
    except BaseException:
        if use_cache:
            shutil.rmtree(work, ignore_errors=True)
        raise
    return {**report, "from_cache": False}


def _train_steps(model, opt, tap, train_ids, hyper: dict, gen, n_expert: int, progress: bool):
    """The training loop: random windows of the train tokens, the fused head loss plus the balance loss,
    clipped AdamW steps on the schedule lr_at gives. Returns each step's LM and balance losses, and
    the loop's seconds."""
    import torch

    steps, seq_len, batch = hyper["steps"], hyper["seq_len"], hyper["batch"]
    model.train()
    losses, balances = [], []
    every = max(1, steps // 10)
    t_train = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, hyper["lr"])
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch,), generator=gen)
        windows = torch.stack([train_ids[s:s + seq_len + 1] for s in starts.tolist()])
        # the CausalLM's forward is model.model then lm_head; the head and its loss are fused
        hidden = model.model(input_ids=windows[:, :-1], use_cache=False).last_hidden_state
        lm = head_loss(hidden.reshape(-1, hidden.shape[-1]), model.lm_head.weight, windows[:, 1:].reshape(-1))
        bal = balance_loss(tap.take(), n_expert)
        loss = lm + hyper["balance"] * bal
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        losses.append(float(lm.detach()))
        balances.append(float(bal.detach()) if torch.is_tensor(bal) else float(bal))
        if progress and ((step + 1) % every == 0 or step + 1 == steps):
            el = time.time() - t_train
            _log(f"step {step + 1}/{steps} loss {losses[-1]:.3f} balance {balances[-1]:.3f} "
                 f"elapsed {el:.0f} s ({el / (step + 1):.2f} s/step)")
    return losses, balances, time.time() - t_train


def _save_bf16(model, weights: Path) -> None:
    """The trained weights as BF16 safetensors, under HF's tensor names."""
    import torch
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)


def _train_into(work: Path, arch: str, data: Corpus, info: dict, hyper: dict, key: str, key_inputs: dict,
                progress: bool) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    steps, seed, seq_len, batch = hyper["steps"], hyper["seed"], hyper["seq_len"], hyper["batch"]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the DeepSeek config's integer rope_scaling values draw warnings
    try:
        make_tiny(arch, work, seed=seed)  # config, tokenizer, generation config (its random weights are replaced)
    finally:
        hf_logging.set_verbosity(verbosity)
    train_ids = tokenize(work / "tokenizer.json", data.train_text)
    held_ids = tokenize(work / "tokenizer.json", data.heldout_text)
    info = {**info, "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids))}
    if len(train_ids) < seq_len + 2:
        raise ZipMoEError(f"corpus {data.name}: {len(train_ids)} train tokens, fewer than --seq-len {seq_len} + 2")

    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), hf_logging.get_verbosity())
    torch.set_num_threads(hyper["threads"])
    torch.use_deterministic_algorithms(True)
    hf_logging.set_verbosity_error()  # the DeepSeek config's integer rope_scaling values draw warnings
    try:
        hf_config = AutoConfig.from_pretrained(work)
        hf_config.output_router_logits = False  # Qwen2Moe's own aux loss stays off: ours is used for both
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config).float()
        vocab = int(hf_config.vocab_size)
        n_expert, top_k = _n_expert(hf_config), int(hf_config.num_experts_per_tok)

        t0 = time.time()
        routing_random = routing_stats(model, held_ids, hyper["routing_tokens"], seq_len)
        if progress:
            _log(f"{arch} on {data.name}: {len(train_ids)} train / {len(held_ids)} held-out tokens; "
                 f"training {steps} steps of {batch} x {seq_len} tokens on {hyper['threads']} threads")

        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=hyper["lr"], betas=BETAS)
        gen = torch.Generator().manual_seed(seed)
        tap = RouterTap(model, top_k)
        try:
            losses, balances, seconds = _train_steps(model, opt, tap, train_ids, hyper, gen, n_expert, progress)
        finally:
            tap.close()
        del opt

        _save_bf16(model, work / "model.safetensors")
        del model

        # the model as saved: BF16 weights, evaluated in float32
        trained = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32)
        eval_ids = held_ids[:hyper["eval_tokens"]]
        nll, n_pred = heldout_nll(trained, eval_ids, seq_len)
        uni = unigram_nll(train_ids, eval_ids, vocab, seq_len)
        routing_trained = routing_stats(trained, held_ids, hyper["routing_tokens"], seq_len)
        total_seconds = time.time() - t0
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])
        hf_logging.set_verbosity(saved[2])

    report = training_report(arch, key, key_inputs, info, hyper, losses, balances, seconds, held_ids, eval_ids,
                             n_pred, nll, uni, routing_trained, routing_random, total_seconds)
    counts = report["routing"].pop("counts")
    (work / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    routing_file = {"arch": arch, "tokens": routing_trained["tokens"], "n_expert": routing_trained["n_expert"],
                    "top_k": routing_trained["top_k"], "layers": [x["layer"] for x in routing_trained["layers"]],
                    "note": "coactivation[l][i][j]: tokens whose top-k selection in MoE layer l holds both i and j "
                            "(diagonal: holds i)",
                    "coactivation": counts}
    (work / "routing.json").write_text(json.dumps(routing_file) + "\n")
    return report


def summary(report: dict) -> str:
    t, h, u = report["training"], report["heldout"], report["unigram"]
    rt, rr = report["routing"]["trained"]["summary"], report["routing"]["random_init"]["summary"]
    return "\n".join([
        f"{report['arch']} on {report['corpus']['name']}: {t['steps']} steps in {t['seconds']:.0f} s "
        f"({t['s_per_step']:.2f} s/step), final train loss {t['final_train_loss']:.3f}",
        f"held-out ({h['tokens_predicted']} tokens): perplexity {h['perplexity']:.1f}, "
        f"unigram {u['perplexity']:.1f}",
        f"routing (mean over MoE layers; trained vs random init): entropy {rt['entropy_mean']:.3f} vs "
        f"{rr['entropy_mean']:.3f}, top-1 share {rt['top1_share_mean']:.3f} vs {rr['top1_share_mean']:.3f} "
        f"(uniform {rt['uniform_top1_share']:.3f}), co-activation lift (top 10% pairs) "
        f"{rt['coactivation_top10pct_lift_mean']:.2f} vs {rr['coactivation_top10pct_lift_mean']:.2f}",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="zipmoe-train-tiny",
        description="Train a small MoE checkpoint (zipmoe-make-tiny's config and tokenizer) on a fixed "
                    "natural-language corpus, deterministically and cached; writes the BF16 checkpoint, "
                    "training.json (loss, held-out perplexity vs a unigram baseline, routing statistics) "
                    "and routing.json (expert co-activation counts).")
    ap.add_argument("arch", choices=sorted(ARCHITECTURES), help="architecture, as in zipmoe-make-tiny")
    ap.add_argument("out_dir", type=Path, help="folder to write the checkpoint into (created if missing)")
    ap.add_argument("--corpus", choices=list(CORPORA), default="python-docs",
                    help=f"python-docs: the Python 3.11 documentation sources (apt-get install python3.11-doc; "
                         f"folder overridable with {PYTHON_DOCS_ENV}); pydoc-topics: pydoc_data.topics "
                         "(default: %(default)s)")
    ap.add_argument("--steps", type=int, default=None,
                    help="optimiser steps (default: " +
                         ", ".join(f"{a} {s}" for a, s in DEFAULT_STEPS.items()) + "; about 5 minutes on 2 cores)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and batch order (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"], help="tokens per window (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="windows per step (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="peak learning rate (default: %(default)s)")
    ap.add_argument("--balance", type=float, default=DEFAULTS["balance"],
                    help="load-balancing loss coefficient per MoE layer (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=DEFAULTS["threads"],
                    help="torch threads; part of the result's identity (default: %(default)s)")
    ap.add_argument("--eval-tokens", type=int, default=DEFAULTS["eval_tokens"],
                    help="held-out tokens evaluated at most (default: %(default)s)")
    ap.add_argument("--routing-tokens", type=int, default=DEFAULTS["routing_tokens"],
                    help="held-out tokens the routing statistics use (default: %(default)s)")
    ap.add_argument("--no-cache", action="store_true", help="train even if a cached result exists (and do not "
                                                            "store this one)")
    args = ap.parse_args(argv)
    try:
        report = train(args.arch, args.out_dir, corpus=args.corpus, steps=args.steps, seed=args.seed,
                       seq_len=args.seq_len, batch=args.batch, lr=args.lr, balance=args.balance,
                       threads=args.threads, eval_tokens=args.eval_tokens, routing_tokens=args.routing_tokens,
                       use_cache=not args.no_cache)
    except ZipMoEError as e:
        print(f"zipmoe-train-tiny: error: {e}", file=sys.stderr)
        return 1
    print(summary(report))
    print(f"wrote {args.arch} checkpoint to {args.out_dir}" + (" (from the cache)" if report["from_cache"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
