"""zipmoe-convert: HF checkpoint -> BF16 GGUF through the unmodified upstream converter."""
from __future__ import annotations

import json
import shutil

import pytest

from zipmoe_py import _paths
from zipmoe_py.gguf_file import read_metadata

from conftest import run, zipmoe_command

EXPECTED = {
    # arch: (general.architecture, expert count, experts used, layers with routed experts)
    "deepseek2": ("deepseek2", 16, 6, range(1, 26)),
    "qwen2moe": ("qwen2moe", 16, 4, range(0, 4)),
}


def _reader(path):
    """gguf-py's reader (upstream's: an independent check of what the file holds); it takes about 20 s on
    a tiny Qwen2-MoE GGUF (its 151,936 tokens and merges, element by element), so a test that wants one
    value reads the metadata with read_metadata"""
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
    config = {k: v for k, v in config.items() if "expert" not in k}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (dense / "config.json").write_text(json.dumps(config))
    err = _convert_error(dense, tmp_path / "out.gguf")
    assert "architecture LlamaForCausalLM is not supported: config.json names no routed experts" in err
    assert str(dense / "config.json") in err


def _checkpoint_folder(folder, config: dict):
    """A folder check_checkpoint looks at: config.json, a weights file and a tokenizer (neither read)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_a_moe_architecture_outside_the_families_is_accepted_with_a_warning(tmp_path):
    """What llama.cpp's converter takes and names routed experts converts, the GGUF then checked as any GGUF:
    MiniMax-M2 (its experts in config.json), GLM-4.5V (in its text_config); the warning names the verified
    families and the checks that still apply."""
    from zipmoe_py import convert, families

    for arch, config in (("MiniMaxM2ForCausalLM", {"num_local_experts": 256}),
                         ("Glm4vMoeForConditionalGeneration", {"text_config": {"n_routed_experts": 128}})):
        assert arch in convert.converter_architectures() and arch not in families.BY_HF_ARCHITECTURE
        folder = _checkpoint_folder(tmp_path / arch, {"architectures": [arch], **config})
        assert convert.check_checkpoint(folder) == arch
        warning = convert.unverified_warning(folder)
        assert f"{arch} is not among the families ZipMoE has verified" in warning
        assert all(f.hf_architecture in warning for f in families.FAMILIES) and "refused naming the tensor" in warning


def test_an_architecture_the_converter_does_not_take_is_refused(tmp_path):
    from zipmoe_py import ZipMoEError, convert

    folder = _checkpoint_folder(tmp_path / "made-up", {"architectures": ["MadeUpMoeForCausalLM"], "num_experts": 8})
    with pytest.raises(ZipMoEError, match="architecture MadeUpMoeForCausalLM is not supported: llama.cpp's "
                                          "converter does not take it"):
        convert.check_checkpoint(folder)


def test_every_verified_family_is_one_the_converter_takes_and_converts_without_a_warning(tmp_path):
    from zipmoe_py import convert, families

    assert {f.hf_architecture for f in families.FAMILIES} <= convert.converter_architectures()
    folder = _checkpoint_folder(tmp_path / "qwen3", {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128})
    assert convert.check_checkpoint(folder) == "Qwen3MoeForCausalLM" and convert.unverified_warning(folder) is None


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
    _wait_for(out_dir, "out.gguf.*.partial", proc)  # the process's own temporary name
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


def test_an_interrupt_held_while_another_thread_runs_waits_for_the_release():
    """A held SIGTERM raises at the release, not inside the held code, even where the process has
    other threads, to one of which the kernel gives a signal that the main thread would block."""
    import os
    import signal
    import threading

    from zipmoe_py.conversion_files import Interrupted, hold_interrupts, on_interrupt, release_interrupts

    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    previous = signal.signal(signal.SIGTERM, on_interrupt)
    try:
        hold_interrupts()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # bytecodes: where Python runs a handler that the C handler has flagged
                pass
            reached_the_end_held = True
        finally:
            with pytest.raises(Interrupted, match="SIGTERM"):
                release_interrupts()
        assert reached_the_end_held
        hold_interrupts()
        release_interrupts()  # raises nothing: the signal was raised once
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop.set()
        other.join()


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


# ---- concurrent and killed conversions ----

def _start_convert(*args) -> "subprocess.Popen":
    import subprocess

    return subprocess.Popen([str(zipmoe_command("zipmoe-convert")), *map(str, args)],
                            stderr=subprocess.PIPE, text=True)


def _verify(path) -> None:
    proc = run([zipmoe_command("zipmoe-verify"), "-q", path])
    assert proc.returncode == 0 and proc.stdout.decode().startswith("ok:"), proc.stderr.decode()


@pytest.mark.parametrize("second_source", ["gguf", "checkpoint"])
def test_a_second_conversion_to_the_same_output_is_refused(tmp_path, tiny_hf, tiny_gguf, second_source):
    """Two conversions to one output used to share OUT.partial and break each other (a vanished
    file, a false checksum mismatch). The second is refused naming the first's pid; the first's output
    is whole; a conversion to another file in the same folder goes ahead beside it."""
    import signal

    out = tmp_path / "out.gguf"
    first = _start_convert(tiny_gguf("qwen2moe"), "-o", out, "--codec", "zstd", "--level", "19",
                           "--threads", "1", "--quiet")
    try:
        _wait_for(tmp_path, "out.gguf.*.partial", first)
        first.send_signal(signal.SIGSTOP)  # holds its lock for as long as this test needs: no race
        source = tiny_gguf("qwen2moe") if second_source == "gguf" else tiny_hf("qwen2moe")
        second = run([zipmoe_command("zipmoe-convert"), source, "-o", out, "--quiet"])
        err = second.stderr.decode()
        assert second.returncode == 1, err
        assert f"{out} is being written by another zipmoe-convert (pid {first.pid})" in err, err
        assert "Traceback" not in err
        beside = run([zipmoe_command("zipmoe-convert"), tiny_gguf("qwen2moe"), "-o", tmp_path / "other.gguf",
                      "--quiet"])
        assert beside.returncode == 0, beside.stderr.decode()
    finally:
        first.send_signal(signal.SIGCONT)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    _verify(out)
    _verify(tmp_path / "other.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.gguf", "out.gguf"]  # no lock, no temporary


def _children(pid: int) -> list[int]:
    from pathlib import Path

    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    """Exited (a zombie left for an init that does not reap counts as exited)."""
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("next_output", ["m.gguf", "n.gguf"])
@pytest.mark.parametrize("killed_while", ["converting the checkpoint", "repacking"])
def test_the_leftovers_of_a_killed_conversion_are_removed_by_the_next(tmp_path, tiny_hf, tiny_gguf, killed_while,
                                                                      next_output):
    """SIGKILL leaves what no handler can remove: the work folder .zipmoe-<pid>-*/ with the half-written
    BF16 GGUF, or OUT.<pid>.*.partial, and OUT.lock (no longer locked). The converter dies with it (it
    would go on writing in the work folder), and the next conversion in that folder, to the same output
    or another, removes them."""
    import signal
    import time

    out = tmp_path / "m.gguf"
    if killed_while == "repacking":
        killed = _start_convert(tiny_gguf("qwen2moe"), "-o", out, "--codec", "zstd", "--level", "19",
                                "--threads", "1", "--quiet")
        _wait_for(tmp_path, "m.gguf.*.partial", killed)
    else:
        killed = _start_convert(tiny_hf("qwen2moe"), "-o", out, "--quiet")
        _wait_for(tmp_path, ".zipmoe-*/bf16.gguf.*.partial", killed)  # the converter is writing
    converters = _children(killed.pid) if killed_while != "repacking" else []
    killed.kill()
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL, "it ended before it was killed"
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "m.gguf.lock" in left and "m.gguf" not in left, left
    if killed_while == "repacking":
        assert any(name.startswith(f"m.gguf.{killed.pid}.") for name in left), left
    else:
        assert any(name.startswith(f".zipmoe-{killed.pid}-") for name in left), left
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in converters):
            assert time.monotonic() < deadline, f"the converter {converters} outlived its zipmoe-convert"
            time.sleep(0.1)

    again = run([zipmoe_command("zipmoe-convert"), tiny_gguf("qwen2moe"), "-o", tmp_path / next_output, "--quiet"])
    assert again.returncode == 0, again.stderr.decode()
    _verify(tmp_path / next_output)
    assert sorted(p.name for p in tmp_path.iterdir()) == [next_output]


def test_a_lock_that_is_not_a_conversions_is_kept(tmp_path, tiny_gguf):
    """Only a killed conversion's lock goes: a .lock file that holds anything but a dead pid, or whose
    writer runs, is someone else's or in use."""
    import subprocess

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        kept = {"notes.lock": "not a pid\n", "alive.gguf.lock": f"{sleeper.pid}\n", "empty.lock": ""}
        for name, text in kept.items():
            (tmp_path / name).write_text(text)
        done = run([zipmoe_command("zipmoe-convert"), tiny_gguf("qwen2moe"), "-o", tmp_path / "m.gguf", "--quiet"])
        assert done.returncode == 0, done.stderr.decode()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "m.gguf"])
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_running_conversions_work_folder_is_kept(tmp_path, tiny_hf, tiny_gguf):
    """Only dead processes' work folders are removed: one whose owner runs (here: stopped) stays."""
    import signal

    running = _start_convert(tiny_hf("qwen2moe"), "-o", tmp_path / "a.gguf", "--quiet")
    try:
        _wait_for(tmp_path, ".zipmoe-*/owner.lock", running)
        running.send_signal(signal.SIGSTOP)
        work = [p.name for p in tmp_path.glob(".zipmoe-*")]
        beside = run([zipmoe_command("zipmoe-convert"), tiny_gguf("qwen2moe"), "-o", tmp_path / "b.gguf", "-q"])
        assert beside.returncode == 0, beside.stderr.decode()
        assert [p.name for p in tmp_path.glob(".zipmoe-*")] == work
    finally:
        running.send_signal(signal.SIGCONT)
    _, err = running.communicate(timeout=300)
    assert running.returncode == 0, err
    _verify(tmp_path / "a.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf"]


