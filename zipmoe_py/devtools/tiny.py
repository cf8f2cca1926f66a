"""zipmoe-make-tiny: small Hugging Face checkpoints in the real target architectures.

The config.json carries exactly the keys of the real DeepSeek-V2-Lite
(DeepseekV2ForCausalLM) and Qwen1.5-MoE-A2.7B (Qwen2MoeForCausalLM) configs, sized
down; the weights come from transformers' own model classes (so tensor names are
HF's), saved as BF16 safetensors; the tokenizer is the real one, rebuilt from the
vocab-only GGUFs that ship in the pinned llama.cpp source, so that the unmodified
converter accepts it (its pre-tokenizer hash check included).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .. import _paths, families
from ..errors import ZipMoEError, require_extra
from ..gguf_file import read_metadata
from .tiny_families import (FAMILY_ARCHITECTURES, GPT_OSS_MXFP4_CONFIG, extra_special_tokens, mxfp4_experts,
                            randomized_buffers, sentencepiece_model)

# DeepSeek-V2-Lite's config.json, as published (auto_map names the remote code the real
# checkpoint ships; transformers 4.57 has the architecture built in and uses that).
DEEPSEEK_V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV2Config",
        "AutoModel": "modeling_deepseek.DeepseekV2Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {  # beta_fast, beta_slow and factor as floats: the real config's integers make transformers warn
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 40.0,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

# Qwen1.5-MoE-A2.7B's config.json, as published.
QWEN15_MOE_A27B_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "max_window_layers": 21,
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.39.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Sized down; everything not listed keeps the real value (vocab, gating, top-k, shared
# experts, biases, rope). llama.cpp treats a q_lora_rank-null DeepSeek-V2 as "Lite" only
# at 26 or 27 layers, so the tiny DeepSeek keeps 26.
DEEPSEEK_TINY_SIZES = {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 48,
    "n_routed_experts": 16, "num_attention_heads": 4, "num_key_value_heads": 4,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32,
    "num_hidden_layers": 26,
}
QWEN_TINY_SIZES = {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 128, "num_experts": 16, "num_attention_heads": 4,
    "num_key_value_heads": 4, "num_hidden_layers": 4, "max_window_layers": 4,
}

# Pre-tokenizer regexes, copied byte for byte from llama.cpp src/llama-vocab.cpp and kept
# as ASCII escapes here so that no editor can normalise the Unicode ranges.
DEEPSEEK_LLM_SPLITS = [
    '[\r\n]',
    '\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+',
    '\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+',
    '\\s+$',
    '[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+',
]
QWEN2_SPLIT = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
               "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

# DeepSeek-V2(-Lite)-Chat's chat template; the deepseek-llm vocab GGUF carries none.
DEEPSEEK_V2_CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 1, 3, 4

# Router variants (make_tiny's router=). "random": every weight as drawn. Such a model routes in a
# concentrated, memoryful way, kinder to expert caches than a trained model (Qwen1.5-MoE widths,
# 3 layers, 512 tokens of English: the top 25% of the experts take 84-96% of the selections,
# consecutive tokens share 40-66% of their experts against 4/60 by chance), and for a reason no
# change of the routers alone undoes: random attention is close to uniform, so an attention output
# is about the mean of the prefix's values (at those widths 8x the embedding already after layer 0,
# cosine 0.6 between consecutive tokens), and every hidden state is dominated by this slowly
# drifting, document-specific average. Scaling a router changes no top-k; rows made orthogonal to
# the mean hidden state of one text route uniformly on that text only, as before on others.
# "uniform", the worst case for every expert cache: attention output projections scaled by
# UNIFORM_ATTN_OUTPUT_SCALE, so a hidden state depends on its own token only and routing becomes
# a random hash of the token (memoryless; as uniform as the token frequencies allow), and each
# router's rows made orthonormal with one common norm, so that no expert wins more often on
# isotropic inputs. Every other weight is the same draw as "random" (routed experts bit-identical,
# so compress the same). bench/prefetch_recall.py measures both; tests/test_tiny.py checks.
ROUTERS = ("random", "uniform")
UNIFORM_ATTN_OUTPUT_SCALE = 1e-3

ARCHITECTURES = {
    "deepseek2": ("ggml-vocab-deepseek-llm.gguf", DEEPSEEK_V2_LITE_CONFIG, DEEPSEEK_TINY_SIZES),
    "qwen2moe": ("ggml-vocab-qwen2.gguf", QWEN15_MOE_A27B_CONFIG, QWEN_TINY_SIZES),
    **FAMILY_ARCHITECTURES,
}


def tiny_config(arch: str) -> dict:
    _, real, sizes = ARCHITECTURES[arch]
    return _merged(real, sizes)


def _merged(config: dict, sizes: dict) -> dict:
    """config with sizes on top; a nested config (text_config, vision_config) takes its own sizes key by key."""
    merged = dict(config)
    for key, value in sizes.items():
        merged[key] = _merged(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def _model_class(hf_config):
    """transformers' class the config names: a checkpoint with a vision tower (Llama4ForConditionalGeneration) is
    an image-text-to-text model, the rest causal language models."""
    import transformers

    if hasattr(hf_config, "text_config") and hasattr(hf_config, "vision_config"):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def _read_vocab_gguf(path: Path) -> dict:
    meta = read_metadata(path)
    return {
        "tokens": meta["tokenizer.ggml.tokens"],
        "types": meta["tokenizer.ggml.token_type"],
        "model": meta["tokenizer.ggml.model"],  # "gpt2" (BPE) or "llama" (SentencePiece)
        "merges": meta.get("tokenizer.ggml.merges", []),
        "scores": meta.get("tokenizer.ggml.scores"),
        "bos": meta.get("tokenizer.ggml.bos_token_id"),
        "eos": meta.get("tokenizer.ggml.eos_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
    }


def _build_tokenizer_json(arch: str, vocab: dict) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    bpe_vocab, added = {}, []
    for i, (tok, ttype) in enumerate(zip(vocab["tokens"], vocab["types"])):
        if ttype == TOKEN_TYPE_NORMAL:
            bpe_vocab[tok] = i
        elif ttype in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED) and not tok.startswith("[PAD"):
            # [PADn] fillers are left out: the converter recreates them from vocab_size
            added.append((i, tok, ttype == TOKEN_TYPE_CONTROL))
    merges = [tuple(m.split(" ", 1)) for m in vocab["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=bpe_vocab, merges=merges, fuse_unk=False, byte_fallback=False))

    if arch == "deepseek2":
        splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in DEEPSEEK_LLM_SPLITS]
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            splits + [pre_tokenizers.Digits(individual_digits=True),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.normalizer = normalizers.Sequence([])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()

    from tokenizers import AddedToken
    for token_id, content, special in sorted(added):
        got = tokenizer.add_tokens([AddedToken(content, special=special, normalized=not special)]) \
            if not special else tokenizer.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        if got != 1 or tokenizer.token_to_id(content) != token_id:
            raise ZipMoEError(f"vocab GGUF: added token {content!r} did not land at id {token_id}")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra_special_tokens(arch)])
    return tokenizer.to_str()  # compact JSON: half the size of the pretty one


def _tokenizer_config(arch: str, vocab: dict) -> dict:
    tokens = vocab["tokens"]
    if arch == "deepseek2":
        bos, eos = tokens[vocab["bos"]], tokens[vocab["eos"]]
        return {
            "add_bos_token": True, "add_eos_token": False,
            "bos_token": bos, "eos_token": eos, "pad_token": eos, "unk_token": None,
            "clean_up_tokenization_spaces": False, "legacy": True, "model_max_length": 16384,
            "sp_model_kwargs": {}, "tokenizer_class": "LlamaTokenizer",
            "chat_template": DEEPSEEK_V2_CHAT_TEMPLATE,
        }
    if vocab["model"] == "llama":
        return {"add_bos_token": True, "add_eos_token": False, "bos_token": tokens[vocab["bos"]],
                "eos_token": tokens[vocab["eos"]], "unk_token": tokens[0], "pad_token": tokens[0],
                "tokenizer_class": "LlamaTokenizer", "model_max_length": 131072}
    eos = tokens[vocab["eos"]]
    return {
        "add_prefix_space": False, "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None, "eos_token": eos, "pad_token": eos, "unk_token": None,
        "clean_up_tokenization_spaces": False, "errors": "replace", "model_max_length": 32768,
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": vocab["chat_template"],
    }


def _uniform_router_weight(name: str, tensor):
    """A weight of the router="uniform" variant, from the one drawn for "random" (float32 in and out;
    see ROUTERS). Tensors other than attention output projections and routers pass unchanged."""
    import torch

    if name.endswith(".self_attn.o_proj.weight"):
        return tensor * UNIFORM_ATTN_OUTPUT_SCALE
    if name.endswith(".mlp.gate.weight"):  # the router (ffn_gate_inp), (n_experts, hidden)
        norm = tensor.norm(dim=1).mean()
        if tensor.shape[0] <= tensor.shape[1]:
            rows = torch.linalg.qr(tensor.t()).Q.t()
        else:  # more experts than dimensions: no orthonormal set, equal norms only
            rows = tensor / tensor.norm(dim=1, keepdim=True)
        return (rows * norm).contiguous()
    return tensor


def _write_streamed_weights(hf_config, out_dir: Path, router: str = "random", mxfp4: bool = False) -> None:
    """A multi-GB checkpoint without holding it in memory: the model is laid out on the meta device
    (names and shapes only), then each layer's tensors are drawn and saved as a shard of their own
    (model-NNNNN.safetensors + model.safetensors.index.json, as sharded HF checkpoints are). Weights
    as transformers initialises them: norms 1, biases 0, the rest N(0, initializer_range)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    groups: dict[str, list[tuple[str, tuple]]] = {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        group = ".".join(parts[:3]) if parts[1:2] == ["layers"] else "rest"
        groups.setdefault(group, []).append((name, tuple(tensor.shape)))
    std = float(getattr(hf_config, "initializer_range", 0.02))
    weight_map, total = {}, 0
    for i, (group, tensors) in enumerate(groups.items()):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        state = {}
        for name, shape in tensors:
            if name.endswith("norm.weight"):
                state[name] = torch.ones(shape, dtype=torch.bfloat16)
            elif name.endswith(".bias"):
                state[name] = torch.zeros(shape, dtype=torch.bfloat16)
            else:
                drawn = torch.randn(shape, dtype=torch.float32) * std
                if router == "uniform":
                    drawn = _uniform_router_weight(name, drawn)
                state[name] = drawn.to(torch.bfloat16)
        if mxfp4:
            state = mxfp4_experts(state)
        for name, tensor in state.items():
            weight_map[name] = shard
            total += tensor.numel() * tensor.element_size()
        save_file(state, str(out_dir / shard), metadata={"format": "pt"})
        (out_dir / shard).chmod(0o644)
        del state
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def make_tiny(arch: str, out_dir: Path, seed: int = 0, std: float | None = None,
              real_widths_layers: int | None = None, sizes: dict | None = None,
              router: str = "random", mxfp4: bool = False) -> Path:
    """Write a tiny HF checkpoint of `arch` into out_dir and return out_dir.

    real_widths_layers: keep the real model's widths and expert counts (multi-GB) and only cut
    the layer count to this (benchmarks; written layer by layer, never whole in memory). sizes: config values to change on top (tests).
    router: "random" (weights as drawn) or "uniform" (near-uniform, memoryless routing; see ROUTERS).
    mxfp4: the experts in MXFP4, as a family published that way stores them (families.Family.mxfp4_checkpoint)."""
    if arch not in ARCHITECTURES:
        raise ZipMoEError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    require_extra("convert", "making a tiny checkpoint")
    if router not in ROUTERS:
        raise ZipMoEError(f"unknown router {router!r}; choose one of {', '.join(ROUTERS)}")
    if mxfp4 and arch not in families.MXFP4_CHECKPOINTS:
        published = ", ".join(families.MXFP4_CHECKPOINTS)
        raise ZipMoEError(f"--mxfp4: {arch} is not published with MXFP4 experts (only {published})")
    vocab_file, _, _ = ARCHITECTURES[arch]
    vocab_path = _paths.vendored_vocab(vocab_file)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    config = tiny_config(arch)
    if real_widths_layers is not None and "text_config" in config:
        raise ZipMoEError(f"{arch}: a checkpoint with a vision tower is made tiny only (no real widths)")
    if real_widths_layers is not None:
        config = dict(ARCHITECTURES[arch][1])
        config["num_hidden_layers"] = real_widths_layers
        if "max_window_layers" in config:
            config["max_window_layers"] = real_widths_layers
        if "layer_types" in config:  # the real pattern, cut or repeated to the layer count
            config["layer_types"] = (config["layer_types"] * real_widths_layers)[:real_widths_layers]
        if arch == "deepseek2" and real_widths_layers not in (26, 27):
            config["q_lora_rank"] = 1536  # llama.cpp treats q_lora_rank-less models as "Lite" only at 26/27 layers
    if sizes:
        config = _merged(config, sizes)
    if std is not None:
        config["initializer_range"] = std
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    vocab = _read_vocab_gguf(vocab_path)
    if vocab["model"] == "llama":
        (out_dir / "tokenizer.model").write_bytes(sentencepiece_model(vocab["tokens"], vocab["scores"], vocab["types"]))
    else:
        (out_dir / "tokenizer.json").write_text(_build_tokenizer_json(arch, vocab))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(arch, vocab), indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "do_sample": False, "transformers_version": "4.57.6"}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    torch.manual_seed(seed)
    hf_config = AutoConfig.from_pretrained(out_dir, trust_remote_code=False)
    if real_widths_layers is not None:
        _write_streamed_weights(hf_config, out_dir, router, mxfp4)
        return _mark_mxfp4(out_dir, config) if mxfp4 else out_dir
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in BF16: no F32 copy of a multi-GB model
    try:
        model = _model_class(hf_config).from_config(hf_config).to(torch.bfloat16)
    finally:
        torch.set_default_dtype(default_dtype)
    state = randomized_buffers(_untied(model.state_dict()), torch.Generator().manual_seed(seed))
    if router == "uniform":
        state = {k: _uniform_router_weight(k, v.float()).to(torch.bfloat16) for k, v in state.items()}
    weights = out_dir / "model.safetensors"
    save_file(mxfp4_experts(state) if mxfp4 else state, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it owner-only; the rest of the checkpoint is world-readable
    return _mark_mxfp4(out_dir, config) if mxfp4 else out_dir


def _untied(state: dict) -> dict:
    """The state to save: a tied weight (tie_word_embeddings: lm_head is the embedding) once, under its first
    name, as transformers saves it."""
    kept, seen = {}, set()
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            kept[name] = tensor.detach().contiguous()
    return kept


def _mark_mxfp4(out_dir: Path, config: dict) -> Path:
    """config.json says the experts are MXFP4 (written after the model is made: transformers' from_config
    would otherwise lay out quantized experts)."""
    (out_dir / "config.json").write_text(json.dumps({**config, "quantization_config": GPT_OSS_MXFP4_CONFIG}, indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="zipmoe-make-tiny",
        description="Write a small Hugging Face checkpoint (config.json with the real model's keys, "
                    "BF16 safetensors, real tokenizer) in a ZipMoE target architecture.")
    ap.add_argument("arch", choices=sorted(ARCHITECTURES),
                    help="; ".join(f"{f.tiny}: {f.name} ({f.hf_architecture})" for f in families.FAMILIES))
    ap.add_argument("out_dir", type=Path, help="folder to write the checkpoint into (created if missing)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: %(default)s)")
    ap.add_argument("--std", type=float, default=None,
                    help="standard deviation of the random weights (default: the config's initializer_range, 0.02)")
    ap.add_argument("--router", choices=ROUTERS, default="random",
                    help="random: weights as drawn (concentrated, memoryful routing); uniform: near-uniform, "
                         "memoryless routing, the worst case for expert caches (default: %(default)s)")
    ap.add_argument("--mxfp4", action="store_true",
                    help="the experts in MXFP4 blocks and scales, as the published checkpoints of " +
                         ", ".join(families.MXFP4_CHECKPOINTS) + " store them")
    args = ap.parse_args(argv)
    try:
        out = make_tiny(args.arch, args.out_dir, seed=args.seed, std=args.std, router=args.router, mxfp4=args.mxfp4)
    except ZipMoEError as e:
        print(f"zipmoe-make-tiny: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.arch} checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
