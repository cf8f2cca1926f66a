"""zipmoe-chat: a llama-cli-style terminal chat on the ZipMoE fork.

Streams tokens as they are generated, formats turns with the chat template stored
in the GGUF, and reads turns from the terminal (or any stdin) until /exit or end of
input. With -p it answers one prompt and exits. With no model it makes a tiny
Qwen2-MoE model (random weights, real tokenizer), converts it to a ZipMoE GGUF and chats
with it under an expert-cache budget of a quarter of its experts.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

from . import _lib
from .errors import ZipMoEError, ZipMoEWarning
from .options import chat_flag, python_options, size_text, zipmoe_overrides
from .placement import PLACEMENT_KWARGS

HELP_TEXT = ("commands: /exit (or end of input) quits, /clear forgets the conversation, /help shows this; "
             "a message that starts with / is typed with //")


def demo_model_path(cache_dir: Path | None = None) -> Path:
    """Make (once) and return the demo model used when no model is given: a tiny Qwen2-MoE trained to
    answer a few questions (devtools/demo.py), as a ZipMoE GGUF."""
    from . import format as zformat
    from .convert import convert_to_bf16_gguf
    from .devtools.demo import DEMO_FORMAT, make_demo

    cache_dir = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zipmoe" / "demo"
    gguf_path = cache_dir / f"demo-qwen2moe-{DEMO_FORMAT}.zipmoe.gguf"
    if gguf_path.exists():
        return gguf_path
    cache_dir.mkdir(parents=True, exist_ok=True)
    print(f"zipmoe-chat: no model given; making the demo model in {cache_dir} (once: a minute or two)",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        make_demo(Path(tmp) / "hf")
        convert_to_bf16_gguf(Path(tmp) / "hf", Path(tmp) / "bf16.gguf", quiet=True)
        zformat.repack(Path(tmp) / "bf16.gguf", Path(tmp) / "demo.zipmoe.gguf")
        os.replace(Path(tmp) / "demo.zipmoe.gguf", gguf_path)  # whole or not at all
    return gguf_path


def experts_bytes(model: Path) -> int | None:
    """BF16 bytes of all routed experts of a ZipMoE GGUF, None for any other GGUF."""
    from . import format as zformat

    try:
        with zformat.ZipMoEFile(model) as zf:
            return zf.expert_bytes().all_experts
    except ZipMoEError:
        return None


def _time_account(stats: dict, n_tokens: int | None) -> str:
    """Where the graphs' time went: their compute outside fetches, and a fetch's wall time by part
    (ggml_zipmoe_cache_stats: the five parts add up to fetch_ns), per token when n_tokens is given."""
    per, unit = (n_tokens, "ms per token") if n_tokens else (1, "ms")
    parts = [("compute", max(0, stats["graph_ns"] - stats["fetch_ns"])), ("fetch lock", stats["lock_wait_ns"]),
             ("plan", stats["plan_ns"]), ("thread 0 decoding", stats["fetch_work_ns"]),
             ("waiting for reads", stats["read_wait_ns"]), ("waiting for the other threads", stats["finish_wait_ns"])]
    text = f"time ({unit}): graphs {stats['graph_ns'] / 1e6 / per:.1f} = " + ", ".join(
        f"{name} {ns / 1e6 / per:.1f}" for name, ns in parts)
    text += f"; {stats['decode_faults']} page faults while fetching"
    if stats.get("populate_bytes"):  # a helper thread's, beside the graphs: CPU they share on a small machine
        text += f"; stores' pages faulted in ahead: {stats['populate_bytes'] / 1e6:.1f} MB in {stats['populate_ns'] / 1e6:.1f} ms"
    if stats.get("migrate_experts"):  # a re-plan's change, beside the graphs
        text += f"; moved from C/S to F: {stats['migrate_experts']} experts in {stats['migrate_ns'] / 1e6:.1f} ms"
        if stats.get("moved_page_bytes"):  # pages the stores gave up, into the slots: no first write
            text += f", {stats['moved_page_bytes'] / 1e6:.1f} MB of the stores' pages moved into their slots"
    return text


def _format_stats(stats: dict, n_tokens: int | None = None) -> str:
    pooled = stats["c_hits"] + stats["s_hits"] + stats["e_hits"]
    lookups = stats["expert_hits"] + pooled + stats["expert_misses"]
    # of the lookups: found full in a slot (hits), in a store C/S/E (decoded or half read), or missed
    text = (f"experts: {lookups} lookups, {stats['expert_hits']} hits in slots "
            f"({100 * stats['expert_hits'] / lookups:.1f}%), {stats['expert_misses']} misses"
            if lookups else "experts: no lookups")
    if pooled:
        text += f"; from pools C/S/E: {stats['c_hits']}/{stats['s_hits']}/{stats['e_hits']}"
    text += (f"; read {stats['bytes_read'] / 1e6:.2f} MB; io {stats['io_ns'] / 1e6:.1f} ms, decode "
             f"{stats['decode_ns'] / 1e6:.1f} ms, recover {stats['recover_ns'] / 1e6:.1f} ms, fetch wall "
             f"{stats['fetch_ns'] / 1e6:.1f} ms")
    text += f"; {_time_account(stats, n_tokens)}"
    if stats.get("h2d_bytes"):
        text += f"; to the slots' device {stats['h2d_bytes'] / 1e6:.2f} MB"
    if stats.get("cpu_experts"):  # zipmoe.cpu_compute: exact weights, the CPU's rounding
        text += f"; computed on the CPU where held (zipmoe.cpu_compute, the CPU's rounding): {stats['cpu_experts']} experts"
    if stats.get("prefetch_bytes_read"):
        read, used = stats["prefetch_bytes_read"], stats["prefetch_bytes_used"]
        text += (f"; prefetch: {stats['prefetch_hits']} experts served, read {read / 1e6:.2f} MB, used "
                 f"{used / 1e6:.2f} MB, wasted {max(0, read - used) / 1e6:.2f} MB")
    if n_tokens:
        text += f"; per token: {stats['expert_misses'] / n_tokens:.2f} misses, {stats['bytes_read'] / n_tokens / 1e6:.3f} MB"
    return text


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'"""
    spans: list[list[int]] = []
    for layer in sorted(layers):
        if spans and layer == spans[-1][1] + 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def _counter_delta(now: dict, before: dict | None) -> dict:
    """every counter of the cache's statistics (the memory plan and the rest are not counters)"""
    return {k: now[k] - (before or {}).get(k, 0) for k, _ in _lib.CacheStats._fields_}


