"""One option table (ggml-zipmoe-options.h) behind every surface: Llama's keyword arguments and
docstring, zipmoe-chat's flags, zipmoe-server's flags and config fields, the loader's KV keys and
docs/OPTIONS.md's table list exactly the table's options, and check values through it."""
from __future__ import annotations

import inspect
import math
import re
import subprocess
from pathlib import Path

import pytest

from zipmoe_py import _lib, options
from zipmoe_py.errors import ZipMoEError

from conftest import VENV_BIN, run

REPO = Path(__file__).resolve().parents[1]


def python_kwargs() -> set[str]:
    return {o.kwarg for o in options.python_options()}


def test_the_table_is_whole_and_its_defaults_are_values_it_accepts():
    rows = options.table()
    assert len(rows) == _lib.lib().ggml_zipmoe_option_count() > 20
    for field in ("name", "key", "env"):
        values = [getattr(o, field) for o in rows if getattr(o, field) is not None]
        assert len(values) == len(set(values)), field
    for o in rows:
        assert o.name and o.help and o.default_text and "\n" not in o.help, o
        assert (o.key is None) == (o.env is None) == (not o.surfaces & _lib.SURFACE_LOADER), o
        if o.key:
            assert o.key == f"zipmoe.{o.name}" and o.env == f"ZIPMOE_{o.name.upper()}"
        desc = _lib.lib().ggml_zipmoe_option_at(o.id).contents
        if o.type in (_lib.TYPE_INT, _lib.TYPE_REAL):  # the default is in range (or the one value beside it)
            assert desc.min <= desc.value <= desc.max or desc.value == desc.also, o
            assert options.parse_value(o, repr(desc.value) if o.type == _lib.TYPE_REAL else int(desc.value)) == \
                desc.value
        if o.type == _lib.TYPE_NAME:
            assert o.choices[int(desc.value)] in o.default_text
        if o.requires:
            assert o.requires[1] in options.find(o.requires[0]).choices
    assert options.find("eviction").choices == _lib.eviction_names()
    assert options.find("substitution").choices == _lib.substitution_names()


@pytest.mark.parametrize("name, text, expected", [
    ("budget", "1.5GiB", int(1.5 * 2 ** 30)), ("budget", " 4g ", 4 << 30), ("budget", "123", 123),
    ("threads", "0", 0), ("threads", "4096", 4096), ("eviction", "LFU", "lfu"), ("buddy_tau", "-1", -1.0),
    ("buddy_tau", "0.25", 0.25), ("smoe_alpha", "1", 1.0), ("work_slots", "1", 1),
])
def test_values_the_table_accepts(name, text, expected):
    assert options.parse_value(options.find(name), text) == expected


@pytest.mark.parametrize("name, value", [
    ("budget", "lots"), ("budget", "-2G"), ("budget", 0), ("budget", 2 ** 70), ("budget", "inf"),
    ("budget", float("nan")), ("budget", True), ("budget", "4G\0junk"), ("budget", "x" * 1000),
    ("threads", 4097), ("threads", -1), ("threads", "two"), ("threads", 2.5), ("work_slots", 0),
    ("eviction", "random"), ("buddy_tau", -0.5), ("buddy_tau", 1.5), ("buddy_temperature", 0.01),
    ("smoe_alpha", math.inf), ("direct_io", "no"), ("direct_io", 1), ("replan_tokens", 2 ** 31),
])
def test_values_the_table_refuses_name_what_they_must_be(name, value):
    option = options.find(name)
    with pytest.raises(ZipMoEError, match=re.escape(f"zipmoe_{name} must be ")):
        options.parse_value(option, value)


def test_the_expected_text_follows_the_range():
    assert options.find("threads").expects == "a whole number of threads from 0 to 4096 (0: all of the graph's threads)"
    assert options.find("buddy_tau").expects == ("a number from 0 to 1, or -1 (-1: each layer's calibrated tau from "
                                                 "the profile)")
    assert options.find("eviction").expects == "one of lru, fifo, marking, lfu, rank, score"


