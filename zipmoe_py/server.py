"""zipmoe-server: llama-cpp-python's OpenAI-compatible server, its models loaded through zipmoe_py.Llama.

    zipmoe-server --model M.zipmoe.gguf [--zipmoe_budget 4G ...] [--host 127.0.0.1] [--port 8000]
    zipmoe-server --config_file server.json     # or CONFIG_FILE=server.yaml zipmoe-server

Every route of `python -m llama_cpp.server` (/v1/chat/completions, /v1/completions with SSE
streaming, /v1/models, /v1/embeddings, /extras/tokenize, ...), and GET /zipmoe/stats: the expert
cache's statistics and memory sizing of the model in use. Every zipmoe_* option of zipmoe_py.Llama is
a flag (--zipmoe_budget 4G) and a field of a model in a config file; an option not given falls back
to its ZIPMOE_* environment variable, then to its default.

How it hooks in. llama-cpp-python 0.3.36's server makes models with `llama_cpp.Llama` named in its
loader and `LlamaProxy` named in create_app, and its settings forbid unknown fields. Here:
ZipMoEModelSettings adds the zipmoe_* fields; ZipMoELlamaProxy loads each model by running the
stock loader (chat formats, caches, draft models, kv overrides: all as upstream) with its module's
view of `llama_cpp` showing zipmoe_py.Llama as `Llama`, for the length of that one load; create_app
runs the stock create_app with ZipMoELlamaProxy in place of LlamaProxy, so no stock model is loaded
first. Both swaps touch only the server modules' own names, under one lock, and are undone after.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import threading
from pathlib import Path
from typing import List, Optional, Union

from . import bindings  # first: points llama_cpp at the fork's libllama

try:
    import uvicorn
    from fastapi import APIRouter, Depends
    from llama_cpp.server import app as server_app
    from llama_cpp.server import model as server_model
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings
    from llama_cpp.server.types import (CreateChatCompletionRequest, CreateCompletionRequest,
                                        CreateEmbeddingRequest, DetokenizeInputRequest, TokenizeInputRequest)
    from pydantic import Field, ValidationError, create_model
    from starlette.responses import JSONResponse
except ImportError as e:  # the server's dependencies are an extra
    raise ImportError(f"zipmoe-server needs the server extra: pip install \".[server]\" ({e})") from e

from . import _lib, options
from .errors import ZipMoEError
from .placement import PLACEMENT_KWARGS

def _option_field(option):
    """A settings field for one option of the option table: its type, help and default in words."""
    kind = {_lib.TYPE_BOOL: bool, _lib.TYPE_INT: int, _lib.TYPE_REAL: float,
            _lib.TYPE_SIZE: Union[int, str]}.get(option.type, str)
    text = f"{option.help} (default: {option.default_text}"
    text += f"; ${option.env})." if option.env else ")."
    return Optional[kind], Field(default=None, description=text)


class _ZipMoEFields(ModelSettings):
    """llama-cpp-python's model settings, with mlock off by default."""

    # llama-cpp-python's server locks the model by default; a lock of a ZipMoE file would read and pin
    # the expert chunks the budget keeps on disk (the fork's loader then ignores it, with a warning)
    use_mlock: bool = Field(default=False, description="Use mlock (default false; never applied to a ZipMoE model).")
    # llama.cpp's placement flags that llama-cpp-python lacks (zipmoe_py.Llama's keyword arguments)
    override_tensor: Optional[str] = Field(default=None, description="PATTERN=BUFFER_TYPE,...: tensors placed as "
                                           "llama.cpp's -ot places them")
    n_cpu_moe: Optional[int] = Field(default=None, description="the routed experts of the first N layers in host "
                                     "memory, computed by the CPU (llama.cpp's --n-cpu-moe)")
    cpu_moe: bool = Field(default=False, description="every layer's routed experts in host memory (llama.cpp's --cpu-moe)")
    rpc_servers: Optional[str] = Field(default=None, description="HOST:PORT,...: rpc-server hosts whose devices take "
                                       "the offloaded layers (n_gpu_layers), as llama.cpp's --rpc")


# llama-cpp-python's model settings plus zipmoe_py.Llama's options, zipmoe_NAME for each option of the
# table (None: its environment variable, then its default)
ZipMoEModelSettings = create_model(
    "ZipMoEModelSettings", __base__=_ZipMoEFields,
    **{o.kwarg: _option_field(o) for o in options.python_options()})


def zipmoe_kwargs(settings) -> dict:
    """The zipmoe_* keyword arguments a model's settings give, and the placement's, for zipmoe_py.Llama."""
    names = [o.kwarg for o in options.python_options()] + [*PLACEMENT_KWARGS, "rpc_servers"]
    out = {name: getattr(settings, name) for name in names if getattr(settings, name, None) is not None}
    if not out.get("cpu_moe", True):  # the setting's default, False, places nothing
        del out["cpu_moe"]
    return out


