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
import re
import sys
import threading
import warnings
from pathlib import Path

from . import _lib, _paths
from .errors import OptionsIgnoredWarning, ZipMoEError, ZipMoELoadError, ZipMoEWarning
from .gguf_file import GGUF_MAGIC
from .options import find, zipmoe_overrides
from .placement import PLACEMENT_KWARGS


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


def _use_ggml_log_level_numbers() -> None:
    """llama-cpp-python 0.3.36 maps ggml's log levels by an older numbering (its WARN as ERROR, its
    ERROR as DEBUG), so that with verbose=False llama.cpp's warnings were printed ("decode: removing
    memory module entries ...") and its errors hidden. ggml.h's numbering: NONE 0, DEBUG 1, INFO 2,
    WARN 3, ERROR 4, CONT 5. verbose=False then prints errors only, as llama-cpp-python means it to."""
    import logging

    from llama_cpp import _logger

    _logger.GGML_LOG_LEVEL_TO_LOGGING_LEVEL.update(
        {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR, 5: logging.DEBUG})


_use_ggml_log_level_numbers()


def _zipmoe_kwargs(kwargs: dict, pop: bool = False) -> dict:
    """The zipmoe_* keyword arguments given, as {name: value} of the option table; a zipmoe_ name the
    table does not have is a typo, not an option to ignore."""
    from .options import python_options

    known = {o.kwarg: o.name for o in python_options()}
    unknown = sorted(k for k in kwargs if k.startswith("zipmoe_") and k not in known)
    if unknown:
        raise ZipMoEError(f"unknown option(s) {', '.join(unknown)}; ZipMoE's options are {', '.join(sorted(known))}")
    get = kwargs.pop if pop else kwargs.get
    return {known[k]: get(k) for k in list(kwargs) if k in known}


class _Checked:
    """What Llama's arguments said once checked (_check_arguments): the zipmoe_* options given
    ({name: value}), the KV overrides they make, the buddy profile read, the rpc-server hosts, the
    tensor placement (override_tensor, n_cpu_moe, cpu_moe: (pattern, buffer type) pairs)."""

    def __init__(self, given: dict, overrides: dict, profile, rpc_servers, placement):
        self.given, self.overrides, self.profile, self.rpc_servers = given, overrides, profile, rpc_servers
        self.placement = placement


def _check_arguments(model_path, kwargs: dict) -> _Checked:
    """Llama's arguments checked, once per Llama: the zipmoe_* options (parsed, and held together), the
    model file, the rpc-server hosts (added as devices), the buddy profile (read, and held to the model)
    and a plan (made for this model). The budget against the model's experts is the loader's check
    (serving/zipmoe-serving.c), which every front end reaches; Llama names the option as it was given
    (_as_given)."""
    given = _zipmoe_kwargs(kwargs)
    check_model_file(model_path)
    rpc_servers = kwargs.get("rpc_servers")
    if rpc_servers:
        from .devices import add_rpc_servers

        add_rpc_servers(rpc_servers)
    from .placement import tensor_overrides

    placement = tensor_overrides(*(kwargs.get(name) for name in PLACEMENT_KWARGS))
    overrides = zipmoe_overrides(given)
    profile = given.get("buddy_profile")
    substitution, source = _effective_substitution(kwargs)
    if substitution == "buddy" and profile is None:
        raise ZipMoEError(f"{source} = 'buddy' needs zipmoe_buddy_profile, a buddy profile of this model "
                          "(make one with zipmoe-buddies)")
    if profile is not None:
        from .buddy_profile import load_profile

        profile = load_profile(Path(profile), Path(model_path))
    if given.get("plan") is not None:
        _check_plan_matches(Path(given["plan"]), Path(model_path))
    return _Checked(given, overrides, profile, rpc_servers, placement)


# llama.cpp's -ot, --n-cpu-moe and --cpu-moe, as Llama's keyword arguments (zipmoe_py/placement.py)


