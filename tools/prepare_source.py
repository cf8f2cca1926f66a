#!/usr/bin/env python3
"""Fetch a pinned third-party source from PyPI, verify it, extract it and apply a patch series.

Third-party sources (llama.cpp, zstd, lz4) are never committed: each has a pin.json
under vendor/ naming an sdist on PyPI, its sha256 and the folder inside it to use.
Called by the top-level CMakeLists.txt at configure time; usable by hand:

    python3 tools/prepare_source.py --dest build/llama.cpp            # llama.cpp + our patches
    python3 tools/prepare_source.py --pin vendor/zstd/pin.json --no-patches --dest build/zstd
    python3 tools/prepare_source.py --fetch-only                      # just fill the sdist cache

Only the standard library is used: this runs inside pip's isolated build environment.
Exit status is non-zero with a one-line reason on any failure.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PIN = REPO_ROOT / "vendor" / "llama.cpp" / "pin.json"
DEFAULT_PATCHES = REPO_ROOT / "vendor" / "llama.cpp" / "patches"
PYPI_SIMPLE = "https://pypi.org/simple/{name}/"
STAMP_NAME = ".zipmoe-prepared"


class PrepareError(RuntimeError):
    """A failure with a message meant for the person running the build."""


def sdist_cache_dir() -> Path:
    env = os.environ.get("ZIPMOE_SDIST_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zipmoe" / "sdist"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sdist_url(name: str, filename: str) -> str:
    """Look the file up in PyPI's JSON simple index (PEP 691)."""
    req = urllib.request.Request(PYPI_SIMPLE.format(name=name),
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        index = json.load(resp)
    for entry in index.get("files", []):
        if entry.get("filename") == filename:
            return entry["url"]
    raise PrepareError(f"{filename} is not listed on PyPI for project {name}")


def fetch_sdist(pin: dict, cache: Path) -> Path:
    """Return the verified sdist, downloading it into the cache if it is not there."""
    sd = pin["sdist"]
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / sd["filename"]
    if target.exists():
        got = sha256_of(target)
        if got == sd["sha256"]:
            return target
        print(f"prepare_source: cached {target} has sha256 {got}, expected {sd['sha256']}; "
              "downloading again", file=sys.stderr)
        target.unlink()
    url = _sdist_url(sd["name"], sd["filename"])
    print(f"prepare_source: downloading {url}", file=sys.stderr)
    fd, tmp_name = tempfile.mkstemp(dir=cache, prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=300) as resp:
            shutil.copyfileobj(resp, out, 1 << 20)
        got = sha256_of(Path(tmp_name))
        if got != sd["sha256"]:
            raise PrepareError(f"sha256 mismatch for {sd['filename']}: expected {sd['sha256']}, got {got}")
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target


def verify_sdist(path: Path, expected_sha256: str) -> None:
    got = sha256_of(path)
    if got != expected_sha256:
        raise PrepareError(f"sha256 mismatch for {path}: expected {expected_sha256}, got {got}")


def list_patches(patch_dir: Path) -> list[Path]:
    if not patch_dir.is_dir():
        return []
    return sorted(p for p in patch_dir.glob("*.patch") if p.is_file())


def apply_patches(src: Path, patches: list[Path]) -> None:
    """Apply each patch with -p1 in order; stop at the first that does not apply."""
    for patch in patches:
        # --dry-run first so that a failing patch leaves no half-applied hunks behind
        for args in (["--dry-run"], []):
            proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch",
                                   "-i", str(patch), *args],
                                  cwd=src, capture_output=True, text=True)
            if proc.returncode != 0:
                raise PrepareError(f"patch {patch.name} does not apply to llama.cpp:\n"
                                   f"{proc.stdout}{proc.stderr}".rstrip())


def _stamp(pin: dict, patches: list[Path]) -> str:
    parts = [pin["sdist"]["sha256"]] + [f"{p.name}:{sha256_of(p)}" for p in patches]
    return "\n".join(parts) + "\n"


def prepare(dest: Path, pin_path: Path = DEFAULT_PIN, patch_dir: Path = DEFAULT_PATCHES,
            cache: Path | None = None, sdist: Path | None = None) -> bool:
    """Make dest a patched llama.cpp tree. Returns False when dest was already up to date."""
    pin = json.loads(pin_path.read_text())
    patches = list_patches(patch_dir)
    stamp = _stamp(pin, patches)
    stamp_file = dest / STAMP_NAME
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return False  # keep mtimes: an untouched tree keeps the build incremental
    if sdist is None:
        sdist = fetch_sdist(pin, cache or sdist_cache_dir())
    else:
        verify_sdist(sdist, pin["sdist"]["sha256"])

    staging = dest.with_name(dest.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    prefix = pin["sdist"]["subdir"].rstrip("/") + "/"
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise PrepareError(f"{sdist} has no {prefix} folder")
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(staging, members=[m for m in members if m.name], filter="data")
    apply_patches(staging, patches)
    if dest.exists():
        _sync_tree(staging, dest)
        shutil.rmtree(staging)
    else:
        os.replace(staging, dest)
    (dest / STAMP_NAME).write_text(stamp)
    return True


def _sync_tree(src: Path, dest: Path) -> None:
    """Make dest equal to src, touching only files whose bytes differ.

    Unchanged files keep their mtimes, so changing one patch rebuilds only what it touches.
    """
    wanted = set()
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        wanted.add(rel)
        target = dest / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not (target.is_file() and target.read_bytes() == path.read_bytes()):
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)  # a fresh mtime, so the build notices the change
            shutil.copymode(path, target)
    for path in sorted(dest.rglob("*"), reverse=True):  # children before their folders
        if path.relative_to(dest) not in wanted and path.name != STAMP_NAME:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, help="where the patched llama.cpp tree goes")
    ap.add_argument("--pin", type=Path, default=DEFAULT_PIN, help="pin file (default: %(default)s)")
    ap.add_argument("--patches", type=Path, default=DEFAULT_PATCHES, help="patch folder (default: %(default)s)")
    ap.add_argument("--no-patches", action="store_true", help="apply no patches (pinned sources used as shipped)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="sdist cache folder (default: $ZIPMOE_SDIST_CACHE or ~/.cache/zipmoe/sdist)")
    ap.add_argument("--sdist", type=Path, default=None, help="use this local sdist instead of the cache")
    ap.add_argument("--fetch-only", action="store_true", help="only download and verify the sdist; print its path")
    args = ap.parse_args(argv)
    try:
        if args.fetch_only:
            pin = json.loads(args.pin.read_text())
            print(fetch_sdist(pin, args.cache or sdist_cache_dir()))
            return 0
        if args.dest is None:
            ap.error("--dest is required unless --fetch-only is given")
        if not args.no_patches and not args.patches.is_dir():
            raise PrepareError(f"patch folder not found: {args.patches} (use --no-patches for none)")
        # absolute: patch(1) runs inside the destination tree
        patches = Path(os.devnull) if args.no_patches else args.patches.resolve()
        changed = prepare(args.dest, args.pin, patches, args.cache, args.sdist)
        print(f"prepare_source: {args.dest} {'prepared' if changed else 'up to date'}", file=sys.stderr)
        return 0
    except PrepareError as e:
        print(f"prepare_source: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"prepare_source: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
