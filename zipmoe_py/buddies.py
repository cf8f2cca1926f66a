"""zipmoe-buddies: BuddyMoE's buddy profiles (its 3.2-3.3), made from a ZipMoE model's own routing.

The model runs over a calibration text with the runtime's routing trace on
(ggml_zipmoe_cache_trace_routing): per MoE layer, every expert's activations A(i), counted per token,
and the co-activations M(i, j) of experts the same token chose, weighted by the smaller of their two
renormalized scores (or binary), the first --warmup tokens down-weighted. Then, per layer:
- q_{j|i} = M(i, j) / sum_j' M(i, j') after Laplace smoothing M + eps (eq. 4; q_{i|i} = 0);
- the buddy list of i: its peers by q_{j|i}, descending, up to the shortest prefix whose q sum reaches
  the cumulative frequency threshold alpha (CFT, eqs. 5-6), at most --k-max (none for an expert never
  chosen);
- tau: the --tae-percentile-th percentile of the layer's token activating entropies (eq. 1), the TAE
  gate's calibrated threshold.
With --heldout, the lists' recall of real co-activations on other text: the share of the binary
co-activations (i, j) seen there whose j is in i's list.

The profile is a JSON file (docs/PLAN_FORMAT.md, BUDDY PROFILE), not GGUF metadata, so one model file
serves several profiles. It names the model it was made for by a fingerprint of the experts' stored
sign+mantissa chunks; loading it for another model is an error naming both.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from . import _lib
from .buddy_profile import FORMAT, VERSION, apply_profile, fingerprint, load_profile  # noqa: F401 (its API)
from .errors import ZipMoEError


def buddy_lists(coact: np.ndarray, activations: np.ndarray, cft: float, k_max: int,
                smoothing: float) -> tuple[list[list[int]], list[list[float]]]:
    """Per pivot i, its buddies (CFT prefix of its peers by q_{j|i}, at most k_max) and their q_{j|i}."""
    n = coact.shape[0]
    m = coact.astype(np.float64) + smoothing
    np.fill_diagonal(m, 0.0)
    q = m / m.sum(axis=1, keepdims=True)
    buddies, qs = [], []
    for i in range(n):
        if activations[i] <= 0:
            buddies.append([])
            qs.append([])
            continue
        order = sorted(range(n), key=lambda j: (-q[i, j], j))
        order = [j for j in order if j != i]
        total, chosen = 0.0, []
        for j in order:
            chosen.append(j)
            total += q[i, j]
            if total >= cft - 1e-12 or len(chosen) == k_max:
                break
        buddies.append(chosen)
        qs.append([float(q[i, j]) for j in chosen])
    return buddies, qs


def tae_percentile(hist: np.ndarray, percentile: float) -> float:
    """The TAE below which `percentile` % of the traced tokens fall (a bin's upper edge)."""
    total = int(hist.sum())
    if total == 0:
        return 0.0
    cumulative = np.cumsum(hist)
    index = int(np.searchsorted(cumulative, total * percentile / 100.0, side="left"))
    return min(1.0, (index + 1) / len(hist))


def recall(coact_binary: np.ndarray, buddies: list[list[int]]) -> float | None:
    """Share of the co-activations (i, j) whose j is in i's buddy list."""
    covered = sum(coact_binary[i, b].sum() for i, b in enumerate(buddies) if b)
    total = coact_binary.sum()
    return float(covered / total) if total > 0 else None


def _trace(model: Path, texts: list[str], temperature: float, warmup: int, threads: int | None,
           n_ctx: int) -> tuple[dict, int]:
    """Routing traces of every MoE layer over the texts, and the tokens evaluated."""
    from . import format as zformat
    from .bindings import Llama

    with zformat.ZipMoEFile(model) as zf:
        layers = {layer: zf.shape(zf.tensors[t[0]])[2] for layer, t in zf.moe_layers().items()}
        everything = zf.expert_bytes().all_experts
    # logits_all: llama.cpp runs the last layer's FFN only for the tokens whose logits are wanted
    llm = Llama(model_path=str(model), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512), n_threads=threads,
                n_threads_batch=threads, verbose=False, kv_overrides={"zipmoe.trace_routing": True},
                zipmoe_budget=everything, logits_all=True)
    try:
        cache = _lib.llama_model_zipmoe_cache(llm._model.model)
        if _lib.lib().ggml_zipmoe_cache_trace_routing(cache, 1, float(temperature), int(warmup)) != _lib.OK:
            raise ZipMoEError("the routing trace could not be started")
        n_tokens = 0
        for text in texts:
            tokens = llm.tokenize(text.encode(), add_bos=False, special=False)
            for start in range(0, len(tokens), n_ctx):
                llm.reset()
                llm.eval(tokens[start:start + n_ctx])
            n_tokens += len(tokens)
        return {layer: _lib.routing_trace(cache, layer, n) for layer, n in layers.items()}, n_tokens
    finally:
        llm.close()


