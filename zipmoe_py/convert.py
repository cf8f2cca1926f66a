"""zipmoe-convert: Hugging Face MoE checkpoint -> BF16 GGUF.

Runs llama.cpp's own, unmodified convert_hf_to_gguf.py from the pinned source: the
code path real checkpoints take (the families of zipmoe_py/families.py; any other MoE architecture the
converter takes, with a warning that it is unverified). The checkpoint and the options
are checked first so that unsupported or incomplete input fails with a message naming the file or
option at fault, and the output is written under a temporary name of its own (OUT.<pid>.<random>.partial)
and renamed only when complete (and, for a ZipMoE GGUF, read back: every chunk checked and decoded), so an
interrupted conversion (SIGINT, SIGTERM, a full disk) never leaves a file at the output path. A
conversion holds OUT.lock (flock) while it writes OUT, so a second one to the same output is refused
instead of corrupting the first; leftovers of a killed conversion are removed by the next one.
"""
from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from . import _paths, families
from .conversion_files import (Interrupted, hold_interrupts, on_interrupt, output_lock, release_interrupts,
                               remove_stale_locks, remove_stale_work_folders, temporary_name, work_folder)
from .errors import ZipMoEError, require_extra
from .unpack import is_zipmoe

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
    if arch not in families.BY_HF_ARCHITECTURE:
        why = ("llama.cpp's converter does not take it" if arch not in converter_architectures() else
               "config.json names no routed experts (num_experts, num_local_experts, n_routed_experts, "
               "moe_num_experts)" if routed_expert_count(config) < 2 else None)
        if why is not None:
            raise ZipMoEError(f"{config_path}: architecture {arch} is not supported: {why}; ZipMoE serves "
                              f"Mixture-of-Experts models: {families.described()}")
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


def converter_architectures() -> frozenset[str]:
    """The Hugging Face architectures the vendored convert_hf_to_gguf.py writes a text GGUF for (its
    TEXT_MODEL_MAP), read from its source: importing it would take torch."""
    source = _paths.LLAMA_CPP_DIR / "conversion" / "__init__.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(getattr(target, "id", None) == "TEXT_MODEL_MAP" for target in targets) and node.value is not None:
            return frozenset(ast.literal_eval(node.value))
    return frozenset()


_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def routed_expert_count(config: dict) -> int:
    """The routed experts per layer a config.json names, or in its text_config (a model with a vision
    tower); 0 when it names none (a dense model)."""
    counts = [value for c in (config, config.get("text_config")) if isinstance(c, dict)
              for key, value in c.items() if key in _EXPERT_COUNT_KEYS and isinstance(value, int)]
    return max(counts, default=0)


def unverified_warning(hf_dir: Path) -> str | None:
    """For a checkpoint check_checkpoint accepts outside the table of families: what is and is not known."""
    arch = json.loads((hf_dir / "config.json").read_text())["architectures"][0]
    if arch in families.BY_HF_ARCHITECTURE:
        return None
    return (f"{hf_dir / 'config.json'}: {arch} is not among the families ZipMoE has verified ({families.described()}). "
            "llama.cpp's converter takes it, and its GGUF is checked as any GGUF is: served where its routed experts "
            "are gate, up and down tensors, refused naming the tensor where they are not. Compare its logits with "
            "the BF16 GGUF's (--keep-bf16) before relying on it")


def convert_to_bf16_gguf(hf_dir: Path, out_path: Path, quiet: bool = False) -> Path:
    """Convert hf_dir to a BF16 GGUF at out_path with the vendored converter.

    The converter's log and progress bar go to stderr unless quiet; its last lines are
    kept for the error message either way. It writes under a name of this process's own
    (temporary_name), so conversions to one output never write the same file.
    """
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    check_checkpoint(hf_dir)
    require_extra("convert", "converting a Hugging Face checkpoint")
    if out_path.is_dir():
        raise ZipMoEError(f"output {out_path} is a folder; give a file name such as {out_path / 'model.gguf'}")
    if not out_path.parent.exists():
        raise ZipMoEError(f"output folder does not exist: {out_path.parent}")
    partial = temporary_name(out_path, ".partial")
    cmd = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), str(_paths.converter_script()), str(hf_dir),
           "--outfile", str(partial), "--outtype", "bf16"]
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use the gguf-py it ships with
    tail: collections.deque[str] = collections.deque(maxlen=15)
    try:
        returncode = _run_converter(cmd, env, tail, lambda line: line.replace(str(partial), str(out_path)), quiet)
        if returncode != 0:
            shown = "\n".join(tail)
            raise ZipMoEError(f"llama.cpp's converter failed on {hf_dir} (exit {returncode})"
                              + (f":\n{shown}" if shown else ""))
        os.replace(partial, out_path)
    finally:
        if partial.exists():
            partial.unlink()
    return out_path


