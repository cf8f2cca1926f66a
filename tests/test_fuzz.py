"""Bounded fuzzing of ggml-zipmoe's parser and decoders under ASan + UBSan: tests/fuzz/fuzz_zipmoe.c
(a libFuzzer target, with its own mutational driver for gcc builds) against the sanitizer build,
from the seed corpus tests/fuzz/make_corpus.py makes (deterministically, for each run) plus every
past finding kept in tests/fuzz/regressions as hex text (*.hex: no binary file in the repository).
A crash leaves its input in the test's folder and fails the run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from test_sanitizers import FLAGS, REPO, sanitized_lib  # noqa: F401  (the fixture)

FUZZ = REPO / "tests" / "fuzz"
sys.path.insert(0, str(FUZZ))
from make_corpus import write_corpus  # noqa: E402

SECONDS = int(os.environ.get("ZIPMOE_FUZZ_SECONDS", "60"))  # CI's bound; longer runs by hand


def test_fuzz_the_parser_and_decoders_under_sanitizers(sanitized_lib, tmp_path):  # noqa: F811
    harness = tmp_path / "fuzz_zipmoe"
    subprocess.run(["cc", *FLAGS.split(), "-g", "-O1", "-I", str(REPO / "ggml-zipmoe" / "include"),
                    str(FUZZ / "fuzz_zipmoe.c"), "-o", str(harness), str(sanitized_lib),
                    f"-Wl,-rpath,{sanitized_lib.parent}"], check=True)
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    for f in sorted((FUZZ / "regressions").glob("*.hex")):
        (corpus / f"regression-{f.stem}.bin").write_bytes(bytes.fromhex("".join(f.read_text().split())))
    log = tmp_path / "stderr.log"  # ggml's GGUF reader logs every file it refuses: megabytes
    with open(log, "wb") as err:
        proc = subprocess.run([str(harness), str(corpus), str(SECONDS), "20261123", str(tmp_path)], stderr=err,
                              stdout=subprocess.PIPE, text=True, timeout=SECONDS + 120,
                              env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1",
                                   "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"})
    crash = tmp_path / "current"
    with open(log, "rb") as f:
        f.seek(max(0, log.stat().st_size - 6000))
        tail = f.read().decode(errors="replace")
    assert proc.returncode == 0 and not crash.exists(), (
        f"the input at {crash} crashed the harness (keep it in tests/fuzz/regressions as hex once fixed):\n{tail}")
    assert "AddressSanitizer" not in tail and "runtime error" not in tail, tail
    runs = int(re.search(r"(\d+) runs", proc.stdout).group(1))
    print(f"\n{proc.stdout.strip()}")
    assert runs > 1000
