"""Run by tests/test_rpc.py in a child process: rpc-server hosts are registered as ggml devices once per
process, and a test's servers are gone after it. Three jobs:

    rpc_worker.py exact ARCH BF16 ZIPMOE SERVERS N_SEQ BUDGET_NAME...
        every layer offloaded (n_gpu_layers 99) to the servers; test_serve's logit trace of the BF16 GGUF
        (stock llama.cpp with the same RPC setup) against the ZipMoE GGUF at each budget, every logit as
        raw bits; prints one JSON line of the ZipMoE runs' statistics
    rpc_worker.py device_pools ARCH BF16 ZIPMOE SERVERS
        one sequence, 48 decode steps at half the experts, zipmoe.device_stores on, the re-plan after 4: the
        same comparison; prints
        the ZipMoE run's statistics
    rpc_worker.py die ZIPMOE SERVERS
        greedy decoding, printing "step N" after each token, until a decode fails (the test kills a
        server); prints "error: MESSAGE" and exits 0, or exits 1 after 2000 steps
"""
from __future__ import annotations

import json
import sys

from test_serve import PROMPTS, assert_same_trace, budget_of, load, logits_trace

N_DECODE = 16


def trace(path, servers: str, n_seq: int, n_decode: int = N_DECODE, prompts=PROMPTS, **options):
    llm = load(path, rpc_servers=servers, n_gpu_layers=99, **options)
    try:
        got, tokens = logits_trace(llm, prompts[:n_seq], n_decode)
        return got, tokens, llm.zipmoe_stats()
    finally:
        llm.close()


def exact(arch: str, bf16: str, zipmoe: str, servers: str, n_seq: str, *budget_names: str) -> int:
    want, want_tokens, _ = trace(bf16, servers, int(n_seq))
    stats = {}
    for name in budget_names:
        got, got_tokens, stats[name] = trace(zipmoe, servers, int(n_seq), zipmoe_budget=budget_of(zipmoe, arch, name))
        assert_same_trace(got, got_tokens, want, want_tokens, f"the BF16 GGUF over RPC ({servers}), budget {name}")
    print(json.dumps(stats))
    return 0


def device_pools(arch: str, bf16: str, zipmoe: str, servers: str) -> int:
    """one sequence decoded long at half the experts, the re-plan after 4 decode steps. A prompt of one
    word: the pools rank experts by the tokens that chose them, and a longer prompt's ranks keep the
    tiny models' few hot experts in F, under a miss per layer a step"""
    want, want_tokens, _ = trace(bf16, servers, 1, 48, prompts=["Hi"])
    got, got_tokens, stats = trace(zipmoe, servers, 1, 48, prompts=["Hi"],
                                   zipmoe_budget=budget_of(zipmoe, arch, "half"), zipmoe_replan_tokens=4,
                                   zipmoe_device_stores=True)
    assert_same_trace(got, got_tokens, want, want_tokens, f"the BF16 GGUF over RPC ({servers}), host stores")
    print(json.dumps(stats))
    return 0


def die(zipmoe: str, servers: str) -> int:
    from zipmoe_py import ZipMoEError

    llm = load(zipmoe, rpc_servers=servers, n_gpu_layers=99)
    tokens = llm.tokenize(PROMPTS[0].encode(), add_bos=True, special=False)
    try:
        for step in range(2000):
            llm.eval(tokens if step == 0 else [token])
            token = llm.sample(temp=0.0)
            print(f"step {step}", flush=True)
    except ZipMoEError as e:
        print(f"error: {e}", flush=True)
        return 0
    finally:
        llm.close()
    return 1


if __name__ == "__main__":
    job, *args = sys.argv[1:]
    sys.exit({"exact": exact, "device_pools": device_pools, "die": die}[job](*args))
