"""zipmoe-profile: record which experts a ZipMoE model's routers choose, per decode batch size.

For each batch size B, the prompts are taken B at a time and decoded together as B sequences
(greedy), so every decode ubatch has B tokens. The expert cache counts, for every MoE layer, in
how many ubatches each expert was chosen (ggml_zipmoe_cache_get_activations); prefills are not
counted. The result is the PROFILE document of docs/PLAN_FORMAT.md, with the rank-based inclusion
probabilities f_r of each batch size added under "f" for reading (the planner derives them again
from the counts).

With --costs, it also measures this machine's delays once (the scheduler's and planner's u, v
and c: reading one SM-chunk, reading one E-chunk, decoding and recovering one E-chunk) on
sampled expert tensors of the model, and saves them as the planner's COSTS document
(docs/PLAN_FORMAT.md).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from . import _lib
from .slot_sets import served_layers
from .errors import ZipMoEError
from .plan_files import COSTS_FORMAT, FORMAT_VERSION, PROFILE_FORMAT
from .plan_math import rank_inclusion_probabilities


def expert_bytes_by_pool(path: Path) -> tuple[dict, int, int]:
    """({F, C, S, E}: bytes of one expert in each pool's compression state as the runtime keeps it: a
    slot for F; for C, S and E a store entry, sized for the file's largest E-chunks and 64-byte aligned
    as in ggml-zipmoe), tensors per expert, shards per tensor."""
    from . import format as zformat

    with zformat.ZipMoEFile(path) as zf:
        raw = sorted({zf.type(t) for t in zf.tensors if zf.is_raw(t)})
        if raw:
            from .gguf_file import ggml_type_name

            raise ZipMoEError(f"{path}: its routed experts are stored raw ({', '.join(map(ggml_type_name, raw))}: "
                              "nothing to decompress), so there are no pools to plan: it serves from one F pool")
        sizes = zf.expert_bytes()
        largest_e = max(sum(chunk.size for t in tensors for chunk in zf.chunks(zf.tensors[t], e)[1:])
                        for tensors in zf.moe_layers().values() for e in range(zf.shape(zf.tensors[tensors[0]])[2]))
        shards = zf.shards

    def entry(n: int) -> int:
        return -(-n // 64) * 64

    return ({"F": sizes.one_expert, "C": entry(sizes.sm_chunks + largest_e), "S": entry(sizes.sm_chunks),
             "E": entry(largest_e)}, len(zformat.EXPERT_KINDS), shards)


def measure_costs(model: Path, samples: int = 24, threads: int = 1) -> dict:
    """The COSTS document for this machine: medians over `samples` random expert tensors of the time
    to read one SM-chunk (u) and one E-chunk (v) with O_DIRECT (or, where the filesystem has none,
    buffered after dropping the file from the page cache), and to decode and recover one E-chunk (c,
    one thread)."""
    from . import codec
    from . import format as zformat

    lib = _lib.lib()
    try:
        zf = zformat.ZipMoEFile(model, direct_io=True)
        direct = True
    except ZipMoEError:
        zf = zformat.ZipMoEFile(model)
        direct = False
    with zf:
        if not direct:
            fd = os.open(model, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        size = lib.ggml_zipmoe_file_chunk_buffer_size(zf._handle)
        raw = np.empty(size + _lib.CHUNK_ALIGNMENT, np.uint8)
        buf = raw[(-raw.ctypes.data) % _lib.CHUNK_ALIGNMENT:][:size]  # O_DIRECT wants an aligned buffer
        rng = random.Random(0)
        decoder = codec.Decoder()
        u, v, c = [], [], []
        for _ in range(samples):
            name = rng.choice(zf.tensors)
            expert = rng.randrange(zf.shape(name)[2])
            tensor = zf.tensors.index(name)
            stored = []
            for k, ref in enumerate(zf.chunks(name, expert)):
                t0 = time.perf_counter()
                status = lib.ggml_zipmoe_file_read_chunk(zf._handle, tensor, expert, k, buf.ctypes.data, size)
                (u if k == 0 else v).append(time.perf_counter() - t0)
                if status != _lib.OK:
                    raise ZipMoEError(f"{model}: reading {ref.describe()}: {_lib.status_string(status)}")
                stored.append((bytes(buf[:ref.size]), lib.ggml_zipmoe_codec_name(ref.codec).decode()))
            sm = np.frombuffer(stored[0][0], np.uint8)
            job = codec.ExpertDecode(decoder, [s for s, _ in stored[1:]], [n for _, n in stored[1:]], sm)
            job()  # first call: page faults of the output
            t0 = time.perf_counter()
            job()
            c.append((time.perf_counter() - t0) / (len(stored) - 1))
        decoder.close()
    return {"format": COSTS_FORMAT, "version": FORMAT_VERSION, "u_s": statistics.median(u),
            "v_s": statistics.median(v), "c_s": statistics.median(c), "threads": threads,
            "measured_on": {"model": str(model), "samples": samples, "direct_io": direct}}


def read_prompts(path: Path) -> list[str]:
    try:
        prompts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise ZipMoEError(f"cannot read prompts from {path}: {e}") from None
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ZipMoEError(f"{path} holds no prompt (one prompt per line)")
    return prompts


def activation_counts(cache, layers: list[int]) -> tuple[np.ndarray, int]:
    """[n_layer_moe, n_expert] counts and the ubatch count since the last reset."""
    rows, n_ubatches = [], 0
    for il in layers:
        counts, n = _lib.cache_activations(cache, il)
        rows.append(counts)
        n_ubatches = n
    return np.array(rows, dtype=np.int64), n_ubatches


def decode_group(llm, prompts: list[str], n_tokens: int, n_ctx: int, threads: int | None, cache, layers) \
        -> tuple[np.ndarray, int]:
    """Decode the prompts as parallel sequences, n_tokens greedy steps; activation counts of the steps."""
    from .bindings import llama_cpp as lc

    n_vocab = llm.n_vocab()
    tokens = [llm.tokenize(p.encode(), add_bos=True, special=False) for p in prompts]
    longest = max(len(t) for t in tokens)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = max(n_ctx, (longest + n_tokens) * len(prompts) + 16)
    cparams.n_batch = cparams.n_ubatch = max(512, longest * len(prompts))
    cparams.n_seq_max = len(prompts)
    if threads:
        cparams.n_threads = cparams.n_threads_batch = threads
    ctx = lc.llama_init_from_model(llm._model.model, cparams)
    if not ctx:
        raise ZipMoEError("llama_init_from_model failed (context too large for memory?)")
    batch = lc.llama_batch_init(cparams.n_batch, 0, len(prompts))
    try:
        def decode(entries, want_logits):
            batch.n_tokens = len(entries)
            for i, (tok, pos, seq) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, i in want_logits
            if lc.llama_decode(ctx, batch) != 0:
                raise ZipMoEError("llama_decode failed")

        entries = [(tok, pos, s) for s, toks in enumerate(tokens) for pos, tok in enumerate(toks)]
        last_of = {s: max(i for i, e in enumerate(entries) if e[2] == s) for s in range(len(prompts))}
        decode(entries, set(last_of.values()))
        rows = {s: i for s, i in last_of.items()}
        pos = [len(t) for t in tokens]
        before, ubatches_before = activation_counts(cache, layers)
        for _ in range(n_tokens):
            step = []
            for s in range(len(prompts)):
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, rows[s]), (n_vocab,))
                step.append((int(np.argmax(logits)), pos[s], s))
                pos[s] += 1
            decode(step, set(range(len(step))))
            rows = {s: s for s in range(len(prompts))}
        after, ubatches_after = activation_counts(cache, layers)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    return after - before, ubatches_after - ubatches_before


def profile(model: Path, prompts: list[str], batch_sizes: list[int], n_tokens: int, budget=None,
            threads: int | None = None, progress: bool = True) -> dict:
    from .bindings import Llama

    bytes_by_state, n_tensors, n_shards = expert_bytes_by_pool(model)
    # the counts come from the fetch ops, which resident views (every expert in a slot) leave out of the graph
    llm = Llama(model_path=str(model), n_ctx=512, n_threads=threads, verbose=False, zipmoe_budget=budget,
                zipmoe_resident_views=False)
    try:
        cache = _lib.llama_model_zipmoe_cache(llm._model.model)
        if not cache:
            raise ZipMoEError(f"{model} is not a ZipMoE GGUF (convert it with zipmoe-convert)")
        layers = served_layers(cache)
        arch = llm.metadata.get("general.architecture", "")
        n_used = int(llm.metadata.get(f"{arch}.expert_used_count", 0))
        n_expert = _lib.lib().ggml_zipmoe_cache_n_expert(cache, layers[0])
        batches = {}
        for b in batch_sizes:
            groups = [[prompts[(g * b + i) % len(prompts)] for i in range(b)]
                      for g in range(max(1, len(prompts) // b))]
            total, n_ubatches = np.zeros((len(layers), n_expert), np.int64), 0
            for gi, group in enumerate(groups):
                if progress:
                    print(f"\rzipmoe-profile: batch {b}: group {gi + 1}/{len(groups)}", end="", file=sys.stderr,
                          flush=True)
                counts, n = decode_group(llm, group, n_tokens, 512, threads, cache, layers)
                total += counts
                n_ubatches += n
            if progress:
                print(file=sys.stderr)
            batches[str(b)] = {"n_ubatches": int(n_ubatches), "counts": total.tolist(),
                               "f": rank_inclusion_probabilities(total, n_ubatches).tolist()}
    finally:
        llm.close()
    return {"format": PROFILE_FORMAT, "version": FORMAT_VERSION, "model": str(model), "n_layer_moe": len(layers),
            "n_expert": int(n_expert), "n_expert_used": n_used, "expert_bytes": bytes_by_state,
            "n_tensors_per_expert": n_tensors, "n_shards": n_shards, "batches": batches}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="zipmoe-profile",
        description="Decode prompts with a ZipMoE GGUF and record, per MoE layer and decode batch size, how "
                    "often its router chose each expert; writes the profile zipmoe-plan takes.")
    ap.add_argument("model", type=Path, help="ZipMoE GGUF (made by zipmoe-convert)")
    ap.add_argument("--prompts", type=Path, required=True, help="text file, one prompt per line")
    ap.add_argument("--batch-sizes", default="1", metavar="B[,B...]",
                    help="decode batch sizes to profile: prompts are decoded B at a time as parallel sequences "
                         "(default: %(default)s)")
    ap.add_argument("-n", "--tokens", type=int, default=32,
                    help="greedy decode steps per group of prompts (default: %(default)s)")
    ap.add_argument("-b", "--budget", default=None, metavar="SIZE",
                    help="expert-cache memory while profiling, like 4G (default: half the available memory)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: llama.cpp's choice)")
    ap.add_argument("-o", "--output", type=Path, required=True, help="profile JSON to write")
    ap.add_argument("--costs", type=Path, default=None, metavar="FILE",
                    help="also measure this machine's read and decode delays (u, v, c) on the model and save "
                         "them here, for zipmoe-plan --costs")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",")]
    except ValueError:
        ap.error(f"--batch-sizes must be comma-separated positive integers, got {args.batch_sizes!r}")
    if any(s <= 0 for s in sizes):
        ap.error(f"--batch-sizes must be positive, got {args.batch_sizes!r}")
    if args.tokens <= 0:
        ap.error(f"--tokens must be positive, got {args.tokens}")
    for flag, out in (("-o", args.output), ("--costs", args.costs)):
        if out is not None and not out.parent.is_dir():  # before the run, not after it
            ap.error(f"the folder of {flag} {out} does not exist")
    if args.threads is not None and args.threads <= 0:
        ap.error(f"--threads must be positive, got {args.threads}")
    try:
        from .bindings import check_model_file

        check_model_file(args.model)
        doc = profile(args.model, read_prompts(args.prompts), sizes, args.tokens, args.budget, args.threads,
                      progress=not args.quiet)
        if args.costs is not None:
            costs = measure_costs(args.model, threads=args.threads or os.cpu_count() or 1)
            args.costs.write_text(json.dumps(costs, indent=1) + "\n")
            if not args.quiet:
                print(f"costs: SM-chunk read {costs['u_s'] * 1e3:.2f} ms, E-chunk read {costs['v_s'] * 1e3:.3f} ms, "
                      f"E-chunk decode {costs['c_s'] * 1e3:.3f} ms; wrote {args.costs}")
    except ZipMoEError as e:
        print(f"zipmoe-profile: error: {e}", file=sys.stderr)
        return 1
    args.output.write_text(json.dumps(doc) + "\n")
    if not args.quiet:
        for b, batch in doc["batches"].items():
            f = batch["f"]
            print(f"batch {b}: {batch['n_ubatches']} ubatches; top-rank inclusion {f[0]:.3f}, "
                  f"median rank {f[len(f) // 2]:.3f}, last rank {f[-1]:.3f}")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
