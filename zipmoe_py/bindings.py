"""llama-cpp-python 0.3.36, bound to ZipMoE's libllama instead of a copy of its own.

llama-cpp-python loads its library once, at `import llama_cpp`, from
$LLAMA_CPP_LIB_PATH when set. Importing this module points it at our build; if
llama_cpp was imported earlier with another library, that cannot be undone in the
process, so we refuse with an error that says how to fix it. The zipmoe_* keyword arguments of
`Llama` are parsed in zipmoe_py/options.py.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

from . import _lib, _paths
from .errors import ZipMoEError, ZipMoELoadError
from .gguf_file import GGUF_MAGIC
from .options import check_budget, zipmoe_overrides


def _loaded_library_path(module) -> Path | None:
    lib = getattr(module, "_lib", None)
    name = getattr(lib, "_name", None)
    return Path(name).resolve() if name else None


def _import_llama_cpp():
    ours = _paths.shared_library("llama").resolve()
    already = sys.modules.get("llama_cpp.llama_cpp")
    if already is not None:
        loaded = _loaded_library_path(already)
        if loaded != ours:
            raise ZipMoEError(
                f"llama_cpp was already imported in this process with {loaded or 'an unknown library'}, "
                f"not ZipMoE's {ours}. Import zipmoe_py before llama_cpp, or start Python with "
                f"LLAMA_CPP_LIB_PATH={ours.parent}")
    else:
        env = os.environ.get("LLAMA_CPP_LIB_PATH")
        if env and Path(env).resolve() != ours.parent:
            raise ZipMoEError(
                f"LLAMA_CPP_LIB_PATH={env} points llama_cpp at another llama.cpp build; ZipMoE needs its own "
                f"({ours.parent}). Unset LLAMA_CPP_LIB_PATH or set it to that folder.")
        os.environ["LLAMA_CPP_LIB_PATH"] = str(ours.parent)
    import llama_cpp

    loaded = _loaded_library_path(llama_cpp.llama_cpp)
    if loaded != ours:
        raise ZipMoEError(f"llama_cpp loaded {loaded}, expected ZipMoE's {ours}")
    return llama_cpp


llama_cpp = _import_llama_cpp()


def _buddy_kwargs(kwargs: dict, pop: bool = False) -> dict:
    """The zipmoe_buddy_NAME keyword arguments (BuddyMoE's parameters) as {NAME: value}."""
    from .options import BUDDY_PARAMETERS

    get = kwargs.pop if pop else kwargs.get
    return {name: get(f"zipmoe_buddy_{name}", None) for name in BUDDY_PARAMETERS}


def _check_kwarg_names(kwargs: dict) -> None:
    """Any zipmoe_ name that is not one of Llama.__init__'s zipmoe_* parameters or BuddyMoE's
    zipmoe_buddy_NAME is a typo, not an option to ignore."""
    import inspect

    from .options import BUDDY_PARAMETERS

    known = {name for name in inspect.signature(Llama.__init__).parameters if name.startswith("zipmoe_")}
    known |= {f"zipmoe_buddy_{name}" for name in BUDDY_PARAMETERS}
    unknown = sorted(k for k in kwargs if k.startswith("zipmoe_") and k not in known)
    if unknown:
        raise ZipMoEError(f"unknown option(s) {', '.join(unknown)}; ZipMoE's options are {', '.join(sorted(known))}")


def _effective_substitution(kwargs: dict) -> tuple[str | None, str]:
    """The substitution policy a load will use, and where it comes from: the keyword, else the KV
    override, else $ZIPMOE_SUBSTITUTION (the loader's order)."""
    if kwargs.get("zipmoe_substitution") is not None:
        return kwargs["zipmoe_substitution"], "zipmoe_substitution"
    overrides = kwargs.get("kv_overrides") or {}
    if overrides.get("zipmoe.substitution") is not None:
        return str(overrides["zipmoe.substitution"]), "kv_overrides['zipmoe.substitution']"
    env = os.environ.get("ZIPMOE_SUBSTITUTION")
    return (env.strip().lower() if env else None), "ZIPMOE_SUBSTITUTION (environment)"


def _check_plan_matches(plan_path: Path, model_path: Path) -> None:
    """A zipmoe-plan file made for another model (other MoE layer or expert counts) is refused."""
    from . import format as zformat
    from .plan_files import load_plan

    result, _ = load_plan(plan_path)
    try:
        zf = zformat.ZipMoEFile(model_path)
    except ZipMoEError:
        return  # not a ZipMoE GGUF: the plan does not apply
    with zf:
        layers = zf.moe_layers()
        n_expert = max(zf.shape(zf.tensors[t])[2] for tensors in layers.values() for t in tensors)
    if (result.n_layer_moe, result.n_expert) != (len(layers), n_expert):
        raise ZipMoEError(f"{plan_path} was planned for {result.n_layer_moe} MoE layers of {result.n_expert} experts, "
                          f"but {model_path} has {len(layers)} of {n_expert}: make a plan for this model "
                          "(zipmoe-profile, then zipmoe-plan)")


_load_lock = threading.Lock()


class _LoaderErrors:
    """llama.cpp's error lines while a model and its context are made. llama-cpp-python's
    exceptions there ("Failed to load model from file") do not carry them, and verbose=False
    silences them; the loader's lines name the option, file or tensor at fault. One load at a
    time: the log callback is the process's."""

    _ERROR, _CONT = 4, 5  # ggml.h ggml_log_level (llama_cpp._logger maps an older numbering)

    def __enter__(self):
        from llama_cpp import _logger

        _load_lock.acquire()
        self.lines: list[str] = []
        self._forward = _logger.llama_log_callback
        in_error = [False]

        @llama_cpp.llama_log_callback
        def capture(level, text, user_data):
            in_error[0] = level == self._ERROR or (level == self._CONT and in_error[0])
            if in_error[0]:
                self.lines.append(text.decode("utf-8", "replace"))
            self._forward(level, text, user_data)

        self._capture = capture  # kept alive while llama.cpp holds it
        llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc):
        llama_cpp.llama_log_set(self._forward, ctypes.c_void_p(0))
        _load_lock.release()

    def reason(self) -> str:
        """The loader's own words: what follows "error loading model: " or "failed to initialize
        the context: " where a line has it, else every error line, without function-name prefixes."""
        lines = [line.strip() for line in "".join(self.lines).splitlines() if line.strip()]
        markers = ("error loading model: ", "failed to initialize the context: ")
        specific = [line.split(m, 1)[1] for line in lines for m in markers if m in line]
        chosen = specific or [line.split(": ", 1)[1] if line.split(": ", 1)[0].isidentifier() and ": " in line
                              else line for line in lines]
        return "; ".join(dict.fromkeys(chosen))  # once each, in order


