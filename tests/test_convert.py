"""zipmoe-convert: HF checkpoint -> BF16 GGUF through the unmodified upstream converter."""
from __future__ import annotations

import json
import shutil

import pytest

from zipmoe_py import _paths

from conftest import run, zipmoe_command

EXPECTED = {
    # arch: (general.architecture, expert count, experts used, layers with routed experts)
    "deepseek2": ("deepseek2", 16, 6, range(1, 26)),
    "qwen2moe": ("qwen2moe", 16, 4, range(0, 4)),
}


def _reader(path):
    return _paths.import_gguf().GGUFReader(str(path))


def test_converted_gguf_has_bf16_routed_experts(arch, tiny_gguf):
    gguf = _paths.import_gguf()
    reader = _reader(tiny_gguf(arch))
    name, n_expert, n_used, moe_layers = EXPECTED[arch]
    assert reader.fields["general.architecture"].contents() == name
    assert reader.fields[f"{name}.expert_count"].contents() == n_expert
    assert reader.fields[f"{name}.expert_used_count"].contents() == n_used
    tensors = {t.name: t for t in reader.tensors}
    for layer in moe_layers:
        for kind in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{kind}_exps.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16
            assert t.shape[-1] == n_expert  # ggml order: [n_embd or n_ff, ..., n_expert]
    if arch == "deepseek2":
        assert "blk.0.ffn_gate_exps.weight" not in tensors  # layer 0 is dense
        assert "blk.1.ffn_gate_shexp.weight" in tensors
    else:
        assert "blk.0.ffn_gate_inp_shexp.weight" in tensors  # the shared expert's sigmoid gate
        assert "blk.0.attn_q.bias" in tensors


def test_conversion_is_deterministic(tiny_hf, tiny_gguf, tmp_path):
    again = tmp_path / "again.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), tiny_hf("qwen2moe"), "-o", again, "--bf16", "-q"])
    assert proc.returncode == 0, proc.stderr.decode()
    assert again.read_bytes() == tiny_gguf("qwen2moe").read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def _convert_error(src, out):
    proc = run([zipmoe_command("zipmoe-convert"), src, "-o", out, "-q"])
    assert proc.returncode == 1
    assert not out.exists()
    return proc.stderr.decode()