def _as_given(reason: str, given: dict) -> str:
    """The loader's reason with the options the caller gave as keyword arguments named so (zipmoe_budget,
    not the KV override zipmoe.budget they travel as)."""
    for name, value in given.items():
        option = find(name)
        if value is not None and option.key:
            reason = re.sub(rf"(?<![\w.-]){re.escape(option.key)}(?![\w.])", option.kwarg, reason)
    return reason


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
    exceptions there ("Failed to load model from file") do not carry them; the loader's lines name
    the option, file or tensor at fault. One load at a
    time: the log callback is the process's."""

    _WARN, _ERROR, _CONT = 3, 4, 5  # ggml.h ggml_log_level (llama_cpp._logger maps an older numbering)

    def __enter__(self):
        from llama_cpp import _logger

        _load_lock.acquire()
        self.lines: list[str] = []
        self.warning_lines: list[str] = []
        self._forward = _logger.llama_log_callback
        in_error = [False]

        @llama_cpp.llama_log_callback
        def capture(level, text, user_data):
            in_error[0] = level == self._ERROR or (level == self._CONT and in_error[0])
            if in_error[0]:
                self.lines.append(text.decode("utf-8", "replace"))
            elif level == self._WARN and b"zipmoe" in text.lower():
                self.warning_lines.append(text.decode("utf-8", "replace"))
            self._forward(level, text, user_data)

        self._capture = capture  # kept alive while llama.cpp holds it
        llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc):
        llama_cpp.llama_log_set(self._forward, ctypes.c_void_p(0))
        _load_lock.release()

    def warnings(self) -> list[str]:
        """ZipMoE's warnings from the load (a budget reduced to fit, a lossy mode), without function-name
        prefixes; not the one for options given to a plain GGUF, which Llama words itself."""
        found = []
        for line in "".join(self.warning_lines).splitlines():
            line = line.strip()
            head, _, rest = line.partition(": ")
            text = rest if rest and head.isidentifier() else line
            if text and "is not a ZipMoE GGUF" not in text:
                found.append(text)
        return list(dict.fromkeys(found))

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
    # __doc__ and __init__'s signature: _document_options, from the option table
    def __new__(cls, model_path: str | None = None, *args, **kwargs):
        if model_path is None:
            return super().__new__(cls)  # unpickling and copy: __setstate__ calls __init__, which checks
        # checked before the object exists (llama_cpp.Llama.__del__ fails on a half-built instance), and
        # handed to __init__, which does not check again
        checked = _check_arguments(model_path, kwargs)
        self = super().__new__(cls)
        self._zipmoe_checked = checked
        return self

    def __init__(self, model_path: str, *args, **kwargs):
        # __new__'s checks; __setstate__ (unpickling, copy) comes here without them
        checked = self.__dict__.pop("_zipmoe_checked", None) or _check_arguments(model_path, kwargs)
        given = checked.given
        _zipmoe_kwargs(kwargs, pop=True)
        # rpc-server hosts as devices for n_gpu_layers (llama.cpp's --rpc; llama-cpp-python 0.3.36 has no such
        # argument): added by the check
        self._zipmoe_rpc_servers = kwargs.pop("rpc_servers", None)
        self._zipmoe_placement = {name: kwargs.pop(name) for name in PLACEMENT_KWARGS if kwargs.get(name) is not None}
        from .placement import override_array

        self._zipmoe_overrides_array = override_array(checked.placement)  # read by model_params' setter
        self._zipmoe_buddy_profile = given.get("buddy_profile")
        profile = checked.profile
        overrides = dict(kwargs.pop("kv_overrides", None) or {})
        overrides.update(checked.overrides)
        if overrides:
            kwargs["kv_overrides"] = overrides
        with _LoaderErrors() as errors:
            try:
                super().__init__(model_path, *args, **kwargs)
            except ValueError as e:
                reason = _as_given(errors.reason(), given)
                if not reason:
                    raise
                what = "load" if "load model" in str(e) else "make a context for"
                raise ZipMoELoadError(f"cannot {what} {model_path}: {reason}") from e
        if profile is not None:
            from .buddy_profile import apply_profile

            apply_profile(self._model.model, profile)
        self._hold_the_whole_context()
        if not self.verbose:  # with verbose, llama.cpp's log has shown them
            for text in errors.warnings():
                warnings.warn(ZipMoEWarning(text), stacklevel=2)
        ignored = tuple(sorted(f"zipmoe_{name}" for name, value in given.items() if value is not None))
        if ignored and not _lib.llama_model_zipmoe_cache(self._model.model):
            # llama.cpp's loader warns too, in its log (silent with verbose=False)
            warnings.warn(OptionsIgnoredWarning(model_path, ignored), stacklevel=2)

    # llama-cpp-python makes model_params in __init__ and loads the model with it: the placement's tensor
    # overrides go in as it is set (the array lives as long as this object)
    @property
    def model_params(self):
        return self.__dict__["model_params"]

    @model_params.setter
    def model_params(self, params) -> None:
        array = getattr(self, "_zipmoe_overrides_array", None)
        if array is not None:
            params.tensor_buft_overrides = ctypes.cast(array, ctypes.c_void_p)
        self.__dict__["model_params"] = params

    def _hold_the_whole_context(self) -> None:
        """llama.cpp rounds the context size up (to a multiple of 256: n_ctx=16 gives 256, self.n_ctx()),
        but llama-cpp-python sizes its arrays of evaluated tokens (and, with logits_all, their scores) by
        the n_ctx asked for: a prompt past it then fails with numpy's "could not broadcast input array
        from shape (5,) into shape (0,)" while replies run on to llama.cpp's size. Sized to the context
        llama.cpp made, n_ctx means what it means to llama.cpp's own programs."""
        import numpy as np

        n_ctx = self.n_ctx()
        if len(self.input_ids) < n_ctx:
            ids = np.zeros(n_ctx, dtype=self.input_ids.dtype)
            ids[:len(self.input_ids)] = self.input_ids
            self.input_ids = ids
            if self._logits_all:
                scores = np.zeros((n_ctx, self.scores.shape[1]), dtype=self.scores.dtype)
                scores[:len(self.scores)] = self.scores
                self.scores = scores

    def __getstate__(self):
        state = super().__getstate__()  # the zipmoe_* options travel in its kv_overrides
        if getattr(self, "_zipmoe_buddy_profile", None) is not None:
            state["zipmoe_buddy_profile"] = self._zipmoe_buddy_profile
        if getattr(self, "_zipmoe_rpc_servers", None):
            state["rpc_servers"] = self._zipmoe_rpc_servers
        state.update(getattr(self, "_zipmoe_placement", {}))
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
        from .slot_sets import model_stats

        stats = model_stats(self._model.model)
        if stats is not None:
            stats["memory"] = _lib.memory_plan(self._model.model)
        return stats

    def zipmoe_reset_stats(self) -> None:
        self._check_open()
        from .slot_sets import reset_stats

        reset_stats(self._model.model)