def _memory_text(plan: dict, on_device: bool) -> str:
    """A memory plan's sums: a device's free memory less what its slots leave for the rest there, or host
    memory less the weights, contexts, buffers and margin beside the slots."""
    size = size_text
    if on_device:
        return (f"available {size(plan['available'])} ({plan['source']}) - its other weights, KV cache and compute "
                f"buffers, a reserve and zero slots {size(plan['non_expert'])} = {size(plan['fits'])} for slots")
    return (f"available {size(plan['available'])} ({plan['source']}) - non-expert weights {size(plan['non_expert'])} "
            f"- {plan['n_contexts']} context(s) {size(plan['contexts'])} - cache buffers {size(plan['cache_buffers'])} "
            f"- margin {size(plan['margin'])} = {size(plan['fits'])} for slots and stores")


def _print_stats(llm, before: dict | None, n_tokens: int, first_token: dict | None = None) -> dict | None:
    """the reply's counters: per token over the tokens after the first (the steady state), the prompt's
    pass with the first token apart (first_token: the statistics when it came)"""
    now = llm.zipmoe_stats()
    if now is None:
        print("[stats] not a ZipMoE model: no expert cache", file=sys.stderr)
        return None
    delta = _counter_delta(now, before)
    if first_token is not None and n_tokens > 1:
        print(f"[stats] this reply ({n_tokens - 1} tokens after the first): "
              f"{_format_stats(_counter_delta(now, first_token), n_tokens - 1)}", file=sys.stderr)
        print(f"[stats] this reply's prompt and first token: {_format_stats(_counter_delta(first_token, before))}",
              file=sys.stderr)
    else:
        print(f"[stats] this reply ({n_tokens} tokens, the prompt's pass included): {_format_stats(delta, n_tokens)}",
              file=sys.stderr)
    print(f"[stats] total ({now['n_slots']} slots): {_format_stats(now)}", file=sys.stderr)
    subst = now.get("substitution") or {}
    if subst.get("lossy"):
        this = delta["substitutions"] / delta["substitution_tokens"] if delta["substitution_tokens"] else 0.0
        params = f" (alpha {subst['alpha']:g})" if "alpha" in subst else ""
        print(f"[stats] LOSSY expert substitution {subst['policy']}{params}: {delta['substitutions']} "
              f"experts replaced in this reply ({this:.2f} per token per MoE layer), {subst['substitutions']} in total "
              f"({subst['per_token']:.2f}); replies differ from the model's", file=sys.stderr)
    recall = now.get("prefetch_recall") or {}
    if recall.get("actual"):
        per_layer = ", ".join(f"{layer}: {r['recall']:.2f}" for layer, r in recall["layers"].items())
        print(f"[stats] prefetch recall (experts the next-layer prediction named, of those chosen): "
              f"{recall['recall']:.2f} over all layers; by layer {per_layer}", file=sys.stderr)
    rates, origins = now.get("rates"), now.get("rate_origins") or {}
    if rates:
        said = {"given": "given", "default": "the default: not measured", "measured": "measured"}
        origin = {name: said.get(origins.get(name), "?") for name in rates}
        print(f"[stats] scheduler's cost model: read {rates['read'] / 1e9:.2f} GB/s ({origin['read']}), decode "
              f"{rates['decode'] / 1e9:.2f} GB/s per thread ({origin['decode']}), compute {rates['compute'] / 1e9:.2f} "
              f"GB/s ({origin['compute']}), first writes of new memory {rates['touch'] / 1e9:.2f} GB/s per thread "
              f"({origin['touch']})", file=sys.stderr)
    sets = now.get("sets") or []
    for s in sets if len(sets) > 1 else []:
        where = "host memory" if s["device"] == "CPU" else f"{s['device']} memory"
        print(f"[stats] slot set in {where}: MoE layers {_layer_ranges(s['layers'])}, {s['n_slots']} slots in use "
              f"of {s['slot_capacity']}; {_memory_text(s['memory'], s['device'] != 'CPU')}", file=sys.stderr)
    # the host set's plan (its pools, or a device set's stores, are host memory's)
    plan = next((s["memory"] for s in sets if s["device"] == "CPU"), None if len(sets) > 1 else now.get("memory"))
    if plan:
        print(f"[stats] memory: {plan['n_slots']} slots x {size_text(plan['expert_bytes'])}; "
              f"{_memory_text(plan, False)}", file=sys.stderr)
        pools = ", ".join(f"{name} {count}" for name, count in plan["pools"].items())
        pools = pools if any(plan["pools"].values()) else "one F pool"
        why = plan["pools_why"]  # its reason may name the pools itself ("one F pool: ...")
        print(f"[stats] pools per MoE layer: {why if why.startswith(pools) else f'{pools}; {why}'}", file=sys.stderr)
    return now


