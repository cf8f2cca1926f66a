"""ggml's devices from Python: rpc-server hosts added as devices (llama.cpp's --rpc), and whether any
device can take offloaded layers.

llama-cpp-python 0.3.36 has no rpc_servers; these call ggml's registry as common/arg.cpp does for --rpc.
An RPC server is registered once per process: registering it again would list its devices twice.
"""
from __future__ import annotations

import ctypes
import socket
import threading

from . import _paths
from .errors import ZipMoEError

_lock = threading.Lock()
_registered: set[str] = set()
_GPU, _IGPU = 1, 2  # enum ggml_backend_dev_type


def _ggml() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_paths.shared_library("ggml")))
    for name, argtypes in (("ggml_backend_reg_by_name", [ctypes.c_char_p]),
                           ("ggml_backend_reg_get_proc_address", [ctypes.c_void_p, ctypes.c_char_p]),
                           ("ggml_backend_dev_by_type", [ctypes.c_int])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_void_p
    lib.ggml_backend_register.argtypes, lib.ggml_backend_register.restype = [ctypes.c_void_p], None
    return lib


def parse_rpc_servers(servers: str, option: str = "rpc_servers") -> list[tuple[str, int]]:
    """"host:port[,host:port...]" as (host, port) pairs; a ZipMoEError naming the option and the entry."""
    endpoints = []
    for entry in (s.strip() for s in servers.split(",")):
        host, _, port = entry.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ZipMoEError(f"{option}: '{entry}' is not HOST:PORT (e.g. 127.0.0.1:50052)")
        endpoints.append((host, int(port)))
    return endpoints


def add_rpc_servers(servers: str, option: str = "rpc_servers", timeout: float = 5.0) -> list[str]:
    """Adds each rpc-server of "host:port,..." as ggml devices (once per process), after checking that it
    answers: ggml aborts on a server it cannot reach when a model is loaded. Returns the endpoints."""
    pairs = parse_rpc_servers(servers, option)
    endpoints = [f"{host}:{port}" for host, port in pairs]
    with _lock:
        for endpoint, (host, port) in zip(endpoints, pairs):
            if endpoint in _registered:
                continue
            try:
                socket.create_connection((host, port), timeout=timeout).close()
            except OSError as e:
                raise ZipMoEError(f"{option}: RPC server {endpoint} cannot be reached ({e.strerror or e}); start "
                                  f"it there with: rpc-server -H {host} -p {port}") from None
            lib = _ggml()
            rpc = lib.ggml_backend_reg_by_name(b"RPC")
            add = lib.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_add_server") if rpc else None
            if not add:
                raise ZipMoEError(f"{option}: this build has no RPC backend (GGML_RPC)")
            reg = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add)(endpoint.encode())
            if not reg:
                raise ZipMoEError(f"{option}: RPC server {endpoint} did not answer the handshake, or has no devices")
            lib.ggml_backend_register(reg)
            _registered.add(endpoint)
    return endpoints


def has_offload_device() -> bool:
    """Whether a GPU or an RPC server added here can take layers (-ngl / n_gpu_layers). llama.cpp's
    llama_supports_gpu_offload says yes for every build with the RPC backend, servers or not."""
    lib = _ggml()
    return bool(_registered or lib.ggml_backend_dev_by_type(_GPU) or lib.ggml_backend_dev_by_type(_IGPU))