def _run_converter(cmd: list[str], env: dict, tail: collections.deque, rename, quiet: bool) -> int:
    """Run the converter, its output lines (through rename) to tail and, unless quiet, stderr; its exit
    status. An interrupt kills it and waits for it, so that nothing writes on after the caller's cleanup."""
    proc = None
    try:
        hold_interrupts()  # an interrupt inside Popen would leave its child writing on, unseen
        try:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, errors="replace", bufsize=1)
        finally:
            release_interrupts()  # one held meanwhile raises here, with proc known
        for line in proc.stdout:
            # the converter names the file it was given ("exported to ….partial"): the user's is out_path
            line = rename(line)
            tail.append(line.rstrip())
            if not quiet:
                sys.stderr.write(line)
                sys.stderr.flush()
    except BaseException:
        if proc is not None:
            proc.kill()
        raise
    finally:
        if proc is not None:
            hold_interrupts()  # a second interrupt must not leave the child unreaped
            try:
                proc.stdout.close()
                proc.wait()
            finally:
                release_interrupts()
    return proc.returncode


# Runs argv[2:] with Python after asking the kernel to SIGKILL it when process argv[1] (this one) dies
# (Linux's PR_SET_PDEATHSIG, which exec keeps): a SIGKILLed zipmoe-convert must not leave the converter
# writing on in its work folder, which the next conversion removes. A wrapper rather than a preexec_fn:
# a SIGINT/SIGTERM that lands while Popen forks with a preexec_fn is swallowed, and the conversion goes on.
_DIE_WITH_PARENT = """
import ctypes, os, sys
try:
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
    pass  # no prctl here: the converter then stops at its next write to the closed pipe
if os.getppid() != int(sys.argv[1]):
    os._exit(1)  # the parent died before the call took effect
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


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
    """Repack a GGUF as a ZipMoE GGUF (BF16 experts split, others raw) and report per-layer entropy and
    ratio of its BF16 experts, or the types stored raw."""
    from . import format as zformat
    from . import gguf_file
    from .gguf_source import GGUFSource

    with GGUFSource(src_gguf) as source:  # a split GGUF's files too
        header = source.header
    total = sum(t.nbytes() for t in header.tensors)
    # repack writes STAGING.partial and renames it to STAGING once it reads back; STAGING is this
    # process's own name (repack's fixed OUT.partial would be shared by conversions to one output)
    staging = temporary_name(Path(out_path))
    update, close = _progress_bar(total, f"ZipMoE {codec} K={shards}", quiet)
    try:
        result = zformat.repack(src_gguf, staging, codec=codec, level=level, shards=shards, threads=threads,
                                progress=update, f32_to_bf16_experts=f32_to_bf16)
        os.replace(staging, out_path)
    finally:
        close()
        if staging.exists():
            staging.unlink()
    if not quiet:
        rows = result.per_layer()
        if rows:
            print("layer  exp. entropy (bits)  expert ratio  bound (8+H)/16", file=sys.stderr)
        for row in rows:
            print(f"{row['layer']:>5}  {row['exp_entropy_bits']:>19.3f}  {row['ratio']:>12.4f}  {row['bound']:>14.4f}",
                  file=sys.stderr)
        raw = sorted({gguf_file.ggml_type_name(header.by_name[t.name].type) for t in result.tensors if t.raw})
        if raw:
            count = sum(t.raw for t in result.tensors)
            print(f"{count} routed-expert tensors stored raw ({', '.join(raw)}: nothing to decompress; served "
                  "bit for bit as in the source)", file=sys.stderr)


def to_plain(src: Path, out_path: Path, quiet: bool) -> None:
    """The plain GGUF a ZipMoE GGUF was made from (zipmoe_py/unpack.py)."""
    from . import format as zformat
    from .unpack import unpack

    with zformat.ZipMoEFile(src) as zf:
        total = zf.expert_bytes().all_experts
    staging = temporary_name(Path(out_path))
    update, close = _progress_bar(total, "plain GGUF", quiet)
    try:
        unpack(src, staging, progress=update)
        os.replace(staging, out_path)
    finally:
        close()
        if staging.exists():
            staging.unlink()


def _layout_words(path: Path, args) -> str:
    """How the experts were stored: "fhuf, K=5"; "experts stored raw (Q4_K, Q6_K)"; or both for a mix."""
    from . import format as zformat
    from .gguf_file import ggml_type_name

    with zformat.ZipMoEFile(path) as zf:
        raw = sorted({zf.type(t) for t in zf.tensors if zf.is_raw(t)})
        split = any(not zf.is_raw(t) for t in zf.tensors)
    words = [f"{args.codec}, K={args.shards}"] if split else []
    if raw:
        words.append(f"experts stored raw ({', '.join(map(ggml_type_name, raw))})")
    return "; ".join(words)


def _refuse_before_work(args, ap: argparse.ArgumentParser) -> bool:
    """Everything that can be refused is refused here, before a lock, a file or an hour of work.
    Returns whether the source is a Hugging Face checkpoint (else a GGUF)."""
    if args.level is not None:
        problem = _level_problem(args.codec, args.level)
        if problem:
            ap.error(problem)
    for flag, path in (("-o", args.outfile), ("--keep-bf16", args.keep_bf16)):
        if path is not None and not path.parent.exists():
            raise ZipMoEError(f"output folder does not exist: {path.parent}"
                              + (f" (of {flag} {path})" if flag != "-o" else ""))
    from_checkpoint = not args.source.is_file()
    if args.bf16 and not from_checkpoint:
        raise ZipMoEError(f"{args.source} is a file: --bf16 conversion takes a checkpoint folder "
                          "(without --bf16, a BF16 GGUF is repacked into ZipMoE)")
    if from_checkpoint:
        check_checkpoint(args.source)
        require_extra("convert", "converting a Hugging Face checkpoint")
        unverified = unverified_warning(args.source)
        if unverified:
            print(f"zipmoe-convert: warning: {unverified}", file=sys.stderr)
    return from_checkpoint


def _parser() -> argparse.ArgumentParser:
    from .codec import CODECS
    from .format import DEFAULT_CODEC, DEFAULT_SHARDS

    ap = argparse.ArgumentParser(
        prog="zipmoe-convert",
        description=f"Convert a Hugging Face Mixture-of-Experts checkpoint (verified: {families.described()}; "
                    "any other MoE architecture llama.cpp's converter takes, with a warning) to a ZipMoE GGUF: llama.cpp's own converter (pinned, unmodified) makes a BF16 GGUF, whose "
                    "routed experts are then repacked into the ZipMoE split-bitfield format (docs/FORMAT.md); "
                    "the intermediate BF16 file is deleted unless --keep-bf16. The input may also be a GGUF "
                    "(repacked directly): BF16 experts are split, experts of any other type (a quantized GGUF "
                    "from llama-quantize: Q8_0, Q4_K, ...; F16, F32) are stored raw, as they are. With --bf16, "
                    "write the plain BF16 GGUF instead. Given a ZipMoE GGUF, write the plain GGUF it was made "
                    "from (its tensors byte for byte).")
    ap.add_argument("source", type=Path, help="Hugging Face checkpoint folder (config.json, *.safetensors, "
                                              "tokenizer), or a GGUF file (BF16 or quantized; a ZipMoE GGUF is converted back)")
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
                    help="codec level (zstd 1..22, or negative for speed; lz4 acceleration >= 1; lz4hc 1..12; "
                         "huf, fhuf, ghuf and raw take none; default: the codec's own)")
    ap.add_argument("--shards", type=int, default=DEFAULT_SHARDS,
                    help="E-chunks per expert, K (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="compression threads (default: all cores)")
    ap.add_argument("--f32-to-bf16", action="store_true",
                    help="round F32 routed experts to BF16 (nearest even, as llama.cpp does) and split them; "
                         "lossy, so without it F32 experts are stored raw, as F32")
    ap.add_argument("--keep-bf16", type=Path, default=None, metavar="FILE",
                    help="when converting a checkpoint: also keep the intermediate BF16 GGUF at FILE")
    ap.add_argument("-q", "--quiet", action="store_true", help="hide logs, progress bars and the ratio table")
    return ap


def _convert_held(args, from_checkpoint: bool) -> None:
    """The conversion itself, with the outputs' locks held and what killed conversions left removed."""
    with contextlib.ExitStack() as held:
        # one writer per output: a second conversion to the same file is refused, not interleaved
        held.enter_context(output_lock(args.outfile))
        if args.keep_bf16 is not None:
            held.enter_context(output_lock(args.keep_bf16))
        remove_stale_work_folders(args.outfile.parent)
        remove_stale_locks(args.outfile.parent)
        if args.bf16:
            out = convert_to_bf16_gguf(args.source, args.outfile, quiet=args.quiet)
            print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, BF16)")
            return
        if not from_checkpoint and is_zipmoe(args.source):
            to_plain(args.source, args.outfile, args.quiet)
            print(f"wrote {args.outfile} ({args.outfile.stat().st_size / 1e6:.1f} MB, the plain GGUF "
                  f"{args.source} was made from)")
            return
        if not from_checkpoint:
            to_zipmoe(args.source, args.outfile, args.codec, args.level, args.shards, args.threads, args.quiet,
                      args.f32_to_bf16)
        else:
            with work_folder(args.outfile.parent) as work:
                bf16 = args.keep_bf16 or work / "bf16.gguf"
                convert_to_bf16_gguf(args.source, bf16, quiet=args.quiet)
                to_zipmoe(bf16, args.outfile, args.codec, args.level, args.shards, args.threads, args.quiet)
    print(f"wrote {args.outfile} ({args.outfile.stat().st_size / 1e6:.1f} MB, ZipMoE {_layout_words(args.outfile, args)})")