# ---- options checked up front, options without effect ----

@pytest.mark.parametrize("codec, level, takes", [
    ("zstd", 99, "zstd takes 1..22 or -"),  # and the negative (fast) levels of the linked zstd
    ("zstd", 0, "zstd takes 1..22"),
    ("zstd", 2 ** 40, "zstd takes 1..22"),  # past C's int: refused, not wrapped around
    ("lz4hc", 13, "lz4hc takes 1..12"),
    ("lz4", 0, "lz4 takes 1 or more"),
])
@pytest.mark.parametrize("source", ["gguf", "checkpoint"])
def test_a_level_the_codec_refuses_is_named_before_any_work(tmp_path, tiny_hf, tiny_gguf, codec, level, takes,
                                                              source):
    src = tiny_gguf("qwen2moe") if source == "gguf" else tiny_hf("qwen2moe")
    proc = run([zipmoe_command("zipmoe-convert"), src, "-o", tmp_path / "out.gguf", "--codec", codec,
                "--level", level])
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert f"--level {level} is not a {codec} level: {takes}" in err, err
    assert "hf-to-gguf" not in err and "Traceback" not in err  # the converter never started
    assert list(tmp_path.iterdir()) == []


def test_a_level_the_codec_takes_is_used_without_warning(tmp_path, tiny_gguf):
    out = tmp_path / "out.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), tiny_gguf("qwen2moe"), "-o", out, "--codec", "lz4hc",
                "--level", "3", "--quiet"])
    assert proc.returncode == 0 and "warning" not in proc.stderr.decode(), proc.stderr.decode()
    assert read_metadata(out)["zipmoe.codec_level"] == 3


