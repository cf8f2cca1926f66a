"""ZipMoE on AArch64: the fork cross-compiled by tools/aarch64.py and run under qemu-user.

The tests below run the suite's own tests again, in a child pytest under an arm64 Python (Debian's
python3.11, unpacked by `tools/aarch64.py setup`) whose zipmoe_py loads the aarch64 build:
- the C-level tests (test_sanitizers.SELECTION: codecs, recovery of every BF16 bit pattern and of odd
  lengths on every recovery path the emulated CPU has, the file parser, the expert cache, the
  scheduler, the memory probe), on qemu's "max" CPU (SVE with 512-bit vectors, and NEON) and on a
  Neoverse N1 (NEON only);
- exactness (tests/aarch64_exactness.py): on the tiny DeepSeek-V2 and Qwen2-MoE models, the ZipMoE
  GGUF against the BF16 GGUF on the same aarch64 build (stock llama.cpp's path: the patches change
  nothing for a file without ZipMoE experts), every logit of prefill and decode as raw bits, at a
  budget of one token's experts, with two graph threads, on a Neoverse N1 (NEON recovery);
  llama-completion's greedy text against the BF16 GGUF's; and one sequence with SVE recovery on "max".
AArch64 is compared with AArch64 only: ARM's float kernels differ from x86's. Emulated timings mean
nothing, so nothing here is timed.

Needs the cross compilers, qemu-user and the arm64 Python: `bash tools/setup.sh --dev` as root installs
them and makes the build, which the fixture brings up to date (incrementally).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_sanitizers import SELECTION

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import aarch64  # noqa: E402  (tools/aarch64.py)

TESTS = REPO / "tests"


@pytest.fixture(scope="module")
def build():
    """The aarch64 build, brought up to date and laid out (tools/aarch64.py build)."""
    try:
        aarch64.build(os.environ.get("ZIPMOE_AARCH64_ARCH") or aarch64.DEFAULT_ARCH)
        aarch64.check_ready()
    except aarch64.SetupError as e:
        pytest.fail(f"AArch64 build: {e}")


@pytest.fixture(scope="module")
def premade_models(zipmoe_gguf, tiny_gguf, models_dir) -> Path:
    """Both tiny models, BF16 and ZipMoE GGUF, made here (the arm64 Python has no torch) in the folder
    the child's fixtures take them from (conftest.premade, ZIPMOE_TEST_MODELS)."""
    for arch in ("deepseek2", "qwen2moe"):
        for path, name in ((tiny_gguf(arch), f"{arch}-bf16.gguf"), (zipmoe_gguf(arch), f"{arch}.zipmoe.gguf")):
            assert path == models_dir / name, path
    return models_dir


# a child pytest's whole run: the longest, exactness on the Neoverse N1, takes 65 s emulated on a 2-core
# Xeon host (2026-12-03), and hosts of this workplace have computed BF16 products up to 5.6 times
# slower (docs/benchmarks/BENCHMARKS.md, "How to read the tables")
EMULATED_TIMEOUT_S = 1200


def emulated(args: list[str], tmp_path: Path, cpu: str | None = None, timeout: int = EMULATED_TIMEOUT_S,
             **env) -> subprocess.CompletedProcess:
    argv, environment = aarch64.command(args, cpu)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={**environment, **env})


def emulated_pytest(tests: list[str], tmp_path: Path, cpu: str | None = None, **env) -> str:
    proc = emulated(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests], tmp_path, cpu, **env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]
    return proc.stdout


RECOVERY = ("from zipmoe_py import _lib, codec; import platform; "
            "print(platform.machine(), codec.recover_impl(), ' '.join(codec.supported_recover_paths()), "
            "_lib.build_info().split('recovery: ')[1].rstrip(')'), sep='|')")


@pytest.mark.parametrize("cpu, chosen, supported", [
    ("max", "sve", "sve neon scalar"),                                  # SVE, 512-bit vectors
    ("max,sve-default-vector-length=16", "neon", "neon scalar"),        # SVE as wide as NEON: NEON
    ("neoverse-n1", "neon", "neon scalar"),                             # no SVE (Graviton2)
    ("cortex-a76", "neon", "neon scalar"),                              # no SVE (Raspberry Pi 5)
])
def test_the_recovery_path_is_picked_at_run_time(build, tmp_path, cpu, chosen, supported):
    proc = emulated(["python", "-c", RECOVERY], tmp_path, cpu)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().split("|") == ["aarch64", chosen, supported, "sve neon scalar"]


