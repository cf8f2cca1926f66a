#!/usr/bin/env python3
"""Regenerate the llama.cpp patch series from an edited tree.

    python3 tools/make_patches.py --tree EDITED [--pristine DIR] [--add NAME FILE [FILE ...]]

Every patch in vendor/llama.cpp/patches is rewritten as the diff, pristine -> edited, of the files
it touches today (the files named by its `+++ b/...` lines), in the same order; a patch whose
files no longer differ is removed. --add makes a new patch NAME (e.g.
0005-context-zipmoe-sizing.patch) of the given files (paths relative to the tree). Without
--pristine the pinned sdist is extracted without patches into a temporary folder.

Each file belongs to one patch: one concern per patch, applied in name order with -p1.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PATCHES = REPO_ROOT / "vendor" / "llama.cpp" / "patches"


def files_of(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)


def diff(pristine: Path, tree: Path, rel: str) -> str:
    old, new = pristine / rel, tree / rel
    label_old = f"a/{rel}" if old.exists() else "/dev/null"
    proc = subprocess.run(["diff", "-u", "--label", label_old, "--label", f"b/{rel}",
                           str(old) if old.exists() else "/dev/null", str(new)], capture_output=True, text=True)
    if proc.returncode > 1:
        raise SystemExit(f"make_patches: diff failed for {rel}: {proc.stderr}")
    return proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, required=True, help="the edited llama.cpp tree")
    ap.add_argument("--pristine", type=Path, help="the unpatched pinned tree (default: extracted now)")
    ap.add_argument("--add", nargs="+", metavar=("NAME", "FILE"), help="a new patch and its files")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        pristine = args.pristine
        if pristine is None:
            pristine = Path(tmp) / "pristine"
            subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "prepare_source.py"), "--no-patches",
                            "--dest", str(pristine)], check=True)
        series = {p.name: files_of(p) for p in sorted(PATCHES.glob("*.patch"))}
        if args.add:
            name, *files = args.add
            if not files:
                ap.error("--add needs a patch name and at least one file")
            series[name] = files
        owner: dict[str, str] = {}
        for name, files in series.items():
            for f in files:
                if f in owner and owner[f] != name:
                    raise SystemExit(f"make_patches: {f} is in both {owner[f]} and {name}; give each file one patch")
                owner[f] = name
        for name, files in sorted(series.items()):
            text = "".join(diff(pristine, args.tree, f) for f in files)
            path = PATCHES / name
            if not text:
                if path.exists():
                    path.unlink()
                    print(f"removed {name} (no change left)")
                continue
            path.write_text(text)
            added = sum(1 for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
            removed = sum(1 for line in text.splitlines() if line.startswith("-") and not line.startswith("---"))
            print(f"{name}: {len(files)} file(s), +{added} -{removed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