@pytest.mark.parametrize("codec", ["huf", "fhuf", "ghuf", "raw"])
def test_a_level_for_a_codec_without_levels_is_warned_about(tmp_path, tiny_gguf, codec):
    out = tmp_path / "out.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), tiny_gguf("qwen2moe"), "-o", out, "--codec", codec,
                "--level", "7", "--quiet"])
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert f"warning: --level has no effect with --codec {codec}: only zstd, lz4 and lz4hc take a level" in err
    assert len([line for line in err.splitlines() if "warning" in line]) == 1
    assert read_metadata(out)["zipmoe.codec_level"] == 0  # not a level that was never used


def test_keep_bf16_with_a_gguf_input_is_warned_about(tmp_path, tiny_gguf):
    kept = tmp_path / "kept.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), tiny_gguf("qwen2moe"), "-o", tmp_path / "out.gguf",
                "--keep-bf16", kept, "--quiet"])
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert (f"warning: --keep-bf16 has no effect: {tiny_gguf('qwen2moe')} is a GGUF file, repacked directly, "
            "so no intermediate BF16 GGUF is made") in err
    assert not kept.exists()


def test_bf16_conversion_warns_of_ignored_options_and_logs_the_final_path(tmp_path, tiny_hf):
    """--bf16 repacks nothing, so --level and --keep-bf16 do nothing; the converter's own log names the
    output, not the temporary file it was given."""
    out = tmp_path / "b.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), tiny_hf("qwen2moe"), "-o", out, "--bf16", "--level", "3",
                "--keep-bf16", tmp_path / "k.gguf"])
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert "warning: --level has no effect with --bf16" in err
    assert f"warning: --keep-bf16 has no effect with --bf16: the BF16 GGUF is the output, {out}" in err
    assert f"Model successfully exported to {out}\n" in err
    assert ".partial" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.gguf"]


def test_checkpoint_conversion_logs_the_final_path_of_the_kept_bf16(tmp_path, tiny_hf):
    kept = tmp_path / "kept.gguf"
    proc = run([zipmoe_command("zipmoe-convert"), tiny_hf("qwen2moe"), "-o", tmp_path / "z.gguf",
                "--keep-bf16", kept])
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert f"Model successfully exported to {kept}\n" in err and ".partial" not in err
    _verify(tmp_path / "z.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.gguf", "z.gguf"]


def test_verify_help_says_against_is_the_gguf_the_file_was_made_from(capsys):
    """--against is the BF16 GGUF for BF16 experts and the quantized GGUF for a quantized model's: the help
    says both, not "the BF16 GGUF" alone."""
    from zipmoe_py.convert import verify_main

    with pytest.raises(SystemExit):
        verify_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--against SOURCE.gguf the GGUF it was made from: the BF16 GGUF for BF16 experts, the quantized GGUF" in text
