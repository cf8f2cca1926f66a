"""Run by tests/test_rpc.py in a child process: rpc-server hosts are registered as ggml devices once per
process, and a test's servers are gone after it. The jobs:

    rpc_worker.py exact ARCH BF16 ZIPMOE SERVERS N_SEQ BUDGET_NAME...
        every layer offloaded (n_gpu_layers 99) to the servers; test_serve's logit trace of the BF16 GGUF
        (stock llama.cpp with the same RPC setup) against the ZipMoE GGUF at each budget, every logit as
        raw bits; prints one JSON line of the ZipMoE runs' statistics
    rpc_worker.py device_pools ARCH BF16 ZIPMOE SERVERS
        one sequence, 6 decode steps at half the experts, zipmoe.device_stores on: the same comparison;
        prints the ZipMoE run's statistics
    rpc_worker.py cpu_compute ARCH BF16 ZIPMOE SERVERS N_SEQ
        one token's experts on the server, zipmoe.cpu_compute on, one thread: the same comparison; prints the
        statistics and, in the order logged, the thread counts the CPU's products were timed on
    rpc_worker.py placement ARCH BF16 ZIPMOE SERVERS N_SEQ PLACEMENT_JSON BUDGET_NAME...
        as exact, every layer offloaded and the placement's keyword arguments (override_tensor, n_cpu_moe)
        given to both; prints one JSON line: the ZipMoE runs' statistics, and by MoE layer the device
        stock llama.cpp gave its experts (its loader's debug log) and the device of the ZipMoE slots
    rpc_worker.py device_budgets ZIPMOE SERVERS BUDGETS
        every layer offloaded, zipmoe_device_budgets=BUDGETS; prints one JSON line: each set's device and
        slots, its memory plan and the load's warnings, and the model's Prometheus text
        (llama_model_zipmoe_metrics), or {"error": MESSAGE} where the load fails
    rpc_worker.py die ZIPMOE SERVERS
        greedy decoding, printing "step N" after each token, until a decode fails (the test kills a
        server); prints "error: MESSAGE" and exits 0, or exits 1 after 2000 steps
"""
from __future__ import annotations

import ctypes
import json
import re
import sys
import warnings

from test_serve import PROMPTS, THREADS, assert_same_trace, budget_of, load, logits_trace

N_DECODE = 16


def trace(path, servers: str, n_seq: int, n_decode: int = N_DECODE, prompts=PROMPTS, threads: int = THREADS,
          **options):
    llm = load(path, rpc_servers=servers, n_gpu_layers=99, threads=threads, **options)
    try:
        got, tokens = logits_trace(llm, prompts[:n_seq], n_decode, threads=threads)
        return got, tokens, llm.zipmoe_stats()
    finally:
        llm.close()


class LoaderLog:
    """llama.cpp's log, debug lines included, while a model loads: zipmoe_py's Llama forwards the loader's
    lines to llama_cpp._logger.llama_log_callback, taken over here"""

    def __enter__(self):
        from llama_cpp import _logger

        from zipmoe_py.bindings import llama_cpp as lc

        self.logger, self.saved, self.lines = _logger, _logger.llama_log_callback, []

        @lc.llama_log_callback
        def capture(level, text, user_data):
            self.lines.append(text.decode(errors="replace"))

        self.capture = capture
        _logger.llama_log_callback = capture
        return self

    def __exit__(self, *exc):
        self.logger.llama_log_callback = self.saved


def stock_expert_devices(log: list[str]) -> dict[int, str]:
    """By layer, where stock's loader put the routed experts: the layer's device, or the buffer type an
    override gave them (CPU: host memory)"""
    text = "".join(log)
    devices = {int(il): dev for il, dev in re.findall(r"layer +(\d+) assigned to device (\S+),", text)}
    experts = {}
    for il, buft in re.findall(r"tensor blk\.(\d+)\.ffn_(?:gate|up|down)_exps\.weight \(.*?\) buffer type overridden to (\S+)", text):
        experts[int(il)] = "CPU" if buft.startswith("CPU") else buft
    return {il: experts.get(il, dev) for il, dev in devices.items()}


