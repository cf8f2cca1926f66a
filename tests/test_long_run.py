"""A long generation at a fixed small budget: 2,000 tokens with a few experts of slots, read from the
file all along. The process's memory stays flat after warm-up, and the cache's statistics add up:
every (layer, expert) a ubatch chose was a hit or a miss, once."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np

RUN = textwrap.dedent('''
    import json, sys
    from zipmoe_py import Llama, _lib

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    llm = Llama(model_path=sys.argv[1], n_ctx=2304, n_threads=2, zipmoe_budget="100K", zipmoe_preload=False,
                verbose=False)
    samples = []
    n = 0
    # tokens, not text: llama-cpp-python's streamed text re-detokenizes what it holds back on every
    # token, which random weights' output makes quadratic (minutes for 2,000 tokens), all in Python
    for token in llm.generate(llm.tokenize(b"Once upon a time"), temp=0):
        n += 1
        if n % 50 == 0:
            samples.append((n, rss()))
        if n == 2000:
            break
    stats = llm.zipmoe_stats()
    cache = _lib.llama_model_zipmoe_cache(llm._model.model)
    chosen = 0
    for layer in range(256):  # layers the cache does not serve give None
        got = _lib.cache_activations(cache, layer)
        if got is not None:
            chosen += sum(got[0])
    print(json.dumps({"tokens": n, "samples": samples, "stats": {k: stats[k] for k in (
        "expert_hits", "expert_misses", "c_hits", "s_hits", "e_hits", "fetch_calls", "bytes_read", "n_slots")},
        "chosen": chosen}))
''')


def test_two_thousand_tokens_at_a_small_budget_keep_memory_flat_and_stats_add_up(zipmoe_gguf, tmp_path):
    proc = subprocess.run([sys.executable, "-c", RUN, str(zipmoe_gguf("qwen2moe"))], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tokens"] == 2000
    stats = out["stats"]
    assert stats["n_slots"] == 5 and stats["expert_misses"] > 2000  # served from the file all along
    assert stats["expert_hits"] + stats["expert_misses"] + stats["c_hits"] + stats["s_hits"] + stats["e_hits"] \
        == out["chosen"]
    # after warm-up (the first 500 tokens: KV cache pages, allocator pools), a straight line through RSS
    tokens, rss = np.array([s for s in out["samples"] if s[0] > 500], dtype=np.float64).T
    slope = np.polyfit(tokens, rss, 1)[0]
    print(f"\n2000 tokens, budget 100K ({stats['n_slots']} slots): {stats['expert_misses']} misses, "
          f"{stats['bytes_read'] / 2**20:.0f} MiB read; RSS {rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB, "
          f"slope {slope:.1f} bytes/token after token 500")
    # the KV cache grows by its pages as positions fill (n_ctx is reserved, written as used): allow a
    # page per token at most, i.e. nothing that grows with the experts read
    assert slope < 4096, slope
