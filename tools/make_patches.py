#!/usr/bin/env python3
"""Regenerate the llama.cpp patch series from an edited tree.

    python3 tools/make_patches.py --tree EDITED [--pristine DIR] [--add NAME FILE [FILE ...]]

Patches apply in name order with -p1, one concern each. Every patch in vendor/llama.cpp/patches is
rewritten as the diff of the files it touches (its `+++ b/...` lines) from the pristine source with
the earlier patches applied to the edited tree; a patch whose files no longer differ is removed.

A file may be touched by several patches (a refactor, then the hook that uses it): the earlier
patches are kept as they are and applied, and only the last one touching the file is regenerated.
A kept patch's change to a file no later patch touches must match the edited tree, or the tool
stops: such a change cannot be told apart from the edits meant for a later patch.

--add makes a new patch NAME (e.g. 0014-graph-moe-ffn-something.patch) of the given files (paths
relative to the tree). Without --pristine the pinned sdist is extracted without patches into a
temporary folder.
"""
from __future__ import annotations

import argparse
import re
import shutil
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
        last_owner: dict[str, str] = {}
        for name, files in sorted(series.items()):
            for f in files:
                last_owner[f] = name
        base = Path(tmp) / "base"  # pristine + the patches so far, for the files of the series
        for f in last_owner:
            if (pristine / f).exists():
                (base / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(pristine / f, base / f)
        for name, files in sorted(series.items()):
            path = PATCHES / name
            if any(last_owner[f] != name for f in files):
                # kept as it is: a later patch builds on its change to a shared file
                subprocess.run(["patch", "-s", "-p1", "-d", str(base), "-i", str(path)], check=True)
                for f in files:
                    if last_owner[f] == name and diff(base, args.tree, f):
                        raise SystemExit(f"make_patches: {f} differs from {name} as kept; move the edit to a later "
                                         f"patch touching {f}, or regenerate {name} by hand")
                print(f"{name}: kept (a later patch touches the same files)")
                continue
            text = "".join(diff(base, args.tree, f) for f in files)
            if not text:
                if path.exists():
                    path.unlink()
                    print(f"removed {name} (no change left)")
                continue
            path.write_text(text)
            for f in files:
                (base / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(args.tree / f, base / f)
            added = sum(1 for line in text.splitlines() if line.startswith("+") and not line.startswith("+++"))
            removed = sum(1 for line in text.splitlines() if line.startswith("-") and not line.startswith("---"))
            print(f"{name}: {len(files)} file(s), +{added} -{removed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
