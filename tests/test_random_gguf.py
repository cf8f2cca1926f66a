"""bench/make_random_gguf.py, which writes the full-geometry quantized bench models without their BF16 model:
a random file keeps its templates' tensor types and shapes and runs in stock llama.cpp; a thinned file keeps
every n-th layer byte for byte; the uniform router's rows are orthonormal."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import bench_module, run, zipmoe_command


@pytest.fixture(scope="module")
def random_gguf():
    return bench_module("make_random_gguf")


@pytest.fixture(scope="module")
def quantized(tiny_gguf, tmp_path_factory):
    """(BF16 GGUF, its Q4_K_M from the fork's llama-quantize)"""
    bf16 = tiny_gguf("qwen2moe")
    out = tmp_path_factory.mktemp("random") / "qwen2moe-Q4_K_M.gguf"
    proc = run([zipmoe_command("llama-quantize"), bf16, out, "Q4_K_M"])
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return bf16, out


def test_a_random_file_has_the_templates_types_and_shapes_and_runs_in_stock(random_gguf, quantized, tmp_path):
    from zipmoe_py import gguf_file as gf

    bf16, q4 = quantized
    shapes, types = gf.read_header(bf16), gf.read_header(q4)
    out = tmp_path / "random.gguf"
    random_gguf.write_random(out, bf16, q4, shapes.value("qwen2moe.block_count"), seed=3, router="random")
    written = gf.read_header(out)
    assert [t.name for t in written.tensors] == [t.name for t in types.tensors]
    for t in written.tensors:
        assert (t.type, t.dims) == (types.by_name[t.name].type, shapes.by_name[t.name].dims), t.name
    assert written.value("general.file_type") == types.value("general.file_type")
    assert any(gf.ggml_type_name(t.type) not in ("F32", "F16", "BF16") for t in written.tensors)
    from zipmoe_py.bindings import Llama

    llm = Llama(model_path=str(out), n_ctx=64, logits_all=True, verbose=False)
    try:
        tokens = llm.tokenize(b"Hello, world")
        llm.eval(tokens)
        assert np.isfinite(llm.scores[:len(tokens)]).all()  # the random blocks' scales keep activations finite
    finally:
        llm.close()


def test_a_thinned_file_keeps_every_nth_layer_byte_for_byte(random_gguf, quantized, tmp_path):
    from zipmoe_py import gguf_file as gf
    from zipmoe_py.gguf_source import GGUFSource

    _, q4 = quantized
    full = gf.read_header(q4)
    n = full.value("qwen2moe.block_count")
    out = tmp_path / "thinned.gguf"
    random_gguf.write_thinned(out, q4, 2)
    thin = gf.read_header(out)
    assert thin.value("qwen2moe.block_count") == len(range(0, n, 2))
    with GGUFSource(q4) as src, GGUFSource(out) as dst:
        for t in thin.tensors:
            i, rest = random_gguf.layer_of(t.name)
            source = full.by_name[t.name if i is None else f"blk.{2 * i}.{rest}"]
            assert (t.type, t.dims) == (source.type, source.dims)
            assert dst.read(t) == src.read(source), t.name


def test_the_uniform_router_has_orthonormal_rows_and_small_attention_outputs(random_gguf):
    from zipmoe_py import gguf_file as gf

    rng = np.random.default_rng(0)
    router = gf.TensorInfo("blk.0.ffn_gate_inp.weight", [64, 16], gf.GGML_TYPE_F32, 0)
    rows = random_gguf.random_data(router, "F32", rng, "uniform").reshape(16, 64)
    gram = rows @ rows.T
    assert np.allclose(gram, gram[0, 0] * np.eye(16), atol=1e-5 * gram[0, 0])
    attn = gf.TensorInfo("blk.0.attn_output.weight", [64, 64], gf.GGML_TYPE_F32, 0)
    plain = random_gguf.random_data(attn, "F32", np.random.default_rng(1), "random")
    scaled = random_gguf.random_data(attn, "F32", np.random.default_rng(1), "uniform")
    assert np.allclose(scaled, plain * 1e-3)
