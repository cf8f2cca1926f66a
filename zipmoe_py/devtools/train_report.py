"""training.json of a zipmoe-train-tiny run: what it trained on and how, its losses, the held-out perplexity
against the unigram baseline, and the routing before and after training."""
from __future__ import annotations

import math

TRAIN_FORMAT = 1  # bump when the training recipe changes in a way the cache key does not see
WARMUP_FRACTION = 0.05


def training_report(arch, key, key_inputs, info, hyper, losses, balances, seconds, held_ids, eval_ids, n_pred, nll, uni,
                    routing_trained, routing_random, total_seconds) -> dict:
    """training.json: the run's corpus, hyperparameters, losses, held-out perplexity against the unigram
    baseline, and the routing before and after (its co-activation counts under routing.counts, for routing.json)."""
    counts = {"trained": routing_trained.pop("coactivation_counts"),
              "random_init": routing_random.pop("coactivation_counts")}
    steps, seq_len = hyper["steps"], hyper["seq_len"]
    tail = max(1, round(WARMUP_FRACTION * steps))
    report = {
        "format": TRAIN_FORMAT, "arch": arch, "cache_key": key,
        "corpus": info, "hyperparameters": hyper,
        "versions": {"torch": key_inputs["torch"], "transformers": key_inputs["transformers"]},
        "training": {"steps": steps, "seconds": round(seconds, 2), "s_per_step": round(seconds / steps, 3),
                     "final_train_loss": round(sum(losses[-tail:]) / tail, 4), "final_train_loss_steps": tail,
                     "loss_curve": [round(x, 4) for x in losses],
                     "balance_curve": [round(x, 4) for x in balances]},
        "heldout": {"tokens": int(len(held_ids)), "tokens_evaluated": int(len(eval_ids)),
                    "tokens_predicted": n_pred, "eval_cap_tokens": hyper["eval_tokens"],
                    "note": f"first {len(eval_ids)} held-out tokens (capped at {hyper['eval_tokens']} for time), "
                            f"non-overlapping windows of {seq_len} tokens, each window's first token context only; "
                            "the saved BF16 weights evaluated in float32",
                    "mean_nll": round(nll, 5), "perplexity": round(math.exp(nll), 3)},
        "unigram": {"smoothing": "add-one over the vocabulary, counts from the train tokens",
                    "mean_nll": round(uni, 5), "perplexity": round(math.exp(uni), 3)},
        "routing": {"note": f"first {routing_trained['tokens']} held-out tokens; random_init is the model before "
                            "training (same seed); counts in routing.json",
                    "trained": routing_trained, "random_init": routing_random, "counts": counts},
        "total_seconds": round(total_seconds, 1),
    }
    return report