class ZipMoEServerSettings(ServerSettings):
    """llama-cpp-python's server settings, with requests queued rather than interrupting each other."""

    # llama-cpp-python's default (True) stops a running stream when another request arrives, and the
    # stopped client gets no finish_reason and no [DONE]; here a request waits for the one before it
    interrupt_requests: bool = Field(default=False, description="Whether a new request interrupts a running "
                                     "one (default false: requests wait their turn).")


class ZipMoESettings(ZipMoEServerSettings, ZipMoEModelSettings):
    """Command-line settings: the server's and one model's."""


class ZipMoEConfigFileSettings(ZipMoEServerSettings):
    """A config file (JSON or YAML): the server's settings and its models, each with zipmoe_* fields."""

    models: List[ZipMoEModelSettings] = Field(default=[], description="Model configs")


class _LlamaCppView:
    """The llama_cpp package as the stock loader sees it during one load: Llama is zipmoe_py.Llama
    with that model's zipmoe_* options bound; every other name is llama_cpp's."""

    def __init__(self, real, llama_factory):
        self._real = real
        self.Llama = llama_factory

    def __getattr__(self, name):
        return getattr(self._real, name)


_SWAP_LOCK = threading.RLock()


@contextlib.contextmanager
def _module_name(module, name: str, value):
    """module.name is value inside the block (under one lock: loads and app creation do not overlap)."""
    with _SWAP_LOCK:
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            yield
        finally:
            setattr(module, name, saved)


class ZipMoELlamaProxy(server_model.LlamaProxy):
    """llama-cpp-python's model switcher, every model made by zipmoe_py.Llama."""

    @staticmethod
    def load_llama_from_model_settings(settings: ModelSettings) -> bindings.Llama:
        if settings.hf_model_repo_id is not None:
            raise ZipMoEError(f"model {settings.model}: hf_model_repo_id is not supported by zipmoe-server; "
                              "download and convert the checkpoint with zipmoe-convert, then give --model")
        factory = functools.partial(bindings.Llama, **zipmoe_kwargs(settings))
        with _module_name(server_model, "llama_cpp", _LlamaCppView(server_model.llama_cpp, factory)):
            return server_model.LlamaProxy.load_llama_from_model_settings(settings)


router = APIRouter()


@router.get("/zipmoe/stats", dependencies=[Depends(server_app.authenticate)], tags=["ZipMoE"])
async def zipmoe_stats(llama_proxy: server_model.LlamaProxy = Depends(server_app.get_llama_proxy)) -> dict:
    """The model in use: its expert cache's cumulative statistics and memory sizing (null for a model
    that is not a ZipMoE GGUF). Never loads a model: with several, asking for one would load it."""
    llama = llama_proxy._current_model
    stats = llama.zipmoe_stats() if llama is not None else None
    return {"model": llama_proxy._current_model_alias if llama is not None else None, "zipmoe": stats}


# the request body of each POST route of the stock server
REQUEST_MODELS = {
    "/v1/completions": CreateCompletionRequest,
    "/v1/engines/copilot-codex/completions": CreateCompletionRequest,
    "/v1/embeddings": CreateEmbeddingRequest,
    "/v1/chat/completions": CreateChatCompletionRequest,
    "/extras/tokenize": TokenizeInputRequest,
    "/extras/tokenize/count": TokenizeInputRequest,
    "/extras/detokenize": DetokenizeInputRequest,
}
_EMBEDDING_MODELS: set = set()  # aliases (or paths) of the models started with embedding=True


