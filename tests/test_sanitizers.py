"""ggml-zipmoe under AddressSanitizer and UndefinedBehaviorSanitizer: the C-level tests (codecs and
recovery, the file parser and its fuzzing, the expert cache, the scheduler, the memory probe) run
again against a sanitizer build of the library, and any report fails them.

The build is the project's own CMake with the sanitizer flags, ggml-zipmoe's target only, in
build/sanitize (reused: incremental). The tests run in a child pytest with libasan preloaded (a
Python interpreter is not built with it) and _lib pointed at that build (ZIPMOE_TEST_LIBGGML_ZIPMOE).
Tests that also load libllama are left out: it is not a sanitizer build, and its C++ exceptions
do not cross an ASan-preloaded process reliably.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import EARLY, early_result, start_early

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build" / "sanitize"
FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
# the C-level tests: ggml-zipmoe through ctypes only (no libllama)
SELECTION = [str(REPO / "tests" / name) for name in ("test_codec.py", "test_cache.py", "test_sched.py",
                                                     "test_format.py", "test_memory.py", "test_substitution.py",
                                                     "test_device_slots.py")] + [
    "-k", "not both_tiny_models and not stock_gguf_py and "
          "(not test_memory or cgroup or mem_available or over_limit or this_machine) and "
          "(not test_substitution or smoe_route)"]


def build_commands(build: Path, c_flags: str, cxx_flags: str = "", cmake_args: tuple = ()) -> list[list[str]]:
    """The project's CMake configuring `build` (once) and building ggml-zipmoe (and ggml-base, whose GGUF
    reader it uses) in it, incrementally."""
    configure = ["cmake", "-S", str(REPO), "-B", str(build), "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                 f"-DPython_EXECUTABLE={sys.executable}", f"-DCMAKE_C_FLAGS={c_flags}", f"-DCMAKE_CXX_FLAGS={cxx_flags}",
                 *cmake_args]
    make = ["cmake", "--build", str(build), "-j2", "--target", "ggml-zipmoe"]
    return ([] if (build / "CMakeCache.txt").exists() else [configure]) + [make]


def build_ggml_zipmoe(build: Path, c_flags: str, cxx_flags: str = "", cmake_args: tuple = (),
                      early: str | None = None) -> Path:
    """build_commands run (after conftest.EARLY's run of them, if `early` names one); returns the library."""
    if early is not None:
        early_result(early, timeout=1800)  # its errors, if any, are the ones the commands below report
    for command in build_commands(build, c_flags, cxx_flags, cmake_args):
        proc = subprocess.run(command, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return build / "ggml-zipmoe" / "libggml-zipmoe.so"


@pytest.fixture(scope="module")
def sanitized_lib() -> Path:
    # C flags only: ggml-base's C++ stays uninstrumented (libasan is preloaded into Python, whose C++
    # runtime does not carry UBSan's)
    return build_ggml_zipmoe(BUILD, FLAGS, early="test_sanitizers.py")


def _sanitized_env(lib: Path) -> dict:
    asan = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True,
                          check=True).stdout.strip()
    return {**os.environ, "LD_PRELOAD": asan, "ZIPMOE_TEST_LIBGGML_ZIPMOE": str(lib),
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


def test_the_sanitizer_build_catches_an_overflow(sanitized_lib, tmp_path):
    """A control: recovery asked for one value more than its buffers hold is reported and stops the
    process, so a clean run below means something."""
    code = textwrap.dedent('''
        import numpy as np
        from zipmoe_py import _lib
        exp, sm, dst = np.zeros(64, np.uint8), np.zeros(64, np.uint8), np.zeros(65, np.uint16)
        u8 = lambda a: a.ctypes.data_as(_lib.c_uint8_p)
        _lib.lib().ggml_zipmoe_recover_bf16(u8(exp), u8(sm), 65, dst.ctypes.data_as(_lib.c_uint16_p))
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=_sanitized_env(sanitized_lib), cwd=tmp_path)
    assert proc.returncode != 0
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-2000:]


def _c_level_tests(folder: Path) -> subprocess.Popen:
    """conftest.EARLY's start: the sanitizer build, then the C-level tests against it in a child pytest."""
    lib = BUILD / "ggml-zipmoe" / "libggml-zipmoe.so"
    env = {k: v for k, v in _sanitized_env(lib).items() if os.environ.get(k) != v}
    child = ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "pytest", "-q", "-p",
             "no:cacheprovider", f"--basetemp={folder / 'tmp'}", *SELECTION]
    # in folder, not the repository: zipmoe_py must come from the installed package
    commands = [*build_commands(BUILD, FLAGS), child]
    return start_early(folder, ["sh", "-c", " && ".join(shlex.join(c) for c in commands)], cwd=folder)


EARLY["test_sanitizers.py"] = _c_level_tests


def test_the_c_level_tests_pass_under_asan_and_ubsan(sanitized_lib):
    code, stdout, stderr, _ = early_result("test_sanitizers.py", timeout=2400)
    stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    report = stdout[-3000:] + stderr[-3000:]
    assert "AddressSanitizer" not in stderr and "runtime error" not in stderr, report
    assert code == 0, report
    import re

    passed = re.search(r"(\d+) passed", stdout)
    assert passed and int(passed.group(1)) >= 150 and "failed" not in stdout, report
    print(f"\n{passed.group(1)} C-level tests passed under ASan + UBSan")
