"""zipmoe-make-tiny: real config keys, HF tensor names, BF16 weights, real tokenizers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from zipmoe_py import _paths
from zipmoe_py.devtools.tiny import ARCHITECTURES, DEEPSEEK_V2_LITE_CONFIG, QWEN15_MOE_A27B_CONFIG, tiny_config

from conftest import run, zipmoe_command

REAL = {"deepseek2": DEEPSEEK_V2_LITE_CONFIG, "qwen2moe": QWEN15_MOE_A27B_CONFIG}


def test_config_has_the_real_models_keys(arch, tiny_hf):
    config = json.loads((tiny_hf(arch) / "config.json").read_text())
    assert sorted(config) == sorted(REAL[arch])
    # what makes the architecture what it is stays as in the real model
    for key in ("architectures", "model_type", "vocab_size", "num_experts_per_tok", "norm_topk_prob",
                "hidden_act", "rope_theta", "tie_word_embeddings"):
        assert config[key] == REAL[arch][key], key
    if arch == "deepseek2":
        assert config["q_lora_rank"] is None and config["num_hidden_layers"] in (26, 27)
        for key in ("n_shared_experts", "first_k_dense_replace", "topk_method", "scoring_func", "rope_scaling"):
            assert config[key] == REAL[arch][key], key
        assert config["n_routed_experts"] > config["num_experts_per_tok"]
    else:
        assert config["shared_expert_intermediate_size"] > 0
        assert config["num_experts"] > config["num_experts_per_tok"]


def test_weights_are_bf16_with_hf_tensor_names(arch, tiny_hf):
    with safe_open(str(tiny_hf(arch) / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        dtypes = {str(f.get_slice(n).get_dtype()) for n in names}
    assert dtypes == {"BF16"}
    if arch == "deepseek2":
        expected = ["model.layers.1.mlp.experts.15.down_proj.weight", "model.layers.1.mlp.shared_experts.gate_proj.weight",
                    "model.layers.1.mlp.gate.weight", "model.layers.0.mlp.gate_proj.weight",
                    "model.layers.25.self_attn.kv_a_proj_with_mqa.weight", "model.layers.3.self_attn.q_proj.weight",
                    "lm_head.weight"]
    else:
        expected = ["model.layers.3.mlp.experts.15.down_proj.weight", "model.layers.0.mlp.shared_expert.up_proj.weight",
                    "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.gate.weight",
                    "model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias", "lm_head.weight"]
    for name in expected:
        assert name in names, name


def _reference_cases(vocab_file: Path):
    inputs = vocab_file.with_name(vocab_file.name + ".inp").read_text(encoding="utf-8")
    outputs = vocab_file.with_name(vocab_file.name + ".out").read_text(encoding="utf-8").splitlines()
    texts = inputs.split("\n__ggml_vocab_test__\n")[:-1]
    assert len(texts) == len(outputs) > 20
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outputs)]


def test_tokenizer_reproduces_llama_cpp_reference_tokenizations(arch, tiny_hf):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_hf(arch)))
    vocab_file = _paths.vendored_vocab(ARCHITECTURES[arch][0])
    cases = _reference_cases(vocab_file)
    mismatches = [(t, ids, tok.encode(t, add_special_tokens=False)) for t, ids in cases
                  if tok.encode(t, add_special_tokens=False) != ids]
    assert not mismatches, mismatches[:3]
    if arch == "deepseek2":  # BOS is added, as the real DeepSeek tokenizer does
        assert tok.encode("Hello")[0] == 100000


def test_a_sentencepiece_family_reproduces_llama_cpp_reference_tokenizations(tmp_path):
    """ERNIE-4.5's converter reads only a SentencePiece model: the one written from the Llama SentencePiece
    vocab GGUF tokenizes llama.cpp's reference texts to its reference ids."""
    import sentencepiece

    arch = next(a for a, (vocab, _, _) in ARCHITECTURES.items() if vocab == "ggml-vocab-llama-spm.gguf")
    out = run([zipmoe_command("zipmoe-make-tiny"), arch, tmp_path / "hf"])
    assert out.returncode == 0, out.stderr.decode()
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    tok = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "hf" / "tokenizer.model"))
    cases = _reference_cases(_paths.vendored_vocab(ARCHITECTURES[arch][0]))
    mismatches = [(t, ids, tok.encode(t)) for t, ids in cases if tok.encode(t) != ids]
    assert not mismatches, mismatches[:3]
    assert tok.id_to_piece(1) == "<s>" and tok.is_control(1) and tok.is_byte(3)


def test_seed_makes_weights_reproducible(tmp_path):
    a = run([zipmoe_command("zipmoe-make-tiny"), "qwen2moe", tmp_path / "a", "--seed", "7"])
    b = run([zipmoe_command("zipmoe-make-tiny"), "qwen2moe", tmp_path / "b", "--seed", "7"])
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def test_unknown_architecture_is_refused(tmp_path):
    proc = run([zipmoe_command("zipmoe-make-tiny"), "llama", tmp_path / "x"])
    assert proc.returncode == 2
    assert b"invalid choice: 'llama'" in proc.stderr


