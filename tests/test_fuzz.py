"""Bounded fuzzing of ggml-zipmoe's parser and decoders under ASan + UBSan: tests/fuzz/fuzz_zipmoe.c
from the seed corpus tests/fuzz/make_corpus.py makes (deterministically, for each run) plus every
past finding kept in tests/fuzz/regressions as hex text (*.hex: no binary file in the repository).

With clang (tools/setup.sh --dev installs it where it may) the harness is a coverage-guided
libFuzzer target, and ggml-zipmoe with ggml's GGUF reader is built instrumented in build/fuzz (the
project's CMake, incremental). Without clang, it is built with gcc against build/sanitize and runs
its own mutational driver (not coverage-guided). With clang the build, the harness and the run are one
command in the background (tests/conftest.py EARLY), checked here. Either way a crash leaves its input
in the run's folder and fails the test; ZIPMOE_FUZZ_SECONDS sets the length (60 s, CI's bound),
ZIPMOE_FUZZ_ENGINE=gcc picks the gcc driver."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import EARLY, early_result, start_early
from test_sanitizers import (BUILD, FLAGS, REPO, build_commands,  # noqa: F401
                             sanitized_lib)  # (sanitized_lib: the fixture)

FUZZ = REPO / "tests" / "fuzz"
SECONDS = int(os.environ.get("ZIPMOE_FUZZ_SECONDS", "60"))
SEED = "20261123"


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
ENV = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1",
       "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}
INCLUDE = ["-I", str(REPO / "ggml-zipmoe" / "include")]


def libfuzzer_commands(work: Path) -> list[list[str]]:
    """ggml-zipmoe built instrumented (incremental), the harness compiled and linked against it, the corpus
    written and the fuzzer run in `work`."""
    lib = LIBFUZZER_BUILD[0] / "ggml-zipmoe" / "libggml-zipmoe.so"
    obj, exe = work / "fuzz_zipmoe.o", work / "fuzz_zipmoe"
    link = ["-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined"]
    return [*build_commands(*LIBFUZZER_BUILD),
            [CLANG, *link, "-g", "-O1", "-DZIPMOE_LIBFUZZER", *INCLUDE, "-c", str(FUZZ / "fuzz_zipmoe.c"),
             "-o", str(obj)],
            # linked by clang++: ggml's reader needs UBSan's C++ runtime
            [CLANGXX, *link, str(obj), "-o", str(exe), str(lib), f"-Wl,-rpath,{lib.parent}"],
            [sys.executable, str(FUZZ / "make_corpus.py"), str(work / "corpus")],
            [str(exe), f"-max_total_time={SECONDS}", f"-seed={SEED}", "-timeout=30", "-rss_limit_mb=4096",
             f"-artifact_prefix={work}/", str(work / "corpus")]]


if CLANG:
    EARLY["test_fuzz.py"] = lambda folder: start_early(folder, ["sh", "-c", " && ".join(
        shlex.join(c) for c in libfuzzer_commands(folder))], env=ENV)


def _gcc_driver_run(lib: Path, work: Path) -> tuple[int, str, str]:
    """The harness with its own mutational driver, against the sanitizer build: (code, stdout, stderr's tail)."""
    exe = work / "fuzz_zipmoe"
    subprocess.run(["cc", *FLAGS.split(), "-g", "-O1", *INCLUDE, str(FUZZ / "fuzz_zipmoe.c"), "-o", str(exe),
                    str(lib), f"-Wl,-rpath,{lib.parent}"], check=True)
    subprocess.run([sys.executable, str(FUZZ / "make_corpus.py"), str(work / "corpus")], check=True,
                   capture_output=True)
    log = work / "stderr.log"  # ggml's GGUF reader logs every file it refuses: megabytes
    with open(log, "wb") as err:
        proc = subprocess.run([str(exe), str(work / "corpus"), str(SECONDS), SEED, str(work)], stderr=err,
                              stdout=subprocess.PIPE, text=True, timeout=SECONDS + 180, env=ENV)
    return proc.returncode, proc.stdout, _tail(log)


def _tail(log: Path) -> str:
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - 6000))
        return f.read().decode(errors="replace")


def test_fuzz_the_parser_and_decoders_under_sanitizers(request, tmp_path):
    if CLANG:
        engine = "libFuzzer"
        code, stdout, _, work = early_result("test_fuzz.py", timeout=1800 + SECONDS)
        stdout, tail = stdout.decode(errors="replace"), _tail(work / "stderr")
        assert (work / "corpus").is_dir() or code == 0, f"the build of the harness failed:\n{tail}"
    else:
        engine, work = "gcc driver", tmp_path
        code, stdout, tail = _gcc_driver_run(request.getfixturevalue("sanitized_lib"), work)
    crashes = [p for p in work.iterdir() if p.name == "current" or re.match(r"(crash|leak|timeout|oom)-", p.name)]
    assert code == 0 and not crashes, (
        f"{engine}: the input at {crashes} crashed the harness (keep it in tests/fuzz/regressions as hex once "
        f"fixed):\n{tail}")
    assert "AddressSanitizer" not in tail and "runtime error" not in tail, tail
    runs = int(re.search(r"(?:Done )?(\d+) runs", stdout + tail).group(1))
    print(f"\n{engine}: {runs} runs in {SECONDS} s, from {len(list((work / 'corpus').iterdir()))} corpus inputs, "
          "no crash")
    assert runs > 1000