class ContextFull(Exception):
    """The conversation (or the one prompt) does not fit the context window."""


def context_in_effect(llm, ctx_size: int) -> str:
    """"the context of N tokens (-c ...)": the tokens a conversation may take, and why."""
    n_ctx = llm.n_ctx()
    if n_ctx > ctx_size:
        return (f"the context of {n_ctx} tokens (-c {ctx_size} was raised to {n_ctx} by llama.cpp, which rounds the "
                "context size up to a multiple of 256)")
    if n_ctx < ctx_size:
        return f"the context of {n_ctx} tokens (-c {ctx_size} was lowered to {n_ctx} by llama.cpp)"
    return f"the context of {ctx_size} tokens (-c {ctx_size})"


def _gpu_offload() -> bool:
    """Whether a GPU, or an rpc-server added with --rpc, can take the layers -ngl offloads."""
    from .devices import has_offload_device

    return has_offload_device()


def _stream_reply(llm, messages: list[dict], args) -> str:
    parts = []
    before = llm.zipmoe_stats() if args.stats else None
    first_token = None
    n_tokens = 0
    try:
        for chunk in llm.create_chat_completion(messages=messages, stream=True, temperature=args.temp,
                                                max_tokens=args.n_predict if args.n_predict > 0 else None):
            delta = chunk["choices"][0]["delta"]
            n_tokens += "content" in delta  # the first chunk carries the role, the last the finish reason
            if n_tokens == 1 and first_token is None and args.stats:
                first_token = llm.zipmoe_stats()  # the prompt's pass is done
            text = delta.get("content") or ""
            if text:
                parts.append(text)
                sys.stdout.write(text)
                sys.stdout.flush()
    except ValueError as e:
        # llama-cpp-python's words for a prompt longer than the context ("Requested tokens (319)
        # exceed context window of 256") or a context that fills up ("could not broadcast ...")
        if "context window" not in str(e) and "broadcast" not in str(e):
            raise
        if parts:
            sys.stdout.write("\n")
        what = "the reply filled" if parts else "the conversation does not fit"
        needs = re.search(r"Requested tokens \((\d+)\)", str(e))
        raise ContextFull(f"{what} {context_in_effect(llm, args.ctx_size)}"
                          + (f": it takes {needs.group(1)} tokens" if needs else "")) from None
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        _print_stats(llm, before, n_tokens, first_token)
    return "".join(parts)