def test_streamed_weights_are_a_sharded_checkpoint_of_every_tensor(tmp_path):
    """The bench models' path (real widths, written layer by layer, never whole in memory), on a tiny
    config: one shard per layer plus one for the rest, an index naming every tensor of the model,
    norms 1, biases 0, the other weights drawn."""
    from transformers import AutoConfig

    from zipmoe_py.devtools.tiny import _write_streamed_weights, make_tiny

    hf = make_tiny("qwen2moe", tmp_path / "hf")
    streamed = tmp_path / "streamed"
    streamed.mkdir()
    _write_streamed_weights(AutoConfig.from_pretrained(hf), streamed)
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        whole = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert set(index["weight_map"]) == set(whole)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == json.loads((hf / "config.json").read_text())["num_hidden_layers"] + 1
    total = 0
    for shard in shards:
        with safe_open(str(streamed / shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert list(t.shape) == whole[name] and str(t.dtype) == "torch.bfloat16", name
                total += t.numel() * 2
                if name.endswith("norm.weight"):
                    assert bool((t == 1).all()), name
                elif name.endswith(".bias"):
                    assert bool((t == 0).all()), name
                else:
                    assert float(t.float().std()) > 0, name
    assert index["metadata"]["total_size"] == total


def test_uniform_router_spreads_routing_and_forgets_the_last_token(tmp_path):
    """router="uniform" (the bench models' worst case for expert caches): against the random router of
    the same seed, expert popularity close to uniform and consecutive tokens sharing experts about as
    often as chance; only attention output projections and routers differ (experts bit-identical).
    Measured with bench/prefetch_recall.py on text, where frequent words keep some experts busier."""
    import torch

    from zipmoe_py.devtools.routing import default_text, load_model, measure, tokenize
    from zipmoe_py.devtools.tiny import make_tiny

    stats, weights = {}, {}
    for router in ("random", "uniform"):
        hf = make_tiny("qwen2moe", tmp_path / router, router=router)
        with safe_open(str(hf / "model.safetensors"), "pt") as f:
            weights[router] = {n: f.get_tensor(n) for n in f.keys()}
        result = measure(load_model(hf, torch.float32), tokenize(hf, default_text(), 256))
        stats[router] = result["overall"]
        assert stats[router]["self_check"] > 0.99, stats[router]
    chance = result["k"] / result["n_experts"]  # 4 of 16

    changed = {n for n in weights["random"] if not torch.equal(weights["random"][n], weights["uniform"][n])}
    assert changed and all(n.endswith((".self_attn.o_proj.weight", ".mlp.gate.weight")) for n in changed), changed
    random, uniform = stats["random"], stats["uniform"]
    assert uniform["entropy"] > 0.98 and uniform["top25"] < 0.36, uniform
    assert uniform["consecutive_overlap"] < chance + 0.05, uniform
    assert random["top25"] > uniform["top25"] + 0.1, (random, uniform)
    assert random["consecutive_overlap"] > uniform["consecutive_overlap"] + 0.1, (random, uniform)


def test_mxfp4_experts_are_what_transformers_reads_back():
    """gpt-oss's published layout, checked against transformers' own reader: weights that MXFP4 holds exactly
    (a power of two times E2M1 values in each block of 32) come back bit for bit, and drawn ones within
    4-bit rounding; a transposed or nibble-swapped layout would miss both."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from zipmoe_py.devtools.tiny_families import E2M1_MAGNITUDES, mxfp4_experts

    gen = torch.Generator().manual_seed(0)
    values = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES))
    # [expert, output row, input]: a power of two for each block of 32 inputs; stored as HF's [expert, input, output]
    scale = torch.exp2(torch.randint(-8, 0, (2, 128, 2), generator=gen).float()).repeat_interleave(32, 2)
    exact = (values[torch.randint(0, 16, (2, 128, 64), generator=gen)] * scale).transpose(1, 2)
    drawn = torch.randn((2, 128, 64), generator=gen) * 0.02
    state = mxfp4_experts({"model.layers.0.mlp.experts.gate_up_proj": exact,
                           "model.layers.0.mlp.experts.down_proj": drawn, "model.norm.weight": torch.ones(64)})
    assert set(state) == {"model.norm.weight", *(f"model.layers.0.mlp.experts.{n}_{part}" for n in ("gate_up_proj", "down_proj")
                                                 for part in ("blocks", "scales"))}
    assert state["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (2, 128, 2, 16)
    assert state["model.layers.0.mlp.experts.gate_up_proj_scales"].shape == (2, 128, 2)
    back = convert_moe_packed_tensors(state["model.layers.0.mlp.experts.gate_up_proj_blocks"],
                                      state["model.layers.0.mlp.experts.gate_up_proj_scales"]).float()
    assert torch.equal(back, exact)
    back = convert_moe_packed_tensors(state["model.layers.0.mlp.experts.down_proj_blocks"],
                                      state["model.layers.0.mlp.experts.down_proj_scales"]).float()
    assert float((back - drawn).norm() / drawn.norm()) < 0.15  # E2M1 with a power-of-two scale per 32


def test_mxfp4_is_refused_for_a_family_not_published_so(tmp_path):
    proc = run([zipmoe_command("zipmoe-make-tiny"), "qwen3moe", tmp_path / "x", "--mxfp4"])
    assert proc.returncode == 1 and b"--mxfp4: qwen3moe is not published with MXFP4 experts (only gptoss)" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_a_nested_checkpoint_takes_its_tiny_sizes_in_its_own_configs():
    """Llama 4 as published: the text model's config in text_config beside vision_config; the tiny sizes go
    into each, and the published keys the sizes leave alone stay."""
    config = tiny_config("llama4vl")
    assert config["architectures"] == ["Llama4ForConditionalGeneration"]
    text, vision = config["text_config"], config["vision_config"]
    assert text["hidden_size"] == 64 and text["num_hidden_layers"] == 4 and text["num_local_experts"] == 16
    assert text["use_qk_norm"] is True and text["interleave_moe_layer_step"] == 1 and text["num_experts_per_tok"] == 1
    assert text["rope_scaling"]["rope_type"] == "llama3" and text["vocab_size"] == config["vocab_size"]
    assert vision["hidden_size"] == 32 and vision["patch_size"] == 14 and vision["pixel_shuffle_ratio"] == 0.5
    assert "num_hidden_layers" not in config  # nothing of the text model's leaks to the top
