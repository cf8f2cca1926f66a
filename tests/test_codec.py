"""ggml-zipmoe codecs: bit-exact BF16 split/recovery and exponent-plane round trips."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from zipmoe_py import codec
from zipmoe_py.codec import CodecError, Decoder

# the paths this CPU runs, best first, and cuda-grid: the CUDA recovery kernel's index arithmetic on the host
IMPLS = codec.supported_recover_paths() + ["cuda-grid"]


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns, round to nearest even (as PyTorch and llama.cpp do)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def expert_tensor(rng, heavy_tails=False) -> np.ndarray:
    shape = (1408, 2048)  # DeepSeek-V2-Lite / Qwen1.5-MoE routed-expert geometry
    x = rng.standard_t(3, shape) * 0.012 if heavy_tails else rng.normal(0, 0.02, shape)
    return to_bf16(x)


def entropy_bits(plane: np.ndarray) -> float:
    counts = np.bincount(plane, minlength=256)
    p = counts[counts > 0] / plane.size
    return float(-(p * np.log2(p)).sum())


@pytest.fixture(autouse=True)
def best_recover_impl():
    yield
    codec.set_recover_impl(None)


def test_scalar_is_always_available_and_the_best_is_default():
    assert IMPLS[-2:] == ["scalar", "cuda-grid"]
    codec.set_recover_impl(None)
    assert codec.recover_impl() == IMPLS[0]


@pytest.mark.parametrize("impl", IMPLS)
def test_every_bf16_bit_pattern_survives_split_and_recovery(impl):
    codec.set_recover_impl(impl)
    every = np.arange(1 << 16, dtype=np.uint16)  # ±0, ±inf, NaNs with payloads, subnormals, max/min normals
    exp, sm = codec.split_bf16(every)
    assert np.array_equal(exp, ((every >> 7) & 0xFF).astype(np.uint8))
    assert np.array_equal(sm, (((every >> 8) & 0x80) | (every & 0x7F)).astype(np.uint8))
    assert np.array_equal(codec.recover_bf16(exp, sm), every)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [0, 1, 7, 9, 15, 16, 17, 31, 33, 63, 65, 1000, 2047, 2048, 2049, 4097])
def test_recovery_handles_lengths_that_are_not_a_vector_multiple(impl, n):
    codec.set_recover_impl(impl)
    values = np.random.default_rng(n).integers(0, 1 << 16, n, dtype=np.uint16)
    exp, sm = codec.split_bf16(values)
    assert np.array_equal(codec.recover_bf16(exp, sm), values)


def test_unknown_recovery_path_is_refused():
    with pytest.raises(CodecError, match="not available"):
        codec.set_recover_impl("sse9")
    # a path of the other architecture is not compiled in
    other = "neon" if "avx2" in codec.recover_paths() else "avx2"
    with pytest.raises(CodecError, match="not available"):
        codec.set_recover_impl(other)


def _planes():
    rng = np.random.default_rng(0)
    exp, _ = codec.split_bf16(expert_tensor(rng))
    exp_t, _ = codec.split_bf16(expert_tensor(rng, heavy_tails=True))
    block = 128 * 1024
    return {
        "empty": np.zeros(0, np.uint8),
        "one": np.array([127], np.uint8),
        "gaussian-expert": exp,
        "heavy-tailed-expert": exp_t,
        "block-minus-1": exp[:block - 1],
        "block-plus-1": exp[:block + 1],
        "constant": np.full(block + 5000, 120, np.uint8),      # huff0 RLE blocks
        "uniform-random": rng.integers(0, 256, 300_000, dtype=np.uint8),  # incompressible: raw blocks
    }


PLANES = _planes()


@pytest.mark.parametrize("name", sorted(codec.CODECS))
@pytest.mark.parametrize("plane", sorted(PLANES))
def test_codec_round_trip_is_bit_exact(name, plane):
    data = PLANES[plane]
    blob = codec.compress(data, name)
    assert len(blob) <= max(len(codec.compress(data, "raw")), 1) + 64 + data.size // 100
    assert np.array_equal(Decoder().decompress(blob, name, data.size), data)


def _fhuf_code_lengths(blob: bytes) -> list[int]:
    """The code lengths in an fhuf Huffman stream's header (format in zipmoe-fhuf.c)."""
    assert blob[0] == 0xF2, "not a Huffman-coded fhuf stream"
    pos = 1
    while blob[pos] & 0x80:  # the decoded size's varint
        pos += 1
    lo, hi = blob[pos + 2], blob[pos + 3]
    nibbles = blob[pos + 4:pos + 4 + (hi - lo + 2) // 2]
    return [(nibbles[i // 2] >> (4 * (i & 1))) & 15 for i in range(hi - lo + 1)]


@pytest.mark.parametrize("first_len", [1, 2])
def test_fhuf_codes_of_the_longest_length_decode_exactly(first_len):
    """Codes of the format's longest length (12 bits) fill the decoder's whole table index, one
    symbol a lookup: rare symbols alone, in runs, alternating with short codes and at the ends of
    the streams (the careful path) decode exactly, with a 1-bit code (first_len 1) or without."""
    rng = np.random.default_rng(first_len)
    top = [0.5] if first_len == 1 else [0.25] * 3
    p = np.concatenate([top, (1 - sum(top)) * 0.5 ** np.arange(1, 14)])
    syms = np.arange(100, 100 + p.size, dtype=np.uint8)
    data = rng.choice(syms, 600_003, p=p / p.sum())
    rare = syms[-1]                             # ~130 in all: a 12-bit code
    data[1000:1060] = rare                      # a run inside the fast kernel
    data[50_000:50_060:2] = rare                # alternating with short codes
    data[:7], data[-7:] = rare, rare            # stream ends: the careful path
    for cut in (150_001, 300_002):              # other streams' segment ends and starts
        data[cut - 3:cut + 3] = rare
    blob = codec.compress(data, "fhuf")
    lengths = _fhuf_code_lengths(blob)
    assert lengths[0] == first_len and lengths[-1] == 12
    assert np.array_equal(Decoder().decompress(blob, "fhuf", data.size), data)


@pytest.mark.parametrize("name", ["zstd", "lz4hc"])
@pytest.mark.parametrize("level", [1, 9])
def test_levels_round_trip(name, level):
    data = PLANES["gaussian-expert"][:200_000]
    assert np.array_equal(Decoder().decompress(codec.compress(data, name, level), name, data.size), data)


@pytest.mark.parametrize("plane", ["gaussian-expert", "heavy-tailed-expert"])
@pytest.mark.parametrize("name", ["huf", "fhuf", "ghuf"])
def test_entropy_coders_whole_expert_size_is_within_1_percent_of_the_entropy_bound(plane, name):
    # whole expert = raw sign+mantissa plane + compressed exponent plane, against (8 + H) / 16 of BF16
    data = PLANES[plane]
    whole_ratio = (data.size + len(codec.compress(data, name))) / (2 * data.size)
    assert whole_ratio <= (8 + entropy_bits(data)) / 16 * 1.01


@pytest.mark.parametrize("name", [c for c in sorted(codec.CODECS)])
def test_truncated_or_missized_data_is_an_error_not_wrong_output(name):
    data = PLANES["gaussian-expert"][:300_000]
    blob = codec.compress(data, name)
    dec = Decoder()
    for cut in (1, len(blob) // 2):
        with pytest.raises(CodecError, match="corrupt compressed data"):
            dec.decompress(blob[:-cut], name, data.size)
    with pytest.raises(CodecError, match="corrupt compressed data"):
        dec.decompress(blob, name, data.size + 1)
    with pytest.raises(CodecError, match="corrupt compressed data"):
        dec.decompress(blob + b"\0", name, data.size)
    assert np.array_equal(dec.decompress(blob, name, data.size), data)  # the context is still good


def test_huf_block_header_corruption_is_detected():
    data = PLANES["gaussian-expert"][:300_000]
    blob = bytearray(codec.compress(data, "huf"))
    blob[8 + 3] ^= 0xC0  # mode bits of the first block (after the u64 size) -> an invalid mode
    with pytest.raises(CodecError, match="corrupt"):
        Decoder().decompress(bytes(blob), "huf", data.size)
    blob = bytearray(codec.compress(data, "huf"))
    blob[8] ^= 0xFF  # payload size of the first block
    with pytest.raises(CodecError, match="corrupt"):
        Decoder().decompress(bytes(blob), "huf", data.size)
    blob = bytearray(codec.compress(data, "huf"))
    blob[0] ^= 0x01  # the stream's decoded size
    with pytest.raises(CodecError, match="corrupt"):
        Decoder().decompress(bytes(blob), "huf", data.size)


def test_bad_arguments_are_refused():
    with pytest.raises(CodecError, match="invalid argument"):
        codec.compress(b"abc", "zstd", level=99)
    with pytest.raises(CodecError, match="invalid argument"):
        codec.compress(b"abc", "lz4hc", level=0)
    with pytest.raises(Exception, match="unknown codec 'brotli'"):
        codec.compress(b"abc", "brotli")


@pytest.mark.parametrize("name", ["fhuf", "ghuf"])
def test_huffman_decoders_survive_random_corruption(name):
    """Bounded fuzz of the default codec's decoder and the GPU layout's: any mutation decodes or is an
    error, never a crash (checksums, not the codec, catch what still decodes)."""
    rng = np.random.default_rng(7)
    data = PLANES["gaussian-expert"][:50_000]
    good = codec.compress(data, name)
    dec = Decoder()
    outcomes = {"error": 0, "decoded": 0}
    for i in range(3000):
        blob = bytearray(good)
        kind = i % 3
        if kind == 0:
            for _ in range(int(rng.integers(1, 6))):
                blob[int(rng.integers(len(blob)))] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            blob = blob[: int(rng.integers(len(blob)))]
        else:
            at = int(rng.integers(len(blob)))
            blob[at:at + 16] = rng.integers(0, 256, 16, dtype=np.uint8).tobytes()
        size = data.size if rng.random() < 0.9 else int(rng.integers(0, 2 * data.size))
        try:
            dec.decompress(bytes(blob), name, size)  # a flip in a stream's padding may still decode
            outcomes["decoded"] += 1
        except CodecError:
            outcomes["error"] += 1
    assert outcomes["error"] > 1500


@pytest.mark.parametrize("shards", [1, 5, 8])
def test_decode_expert_recovers_every_value_shard_by_shard(shards):
    from zipmoe_py.codec import ExpertDecode

    rng = np.random.default_rng(shards)
    values = rng.integers(0, 1 << 16, 67 * 45 * 3, dtype=np.uint16)  # every pattern kind, odd size
    exp, sm = codec.split_bf16(values)
    n = exp.size
    chunks, names = [], []
    for k in range(shards):
        name = sorted(codec.CODECS)[k % len(codec.CODECS)]
        chunks.append(codec.compress(exp[k * n // shards:(k + 1) * n // shards], name))
        names.append(name)
    assert np.array_equal(ExpertDecode(Decoder(), chunks, names, sm)(), values)
    names[-1] = "raw" if names[-1] != "raw" else "zstd"  # a chunk decoded with the wrong codec
    with pytest.raises(CodecError):
        ExpertDecode(Decoder(), chunks, names, sm)()


@pytest.mark.parametrize("plane", sorted(PLANES))
def test_ghuf_decodes_the_same_the_gpu_way(plane):
    """The GPU's decoder, run on the host: its table built entry by entry (one GPU thread each) and
    its segments decoded last first (independent, as GPU threads run them), equals the host's."""
    data = PLANES[plane]
    blob = codec.compress(data, "ghuf")
    assert np.array_equal(codec.ghuf_decode_as_gpu(blob, data.size), data)
    if data.size > 4096:  # segments of 1024 values with offsets: no more than 1.5% on the plane's Huffman size
        assert len(blob) <= len(codec.compress(data, "fhuf")) * 1.015 + 64


def test_ghuf_malformed_streams_are_errors_the_gpu_way():
    """What the layout itself can tell (a flipped code bit may still decode: the chunk's checksum
    catches that): a segment cut short or with a byte too many, offsets out of order, no code."""
    data = PLANES["gaussian-expert"][:100_000]
    blob = codec.compress(data, "ghuf")
    assert blob[0] == 0xE2  # Huffman mode
    lo, hi = blob[1 + 3], blob[1 + 4]  # after the tag and the 3-byte varint of 100000
    lengths = 1 + 3 + 2
    offsets = lengths + (hi - lo + 2) // 2
    second = bytearray(blob)
    second[offsets + 4:offsets + 8] = (1 << 31).to_bytes(4, "little")  # segment 1 starts past the area
    no_code = bytearray(blob)
    no_code[lengths:offsets] = bytes(offsets - lengths)
    for bad in (blob[:-1], blob + b"\0", bytes(second), bytes(no_code)):
        with pytest.raises(CodecError, match="corrupt"):
            codec.ghuf_decode_as_gpu(bad, data.size)
        with pytest.raises(CodecError, match="corrupt"):
            Decoder().decompress(bad, "ghuf", data.size)


def test_the_decoder_bench_builds_and_decodes_exactly(tmp_path):
    """bench/fhuf_decode_bench.c, built as its header says, decodes one expert's shards exactly and
    reports the exponents' coded size near their entropy (Gaussian BF16: ~2.6 bits)."""
    repo = Path(__file__).resolve().parent.parent
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler"
    src = repo / "ggml-zipmoe" / "src"
    exe = tmp_path / "fhuf_decode_bench"
    subprocess.run([cc, "-O3", "-DNDEBUG", "-std=gnu11", f"-I{src}", "-o", str(exe), str(repo / "bench" / "fhuf_decode_bench.c"),
                    str(src / "codec" / "zipmoe-fhuf.c"), str(src / "codec" / "zipmoe-fhuf-encode.c"), "-lm"], check=True)
    out = subprocess.run([str(exe), "1"], capture_output=True, text=True, check=True).stdout
    bits = float(re.match(r"([\d.]+) bits/symbol, [\d.]+ ns/symbol", out).group(1))
    assert 2.4 < bits < 2.8
    assert subprocess.run([str(exe), "0"], capture_output=True, text=True).returncode == 2
