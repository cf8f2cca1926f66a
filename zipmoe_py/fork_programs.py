"""The fork's own llama.cpp programs on the venv's PATH: `llama-completion`, `llama-bench`,
`llama-perplexity`, `llama-server`, `llama-quantize` and `rpc-server` run the binaries built with ZipMoE
(zipmoe_py/bin), with their own arguments.

They take every ZipMoE option as a KV override (--override-kv zipmoe.budget=str:4G,zipmoe.direct_io=bool:true)
or as an environment variable (ZIPMOE_BUDGET=4G); llama-bench has no --override-kv, so there the
environment is the way (README: "Options").
"""
from __future__ import annotations

import os
import sys

from . import _paths
from .errors import ZipMoEError


def _exec(name: str) -> int:
    try:
        program = str(_paths.program(name))
    except ZipMoEError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    os.execv(program, [program, *sys.argv[1:]])
    return 1  # not reached


def llama_completion() -> int:
    return _exec("llama-completion")


def llama_bench() -> int:
    return _exec("llama-bench")


def llama_perplexity() -> int:
    return _exec("llama-perplexity")


def llama_server() -> int:
    return _exec("llama-server")


def llama_quantize() -> int:
    return _exec("llama-quantize")


def rpc_server() -> int:
    """upstream's ggml-rpc-server: a host that computes the layers given to it with --rpc (docs/DISTRIBUTED.md)"""
    return _exec("ggml-rpc-server")
