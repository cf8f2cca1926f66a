"""The build: pinned and verified source, the patch series, the installed layout."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from zipmoe_py import _lib, _paths

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import prepare_source  # noqa: E402


def test_pin_names_the_sdist_and_commit():
    pin = json.loads((REPO / "vendor/llama.cpp/pin.json").read_text())
    assert pin["sdist"]["version"] == "0.3.36"
    assert len(pin["sdist"]["sha256"]) == 64
    assert pin["llama_cpp_commit"] == "0c1e570"
    installed = json.loads((_paths.LLAMA_CPP_DIR / "pin.json").read_text())
    assert installed == pin


def _fake_sdist(tmp_path: Path, files: dict[str, bytes]) -> tuple[Path, str]:
    import io
    import tarfile

    sdist = tmp_path / "fake-0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"fake-0.0/vendor/llama.cpp/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return sdist, hashlib.sha256(sdist.read_bytes()).hexdigest()


def _pin(tmp_path: Path, sha: str) -> Path:
    pin = tmp_path / "pin.json"
    pin.write_text(json.dumps({"sdist": {"name": "fake", "version": "0.0", "filename": "fake-0.0.tar.gz",
                                         "sha256": sha, "subdir": "fake-0.0/vendor/llama.cpp"},
                               "llama_cpp_commit": "0"}))
    return pin


def _tool(*args):
    return subprocess.run([sys.executable, str(REPO / "tools/prepare_source.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_checksum_mismatch_stops_with_both_hashes(tmp_path):
    sdist, sha = _fake_sdist(tmp_path, {"a.txt": b"hello\n"})
    wrong = "0" * 64
    patches = tmp_path / "patches"
    patches.mkdir()
    proc = _tool("--pin", _pin(tmp_path, wrong), "--patches", patches, "--sdist", sdist, "--dest", tmp_path / "out")
    assert proc.returncode == 1
    assert f"expected {wrong}, got {sha}" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cached_sdist_with_wrong_hash_is_not_used(tmp_path, monkeypatch):
    sdist, sha = _fake_sdist(tmp_path, {"a.txt": b"hello\n"})
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / sdist.name).write_bytes(b"corrupted")

    def no_network(name, filename):
        raise prepare_source.PrepareError(f"{filename} is not listed on PyPI for project {name}")

    monkeypatch.setattr(prepare_source, "_sdist_url", no_network)
    pin = json.loads(_pin(tmp_path, sha).read_text())
    with pytest.raises(prepare_source.PrepareError, match="not listed on PyPI"):
        prepare_source.fetch_sdist(pin, cache)
    assert not (cache / sdist.name).exists()  # the corrupt copy was dropped, never extracted


def _patch(path: Path, old: str, new: str) -> None:
    path.write_text(f"--- a/a.txt\n+++ b/a.txt\n@@ -1 +1 @@\n-{old}\n+{new}\n")


def test_patches_apply_in_order_and_a_bad_one_is_named(tmp_path):
    sdist, sha = _fake_sdist(tmp_path, {"a.txt": b"one\n"})
    pin = _pin(tmp_path, sha)
    patches = tmp_path / "patches"
    patches.mkdir()
    _patch(patches / "0001-first.patch", "one", "two")
    _patch(patches / "0002-second.patch", "two", "three")
    dest = tmp_path / "src"
    proc = _tool("--pin", pin, "--patches", patches, "--sdist", sdist, "--dest", dest)
    assert proc.returncode == 0, proc.stderr
    assert (dest / "a.txt").read_text() == "three\n"
    # unchanged pin and patches: the tree is left alone (keeps the build incremental)
    mtime = (dest / "a.txt").stat().st_mtime_ns
    proc = _tool("--pin", pin, "--patches", patches, "--sdist", sdist, "--dest", dest)
    assert "up to date" in proc.stderr and (dest / "a.txt").stat().st_mtime_ns == mtime
    # a changed series rewrites only the files whose bytes change
    (patches / "0002-second.patch").unlink()
    proc = _tool("--pin", pin, "--patches", patches, "--sdist", sdist, "--dest", dest)
    assert proc.returncode == 0, proc.stderr
    assert (dest / "a.txt").read_text() == "two\n"
    assert (dest / "a.txt").stat().st_mtime_ns > mtime
    _patch(patches / "0002-second.patch", "two", "three")
    assert _tool("--pin", pin, "--patches", patches, "--sdist", sdist, "--dest", dest).returncode == 0

    _patch(patches / "0003-stale.patch", "one", "four")
    proc = _tool("--pin", pin, "--patches", patches, "--sdist", sdist, "--dest", dest)
    assert proc.returncode == 1
    assert "patch 0003-stale.patch does not apply" in proc.stderr
    assert (dest / "a.txt").read_text() == "three\n"  # the good tree was not replaced


def test_every_patch_applies_to_the_pinned_source(tmp_path):
    """The series, applied in order to a fresh extraction of the pinned sdist: a hunk whose context
    drifted fails here, naming the patch, before a build starts."""
    patches = prepare_source.list_patches(REPO / "vendor/llama.cpp/patches")
    assert [p.name for p in patches][0].startswith("0001-")
    for p in patches:
        assert p.read_text().startswith("--- a/"), p.name
    pin = json.loads((REPO / "vendor/llama.cpp/pin.json").read_text())
    sdist = prepare_source.fetch_sdist(pin, prepare_source.sdist_cache_dir())
    assert prepare_source.prepare(tmp_path / "llama.cpp", sdist=sdist)
    # each patch's change is in the tree
    assert "llama_zipmoe_last_error" in (tmp_path / "llama.cpp/include/llama.h").read_text()
    assert "model.zipmoe->lock_compute(this, ubatch.n_tokens > 1)" in (tmp_path / "llama.cpp/src/llama-context.cpp").read_text()
    graph = (tmp_path / "llama.cpp/src/llama-graph.cpp").read_text()
    assert "llm_graph_context::build_moe_ffn_experts(" in graph  # the refactor
    assert "llama_zipmoe::of(down_exps)" in graph                 # the hook on it


def _make_patches(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools/make_patches.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_make_patches_regenerates_the_last_patch_of_a_shared_file(tmp_path, monkeypatch):
    """A refactor patch and the hook built on it touch one file: the refactor is kept as it is, the
    hook is regenerated against pristine + refactor, and an edit that belongs to no later patch stops
    the tool instead of being folded into the wrong patch."""
    import make_patches

    pristine, tree, patches = tmp_path / "pristine", tmp_path / "tree", tmp_path / "patches"
    for d in (pristine, tree, patches):
        d.mkdir()
    (pristine / "a.txt").write_text("one\ntwo\nthree\n")
    (pristine / "b.txt").write_text("x\n")
    (patches / "0001-refactor.patch").write_text(
        "--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n")
    (patches / "0002-hook.patch").write_text(
        "--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n one\n TWO\n-three\n+hook\n")
    (tree / "a.txt").write_text("one\nTWO\nhook, edited\n")
    (tree / "b.txt").write_text("x\n")
    monkeypatch.setattr(make_patches, "PATCHES", patches)
    monkeypatch.setattr(sys, "argv", ["make_patches.py", "--tree", str(tree), "--pristine", str(pristine)])
    assert make_patches.main() == 0
    assert "+TWO" in (patches / "0001-refactor.patch").read_text()  # kept
    hook = (patches / "0002-hook.patch").read_text()
    assert "-three\n+hook, edited\n" in hook and "-two" not in hook

    (patches / "0001-refactor.patch").write_text(
        "--- a/b.txt\n+++ b/b.txt\n@@ -1 +1 @@\n-x\n+y\n"
        "--- a/a.txt\n+++ b/a.txt\n@@ -1,3 +1,3 @@\n one\n-two\n+TWO\n three\n")
    (tree / "b.txt").write_text("z\n")  # differs from the kept refactor, and no later patch has b.txt
    with pytest.raises(SystemExit, match="b.txt differs from 0001-refactor.patch as kept"):
        make_patches.main()


def _dynamic_section(path: Path) -> str:
    return subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("name", ["llama", "ggml", "ggml-base", "ggml-cpu", "ggml-rpc", "ggml-zipmoe"])
def test_libraries_are_installed_in_the_package_with_origin_rpath(name):
    lib = _paths.shared_library(name)
    assert lib.parent == _paths.LIB_DIR
    if name != "ggml-zipmoe":
        assert "$ORIGIN" in _dynamic_section(lib)


def test_programs_find_the_package_libraries():
    for name in ("llama-completion", "llama-bench", "ggml-rpc-server"):
        prog = _paths.program(name)
        assert "$ORIGIN/../lib" in _dynamic_section(prog)
        ldd = subprocess.run(["ldd", str(prog)], capture_output=True, text=True, check=True).stdout
        assert "not found" not in ldd, ldd
        resolved = {line.split()[0]: Path(line.split()[2]).resolve() for line in ldd.splitlines() if "=>" in line}
        assert resolved["libggml.so"] == _paths.LIB_DIR / "libggml.so"
        assert resolved["libggml-rpc.so"] == _paths.LIB_DIR / "libggml-rpc.so"
        if name != "ggml-rpc-server":  # ggml-only: the CPU backend is loaded through libggml
            assert resolved["libllama.so"] == _paths.LIB_DIR / "libllama.so"
            assert resolved["libggml-cpu.so"] == _paths.LIB_DIR / "libggml-cpu.so"


def test_libllama_is_the_fork_and_links_ggml_zipmoe():
    import ctypes

    libllama = _paths.shared_library("llama")
    assert "libggml-zipmoe.so" in _dynamic_section(libllama)
    fn = ctypes.CDLL(str(libllama)).llama_zipmoe_build_info  # added by patch 0001
    fn.restype = ctypes.c_char_p
    assert fn().decode() == _lib.build_info()


def test_ggml_zipmoe_version_through_its_header():
    assert _lib.version() == "0.1.0"
    assert _lib.version_number() == 100
    assert _lib.build_info().startswith("ggml-zipmoe 0.1.0 (")
    # it lists the recovery paths compiled in, the one in use among them
    compiled = _lib.build_info().split("recovery: ")[1].rstrip(")").split()
    from zipmoe_py import codec

    assert compiled == codec.recover_paths() and compiled[-1] == "scalar"
    assert codec.recover_impl() == codec.supported_recover_paths()[0]
    import platform

    assert compiled[0] == {"x86_64": "avx512bw", "aarch64": "sve"}[platform.machine()]


def _nvcc() -> str:
    """The CUDA toolkit's nvcc, else the one tools/setup.sh --dev installs from PyPI into the venv."""
    import shutil
    import sysconfig

    candidates = [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc",
                  str(Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin" / "nvcc")]
    found = next((p for p in candidates if p and Path(p).exists()), None)
    assert found, "nvcc not found: run bash tools/setup.sh --dev (it installs nvcc when the CUDA toolkit is absent)"
    return found


@pytest.mark.parametrize("arch", ["90", "87"])  # Hopper (the default) and Jetson Orin
def test_cuda_sources_compile_with_nvcc(arch, tmp_path):
    """The full ggml-cuda build is too slow for CI's 2 cores; ZipMoE's own CUDA source is compiled
    here, for the default architecture and the Jetson option (docs/CUDA.md: the GPU run)."""
    src = REPO / "ggml-zipmoe" / "src" / "gpu" / "zipmoe-cuda.cu"
    proc = subprocess.run([_nvcc(), "-std=c++17", f"-arch=sm_{arch}", "-Xcompiler", "-fPIC,-Wall",
                           "-I", str(REPO / "ggml-zipmoe" / "include"), "-I", str(REPO / "ggml-zipmoe" / "src"),
                           "-DGGML_ZIPMOE_BUILD", "-c", str(src), "-o", str(tmp_path / "zipmoe-cuda.o")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "zipmoe-cuda.o").stat().st_size > 0


def test_cpu_build_reports_no_cuda_devices():
    """A build without CUDA (CI's) reports none; llama.cpp then keeps the slots in host memory."""
    assert _lib.lib().ggml_zipmoe_cuda_devices() == 0


def test_cpu_backend_is_built_without_amx():
    """ggml-cpu's AMX buffer type makes context creation abort on quantized models (CMakeLists.txt says
    why): where the build machine has AMX, -march=native is told not to use it, so the CPU features the
    build reports name no AMX on any machine."""
    from zipmoe_py.bindings import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert "AVX" in info and "AMX" not in info, info
