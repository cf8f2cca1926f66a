"""zipmoe-train-tiny: trained tiny checkpoints, deterministic and cached, with their report.

Short runs only (a few steps of 2 x 64 tokens on pydoc-topics); full training is a benchmark."""
from __future__ import annotations

import json
import math
import time

import pytest

from zipmoe_py.errors import ZipMoEError
from zipmoe_py.devtools.train_tiny import heldout_text, load_corpus, main, train

from conftest import run, zipmoe_command

SHORT = dict(corpus="pydoc-topics", steps=8, batch=2, seq_len=64, lr=1e-2, eval_tokens=2048,
             routing_tokens=1024, progress=False)
SHORT_ARGS = ["--corpus", "pydoc-topics", "--steps", "8", "--batch", "2", "--seq-len", "64", "--lr", "1e-2",
              "--eval-tokens", "2048", "--routing-tokens", "1024"]
MOE_LAYERS = {"deepseek2": 25, "qwen2moe": 4}  # DeepSeek-V2-Lite's first layer is dense


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("zipmoe-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZIPMOE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def short_run(cache_dir, tmp_path_factory):
    """arch -> (checkpoint folder, report, seconds), trained once per module."""
    done = {}

    def get(arch):
        if arch not in done:
            out = tmp_path_factory.mktemp(f"trained-{arch}")
            t = time.monotonic()
            report = train(arch, out, **SHORT)
            done[arch] = (out, report, time.monotonic() - t)
        return done[arch]

    return get


def test_short_run_writes_a_loadable_checkpoint_and_report(arch, short_run):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out, report, _ = short_run(arch)
    assert not report["from_cache"]
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors", "training.json", "routing.json"):
        assert (out / name).is_file(), name
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(n).get_dtype()) for n in f.keys()} == {"BF16"}
        assert "model.layers.1.mlp.gate.weight" in f.keys() and "lm_head.weight" in f.keys()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == {"deepseek2": "DeepseekV2ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}[arch]

    saved = json.loads((out / "training.json").read_text())
    assert saved == {k: v for k, v in report.items() if k != "from_cache"}
    assert saved["training"]["steps"] == 8 and len(saved["training"]["loss_curve"]) == 8
    for value in (saved["heldout"]["perplexity"], saved["unigram"]["perplexity"], saved["heldout"]["mean_nll"],
                  saved["training"]["final_train_loss"]):
        assert math.isfinite(value) and value > 0
    assert 0 < saved["heldout"]["tokens_predicted"] <= saved["heldout"]["tokens_evaluated"] <= 2048
    curve = saved["training"]["loss_curve"]
    assert sum(curve[-2:]) < sum(curve[:2]), curve  # it learns
    assert saved["corpus"]["name"] == "pydoc-topics" and "PSF" in saved["corpus"]["licence"]
    assert saved["corpus"]["train_tokens"] > 10 * saved["corpus"]["heldout_tokens"] > 0

    for which in ("trained", "random_init"):
        stats = saved["routing"][which]
        assert len(stats["layers"]) == MOE_LAYERS[arch] and stats["n_expert"] == 16
        for layer in stats["layers"]:
            assert len(layer["popularity"]) == 16 and abs(sum(layer["popularity"]) - 1) < 1e-4
            assert 0 < layer["entropy"] <= 1 and 1 / 16 <= layer["top1_share"] <= 1
            assert layer["coactivation_top10pct_lift"] > 0
    routing = json.loads((out / "routing.json").read_text())
    top_k = routing["top_k"]
    for which in ("trained", "random_init"):
        assert len(routing["coactivation"][which]) == MOE_LAYERS[arch]
        for matrix in routing["coactivation"][which]:
            assert len(matrix) == 16 and all(len(row) == 16 for row in matrix)
            assert sum(matrix[i][i] for i in range(16)) == routing["tokens"] * top_k
            assert all(matrix[i][j] == matrix[j][i] for i in range(16) for j in range(16))


def test_second_call_hits_the_cache(arch, short_run, tmp_path):
    first, report, seconds = short_run(arch)
    t = time.monotonic()
    again = train(arch, tmp_path / "again", **SHORT)
    assert again["from_cache"] and time.monotonic() - t < seconds
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    assert again["cache_key"] == report["cache_key"]


def test_training_is_deterministic(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZIPMOE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("a", "b"):
        assert main(["qwen2moe", str(tmp_path / name), *SHORT_ARGS, "--steps", "4", "--no-cache"]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert not (tmp_path / "cache").exists()  # --no-cache neither reads nor writes it


def test_missing_python_docs_names_the_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ZIPMOE_PYTHON_DOCS", str(tmp_path))
    with pytest.raises(ZipMoEError, match="python3.11-doc"):
        heldout_text("python-docs")
    assert main(["qwen2moe", str(tmp_path / "out"), "--corpus", "python-docs"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("zipmoe-train-tiny: error: ") and "python3.11-doc" in err and str(tmp_path) in err


def test_heldout_split_is_disjoint_from_train():
    corpus = load_corpus("pydoc-topics")
    from pydoc_data.topics import topics

    keys = sorted(topics)
    assert corpus.heldout_documents == [k for i, k in enumerate(keys) if i % 10 == 9]
    assert set(corpus.heldout_documents).isdisjoint(corpus.train_documents)
    assert len(corpus.heldout_documents) + len(corpus.train_documents) == len(keys)
    for name in corpus.heldout_documents:
        assert topics[name] not in corpus.train_text, name
    assert heldout_text("pydoc-topics") == corpus.heldout_text == "\n\n".join(topics[k] for k in corpus.heldout_documents)


def test_trained_checkpoint_converts(short_run, tmp_path):
    out, _, _ = short_run("qwen2moe")
    gguf = tmp_path / "trained-qwen2moe-bf16.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), out, "-o", gguf, "--bf16", "--quiet"])
    assert proc.returncode == 0, proc.stderr.decode()
    assert gguf.stat().st_size > 0
