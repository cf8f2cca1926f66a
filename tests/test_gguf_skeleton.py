"""tools/gguf_skeleton.py: a model carried as its header (strip) and filled with random weights on the
other side (fill), the GPU machine's only way to get a bench model; --layers grows the header to a
deeper model of the same geometry (the full DeepSeek-V2-Lite's 27 layers from a 2-layer one)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zipmoe_py.gguf_file import read_header

TOOL = Path(__file__).resolve().parent.parent / "tools" / "gguf_skeleton.py"


def skeleton(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, cwd="/")


def generates(path: Path) -> None:
    """llama.cpp loads the model and evaluates a prompt with it."""
    from zipmoe_py import Llama

    llm = Llama(model_path=str(path), n_ctx=64, n_threads=2, verbose=False)
    try:
        assert llm.create_completion("Hello", max_tokens=2, temperature=0)["usage"]["prompt_tokens"] > 0
    finally:
        llm.close()


def test_strip_and_fill_give_the_same_header_with_fresh_weights(tiny_gguf, tmp_path):
    src = tiny_gguf("qwen2moe")
    assert skeleton("strip", src, tmp_path / "s.gguf").returncode == 0
    assert (tmp_path / "s.gguf").stat().st_size < src.stat().st_size / 4
    assert skeleton("fill", tmp_path / "s.gguf", tmp_path / "m.gguf").returncode == 0
    want, got = read_header(src), read_header(tmp_path / "m.gguf")
    assert [kv.raw for kv in got.kv.values()] == [kv.raw for kv in want.kv.values()]
    assert [(t.name, t.dims, t.type, t.offset) for t in got.tensors] == [(t.name, t.dims, t.type, t.offset) for t in want.tensors]
    assert (tmp_path / "m.gguf").stat().st_size == src.stat().st_size
    assert (tmp_path / "m.gguf").read_bytes()[want.data_offset:] != src.read_bytes()[want.data_offset:]
    generates(tmp_path / "m.gguf")


def layer_tensors(header, layer: int) -> dict:
    return {t.name.split(".", 2)[2]: (t.dims, t.type) for t in header.tensors if t.name.startswith(f"blk.{layer}.")}


@pytest.mark.parametrize("arch, grow", [("deepseek2", 1), ("qwen2moe", 2)])  # the tiny DeepSeek is a 26-layer Lite
def test_layers_grows_the_header_to_a_deeper_model_that_runs(arch, grow, tiny_gguf, tmp_path):
    src = tiny_gguf(arch)
    have = read_header(src)
    layers = have.value(f"{arch}.block_count")
    proc = skeleton("strip", src, tmp_path / "s.gguf", "--layers", layers + grow)
    assert proc.returncode == 0, proc.stderr
    assert skeleton("fill", tmp_path / "s.gguf", tmp_path / "m.gguf").returncode == 0
    grown = read_header(tmp_path / "m.gguf")
    assert grown.value(f"{arch}.block_count") == layers + grow
    for layer in range(layers, layers + grow):
        assert layer_tensors(grown, layer) == layer_tensors(have, layers - 1)
    generates(tmp_path / "m.gguf")


def test_a_deepseek2_grown_to_27_layers_takes_lite_attention(tmp_path):
    """llama.cpp reads a 27-layer DeepSeek-V2 as DeepSeek-V2-Lite: one query projection, no q_lora_rank."""
    from zipmoe_py.devtools.tiny import make_tiny

    from conftest import zipmoe_command

    hf = make_tiny("deepseek2", tmp_path / "hf", seed=1, sizes={"num_hidden_layers": 3, "q_lora_rank": 32})
    src = tmp_path / "ds3.gguf"
    subprocess.run([zipmoe_command("zipmoe-convert"), str(hf), "-o", str(src), "--bf16", "--quiet"], check=True)
    assert skeleton("strip", src, tmp_path / "s.gguf", "--layers", 27).returncode == 0
    assert skeleton("fill", tmp_path / "s.gguf", tmp_path / "m.gguf").returncode == 0
    grown = read_header(tmp_path / "m.gguf")
    assert "deepseek2.attention.q_lora_rank" not in grown.kv
    q_b = layer_tensors(read_header(src), 2)["attn_q_b.weight"]
    for layer in (0, 26):
        names = layer_tensors(grown, layer)
        assert "attn_q_a.weight" not in names and names["attn_q.weight"] == ([grown.value("deepseek2.embedding_length"), q_b[0][1]], q_b[1])
    generates(tmp_path / "m.gguf")


def test_layers_no_deeper_than_the_model_is_refused(tiny_gguf, tmp_path):
    src = tiny_gguf("qwen2moe")
    layers = read_header(src).value("qwen2moe.block_count")
    proc = skeleton("strip", src, tmp_path / "s.gguf", "--layers", layers)
    assert proc.returncode != 0 and f"qwen2moe.block_count is {layers}" in proc.stderr
    assert not (tmp_path / "s.gguf").exists()
