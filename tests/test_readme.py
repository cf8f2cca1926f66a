"""The README's command examples run as written (paths under /tmp moved into a scratch folder, .venv/bin
being the venv that runs the tests)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from conftest import VENV_BIN

README = Path(__file__).resolve().parents[1] / "README.md"


def marked_blocks() -> list[str]:
    """The bash blocks that follow a comment naming this test."""
    text = README.read_text()
    return re.findall(r"<!--[^>]*test_readme\.py[^>]*-->\s*```bash\n(.*?)```", text, flags=re.S)


def test_the_readme_marks_its_examples():
    blocks = marked_blocks()
    assert len(blocks) == 2
    assert "llama-completion" in blocks[1] and "llama-bench" in blocks[1]
    # several options go in one comma-separated --override-kv: llama.cpp keeps only the last of several
    for block in blocks:
        for command in block.replace("\\\n", " ").splitlines():
            assert command.count("--override-kv") <= 1, command


def test_the_readme_examples_run(tmp_path):
    script = "\n".join(marked_blocks())
    script = script.replace("/tmp/tiny-qwen", str(tmp_path / "tiny-qwen")).replace(".venv/bin/", f"{VENV_BIN}/")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, timeout=900)
    # random weights sampled at random: the text may split a UTF-8 character between tokens
    out, err = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, err[-3000:]
    assert "[stats] total" in err and "[stats] memory:" in err  # zipmoe-chat --stats
    assert re.search(r"\| +tg8 \|", out), out  # llama-bench's table
