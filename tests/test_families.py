"""Every family of zipmoe_py/families.py that is served, from a tiny checkpoint made with transformers' own
classes through zipmoe-convert (llama.cpp's converter, then the repack): every logit as raw bits equal to
stock llama.cpp on the plain GGUF, at budgets top-k, half and all, with 1 and 4 sequences, in BF16 and in
the family's quantized type (Q4_0, a type ggml-cpu repacks on x86; MXFP4 for gpt-oss). DeepSeek-V2 and
Qwen2-MoE have the full matrix in test_serve.py and the files beside it. Experts the slots do not serve
are refused at conversion, before anything is written.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from zipmoe_py import ZipMoEError, families
from zipmoe_py import format as zformat
from zipmoe_py.gguf_file import read_header, read_metadata

from conftest import EARLY, early_result, run, start_early, zipmoe_command
from test_serve import PROMPTS, assert_same_trace, expert_geometry, load, logits_trace

NEWER = [f for f in families.FAMILIES if not f.whole_suite]
PUBLISHED_MXFP4 = [f for f in NEWER if f.mxfp4_checkpoint]
N_DECODE = 8  # every budget still misses, and top-k runs several passes
MXFP4 = 39     # ggml_type


def top_k(path) -> int:
    meta = read_metadata(path)
    return int(meta[f"{meta['general.architecture']}.expert_used_count"])


def budgets(path) -> dict:
    one, _, everything = expert_geometry(path)
    return {"top-k": top_k(path) * one, "half": everything // 2, "all": everything}


def smallest_budget(path) -> dict:
    """The smallest budget there is, one expert: a single slot, which for a type ggml-cpu repacks (Q4_0 on
    x86) needs a second one the kernels can take as 3-D."""
    return {"one expert": expert_geometry(path)[0]}


def _make_models(folder: Path):
    """conftest.EARLY's start: every family's checkpoint (tests/conftest.py's seed), its BF16 GGUF and ZipMoE
    GGUF, and its quantized GGUF and ZipMoE GGUF, made on the core the files before this one leave idle."""
    convert = zipmoe_command("zipmoe-convert")
    commands = []
    for f in NEWER:
        hf, bf16, quant = folder / f"hf-{f.tiny}", folder / f"{f.tiny}-bf16.gguf", folder / f"{f.tiny}-{f.quantized}.gguf"
        commands += [[zipmoe_command("zipmoe-make-tiny"), f.tiny, hf, "--seed", "1234"],
                     [convert, hf, "-o", bf16, "--bf16", "--quiet"],
                     [convert, bf16, "-o", folder / f"{f.tiny}.zipmoe.gguf", "--quiet"],
                     [zipmoe_command("llama-quantize"), bf16, quant, f.quantized],
                     [convert, quant, "-o", folder / f"{f.tiny}-{f.quantized}.zipmoe.gguf", "--quiet"]]
    for f in PUBLISHED_MXFP4:  # the checkpoint as published: the converter's GGUF, and ZipMoE's straight from it
        hf = folder / f"hf-{f.tiny}-mxfp4"
        commands += [[zipmoe_command("zipmoe-make-tiny"), f.tiny, hf, "--seed", "1234", "--mxfp4"],
                     [convert, hf, "-o", folder / f"{f.tiny}-mxfp4-checkpoint.gguf", "--bf16", "--quiet"],
                     [convert, hf, "-o", folder / f"{f.tiny}-mxfp4-checkpoint.zipmoe.gguf", "--quiet"]]
    return start_early(folder, ["sh", "-c", " && ".join(shlex.join(map(str, c)) for c in commands)], cwd=folder)


EARLY["test_families.py"] = _make_models


@pytest.fixture(scope="module")
def made() -> Path:
    """The folder of every family's models (_make_models)."""
    code, stdout, stderr, folder = early_result("test_families.py", timeout=1800)
    assert code == 0, stdout.decode(errors="replace")[-2000:] + stderr.decode(errors="replace")[-3000:]
    return folder


def models(made: Path, family: families.Family, quant: str) -> tuple[Path, Path]:
    """(stock GGUF, its ZipMoE GGUF) of a family, in BF16 or its quantized type."""
    name = family.tiny if quant == "BF16" else f"{family.tiny}-{family.quantized}"
    return made / (f"{name}-bf16.gguf" if quant == "BF16" else f"{name}.gguf"), made / f"{name}.zipmoe.gguf"


@pytest.mark.parametrize("quant", ["BF16", "quantized"])
@pytest.mark.parametrize("family", NEWER, ids=lambda f: f.tiny)
def test_each_family_is_bit_identical_to_stock_at_every_budget(family, quant, made):
    stock, packed = models(made, family, quant)
    assert read_metadata(stock)["general.architecture"] == family.gguf_architecture
    assert_bit_identical_at_every_budget(stock, packed, smallest_budget(packed) if quant != "BF16" else {})


@pytest.mark.parametrize("family", PUBLISHED_MXFP4, ids=lambda f: f.tiny)
def test_a_published_mxfp4_checkpoint_converts_and_is_bit_identical(family, made):
    """zipmoe-convert takes the Hugging Face folder as the family is published, its experts in MXFP4 blocks and
    scales: the ZipMoE GGUF it writes straight from it serves logits bit-identical to the converter's GGUF."""
    stock, packed = made / f"{family.tiny}-mxfp4-checkpoint.gguf", made / f"{family.tiny}-mxfp4-checkpoint.zipmoe.gguf"
    experts = [t for t in read_header(stock).tensors if t.name.endswith("_exps.weight")]
    assert experts and {t.type for t in experts} == {MXFP4}, [(t.name, t.type) for t in experts]
    assert_bit_identical_at_every_budget(stock, packed, smallest_budget(packed))


def assert_bit_identical_at_every_budget(stock: Path, packed: Path, more_budgets: dict) -> None:
    """Every logit of prompts and N_DECODE steps, 1 and 4 sequences, as raw bits: packed at budgets top-k, half,
    all and more_budgets against stock, each budget missing."""
    for n_seq in (1, 4):
        reference = load(stock)
        try:
            want, want_tokens = logits_trace(reference, PROMPTS[:n_seq], N_DECODE)
        finally:
            reference.close()
        for name, budget in {**budgets(packed), **more_budgets}.items():
            llm = load(packed, zipmoe_budget=budget)
            try:
                got, got_tokens = logits_trace(llm, PROMPTS[:n_seq], N_DECODE)
                stats = llm.zipmoe_stats()
            finally:
                llm.close()
            assert_same_trace(got, got_tokens, want, want_tokens, f"stock on {stock.name} ({name}, {n_seq} seq)")
            assert stats["expert_misses"] > 0, name


def test_an_unknown_architecture_names_every_served_family(tmp_path):
    hf = tmp_path / "llama"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    proc = run([zipmoe_command("zipmoe-convert"), hf, "-o", tmp_path / "out.gguf"], text=True)
    assert proc.returncode == 1 and "architecture LlamaForCausalLM is not supported" in proc.stderr
    for family in families.FAMILIES:
        assert family.hf_architecture in proc.stderr
    helped = run([zipmoe_command("zipmoe-convert"), "--help"], text=True)
    assert all(f.hf_architecture in " ".join(helped.stdout.split()) for f in families.FAMILIES)


def _gguf_with(path, extra: str) -> None:
    """A GGUF of one MoE layer whose experts also have the tensor `extra`."""
    from zipmoe_py import _paths

    gguf = _paths.import_gguf()
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    rng = np.random.default_rng(0)
    for kind in ("gate", "up", "down"):
        values = (rng.normal(0, 0.02, (4, 32, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        w.add_tensor(f"blk.0.ffn_{kind}_exps.weight", values, raw_shape=values.shape,
                     raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.add_tensor(extra, np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("extra", ["blk.0.ffn_up_exps.scale", "blk.0.ffn_down_exps.scale", "blk.0.ffn_gate_up_exps.weight",
                                   "blk.0.ffn_gate_up_exps.bias"])
def test_experts_the_slots_do_not_serve_are_refused_before_writing(extra, tmp_path):
    """Never a file that loads nowhere: a GGUF whose experts have per-expert scales or a merged gate_up tensor is
    refused by zipmoe-convert, naming the tensor, as the loader would refuse it."""
    src, out = tmp_path / "model.gguf", tmp_path / "model.zipmoe.gguf"
    _gguf_with(src, extra)
    proc = run([zipmoe_command("zipmoe-convert"), src, "-o", out], text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"tensor {extra}: {families.UNSERVED_REASON}; nothing was written" in proc.stderr, proc.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
    with pytest.raises(ZipMoEError, match="do not serve"):
        zformat.repack(src, out)


def test_the_readme_shows_the_table_of_families():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "<!-- zipmoe_py/families.py makes this table" in readme
    assert families.markdown_table() in readme, "README.md's table of families differs from zipmoe_py/families.py"


@pytest.mark.parametrize("quant", ["BF16", "quantized"])
def test_a_zipmoe_gguf_converts_back_to_its_source_byte_for_byte(quant, made, tmp_path):
    """zipmoe-convert given a ZipMoE GGUF writes the plain GGUF it was made from: here, the very file."""
    stock, packed = models(made, NEWER[0], quant)
    back = tmp_path / "back.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), packed, "-o", back, "--shards", 3], text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--shards has no effect" in proc.stderr and "the plain GGUF" in proc.stdout
    assert back.read_bytes() == stock.read_bytes()


def test_a_split_gguf_converts_as_one_model(made, tmp_path):
    """M-00001-of-0000N.gguf (llama.cpp's converter with --split-max-tensors) converts from its first file,
    its siblings read beside it; served, it is bit-identical to stock on the split files; converted back,
    it is the one-file GGUF of the same checkpoint. A later split, or a missing sibling, is named."""
    import os
    import sys

    from zipmoe_py import _paths

    tiny = NEWER[0].tiny
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    proc = run([sys.executable, _paths.converter_script(), made / f"hf-{tiny}", "--outfile", tmp_path / "m.gguf",
                "--outtype", "bf16", "--split-max-tensors", 8], env=env, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    splits = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(splits) > 2, splits
    packed, back = tmp_path / "m.zipmoe.gguf", tmp_path / "back.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), splits[0], "-o", packed, "-q"], text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run([zipmoe_command("zipmoe-verify"), packed, "--against", splits[0], "-q"], text=True)
    assert proc.returncode == 0 and "identical to" in proc.stdout, proc.stderr[-2000:]
    reference = load(splits[0])
    try:
        want, want_tokens = logits_trace(reference, PROMPTS[:4], N_DECODE)
    finally:
        reference.close()
    llm = load(packed, zipmoe_budget=budgets(packed)["top-k"])
    try:
        got, got_tokens = logits_trace(llm, PROMPTS[:4], N_DECODE)
    finally:
        llm.close()
    assert_same_trace(got, got_tokens, want, want_tokens, "stock on the split GGUF")
    assert run([zipmoe_command("zipmoe-convert"), packed, "-o", back, "-q"]).returncode == 0
    assert back.read_bytes() == models(made, NEWER[0], "BF16")[0].read_bytes()

    later = run([zipmoe_command("zipmoe-convert"), splits[1], "-o", tmp_path / "x.gguf"], text=True)
    assert later.returncode == 1 and f"give its first file, m-00001-of-{len(splits):05d}.gguf" in later.stderr
    splits[-1].unlink()
    missing = run([zipmoe_command("zipmoe-convert"), splits[0], "-o", tmp_path / "x.gguf"], text=True)
    assert missing.returncode == 1 and f"missing beside it: {splits[-1].name}" in missing.stderr, missing.stderr
    assert not (tmp_path / "x.gguf").exists()