_LLAMA_DOC = """llama-cpp-python's `Llama`, unchanged in API, running on the ZipMoE fork.

Extra keyword arguments, used when model_path is a ZipMoE GGUF (ignored otherwise). An option not
given is taken from its environment variable, else its default (a kv_overrides entry zipmoe.NAME
comes before both). Bad values raise ZipMoEError naming the option; errors of the loader raise
ZipMoELoadError with its reason. See README.md for memory sizing, pools and the lossy modes.

rpc_servers="host:port,..." adds rpc-server hosts as devices for n_gpu_layers, as llama.cpp's --rpc
(docs/DISTRIBUTED.md); a server that cannot be reached raises ZipMoEError.

override_tensor="PATTERN=BUFFER_TYPE,...", n_cpu_moe=N and cpu_moe=True place tensors as llama.cpp's -ot,
--n-cpu-moe and --cpu-moe do (routed experts of the first N layers, or of all, in host memory); a ZipMoE
model's expert slots follow, each layer's on the device stock llama.cpp gives its experts.

{options}
"""


def _document_options(cls) -> None:
    """cls's docstring and __init__'s signature list the option table's zipmoe_* keyword arguments."""
    import inspect

    from .options import python_docstring, python_options

    cls.__doc__ = _LLAMA_DOC.format(options=python_docstring())
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model_path", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
              inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)]
    params += [inspect.Parameter(o.kwarg, inspect.Parameter.KEYWORD_ONLY, default=None,
                                 annotation=f"{o.python_type} | None") for o in python_options()]
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    cls.__init__.__signature__ = inspect.Signature(params)


_document_options(Llama)
