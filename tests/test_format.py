"""ZipMoE GGUF (docs/FORMAT.md): repacking, verification, corruption detection, compatibility."""
from __future__ import annotations

import os
import random
import struct
import subprocess

import numpy as np
import pytest

from zipmoe_py import _paths, codec
from zipmoe_py import format as zformat
from zipmoe_py import gguf_file
from zipmoe_py.errors import ZipMoEError

from conftest import run, zipmoe_command


def _bf16_patterns(rng, n: int) -> np.ndarray:
    """Realistic weights mixed with every special value: ±0, ±inf, NaN payloads, subnormals, extremes."""
    x = rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16
    special = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x807F,
                        0x7F7F, 0xFF7F, 0x0080, 0x8080], np.uint16)
    out = x.astype(np.uint16)
    out[rng.choice(n, min(n, 64), replace=False)] = rng.choice(special, min(n, 64))
    return out


def make_moe_gguf(path, expert_dtype="bf16", shape=(67, 45, 3), layers=2, seed=0):
    """A small GGUF with routed-expert tensors of awkward sizes and a few ordinary tensors. expert_dtype:
    bf16, f32, or any type gguf-py quantizes to (f16, q8_0, q4_0, ...; shape[0] a whole number of blocks)."""
    gguf = _paths.import_gguf()
    from gguf import quants

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    w.add_block_count(layers)
    w.add_uint32("test.marker", 7)
    w.add_array("test.tokens", ["a", "b", "c"])
    w.add_tensor("token_embd.weight", rng.normal(size=(5, 67)).astype(np.float32))
    for layer in range(layers):
        w.add_tensor(f"blk.{layer}.ffn_norm.weight", rng.normal(size=67).astype(np.float32))
        for kind in ("gate", "up", "down"):
            n_expert, n_ff, n_embd = shape[2], shape[1], shape[0]
            name = f"blk.{layer}.ffn_{kind}_exps.weight"
            if expert_dtype == "bf16":
                data = _bf16_patterns(rng, n_expert * n_ff * n_embd).reshape(n_expert, n_ff, n_embd)
                w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
            elif expert_dtype == "f32":
                w.add_tensor(name, rng.normal(size=(n_expert, n_ff, n_embd)).astype(np.float32))
            else:
                qtype = gguf.GGMLQuantizationType[expert_dtype.upper()]
                data = quants.quantize(rng.normal(size=(n_expert, n_ff, n_embd)).astype(np.float32), qtype)
                w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def small_src(tmp_path_factory):
    return make_moe_gguf(tmp_path_factory.mktemp("fmt") / "src.gguf")


@pytest.mark.parametrize("codec_name", sorted(codec.CODECS))
@pytest.mark.parametrize("shards", [1, 5, 8])
def test_round_trip_every_codec_and_shard_count(small_src, tmp_path, codec_name, shards):
    dst = tmp_path / "z.gguf"
    zformat.repack(small_src, dst, codec=codec_name, shards=shards, threads=2)
    counts = zformat.verify(dst, against=small_src)
    assert counts == {"tensors": 6, "experts": 18, "chunks": 18 * (1 + shards), "other_tensors": 3}
    header = gguf_file.read_header(dst)
    assert header.alignment == 4096 and header.data_offset % 4096 == 0
    with zformat.ZipMoEFile(dst) as zf:
        for tensor in zf.tensors:
            for e in range(3):
                refs = zf.chunks(tensor, e)
                assert all(r.offset % 4096 == 0 for r in refs)  # O_DIRECT-ready
                assert sum(r.decoded_size for r in refs[1:]) == refs[0].decoded_size == 67 * 45
    # every source key-value is kept byte for byte
    src = gguf_file.read_header(small_src)
    for key, kv in src.kv.items():
        if key != "general.alignment":
            assert header.kv[key].raw == kv.raw, key