def _check_text(text: str, what: str, name: str) -> None:
    """ZipMoEError naming the text (a file, or a corpus split) when it is empty."""
    if not text:
        raise ZipMoEError(f"the {what}{f' ({name})' if name else ''} is empty: give a text of at least one token "
                          "for the model to route")


def _check_routed(traces: dict, n_tokens: int, what: str, name: str) -> None:
    """ZipMoEError naming the text unless every MoE layer routed at least one of its tokens (a layer
    that routed none would get no buddy lists and no tau)."""
    silent = [str(layer) for layer, tr in traces.items() if tr["tokens"] == 0]
    if n_tokens > 0 and traces and not silent:
        return
    routed = f"MoE layers {', '.join(silent)} routed none of them" if n_tokens > 0 and silent else "no token was routed"
    raise ZipMoEError(f"the {what}{f' ({name})' if name else ''} gives {n_tokens} tokens and {routed}: it is too short "
                      "to route any token; give a longer text")


def make_profile(model: Path, text: str, heldout: str | None = None, cft: float | list[float] = 0.9, k_max: int = 16,
                 percentile: float = 15.0, temperature: float = 1.0, smoothing: float = 1e-3,
                 weighting: str = "probability", warmup: int = 0, threads: int | None = None,
                 n_ctx: int = 512, text_name: str = "", heldout_name: str = "", progress=None) -> dict:
    """The buddy profile of `model` from its routing over `text` (and the lists' recall over `heldout`);
    ZipMoEError for an option out of range, or a text that is empty or routes no token (named by
    text_name / heldout_name: a file, or a corpus split)."""
    cfts = cft if isinstance(cft, (list, tuple)) else None
    if any(not 0 < c <= 1 for c in (cfts or [cft])):
        raise ZipMoEError(f"--cft must be in (0, 1] (one value, or one per MoE layer); got {cft}")
    if k_max < 1:
        raise ZipMoEError(f"--k-max must be >= 1; got {k_max}")
    if not 0 <= percentile <= 100:
        raise ZipMoEError(f"--tae-percentile must be in [0, 100]; got {percentile}")
    if weighting not in ("probability", "binary"):
        raise ZipMoEError(f"--weighting must be probability or binary; got {weighting!r}")
    if cfts is not None:
        from . import format as zformat

        with zformat.ZipMoEFile(model) as zf:
            n_layers = len(zf.moe_layers())
        if len(cfts) != n_layers:
            raise ZipMoEError(f"--cft gives {len(cfts)} values for the model's {n_layers} MoE layers")
    _check_text(text, "calibration text", text_name)
    if heldout is not None:
        _check_text(heldout, "held-out text", heldout_name)
    t0 = time.perf_counter()
    traces, n_tokens = _trace(model, [text], temperature, warmup, threads, n_ctx)
    _check_routed(traces, n_tokens, "calibration text", text_name)
    if progress:
        progress(f"traced {n_tokens} calibration tokens in {time.perf_counter() - t0:.1f} s")
    layers = {}
    for n, (layer, tr) in enumerate(traces.items()):
        m = tr["coact_weighted"] if weighting == "probability" else tr["coact"]
        buddies, qs = buddy_lists(m, tr["activations"], cfts[n] if cfts else cft, k_max, smoothing)
        sizes = [len(b) for b in buddies if b]
        layers[str(layer)] = {
            "tau": tae_percentile(tr["tae_hist"], percentile), "cft": cfts[n] if cfts else cft,
            "buddies": buddies, "q": [[round(v, 6) for v in q] for q in qs],
            "activations": [round(float(a), 3) for a in tr["activations"]],
            "list_size": {"mean": float(np.mean(sizes)) if sizes else 0.0, "max": max(sizes, default=0)},
            "recall_calibration": recall(tr["coact"], buddies),
        }
    heldout_recall = None
    if heldout is not None:
        t0 = time.perf_counter()
        held, held_tokens = _trace(model, [heldout], temperature, 0, threads, n_ctx)
        _check_routed(held, held_tokens, "held-out text", heldout_name)
        per_layer = {str(layer): recall(tr["coact"], layers[str(layer)]["buddies"]) for layer, tr in held.items()}
        total_cov = sum(held[l]["coact"][i, b].sum() for l in held for i, b in enumerate(layers[str(l)]["buddies"]) if b)
        total = sum(held[l]["coact"].sum() for l in held)
        heldout_recall = {"tokens": held_tokens, "recall": float(total_cov / total) if total else None,
                          "by_layer": per_layer}
        if progress:
            shown = "none" if heldout_recall["recall"] is None else f"{heldout_recall['recall']:.3f}"
            progress(f"held-out recall {shown} over {held_tokens} tokens "
                     f"({time.perf_counter() - t0:.1f} s)")
    return {"format": FORMAT, "version": VERSION, "model": fingerprint(model),
            "made_with": {"text": text_name, "tokens": n_tokens, "cft": cft, "k_max": k_max,
                          "tae_percentile": percentile, "temperature": temperature, "smoothing": smoothing,
                          "weighting": weighting, "warmup": warmup},
            "heldout": heldout_recall, "layers": layers}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="zipmoe-buddies",
        description="Make a BuddyMoE buddy profile for a ZipMoE GGUF from its routing over a calibration text "
                    "(for zipmoe_substitution='buddy', which is LOSSY). The profile is written to the JSON file "
                    "-o names (docs/PLAN_FORMAT.md, BUDDY PROFILE), not into the model, so one model serves "
                    "several profiles; load one with zipmoe-chat --buddy-profile or Llama(zipmoe_buddy_profile=).")
    ap.add_argument("model", type=Path, help="ZipMoE GGUF (made by zipmoe-convert)")
    ap.add_argument("-o", "--output", type=Path, required=True, metavar="PROFILE.json",
                    help="buddy profile JSON to write (required; its folder must exist)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", type=Path, help="calibration text file")
    src.add_argument("--corpus", help="the train split of a zipmoe-train-tiny corpus (python-docs, pydoc-topics)")
    ap.add_argument("--heldout", type=Path, default=None,
                    help="text to measure the lists' recall of real co-activations on (with --corpus: its held-out "
                         "split, unless given)")
    ap.add_argument("--max-tokens", type=int, default=100_000,
                    help="about this many calibration tokens at most (default: %(default)s)")
    ap.add_argument("--cft", default="0.9", metavar="ALPHA[,ALPHA...]",
                    help="cumulative frequency threshold alpha of the buddy lists, in (0, 1]: one value, or one per "
                         "MoE layer in layer order (alpha_l) (default: %(default)s)")
    ap.add_argument("--k-max", type=int, default=16, help="buddies per expert at most (default: %(default)s)")
    ap.add_argument("--tae-percentile", type=float, default=15.0,
                    help="the TAE gate's calibrated tau: this percentile of each layer's token entropies "
                         "(default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="temperature T of the TAE (the runtime's zipmoe_buddy_temperature should match; "
                         "default: %(default)s)")
    ap.add_argument("--smoothing", type=float, default=1e-3, help="Laplace smoothing eps of M (default: %(default)s)")
    ap.add_argument("--weighting", choices=("probability", "binary"), default="probability",
                    help="co-activations weighted by the smaller renormalized score, or counted (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="down-weight each layer's first N traced tokens linearly (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: llama.cpp's choice)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.output.parent.is_dir():  # before the run, not after it
        ap.error(f"the folder of -o {args.output} does not exist")
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        cft = [float(v) for v in args.cft.split(",")]
    except ValueError:
        ap.error(f"--cft must be numbers in (0, 1], like 0.9 or 0.95,0.9,0.85; got {args.cft!r}")
    try:
        heldout = args.heldout.read_text() if args.heldout else None  # one given and empty is refused
        held_name = str(args.heldout) if args.heldout else ""
        if args.text is not None:
            text, name = args.text.read_text(), str(args.text)
        else:
            from .devtools.corpus import load_corpus

            corpus = load_corpus(args.corpus)
            text, held = corpus.train_text, corpus.heldout_text
            name = f"train split of {args.corpus}"
            if heldout is None and held:  # the corpus's held-out split, when it has one
                heldout, held_name = held, f"held-out split of {args.corpus}"
        text = text[: args.max_tokens * 4]  # about max_tokens tokens (English BPE: ~4 characters a token)
        doc = make_profile(args.model, text, heldout=heldout[: 200_000] if heldout is not None else None,
                           cft=cft[0] if len(cft) == 1 else cft,
                           k_max=args.k_max, percentile=args.tae_percentile, temperature=args.temperature,
                           smoothing=args.smoothing, weighting=args.weighting, warmup=args.warmup,
                           threads=args.threads, text_name=name, heldout_name=held_name,
                           progress=lambda m: print(f"zipmoe-buddies: {m}", file=sys.stderr))
    except (ZipMoEError, OSError) as e:
        print(f"zipmoe-buddies: error: {e}", file=sys.stderr)
        return 1
    args.output.write_text(json.dumps(doc) + "\n")
    sizes = [v["list_size"]["mean"] for v in doc["layers"].values()]
    rec = doc["heldout"]["recall"] if doc["heldout"] else None
    print(f"wrote {args.output}: {len(doc['layers'])} MoE layers, mean buddy list {np.mean(sizes):.1f} experts"
          + (f", held-out recall {rec:.3f}" if rec is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