def test_rules_between_options_come_from_the_table():
    with pytest.raises(ZipMoEError, match="zipmoe_smoe_alpha needs zipmoe_substitution=smoe"):
        options.zipmoe_overrides(substitution="buddy", smoe_alpha=0.2)
    with pytest.raises(ZipMoEError, match="zipmoe_pools needs zipmoe_eviction=rank"):
        options.zipmoe_overrides(pools="F=2", eviction="lru")
    with pytest.raises(ZipMoEError, match="zipmoe_buddy_rho needs zipmoe_substitution=buddy"):
        options.zipmoe_overrides(buddy_rho=2, substitution="smoe")
    # an option whose partner is not given is left to the loader, which sees the environment too
    assert options.zipmoe_overrides(smoe_alpha=0.5) == {"zipmoe.smoe_alpha": 0.5}
    with pytest.raises(ZipMoEError, match="unknown ZipMoE option 'bogus'"):
        options.zipmoe_overrides(bogus=1)
    # zipmoe-chat names the same rule by its flags
    with pytest.raises(ZipMoEError, match="--smoe-alpha needs --substitution=smoe"):
        options.zipmoe_overrides(substitution="none", smoe_alpha=0.2, name_of=options.chat_flag)


def test_llama_takes_exactly_the_tables_keyword_arguments_and_documents_them():
    from zipmoe_py import Llama

    params = inspect.signature(Llama.__init__).parameters
    assert {name for name in params if name.startswith("zipmoe_")} == python_kwargs()
    for o in options.python_options():
        assert f"{o.kwarg} (" in Llama.__doc__ and o.help in Llama.__doc__


def test_zipmoe_chat_has_a_flag_for_each_option_of_the_table():
    from zipmoe_py import cli

    parser = cli.build_parser()
    flags = {action.dest: action.option_strings for action in parser._actions if action.dest.startswith("zipmoe_")}
    assert set(flags) == python_kwargs()
    for o in options.python_options():
        assert options.chat_flag(o) in flags[o.kwarg]
        if o.type == _lib.TYPE_BOOL:
            assert f"--no-{options.chat_flag(o)[2:]}" in flags[o.kwarg]
    args = parser.parse_args(["--no-auto-pools", "--eviction", "score", "--budget", "4G", "--zipmoe-threads", "1"])
    assert (args.zipmoe_auto_pools, args.zipmoe_eviction, args.zipmoe_budget, args.zipmoe_threads) == \
        (False, "score", 4 << 30, 1)


def test_zipmoe_server_has_a_flag_and_a_config_field_for_each_option_of_the_table():
    from zipmoe_py import server

    fields = {name for name in server.ZipMoEModelSettings.model_fields if name.startswith("zipmoe_")}
    assert fields == python_kwargs()
    parser = server.build_parser()
    flags = {a.dest for a in parser._actions if a.dest.startswith("zipmoe_")}
    assert flags == python_kwargs()
    args = parser.parse_args(["--model", "m.gguf", "--zipmoe_auto_pools", "false", "--zipmoe_budget", "4G",
                              "--zipmoe_eviction", "score"])
    assert (args.zipmoe_auto_pools, args.zipmoe_budget, args.zipmoe_eviction) == (False, "4G", "score")
    settings = server.ZipMoEModelSettings.model_validate({"model": "m.gguf", "zipmoe_budget": 1 << 30})
    assert server.zipmoe_kwargs(settings) == {"zipmoe_budget": 1 << 30}


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("1", True), ("Yes", True), (" on ", True), ("false", False), ("0", False), ("NO", False),
    ("off", False), ("t", None), ("y", None), ("n", None), ("", None), ("maybe", None), ("2", None)])
