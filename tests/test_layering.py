"""ggml-zipmoe's files call each other one way (docs/ARCHITECTURE.md; the order is written in
src/cache/zipmoe-cache-impl.h): a lower file of the expert cache never calls a function defined in a
higher one, the lossy policies see nothing of the cache, and serving sees only the public API.

The calls are read from the sources: every function a file defines, and every call of a function
another file defines (comments removed).
"""
from __future__ import annotations

import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "ggml-zipmoe" / "src"

# the cache's files from the top down (zipmoe-cache-impl.h); a file may call those after it only
CACHE_ORDER = [
    ("zipmoe-migrate.c",),
    ("zipmoe-preload.c", "zipmoe-substitution-hook.c", "zipmoe-default-pools.c"),
    ("zipmoe-cache.c", "zipmoe-stats.c"),
    ("zipmoe-fetch.c",),
    ("zipmoe-fetch-device.c",),
    ("zipmoe-residency.c",),
    ("zipmoe-stores.c",),
    ("zipmoe-prefetch.c",),
    ("zipmoe-fetch-io.c",),
    ("zipmoe-sched.c", "zipmoe-planner.c"),
]

DEFINITION = re.compile(r"^[a-z][\w \*]*?\b((?:ggml_)?zipmoe_\w+)\([^;{]*\)\s*\{", re.M)


def code(path: Path) -> str:
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def calls_between(files: list[Path]) -> dict[str, dict[str, set[str]]]:
    """{caller file: {callee file: functions}} among `files`"""
    defined = {}
    for f in files:
        for name in DEFINITION.findall(code(f)):
            defined.setdefault(name, f.name)
    graph: dict[str, dict[str, set[str]]] = {}
    for f in files:
        text = code(f)
        for name, owner in defined.items():
            if owner != f.name and re.search(rf"\b{name}\(", text):
                graph.setdefault(f.name, {}).setdefault(owner, set()).add(name)
    return graph


def test_the_cache_files_call_downward_only():
    files = sorted((SRC / "cache").glob("*.c"))
    assert {f.name for f in files} == {name for level in CACHE_ORDER for name in level}, \
        "a file was added to or removed from src/cache: place it in CACHE_ORDER and zipmoe-cache-impl.h"
    level = {name: i for i, names in enumerate(CACHE_ORDER) for name in names}
    graph = calls_between(files)
    assert graph["zipmoe-fetch.c"]["zipmoe-residency.c"]  # the reader sees real calls
    upward = [(caller, callee, sorted(names)) for caller, callees in graph.items()
              for callee, names in callees.items() if level[callee] <= level[caller]]
    assert not upward, f"calls that go up or sideways: {upward}"


def test_lossy_policies_and_serving_see_no_cache_internals():
    for folder in ("lossy", "serving"):
        for source in (SRC / folder).glob("*.[ch]"):
            includes = re.findall(r'#include "([^"]+)"', source.read_text())
            assert not any(i.startswith("cache/") for i in includes), f"{source.name} includes {includes}"