def test_moe_layers_and_expert_bytes_come_from_the_tensor_index(small_src, tmp_path):
    dst = tmp_path / "z.gguf"
    zformat.repack(small_src, dst)
    with zformat.ZipMoEFile(dst) as zf:
        layers = zf.moe_layers()
        assert list(layers) == [0, 1]
        for layer, tensors in layers.items():
            assert [zf.tensors[t] for t in tensors] == [f"blk.{layer}.ffn_{kind}_exps.weight"
                                                        for kind in ("gate", "up", "down")]
        sizes = zf.expert_bytes()
    one_tensor = 67 * 45 * 2  # BF16 values of the (67, 45, 3) tensors
    assert sizes.by_kind == {"gate": one_tensor, "up": one_tensor, "down": one_tensor}
    assert sizes.one_expert == 3 * one_tensor and sizes.sm_chunks == 3 * 67 * 45
    assert sizes.all_experts == 2 * 3 * 3 * one_tensor  # layers x experts x one expert


def test_repacking_is_deterministic(small_src, tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    zformat.repack(small_src, a, threads=1)
    zformat.repack(small_src, b, threads=2)
    assert a.read_bytes() == b.read_bytes()


def test_both_tiny_models_convert_to_zipmoe_and_verify(arch, tiny_hf, tiny_gguf, tmp_path):
    out = tmp_path / f"{arch}-zipmoe.gguf"
    if arch == "qwen2moe":  # straight from the Hugging Face checkpoint, the one-command path
        proc = run([zipmoe_command("zipmoe-convert"), tiny_hf(arch), "-o", out, "--zipmoe"])
    else:
        proc = run([zipmoe_command("zipmoe-convert"), tiny_gguf(arch), "-o", out, "--zipmoe", "--shards", "8"])
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"bound (8+H)/16" in proc.stderr  # the per-layer entropy / ratio table
    assert not list(tmp_path.glob(".zipmoe-*")) and not list(tmp_path.glob("*.partial"))
    proc = run([zipmoe_command("zipmoe-verify"), out, "--against", tiny_gguf(arch), "-q"])
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"identical to" in proc.stdout


def test_stock_gguf_py_reads_it_and_a_loader_without_zipmoe_refuses_it(tiny_gguf, tmp_path):
    out = tmp_path / "z.gguf"
    zformat.repack(tiny_gguf("deepseek2"), out)
    reader = _paths.import_gguf().GGUFReader(str(out))
    names = {t.name for t in reader.tensors}
    assert "blk.1.ffn_up_exps.zipmoe" in names and "blk.1.ffn_up_exps.weight" not in names
    assert int(reader.fields["zipmoe.format_version"].contents()) == 1
    # the fork serves a file only when it has zipmoe.format_version; with the key renamed it takes
    # stock llama.cpp's path, which must refuse the file rather than misbehave
    data = out.read_bytes()
    assert data.count(b"zipmoe.format_version") == 1
    stock_view = tmp_path / "stock-view.gguf"
    stock_view.write_bytes(data.replace(b"zipmoe.format_version", b"zipmoe.format_versioX"))
    proc = run([_paths.program("llama-completion"), "-m", stock_view, "-p", "hi", "-n", 1, "-no-cnv", "--no-warmup"],
               stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert b"error loading model: check_tensor_dims: tensor 'blk.1.ffn_" in proc.stderr
    assert b"_exps.weight' not found" in proc.stderr


def _first_chunk(path, tensor="blk.1.ffn_down_exps.weight", expert=2, shard=1):
    with zformat.ZipMoEFile(path) as zf:
        return zf.chunks(tensor, expert)[1 + shard if shard is not None else 0]


@pytest.mark.parametrize("shard", [None, 0, 3])
def test_a_flipped_byte_is_named_by_layer_tensor_expert_and_shard(small_src, tmp_path, shard):
    dst = tmp_path / "z.gguf"
    zformat.repack(small_src, dst, shards=5)
    ref = _first_chunk(dst, shard=shard)
    data = bytearray(dst.read_bytes())
    data[ref.offset + ref.size // 2] ^= 0x10
    dst.write_bytes(bytes(data))
    what = "SM-chunk" if shard is None else f"E-chunk \\(shard {shard}\\)"
    pattern = f"checksum mismatch in layer 1, tensor blk.1.ffn_down_exps.weight, expert 2, {what}"
    with pytest.raises(ZipMoEError, match=pattern):
        zformat.verify(dst)
    proc = run([zipmoe_command("zipmoe-verify"), dst, "-q"])
    assert proc.returncode == 1
    assert b"checksum mismatch in layer 1, tensor blk.1.ffn_down_exps.weight, expert 2" in proc.stderr


def test_truncated_file_wrong_version_and_bad_offsets_are_clear_errors(small_src, tmp_path):
    dst = tmp_path / "z.gguf"
    zformat.repack(small_src, dst)
    good = dst.read_bytes()

    dst.write_bytes(good[: len(good) - 5000])
    with pytest.raises(ZipMoEError, match="lies beyond the end of the file|truncated|outside"):
        zformat.verify(dst)

    version_key = gguf_file.pack_string("zipmoe.format_version") + struct.pack("<I", gguf_file.T_U32)
    at = good.index(version_key) + len(version_key)
    dst.write_bytes(good[:at] + struct.pack("<I", 99) + good[at + 4:])
    with pytest.raises(ZipMoEError, match="format version 99 is not supported"):
        zformat.verify(dst)

    offsets_key = gguf_file.pack_string("zipmoe.tensor.blk.0.ffn_gate_exps.weight.chunk_offset")
    at = good.index(offsets_key) + len(offsets_key) + 4 + 4 + 8  # type, item type, count
    dst.write_bytes(good[:at] + struct.pack("<Q", 1 << 40) + good[at + 8:])
    with pytest.raises(ZipMoEError, match="layer 0, tensor blk.0.ffn_gate_exps.weight, expert 0, SM-chunk "
                                          "lies outside its tensor"):
        zformat.verify(dst)
    proc = run([zipmoe_command("zipmoe-verify"), dst, "-q"])
    assert proc.returncode == 1 and b"lies outside its tensor" in proc.stderr


@pytest.mark.parametrize("dtype, width", [("f32", 67), ("f16", 67), ("q8_0", 64), ("q4_0", 64)])
def test_experts_of_any_other_type_are_stored_raw_and_read_back_bit_for_bit(tmp_path, dtype, width):
    """Format version 3: an expert that is not BF16 is its own bytes in chunk 0, its E-chunks empty."""
    src = make_moe_gguf(tmp_path / f"{dtype}.gguf", expert_dtype=dtype, shape=(width, 45, 3))
    out = tmp_path / "z.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), src, "-o", out, "--shards", "3"])
    assert proc.returncode == 0, proc.stderr.decode()
    assert f"6 routed-expert tensors stored raw ({dtype.upper()}: nothing to decompress".encode() in proc.stderr
    assert zformat.verify(out, against=src) == {"tensors": 6, "experts": 18, "chunks": 18 * 4, "other_tensors": 3}
    header = gguf_file.read_header(out)
    assert header.value("zipmoe.format_version") == 3
    source = gguf_file.read_header(src)
    t = source.by_name["blk.1.ffn_up_exps.weight"]
    one = t.nbytes() // 3
    with zformat.ZipMoEFile(out) as zf:
        assert zf.type("blk.1.ffn_up_exps.weight") == t.type and zf.is_raw("blk.1.ffn_up_exps.weight")
        got = zf.read_expert("blk.1.ffn_up_exps.weight", 2)
        chunks = zf.chunks("blk.1.ffn_up_exps.weight", 2)
        sizes = zf.expert_bytes()
    assert got.dtype == np.uint8 and got.tobytes() == src.read_bytes()[source.data_offset + t.offset + 2 * one:][:one]
    assert [c.size for c in chunks] == [one, 0, 0, 0] and all(c.codec == 0 for c in chunks)
    assert sizes.by_kind == {"gate": one, "up": one, "down": one} and sizes.all_experts == 2 * 3 * 3 * one


def test_a_raw_type_in_a_version_2_file_and_a_raw_tensors_nonempty_e_chunk_are_refused(tmp_path):
    """A raw tensor's type in a file that claims format version 1 or 2 (which have BF16 only) is refused,
    naming the key; and a raw tensor's E-chunk that is not empty is a corrupt index."""
    src = make_moe_gguf(tmp_path / "q.gguf", expert_dtype="q8_0", shape=(64, 45, 3))
    good_path = tmp_path / "z.gguf"
    zformat.repack(src, good_path, shards=2)
    good = good_path.read_bytes()
    dst = tmp_path / "bad.gguf"
    version_key = gguf_file.pack_string("zipmoe.format_version") + struct.pack("<I", gguf_file.T_U32)
    at = good.index(version_key) + len(version_key)
    dst.write_bytes(good[:at] + struct.pack("<I", 2) + good[at + 4:])
    with pytest.raises(ZipMoEError, match=r"zipmoe.tensor.blk.0.ffn_gate_exps.weight.type is 8, not BF16 \(30\), "
                                          "the only type format versions 1 and 2 have"):
        zformat.verify(dst)
    sizes_key = gguf_file.pack_string("zipmoe.tensor.blk.0.ffn_gate_exps.weight.chunk_size")
    at = good.index(sizes_key) + len(sizes_key) + 4 + 4 + 8 + 8  # type, item type, count, chunk 0's size
    dst.write_bytes(good[:at] + struct.pack("<Q", 16) + good[at + 8:])
    with pytest.raises(ZipMoEError, match="layer 0, tensor blk.0.ffn_gate_exps.weight, expert 0, E-chunk \\(shard 0\\) "
                                          "is not empty, as a raw tensor's E-chunks are"):
        zformat.verify(dst)


def test_f32_experts_are_rounded_only_when_asked(tmp_path):
    src = make_moe_gguf(tmp_path / "f32.gguf", expert_dtype="f32")
    out = tmp_path / "z.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), src, "-o", out, "--zipmoe", "--f32-to-bf16", "-q"])
    assert proc.returncode == 0, proc.stderr.decode()
    assert zformat.verify(out, against=src)["experts"] == 18  # equal to the source rounded to BF16
    header = gguf_file.read_header(src)
    t = header.by_name["blk.1.ffn_up_exps.weight"]
    f32 = np.frombuffer(src.read_bytes(), np.float32, 67 * 45, header.data_offset + t.offset)
    with zformat.ZipMoEFile(out) as zf:
        got = zf.read_expert("blk.1.ffn_up_exps.weight", 0)
    # independent reference: BF16 nearest-even rounding through PyTorch
    import torch

    want = torch.from_numpy(f32.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, want)


def test_f32_to_bf16_rounding_matches_llama_cpp_on_special_values():
    bits = np.array([0x3F800000, 0x3F808000, 0x3F818000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800001,
                     0xFFFFFFFF, 0x00000001, 0x80000000, 0x7F7FFFFF], np.uint32)
    want = np.array([0x3F80, 0x3F80, 0x3F82, 0x7F80, 0xFF80, 0x7FC0, 0x7FC0, 0xFFFF, 0x0000, 0x8000, 0x7F80],
                    np.uint16)
    assert np.array_equal(zformat.f32_to_bf16(bits.view(np.float32)), want)


def test_already_zipmoe_and_non_moe_inputs_are_refused(small_src, tmp_path):
    dst = tmp_path / "z.gguf"
    zformat.repack(small_src, dst)
    with pytest.raises(ZipMoEError, match="already a ZipMoE GGUF"):
        zformat.repack(dst, tmp_path / "again.gguf")
    with pytest.raises(ZipMoEError, match="is not a ZipMoE GGUF"):
        zformat.verify(small_src)


def test_header_parser_fuzz(small_src, tmp_path):
    """Bounded random mutations of a ZipMoE header: a clear ZipMoEError or a clean parse, never a crash."""
    dst = tmp_path / "z.gguf"
    zformat.repack(small_src, dst)
    good = dst.read_bytes()
    header_len = gguf_file.read_header(dst).data_offset
    rng = random.Random(1234)
    fuzzed = tmp_path / "fuzzed.gguf"
    outcomes = {"error": 0, "parsed": 0}
    for _ in range(400):
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(header_len)] = rng.randrange(256)
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        fuzzed.write_bytes(bytes(data))
        try:
            with zformat.ZipMoEFile(fuzzed) as zf:
                for tensor in zf.tensors[:1]:
                    zf.chunks(tensor, 0)
            outcomes["parsed"] += 1
        except ZipMoEError:
            outcomes["error"] += 1
    assert outcomes["error"] > 50 and sum(outcomes.values()) == 400


def test_a_different_source_is_named_by_layer_tensor_and_expert(small_src, tmp_path):
    dst = tmp_path / "z.gguf"
    zformat.repack(small_src, dst)
    other = make_moe_gguf(tmp_path / "other.gguf", seed=1)
    with pytest.raises(ZipMoEError, match="layer 0, tensor blk.0.ffn_gate_exps.weight, expert 0 differs from"):
        zformat.verify(dst, against=other)
    proc = run([zipmoe_command("zipmoe-verify"), dst, "--against", other, "-q"])
    assert proc.returncode == 1 and b"differs from" in proc.stderr


def test_direct_io_reads_the_same_experts(small_src, tmp_path):
    dst = tmp_path / "z.gguf"
    zformat.repack(small_src, dst, shards=3)
    with zformat.ZipMoEFile(dst, direct_io=True) as direct, zformat.ZipMoEFile(dst) as buffered:
        for tensor in buffered.tensors:
            for e in range(buffered.shape(tensor)[2]):
                assert np.array_equal(direct.read_expert(tensor, e), buffered.read_expert(tensor, e))


def test_c_chunk_reads_check_buffers_and_checksums(small_src, tmp_path):
    """ggml_zipmoe_file_read_chunk: the runtime's I/O primitive, called as the I/O thread does."""
    import ctypes

    from zipmoe_py import _lib

    dst = tmp_path / "z.gguf"
    zformat.repack(small_src, dst, shards=2)
    lib = _lib.lib()
    err = ctypes.create_string_buffer(512)
    handle = lib.ggml_zipmoe_file_open(str(dst).encode(), 0, err, len(err))
    assert handle, err.value
    try:
        cap = lib.ggml_zipmoe_file_chunk_buffer_size(handle)
        assert cap % 4096 == 0 and cap >= lib.ggml_zipmoe_file_max_chunk_size(handle)
        t = lib.ggml_zipmoe_file_find_tensor(handle, b"blk.1.ffn_up_exps.weight")
        assert t >= 0 and lib.ggml_zipmoe_file_find_tensor(handle, b"blk.1.ffn_up_exps.zipmoe") == -1
        buf = np.zeros(cap, np.uint8)
        data = dst.read_bytes()
        for c in range(3):
            info = _lib.ChunkInfo()
            assert lib.ggml_zipmoe_file_chunk(handle, t, 1, c, ctypes.byref(info)) == _lib.OK
            assert info.offset % 4096 == 0 and info.shard == c - 1
            assert lib.ggml_zipmoe_file_read_chunk(handle, t, 1, c, buf.ctypes.data, cap) == _lib.OK
            assert buf[:info.size].tobytes() == data[info.offset:info.offset + info.size]
        assert lib.ggml_zipmoe_file_read_chunk(handle, t, 1, 0, buf.ctypes.data, info.size - 1) == _lib.ERR_ARG
        assert lib.ggml_zipmoe_file_read_chunk(handle, t, 99, 0, buf.ctypes.data, cap) == _lib.ERR_ARG
        assert lib.ggml_zipmoe_file_chunk(handle, t, 1, 3, ctypes.byref(info)) == _lib.ERR_ARG
        # a byte flipped on disk after opening is caught by the checksum of the chunk read
        with open(dst, "r+b") as f:
            f.seek(info.offset)
            f.write(bytes([data[info.offset] ^ 1]))
        assert lib.ggml_zipmoe_file_read_chunk(handle, t, 1, 2, buf.ctypes.data, cap) == _lib.ERR_CHECKSUM
        # and a file truncated after opening gives an I/O error, not garbage
        os.truncate(dst, info.offset + 10)
        assert lib.ggml_zipmoe_file_read_chunk(handle, t, 1, 2, buf.ctypes.data, cap) == _lib.ERR_IO
    finally:
        lib.ggml_zipmoe_file_close(handle)


def test_ghuf_files_are_version_2_and_a_version_1_file_claiming_ghuf_is_refused(tmp_path):
    """Codec ghuf (the GPU layout) writes format version 2; every other codec still writes 1, which
    older readers read. A version 1 file whose chunks claim ghuf is malformed, and said so."""
    from zipmoe_py import gguf_file as gf

    src = make_moe_gguf(tmp_path / "src.gguf", shape=(257, 129, 4))
    ghuf, fhuf = tmp_path / "g.gguf", tmp_path / "f.gguf"
    zformat.repack(src, ghuf, codec="ghuf", shards=3)
    zformat.repack(src, fhuf, shards=3)
    assert gf.read_header(ghuf).value("zipmoe.format_version") == 2
    assert gf.read_header(fhuf).value("zipmoe.format_version") == 1
    report = zformat.verify(ghuf, against=src)  # every chunk decoded and compared with the BF16 source
    assert report
    # the same bytes, relabelled version 1
    raw = bytearray(ghuf.read_bytes())
    key = b"zipmoe.format_version"
    at = raw.index(key) + len(key)
    assert raw[at:at + 8] == (4).to_bytes(4, "little") + (2).to_bytes(4, "little")  # u32, 2
    raw[at + 4:at + 8] = (1).to_bytes(4, "little")
    bad = tmp_path / "v1-ghuf.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(zformat.ZipMoEError, match="uses codec ghuf, which format version 1 does not have"):
        zformat.ZipMoEFile(bad)


@pytest.mark.parametrize("dtype, width", [("bf16", 67), ("f32", 67), ("q4_0", 64)])
def test_a_zipmoe_gguf_unpacks_to_its_source_byte_for_byte(tmp_path, dtype, width):
    from zipmoe_py.unpack import unpack

    src = make_moe_gguf(tmp_path / f"{dtype}.gguf", expert_dtype=dtype, shape=(width, 45, 3))
    packed, back = tmp_path / "z.gguf", tmp_path / "back.gguf"
    zformat.repack(src, packed, shards=3)
    unpack(packed, back)
    assert back.read_bytes() == src.read_bytes()


def test_unpacking_a_corrupt_chunk_names_it_and_writes_nothing(small_src, tmp_path):
    from zipmoe_py.unpack import unpack

    packed, back = tmp_path / "z.gguf", tmp_path / "back.gguf"
    zformat.repack(small_src, packed, shards=5)
    ref = _first_chunk(packed, shard=0)
    data = bytearray(packed.read_bytes())
    data[ref.offset + ref.size // 2] ^= 0x10
    packed.write_bytes(bytes(data))
    with pytest.raises(ZipMoEError, match="checksum mismatch in layer 1, tensor blk.1.ffn_down_exps.weight, expert 2"):
        unpack(packed, back)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z.gguf"]