# C-level tests left out under emulation: the one that holds the converter's F32 rounding to PyTorch's,
# which the arm64 Python lacks; the scheduler's brute-force optimality searches (Python, a minute
# emulated; its C is held to the reference algorithm by test_matches_the_reference_algorithm_1); and
# those whose emulated minutes go to code with nothing of the CPU's own in it (byte copies of raw
# experts, a file parser's error messages, slots written through a device callback), 150 of the
# selection's 235 s emulated on a Zen 4 host (2026-12-01). Recovery, the decoders, the cache's fetches
# and fills, and the parser's round trips all run.
LEFT_OUT_EMULATED = ("f32_experts_are_rounded_only_when_asked", "test_alg_within_3_minus_1_over_L_of_opt",
                     "test_optimal_search_equals_brute_force", "test_device_slots_hold_what_host_slots_hold",
                     "test_experts_of_any_other_type_are_stored_raw_and_read_back_bit_for_bit",
                     "test_a_different_source_is_named_by_layer_tensor_and_expert",
                     "test_truncated_file_wrong_version_and_bad_offsets_are_clear_errors",
                     "test_a_flipped_byte_is_named_by_layer_tensor_expert_and_shard")


def test_the_c_level_tests_pass_on_aarch64(build, tmp_path):
    files, keyword = SELECTION[:-2], SELECTION[-1]
    assert SELECTION[-2] == "-k"
    left_out = " ".join(f"and not {name}" for name in LEFT_OUT_EMULATED)
    out = emulated_pytest([*files, "-k", f"({keyword}) {left_out}"], tmp_path)
    assert int(re.search(r"(\d+) passed", out).group(1)) >= 200, out[-2000:]


def test_recovery_on_a_cpu_without_sve(build, tmp_path):
    """Recovery again where NEON is the best path (the run above made SVE the default): the path picked
    at run time is all that differs between the two CPUs on the same build, so the codecs' other tests
    (run above) are not repeated."""
    out = emulated_pytest([str(TESTS / "test_codec.py"), "-k", "recover or bit_pattern or best_is_default"],
                          tmp_path, cpu="neoverse-n1")
    assert int(re.search(r"(\d+) passed", out).group(1)) >= 50, out[-2000:]


def test_logits_on_aarch64_are_bit_identical_to_the_bf16_gguf(build, premade_models, tmp_path):
    """tests/aarch64_exactness.py on a Neoverse N1 (NEON recovery), and llama-completion's greedy text
    against the BF16 GGUF's at the smallest budget (test_serve's CLI test)."""
    out = emulated_pytest([str(TESTS / "aarch64_exactness.py"), str(TESTS / "test_serve.py"), "-k",
                           "on_aarch64 or test_fork_cli_with_warmup"], tmp_path, cpu="neoverse-n1",
                          ZIPMOE_TEST_MODELS=str(premade_models), ZIPMOE_EXPECTED_RECOVERY="neon")
    assert "4 passed" in out, out[-2000:]


def test_sve_recovery_in_the_graph_is_bit_identical(build, premade_models, tmp_path):
    """aarch64_exactness's SVE case on qemu's "max" CPU (SVE, 512-bit vectors)."""
    out = emulated_pytest([str(TESTS / "aarch64_exactness.py"), "-k", "sve_recovery"], tmp_path,
                          ZIPMOE_TEST_MODELS=str(premade_models), ZIPMOE_EXPECTED_RECOVERY="sve")
    assert "1 passed" in out, out[-2000:]


def test_sve_instructions_are_confined_to_the_sve_recovery(build):
    """The library runs on cores without SVE (Cortex-A78AE, Neoverse N1): SVE instructions appear only in
    the functions that run after the HWCAP check. Compilers have leaked them before: a target pragma's
    region auto-vectorized the next function with SVE, and an inlined CNTB was hoisted above the check."""
    lib = aarch64.PACKAGE / "lib" / "libggml-zipmoe.so"
    listing = subprocess.run(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True,
                             text=True, check=True).stdout
    sve = re.compile(r"\bz\d+\.|\bp\d+[./]|\b(whilel[eost]|ptrue|cnt[bhwd]|addvl|movprfx)\b")
    functions, current = set(), None
    for line in listing.splitlines():
        if line.endswith(">:"):
            current = line.split("<")[1].rstrip(">:")
        elif current and "\t" in line and sve.search(line.split("\t", 1)[1].split("<")[0]):
            functions.add(current)
    assert functions == {"recover_sve", "sve_vector_bytes"}, functions
