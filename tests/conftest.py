"""Shared fixtures: tiny checkpoints in both target architectures, made once per session."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

ARCHS = ["deepseek2", "qwen2moe"]
VENV_BIN = Path(sys.executable).parent

# The slow tier: what `pytest -m "not slow"` (the fast tier, a few minutes on 2 cores) leaves out. Whole
# files by what they run, and single tests of over 10 s; `pytest tests` runs both tiers.
SLOW_FILES = {
    "test_aarch64.py": "the fork emulated under qemu-user",
    "test_fuzz.py": "the libFuzzer harness",
    "test_sanitizers.py": "the library built and run under ASan and UBSan",
    "test_llama_server.py": "llama-server processes, the web UI in headless Chromium",
    "test_rpc.py": "rpc-server processes, the exactness matrix over RPC",
    "test_quantized.py": "llama-quantize into every type, the exactness matrix per type",
    "test_convert.py": "Hugging Face conversions, killed conversions",
    "test_concurrency.py": "contexts and threads at once",
    "test_faults.py": "every read of a generation failed in turn",
    "test_memory.py": "memory limits through child processes",
    "test_long_run.py": "two thousand tokens",
    "test_readme.py": "the README's commands as written",
    "test_train_tiny.py": "training runs",
    "test_accuracy_bench.py": "the accuracy harness on trained models",
    "test_light_install.py": "a second install without torch",
    "test_upstream.py": "llama-cpp-python's own tests",
    "test_tiny.py": "checkpoints made and routed again",
    "test_server.py": "zipmoe-server processes",
    "test_families.py": "a checkpoint of each MoE family made, converted, quantized and served",
    "test_gguf_skeleton.py": "models stripped, grown, filled and loaded",
}
SLOW_TESTS = {
    "test_chat_cli.py::test_the_demo_model_answers_in_words": "trains the demo model",
    "test_serve.py::test_resident_memory_stays_within_the_budget": "a child process per budget",
    "test_pools.py::test_a_migration_stays_within_the_memory_of_the_pools_before_or_after_it": "four migrations",
    "test_format.py::test_stock_gguf_py_reads_it_and_a_loader_without_zipmoe_refuses_it": "gguf-py's reader",
    "test_format.py::test_both_tiny_models_convert_to_zipmoe_and_verify": "both models converted and verified",
    "test_serve.py::test_passes_run_as_a_gpu_runs_them_are_bit_identical": "test_logits_are_bit_identical's at top-k again",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES or f"{item.path.name}::{item.originalname}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


# Commands of minutes that keep at most a core busy and whose result a test only checks (a training run,
# a build and its run, the models one file's tests share), run in the background beside the files before
# their test: the suite's tests mostly keep one core of two busy. "FILE" or "FILE::TEST" -> start(folder) -> the process, its output in
# folder/stdout and folder/stderr. A test file registers its own at import. The selected ones run one at a
# time, in the order of their tests (more at once only slow the files beside them); early_result() waits
# for one, and starts it at once if its turn has not come.
EARLY: dict = {}
_started: dict = {}
_lock = threading.Lock()
_closed = []  # set once the run ends: no command starts after it


def pytest_collection_finish(session):
    order = []
    for item in session.items:
        for name in (f"{item.path.name}::{item.originalname}", item.path.name):
            if name in EARLY and name not in order:
                order.append(name)
    if order:
        threading.Thread(target=_run_in_turn, args=(order,), daemon=True).start()


def _run_in_turn(order: list) -> None:
    for name in order:
        proc = _start(name)
        if proc is None:
            return
        proc.wait()


def _start(name: str) -> subprocess.Popen | None:
    with _lock:
        if _closed:
            return None
        if name not in _started:
            folder = Path(tempfile.mkdtemp(prefix="zipmoe-early-"))
            _started[name] = (folder, EARLY[name](folder))
        return _started[name][1]


def early_result(name: str, timeout: float) -> tuple[int, bytes, bytes, Path]:
    """(returncode, stdout, stderr, folder) of EARLY[name]'s command, started now if its turn has not come."""
    proc = _start(name)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    folder = _started[name][0]
    return code, (folder / "stdout").read_bytes(), (folder / "stderr").read_bytes(), folder


