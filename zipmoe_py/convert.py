"""zipmoe-convert: Hugging Face MoE checkpoint -> BF16 GGUF.

Runs llama.cpp's own, unmodified convert_hf_to_gguf.py from the pinned source: the
code path real DeepSeek-V2-Lite and Qwen1.5-MoE checkpoints take. The checkpoint is
checked first so that unsupported or incomplete input fails with a message naming
the file at fault, and the output is written under a temporary name and renamed only when
complete (and, for a ZipMoE GGUF, read back: every chunk checked and decoded), so an interrupted
conversion (SIGINT, SIGTERM, a full disk) never leaves a file at the output path.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from . import _paths
from .errors import ZipMoEError, require_extra

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
    require_extra("convert", "converting a Hugging Face checkpoint")
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
            try:
                for line in proc.stdout:
                    tail.append(line.rstrip())
                    if not quiet:
                        sys.stderr.write(line)
                        sys.stderr.flush()
            except BaseException:
                proc.kill()  # interrupted: the converter must not go on writing the file removed below
                raise
        if proc.returncode != 0:
            shown = "\n".join(tail)
            raise ZipMoEError(f"llama.cpp's converter failed on {hf_dir} (exit {proc.returncode})"
                              + (f":\n{shown}" if shown else ""))
        os.replace(partial, out_path)
    finally:
        if partial.exists():
            partial.unlink()
    return out_path


def _progress_bar(total: int, desc: str, quiet: bool):
    if quiet:
        return None, lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr)

    def update(done: int):
        bar.update(done - bar.n)

    return update, bar.close


def to_zipmoe(src_gguf: Path, out_path: Path, codec: str, level: int | None, shards: int,
              threads: int | None, quiet: bool, f32_to_bf16: bool = False) -> None:
    """Repack a BF16 GGUF as a ZipMoE GGUF and report per-layer entropy and ratio."""
    from . import format as zformat
    from . import gguf_file

    header = gguf_file.read_header(src_gguf)
    total = sum(t.nbytes() for t in header.tensors)
    update, close = _progress_bar(total, f"ZipMoE {codec} K={shards}", quiet)
    try:
        result = zformat.repack(src_gguf, out_path, codec=codec, level=level, shards=shards, threads=threads,
                                progress=update, f32_to_bf16_experts=f32_to_bf16)
    finally:
        close()
    if not quiet:
        print("layer  exp. entropy (bits)  expert ratio  bound (8+H)/16", file=sys.stderr)
        for row in result.per_layer():
            print(f"{row['layer']:>5}  {row['exp_entropy_bits']:>19.3f}  {row['ratio']:>12.4f}  {row['bound']:>14.4f}",
                  file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from .codec import CODECS
    from .format import DEFAULT_CODEC, DEFAULT_SHARDS

    ap = argparse.ArgumentParser(
        prog="zipmoe-convert",
        description="Convert a Hugging Face DeepSeek-V2(-Lite) or Qwen1.5-MoE/Qwen2-MoE checkpoint to a "
                    "ZipMoE GGUF: llama.cpp's own converter (pinned, unmodified) makes a BF16 GGUF, whose "
                    "routed experts are then repacked into the ZipMoE split-bitfield format (docs/FORMAT.md); "
                    "the intermediate BF16 file is deleted unless --keep-bf16. The input may also be a BF16 "
                    "GGUF (repacked directly). With --bf16, write the plain BF16 GGUF instead.")
    ap.add_argument("source", type=Path, help="Hugging Face checkpoint folder (config.json, *.safetensors, "
                                              "tokenizer), or a BF16 GGUF file with --zipmoe")
    ap.add_argument("-o", "--outfile", type=Path, required=True, help="GGUF file to write (replaced if it exists)")
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--zipmoe", action="store_true",
                      help="write a ZipMoE GGUF (compressed exponents, raw sign+mantissa); the default")
    kind.add_argument("--bf16", action="store_true",
                      help="write a plain BF16 GGUF (what stock llama.cpp runs) instead of ZipMoE")
    ap.add_argument("--codec", choices=sorted(CODECS), default=DEFAULT_CODEC,
                    help="exponent codec (default: %(default)s, order-0 Huffman with fast table decoding; "
                         "ghuf: the layout a GPU decodes, for expert slots in CUDA memory (format version 2; "
                         "on the CPU it decodes about 14x slower than fhuf))")
    ap.add_argument("--level", type=int, default=None,
                    help="codec level (zstd 1..22, lz4 acceleration >= 1, lz4hc 1..12; default: the codec's own)")
    ap.add_argument("--shards", type=int, default=DEFAULT_SHARDS,
                    help="E-chunks per expert, K (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="compression threads (default: all cores)")
    ap.add_argument("--f32-to-bf16", action="store_true",
                    help="round F32 routed experts to BF16 (nearest even, as llama.cpp does); "
                         "lossy, so without it non-BF16 experts are refused")
    ap.add_argument("--keep-bf16", type=Path, default=None, metavar="FILE",
                    help="when converting a checkpoint: also keep the intermediate BF16 GGUF at FILE")
    ap.add_argument("-q", "--quiet", action="store_true", help="hide logs, progress bars and the ratio table")
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    problem = _outputs_overwrite_inputs(args.source, args.outfile, args.keep_bf16)
    if problem:
        ap.error(problem)
    previous_sigterm = signal.signal(signal.SIGTERM, _interrupt)
    previous_sigint = signal.signal(signal.SIGINT, _interrupt)
    try:
        if args.bf16:
            if args.source.is_file():
                raise ZipMoEError(f"{args.source} is a file: --bf16 conversion takes a checkpoint folder "
                                  "(without --bf16, a BF16 GGUF is repacked into ZipMoE)")
            out = convert_to_bf16_gguf(args.source, args.outfile, quiet=args.quiet)
            print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, BF16)")
            return 0
        if not args.outfile.parent.exists():
            raise ZipMoEError(f"output folder does not exist: {args.outfile.parent}")
        if args.source.is_file():
            to_zipmoe(args.source, args.outfile, args.codec, args.level, args.shards, args.threads, args.quiet,
                      args.f32_to_bf16)
        else:
            import tempfile

            with tempfile.TemporaryDirectory(dir=args.outfile.parent, prefix=".zipmoe-") as tmp:
                bf16 = args.keep_bf16 or Path(tmp) / "bf16.gguf"
                convert_to_bf16_gguf(args.source, bf16, quiet=args.quiet)
                to_zipmoe(bf16, args.outfile, args.codec, args.level, args.shards, args.threads, args.quiet)
        print(f"wrote {args.outfile} ({args.outfile.stat().st_size / 1e6:.1f} MB, ZipMoE {args.codec}, "
              f"K={args.shards})")
        return 0
    except ZipMoEError as e:
        print(f"zipmoe-convert: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk, a quota, a read-only folder: the partial output is already removed
        where = f" ({e.filename})" if e.filename else ""
        print(f"zipmoe-convert: error: writing {args.outfile} failed: {e.strerror or e}{where}; "
              f"{args.outfile} was not written and no partial file is left", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"zipmoe-convert: interrupted by {e}; {args.outfile} was not written and no partial file is left",
              file=sys.stderr)
        return 130 if str(e) == "SIGINT" else 143
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        signal.signal(signal.SIGINT, previous_sigint)


def _outputs_overwrite_inputs(source: Path, outfile: Path, keep_bf16: Path | None) -> str | None:
    """Why the outputs would destroy the input (or each other), or None: a conversion replaces
    its output file, so an output that is the source, or lies inside a checkpoint folder, loses it."""
    if not outfile.name or outfile.is_dir():
        return f"-o {str(outfile)!r} must name a file, not a folder"
    if keep_bf16 is not None and (not keep_bf16.name or keep_bf16.is_dir()):
        return f"--keep-bf16 {str(keep_bf16)!r} must name a file, not a folder"
    src = source.resolve()
    for flag, path in (("-o", outfile), ("--keep-bf16", keep_bf16)):
        if path is None:
            continue
        target = path.resolve()
        if target == src:
            return f"{flag} {path} is the input {source}: it would be overwritten; write elsewhere"
        if source.is_dir() and src in target.parents:
            return f"{flag} {path} lies inside the checkpoint folder {source}: write it elsewhere"
    if keep_bf16 is not None and keep_bf16.resolve() == outfile.resolve():
        return f"--keep-bf16 and -o are the same file ({outfile}): the ZipMoE GGUF would replace the BF16 one"
    return None


class Interrupted(BaseException):
    """SIGINT or SIGTERM during a conversion: unwinds like KeyboardInterrupt, so that every partial
    file is removed on the way out."""


def _interrupt(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def verify_main(argv: list[str] | None = None) -> int:
    from . import format as zformat

    ap = argparse.ArgumentParser(
        prog="zipmoe-verify",
        description="Decode every routed expert of a ZipMoE GGUF, checking every chunk's checksum; with "
                    "--against, also compare every tensor bit for bit with the BF16 GGUF it came from. "
                    "Exits 1 naming the first corrupt chunk (layer, tensor, expert, shard) or differing tensor.")
    ap.add_argument("file", type=Path, help="ZipMoE GGUF to check")
    ap.add_argument("--against", type=Path, default=None, metavar="SOURCE.gguf", help="the BF16 GGUF it was made from")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        with zformat.ZipMoEFile(args.file) as zf:
            total = zf.expert_bytes().all_experts
        update, close = _progress_bar(total, "verify", args.quiet)
        try:
            counts = zformat.verify(args.file, args.against, progress=update)
        finally:
            close()
    except ZipMoEError as e:
        print(f"zipmoe-verify: error: {e}", file=sys.stderr)
        return 1
    against = f", identical to {args.against} ({counts['other_tensors']} other tensors too)" if args.against else ""
    print(f"ok: {counts['tensors']} expert tensors, {counts['experts']} experts, {counts['chunks']} chunks "
          f"decoded with valid checksums{against}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