def _warning_text(warning: Warning) -> str:
    """A warning of the load in zipmoe-chat's words: options by their flags (--budget), not Python's."""
    from .errors import OptionsIgnoredWarning
    from .options import find

    if isinstance(warning, OptionsIgnoredWarning):
        return warning.worded([chat_flag(find(kwarg)) for kwarg in warning.kwargs])
    return str(warning)


def _load(args, model: Path, options: dict):
    """The model as zipmoe-chat loads it, the load's warnings said in its own words ("always": a ZipMoE
    warning is never lost to an earlier one with the same text)."""
    from .bindings import Llama

    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always", ZipMoEWarning)
        llm = Llama(model_path=str(model), n_ctx=args.ctx_size, n_threads=args.threads, seed=args.seed,
                    n_gpu_layers=args.n_gpu_layers, verbose=args.verbose, **options)
    for w in raised:
        print(f"zipmoe-chat: warning: {_warning_text(w.message)}", file=sys.stderr)
    return llm


def chat(args) -> int:
    model = args.model if args.model is not None else demo_model_path()
    options = {o.kwarg: getattr(args, o.kwarg) for o in python_options()}
    if args.model is None:
        print(f"zipmoe-chat: demo model {model}: a tiny MoE that knows a few answers by heart (ask it what a "
              "mixture of experts is, or what an option does); give a model's GGUF for a real one", file=sys.stderr)
        if options["zipmoe_budget"] is None:
            options["zipmoe_budget"] = max(1, experts_bytes(model) // 4)
            print(f"zipmoe-chat: expert-cache budget {options['zipmoe_budget'] / 1024:.0f} KiB (a quarter of the "
                  "demo's experts)", file=sys.stderr)
    if args.batch_size is not None:
        options["n_batch"] = args.batch_size
    for name in PLACEMENT_KWARGS:
        if getattr(args, name):
            options[name] = getattr(args, name)
    if args.rpc:
        from .devices import add_rpc_servers

        add_rpc_servers(args.rpc, option="--rpc")
        options["rpc_servers"] = args.rpc
    if args.n_gpu_layers and not _gpu_offload():
        print(f"zipmoe-chat: warning: -ngl {args.n_gpu_layers} does nothing: this build has no GPU backend "
              "(bash tools/setup.sh --cuda builds one) and no --rpc server was given; every layer runs on the CPU",
              file=sys.stderr)
    llm = _load(args, model, options)
    system = [{"role": "system", "content": args.system}] if args.system else []

    if args.prompt is not None:
        _stream_reply(llm, system + [{"role": "user", "content": args.prompt}], args)
        return 0

    interactive = sys.stdin.isatty()
    if interactive:
        print(f"zipmoe-chat: {Path(model).name} loaded; {HELP_TEXT}", file=sys.stderr)
    history = list(system)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        text = line.strip()
        if not text:
            continue
        if text.startswith("//"):  # a message that starts with /
            line = text[1:]
        elif text.startswith("/"):  # a command: never sent to the model
            command = text.split()[0]
            if command in ("/exit", "/quit"):
                break
            if command == "/clear":
                history = list(system)
            elif command == "/help":
                print(HELP_TEXT, file=sys.stderr)
            else:
                print(f"zipmoe-chat: unknown command {command}; /help lists them", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = _stream_reply(llm, history, args)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            history.pop()
            continue
        except ZipMoEError as e:  # an expert could not be read: this turn is lost, the chat goes on
            print(f"\nzipmoe-chat: error: {e}", file=sys.stderr)
            history.pop()
            continue
        except ContextFull as e:  # this turn is dropped; /clear or a larger -c makes room
            print(f"zipmoe-chat: error: {e}; this turn is dropped: /clear starts over, or restart with a larger -c",
                  file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
    return 0


def add_option_flag(ap: argparse.ArgumentParser, option) -> None:
    """option's flag (options.chat_flag), its type, checks and help from the option table."""
    from .options import chat_flag, parse_text

    flag = chat_flag(option)
    help_text = f"ZipMoE GGUFs: {option.help} (default: {option.default_text}"
    help_text += f"; ${option.env})" if option.env else ")"
    if option.type == _lib.TYPE_BOOL:
        ap.add_argument(flag, dest=option.kwarg, action=argparse.BooleanOptionalAction, default=None,
                        help=help_text.replace("%", "%%"))
        return

    def checked(text: str):
        if option.type in (_lib.TYPE_POOLS, _lib.TYPE_PATH):
            return text  # read by zipmoe_overrides / Llama, which name the flag in their errors
        try:
            return parse_text(option, text, flag)
        except ZipMoEError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag} ")) from None

    checked.__name__ = option.name
    metavar = {_lib.TYPE_SIZE: "SIZE", _lib.TYPE_INT: "N", _lib.TYPE_REAL: "X", _lib.TYPE_POOLS: "F=N,C=N,S=N,E=N",
               _lib.TYPE_PATH: "FILE", _lib.TYPE_DEVICE_SIZES: "DEVICE=SIZE,..."}.get(option.type)
    ap.add_argument(flag, dest=option.kwarg, type=checked, default=None, metavar=metavar,
                    choices=option.choices or None, help=help_text.replace("%", "%%"))


def batch_size(text: str) -> int:
    """-b's value: a whole number of tokens > 0."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number of tokens > 0 (the batch size, as llama.cpp's -b; "
                                         f"the expert-cache budget is --budget); got {text!r}")
    return value


def values_may_start_with_dash(ap: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with each flag that takes a value and the value after it joined as FLAG=VALUE where the value
    starts with - (--budget -5G, -p "-x"): llama.cpp takes the next argument as the value, argparse takes
    it for a flag ("expected one argument"), and reads FLAG=VALUE as a value. A next argument that is
    itself a flag stays one (--budget --stats: "expected one argument")."""
    flags = {s: a for a in ap._actions for s in a.option_strings}

    def flag(text: str):
        """The flag text names (itself, an unambiguous --prefix of it, or FLAG=VALUE), or None."""
        name = text.split("=", 1)[0]
        if name in flags:
            return name
        if name.startswith("--") and ap.allow_abbrev:
            found = [s for s in flags if s.startswith(name)]
            return found[0] if len(found) == 1 else None
        return None

    out, i = [], 0
    while i < len(argv):
        text = argv[i]
        if text == "--":
            out += argv[i:]
            break
        name = flag(text) if "=" not in text else None
        if (name is not None and flags[name].nargs is None and i + 1 < len(argv)
                and argv[i + 1].startswith("-") and argv[i + 1] not in ("-", "--") and flag(argv[i + 1]) is None):
            out.append(f"{name}={argv[i + 1]}")
            i += 2
            continue
        out.append(text)
        i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="zipmoe-chat",
        description="Chat with a GGUF Mixture-of-Experts model on the ZipMoE build of llama.cpp. "
                    "Turns are formatted with the model's own chat template and replies stream as "
                    "they are generated. " + HELP_TEXT + ".")
    # the short flags mean what they mean to llama.cpp's llama-cli / llama-completion (-b is the batch
    # size there: the expert-cache budget is --budget only)
    ap.add_argument("model", nargs="?", type=Path, default=None,
                    help="GGUF model file; if omitted, a tiny random Qwen2-MoE demo model is made and used")
    ap.add_argument("-m", "--model", dest="model_file", type=Path, default=None, metavar="FILE",
                    help="the GGUF model file, as llama.cpp's -m (or give it as the argument above)")
    ap.add_argument("-p", "--prompt", default=None, help="answer this one prompt and exit (no interactive chat)")
    ap.add_argument("-n", "--n-predict", type=int, default=256,
                    help="most tokens per reply; <= 0 means until the model stops or the context is full "
                         "(default: %(default)s)")
    ap.add_argument("--temp", type=float, default=0.8, help="sampling temperature; 0 = greedy (default: %(default)s)")
    ap.add_argument("-s", "--seed", type=int, default=0xFFFFFFFF,
                    help="sampling seed; 4294967295 = random (default: %(default)s)")
    ap.add_argument("-t", "--threads", type=int, default=None,
                    help="CPU threads for generation (default: llama.cpp's choice, the physical cores)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default: %(default)s)")
    ap.add_argument("-b", "--batch-size", type=batch_size, default=None, metavar="N",
                    help="tokens of a prompt evaluated per llama_decode call, as llama.cpp's -b (default: 512, "
                         "at most -c); the expert-cache budget is --budget")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, metavar="N",
                    help="layers to offload to the GPU in a build with CUDA (bash tools/setup.sh --cuda); each device "
                         "holds the expert slots of the MoE layers whose experts it computes, and --budget is the "
                         "slots of every device (docs/CUDA.md); with --rpc, the layers go to the rpc-server hosts "
                         "(docs/DISTRIBUTED.md). Default: %(default)s, everything on the CPU")
    ap.add_argument("--n-cpu-moe", "-ncmoe", dest="n_cpu_moe", type=int, default=None, metavar="N",
                    help="keep the routed experts of the first N layers in host memory, computed by the CPU, as "
                         "llama.cpp's --n-cpu-moe (their slots too)")
    ap.add_argument("--cpu-moe", "-cmoe", dest="cpu_moe", action="store_true",
                    help="keep every layer's routed experts in host memory, as llama.cpp's --cpu-moe")
    ap.add_argument("-ot", "--override-tensor", dest="override_tensor", default=None, metavar="PATTERN=BUFFER_TYPE,...",
                    help="place the tensors matching PATTERN in BUFFER_TYPE (CPU, CUDA0, ...), as llama.cpp's -ot")
    ap.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                    help="rpc-server hosts whose devices take the offloaded layers (-ngl), as llama.cpp's --rpc; "
                         "this process still reads and decodes every expert, each server holding its layers' "
                         "slots (docs/DISTRIBUTED.md)")
    ap.add_argument("-sys", "--system-prompt", "--system", dest="system", default=None,
                    help="system message that starts the conversation")
    for option in python_options():
        add_option_flag(ap, option)
    ap.add_argument("--stats", action="store_true",
                    help="after each reply, print expert-cache statistics (hits, misses, bytes read, I/O, "
                         "decode and recover time), for the reply, per token and in total")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's load and timing log")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(values_may_start_with_dash(ap, sys.argv[1:] if argv is None else [str(a) for a in argv]))
    if args.model_file is not None:
        if args.model is not None:
            ap.error(f"give the model once: -m {args.model_file} or {args.model}, not both")
        args.model = args.model_file
    for name in ("threads", "ctx_size"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    try:  # the rules between options (a plan or pools, SMoE's alpha with smoe, ...), named by their flags
        zipmoe_overrides({o.name: getattr(args, o.kwarg) for o in python_options()}, name_of=chat_flag)
    except ZipMoEError as e:
        ap.error(str(e))
    if args.zipmoe_substitution == "buddy" and args.zipmoe_buddy_profile is None:
        ap.error("--substitution buddy needs --buddy-profile (make one with zipmoe-buddies)")
    if not args.temp >= 0:  # NaN too
        ap.error(f"--temp must be >= 0, got {args.temp}")
    try:
        return chat(args)
    except (ZipMoEError, ContextFull) as e:
        print(f"zipmoe-chat: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
