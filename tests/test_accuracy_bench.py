"""The accuracy harness (bench/accuracy_bench.py): lossless configurations give deltas of exactly 0
against the exact run, SMoE at alpha 0 too, and a lossy configuration that replaces experts shows up
in its metrics."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import bench_module

TEXT = ("Mixture of experts models route every token to a few of their experts. The router scores each "
        "expert, keeps the best ones and weights their outputs by the scores. A cache of experts keeps the "
        "popular ones in memory while the others stay compressed on disk until the router asks for them.")


@pytest.fixture(scope="module")
def harness():
    return bench_module("accuracy_bench")


# the harness's arithmetic on one architecture (its 26-layer DeepSeek took 53 s); both architectures' exactness
# at a budget is test_serve's
@pytest.mark.parametrize("arch", ["qwen2moe"])
def test_lossless_deltas_are_exactly_zero_and_lossy_ones_are_not(arch, harness, tiny_gguf, zipmoe_gguf):
    bf16, zipmoe = tiny_gguf(arch), zipmoe_gguf(arch)
    tokens = harness.held_out_tokens(bf16, TEXT * 2, 96)
    windows = [tokens[:48], tokens[48:]]
    exact = harness.run_windows(bf16, windows, 1, 2, {})
    budget = harness.all_experts_bytes(zipmoe) // 4
    for config in ("lossless", "smoe:0"):
        got = harness.run_windows(zipmoe, windows, 1, 2, {"zipmoe_budget": budget, **harness.parse_config(config)})
        m = harness.compare(exact["logits"], got["logits"], windows)
        assert m["bit_identical"], config
        assert m["ppl_delta"] == 0.0 and m["kl_mean"] == 0.0 and m["top1_agreement"] == 1.0, (config, m)
        assert m["positions"] == 94
        assert got["stats"]["expert_misses"] > 0  # the budget made it fetch
    got = harness.run_windows(zipmoe, windows, 1, 2, {"zipmoe_budget": budget, **harness.parse_config("smoe:1")})
    m = harness.compare(exact["logits"], got["logits"], windows)
    assert got["stats"]["substitutions"] > 0
    assert not m["bit_identical"] and m["kl_mean"] > 0 and m["ppl_delta"] != 0


def test_configuration_names_are_checked(harness):
    assert harness.parse_config("lossless") == {}
    assert harness.parse_config("smoe:0.25") == {"zipmoe_substitution": "smoe", "zipmoe_smoe_alpha": 0.25}
    assert harness.parse_config("buddy:rho=2:tau=0.5", Path("b.json")) == {
        "zipmoe_substitution": "buddy", "zipmoe_buddy_profile": "b.json", "zipmoe_buddy_rho": 2,
        "zipmoe_buddy_tau": 0.5}
    for bad in ("smoe:2", "smoe:x", "buddi", "buddy:rho=x", "buddy:alpha=1"):
        with pytest.raises(ValueError, match="unknown configuration"):
            harness.parse_config(bad)