def start_early(folder: Path, cmd: list, **kwargs) -> subprocess.Popen:
    """cmd at the lowest priority: it takes the core the tests leave idle, never theirs (a torch or qemu test
    beside it otherwise runs several times slower)."""
    with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
        return subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                preexec_fn=lambda: os.nice(19), **kwargs)


def pytest_sessionfinish(session):
    with _lock:
        _closed.append(True)
        for folder, proc in _started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            shutil.rmtree(folder, ignore_errors=True)


def zipmoe_command(name: str) -> str:
    """A console script installed beside the Python running the tests."""
    path = VENV_BIN / name
    if not path.exists():
        found = shutil.which(name)
        assert found, f"{name} is not installed (run bash tools/setup.sh --dev)"
        return found
    return str(path)


def bench_module(name: str):
    """bench/NAME.py loaded as a module (bench/ is scripts, not a package), as `python bench/NAME.py` runs it:
    with bench/ on sys.path, where the scripts find bench/_common.py."""
    import importlib.util

    bench = Path(__file__).resolve().parents[1] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("timeout", 600)
    return subprocess.run([str(c) for c in cmd], **kwargs)


def premade(name: str) -> Path | None:
    """A tiny model made beforehand (the fixtures below, run elsewhere), from the folder
    ZIPMOE_TEST_MODELS names: for a machine that cannot make them (a GPU machine without the
    converter's pinned transformers). None: make it here."""
    folder = os.environ.get("ZIPMOE_TEST_MODELS")
    path = Path(folder) / name if folder else None
    return path if path is not None and path.is_file() else None


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_hf(models_dir):
    """arch -> HF checkpoint folder, made on first use."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            from zipmoe_py.devtools.tiny import make_tiny

            made[arch] = make_tiny(arch, models_dir / f"hf-{arch}", seed=1234)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def tiny_gguf(models_dir, tiny_hf):
    """arch -> BF16 GGUF converted by zipmoe-convert, made on first use."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made and premade(f"{arch}-bf16.gguf"):
            made[arch] = premade(f"{arch}-bf16.gguf")
        if arch not in made:
            out = models_dir / f"{arch}-bf16.gguf"
            proc = run([zipmoe_command("zipmoe-convert"), tiny_hf(arch), "-o", out, "--bf16", "--quiet"])
            assert proc.returncode == 0, proc.stderr.decode()
            made[arch] = out
        return made[arch]

    return get


@pytest.fixture(scope="session")
def zipmoe_gguf(models_dir, tiny_gguf):
    """arch -> ZipMoE GGUF repacked from the BF16 GGUF (default codec), made on first use. Tests that
    damage a model work on a copy."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made and premade(f"{arch}.zipmoe.gguf"):
            shutil.copyfile(premade(f"{arch}.zipmoe.gguf"), models_dir / f"{arch}.zipmoe.gguf")  # tests damage copies
            made[arch] = models_dir / f"{arch}.zipmoe.gguf"
        if arch not in made:
            from zipmoe_py import format as zformat

            out = models_dir / f"{arch}.zipmoe.gguf"
            zformat.repack(tiny_gguf(arch), out)
            made[arch] = out
        return made[arch]

    return get


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def shim(tmp_path_factory) -> Path:
    """tests/fault_shim.c compiled: the test-only LD_PRELOAD fault injector over pread(2)."""
    out = tmp_path_factory.mktemp("shim") / "fault_shim.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out),
                    str(Path(__file__).resolve().parent / "fault_shim.c"), "-ldl", "-lpthread"], check=True)
    return out
