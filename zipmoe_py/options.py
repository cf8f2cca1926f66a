"""ZipMoE's options, read from ggml-zipmoe's option table (ggml-zipmoe-options.h), and parsed into the
KV overrides of the fork's model loader.

The table is the single source: names, KV keys, environment variables, types, ranges, defaults and
help come from C, and values are checked by C (ggml_zipmoe_option_parse, ggml_zipmoe_options_check).
From it come Llama's zipmoe_* keyword arguments and docstring (bindings), zipmoe-chat's flags (cli),
zipmoe-server's flags and config fields (server) and docs/OPTIONS.md's options table (markdown_table).
Parsing an option never loads libllama: this module imports neither llama_cpp nor the planner.
"""
from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from . import _lib
from .errors import ZipMoEError


@dataclass(frozen=True)
class Option:
    """One row of the option table (struct ggml_zipmoe_option)."""

    id: int
    name: str                 # "budget"
    key: str | None           # "zipmoe.budget": the loader's KV override, None if it does not read it
    env: str | None           # "ZIPMOE_BUDGET"
    type: int                 # _lib.TYPE_*
    surfaces: int             # _lib.SURFACE_* or'ed
    default_text: str
    help: str
    requires: tuple[str, str] | None  # (option, value) this one needs
    choices: tuple[str, ...]  # a NAME option's

    @property
    def kwarg(self) -> str:
        """Its keyword argument of Llama and its zipmoe-server flag (without --)."""
        return f"zipmoe_{self.name}"

    @property
    def in_python(self) -> bool:
        """Given as Llama's keyword argument, zipmoe-chat's flag and zipmoe-server's flag."""
        return bool(self.surfaces & _lib.SURFACE_PYTHON)

    @property
    def expects(self) -> str:
        """What a value must be, in words (ggml_zipmoe_option_expects)."""
        buf = ctypes.create_string_buffer(512)
        _lib.lib().ggml_zipmoe_option_expects(self.id, buf, len(buf))
        return buf.value.decode()

    @property
    def python_type(self) -> str:
        return {_lib.TYPE_SIZE: "int | str", _lib.TYPE_BOOL: "bool", _lib.TYPE_INT: "int", _lib.TYPE_REAL: "float",
                _lib.TYPE_NAME: "str", _lib.TYPE_POOLS: "str | dict", _lib.TYPE_PATH: "str | os.PathLike",
                _lib.TYPE_DEVICE_SIZES: "str | dict"}[self.type]


@functools.cache
def table() -> tuple[Option, ...]:
    """Every option, in the table's order."""
    lib = _lib.lib()
    rows = []
    for i in range(lib.ggml_zipmoe_option_count()):
        o = lib.ggml_zipmoe_option_at(i).contents
        text = lambda b: b.decode() if b is not None else None  # noqa: E731
        choices = []
        while (choice := lib.ggml_zipmoe_option_choice(i, len(choices))) is not None:
            choices.append(choice.decode())
        requires = None
        if o.requires >= 0:
            needed = lib.ggml_zipmoe_option_at(o.requires).contents
            requires = (needed.name.decode(), lib.ggml_zipmoe_option_choice(o.requires, o.requires_value).decode())
        rows.append(Option(i, text(o.name), text(o.key), text(o.env), o.type, o.surfaces, text(o.default_text),
                           text(o.help), requires, tuple(choices)))
    return tuple(rows)


def python_options() -> tuple[Option, ...]:
    """The options Llama, zipmoe-chat and zipmoe-server take."""
    return tuple(o for o in table() if o.in_python)


# zipmoe-chat's own flags that an option's flag would shadow (llama.cpp's -t/--threads): those get a
# zipmoe- prefix
CHAT_OWN_FLAGS = ("threads",)


def chat_flag(option: Option) -> str:
    """Its zipmoe-chat flag: --budget, --zipmoe-threads (a boolean also has --no-NAME)."""
    return f"--{'zipmoe-' if option.name in CHAT_OWN_FLAGS else ''}{option.name.replace('_', '-')}"


def find(name: str) -> Option:
    """The option named name ("budget"), or its keyword argument ("zipmoe_budget")."""
    for o in table():
        if name in (o.name, o.kwarg):
            return o
    raise KeyError(name)


