"""ggml-zipmoe's files call each other one way (docs/ARCHITECTURE.md; the order is written in
src/cache/zipmoe-cache-impl.h): a lower file of the expert cache never calls a function defined in a
higher one, the policies (policy/, lossy/) see nothing of the cache, and serving sees only the public API.

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
    ("zipmoe-preload.c", "zipmoe-substitution-hook.c", "zipmoe-pool-view.c"),
    ("zipmoe-cache.c", "zipmoe-stats.c"),
    ("zipmoe-fetch.c",),
    ("zipmoe-fetch-device.c",),
    ("zipmoe-residency.c",),
    ("zipmoe-stores.c",),
    ("zipmoe-prefetch.c",),
    ("zipmoe-fetch-io.c",),
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


def test_policies_and_serving_see_no_cache_internals():
    for folder in ("policy", "lossy", "serving"):
        for source in (SRC / folder).glob("*.[ch]"):
            includes = re.findall(r'#include "([^"]+)"', source.read_text())
            assert not any(i.startswith("cache/") for i in includes), f"{source.name} includes {includes}"


# ggml-zipmoe's folders from the bottom up: a file calls functions of its own folder or of a lower level only.
# policy (the scheduler, the planner and the default pools: pure functions of what they are given), lossy and
# gpu sit beside each other, under the cache that calls them (the fetch's schedule, the default rates, the
# default pools on the view the cache fills); serving sits on top.
SRC_LEVELS = {"common": 0, "codec": 1, "format": 2, "policy": 3, "lossy": 3, "gpu": 3, "cache": 4, "serving": 5}


def test_the_library_folders_call_downward_only():
    files = sorted(list(SRC.glob("*/*.c")) + list(SRC.glob("*/*.cu")))
    assert {f.parent.name for f in files} == set(SRC_LEVELS), "a folder was added to src/: give it a level"
    graph = calls_between(files)
    folder = {f.name: f.parent.name for f in files}
    assert graph["zipmoe-fetch.c"]["zipmoe-codec.c"]  # the reader sees calls across folders
    assert graph["zipmoe-fetch.c"]["zipmoe-sched.c"] and graph["zipmoe-pool-view.c"]["zipmoe-default-pools.c"]
    wrong = sorted((caller, callee, sorted(names)) for caller, callees in graph.items()
                   for callee, names in callees.items()
                   if folder[caller] != folder[callee] and SRC_LEVELS[folder[callee]] >= SRC_LEVELS[folder[caller]])
    assert not wrong, f"calls that go up or sideways between folders: {wrong}"


def test_the_library_folders_include_downward_only():
    for source in sorted(SRC.glob("*/*.[ch]")) + sorted(SRC.glob("*/*.cu")):
        for inc in re.findall(r'#include "(\w+)/[^"]+"', source.read_text()):
            own = source.parent.name
            assert inc == own or SRC_LEVELS[inc] < SRC_LEVELS[own], f"{own}/{source.name} includes a {inc}/ header"


PY = Path(__file__).resolve().parents[1] / "zipmoe_py"


def python_imports() -> dict[str, set[str]]:
    """{module: zipmoe_py modules it imports}, module names relative to zipmoe_py ("devtools.tiny"), every
    import counted, those inside functions too"""
    import ast

    graph = {}
    for path in sorted(PY.rglob("*.py")):
        name = ".".join(path.relative_to(PY).with_suffix("").parts).replace(".__init__", "").replace("__init__", "")
        package = name.rsplit(".", 1)[0] if "." in name and path.name != "__init__.py" else \
            (name if path.name == "__init__.py" else "")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if package else []
                    base = ".".join(p for p in base if p)
                    target = ".".join(p for p in (base, node.module or "") if p)
                elif node.module and node.module.startswith("zipmoe_py"):
                    target = node.module[len("zipmoe_py."):] if node.module != "zipmoe_py" else ""
                else:
                    continue
                for alias in node.names:  # `from . import format` names a module
                    sub = ".".join(p for p in (target, alias.name) if p)
                    found.add(sub if (PY / (sub.replace(".", "/") + ".py")).exists() else target)
            elif isinstance(node, ast.Import):
                found |= {a.name[len("zipmoe_py."):] for a in node.names if a.name.startswith("zipmoe_py.")}
        graph[name] = {m for m in found if m and m != name}
    return graph


def cli_modules() -> set[str]:
    """the modules of the package's commands (pyproject.toml's [project.scripts])"""
    text = (PY.parent / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return {m[len("zipmoe_py."):] for m in re.findall(r'=\s*"(zipmoe_py\.[\w.]+):', scripts)}


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_python_package_imports_one_way():
    graph = python_imports()
    assert "bindings" in graph["server"] and "buddy_profile" in graph["bindings"]  # the reader sees imports
    clis = cli_modules()
    assert {"cli", "server", "buddies", "devtools.tiny"} <= clis
    # the runtime (what Llama loads) reaches no command and no developer tool
    runtime = closure(graph, "bindings") | {"bindings"}
    assert not runtime & clis, f"bindings reaches the commands {sorted(runtime & clis)}"
    assert not {m for m in runtime if m.startswith("devtools")}, sorted(runtime)
    # no module but a command or a developer tool imports devtools
    devtools_users = {m for m, deps in graph.items() if any(d.startswith("devtools") for d in deps)
                      and not m.startswith("devtools") and m not in clis}
    assert not devtools_users, f"the runtime imports devtools: {sorted(devtools_users)}"
    # and no circle anywhere in the package
    circles = sorted(m for m in graph if m in closure(graph, m))
    assert not circles, f"modules in an import circle: {circles}"
