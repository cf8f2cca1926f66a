"""The machine-limit bench (bench/limits.py): its rates come from real reads and decodes of a ZipMoE
file, and its bound is the runtime planner's makespan plus the compute floor, with the planner's own
edge cases: everything in F reads nothing, more memory never raises the bound."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import bench_module


@pytest.fixture(scope="module")
def limits():
    return bench_module("limits")


def test_the_line_through_the_truncations_reports_its_residuals(limits):
    exact = limits.fit_line([(2, 0.03), (4, 0.05), (6, 0.07)])
    assert exact["fixed_s"] == pytest.approx(0.01, abs=1e-12) and exact["per_layer_s"] == pytest.approx(0.01, abs=1e-12)
    assert max(abs(r) for r in exact["residuals_s"]) < 1e-12
    bent = limits.fit_line([(2, 0.03), (4, 0.06), (6, 0.07)])
    assert sum(bent["residuals_s"]) == pytest.approx(0.0, abs=1e-12)  # least squares: residuals sum to 0
    assert bent["residuals_s"][1] > 0 > bent["residuals_s"][0]
    with pytest.raises(ValueError, match="two different layer counts"):
        limits.fit_line([(4, 0.1), (4, 0.2)])


def test_a_batch_selects_the_union_of_its_tokens_experts(limits):
    f, k = limits.inclusion("uniform", 64, 6, 1)
    assert k == 6 and np.allclose(f, 6 / 64)
    f4, k4 = limits.inclusion("uniform", 64, 6, 4)
    union = 64 * (1 - (1 - 6 / 64) ** 4)  # 20.9 distinct experts of 4 independent tokens
    assert k4 == round(union) and f4.sum() == pytest.approx(k4)


def test_rates_are_measured_on_the_files_own_chunks(limits, zipmoe_gguf):
    model = zipmoe_gguf("qwen2moe")
    reads = limits.read_rates(model, rounds=1, volume=1 << 20)
    assert set(reads["gbps"]) == {"chunks_depth1", "chunks_depth2", "chunks_depth4", "sequential"}
    assert all(r["median"] > 0 for r in reads["gbps"].values())
    decode = limits.decode_rates(model, threads=2, rounds=1, seconds=0.05, load_rows=64)
    assert set(decode["gbps"]) == {"one_thread", "all_threads", "one_thread_under_load"}
    assert all(r["median"] > 0 for r in decode["gbps"].values())
    # the jobs decode the file's experts exactly: the library's reader gives the same values
    from zipmoe_py import format as zformat

    decoder, jobs = limits.decode_jobs(model, 2)
    with zformat.ZipMoEFile(model) as zf:
        import random

        rng = random.Random(1)
        split = [t for t in zf.tensors if not zf.is_raw(t)]
        for job in jobs:
            name = rng.choice(split)
            expert = rng.randrange(zf.shape(name)[2])
            assert np.array_equal(job.out, zf.read_expert(name, expert))
    decoder.close()


def test_the_bound_is_the_planners_makespan_plus_the_compute_floor(limits, zipmoe_gguf):
    model = zipmoe_gguf("deepseek2")
    facts = limits.model_facts(model)
    reads = {"gbps": {name: {"median": gbps} for name, gbps in
                      (("chunks_depth1", 1.0), ("chunks_depth2", 1.5), ("chunks_depth4", 2.0), ("sequential", 1.8))}}
    decode = {"gbps": {"all_threads": {"median": 6.0}}}
    floor = {"tpot_s": {"floor_s": 0.2}, "prompt_s": {"floor_s": 3.0}}
    everything = facts["n_layer_moe"] * facts["n_expert"] * facts["entry_bytes"]["F"]
    caps = [facts["non_expert_bytes"] + everything // 8, facts["non_expert_bytes"] + everything // 2,
            facts["non_expert_bytes"] + 2 * everything]
    rows = limits.bounds(facts, reads, decode, floor, caps, [1, 4], "uniform", 2, 0, 40)
    by_cap = {(r["cap_bytes"], r["batch"]): r for r in rows}
    for batch in (1, 4):
        small, half, full = (by_cap[(c, batch)] for c in caps)
        assert full["experts_s"] == 0.0 and full["tpot_bound_s"] == pytest.approx(0.2)  # every expert in F
        assert full["capacities"]["F"] == facts["n_expert"]
        assert small["tpot_bound_s"] >= half["tpot_bound_s"] >= full["tpot_bound_s"]
        assert small["experts_s"] > 0
        assert small["best_depth"] == 4 and small["best_depth_tpot_bound_s"] < small["tpot_bound_s"]
        assert small["tpot_bound_s"] == pytest.approx(small["experts_s"] + 0.2)
    assert by_cap[(caps[0], 4)]["experts_s"] > by_cap[(caps[0], 1)]["experts_s"]
    one = by_cap[(caps[0], 1)]
    # TTFT: the prompt's compute plus one sequential read of the non-expert weights and of every expert a
    # 40-token prompt needs
    needed = facts["n_layer_moe"] * facts["n_expert"] * (1 - (1 - facts["k"] / facts["n_expert"]) ** 40)
    assert one["experts_needed"] == pytest.approx(needed)
    cold = facts["non_expert_bytes"] + needed * facts["stored_expert_bytes"]
    assert one["ttft_bound_s"] == pytest.approx(3.0 + cold / 1.8e9)
    assert "ttft_bound_s" not in by_cap[(caps[0], 4)]
    # the CPU's floor beside it: compute, every needed expert decoded once on both threads (6 GB/s), and
    # the memory they are kept in, at most the experts' budget, made present on both at one thread's rate
    assert one["ttft_cpu_floor_s"] == pytest.approx(3.0 + needed * facts["bf16_expert_bytes"] / 6e9)  # rate not given
    fresh = {"gbps": {"median": 0.5}}
    for cap in (caps[0], caps[2]):
        row = limits.bounds(facts, reads, decode, floor, [cap], [1], "uniform", 2, 0, 40, fresh)[0]
        kept = min(cap - facts["non_expert_bytes"], needed * facts["stored_expert_bytes"])
        assert row["fresh_memory_s"] == pytest.approx(kept / 1e9)
        assert row["ttft_cpu_floor_s"] == pytest.approx(3.0 + needed * facts["bf16_expert_bytes"] / 6e9 + kept / 1e9)
        assert row["ttft_bound_s"] == pytest.approx(one["ttft_bound_s"])  # the issue's bound is the reads'


def test_new_memory_is_timed_as_it_is_first_written(limits):
    assert limits.fresh_memory_rate(16 << 20) > 0


def test_a_batch_takes_its_own_compute_floor_where_one_was_measured(limits, zipmoe_gguf):
    model = zipmoe_gguf("deepseek2")
    facts = limits.model_facts(model)
    reads = {"gbps": {name: {"median": 1.0} for name in
                      ("chunks_depth1", "chunks_depth2", "chunks_depth4", "sequential")}}
    decode = {"gbps": {"all_threads": {"median": 6.0}}}
    cap = facts["non_expert_bytes"] + 4 * facts["n_layer_moe"] * facts["n_expert"] * facts["entry_bytes"]["F"]
    floor = {"tpot_s": {"floor_s": 0.2}, "prompt_s": {"floor_s": 3.0}}
    one, four = limits.bounds(facts, reads, decode, floor, [cap], [1, 4], "uniform", 2, 0, 40)
    assert four["compute_s"] == 0.2 and four["compute_floor_of"] == "batch 1"  # none measured: batch 1's
    floor["tpot_s_batch4"] = {"floor_s": 0.5}
    one, four = limits.bounds(facts, reads, decode, floor, [cap], [1, 4], "uniform", 2, 0, 40)
    assert one["tpot_bound_s"] == 0.2 and one["compute_floor_of"] == "batch 1"  # every expert in F: no experts part
    assert four["tpot_bound_s"] == 0.5 and four["compute_floor_of"] == "batch 4"


def test_a_resident_step_of_several_sequences_is_timed_on_the_truncation(limits, tiny_gguf):
    found = limits.resident_batch_tpot(tiny_gguf("deepseek2"), 4, 8, 4, 2, 2)
    assert found["batch"] == 4 and len(found["tpot_s"]) == 2 and all(0 < s < 5 for s in found["tpot_s"])


def test_the_pools_imply_the_reads_of_the_ranks_beyond_f_and_c(limits, zipmoe_gguf):
    facts = limits.model_facts(zipmoe_gguf("deepseek2"))
    n, k, layers = facts["n_expert"], facts["k"], facts["n_layer_moe"]
    f = np.full(n, k / n)
    stored, sm = facts["stored_expert_bytes"], facts["sm_bytes"]
    assert limits.implied_read_bytes(facts, f, {"F": n}) == 0.0
    assert limits.implied_read_bytes(facts, f, {}) == pytest.approx(layers * k * stored)
    # one rank in each pool: F and C read nothing, S its E-chunks, E its SM-chunks, the rest everything
    mixed = limits.implied_read_bytes(facts, f, {"F": 1, "C": 1, "S": 1, "E": 1})
    assert mixed == pytest.approx(layers * k / n * ((stored - sm) + sm + (n - 4) * stored))


def test_a_runs_steady_reads_are_those_after_the_re_plan(zipmoe_gguf):
    quant_bench = bench_module("quant_bench")
    log = ["I llama_zipmoe: ZipMoE expert cache pools per MoE layer: F 0, C 17, S 0, E 46, 8 working slots: ...",
           "I detach: ZipMoE expert cache so far: 0 fetches, 0 hits, 0 misses (0 from C/S/E), 0.0 MB read (prefetch ...",
           "I llama_zipmoe: ZipMoE expert cache pools per MoE layer: F 2, C 20, S 0, E 40, 8 working slots: ...",
           "I llama_zipmoe: ZipMoE pools re-planned after 16 decode steps (3000.0 MB read so far): F 5, C 30, S 1, "
           "E 20 per MoE layer, 300 slots: ...",
           "I detach: ZipMoE expert cache so far: 10 fetches, 0 hits, 9 misses (0 from C/S/E), 8000.0 MB read (prefetch "
           "0.0 MB read, 0.0 MB used, 0 experts served, recall 0.00); io 9.0 ms, decode 1.0 ms, recover 1.0 ms, ...",
           "I llama_zipmoe: ZipMoE expert cache pools per MoE layer: F 9, C 9, S 0, E 9, 8 working slots: ..."]
    row = {"zipmoe_log": log, "zipmoe_stats": log[4].split("so far: ")[1], "decode_tokens": 66}
    found = quant_bench.steady_reads(row)
    assert found["steady_read_per_token"] == pytest.approx(5000e6 / 50)
    assert found["steady_pools"] == {"F": 5, "C": 30, "S": 1, "E": 20}  # not the plan made after the context went
    kept = dict(row, zipmoe_log=log[:3] + [log[3].split("): F")[0] + "): kept (...)"] + log[4:])
    assert quant_bench.steady_reads(kept)["steady_pools"] == {"F": 2, "C": 20, "S": 0, "E": 40}
    assert quant_bench.steady_reads(dict(row, zipmoe_log=log[:3] + log[4:])) == {}  # never re-planned
    # the runtime's line since parallel steps count: the experts of a step come before the bytes read
    steps = log[3].replace("(3000.0 MB", "(17 experts per MoE layer a step, 3000.0 MB").replace(
        " so far)", " so far; routing z = 53.4 against a uniform router's)")
    found = quant_bench.steady_reads(dict(row, zipmoe_log=log[:3] + [steps] + log[4:]))
    assert found["steady_read_per_token"] == 5000e6 / 50  # whole MB values: exact in binary
    # planned as the prompt ended: every decode step is after it
    prompt = steps.replace("after 16 decode steps", "after a prompt of 40 tokens")
    found = quant_bench.steady_reads(dict(row, zipmoe_log=log[:3] + [prompt] + log[4:]))
    assert found["steady_read_per_token"] == 5000e6 / 66 and found["steady_pools"]["F"] == 5


def test_a_runs_bound_takes_the_read_rate_the_runtime_saw(limits, zipmoe_gguf):
    quant_bench = bench_module("quant_bench")
    model = zipmoe_gguf("deepseek2")
    facts = limits.model_facts(model)
    everything = facts["n_layer_moe"] * facts["n_expert"] * facts["entry_bytes"]["F"]
    cap = facts["non_expert_bytes"] + everything // 4
    lim = {"facts": facts, "decode": {"gbps": {"all_threads": {"median": 6.0}}}, "profile": "uniform", "threads": 2,
           "floor": {"tpot_s": {"floor_s": 0.2}, "prompt_s": {"floor_s": 3.0}}, "overhead_bytes": 0,
           "prompt_tokens": 40}

    def stats(mb, io_ms):
        return (f"1 fetches, 0 hits, 1 misses (0 from C/S/E), {mb:.1f} MB read (prefetch 0.0 MB read, 0.0 MB used, 0 "
                f"experts served, recall 0.00); io {io_ms:.1f} ms, decode 1.0 ms, recover 1.0 ms, fetch wall 2.0 ms")

    rows = [{"cap_bytes": cap, "tpot_s": 0.5, "zipmoe_stats": stats(1000, 1000)},
            {"cap_bytes": cap, "tpot_s": 0.5, "zipmoe_stats": stats(1000, 4000)},
            {"cap_bytes": cap, "tpot_s": 0.5}]  # stock: no counters, no bound
    result = {"limits": lim, "rows": rows}
    quant_bench.add_run_bounds(result)
    fast, slow = rows[0]["run_bound"], rows[1]["run_bound"]
    assert fast["read_gbps"] == pytest.approx(1.0) and slow["read_gbps"] == pytest.approx(0.25)
    assert slow["tpot_bound_s"] > fast["tpot_bound_s"] > 0.2
    reads = {"gbps": {**{f"chunks_depth{d}": {"median": 1.0} for d in limits.DEPTHS}, "sequential": {"median": 1.0}}}
    same = limits.bounds(facts, reads, lim["decode"], lim["floor"], [cap], [1], "uniform", 2, 0, 40)[0]
    assert fast["tpot_bound_s"] == pytest.approx(same["tpot_bound_s"])
    assert fast["ttft_bound_s"] == pytest.approx(same["ttft_bound_s"]) and slow["ttft_bound_s"] > fast["ttft_bound_s"]
    assert "run_bound" not in rows[2]


def test_the_ttft_bound_takes_the_prompt_length_its_floor_was_measured_at(limits, zipmoe_gguf, tmp_path):
    floor = tmp_path / "floor.json"
    floor.write_text('{"prompt_tokens": 78, "full_layers": 2}')
    model = zipmoe_gguf("deepseek2")
    with pytest.raises(SystemExit, match=r"--prompt-tokens 44: .*floor.json measured the prompt's floor at 78 tokens"):
        limits.main(["bound", str(model), "--floor", str(floor), "--prompt-tokens", "44", "--out", str(tmp_path / "b.json")])


def test_a_zipmoe_only_bench_needs_no_stock_file():
    quant_bench = bench_module("quant_bench")
    assert quant_bench.stock_size({"stock_bytes": 2_000_000_000}) == "2.00 GB"
    assert "not present" in quant_bench.stock_size({"stock_bytes": None})


def test_a_zipmoe_only_server_bench_needs_no_bf16_file(tmp_path):
    """The disk's rate is then measured on the ZipMoE GGUF; the stock server still needs its file."""
    server_bench = bench_module("llama_server_bench")
    common = ["--zipmoe", str(tmp_path / "m.zipmoe.gguf"), "--cap", "20G", "--out", str(tmp_path / "o.json")]
    args = server_bench.parse_args([*common, "--servers", "llama-server zipmoe"])
    assert args.bf16 is None and args.servers == ["llama-server zipmoe"]
    with pytest.raises(SystemExit) as refused:
        server_bench.parse_args([*common, "--servers", "llama-server zipmoe", "llama-server bf16"])
    assert refused.value.code == 2