def parse_value(option: Option, value, what: str | None = None):
    """value checked by the C library against option's type and range, as the loader's KV override
    takes it (bytes, a whole number, a number, True/False, a name). A boolean option takes a Python
    bool only (bool("no") would be True); text from a command line goes through parse_text. what: how
    the caller names the option in errors (default: its keyword argument)."""
    what = what or option.kwarg
    if option.type == _lib.TYPE_DEVICE_SIZES:
        return device_sizes_text(option, value, what)
    if option.type == _lib.TYPE_BOOL:
        if not isinstance(value, bool):
            raise ZipMoEError(f"{what} must be True or False; got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ZipMoEError(f"{what} must be {option.expects}; got {value!r}")
    return parse_text(option, str(value), what, shown=value)


def parse_text(option: Option, text: str, what: str | None = None, shown=None):
    """text, as a command line or an environment variable gives it, parsed and checked by the C
    library (ggml_zipmoe_option_parse): the words it accepts are the option table's, for a boolean
    too (its true/false words). Returns the value as parse_value does. shown: the value to quote in
    errors (default: text)."""
    if option.type == _lib.TYPE_DEVICE_SIZES:
        return device_sizes_text(option, text if shown is None else shown, what or option.kwarg)
    parsed = _lib.OptionValue()
    given = _lib.OptionInput(_lib.GIVEN_TEXT, text.encode(), 0, 0.0)
    # a NUL would end the text C reads
    if "\0" in text or _lib.lib().ggml_zipmoe_option_parse(option.id, ctypes.byref(given),
                                                           ctypes.byref(parsed)) != _lib.OK:
        shown = text if shown is None else shown
        raise ZipMoEError(f"{what or option.kwarg} must be {option.expects}; got {shown!r}")
    if option.type == _lib.TYPE_BOOL:
        return bool(parsed.i)
    if option.type == _lib.TYPE_REAL:
        return parsed.f
    return option.choices[parsed.i] if option.type == _lib.TYPE_NAME else parsed.i


def device_sizes_text(option: Option, value, what: str) -> str:
    """A DEVICE_SIZES value ("CUDA0=6G CPU=8G", or {"CUDA0": "6G", "CPU": 8 << 30}) as the loader's text,
    checked by the C library."""
    if isinstance(value, dict):
        value = " ".join(f"{device}={size}" for device, size in value.items())
    if not isinstance(value, str) or "\0" in value:
        raise ZipMoEError(f"{what} must be {option.expects}; got {value!r}")
    parsed = _lib.OptionValue()
    given = _lib.OptionInput(_lib.GIVEN_TEXT, value.encode(), 0, 0.0)
    if _lib.lib().ggml_zipmoe_option_parse(option.id, ctypes.byref(given), ctypes.byref(parsed)) != _lib.OK:
        problem = ctypes.create_string_buffer(160)
        _lib.lib().ggml_zipmoe_device_sizes_problem(value.encode(), problem, len(problem))
        detail = problem.value.decode(errors="replace")
        raise ZipMoEError(f"{what} must be {option.expects}; got {value!r}" + (f": {detail}" if detail else ""))
    return " ".join(value.replace(",", " ").split())  # a comma would split llama.cpp's --override-kv


def parse_size(value, what: str = "zipmoe_budget") -> int:
    """Bytes from an int or a string like "4G", "512M", "1.5GiB" (binary units)."""
    return parse_value(find("budget"), value, what)


def size_text(n_bytes: int) -> str:
    """A size in words, as every ZipMoE message writes it ("1.25 GiB", "18.0 KiB"; ggml_zipmoe_size_text)."""
    buf = ctypes.create_string_buffer(32)
    _lib.lib().ggml_zipmoe_size_text(int(n_bytes), buf, len(buf))
    return buf.value.decode()


def pool_overrides(value, what: str = "zipmoe_pools") -> dict:
    """The KV overrides zipmoe.pool_f, pool_c, pool_s, pool_e from {"F": 4, "C": 8} or "F=4,C=8"
    (experts per MoE layer of the pools F, C, S, E)."""
    if isinstance(value, str):
        items = [item.split("=", 1) for item in value.replace(" ", "").split(",") if item]
    elif isinstance(value, dict):
        items = list(value.items())
    else:
        raise ZipMoEError(f"{what} must be {find('pools').expects}; got {value!r}")
    names = _lib.pool_names()
    pools = {}
    for item in items:
        name, count = (item + [None])[:2] if isinstance(item, list) else item
        name = str(name).upper()
        option = find(f"pool_{name.lower()}") if name in names else None
        if option is None or name in pools or count is None:
            raise ZipMoEError(f"{what}: {value!r} must name each of the pools {', '.join(names)} at most once, "
                              f"like 'F=4,C=8,E=2'")
        pools[name] = parse_value(option, count, f"{what}: {name}")
    if not any(pools.values()):
        raise ZipMoEError(f"{what}: {value!r} holds no expert; give e.g. 'F=4,C=8,E=2'")
    return {f"zipmoe.pool_{p.lower()}": pools[p] for p in names if p in pools}


def plan_overrides(plan_path) -> dict:
    """zipmoe.pool_* and zipmoe.rank_delta from a zipmoe-plan PLAN file (docs/PLAN_FORMAT.md)."""
    from .plan_files import load_plan  # only when a plan is given

    result, _ = load_plan(Path(plan_path))
    if not any(result.capacities.values()):
        raise ZipMoEError(f"{plan_path}: the plan keeps no expert in any pool "
                          "(its budget is below one expert per layer)")
    return {**pool_overrides(dict(result.capacities), f"{plan_path}: capacities"),
            "zipmoe.rank_delta": int(result.delta)}


def zipmoe_overrides(given: dict | None = None, name_of=None, **named) -> dict:
    """The KV overrides that carry ZipMoE options to the fork's model loader, from {name: value}
    (names as in the table, "budget", or keyword arguments, "zipmoe_budget"; None values are left out:
    the loader then takes the option's ZIPMOE_* environment variable, else its default). Paths
    (buddy_profile) are checked but give no override. name_of(option) names an option in errors
    (default: its keyword argument; zipmoe-chat gives its flags)."""
    name_of = name_of or (lambda o: o.kwarg)
    options = {}
    for name, value in {**(given or {}), **named}.items():
        try:
            option = find(name)
        except KeyError:
            raise ZipMoEError(f"unknown ZipMoE option {name!r}; known are "
                              f"{', '.join(o.name for o in python_options())}") from None
        if value is not None:
            options[option.name] = (option, value)
    if "plan" in options and "pools" in options:
        raise ZipMoEError(f"give {name_of(find('plan'))} or {name_of(find('pools'))}, not both (a plan sets the pools)")
    if "auto_pools" in options and ("plan" in options or "pools" in options):
        raise ZipMoEError(f"{name_of(find('auto_pools'))} is for the default pools: {name_of(find('pools'))} and "
                          f"{name_of(find('plan'))} set the pools")
    out, values = {}, (_lib.OptionValue * len(table()))()
    flags = (ctypes.c_bool * len(table()))()
    for option, value in options.values():
        if option.name == "plan":
            out.update(plan_overrides(value))
            flags[find("pools").id] = True  # a plan sets the pools: their rules apply
        elif option.type == _lib.TYPE_POOLS:
            out.update(pool_overrides(value, name_of(option)))
        elif option.type == _lib.TYPE_DEVICE_SIZES:
            out[option.key] = parse_value(option, value, name_of(option))
        elif option.type != _lib.TYPE_PATH:
            out[option.key] = parse_value(option, value, name_of(option))
            parsed = out[option.key]
            values[option.id].i = option.choices.index(parsed) if option.choices else int(parsed)
            values[option.id].f = float(parsed) if not option.choices else 0.0
        flags[option.id] = True
    err = ctypes.create_string_buffer(512)
    if _lib.lib().ggml_zipmoe_options_check(values, flags, True, b"zipmoe_", err, len(err)) != _lib.OK:
        raise ZipMoEError(re.sub(r"zipmoe_(\w+)", lambda m: name_of(find(m.group(1))), err.value.decode()))
    return out


def python_docstring() -> str:
    """The zipmoe_* keyword arguments of Llama, one paragraph each, from the table."""
    lines = []
    for o in python_options():
        env = f"; environment {o.env}" if o.env else ""
        lines.append(f"  {o.kwarg} ({o.python_type}): {o.help}. Takes {o.expects}. Default: {o.default_text}{env}.")
    return "\n".join(lines)


def markdown_table() -> str:
    """docs/OPTIONS.md's options table (tests/test_option_table.py compares it with the file)."""
    rows = ["| Python `Llama(...)` / `zipmoe-server` | `zipmoe-chat` | `--override-kv` key / environment | default | what |",
            "| --- | --- | --- | --- | --- |"]
    for o in table():
        python = f"`{o.kwarg}`" if o.in_python else ""
        chat = f"`{chat_flag(o)}`" if o.in_python else ""
        if o.in_python and o.type == _lib.TYPE_BOOL:
            chat = f"`{chat_flag(o)}`, `--no-{chat_flag(o)[2:]}`"
        loader = f"`{o.key}` / `{o.env}`" if o.key else "(Python only)"
        rows.append(f"| {python} | {chat} | {loader} | {o.default_text} | {o.help} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m zipmoe_py.options: docs/OPTIONS.md's options table
    print(markdown_table())
