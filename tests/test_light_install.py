"""The runtime installs without torch and transformers: a fresh venv holding only pyproject.toml's
[project] dependencies runs zipmoe-chat on a ZipMoE GGUF, bit-identical to the full install, and a
command that needs the 'convert' extra says so."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import zipmoe_py

from conftest import run

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "safetensors", "tokenizers", "sentencepiece")


def test_the_runtime_dependencies_leave_out_the_heavy_ones():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [dep.split("=")[0].split(">")[0].split("<")[0].split("~")[0].strip().lower()
             for dep in project["dependencies"]]
    assert not set(names) & set(HEAVY), names
    assert "torch>=2.6" in project["optional-dependencies"]["convert"]


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory) -> Path:
    """A venv with the runtime's dependencies only, and this build's installed zipmoe_py beside them."""
    installed = Path(zipmoe_py.__file__).resolve().parent
    if not (installed / "lib").is_dir():
        pytest.fail(f"zipmoe_py is imported from {installed}, which holds no build: run .venv/bin/pytest")
    root = tmp_path_factory.mktemp("light")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    sdist = run([sys.executable, REPO / "tools" / "prepare_source.py", "--fetch-only"]).stdout.decode().strip()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python, "install", "-q"]
    env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"}
    deps = [sdist if d.startswith("llama-cpp-python") else d for d in dependencies]
    proc = run(pip + deps, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    # the package as installed (its lib/ and bin/), not the heavy venv's site-packages
    (root / "pkg").mkdir()
    (root / "pkg" / "zipmoe_py").symlink_to(installed)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zipmoe-under-test.pth").write_text(str(root / "pkg") + "\n")
    return venv


def test_zipmoe_chat_runs_a_zipmoe_gguf_without_torch(light_venv, zipmoe_gguf, tmp_path):
    python = light_venv / "bin" / "python"
    probe = run([python, "-c", "import importlib.util as u; print([m for m in %r if u.find_spec(m)])" % (HEAVY,)])
    assert probe.stdout.strip() == b"[]", probe.stdout  # none of them is importable there
    model = zipmoe_gguf("qwen2moe")
    chat = [python, "-m", "zipmoe_py.cli", model, "-p", "Hi", "-n", "8", "--temp", "0", "-s", "1", "-c", "256",
            "--budget", "256K"]
    light = run(chat, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert light.returncode == 0, light.stderr.decode()[-3000:]
    full = run([sys.executable, "-m", "zipmoe_py.cli", *chat[3:]], cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert full.returncode == 0 and light.stdout == full.stdout and light.stdout.strip()


def test_a_command_that_needs_the_convert_extra_names_it(light_venv, tmp_path):
    python = light_venv / "bin" / "python"
    for module, args in (("zipmoe_py.devtools.tiny", ["qwen2moe", tmp_path / "tiny"]), ("zipmoe_py.cli", ["-p", "Hi"])):
        proc = run([python, "-m", module, *args], cwd=tmp_path, stdin=subprocess.DEVNULL,
                   env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
        assert proc.returncode == 1, proc.stderr.decode()[-2000:]
        assert b"install the 'convert' extra (pip install 'zipmoe[convert]'" in proc.stderr, proc.stderr