def test_a_rotated_server_bench_starts_each_round_one_server_later():
    """--rotate: no build always runs first in a round (the first server of a round ran slower on the bench VM)"""
    server_bench = bench_module("llama_server_bench")
    servers = ["a", "b", "c"]
    assert [server_bench.round_order(servers, r, True) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert all(server_bench.round_order(servers, r, False) == servers for r in range(4))


def test_the_server_bench_watches_the_servers_anonymous_memory_to_its_end():
    """MemoryWatch samples the newest process with the port in its command line (the server, not
    capped-run): its peak while serving, at the SIGTERM and after it; memory_summary takes the median and
    range over rounds (a change of pools or a shutdown that wrote past the cap was ended by the OOM killer)."""
    server_bench = bench_module("llama_server_bench")
    port = server_bench.free_port()
    hold = "import sys, time; x = bytearray(96 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(60)"
    # the watch starts beside a starter with the port in its command line too (capped-run's place), before
    # the server: it waits for the server's program
    starter = subprocess.Popen(["/bin/sh", "-c", "sleep 60; :", "sh", "--port", str(port)])
    watch = server_bench.MemoryWatch(port, "/elsewhere/" + Path(sys.executable).name)  # named as the server
    time.sleep(0.5)
    proc = subprocess.Popen([sys.executable, "-c", hold, "--port", str(port)])
    try:
        deadline = time.monotonic() + 30
        while (not watch.samples or watch.samples[-1][1] < 96 << 20) and time.monotonic() < deadline:
            time.sleep(0.1)
        watch.term_at = time.monotonic()
        proc.terminate()
        proc.wait(timeout=30)
        report = watch.report()
        assert starter.poll() is None  # it was there to be passed over
    finally:
        proc.kill()
        starter.kill()
    assert watch.pid == proc.pid
    assert 96 / 1024 <= report["peak_anon_gib"] < 1 and report["anon_at_term_gib"] >= 96 / 1024, report
    assert report["oom_kills"] in (0, None), report  # None where dmesg is not readable
    runs = [{"server": "s", "memory": {"peak_anon_gib": p, "oom_kills": k}} for p, k in ((17.4, 0), (20.1, 1), (17.9, 0))]
    assert server_bench.memory_summary(runs + [{"server": "t", "memory": None}], "s") == {
        "peak_anon_gib": 17.9, "peak_anon_gib_min": 17.4, "peak_anon_gib_max": 20.1, "oom_kills": 1}
    assert server_bench.memory_summary(runs, "t")["peak_anon_gib"] is None


def test_the_steady_account_counts_each_decode_step_of_a_model(zipmoe_gguf):
    """bench/steady_account.py: the runtime's counters between two decode steps, per step. One fetch per
    MoE layer a step on the fetch path; none where every expert is resident and the graph uses the slots in
    place (the default, resident views); and a file that is not there is named, not a traceback."""
    script = Path(__file__).resolve().parent.parent / "bench" / "steady_account.py"
    model = zipmoe_gguf("qwen2moe")
    from zipmoe_py.gguf_file import read_metadata
    n_layer = read_metadata(model)["qwen2moe.block_count"]
    for views in ("0", "1"):
        proc = subprocess.run([sys.executable, script, model, "--steps", "6", "--from-step", "2", "--threads", "1",
                               "--ctx", "256", "--prompt", "the cache of experts"], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "ZIPMOE_RESIDENT_VIEWS": views})
        assert proc.returncode == 0, proc.stderr
        lines = dict(line.rsplit(None, 1) for line in proc.stdout.splitlines()[1:])
        counters = {key.strip(): float(value) for key, value in lines.items()}
        assert proc.stdout.splitlines()[0].endswith("steps 2-5, per step")
        assert counters["wall ms"] > 0 and counters["graph ms"] > 0
        if views == "0":
            assert counters["fetch_calls"] == n_layer  # every layer is MoE in the tiny Qwen2-MoE
            assert counters["graph ms"] >= counters["fetch ms"] > 0
        else:
            assert "fetch_calls" not in counters and "fetch ms" not in counters
    missing = subprocess.run([sys.executable, script, model.parent / "absent.gguf"], capture_output=True, text=True)
    assert missing.returncode == 2 and "absent.gguf: no such file" in missing.stderr
