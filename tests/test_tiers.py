"""The slow tier's lists (conftest.SLOW_FILES, SLOW_TESTS) name tests that exist: a renamed file or test
would otherwise slip into the fast tier unnoticed."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import SLOW_FILES, SLOW_TESTS

HERE = Path(__file__).resolve().parent


def test_every_slow_file_and_test_exists():
    for name in SLOW_FILES:
        assert (HERE / name).is_file(), name
    for entry in SLOW_TESTS:
        name, test = entry.split("::")
        tree = ast.parse((HERE / name).read_text())
        assert any(isinstance(node, ast.FunctionDef) and node.name == test for node in tree.body), entry
