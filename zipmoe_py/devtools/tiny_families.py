"""The configs of zipmoe-make-tiny's newer families: each published model's config.json keys that shape it
(widths, experts, gating, dense layers, attention), as released, then sized down. transformers' own
config class fills any key left out with its default. They take the Qwen2 tokenizer (the vocab GGUF the
pinned llama.cpp ships): the converter reads any BPE tokenizer for them, and the tokenizer plays no part
in how experts are served. ERNIE-4.5's converter reads only a SentencePiece model: it takes the Llama
SentencePiece vocab GGUF, written as a tokenizer.model (sentencepiece_model).

The tiny sizes keep what the serving path branches on: more experts than top-k, top-k > 1 and 1 (Llama 4),
expert groups (DeepSeek-V3), dense leading layers (DeepSeek-V3, GLM-4.5) or every other layer dense (Llama
4), shared experts, normalised or plain top-k weights, sigmoid gating with a correction bias, expert biases
(gpt-oss), widths that every 32-value block type divides, and a published checkpoint's nesting (Llama 4's
text_config beside its vision tower).
"""
from __future__ import annotations

QWEN2_IDS = {"bos_token_id": 151643, "eos_token_id": 151645, "vocab_size": 151936}
COMMON_TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
               "moe_intermediate_size": 64, "max_position_embeddings": 4096}

QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "attention_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", **QWEN2_IDS,
}
MIXTRAL_8X7B_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", **QWEN2_IDS,
}
OLMOE_1B_7B_CONFIG = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
    "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
    "clip_qkv": None, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **QWEN2_IDS,
}
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "rms_norm_eps": 1e-06, "rope_theta": 10000, "max_position_embeddings": 163840,
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **QWEN2_IDS,
}
GPT_OSS_20B_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_act": "silu",
    "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
    "experts_per_token": 4, "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "attention_bias": True, "swiglu_limit": 7.0, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **QWEN2_IDS,
}
GLM45_AIR_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
    "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True, "use_qk_norm": False,
    "attention_bias": True, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_theta": 1000000,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **QWEN2_IDS,
}
LLAMA4_MAVERICK_TEXT_CONFIG = {
    "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_act": "silu",
    "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 128,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "attention_chunk_size": 8192, "use_qk_norm": False,
    "attention_bias": False, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "rope_scaling": None,
    "max_position_embeddings": 1048576, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **QWEN2_IDS,
}
# Llama 4 as Meta published it (Scout): the text model in text_config beside a vision tower; the converter writes
# the text model's GGUF and leaves the vision tower to an mmproj file, which ZipMoE does not touch
LLAMA4_SCOUT_CONFIG = {
    "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "llama4_text", "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
        "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
        "attention_chunk_size": 8192, "use_qk_norm": True, "attention_bias": False, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
        "max_position_embeddings": 10485760, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **QWEN2_IDS},
    "vision_config": {
        "model_type": "llama4_vision_model", "hidden_size": 1408, "num_hidden_layers": 34, "num_attention_heads": 16,
        "intermediate_size": 5632, "vision_output_dim": 4096, "image_size": 336, "patch_size": 14,
        "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096, "projector_output_dim": 4096, "norm_eps": 1e-05},
    "torch_dtype": "bfloat16", **QWEN2_IDS,
}
ERNIE_45_21B_A3B_CONFIG = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "hidden_act": "silu",
    "hidden_size": 2560, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 28,
    "num_attention_heads": 20, "num_key_value_heads": 4, "moe_num_experts": 64, "moe_num_shared_experts": 2,
    "moe_k": 6, "moe_layer_start_index": 1, "moe_layer_end_index": 27, "moe_layer_interval": 1,
    "moe_norm_min": 1e-12, "use_bias": False, "rms_norm_eps": 1e-05, "rope_theta": 500000,
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "vocab_size": 32000,
}
GRANITE_3_MOE_3B_CONFIG = {
    "architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", "hidden_act": "silu",
    "hidden_size": 1536, "intermediate_size": 512, "num_hidden_layers": 32, "num_attention_heads": 24,
    "num_key_value_heads": 8, "num_local_experts": 40, "num_experts_per_tok": 8, "attention_multiplier": 0.015625,
    "embedding_multiplier": 12.0, "logits_scaling": 6.0, "residual_multiplier": 0.22, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "max_position_embeddings": 4096, "attention_bias": False, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", **QWEN2_IDS,
}

