"""Quantized MoE GGUFs: their routed experts stored raw in a ZipMoE GGUF (format version 3) and served by
the same expert cache, bit-identical to stock llama.cpp on the same quantized GGUF.

The models are the tiny DeepSeek-V2 and Qwen2-MoE at widths K-quants can hold (256: a whole super-block
per row), quantized here with the fork's own llama-quantize to Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_NL,
IQ4_XS and Q4_K_M (Q4_K and Q6_K experts by layer). On x86 CPUs with AVX2, stock llama.cpp puts Q4_0,
Q4_K and IQ4_NL experts in ggml-cpu's repacking buffer type (CPU_REPACK), whose kernels
round differently from the plain ones (measured: 4 to 5 of 12 positions differ for Q4_0 and Q4_K); the
slots then take the same buffer type and each expert is set through it, so the same kernels run on the
same layout. The products' rows are each pass's own (other passes' selections are skipped), so no
kernel sees another row count than stock's.
"""
from __future__ import annotations

import numpy as np
import pytest

from zipmoe_py import ZipMoEError
from zipmoe_py import format as zformat

from conftest import run, zipmoe_command
from test_serve import PROMPTS, assert_same_trace, load, logits_trace, served_trace

# widths every ggml type's blocks divide (K-quants: 256); few layers (DeepSeek-V2 with a q_lora_rank:
# llama.cpp's "Lite" path needs 26)
QUANT_SIZES = {
    "qwen2moe": {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512,
                 "shared_expert_intermediate_size": 512, "num_hidden_layers": 2, "max_window_layers": 2,
                 "num_experts": 8},
    "deepseek2": {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512,
                  "num_hidden_layers": 3, "n_routed_experts": 8, "q_lora_rank": 64},
}
# llama-quantize's file types and the expert types they give (Q4_K_M: Q6_K in some layers' down experts)
TYPES = {"Q8_0": {"Q8_0"}, "Q4_0": {"Q4_0"}, "Q4_K_S": {"Q4_K"}, "Q5_K_S": {"Q5_K"}, "Q6_K": {"Q6_K"},
         "IQ4_NL": {"IQ4_NL"}, "IQ4_XS": {"IQ4_XS"}, "Q4_K_M": {"Q4_K", "Q6_K"}}
# each type on one model, and on both the types that ggml-cpu repacks (Q4_0, Q4_K, IQ4_NL: their own
# buffer type and kernels) and Q4_K_M (two types of experts): the raw path copies blocks whatever their
# type, and all 16 pairs took 164 s of the suite (2026-12-01)
TYPES_SERVED = [(arch, qtype) for qtype in ("Q4_0", "IQ4_NL", "Q4_K_M") for arch in ("deepseek2", "qwen2moe")] + [
    ("deepseek2", "Q8_0"), ("deepseek2", "Q5_K_S"), ("deepseek2", "IQ4_XS"), ("qwen2moe", "Q4_K_S"),
    ("qwen2moe", "Q6_K")]
TOP_K = {"qwen2moe": 4, "deepseek2": 6}
N_DECODE = 8


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory):
    """(arch, type) -> (stock quantized GGUF, its ZipMoE GGUF), made on first use."""
    folder = tmp_path_factory.mktemp("quant")
    bf16, made = {}, {}

    def get(arch: str, qtype: str):
        if arch not in bf16:
            from zipmoe_py.devtools.tiny import make_tiny

            hf = make_tiny(arch, folder / f"hf-{arch}", seed=7, sizes=QUANT_SIZES[arch])
            bf16[arch] = folder / f"{arch}-bf16.gguf"
            proc = run([zipmoe_command("zipmoe-convert"), hf, "-o", bf16[arch], "--bf16", "--quiet"])
            assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        if (arch, qtype) not in made:
            stock = folder / f"{arch}-{qtype}.gguf"
            proc = run([zipmoe_command("llama-quantize"), bf16[arch], stock, qtype])
            assert proc.returncode == 0, proc.stdout.decode()[-2000:] + proc.stderr.decode()[-2000:]
            zipmoe = folder / f"{arch}-{qtype}.zipmoe.gguf"
            proc = run([zipmoe_command("zipmoe-convert"), stock, "-o", zipmoe])
            assert proc.returncode == 0, proc.stderr.decode()[-2000:]
            made[arch, qtype] = stock, zipmoe
        return made[arch, qtype]

    return get


def expert_types(path) -> set[str]:
    with zformat.ZipMoEFile(path) as zf:
        from zipmoe_py import gguf_file

        return {gguf_file.ggml_type_name(zf.type(t)) for t in zf.tensors}


def budget(path, arch: str, name: str) -> int:
    with zformat.ZipMoEFile(path) as zf:
        sizes = zf.expert_bytes()
    return {"top-k": TOP_K[arch] * sizes.one_expert, "everything": sizes.all_experts}[name]


def assert_same_logits(stock, zipmoe, arch: str, budget_name: str, threads: int, n_seq: int = 4) -> dict:
    llm = load(stock, threads)
    try:
        want, want_tokens = logits_trace(llm, PROMPTS[:n_seq], N_DECODE, threads)
    finally:
        llm.close()
    got, got_tokens, stats = served_trace(zipmoe, budget(zipmoe, arch, budget_name), PROMPTS[:n_seq], N_DECODE, threads)
    assert_same_trace(got, got_tokens, want, want_tokens, f"stock llama.cpp on {stock.name}")
    assert stats["expert_misses"] > 0 and stats["bytes_read"] > 0
    return stats