def placement(arch: str, bf16: str, zipmoe: str, servers: str, n_seq: str, placement_json: str, *budget_names) -> int:
    from zipmoe_py.slot_sets import caches, served_layers

    where = json.loads(placement_json)
    with LoaderLog() as log:
        stock = load(bf16, rpc_servers=servers, n_gpu_layers=99, **where)
    try:
        want, want_tokens = logits_trace(stock, PROMPTS[:int(n_seq)], N_DECODE)
    finally:
        stock.close()
    stock_devices = stock_expert_devices(log.lines)
    out = {"stock": stock_devices, "runs": {}}
    for name in budget_names:
        llm = load(zipmoe, rpc_servers=servers, n_gpu_layers=99, zipmoe_budget=budget_of(zipmoe, arch, name), **where)
        try:
            slots = {layer: device for device, cache in caches(llm._model.model) for layer in served_layers(cache)}
            got, got_tokens = logits_trace(llm, PROMPTS[:int(n_seq)], N_DECODE)
            stats = llm.zipmoe_stats()
        finally:
            llm.close()
        assert_same_trace(got, got_tokens, want, want_tokens, f"the BF16 GGUF over RPC ({servers}, {where}), budget {name}")
        out["runs"][name] = {"slots": slots, "n_slots": stats["n_slots"], "h2d_bytes": stats["h2d_bytes"],
                             "misses": stats["expert_misses"], "sets": [s["device"] for s in stats["sets"]]}
    print(json.dumps(out))
    return 0


def exact(arch: str, bf16: str, zipmoe: str, servers: str, n_seq: str, *budget_names: str) -> int:
    want, want_tokens, _ = trace(bf16, servers, int(n_seq))
    stats = {}
    for name in budget_names:
        got, got_tokens, stats[name] = trace(zipmoe, servers, int(n_seq), zipmoe_budget=budget_of(zipmoe, arch, name))
        assert_same_trace(got, got_tokens, want, want_tokens, f"the BF16 GGUF over RPC ({servers}), budget {name}")
    print(json.dumps(stats))
    return 0


def device_pools(arch: str, bf16: str, zipmoe: str, servers: str) -> int:
    """one sequence at half the experts, host stores beside the server's slots: fewer decode steps than a
    re-plan waits for (zipmoe.replan_tokens, 8), as the stores are there from the prompt on"""
    want, want_tokens, _ = trace(bf16, servers, 1, 6)
    got, got_tokens, stats = trace(zipmoe, servers, 1, 6,
                                   zipmoe_budget=budget_of(zipmoe, arch, "half"), zipmoe_device_stores=True)
    assert_same_trace(got, got_tokens, want, want_tokens, f"the BF16 GGUF over RPC ({servers}), host stores")
    print(json.dumps(stats))
    return 0


def cpu_compute(arch: str, bf16: str, zipmoe: str, servers: str, n_seq: str) -> int:
    """slots on the server at one token's experts, zipmoe.cpu_compute on: the client's CPU computes the misses
    the balancer gives it. The server computes on its CPU as well, with the same kernels, so here the CPU's
    rounding is the device's and the logits must stay stock's, bit for bit"""
    want, want_tokens, _ = trace(bf16, servers, int(n_seq), threads=1)
    with LoaderLog() as log:  # the load and the graphs: the CPU's products timed on the graphs' one thread
        got, got_tokens, stats = trace(zipmoe, servers, int(n_seq), zipmoe_budget=budget_of(zipmoe, arch, "top-k"),
                                       zipmoe_cpu_compute=True, threads=1)
    assert_same_trace(got, got_tokens, want, want_tokens, f"the BF16 GGUF over RPC ({servers}), the CPU computing")
    timed = re.findall(r"products of a token take [\d.]+ ms on (\d+) CPU threads( \(a graph's\))?", "".join(log.lines))
    print(json.dumps({**stats, "cpu_products_timed_on": [(int(n), bool(graph)) for n, graph in timed]}))
    return 0


def device_budgets(zipmoe: str, servers: str, budgets: str) -> int:
    from zipmoe_py import ZipMoEError

    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            llm = load(zipmoe, rpc_servers=servers, n_gpu_layers=99, zipmoe_device_budgets=budgets)
    except ZipMoEError as e:
        print(json.dumps({"error": str(e)}))
        return 0
    try:
        logits_trace(llm, PROMPTS[:1], 2)
        sets = llm.zipmoe_stats()["sets"]
        out = {s["device"]: s["n_slots"] for s in sets}
        from zipmoe_py import _paths

        lib = ctypes.CDLL(str(_paths.shared_library("llama")))
        lib.llama_model_zipmoe_metrics.restype = ctypes.c_size_t
        lib.llama_model_zipmoe_metrics.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        text = ctypes.create_string_buffer(1 << 20)
        lib.llama_model_zipmoe_metrics(ctypes.cast(llm._model.model, ctypes.c_void_p), text, len(text))
        print(json.dumps({"slots": out, "memory": {s["device"]: s["memory"] for s in sets},
                          "warnings": [str(w.message) for w in warned], "metrics": text.value.decode()}))
    finally:
        llm.close()
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
    sys.exit({"exact": exact, "device_pools": device_pools, "cpu_compute": cpu_compute, "placement": placement, "device_budgets": device_budgets,
              "die": die}[job](*args))