def main(argv: list[str] | None = None) -> int:
    from .format import DEFAULT_CODEC, DEFAULT_SHARDS

    ap = _parser()
    args = ap.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if not 1 <= args.shards <= MAX_SHARDS:  # format.repack's limit, checked before hours of conversion
        ap.error(f"--shards must be between 1 and {MAX_SHARDS}, got {args.shards}")
    for warning in _drop_ignored_options(args, DEFAULT_CODEC, DEFAULT_SHARDS):
        print(f"zipmoe-convert: warning: {warning}", file=sys.stderr)
    problem = _outputs_overwrite_inputs(args.source, args.outfile, args.keep_bf16)
    if problem:
        ap.error(problem)
    previous_sigterm = signal.signal(signal.SIGTERM, on_interrupt)
    previous_sigint = signal.signal(signal.SIGINT, on_interrupt)
    try:
        _convert_held(args, _refuse_before_work(args, ap))
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


MAX_SHARDS = 64  # format.repack's bound on K
# the codecs ggml_zipmoe_compress hands a level to (ggml-zipmoe's zipmoe-codec.c); the others ignore it
LEVELLED_CODECS = ("zstd", "lz4", "lz4hc")
_C_INT_MIN, _C_INT_MAX = -2 ** 31, 2 ** 31 - 1  # the C `int level`: ctypes would wrap anything wider silently


