"""The daemons' console scripts without the `server` extra: one line saying what to install.

`pip install instaslice` brings what `kubectl instaslice` needs; the webhook and the node agent
also need the `server` extra (`pip install 'instaslice[server]'`, what the images install).
Without it their first import of, say, jsonpatch used to end in a ModuleNotFoundError
traceback. `webhook/cli.py` and `nodeagent/cli.py` load the real entry point inside
`server_extra(...)`, which turns exactly that failure into a message and exit status 1; a
missing module that the extra does not provide is a different bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

# top-level module -> the distribution of pyproject.toml's `server` extra that provides it
SERVER_MODULES = {
    "jsonpatch": "jsonpatch",
    "pynvml": "nvidia-ml-py",
    "cryptography": "cryptography",
    "prometheus_client": "prometheus-client",
    "grpc": "grpcio",
    "google": "protobuf",
}


def missing_extra_message(command: str, module: str) -> str | None:
    """The message for a missing module of the server extra; None for any other module."""
    dist = SERVER_MODULES.get(module.split(".")[0])
    if dist is None:
        return None
    return (
        f"{command}: the Python package {dist} (module {module}) is not installed. "
        f"{command} needs the `server` extra: pip install 'instaslice[server]' "
        "(`pip install instaslice` alone brings only what kubectl-instaslice needs)."
    )


@contextmanager
def server_extra(command: str) -> Iterator[None]:
    """Around the import of a daemon's entry point: a missing server module exits with a
    message (status 1) instead of a traceback."""
    try:
        yield
    except ModuleNotFoundError as exc:
        message = missing_extra_message(command, exc.name or "")
        if message is None:
            raise
        print(message, file=sys.stderr)
        sys.exit(1)