def test_boolean_text_takes_the_tables_words(text, expected, capsys):
    """A boolean given as text (zipmoe-server's flags, like the loader's ZIPMOE_* variables) takes the C
    table's words, not llama-cpp-python's (which would take t, y, n); Llama's keyword argument takes a
    Python bool only."""
    from zipmoe_py import server

    option = options.find("auto_pools")
    parser = server.build_parser()
    argv = ["--model", "m.gguf", "--zipmoe_auto_pools", text]
    if expected is None:
        with pytest.raises(ZipMoEError, match=re.escape(f"zipmoe_auto_pools must be {option.expects}")):
            options.parse_text(option, text)
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert f"argument --zipmoe_auto_pools: must be {option.expects}; got {text!r}" in capsys.readouterr().err
    else:
        assert options.parse_text(option, text) is expected
        assert parser.parse_args(argv).zipmoe_auto_pools is expected
    with pytest.raises(ZipMoEError, match="zipmoe_auto_pools must be True or False"):
        options.parse_value(option, text)


@pytest.mark.parametrize("program, flag", [("zipmoe-server", "--zipmoe_prefetch"), ("zipmoe-chat", "--budget")])
def test_a_bad_flag_value_says_what_it_must_be(program, flag):
    proc = run([VENV_BIN / program, flag, "maybe"], stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    expects = options.find(flag.lstrip("-").replace("zipmoe_", "")).expects
    assert f"argument {flag}: must be {expects}; got 'maybe'".encode() in proc.stderr, proc.stderr


@pytest.mark.parametrize("program", ["zipmoe-chat", "zipmoe-server"])
def test_help_texts_are_the_tables(program):
    proc = run([VENV_BIN / program, "--help"], env={"COLUMNS": "4000"})
    assert proc.returncode == 0
    text = b" ".join(proc.stdout.split()).decode()
    for o in options.python_options():
        assert o.help in text, o.name
    assert "one F pool of the whole budget" not in text


def test_the_documented_options_table_is_the_tables():
    doc = (REPO / "docs" / "OPTIONS.md").read_text()
    block = re.search(r"<!-- options table: python -m zipmoe_py.options -->\n(.*?)\n<!-- end of options table -->",
                      doc, re.S)
    assert block, "docs/OPTIONS.md has no generated options table"
    assert block.group(1).strip() == options.markdown_table().strip(), \
        "docs/OPTIONS.md's options table is stale: regenerate it with python -m zipmoe_py.options"
    assert "(docs/OPTIONS.md)" in (REPO / "README.md").read_text()


def test_the_loader_knows_exactly_the_tables_keys(zipmoe_gguf):
    path = zipmoe_gguf("qwen2moe")
    proc = run([VENV_BIN / "llama-completion", "-m", path, "-p", "Hi", "-n", 1, "-no-cnv", "-c", 64,
                "--override-kv", "zipmoe.bogus=int:1"], stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    known = re.search(rb"unknown ZipMoE option 'zipmoe.bogus': known are ([^\n]*)", proc.stderr)
    assert known, proc.stderr.decode()[-2000:]
    assert known.group(1).decode().split(", ") == [o.key for o in options.table() if o.key]


@pytest.mark.parametrize("program", ["llama-completion", "llama-perplexity", "llama-server"])
def test_the_fork_programs_help_has_a_zipmoe_section_from_the_table(program):
    """--help of the fork's common-argument programs lists every option the loader reads: its override,
    its variable, its help and default, as the table says."""
    from zipmoe_py import _paths

    proc = run([_paths.program(program), "--help"], text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    section = proc.stdout.split("----- ZipMoE options -----", 1)
    assert len(section) == 2, proc.stdout[-2000:]
    for o in options.table():
        if o.key is None:
            assert f"zipmoe.{o.name}=" not in section[1]  # the Python layer reads it, not the loader
            continue
        assert f"--override-kv {o.key}=" in section[1] and f" {o.env}\n" in section[1], o.name
        assert f"{o.help} (default: {o.default_text})" in section[1], o.name
        assert f"VALUE: {o.expects}" in section[1], o.name