def _drop_ignored_options(args: argparse.Namespace, default_codec: str, default_shards: int) -> list[str]:
    """One warning per option given where it has no effect (and reset it, so that nothing downstream,
    such as the codec_level recorded in the file, depends on it)."""
    warnings = []
    from_checkpoint = not args.source.is_file()
    if args.bf16:
        for flag, given in (("--codec", args.codec != default_codec), ("--level", args.level is not None),
                            ("--shards", args.shards != default_shards), ("--threads", args.threads is not None),
                            ("--f32-to-bf16", args.f32_to_bf16)):
            if given:
                warnings.append(f"{flag} has no effect with --bf16: the BF16 GGUF is written as is, "
                                "nothing is repacked")
        args.level = None
    elif not from_checkpoint and _is_zipmoe_file(args.source):
        for flag, given in (("--codec", args.codec != default_codec), ("--level", args.level is not None),
                            ("--shards", args.shards != default_shards), ("--f32-to-bf16", args.f32_to_bf16),
                            ("--zipmoe", args.zipmoe)):
            if given:
                warnings.append(f"{flag} has no effect: {args.source} is a ZipMoE GGUF, converted back to the "
                                "plain GGUF it was made from")
        args.level = None
    elif args.level is not None and args.codec not in LEVELLED_CODECS:
        warnings.append(f"--level has no effect with --codec {args.codec}: only "
                        f"{', '.join(LEVELLED_CODECS[:-1])} and {LEVELLED_CODECS[-1]} take a level")
        args.level = None
    if args.f32_to_bf16 and from_checkpoint and not args.bf16:
        warnings.append("--f32-to-bf16 has no effect with a checkpoint: its BF16 conversion rounds the "
                        "routed experts to BF16 already")
    if args.keep_bf16 is not None:
        if args.bf16:
            warnings.append(f"--keep-bf16 has no effect with --bf16: the BF16 GGUF is the output, {args.outfile}")
        elif not from_checkpoint:
            warnings.append(f"--keep-bf16 has no effect: {args.source} is a GGUF file, repacked directly, "
                            "so no intermediate BF16 GGUF is made")
        else:
            return warnings
        args.keep_bf16 = None
    return warnings


