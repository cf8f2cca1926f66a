"""The Mixture-of-Experts families ZipMoE serves, in one table: zipmoe-convert's check of a Hugging Face
checkpoint and its --help, the README's table and the suite's exactness matrix (tests/test_families.py)
all derive from FAMILIES.

A family is served when llama.cpp computes its routed experts through build_moe_ffn with one gate, up
and down tensor per layer and nothing else per expert: ZipMoE's expert slots then stand in for those
three tensors (their biases, indexed by expert, stay ordinary tensors). Per-expert scales and a merged
gate_up tensor are not served yet: UNSERVED_EXPERT_TENSORS names them, and a file that holds one is
refused at conversion, before anything is written, as the loader would refuse it
(llama_zipmoe::check_model).
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    hf_architecture: str    # config.json's "architectures"
    gguf_architecture: str  # general.architecture of the GGUF llama.cpp's converter writes
    name: str               # what users call it
    tiny: str               # the tiny model of it the suite makes (zipmoe-make-tiny ARCH)
    quantized: str = "Q4_0"    # the llama-quantize type its exactness matrix checks beside BF16
    whole_suite: bool = False  # in every test of the suite, and benchmarked at its real geometry
    mxfp4_checkpoint: bool = False  # published with MXFP4 experts (zipmoe-make-tiny --mxfp4 makes one)

    @property
    def verified(self) -> str:
        if self.whole_suite:
            return "bit-exact in the whole suite; benchmarked at its real geometry"
        # budgets top-k, half and all, 1 and 4 sequences
        checkpoint = "; its MXFP4 checkpoints too" if self.mxfp4_checkpoint else ""
        return f"bit-exact in tests/test_families.py, BF16 and {self.quantized}{checkpoint}"


# llama.cpp GGUF tensor names (src/llama-arch.cpp) of what the expert slots do not hold
UNSERVED_EXPERT_TENSORS = re.compile(r"blk\.\d+\.(ffn_gate_up_exps\.(weight|bias)|ffn_(gate|up|down)_exps\.scale)")
UNSERVED_REASON = "routed experts with per-expert scales or a merged gate_up tensor, which ZipMoE's expert slots do not serve"

FAMILIES = (
    Family("DeepseekV2ForCausalLM", "deepseek2", "DeepSeek-V2, DeepSeek-V2-Lite", "deepseek2", whole_suite=True),
    Family("DeepseekV3ForCausalLM", "deepseek2", "DeepSeek-V3, R1", "deepseek3"),
    Family("Qwen2MoeForCausalLM", "qwen2moe", "Qwen1.5-MoE, Qwen2-MoE", "qwen2moe", whole_suite=True),
    Family("Qwen3MoeForCausalLM", "qwen3moe", "Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B)", "qwen3moe"),
    Family("MixtralForCausalLM", "llama", "Mixtral 8x7B, 8x22B", "mixtral"),
    Family("OlmoeForCausalLM", "olmoe", "OLMoE", "olmoe"),
    Family("Glm4MoeForCausalLM", "glm4moe", "GLM-4.5, GLM-4.5-Air", "glm4moe"),
    Family("Llama4ForCausalLM", "llama4", "Llama 4 Scout, Maverick (text)", "llama4"),
    Family("Llama4ForConditionalGeneration", "llama4", "Llama 4 Scout, Maverick (as published; vision left out)",
           "llama4vl"),
    Family("GraniteMoeForCausalLM", "granitemoe", "Granite 3.0 / 3.1 MoE (1b-a400m, 3b-a800m)", "granitemoe"),
    Family("Ernie4_5_MoeForCausalLM", "ernie4_5-moe", "ERNIE-4.5 MoE (21B-A3B, 300B-A47B; text)", "ernie45moe"),
    Family("GptOssForCausalLM", "gpt-oss", "gpt-oss-20b, -120b (expert biases)", "gptoss", "MXFP4_MOE",
           mxfp4_checkpoint=True),
)
BY_HF_ARCHITECTURE = {f.hf_architecture: f for f in FAMILIES}
MXFP4_CHECKPOINTS = tuple(f.tiny for f in FAMILIES if f.mxfp4_checkpoint)  # zipmoe-make-tiny --mxfp4 makes these


def described() -> str:
    """The families in a line, for errors and --help."""
    return "; ".join(f"{f.name} ({f.hf_architecture})" for f in FAMILIES)


def unserved_tensors(names) -> list[str]:
    """The tensors among names that the expert slots do not serve."""
    return [n for n in names if UNSERVED_EXPERT_TENSORS.fullmatch(n)]


def unserved_message(tensors: list[str]) -> str:
    more = f" and {len(tensors) - 1} more" if len(tensors) > 1 else ""
    return f"tensor {tensors[0]}{more}: {UNSERVED_REASON}"


def markdown_table() -> str:
    """The README's table of families."""
    rows = ["| family | Hugging Face architecture | GGUF architecture | verified |", "| --- | --- | --- | --- |"]
    for f in FAMILIES:
        rows.append(f"| {f.name} | `{f.hf_architecture}` | `{f.gguf_architecture}` | {f.verified} |")
    return "\n".join(rows) + "\n"