QWEN3_TINY_SIZES = {**COMMON_TINY, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4,
                    "num_hidden_layers": 3}
MIXTRAL_TINY_SIZES = {**COMMON_TINY, "num_local_experts": 8, "num_hidden_layers": 2,
                      "intermediate_size": 64}
OLMOE_TINY_SIZES = {**COMMON_TINY, "num_key_value_heads": 4, "num_experts": 16, "num_experts_per_tok": 4,
                    "num_hidden_layers": 2, "intermediate_size": 64}
DEEPSEEK_V3_TINY_SIZES = {**COMMON_TINY, "num_key_value_heads": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
                          "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3,
                          "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                          "v_head_dim": 16}
# the next-token (MTP) layer left out: transformers' class does not make it
GLM45_TINY_SIZES = {**COMMON_TINY, "head_dim": 16, "n_routed_experts": 16, "num_experts_per_tok": 4,
                    "num_hidden_layers": 3, "num_nextn_predict_layers": 0}

GPT_OSS_TINY_SIZES = {**COMMON_TINY, "head_dim": 16, "num_local_experts": 16, "num_experts_per_tok": 4,
                      "experts_per_token": 4, "intermediate_size": 64, "num_hidden_layers": 2,
                      "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
                      "max_position_embeddings": 131072}  # YaRN's factor 32 over 4096
# every other layer dense (interleave_moe_layer_step 2), one expert a token, as Maverick
LLAMA4_TINY_SIZES = {**COMMON_TINY, "head_dim": 16, "num_local_experts": 16, "intermediate_size": 64,
                     "intermediate_size_mlp": 128, "num_hidden_layers": 4}
# a checkpoint with a text_config takes its sizes there (tiny.tiny_config merges them); every layer MoE, as Scout;
# 4 layers, as for Llama 4's text model: the fourth is its first without RoPE, whose attention-temperature input
# llama.cpp sets (and asserts is allocated) for every model
LLAMA4_VL_TINY_SIZES = {
    "text_config": LLAMA4_TINY_SIZES,
    "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                      "vision_output_dim": 64, "image_size": 28, "patch_size": 14, "projector_input_dim": 64,
                      "projector_output_dim": 64},
}
GRANITE_TINY_SIZES = {**COMMON_TINY, "num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 64,
                      "num_hidden_layers": 2}
# layer 0 dense; the converter sizes the shared experts as intermediate_size / num_key_value_heads, which is
# moe_intermediate_size x moe_num_shared_experts in the published config, and so here
ERNIE_TINY_SIZES = {**COMMON_TINY, "intermediate_size": 256, "moe_num_experts": 16, "moe_k": 4,
                    "num_hidden_layers": 3, "moe_layer_end_index": 2}

# GLM-4.5's converter sets its special tokens from these (they follow the Qwen2 vocab's own)
GLM_SPECIAL_TOKENS = ["[gMASK]", "<|user|>", "<|observation|>"]

QWEN2_VOCAB = "ggml-vocab-qwen2.gguf"
LLAMA_SPM_VOCAB = "ggml-vocab-llama-spm.gguf"
FAMILY_ARCHITECTURES = {
    "qwen3moe": (QWEN2_VOCAB, QWEN3_30B_A3B_CONFIG, QWEN3_TINY_SIZES),
    "mixtral": (QWEN2_VOCAB, MIXTRAL_8X7B_CONFIG, MIXTRAL_TINY_SIZES),
    "olmoe": (QWEN2_VOCAB, OLMOE_1B_7B_CONFIG, OLMOE_TINY_SIZES),
    "deepseek3": (QWEN2_VOCAB, DEEPSEEK_V3_CONFIG, DEEPSEEK_V3_TINY_SIZES),
    "glm4moe": (QWEN2_VOCAB, GLM45_AIR_CONFIG, GLM45_TINY_SIZES),
    "gptoss": (QWEN2_VOCAB, GPT_OSS_20B_CONFIG, GPT_OSS_TINY_SIZES),
    "llama4": (QWEN2_VOCAB, LLAMA4_MAVERICK_TEXT_CONFIG, LLAMA4_TINY_SIZES),
    "llama4vl": (QWEN2_VOCAB, LLAMA4_SCOUT_CONFIG, LLAMA4_VL_TINY_SIZES),
    "granitemoe": (QWEN2_VOCAB, GRANITE_3_MOE_3B_CONFIG, GRANITE_TINY_SIZES),
    "ernie45moe": (LLAMA_SPM_VOCAB, ERNIE_45_21B_A3B_CONFIG, ERNIE_TINY_SIZES),
}