def test_every_type_is_served_on_one_model_at_least():
    assert sorted({qtype for _, qtype in TYPES_SERVED}) == sorted(TYPES)


@pytest.mark.parametrize("arch, qtype", TYPES_SERVED)
def test_quantized_experts_are_bit_identical_to_stock_on_the_same_file(arch, qtype, quant_models):
    """Four sequences decoded together, at a budget of one token's experts per layer: the prefill
    takes several passes per layer and every decode step misses."""
    stock, zipmoe = quant_models(arch, qtype)
    assert expert_types(zipmoe) == TYPES[qtype]
    stats = assert_same_logits(stock, zipmoe, arch, "top-k", threads=2)
    assert stats["fetch_calls"] > stats["expert_misses"] / TOP_K[arch]  # several passes ran
    assert stats["memory"]["pools"] == {"F": 0, "C": 0, "S": 0, "E": 0}
    assert "stored raw" in stats["memory"]["pools_why"]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K_M"])
def test_one_sequence_one_thread_and_every_expert_resident_stay_bit_identical(arch, qtype, quant_models):
    stock, zipmoe = quant_models(arch, qtype)
    assert_same_logits(stock, zipmoe, arch, "top-k", threads=1, n_seq=1)
    assert_same_logits(stock, zipmoe, arch, "everything", threads=2, n_seq=4)


def test_zipmoe_verify_holds_a_quantized_file_to_its_source_and_profile_has_no_pools_to_plan(quant_models, tmp_path):
    stock, zipmoe = quant_models("deepseek2", "Q4_K_M")
    proc = run([zipmoe_command("zipmoe-verify"), zipmoe, "--against", stock])
    assert proc.returncode == 0 and b"identical to" in proc.stdout, proc.stderr.decode()
    other, _ = quant_models("deepseek2", "Q4_K_S")
    proc = run([zipmoe_command("zipmoe-verify"), zipmoe, "--against", other, "-q"])
    # another quantization of the same model: Q4_K_S has Q4_K where Q4_K_M has Q6_K
    assert proc.returncode == 1 and b"has no Q6_K tensor blk.2.ffn_down_exps.weight" in proc.stderr, proc.stderr.decode()
    (tmp_path / "prompts.txt").write_text("Hello\n")
    proc = run([zipmoe_command("zipmoe-profile"), zipmoe, "--prompts", tmp_path / "prompts.txt", "-o",
                tmp_path / "p.json"])
    assert proc.returncode != 0 and b"stored raw (Q4_K, Q6_K: nothing to decompress), so there are no pools to plan" \
        in proc.stderr, proc.stderr.decode()


def test_repacked_types_take_stocks_buffer_type_and_the_others_the_plain_one(quant_models, tmp_path):
    """Where stock llama.cpp repacks the experts (Q4_0 on an AVX2 CPU, as every machine here has), the
    slots are in its CPU_REPACK buffer; Q6_K, which this CPU does not repack, stays plain. With
    --no-repack stock keeps them plain, and so does ZipMoE: the greedy text stays stock's."""
    for qtype, repacked in (("Q4_0", True), ("Q6_K", False)):
        stock, zipmoe = quant_models("qwen2moe", qtype)
        outputs = []
        for path, extra in ((stock, []), (zipmoe, []), (stock, ["--no-repack"]), (zipmoe, ["--no-repack"])):
            proc = run([zipmoe_command("llama-completion"), "-m", path, "-p", PROMPTS[0], "-n", 12, "--temp", 0,
                        "-t", 2, "-no-cnv", "--no-warmup", "-c", 256, "-v", *extra])
            assert proc.returncode == 0, proc.stderr.decode()[-3000:]
            outputs.append(proc.stdout)
            if path == zipmoe:
                laid_out = b"laid out for CPU_REPACK" in proc.stderr
                assert laid_out == (repacked and not extra), proc.stderr.decode()[-3000:]
        assert outputs[0] == outputs[1] and outputs[2] == outputs[3]


def test_compressed_pools_are_refused_for_raw_experts(quant_models):
    _, zipmoe = quant_models("qwen2moe", "Q8_0")
    with pytest.raises(ZipMoEError, match="not BF16 .*stored raw, nothing to decompress.*pools C, S and E do not apply"):
        load(zipmoe, zipmoe_pools="F=2,C=2")


def test_a_quantized_zipmoe_gguf_reads_fewer_bytes_per_token_than_its_bf16(quant_models):
    """The point of it: a Q4_K expert is 4.5 bits a value, against the split BF16's ~10.6 (its sign
    and mantissa byte plus the compressed exponent)."""
    _, zipmoe = quant_models("qwen2moe", "Q4_K_S")
    with zformat.ZipMoEFile(zipmoe) as zf:
        sizes = zf.expert_bytes()
        shape = zf.shape(zf.tensors[0])
    assert sizes.by_kind["gate"] == shape[0] // 256 * 144 * shape[1]  # Q4_K: 144 bytes per 256 values
    values = np.prod(shape[:2])
    assert sizes.by_kind["gate"] * 8 / values == 4.5
