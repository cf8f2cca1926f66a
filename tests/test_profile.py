"""zipmoe-profile on a tiny ZipMoE model, and zipmoe-plan on what it writes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from zipmoe_py import ZipMoEError, plan_cli, plan_files, profile

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Mixture of experts models route each token",
           "1 2 3 4 5 6 7 8 9 10 11 12", "Once upon a time", "SELECT * FROM"]


@pytest.fixture
def zipmoe_qwen(zipmoe_gguf):
    return zipmoe_gguf("qwen2moe")


def test_profile_counts_each_decode_ubatch_and_plan_reads_it(zipmoe_qwen, tiny_gguf, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")
    out = tmp_path / "profile.json"
    costs = tmp_path / "costs.json"
    assert profile.main([str(zipmoe_qwen), "--prompts", str(prompts), "--batch-sizes", "1,3", "-n", "5", "-t", "2",
                         "-o", str(out), "--costs", str(costs), "-q"]) == 0
    doc = plan_files.load_profile(out)  # the planner's own validation
    k, n_expert = doc["n_expert_used"], doc["n_expert"]
    assert (k, n_expert, doc["n_tensors_per_expert"]) == (4, 16, 3)
    one = doc["batches"]["1"]
    assert one["n_ubatches"] == len(PROMPTS) * 5  # one ubatch per decode step, prefills not counted
    counts = np.array(one["counts"])
    assert counts.shape == (doc["n_layer_moe"], n_expert)
    # batch 1: every ubatch chooses exactly k distinct experts in every layer
    assert (counts.sum(axis=1) == k * one["n_ubatches"]).all()
    three = doc["batches"]["3"]
    assert three["n_ubatches"] == 2 * 5
    per_layer = np.array(three["counts"]).sum(axis=1)
    assert ((per_layer >= k * three["n_ubatches"]) & (per_layer <= 3 * k * three["n_ubatches"])).all()
    f = np.array(one["f"])
    assert np.all(np.diff(f) <= 0) and f.sum() == pytest.approx(k)
    # the state sizes are the runtime's store entries (64-byte aligned): SM is half of BF16, compressed E
    # is smaller than the other half
    b = doc["expert_bytes"]
    assert b["S"] == -(-b["F"] // 128) * 64 and 0 < b["E"] < b["S"] and b["S"] + b["E"] - 64 <= b["C"] <= b["S"] + b["E"]

    measured, threads = plan_files.load_costs(costs)  # the planner's own validation
    assert threads == 2 and 0 < measured.v_s and 0 < measured.c_s and 0 < measured.u_s

    plan = tmp_path / "plan.json"
    assert plan_cli.main([str(out), "--budget", str(4 * b["F"] * doc["n_layer_moe"]), "--pools", "F,C",
                         "--costs", str(costs), "-o", str(plan)]) == 0
    result, meta = plan_files.load_plan(plan)
    assert sum(result.ratios.values()) == pytest.approx(1.0)
    assert json.loads(plan.read_text())["format"] == "zipmoe-plan"

    # the runtime takes the plan: its pools as planned, logits bit-identical to the BF16 GGUF
    from test_serve import load, logits_trace

    reference = load(tiny_gguf("qwen2moe"))
    want = logits_trace(reference, PROMPTS[:2], n_decode=8)
    reference.close()
    llm = load(zipmoe_qwen, zipmoe_plan=plan, zipmoe_work_slots=4)
    try:
        got = logits_trace(llm, PROMPTS[:2], n_decode=8)
        stats = llm.zipmoe_stats()
    finally:
        llm.close()
    assert got[1] == want[1] and np.array_equal(got[0], want[0])
    for pool in "FCSE":
        assert stats["pools"][pool]["experts"] == result.capacities.get(pool, 0) * doc["n_layer_moe"]
    assert stats["n_slots"] == result.capacities["F"] * doc["n_layer_moe"] + 4

    # a plan made for another model, or not a plan at all, is refused before loading
    other = json.loads(plan.read_text())
    other["n_layer_moe"] += 1
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ZipMoEError, match=f"was planned for {doc['n_layer_moe'] + 1} MoE layers of {n_expert} "
                                          f"experts, but .* has {doc['n_layer_moe']} of {n_expert}"):
        load(zipmoe_qwen, zipmoe_plan=tmp_path / "other.json")
    with pytest.raises(ZipMoEError, match="not a plan file \\(binary, not JSON text\\)"):
        load(zipmoe_qwen, zipmoe_plan=zipmoe_qwen)


def test_profile_errors_name_what_is_wrong(zipmoe_qwen, tiny_gguf, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    assert profile.main([str(zipmoe_qwen), "--prompts", str(empty), "-o", str(tmp_path / "p.json")]) == 1
    assert "holds no prompt" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    assert profile.main([str(tiny_gguf("qwen2moe")), "--prompts", str(prompts), "-o", str(tmp_path / "p.json"),
                         "-q"]) == 1
    assert "not a ZipMoE GGUF" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        profile.main([str(zipmoe_qwen), "--prompts", str(prompts), "--batch-sizes", "0", "-o", "x"])
