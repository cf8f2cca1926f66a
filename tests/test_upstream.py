"""llama.cpp's own checks, run against our build of the fork."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from zipmoe_py import _paths

from conftest import run


def test_backend_ops_mul_mat_id_on_cpu():
    # -b CPU is required: without it test-backend-ops skips the CPU backend and passes having tested nothing.
    # -p keeps the float expert types ZipMoE serves (BF16 first) and q8_0: the quantized types' large
    # cases take over 15 minutes on 2 cores and are not on any ZipMoE path.
    proc = run([_paths.program("test-backend-ops"), "test", "-b", "CPU", "-o", "MUL_MAT_ID",
                "-p", "type_a=(bf16|f16|f32|q8_0),"], timeout=900)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out[-3000:] + proc.stderr.decode()[-2000:]
    assert "Backend CPU" in out or "CPU" in out
    passed = [line for line in out.splitlines() if "tests passed" in line]
    assert passed, out[-3000:]
    n_ok, n_total = map(int, passed[-1].split()[0].split("/"))
    assert n_total > 200 and n_ok == n_total, passed
    assert "type_a=bf16" in out


@pytest.mark.parametrize("arch", ["deepseek2", "qwen2moe"])
def test_llama_archs(arch):
    # random models of the architecture (dense and MoE variants): CPU logits, causal-attention toggle
    # and a save/load roundtrip that must reproduce the logits exactly
    proc = run([_paths.program("test-llama-archs"), "-a", f"^{arch}$", "-b", "CPU"], timeout=900)
    out = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, out[-4000:]
    # the table's rows are printed in pieces, and llama.cpp's asynchronous logger may write a whole log line
    # ("0.00.002.486 I main: using seed ...") between them: taken out, each row is whole again
    table = re.sub(r"\d+\.\d{2}\.\d{3}\.\d{3} [DIWE] [^\n]*\n", "", re.sub(r"\x1b\[[0-9;]*m", "", out))
    rows = [line for line in table.splitlines() if line.startswith("|") and f" {arch}|" in line]
    assert any("|   MoE|" in r for r in rows), out[-4000:]
    for row in rows:  # NMSE vs. the CPU reference and the save/load roundtrip both executed and passed
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3].startswith("OK") and cells[4] == "OK", row
    # the "Summary:" line goes through llama.cpp's asynchronous logger and is sometimes lost at exit,
    # so the exit status and the per-row results are what is checked


def test_llama_cpp_pythons_own_tests(tmp_path, zipmoe_gguf):
    """llama-cpp-python's own tests (tests/ of the pinned sdist) through a plain `import llama_cpp` on our
    libllama. The model they download for the transformer cases (stories15M) comes, through an offline
    Hugging Face cache, as a tiny ZipMoE GGUF under a budget below its experts' size: a reused prompt
    cache must give what a fresh evaluation gives. The other downloads (Qwen3.5 with expected texts,
    Mamba, Falcon-H1, BGE) are deselected: no registry here serves them."""
    import json
    import os
    import sys
    import tarfile

    tools = Path(__file__).resolve().parent.parent / "tools"
    sys.path.insert(0, str(tools))
    import prepare_source

    pin = json.loads(prepare_source.DEFAULT_PIN.read_text())
    sdist = prepare_source.fetch_sdist(pin, prepare_source.sdist_cache_dir())
    with tarfile.open(sdist) as tar:
        wanted = [m for m in tar.getmembers()
                  if "/tests/" in m.name or m.name.endswith("/models/ggml-vocab-llama-spm.gguf")]
        tar.extractall(tmp_path, members=wanted, filter="data")
    source = next(tmp_path.iterdir())
    snapshot = tmp_path / "hf" / "models--ggml-org--models"
    revision = "0" * 40
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text(revision)
    model = snapshot / "snapshots" / revision / "tinyllamas" / "stories15M-q4_0.gguf"
    model.parent.mkdir(parents=True)
    model.symlink_to(zipmoe_gguf("qwen2moe"))
    environment = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_LIB_PATH"}
    environment.update(HF_HUB_CACHE=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", ZIPMOE_BUDGET="40K")
    proc = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-k",
                "transformer or version or tokenization or chat_format or grammar or speculative"],
               cwd=source, env=environment, timeout=600)
    out = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, out[-4000:]
    summary = re.search(r"(\d+) passed", out)
    assert summary and int(summary.group(1)) >= 12, out[-2000:]