def _is_zipmoe_file(path: Path) -> bool:
    """A readable ZipMoE GGUF; anything else (unreadable, not a GGUF) is named by the conversion itself."""
    try:
        return is_zipmoe(path)
    except ZipMoEError:
        return False


def _level_accepted(codec: str, level: int) -> bool:
    from . import codec as _codec

    if not _C_INT_MIN <= level <= _C_INT_MAX:
        return False
    try:
        _codec.compress(bytes(range(256)), codec, level)  # a few bytes: the library checks the level first
    except _codec.CodecError:
        return False
    return True


def _level_problem(codec: str, level: int) -> str | None:
    """Why --level is no level of codec, or None. The valid levels are the linked C library's (zstd's
    range is its version's), so they are found by compressing a few bytes, not written down here."""
    if _level_accepted(codec, level):
        return None
    return f"--level {level} is not a {codec} level: {codec} takes {_describe_levels(codec)}"


def _describe_levels(codec: str) -> str:
    """The levels the library accepts for codec, as text ("1..22 or -131072..-1"), found by trying:
    the accepted levels are runs going out from 1 and from -1."""
    runs = []
    for start, step in ((1, 1), (-1, -1)):
        if _level_accepted(codec, start):
            end = _furthest_accepted(codec, start, step)
            lo, hi = min(start, end), max(start, end)
            runs.append("1 or more" if (lo, hi) == (1, _C_INT_MAX) else
                        "any negative level" if (lo, hi) == (_C_INT_MIN, -1) else
                        str(lo) if lo == hi else f"{lo}..{hi}")
    if _level_accepted(codec, 0):
        runs.append("0")
    return " or ".join(runs) or "no level"


def _furthest_accepted(codec: str, start: int, step: int) -> int:
    """The accepted level furthest from start (accepted) going in step's direction: doubling out
    until one is refused, then bisecting back."""
    bound = _C_INT_MAX if step > 0 else _C_INT_MIN
    good, distance = start, 1
    while True:
        candidate = start + step * distance
        if (candidate - bound) * step >= 0:
            candidate = bound
        if not _level_accepted(codec, candidate):
            bad = candidate
            break
        good = candidate
        if candidate == bound:
            return good
        distance *= 2
    while abs(bad - good) > 1:
        middle = (good + bad) // 2
        if _level_accepted(codec, middle):
            good = middle
        else:
            bad = middle
    return good


def verify_main(argv: list[str] | None = None) -> int:
    from . import format as zformat

    ap = argparse.ArgumentParser(
        prog="zipmoe-verify",
        description="Decode every routed expert of a ZipMoE GGUF, checking every chunk's checksum; with "
                    "--against, also compare every tensor bit for bit with the GGUF it was made from. "
                    "Exits 1 naming the first corrupt chunk (layer, tensor, expert, shard) or differing tensor.")
    ap.add_argument("file", type=Path, help="ZipMoE GGUF to check")
    ap.add_argument("--against", type=Path, default=None, metavar="SOURCE.gguf", help="the GGUF it was made from: the BF16 GGUF for BF16 experts, the quantized GGUF "
                         "(Q4_K_M, Q8_0, ...) for a quantized model's")
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
