"""A free TCP port on 127.0.0.1, for the servers the tests and benches start (llama-server, rpc-server,
zipmoe-server)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick): a server started on it next will most likely get it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