def _invalid_request(message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-style 400: the client's request is at fault, not the server."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=400)


def _semantic_problem(path: str, request: dict) -> tuple[str, str] | None:
    """(message, field) for what the request models let through but generation cannot take (the
    stock server then fails with a 500): a chat without messages, a user or system message without
    text, a negative temperature."""
    prompt = request.get("prompt")
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        if prompt == "" or prompt == []:
            return "prompt: a completion needs a prompt that is not empty", "prompt"
        if isinstance(prompt, list) and len(prompt) > 1:
            return ("prompt: one prompt per request here (llama-server takes several, each in its own "
                    "slot)"), "prompt"
    if path.endswith("/embeddings") and not _EMBEDDING_MODELS:
        return "embeddings: no model of this server was started with --embedding true", "input"
    temperature = request.get("temperature")
    if isinstance(temperature, (int, float)) and not temperature >= 0:
        return f"temperature must be >= 0, got {temperature}", "temperature"
    if path.endswith("/chat/completions"):
        messages = request.get("messages")
        if not messages:
            return "messages: a chat completion needs at least one message", "messages"
        for i, message in enumerate(messages):
            if isinstance(message, dict) and message.get("role") in ("system", "user") and message.get("content") is None:
                return f"messages.{i}.content: a {message['role']} message needs content", f"messages.{i}.content"
    return None


class RequestValidation:
    """ASGI middleware: a POST body that is not JSON, or not the route's request model, gets a 400
    naming the field at fault. (The stock routes' error handler turns both into 500 internal errors,
    and a body that is not JSON into an unhandled exception.)"""

    def __init__(self, app, root_path: str = ""):
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if self.root_path and path.startswith(self.root_path):
            path = path[len(self.root_path):]
        model = REQUEST_MODELS.get(path) if scope["type"] == "http" and scope.get("method") == "POST" else None
        if model is None:
            return await self.app(scope, receive, send)
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        response = None
        try:
            request = json.loads(body)
            model.model_validate(request)
            problem = _semantic_problem(path, request)
            if problem is not None:
                response = _invalid_request(*problem)
        except json.JSONDecodeError as e:
            response = _invalid_request(f"the request body is not JSON: {e}")
        except ValidationError as e:
            first = e.errors()[0]
            field = ".".join(str(x) for x in first.get("loc", ()))
            response = _invalid_request(f"{field or 'body'}: {first.get('msg', 'invalid')}", field or None)
        if response is not None:
            return await response(scope, receive, send)

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def create_app(server_settings: ServerSettings, model_settings: List[ModelSettings]):
    """llama-cpp-python's FastAPI app with ZipMoELlamaProxy, plus GET /zipmoe/stats and 400s for
    malformed requests. The default model is loaded here."""
    _EMBEDDING_MODELS.clear()
    _EMBEDDING_MODELS.update(m.model_alias or m.model for m in model_settings if m.embedding)
    with _module_name(server_app, "LlamaProxy", ZipMoELlamaProxy), _without_env("CONFIG_FILE"):
        app = server_app.create_app(server_settings=server_settings, model_settings=model_settings)
    app.include_router(router)
    app.add_middleware(RequestValidation, root_path=server_settings.root_path)
    return app


@contextlib.contextmanager
def _without_env(name: str):
    """The stock create_app reads CONFIG_FILE itself, with settings that refuse zipmoe_* fields: our
    CLI has read it already."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def load_settings(args: argparse.Namespace) -> tuple[ServerSettings, List[ZipMoEModelSettings]]:
    """The server's and the models' settings: from --config_file (or CONFIG_FILE) if given, else the flags."""
    config_file = os.environ.get("CONFIG_FILE", args.config_file)
    if not config_file:
        return parse_model_from_args(ZipMoEServerSettings, args), [parse_model_from_args(ZipMoEModelSettings, args)]
    path = Path(config_file)
    try:
        text = path.read_bytes()
    except OSError as e:
        raise ZipMoEError(f"config file {path}: {e.strerror}") from e
    if path.suffix in (".yaml", ".yml"):
        import yaml

        text = json.dumps(yaml.safe_load(text))
    try:
        config = ZipMoEConfigFileSettings.model_validate_json(text)
    except ValueError as e:
        raise ZipMoEError(f"config file {path}: {e}") from e
    if not config.models:
        raise ZipMoEError(f"config file {path}: no models (give a list 'models' with at least one 'model' path)")
    return ZipMoEServerSettings.model_validate(config.model_dump(exclude={"models"})), config.models


def _checked_flag(option):
    """A zipmoe flag's argparse type: the text parsed by the option table's C parser (a boolean takes its
    words, as ZIPMOE_* variables do), the error saying what it must be (llama-cpp-python's own boolean
    flags say "invalid _parse_bool_arg value")."""
    def checked(text: str):
        if option.type in (_lib.TYPE_POOLS, _lib.TYPE_PATH):
            return text  # checked when the model loads (a pool list's items, a file)
        try:
            value = options.parse_text(option, text)
        except ZipMoEError:
            raise argparse.ArgumentTypeError(f"must be {option.expects}; got {text!r}") from None
        if option.type in (_lib.TYPE_BOOL, _lib.TYPE_INT, _lib.TYPE_REAL):
            return value  # True/False, a whole number, a number: as the settings field holds it
        return text  # a size or a name as given: Llama parses it again

    checked.__name__ = option.kwarg
    return checked


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zipmoe-server", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="llama-cpp-python's OpenAI-compatible server on the ZipMoE fork: routed experts served on "
                    "demand from a ZipMoE GGUF under a memory budget, bit-exact. GET /zipmoe/stats gives the "
                    "expert cache's statistics.",
        epilog="Every flag is also a field of a model (zipmoe_*, model, n_ctx, ...) or of the server (host, port, "
               "api_key, ...) in a JSON/YAML --config_file, which then replaces the flags. zipmoe_* options not "
               "given fall back to their ZIPMOE_* environment variables.")
    add_args_from_model(parser, ZipMoESettings)
    for action in parser._actions:
        if action.dest.startswith("zipmoe_"):
            action.type = _checked_flag(options.find(action.dest))
    parser.add_argument("--config_file", type=str, help="Path to a config file (JSON or YAML) to load.")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        server_settings, model_settings = load_settings(args)
    except (ZipMoEError, ValueError) as e:
        print(f"zipmoe-server: {e}", file=sys.stderr)
        return 2
    try:
        app = create_app(server_settings, model_settings)
    except (ZipMoEError, ValueError, RuntimeError) as e:
        print(f"zipmoe-server: cannot load {model_settings[0].model}: {e}", file=sys.stderr)
        return 1
    uvicorn.run(app, host=os.getenv("HOST", server_settings.host), port=int(os.getenv("PORT", server_settings.port)),
                ssl_keyfile=server_settings.ssl_keyfile, ssl_certfile=server_settings.ssl_certfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
