"""Bounded fuzzing of ggml-zipmoe's parser and decoders under ASan + UBSan: tests/fuzz/fuzz_zipmoe.c
from the seed corpus tests/fuzz/make_corpus.py makes (deterministically, for each run) plus every
past finding kept in tests/fuzz/regressions as hex text (*.hex: no binary file in the repository).

With clang (tools/setup.sh --dev installs it where it may) the harness is a coverage-guided
libFuzzer target, and ggml-zipmoe with ggml's GGUF reader is built instrumented in build/fuzz (the
project's CMake, incremental). Without clang, it is built with gcc against build/sanitize and runs
its own mutational driver (not coverage-guided). Either way a crash leaves its input in the test's
folder and fails the run; ZIPMOE_FUZZ_SECONDS sets the length (60 s, CI's bound),
ZIPMOE_FUZZ_ENGINE=gcc picks the gcc driver."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EARLY
from test_sanitizers import (BUILD, FLAGS, REPO, build_commands, build_ggml_zipmoe,  # noqa: F401
                             sanitized_lib, start_build_early)  # (sanitized_lib: the fixture)

FUZZ = REPO / "tests" / "fuzz"
sys.path.insert(0, str(FUZZ))
from make_corpus import write_corpus  # noqa: E402

SECONDS = int(os.environ.get("ZIPMOE_FUZZ_SECONDS", "60"))


def _clang_with_libfuzzer() -> str | None:
    for clang in ("clang-14", "clang"):
        if shutil.which(clang):
            res = subprocess.run([clang, "-print-resource-dir"], capture_output=True, text=True).stdout.strip()
            if list(Path(res, "lib").glob("*/libclang_rt.fuzzer*.a")):
                return clang
    return None


# ZIPMOE_FUZZ_ENGINE=gcc forces the gcc driver where clang is installed
CLANG = None if os.environ.get("ZIPMOE_FUZZ_ENGINE") == "gcc" else _clang_with_libfuzzer()
CLANGXX = CLANG and CLANG.replace("clang", "clang++")
# clang's enum check fires in upstream gguf.cpp (benign; see the list): our own code is C, unaffected
LIBFUZZER_FLAGS = f"{FLAGS} -fsanitize-ignorelist={FUZZ / 'ubsan-ignorelist.txt'}"
# C and C++: ggml's GGUF reader is fuzzed too
LIBFUZZER_BUILD = (BUILD.parent / "fuzz", f"{LIBFUZZER_FLAGS} -fsanitize=fuzzer-no-link",
                   f"{LIBFUZZER_FLAGS} -fsanitize=fuzzer-no-link",
                   (f"-DCMAKE_C_COMPILER={CLANG}", f"-DCMAKE_CXX_COMPILER={CLANGXX}"))
if CLANG:
    EARLY["test_fuzz.py"] = lambda folder: start_build_early(folder, build_commands(*LIBFUZZER_BUILD))
ENV = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1",
       "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory) -> tuple[str, Path]:
    """(engine, executable): libFuzzer when clang is here, else the gcc driver."""
    out = tmp_path_factory.mktemp("fuzz") / "fuzz_zipmoe"
    include = ["-I", str(REPO / "ggml-zipmoe" / "include")]
    if CLANG:
        lib = build_ggml_zipmoe(*LIBFUZZER_BUILD, early="test_fuzz.py")
        obj = out.with_suffix(".o")
        link = ["-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined"]
        subprocess.run([CLANG, *link, "-g", "-O1", "-DZIPMOE_LIBFUZZER", *include, "-c",
                        str(FUZZ / "fuzz_zipmoe.c"), "-o", str(obj)], check=True)
        # linked by clang++: ggml's reader needs UBSan's C++ runtime
        subprocess.run([CLANGXX, *link, str(obj), "-o", str(out), str(lib), f"-Wl,-rpath,{lib.parent}"], check=True)
        return "libFuzzer", out
    lib = request.getfixturevalue("sanitized_lib")
    subprocess.run(["cc", *FLAGS.split(), "-g", "-O1", *include, str(FUZZ / "fuzz_zipmoe.c"), "-o", str(out),
                    str(lib), f"-Wl,-rpath,{lib.parent}"], check=True)
    return "gcc driver", out


def test_fuzz_the_parser_and_decoders_under_sanitizers(harness, tmp_path):
    engine, exe = harness
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    for f in sorted((FUZZ / "regressions").glob("*.hex")):
        (corpus / f"regression-{f.stem}.bin").write_bytes(bytes.fromhex("".join(f.read_text().split())))
    if engine == "libFuzzer":
        cmd = [str(exe), f"-max_total_time={SECONDS}", "-seed=20261123", "-timeout=30", "-rss_limit_mb=4096",
               f"-artifact_prefix={tmp_path}/", str(corpus)]
    else:
        cmd = [str(exe), str(corpus), str(SECONDS), "20261123", str(tmp_path)]
    log = tmp_path / "stderr.log"  # ggml's GGUF reader logs every file it refuses: megabytes
    with open(log, "wb") as err:
        proc = subprocess.run(cmd, stderr=err, stdout=subprocess.PIPE, text=True, timeout=SECONDS + 180, env=ENV)
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - 6000))
        tail = f.read().decode(errors="replace")
    crashes = [p for p in tmp_path.iterdir() if p.name == "current" or re.match(r"(crash|leak|timeout|oom)-", p.name)]
    assert proc.returncode == 0 and not crashes, (
        f"{engine}: the input at {crashes} crashed the harness (keep it in tests/fuzz/regressions as hex once "
        f"fixed):\n{tail}")
    assert "AddressSanitizer" not in tail and "runtime error" not in tail, tail
    runs = int(re.search(r"(?:Done )?(\d+) runs", proc.stdout + tail).group(1))
    print(f"\n{engine}: {runs} runs in {SECONDS} s, from {len(list(corpus.iterdir()))} corpus inputs, no crash")
    assert runs > 1000
