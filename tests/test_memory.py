"""Memory the expert cache may take: the process's own cgroup limits (v1, v2, nested, containers),
MemAvailable, and the slots sized from them when contexts are made and freed.

The cgroup probe (ggml_zipmoe_memory_available) is driven on fake /proc and /sys trees, one per
layout users meet; the sizing is driven through zipmoe.mem_limit, which stands for a limit without
needing the rights to make a cgroup, and, where this machine lets the tests make one, a real cgroup.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from zipmoe_py import _lib, _paths
from zipmoe_py import format as zformat

from conftest import run
from test_serve import expert_geometry

GIB = 1 << 30
MIB = 1 << 20
NO_LIMIT = 2**64 - 1
V1_UNLIMITED = 9223372036854771712


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_proc(root: Path, cgroup: str, mountinfo: str, mem_available_kb: int | None = 20 * 1024 * 1024) -> None:
    write(root, "/proc/self/cgroup", cgroup)
    write(root, "/proc/self/mountinfo", mountinfo)
    if mem_available_kb is not None:
        write(root, "/proc/meminfo", f"MemTotal:       25165824 kB\nMemFree:  1000 kB\nMemAvailable:   {mem_available_kb} kB\n")


def v1_group(root: Path, folder: str, limit: int, usage: int, cache: int = 0, shmem: int = 0,
             hierarchical: int | None = None) -> None:
    write(root, f"{folder}/memory.limit_in_bytes", f"{limit}\n")
    write(root, f"{folder}/memory.usage_in_bytes", f"{usage}\n")
    write(root, f"{folder}/memory.stat", f"cache {cache}\nrss {usage - cache}\nshmem {shmem}\n"
                                         f"hierarchical_memory_limit {hierarchical or limit}\n"
                                         f"total_cache {cache}\ntotal_shmem {shmem}\n")


def v2_group(root: Path, folder: str, limit: int | None, current: int, file: int = 0, shmem: int = 0,
             high: int | None = None) -> None:
    write(root, f"{folder}/memory.max", "max\n" if limit is None else f"{limit}\n")
    write(root, f"{folder}/memory.high", "max\n" if high is None else f"{high}\n")
    write(root, f"{folder}/memory.current", f"{current}\n")
    write(root, f"{folder}/memory.stat", f"anon {current - file}\nfile {file}\nshmem {shmem}\n")


V1_MOUNTS = ("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
             "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
             "35 31 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
V2_MOUNTS = "30 23 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"


def probe(root: Path) -> dict:
    return _lib.memory_available(str(root))


def test_cgroup_v1_limit_of_the_process_own_cgroup(tmp_path):
    fake_proc(tmp_path, "5:cpu:/\n4:memory:/jobs/job1\n0::/\n", V1_MOUNTS)
    base = "/sys/fs/cgroup/memory"
    v1_group(tmp_path, base, V1_UNLIMITED, 8 * GIB, cache=6 * GIB)
    v1_group(tmp_path, base + "/jobs", V1_UNLIMITED, 3 * GIB, cache=GIB)
    v1_group(tmp_path, base + "/jobs/job1", 2 * GIB, 700 * MIB, cache=300 * MIB, shmem=100 * MIB)
    m = probe(tmp_path)
    # usage beyond reclaimable page cache: 700M - (300M - 100M shared, not reclaimable) = 500M
    assert m["cgroup_version"] == 1 and m["cgroup_path"] == base + "/jobs/job1"
    assert m["cgroup_limit"] == 2 * GIB and m["cgroup_used"] == 500 * MIB
    assert m["available"] == 2 * GIB - 500 * MIB
    assert m["mem_available"] == 20 * GIB


def test_cgroup_v1_ancestor_leaving_less_room_wins(tmp_path):
    fake_proc(tmp_path, "4:memory:/jobs/job1\n", V1_MOUNTS)
    base = "/sys/fs/cgroup/memory"
    v1_group(tmp_path, base, V1_UNLIMITED, 8 * GIB)
    v1_group(tmp_path, base + "/jobs", 3 * GIB, int(2.5 * GIB), cache=GIB)   # 1.5G pinned of 3G: 1.5G free
    v1_group(tmp_path, base + "/jobs/job1", 4 * GIB, 200 * MIB, hierarchical=3 * GIB)
    m = probe(tmp_path)
    assert m["cgroup_path"] == base + "/jobs" and m["available"] == int(1.5 * GIB)


def test_cgroup_v1_limit_above_the_mounted_tree_comes_from_hierarchical_memory_limit(tmp_path):
    # a container sees its own cgroup as the root of the mount; the limit sits on an ancestor outside it
    fake_proc(tmp_path, "4:memory:/docker/abc\n",
              "40 30 0:30 /docker/abc /sys/fs/cgroup/memory ro,relatime - cgroup cgroup rw,memory\n")
    folder = "/sys/fs/cgroup/memory"
    v1_group(tmp_path, folder, V1_UNLIMITED, 300 * MIB, cache=100 * MIB, hierarchical=GIB)
    m = probe(tmp_path)
    assert m["cgroup_version"] == 1 and m["cgroup_limit"] == GIB and m["available"] == GIB - 200 * MIB


def test_cgroup_v2_nested_limits_and_memory_high(tmp_path):
    fake_proc(tmp_path, "0::/user.slice/app.scope\n", V2_MOUNTS)
    base = "/sys/fs/cgroup"
    v2_group(tmp_path, base, None, 10 * GIB)
    v2_group(tmp_path, base + "/user.slice", 8 * GIB, 2 * GIB, file=GIB)
    v2_group(tmp_path, base + "/user.slice/app.scope", None, 900 * MIB, file=400 * MIB, high=3 * GIB)
    m = probe(tmp_path)
    # app.scope: high 3G - (900M - 400M) = 2.5G; user.slice: 8G - 1G = 7G
    assert m["cgroup_version"] == 2 and m["cgroup_path"] == base + "/user.slice/app.scope"
    assert m["cgroup_limit"] == 3 * GIB and m["available"] == 3 * GIB - 500 * MIB


def test_cgroup_v2_container_namespace_mount(tmp_path):
    # a cgroup namespace: /proc/self/cgroup says "/" and the mount shows the container's subtree
    fake_proc(tmp_path, "0::/\n", V2_MOUNTS.replace(" / /sys/fs/cgroup", " /kubepods/pod1 /sys/fs/cgroup"))
    v2_group(tmp_path, "/sys/fs/cgroup", 4 * GIB, GIB)
    m = probe(tmp_path)
    assert m["cgroup_path"] == "/sys/fs/cgroup" and m["available"] == 3 * GIB


def test_mem_available_caps_a_loose_cgroup_and_no_cgroup_means_mem_available(tmp_path):
    fake_proc(tmp_path, "0::/a\n", V2_MOUNTS, mem_available_kb=1024 * 1024)
    v2_group(tmp_path, "/sys/fs/cgroup/a", 8 * GIB, GIB)
    m = probe(tmp_path)
    assert m["available"] == GIB and m["cgroup_limit"] == 8 * GIB
    other = tmp_path / "none"
    fake_proc(other, "0::/\n", "")
    m = probe(other)
    assert m["available"] == 20 * GIB and m["cgroup_version"] == 0 and m["cgroup_limit"] == NO_LIMIT


def test_an_over_limit_cgroup_leaves_nothing_and_unreadable_proc_is_an_error(tmp_path):
    fake_proc(tmp_path, "0::/a\n", V2_MOUNTS)
    v2_group(tmp_path, "/sys/fs/cgroup/a", GIB, 2 * GIB)
    assert probe(tmp_path)["available"] == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    m = probe(empty)
    assert m["status"] == _lib.ERR_IO and m["available"] == NO_LIMIT


def test_this_machine(tmp_path):
    m = _lib.memory_available()
    assert m["status"] == _lib.OK
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert abs(m["mem_available"] - int(meminfo["MemAvailable"].split()[0]) * 1024) < GIB
    assert 0 < m["available"] <= m["mem_available"]


#
# sizing the slots from what is available
#

PROBE = r"""
import json, os, sys
from zipmoe_py import Llama, _lib
from zipmoe_py.bindings import llama_cpp as lc
opts = json.loads(sys.argv[2])
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_batch=256, n_threads=2, verbose=True, **opts)
plans = [llm.zipmoe_stats()["memory"]]
cp = lc.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 256, 256, 256, 2, 2
second = lc.llama_init_from_model(llm._model.model, cp)
plans.append(llm.zipmoe_stats()["memory"])
out = llm.create_completion("The capital of France is", max_tokens=4, temperature=0.0)["choices"][0]["text"]
lc.llama_free(second)
plans.append(llm.zipmoe_stats()["memory"])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"plans": plans, "text": out, "peak_rss": int(status["VmHWM"].split()[0]) * 1024}))
"""


def sized(path, env=None, **opts) -> tuple[dict, str]:
    proc = run([sys.executable, "-c", PROBE, path, json.dumps(opts)], env={**os.environ, **(env or {})},
               cwd=Path(path).parent)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout.decode().strip().splitlines()[-1]), proc.stderr.decode()


def expected_slots(plan: dict) -> int:
    fit = plan["fits"] // plan["expert_bytes"]
    if plan["budget"]:
        want = min(plan["slot_capacity"], plan["budget"] // plan["expert_bytes"])
        return want if want <= fit else max(min(want, plan["min_slots"]), fit)
    return min(plan["slot_capacity"], max(plan["min_slots"], fit))


@pytest.fixture
def zipmoe_qwen(zipmoe_gguf):
    return zipmoe_gguf("qwen2moe")


def test_plenty_of_memory_keeps_every_expert_and_the_sums_add_up(zipmoe_qwen):
    result, _ = sized(zipmoe_qwen)
    one, two, after = result["plans"]
    assert one["source"] == "MemAvailable" or one["source"].startswith("cgroup")
    for plan, n_ctx in ((one, 1), (two, 2), (after, 1)):
        assert plan["n_contexts"] == n_ctx
        assert plan["fits"] == plan["available"] - plan["non_expert"] - plan["contexts"] - plan["cache_buffers"] - plan["margin"]
        assert plan["n_slots"] == plan["slot_capacity"] == expected_slots(plan)
    assert two["contexts"] > one["contexts"] == after["contexts"] > 0
    assert one["non_expert"] > 0 and one["cache_buffers"] > 0


def test_a_limit_shrinks_the_slots_per_context_and_freeing_one_grows_them_back(zipmoe_qwen):
    """zipmoe.mem_limit set so that one context leaves room for every expert and two leave room for none."""
    # with zipmoe.mem_limit L, available = L - the resident memory when loading began
    first, _ = sized(zipmoe_qwen, env={"ZIPMOE_MEM_LIMIT": str(8 * GIB)})
    one = first["plans"][0]
    assert one["source"].startswith("zipmoe.mem_limit")
    resident_at_load = 8 * GIB - one["available"]
    ctx_bytes = one["contexts"]
    # one context's fit = every expert + half a context; the margin is 64 MiB + available / 32
    need = (one["non_expert"] + ctx_bytes + one["cache_buffers"] + one["expert_bytes"] * one["slot_capacity"]
            + ctx_bytes // 2 + 64 * MIB)
    limit = resident_at_load + need * 32 // 31
    result, log = sized(zipmoe_qwen, env={"ZIPMOE_MEM_LIMIT": str(limit)})
    one, two, after = result["plans"]
    assert one["source"].startswith("zipmoe.mem_limit")
    assert one["n_slots"] == expected_slots(one) and two["n_slots"] == expected_slots(two)
    assert after["n_slots"] == expected_slots(after)
    assert two["n_slots"] < one["n_slots"] and two["n_slots"] == two["min_slots"] == 4  # qwen2moe's top-k
    assert after["n_slots"] == one["n_slots"]
    assert "memory is short for the ZipMoE expert cache" in log


def test_a_budget_that_does_not_fit_is_reduced_with_the_numbers(zipmoe_qwen):
    one_expert, _, everything = expert_geometry(zipmoe_qwen)
    result, log = sized(zipmoe_qwen, env={"ZIPMOE_MEM_LIMIT": "1M"}, zipmoe_budget=everything)
    plan = result["plans"][0]
    assert plan["budget"] == everything and plan["fits"] == 0
    assert plan["n_slots"] == 4 == expected_slots(plan)
    assert "zipmoe.budget of" in log and "does not fit: available" in log and "using 4 slots" in log
    # and with room, the budget is kept as given
    result, _ = sized(zipmoe_qwen, zipmoe_budget=5 * one_expert)
    assert all(p["n_slots"] == 5 for p in result["plans"])


def test_pools_that_do_not_fit_refuse_the_context_with_the_numbers(zipmoe_qwen):
    from zipmoe_py import Llama

    os.environ["ZIPMOE_MEM_LIMIT"] = "1M"
    try:
        # the ValueError llama-cpp-python raises, with the numbers though verbose=False
        with pytest.raises(ValueError, match="cannot make a context for .*: the ZipMoE pools need .* only 0 bytes "
                                             "is left: available"):
            Llama(model_path=str(zipmoe_qwen), n_ctx=256, n_threads=2, verbose=False, zipmoe_pools="F=2,C=2")
    finally:
        del os.environ["ZIPMOE_MEM_LIMIT"]
    proc = run([_paths.program("llama-completion"), "-m", zipmoe_qwen, "-p", "Hi", "-n", 2, "-no-cnv", "-c", 256,
                "--override-kv", "zipmoe.pool_f=int:2,zipmoe.pool_c=int:2"],
               env={**os.environ, "ZIPMOE_MEM_LIMIT": "1M"}, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert b"the ZipMoE pools need" in proc.stderr and b"only 0 bytes is left: available" in proc.stderr


def test_bad_memory_limits_are_named(zipmoe_qwen):
    from zipmoe_py import Llama

    for bad in ["lots", "-1G", "0", "1.5X"]:
        os.environ["ZIPMOE_MEM_LIMIT"] = bad
        try:
            with pytest.raises(ValueError):
                Llama(model_path=str(zipmoe_qwen), n_ctx=256, verbose=False)
        finally:
            del os.environ["ZIPMOE_MEM_LIMIT"]
    proc = run([_paths.program("llama-completion"), "-m", zipmoe_qwen, "-p", "Hi", "-n", 2, "-no-cnv"],
               env={**os.environ, "ZIPMOE_MEM_LIMIT": "lots"}, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    assert b"ZIPMOE_MEM_LIMIT (environment) must be a size in bytes, or like 4G, 512M, 1.5GiB; got 'lots'" in proc.stderr


#
# a real memory cgroup, where the tests may make one
#

def _own_memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory" + path)
            return folder if (folder / "memory.limit_in_bytes").exists() else None
    folder = Path("/sys/fs/cgroup" + next(l.split(":", 2)[2] for l in Path("/proc/self/cgroup").read_text().splitlines()
                                          if l.startswith("0::")))
    return folder if (folder / "memory.max").exists() else None


def _child_cgroup() -> Path | None:
    parent = _own_memory_cgroup()
    if parent is None or not os.access(parent, os.W_OK):
        return None
    child = parent / f"zipmoe-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError:
        return None
    return child


CGROUP_RUN = r"""
import os, sys
open(sys.argv[1], "w").write(str(os.getpid()))
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2], *sys.argv[3:]])
"""

CGROUP_PROBE = r"""
import json, sys
from zipmoe_py import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=256, n_batch=64, n_threads=2, verbose=False)
words = "the model routes every token to a few experts and the cache keeps the popular ones".split()
llm.create_completion(" ".join(words * 4), max_tokens=8, temperature=0.0)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"plan": llm.zipmoe_stats()["memory"], "peak_rss": int(status["VmHWM"].split()[0]) * 1024}))
"""


def test_default_budget_follows_a_real_memory_limit(tmp_path_factory):
    """Under a limit smaller than baseline + every expert, with no options, the cache is sized from the
    limit (not from the machine's MemAvailable) and the process is neither killed nor over it: a real
    memory cgroup where this machine lets the tests make one, else zipmoe.mem_limit standing for it."""
    from zipmoe_py.convert import convert_to_bf16_gguf
    from zipmoe_py.devtools.tiny import make_tiny

    work = tmp_path_factory.mktemp("limit")
    make_tiny("qwen2moe", work / "hf", sizes={"moe_intermediate_size": 1408, "num_experts": 60})
    bf16 = convert_to_bf16_gguf(work / "hf", work / "bf16.gguf", quiet=True)
    path = work / "zipmoe.gguf"
    zformat.repack(bf16, path)
    one, _, everything = expert_geometry(path)
    # what the probe holds without experts, measured unlimited with a four-expert budget
    base = run([sys.executable, "-c", CGROUP_PROBE, path], cwd=work, env={**os.environ, "ZIPMOE_BUDGET": str(4 * one)})
    assert base.returncode == 0, base.stderr.decode()[-2000:]
    baseline = json.loads(base.stdout.decode().splitlines()[-1])["peak_rss"]
    cap = baseline + everything // 2
    child = _child_cgroup()
    try:
        if child is not None:
            v2 = (child / "memory.max").exists()
            (child / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(cap))
            proc = run([sys.executable, "-c", CGROUP_RUN, child / "cgroup.procs", CGROUP_PROBE, path], cwd=work)
        else:  # no rights to make a cgroup here: the same limit, told to the loader
            proc = run([sys.executable, "-c", CGROUP_PROBE, path], cwd=work,
                       env={**os.environ, "ZIPMOE_MEM_LIMIT": str(cap)})
        assert proc.returncode == 0, f"killed or failed under a {cap / MIB:.0f} MiB limit: {proc.stderr.decode()[-2000:]}"
        result = json.loads(proc.stdout.decode().splitlines()[-1])
    finally:
        if child is not None:
            child.rmdir()
    plan = result["plan"]
    assert plan["source"].startswith("cgroup" if child is not None else "zipmoe.mem_limit"), plan
    assert plan["available"] <= cap
    assert plan["min_slots"] < plan["n_slots"] and plan["n_slots"] * plan["expert_bytes"] < everything
    assert result["peak_rss"] <= cap


def completion(path, *extra, env=None) -> tuple[int, str]:
    """llama-completion's context size and log for one token of "Hi"."""
    import re

    proc = run([_paths.program("llama-completion"), "-m", path, "-p", "Hi", "-n", 1, "-no-cnv", "-v", *extra],
               env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    log = proc.stderr.decode()
    return int(re.findall(r"llama_context: n_ctx\s+= (\d+)", log)[-1]), log


def test_an_unset_context_gets_what_the_experts_leave_as_upstreams_fit(tiny_gguf, zipmoe_gguf):
    """n_ctx unset (llama-completion's default): stock takes the trained context (the tiny DeepSeek-V2
    keeps DeepSeek-V2-Lite's 163,840 tokens); a ZipMoE model takes it only when its KV cache fits in
    what every expert leaves of the memory beside the non-expert weights, the cache's buffers, twice its
    margin and a ubatch's logits, else the largest multiple of 256 that does, at least upstream fit's 4096 tokens:
    a small machine's experts keep their memory. A context size given stays as given."""
    import re

    trained = 163840
    assert completion(tiny_gguf("deepseek2"))[0] == trained
    zipmoe = zipmoe_gguf("deepseek2")
    assert completion(zipmoe)[0] == trained  # its 0.32 GiB KV cache fits beside every expert on this machine
    size = r"([0-9.]+ (?:bytes|KiB|MiB|GiB))"  # ggml_zipmoe_size_text
    said_re = re.compile(rf"no context size given: (\d+) tokens \(a KV cache of {size}\), not the trained "
                         rf"163840 \({size}\): as upstream's fit, the context gets what the model leaves, at "
                         rf"least 4096 tokens, and here the model's experts \({size}\) take all but {size} "
                         rf"of the {size} left beside the non-expert weights, the expert cache's buffers, twice its "
                         rf"margin and a ubatch's logits \({size}\)")
    units = {"bytes": 0, "KiB": 10, "MiB": 20, "GiB": 30}

    def gib(text):
        number, unit = text.split()
        return float(number) * 2 ** (units[unit] - 30)

    # the spare memory holds about 100k tokens (beside 200 MiB of logits: 102,400 tokens x 512 x 4 bytes); under 4096
    for limit_mib in (512, 256):
        limit = {"ZIPMOE_MEM_LIMIT": str(limit_mib << 20)}
        n_ctx, log = completion(zipmoe, env=limit)
        said = said_re.search(log)
        assert said and int(said.group(1)) == n_ctx, log[-3000:]
        kv_gib, trained_gib, experts_gib, spare_gib, left_gib, overhead_gib = (gib(said.group(i)) for i in range(2, 8))
        assert 4096 <= n_ctx < trained and n_ctx % 256 == 0
        assert overhead_gib >= 200 / 1024  # the logits of a 512-token ubatch at least
        # four roundings to 0.01, and nothing of what is left but the spare
        assert abs(left_gib - experts_gib - overhead_gib - spare_gib) <= 0.02 or spare_gib == 0
        assert spare_gib < trained_gib
        per_token_gib = trained_gib / trained
        if n_ctx > 4096:  # the most the spare memory holds, to 256 tokens and the log's rounding
            assert kv_gib <= spare_gib + 0.005 and (n_ctx + 256) * per_token_gib > spare_gib - 0.005
        else:
            assert spare_gib < (4096 + 256) * per_token_gib + 0.005
        # the estimate is the KV cache llama.cpp makes
        kv_mib = float(re.findall(r"KV buffer size =\s+([0-9.]+) MiB", log)[-1])
        assert abs(kv_mib / 1024 - kv_gib) <= 0.005
    assert completion(zipmoe, "-c", 512, env=limit)[0] == 512


def test_an_unset_context_leaves_the_slots_every_expert(zipmoe_gguf):
    """Where the trained context's KV cache fits beside every expert but not beside the cache's buffers, its
    margin and the context's logits too, an unset context is made smaller, so that the slots hold every
    expert and the preload fills them (a trained context there left the slots a few experts short, the
    preload read nothing, and every expert was then missed once: slower than stock)."""
    import re

    zipmoe = zipmoe_gguf("deepseek2")
    n_ctx, log = completion(zipmoe, env={"ZIPMOE_MEM_LIMIT": str(2 << 30)})
    assert n_ctx == 163840 and "ZipMoE preloaded" in log, log[-3000:]
    kv_mib = float(re.findall(r"KV buffer size =\s+([0-9.]+) MiB", log)[-1])
    left = re.search(r"\(available ([0-9.]+) GiB .*?- non-expert weights ([0-9.]+) (MiB|GiB)", log)
    non_expert_mib = float(left.group(2)) * (1024 if left.group(3) == "GiB" else 1)
    experts_mib = float(re.search(r"all experts ([0-9.]+) MiB", log).group(1))
    # the trained context's KV cache and 100 MiB fit beside every expert: less than a ubatch's logits (200 MiB)
    limit_mib = non_expert_mib + experts_mib + kv_mib + 100
    n_ctx, log = completion(zipmoe, env={"ZIPMOE_MEM_LIMIT": str(int(limit_mib * 2**20))})
    assert 4096 <= n_ctx < 163840, log[-3000:]
    assert "nothing loaded: the slots in use do not hold every expert" not in log
    preloaded = re.search(r"ZipMoE preloaded (\d+) experts", log)
    assert preloaded, log[-3000:]


def test_an_unset_context_of_a_sliding_window_model_counts_its_window(zipmoe_gguf):
    """gpt-oss: every other layer attends within a window of 8 tokens here, and llama.cpp keeps only that
    window and a ubatch of cells for them. An unset context gets what the experts leave, counting the full
    layers per token and the sliding ones at their window (not the trained 131,072 tokens whatever the
    memory), and the estimate is the KV cache llama.cpp makes: both of its caches, the sliding one's
    ubatch counted at its largest (n_batch)."""
    import re

    # about 10 MiB spare beside every expert, the cache's buffers, twice its margin and a ubatch's logits (297 MiB)
    n_ctx, log = completion(zipmoe_gguf("gptoss"), env={"ZIPMOE_MEM_LIMIT": str(520 << 20)})
    said = re.search(r"no context size given: (\d+) tokens \(a KV cache of ([0-9.]+) (KiB|MiB)\), not the trained 131072", log)
    assert said and int(said.group(1)) == n_ctx, log[-3000:]
    assert 4096 < n_ctx < 131072 and n_ctx % 256 == 0
    estimate = float(said.group(2)) / (1024 if said.group(3) == "KiB" else 1)
    cells = [int(c) for c in re.findall(r"creating (?:non-SWA|    SWA) KV cache, size = (\d+) cells", log)[-2:]]
    assert cells[0] == n_ctx and cells[1] < 4096, cells
    made = sum(float(m) for m in re.findall(r"KV buffer size =\s+([0-9.]+) MiB", log)[-2:])
    # what the ubatch bound adds: (2048 - 512) cells of the sliding layer, 128 bytes each, and the log's rounding
    assert made - 0.01 <= estimate <= made + 1536 * 128 / 2**20 + 0.06, (estimate, made)
