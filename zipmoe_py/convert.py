"""zipmoe-convert: Hugging Face MoE checkpoint -> BF16 GGUF.

Runs llama.cpp's own, unmodified convert_hf_to_gguf.py from the pinned source: the
code path real DeepSeek-V2-Lite and Qwen1.5-MoE checkpoints take. The checkpoint is
checked first so that unsupported or incomplete input fails with a message naming
the file at fault, and the output is written under a temporary name and renamed
only when complete, so an interrupted conversion never leaves a truncated GGUF.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

from . import _paths
from .errors import ZipMoEError

# HF architecture -> what users call it
SUPPORTED_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "DeepSeek-V2 / DeepSeek-V2-Lite",
    "Qwen2MoeForCausalLM": "Qwen1.5-MoE / Qwen2-MoE",
}


def check_checkpoint(hf_dir: Path) -> str:
    """Validate a Hugging Face checkpoint folder; return its architecture."""
    if not hf_dir.exists():
        raise ZipMoEError(f"checkpoint folder not found: {hf_dir}")
    if not hf_dir.is_dir():
        raise ZipMoEError(f"{hf_dir} is a file; give the Hugging Face checkpoint folder that holds config.json")
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ZipMoEError(f"{hf_dir} has no config.json: not a Hugging Face checkpoint folder")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ZipMoEError(f"{config_path} is not valid JSON: {e}") from e
    archs = config.get("architectures") or []
    if not archs:
        raise ZipMoEError(f"{config_path} names no architecture (\"architectures\" is missing)")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{a} ({n})" for a, n in SUPPORTED_ARCHITECTURES.items())
        raise ZipMoEError(f"{config_path}: architecture {arch} is not supported; ZipMoE serves "
                          f"Mixture-of-Experts models: {supported}")
    weights = list(hf_dir.glob("*.safetensors")) + list(hf_dir.glob("pytorch_model*.bin"))
    if not weights:
        raise ZipMoEError(f"{hf_dir} has no weights (*.safetensors or pytorch_model*.bin)")
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (hf_dir / s).is_file())
        if missing:
            raise ZipMoEError(f"{index} lists weight files that are missing: {', '.join(missing)}")
    if not any((hf_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise ZipMoEError(f"{hf_dir} has no tokenizer (tokenizer.json or tokenizer.model)")
    return arch


def convert_to_bf16_gguf(hf_dir: Path, out_path: Path, quiet: bool = False) -> Path:
    """Convert hf_dir to a BF16 GGUF at out_path with the vendored converter.

    The converter's log and progress bar go to stderr unless quiet; its last lines are
    kept for the error message either way.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    check_checkpoint(hf_dir)
    if out_path.is_dir():
        raise ZipMoEError(f"output {out_path} is a folder; give a file name such as {out_path / 'model.gguf'}")
    if not out_path.parent.exists():
        raise ZipMoEError(f"output folder does not exist: {out_path.parent}")
    partial = out_path.with_name(out_path.name + ".partial")
    cmd = [sys.executable, str(_paths.converter_script()), str(hf_dir),
           "--outfile", str(partial), "--outtype", "bf16"]
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use the gguf-py it ships with
    tail: collections.deque[str] = collections.deque(maxlen=15)
    try:
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace", bufsize=1) as proc:
            for line in proc.stdout:
                tail.append(line.rstrip())
                if not quiet:
                    sys.stderr.write(line)
                    sys.stderr.flush()
        if proc.returncode != 0:
            shown = "\n".join(tail)
            raise ZipMoEError(f"llama.cpp's converter failed on {hf_dir} (exit {proc.returncode})"
                              + (f":\n{shown}" if shown else ""))
        os.replace(partial, out_path)
    finally:
        if partial.exists():
            partial.unlink()
    return out_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="zipmoe-convert",
        description="Convert a Hugging Face DeepSeek-V2(-Lite) or Qwen1.5-MoE/Qwen2-MoE checkpoint to a "
                    "BF16 GGUF with llama.cpp's own converter (pinned, unmodified).")
    ap.add_argument("hf_dir", type=Path, help="Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer)")
    ap.add_argument("-o", "--outfile", type=Path, required=True, help="GGUF file to write (replaced if it exists)")
    ap.add_argument("-q", "--quiet", action="store_true", help="hide the converter's log and progress bar")
    args = ap.parse_args(argv)
    try:
        out = convert_to_bf16_gguf(args.hf_dir, args.outfile, quiet=args.quiet)
    except ZipMoEError as e:
        print(f"zipmoe-convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, BF16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