def extra_special_tokens(arch: str) -> list[str]:
    return GLM_SPECIAL_TOKENS if arch == "glm4moe" else []


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # a length-delimited protobuf field
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def sentencepiece_model(tokens: list[str], scores: list[float], types: list[int]) -> bytes:
    """A SentencePiece ModelProto (sentencepiece_model.proto) of a GGUF's SentencePiece vocab: the pieces with
    their scores and types (GGUF's token types are SentencePiece's), a BPE model with byte fallback, and
    Llama's normalizer (identity, a dummy prefix). Written by hand: the protobuf runtime that
    sentencepiece_model_pb2 needs is not a dependency."""
    import struct

    pieces = b"".join(_field(1, _field(1, t.encode()) + b"\x15" + struct.pack("<f", s) + b"\x18" + _varint(k))
                      for t, s, k in zip(tokens, scores, types))
    trainer = b"\x18" + _varint(2) + b"\x20" + _varint(len(tokens)) + _varint(35 << 3) + _varint(1)
    normalizer = _field(1, b"identity") + b"\x18\x01\x20\x00\x28\x01"
    return pieces + _field(2, trainer) + _field(3, normalizer)


# what transformers initialises to zeros and a tiny model draws: gating biases (DeepSeek-V3's and GLM-4.5's
# e_score_correction_bias), so that they take part in the choice of experts, and gpt-oss's expert biases,
# so that a bias added for the wrong expert shows in the logits
DRAWN_BIASES = {"e_score_correction_bias": 0.1, "mlp.experts.gate_up_proj_bias": 0.02,
                "mlp.experts.down_proj_bias": 0.02}


def randomized_buffers(state: dict, generator) -> dict:
    """state with the tensors DRAWN_BIASES names drawn (normal, its standard deviation)."""
    import torch

    for name, tensor in state.items():
        std = next((s for suffix, s in DRAWN_BIASES.items() if name.endswith(suffix)), None)
        if std is not None:
            state[name] = (torch.randn(tensor.shape, generator=generator) * std).to(tensor.dtype)
    return state


# gpt-oss as OpenAI published it: routed experts in MXFP4 (transformers' layout: per expert and output row,
# blocks of 32 values, each a byte of two E2M1 codes, low nibble first, and an E8M0 scale), the rest BF16
GPT_OSS_MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _to_mxfp4(rows):
    """rows [R, C] (C a multiple of 32) -> (blocks [R, C/32, 16] uint8, scales [R, C/32] uint8): each block's
    scale the power of two that brings its largest magnitude to at most 6, each value rounded to the nearest
    E2M1 code."""
    import torch

    x = rows.float().reshape(rows.shape[0], -1, 32)
    amax = x.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127)).clamp(-127, 127)
    q = x / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    code = (q.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1) + 8 * (q < 0)
    code = code.to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def mxfp4_experts(state: dict) -> dict:
    """state with gpt-oss's expert weights (mlp.experts.gate_up_proj [E, H, 2I], down_proj [E, I, H]) as the
    published checkpoints hold them: NAME_blocks [E, out, in/32, 16] and NAME_scales [E, out, in/32]."""
    import torch

    out = {}
    for name, tensor in state.items():
        if not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            out[name] = tensor
            continue
        pairs = [_to_mxfp4(expert.t()) for expert in tensor]  # one expert at a time: [out, in]
        out[name + "_blocks"] = torch.stack([b for b, _ in pairs])
        out[name + "_scales"] = torch.stack([s for _, s in pairs])
    return out
