"""The C ABI that zipmoe_py/_lib.py mirrors by hand, checked against the headers by a C compiler.

_lib.py declares ggml-zipmoe's public structs as ctypes Structures, their enums as constants and the
functions it calls in _PROTOTYPES. A C program generated from those mirrors prints, per struct, its size
and, per field, its offset, size and kind (integer signed or not, floating, pointer) as the compiler
lays them out from ggml-zipmoe/include/*.h; the test compares them with ctypes', and the field names
with the struct's declaration in the header, so that a field added, removed, moved or retyped on either
side fails here. The memory plan exists three times (ggml_zipmoe_serving_plan, llama.h's
llama_zipmoe_memory_plan, _lib.MemoryPlan): the two C structs are held to the same field names and
types, and the Python mirror to both.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zipmoe_py import _lib

REPO = Path(__file__).resolve().parent.parent
INCLUDE = REPO / "ggml-zipmoe" / "include"
HEADERS = sorted(INCLUDE.glob("ggml-zipmoe*.h"))

# every ctypes mirror in _lib and the C structs it stands for
STRUCTS = {
    "ChunkInfo": ["ggml_zipmoe_chunk_info"],
    "CacheStats": ["ggml_zipmoe_cache_stats"],
    "BuddyParams": ["ggml_zipmoe_buddy_params"],
    "Memory": ["ggml_zipmoe_memory"],
    "MemoryPlan": ["ggml_zipmoe_serving_plan", "llama_zipmoe_memory_plan"],
    "PlanParams": ["ggml_zipmoe_plan_params"],
    "PlanResult": ["ggml_zipmoe_plan_result"],
    "DefaultPools": ["ggml_zipmoe_default_pools"],
    "CacheParams": ["ggml_zipmoe_cache_params"],
    "ServingParams": ["ggml_zipmoe_serving_params"],
    "ServingInfo": ["ggml_zipmoe_serving_info"],
    "ServingDemand": ["ggml_zipmoe_serving_demand"],
    "SchedTask": ["ggml_zipmoe_sched_task"],
    "SchedParams": ["ggml_zipmoe_sched_params"],
    "SchedOp": ["ggml_zipmoe_sched_op"],
    "SchedResult": ["ggml_zipmoe_sched_result"],
    "OptionDesc": ["ggml_zipmoe_option"],
    "OptionInput": ["ggml_zipmoe_option_input"],
    "OptionValue": ["ggml_zipmoe_option_value"],
}
# _lib's constants that are not GGML_ZIPMOE_<NAME> of a header (none today)
NOT_MIRRORED: set[str] = set()


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", " ", re.sub(r"//[^\n]*", "", text), flags=re.S)


def _split_top(text: str, sep: str) -> list[str]:
    """text split at sep outside parentheses and brackets"""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def c_fields(text: str, struct: str) -> list[str]:
    """the field names of `struct NAME { ... };` in a header's text, in order"""
    m = re.search(r"struct\s+%s\s*\{(.*?)\n\s*\};" % struct, _strip_comments(text), re.S)
    assert m, f"struct {struct} is not declared"
    names = []
    for decl in _split_top(m.group(1), ";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        pointer_to_function = re.match(r".*?\(\s*\*\s*(\w+)\s*\)\s*\(", decl)
        if pointer_to_function:
            names.append(pointer_to_function.group(1))
            continue
        first, *more = _split_top(decl, ",")
        for d in [first, *more]:
            names.append(re.match(r".*?(\w+)\s*(\[[^\]]*\]\s*)*$", d.strip()).group(1))
    return names


def _llama_include_dirs(tmp_path_factory) -> list[Path]:
    """llama.h of the fork (patch 0001 declares llama_zipmoe_memory_plan) and ggml's headers beside it: the
    prepared source of the build tree, or the pinned source prepared here"""
    for llama_h in sorted(REPO.glob("build/*/llama.cpp-src/include/llama.h")):
        if "llama_zipmoe_memory_plan" in llama_h.read_text():
            return [llama_h.parent, llama_h.parents[1] / "ggml" / "include"]
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import prepare_source
    finally:
        sys.path.remove(str(REPO / "tools"))
    import json

    pin = json.loads((REPO / "vendor/llama.cpp/pin.json").read_text())
    src = tmp_path_factory.mktemp("llama-src") / "llama.cpp"
    prepare_source.prepare(src, sdist=prepare_source.fetch_sdist(pin, prepare_source.sdist_cache_dir()))
    return [src / "include", src / "ggml" / "include"]


def _kind(ctype) -> tuple[str, list[int]]:
    """(kind, array dimensions) of a ctypes field type: kind is int/uint/float/char/pointer"""
    dims = []
    while issubclass(ctype, ctypes.Array):
        dims.append(ctype._length_)
        ctype = ctype._type_
    if ctype is ctypes.c_char:
        return "char", dims
    if ctype in (ctypes.c_float, ctypes.c_double):
        return "float", dims
    if issubclass(ctype, (ctypes._Pointer, ctypes._CFuncPtr)) or ctype in (ctypes.c_void_p, ctypes.c_char_p):
        return "pointer", dims
    assert isinstance(getattr(ctype, "_type_", None), str) and ctype._type_ in "bBhHiIlLqQ", ctype
    return ("int" if ctype._type_ in "bhilq" else "uint"), dims


# the C expression's kind: __builtin_classify_type (GCC, Clang) says integer (1), enum (3), real (8) or pointer
# (5, also an array's or function's decayed); an integer's sign from converting -1 to its type
KIND_C = r"""
#define KIND(e) (__builtin_classify_type(e) == 8 ? "float" : __builtin_classify_type(e) == 5 ? "pointer" : \
                 __builtin_classify_type(e) == 3 ? "enum" : sizeof(e) == 1 && (char) -1 == (__typeof__(e)) -1 ? "char" : \
                 (__typeof__(e)) -1 < (__typeof__(e)) 0 ? "int" : "uint")
#define KIND_P(e) (__builtin_classify_type(e) == 5 ? "pointer" : "not a pointer")
"""


def _program(includes: list[str], text: str) -> str:
    """C that prints, per mirrored struct, `S pystruct cstruct size` and per field both sides declare (text: the
    headers') `F pystruct cstruct field offset size kind`; then `C NAME value` per constant"""
    out = ["#include <stddef.h>", "#include <stdio.h>", "#include <stdint.h>",
           *[f'#include "{h}"' for h in includes], KIND_C, "int main(void) {"]
    for py_name, c_names in STRUCTS.items():
        mirror = getattr(_lib, py_name)
        for c_name in c_names:
            out.append(f'    {{ struct {c_name} s; (void) s; printf("S {py_name} {c_name} %zu\\n", sizeof s);')
            declared = set(c_fields(text, c_name))
            for field, ctype in mirror._fields_:
                if field not in declared:  # test_struct_mirror_matches_the_header names it
                    continue
                kind, dims = _kind(ctype)
                elem = f"s.{field}" + "[0]" * len(dims)
                # a pointer's kind by itself: KIND's arithmetic on it would not compile
                what = f"KIND_P({elem})" if kind == "pointer" else f"KIND({elem})"
                out.append(f'      printf("F {py_name} {c_name} {field} %zu %zu %s\\n", offsetof(struct {c_name}, '
                           f'{field}), sizeof s.{field}, {what});')
            out.append("    }")
    for name, _ in _constants():
        out.append(f'    printf("C {name} %lld\\n", (long long) GGML_ZIPMOE_{name});')
    out.append('    printf("C FORMAT_VERSION %lld\\n", (long long) GGML_ZIPMOE_FORMAT_VERSION);')
    # the two C structs of the memory plan: the same field types, one by one (names: from the headers)
    for field in c_fields(text, "ggml_zipmoe_serving_plan"):
        out.append(f"    _Static_assert(__builtin_types_compatible_p(__typeof__(((struct ggml_zipmoe_serving_plan *) 0)->"
                   f"{field}), __typeof__(((struct llama_zipmoe_memory_plan *) 0)->{field})), \"{field}\");")
    out += ["    return 0;", "}"]
    return "\n".join(out) + "\n"


def _constants() -> list[tuple[str, int]]:
    """_lib's integer constants (upper-case names; RATE_ORIGINS' names as GGML_ZIPMOE_RATE_<NAME>)"""
    found = [(name, value) for name, value in vars(_lib).items()
             if re.fullmatch(r"[A-Z][A-Z0-9_]*", name) and type(value) is int and name not in NOT_MIRRORED]
    found += [(f"RATE_{origin.upper()}", k) for k, origin in enumerate(_lib.RATE_ORIGINS)]
    return found


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> dict:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    assert cc, "no C compiler (cc) on PATH"
    llama = _llama_include_dirs(tmp_path_factory)
    texts = {h.name: h.read_text() for h in HEADERS}
    texts["llama.h"] = (llama[0] / "llama.h").read_text()
    text = "\n".join(texts.values())
    folder = tmp_path_factory.mktemp("abi")
    (folder / "abi.c").write_text(_program(list(texts), text))
    cmd = [cc, "-std=gnu11", "-Wall", "-Werror", "-I", str(INCLUDE), *[f"-I{d}" for d in llama],
           str(folder / "abi.c"), "-o", str(folder / "abi")]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, f"{' '.join(cmd)}\n{built.stderr}"
    ran = subprocess.run([str(folder / "abi")], capture_output=True, text=True, timeout=60, check=True)
    out = {"S": {}, "F": {}, "C": {}}
    for line in ran.stdout.splitlines():
        tag, *rest = line.split()
        if tag == "S":
            out["S"][(rest[0], rest[1])] = int(rest[2])
        elif tag == "F":
            out["F"][(rest[0], rest[1], rest[2])] = (int(rest[3]), int(rest[4]), rest[5])
        else:
            out["C"][rest[0]] = int(rest[1])
    out["text"] = text
    return out


def test_every_structure_of_lib_is_checked():
    mirrors = {name for name, v in vars(_lib).items() if isinstance(v, type) and issubclass(v, ctypes.Structure)
               and v.__module__ == _lib.__name__}
    assert mirrors == set(STRUCTS)


@pytest.mark.parametrize("py_name", list(STRUCTS))
def test_struct_mirror_matches_the_header(layout, py_name):
    mirror = getattr(_lib, py_name)
    for c_name in STRUCTS[py_name]:
        assert [f for f, _ in mirror._fields_] == c_fields(layout["text"], c_name), c_name
        assert layout["S"][(py_name, c_name)] == ctypes.sizeof(mirror), f"sizeof(struct {c_name})"
        for field, ctype in mirror._fields_:
            offset, size, kind = layout["F"][(py_name, c_name, field)]
            want, _ = _kind(ctype)
            assert (offset, size) == (getattr(mirror, field).offset, getattr(mirror, field).size), f"{c_name}.{field}"
            # an enum field is mirrored as a 32-bit integer, whichever sign the compiler gives the enum
            assert kind == want or (kind == "enum" and want in ("int", "uint")), f"{c_name}.{field}: C {kind}, ctypes {want}"


def test_the_memory_plan_is_one_layout_three_times(layout):
    """ggml_zipmoe_serving_plan is what llama_zipmoe_memory_plan reports, field for field (the C program
    asserts their types equal; here their names), and _lib.MemoryPlan mirrors both"""
    names = c_fields(layout["text"], "ggml_zipmoe_serving_plan")
    assert names == c_fields(layout["text"], "llama_zipmoe_memory_plan")
    assert layout["S"][("MemoryPlan", "ggml_zipmoe_serving_plan")] == layout["S"][("MemoryPlan", "llama_zipmoe_memory_plan")]


def test_constants_match_the_headers(layout):
    for name, value in _constants():
        assert layout["C"][name] == value, f"_lib.{name} = {value}, GGML_ZIPMOE_{name} = {layout['C'][name]}"


def test_the_newest_format_version_is_the_headers(layout):
    """GGML_ZIPMOE_FORMAT_VERSION (ggml-zipmoe.h) is the one place that says which zipmoe.format_version the
    library reads at newest; the converter writes none newer, and its newest is that one"""
    from zipmoe_py import format as zformat

    assert not hasattr(_lib, "FORMAT_VERSION")
    newest = max(zformat.FORMAT_VERSION, zformat.GHUF_FORMAT_VERSION, zformat.RAW_FORMAT_VERSION)
    assert newest == layout["C"]["FORMAT_VERSION"]
    assert zformat.CHUNK_ALIGNMENT == _lib.CHUNK_ALIGNMENT


def test_prototypes_name_declared_functions_with_their_arity():
    """each function in _lib._PROTOTYPES is declared in a header with as many parameters"""
    text = _strip_comments("\n".join(h.read_text() for h in HEADERS))
    for name, (_, argtypes) in _lib._PROTOTYPES.items():
        m = re.search(r"\b%s\s*\(" % name, text)
        assert m, f"{name} is not declared in {INCLUDE}"
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        params = text[m.end():i - 1].strip()
        n = 0 if params in ("", "void") else len(_split_top(params, ","))
        assert n == len(argtypes), f"{name}: {n} parameters in C, {len(argtypes)} in _PROTOTYPES"