def test_dense_llama_checkpoint_is_refused(tmp_path, tiny_hf):
    dense = tmp_path / "dense"
    shutil.copytree(tiny_hf("qwen2moe"), dense)
    config = json.loads((dense / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (dense / "config.json").write_text(json.dumps(config))
    err = _convert_error(dense, tmp_path / "out.gguf")
    assert "architecture LlamaForCausalLM is not supported" in err
    assert str(dense / "config.json") in err


@pytest.mark.parametrize("problem, message", [
    ("missing_dir", "checkpoint folder not found"),
    ("no_config", "has no config.json"),
    ("bad_config", "is not valid JSON"),
    ("no_weights", "has no weights"),
    ("no_tokenizer", "has no tokenizer"),
    ("missing_shard", "lists weight files that are missing: model-00002-of-00002.safetensors"),
])
def test_incomplete_checkpoints_are_named(problem, message, tmp_path, tiny_hf):
    src = tmp_path / "ckpt"
    if problem != "missing_dir":
        shutil.copytree(tiny_hf("qwen2moe"), src)
    if problem == "no_config":
        (src / "config.json").unlink()
    elif problem == "bad_config":
        (src / "config.json").write_text("{not json")
    elif problem == "no_weights":
        (src / "model.safetensors").unlink()
    elif problem == "no_tokenizer":
        (src / "tokenizer.json").unlink()
    elif problem == "missing_shard":
        (src / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    err = _convert_error(src, tmp_path / "out.gguf")
    assert message in err
    assert str(src) in err


def test_converter_failure_leaves_no_output(tmp_path, tiny_hf):
    src = tmp_path / "ckpt"
    shutil.copytree(tiny_hf("qwen2moe"), src)
    (src / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    out = tmp_path / "out.gguf"
    err = _convert_error(src, out)
    assert "llama.cpp's converter failed" in err
    assert not list(tmp_path.glob("*.partial"))


def test_output_folder_must_exist(tmp_path, tiny_hf):
    err = _convert_error(tiny_hf("qwen2moe"), tmp_path / "nowhere" / "out.gguf")
    assert "output folder does not exist" in err


def test_an_output_that_would_overwrite_the_input_is_refused(tmp_path, tiny_hf, tiny_gguf):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_hf("qwen2moe"), ckpt)
    bf16 = tmp_path / "model.gguf"
    shutil.copy(tiny_gguf("qwen2moe"), bf16)
    before = {p.name: p.read_bytes() for p in [*ckpt.iterdir(), bf16] if p.is_file()}
    for args, message in (
            ([bf16, "-o", bf16], "is the input"),
            ([bf16, "-o", tmp_path / "." / "model.gguf"], "is the input"),
            ([ckpt, "-o", ckpt / "model.safetensors"], "lies inside the checkpoint folder"),
            ([ckpt, "-o", tmp_path / "z.gguf", "--keep-bf16", ckpt / "config.json"], "lies inside the checkpoint"),
            ([ckpt, "-o", tmp_path / "same.gguf", "--keep-bf16", tmp_path / "same.gguf"], "are the same file"),
            ([bf16, "-o", ""], "must name a file"),
            ([bf16, "-o", tmp_path], "must name a file")):
        proc = run([zipmoe_command("zipmoe-convert"), *args])
        assert proc.returncode == 2 and message in proc.stderr.decode(), (args, proc.stderr.decode()[-1000:])
    # nothing was touched, nothing was written
    assert before == {p.name: p.read_bytes() for p in [*ckpt.iterdir(), bf16] if p.is_file()}
    assert not (tmp_path / "z.gguf").exists() and not (tmp_path / "same.gguf").exists()


def _wait_for(pattern_dir, pattern: str, proc, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not list(pattern_dir.glob(pattern)):
        assert proc.poll() is None, f"zipmoe-convert ended (exit {proc.returncode}) before writing {pattern}"
        assert time.monotonic() < deadline, f"no {pattern} after {timeout} s"
        time.sleep(0.02)


@pytest.mark.parametrize("signum, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_an_interrupted_repacking_leaves_nothing(tmp_path, tiny_gguf, signum, code):
    """Killed halfway through writing (slow codec settings so that there is a halfway): no output,
    no partial file, a message, the signal's exit code."""
    import signal
    import subprocess

    out = tmp_path / "out.gguf"
    out_dir = tmp_path
    proc = subprocess.Popen([str(zipmoe_command("zipmoe-convert")), str(tiny_gguf("qwen2moe")), "-o", str(out),
                             "--codec", "zstd", "--level", "19", "--threads", "1", "--quiet"],
                            stderr=subprocess.PIPE, text=True)
    _wait_for(out_dir, "out.gguf.partial", proc)
    proc.send_signal(getattr(signal, signum))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert f"interrupted by {signum}" in err and "Traceback" not in err
    assert sorted(p.name for p in out_dir.iterdir()) == []


def test_an_interrupted_checkpoint_conversion_stops_the_converter_and_leaves_nothing(tmp_path, tiny_hf):
    import signal
    import subprocess
    import time

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([str(zipmoe_command("zipmoe-convert")), str(tiny_hf("qwen2moe")), "-o",
                             str(out_dir / "m.gguf"), "--quiet"], stderr=subprocess.PIPE, text=True)
    _wait_for(out_dir, ".zipmoe-*", proc)  # the intermediate BF16 GGUF's folder: the converter is running
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    time.sleep(0.5)  # a converter left running would still be writing
    assert list(out_dir.iterdir()) == []


def _small_filesystem(path, size: str = "4m") -> bool:
    """A tmpfs of `size` mounted at path, where this process may mount one (root in a VM)."""
    import subprocess

    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_is_named_and_leaves_nothing(tmp_path, tiny_gguf):
    """Output on a 4 MB filesystem (a tmpfs; where mounting is not allowed, a 4 MB file-size limit,
    which fails the same write the same way, with EFBIG instead of ENOSPC)."""
    import resource
    import signal
    import subprocess

    small = tmp_path / "small"
    mounted = _small_filesystem(small)

    def limit_file_size():
        if not mounted:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))

    try:
        out = small / "out.gguf"
        proc = subprocess.run([str(zipmoe_command("zipmoe-convert")), str(tiny_gguf("qwen2moe")), "-o", str(out),
                               "--quiet"], capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
        assert proc.returncode == 1, proc.stderr
        reason = "No space left on device" if mounted else "File too large"
        assert f"writing {out} failed: {reason}" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert list(small.iterdir()) == []
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)