def check_model_file(model_path: str | os.PathLike) -> Path:
    """Fail early, naming the file, instead of deep inside llama.cpp's loader."""
    path = Path(model_path)
    if not path.exists():
        raise ZipMoEError(f"model file not found: {path}")
    if path.is_dir():
        raise ZipMoEError(f"model path is a folder, not a GGUF file: {path} "
                          "(a Hugging Face checkpoint must be converted first: zipmoe-convert DIR -o OUT.gguf)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ZipMoEError(f"cannot read model file {path}: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise ZipMoEError(f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    return path


class Llama(llama_cpp.Llama):
    """llama-cpp-python's `Llama`, unchanged in API, running on the ZipMoE fork.

    Extra keyword arguments, used when model_path is a ZipMoE GGUF (ignored otherwise). An option not
    given is taken from its environment variable (ZIPMOE_BUDGET, ZIPMOE_MEM_LIMIT, ZIPMOE_DIRECT_IO,
    ZIPMOE_THREADS, ZIPMOE_EVICTION, ZIPMOE_RANK_DELTA, ZIPMOE_POOL_F/C/S/E, ZIPMOE_WORK_SLOTS), else
    its default:
      zipmoe_budget:    bytes (or "4G", "512M") of expert slots; default: what the process may use
                        (its cgroup limits and MemAvailable) minus the non-expert weights, every
                        context's KV cache and compute buffers, the cache's own buffers and a margin,
                        at most every expert and at least one token's experts of a layer; sized
                        again whenever a context is made or freed. A budget that does not fit is
                        reduced, with a warning giving the numbers
      zipmoe_mem_limit: memory this process may use in all (bytes or "16G"), when it must share the
                        machine below what its cgroup and MemAvailable allow
      zipmoe_preload:   fill the expert slots when the first context is made, as a memory-mapped
                        model's populate does (default True; statistics do not count it)
      zipmoe_direct_io: True: read expert chunks with O_DIRECT (an error where the filesystem cannot);
                        False: through the page cache; default: O_DIRECT where the filesystem supports it
      zipmoe_threads:   how many of the graph's threads (n_threads) decode fetched experts; default
                        all (0). Reads run on the cache's own I/O thread either way.
      zipmoe_eviction:  which resident expert a miss replaces: "rank" (default; ZipMoE's rank
                        dispatch: experts ranked beyond their layer's share of the cache go first,
                        then the least often chosen), "lru", "fifo", "marking" (randomized
                        marking), "lfu" (least often chosen)
      zipmoe_rank_delta: the "rank" dispatch's tolerance margin delta (default 0, or the plan's)
      zipmoe_pools:     the hierarchical pools (ZipMoE §3.2), experts per MoE layer kept full (F),
                        compressed (C: SM + E-chunks), as SM-chunks (S) or as E-chunks (E), e.g.
                        "F=4,C=8,E=2" or {"F": 4, "C": 8}; default: zipmoe_auto_pools
      zipmoe_auto_pools: with no pools given (default True), the pools for the memory left: one F pool
                        when every expert fits full; when every compressed expert fits, all of them in C
                        and as many as room allows in F too (nothing is read after warm-up); otherwise
                        the planner's pools for a uniform profile (ZipMoE Alg. 4), if it expects them to
                        beat one F pool; after 16 one-token decode steps (KV zipmoe.replan_tokens, 0:
                        never) planned once more from the routing seen.
                        zipmoe_stats()["memory"]["pools_why"] says which and why.
                        False: one F pool of the whole budget
      zipmoe_plan:      a zipmoe-plan PLAN file: its pool capacities and delta (instead of zipmoe_pools)
      zipmoe_work_slots: with pools, the slots beyond F's where other experts are made full for a
                        pass (default 8; a ubatch choosing more distinct experts per layer than the
                        free slots runs in several passes)
      zipmoe_prefetch:  read ahead, while a layer computes, the chunks of the experts the next layer's
                        router is predicted to choose (its gate applied to this layer's FFN input);
                        lossless: routing and arithmetic are unchanged (default False: on the
                        random-weight bench models it did not pay for itself)
      zipmoe_substitution: "none" (default, lossless) or "smoe": LOSSY, opt-in. SMoE's expert-cache
                        router replaces some low-score experts the router chose, when they are not
                        resident, with resident experts of nearly the same score, so that fewer are
                        read; outputs then differ from the model's (zipmoe_stats()["substitution"]
                        counts the replacements, labelled lossy)
      zipmoe_smoe_alpha: SMoE's alpha in [0, 1] (default 0.1): a chosen expert scoring below (1 + alpha)
                        beta may be replaced by one scoring in [(1 - alpha) beta, beta), beta being the
                        (k+1)-th score; 0 replaces nothing
      zipmoe_substitution="buddy": LOSSY, opt-in. BuddyMoE: a chosen expert that is not resident is
                        replaced with a resident "buddy" (an expert that often co-activates with it, from
                        zipmoe_buddy_profile, a zipmoe-buddies file made for this model), when the token's
                        routing entropy passes the gate, the batch's share of missing experts is below
                        beta, and the token's budget rho is not spent. Parameters (KV zipmoe.buddy_NAME):
        zipmoe_buddy_tau:  TAE gate, in [0, 1]; default -1: each layer's tau from the profile
        zipmoe_buddy_rho:  replacements per token at most (default 3; 0 replaces nothing)
        zipmoe_buddy_beta: no replacement in a batch whose share of missing experts is >= beta (default 1)
        zipmoe_buddy_search: H, buddies searched per missing expert (default 16)
        zipmoe_buddy_gamma: margin gate: none when the top-1 minus top-2 renormalized score >= gamma
                           (default 1: off)
        zipmoe_buddy_temperature: T of the TAE (default 1; use the profile's)
        zipmoe_buddy_eta:  priority q (1 + eta z) by the token's own scores (default 0: the list's order)
    """

    def __new__(cls, model_path: str | None = None, *args, **kwargs):
        if model_path is None:
            return super().__new__(cls)  # unpickling and copy: __setstate__ calls __init__, which checks
        # checked before the object exists: llama_cpp.Llama.__del__ fails on a half-built instance
        _check_kwarg_names(kwargs)
        check_model_file(model_path)
        options = zipmoe_overrides(kwargs.get("zipmoe_budget"), kwargs.get("zipmoe_direct_io"),
                                   kwargs.get("zipmoe_threads"), kwargs.get("zipmoe_eviction"),
                                   kwargs.get("zipmoe_rank_delta"), kwargs.get("zipmoe_pools"),
                                   kwargs.get("zipmoe_work_slots"), kwargs.get("zipmoe_plan"),
                                   kwargs.get("zipmoe_mem_limit"), kwargs.get("zipmoe_preload"),
                                   kwargs.get("zipmoe_prefetch"), kwargs.get("zipmoe_substitution"),
                                   kwargs.get("zipmoe_smoe_alpha"), _buddy_kwargs(kwargs),
                                   auto_pools=kwargs.get("zipmoe_auto_pools"))
        if kwargs.get("zipmoe_buddy_profile") is not None and kwargs.get("zipmoe_substitution") != "buddy":
            raise ZipMoEError("zipmoe_buddy_profile is BuddyMoE's: give it with zipmoe_substitution='buddy'")
        substitution, source = _effective_substitution(kwargs)
        if substitution == "buddy" and kwargs.get("zipmoe_buddy_profile") is None:
            raise ZipMoEError(f"{source} = 'buddy' needs zipmoe_buddy_profile, a buddy profile of this model "
                              "(make one with zipmoe-buddies)")
        if kwargs.get("zipmoe_buddy_profile") is not None:
            from .buddies import load_profile

            load_profile(Path(kwargs["zipmoe_buddy_profile"]), Path(model_path))
        if "zipmoe.budget" in options:
            check_budget(Path(model_path), options["zipmoe.budget"])
        if kwargs.get("zipmoe_plan") is not None:
            _check_plan_matches(Path(kwargs["zipmoe_plan"]), Path(model_path))
        return super().__new__(cls)

    def __init__(self, model_path: str, *args, zipmoe_budget=None, zipmoe_direct_io: bool | None = None,
                 zipmoe_threads: int | None = None, zipmoe_eviction: str | None = None,
                 zipmoe_rank_delta: int | None = None, zipmoe_pools=None, zipmoe_work_slots: int | None = None,
                 zipmoe_plan=None, zipmoe_mem_limit=None, zipmoe_preload: bool | None = None,
                 zipmoe_prefetch: bool | None = None, zipmoe_substitution: str | None = None,
                 zipmoe_smoe_alpha: float | None = None, zipmoe_buddy_profile=None,
                 zipmoe_auto_pools: bool | None = None, **kwargs):
        _check_kwarg_names(kwargs)  # again: __setstate__ comes here without __new__'s checks
        check_model_file(model_path)
        buddy = _buddy_kwargs(kwargs, pop=True)
        self._zipmoe_buddy_profile = zipmoe_buddy_profile
        profile = None
        if zipmoe_buddy_profile is not None:
            from .buddies import load_profile

            profile = load_profile(Path(zipmoe_buddy_profile), Path(model_path))
        overrides = dict(kwargs.pop("kv_overrides", None) or {})
        overrides.update(zipmoe_overrides(zipmoe_budget, zipmoe_direct_io, zipmoe_threads, zipmoe_eviction,
                                          zipmoe_rank_delta, zipmoe_pools, zipmoe_work_slots, zipmoe_plan,
                                          zipmoe_mem_limit, zipmoe_preload, zipmoe_prefetch, zipmoe_substitution,
                                          zipmoe_smoe_alpha, buddy, auto_pools=zipmoe_auto_pools))
        if overrides:
            kwargs["kv_overrides"] = overrides
        with _LoaderErrors() as errors:
            try:
                super().__init__(model_path, *args, **kwargs)
            except ValueError as e:
                reason = errors.reason()
                if not reason:
                    raise
                what = "load" if "load model" in str(e) else "make a context for"
                raise ZipMoELoadError(f"cannot {what} {model_path}: {reason}") from e
        if profile is not None:
            from .buddies import apply_profile

            apply_profile(_lib.llama_model_zipmoe_cache(self._model.model), profile)

    def __getstate__(self):
        state = super().__getstate__()  # the zipmoe_* options travel in its kv_overrides
        if getattr(self, "_zipmoe_buddy_profile", None) is not None:
            state["zipmoe_buddy_profile"] = self._zipmoe_buddy_profile
        return state

    def _check_open(self) -> None:
        # llama-cpp-python's closed object crashes the process on use (its context is freed)
        if getattr(self, "_ctx", None) is None or self._ctx.ctx is None:
            raise ZipMoEError(f"this Llama ({self.model_path}) was closed; make a new one")

    # llama-cpp-python's entry points that reach the freed model first: completions, chat and
    # embeddings tokenize before anything else
    def tokenize(self, *args, **kwargs):
        self._check_open()
        return super().tokenize(*args, **kwargs)

    def detokenize(self, *args, **kwargs):
        self._check_open()
        return super().detokenize(*args, **kwargs)

    def eval(self, tokens):
        """llama-cpp-python's eval; an expert that cannot be fetched (I/O error, checksum mismatch,
        corrupt chunk) raises ZipMoEError naming layer, tensor, expert and chunk. The model and this
        object stay usable: the failed batch leaves nothing in the KV cache."""
        self._check_open()
        try:
            return super().eval(tokens)
        except RuntimeError as e:
            message = _lib.llama_zipmoe_last_error(self._ctx.ctx) if self._ctx is not None else ""
            if not message:
                raise
            self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
            raise ZipMoEError(message) from e

    def zipmoe_stats(self) -> dict | None:
        """Cumulative expert-cache statistics, or None for a model that is not a ZipMoE GGUF."""
        self._check_open()
        cache = _lib.llama_model_zipmoe_cache(self._model.model)
        if not cache:
            return None
        stats = _lib.cache_stats(cache)
        stats["memory"] = _lib.memory_plan(self._model.model)
        return stats

    def zipmoe_reset_stats(self) -> None:
        self._check_open()
        cache = _lib.llama_model_zipmoe_cache(self._model.model)
        if cache:
            _lib.lib().ggml_zipmoe_cache_reset_stats(cache)
