"""Running the user's `kubectl` for the plugin: the connection flags, passed through.

`kubectl instaslice` reads the cluster through the kubectl that invoked it (or `--kubectl`),
never through its own client: so every kubeconfig feature is kubectl's own — `KUBECONFIG`
with several files merged by kubectl's rules, the context's namespace, exec credential
plugins, `proxy-url`, `--as`/`--as-group` impersonation, `--request-timeout` — and the plugin
needs no Kubernetes client library (the krew archive carries only pure Python,
plugins/krew/README.md). The cost, one `kubectl` process per list, is a few hundred
milliseconds on a command a person types.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Run = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


@dataclass(frozen=True)
class Connection:
    """kubectl's global flags the plugin accepts, passed on unchanged (None: not given)."""

    kubeconfig: str | None = None
    context: str | None = None
    cluster: str | None = None
    user: str | None = None
    as_user: str | None = None
    as_groups: tuple[str, ...] = field(default=())
    request_timeout: str | None = None

    def flags(self) -> list[str]:
        named = {
            "kubeconfig": self.kubeconfig,
            "context": self.context,
            "cluster": self.cluster,
            "user": self.user,
            "as": self.as_user,
            "request-timeout": self.request_timeout,
        }
        out = [f"--{k}={v}" for k, v in named.items() if v is not None]
        return out + [f"--as-group={g}" for g in self.as_groups]


class KubectlError(Exception):
    """kubectl exited non-zero; the message is its stderr."""


def kubectl_runner(kubectl: str, conn: Connection, timeout_s: float = 120.0) -> Run:
    """A function running `kubectl <connection flags> <args>`; a failure to start or a hang
    past `timeout_s` is returned as a failed process, never raised."""
    base = [kubectl, *conn.flags()]

    def run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [*base, *args], capture_output=True, text=True, check=False, timeout=timeout_s
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return subprocess.CompletedProcess([*base, *args], 1, "", str(exc))

    return run


def list_items(run: Run, resource: str, *scope: str) -> list[dict[str, Any]]:
    """`kubectl get RESOURCE [scope] -o json`'s items; KubectlError with kubectl's stderr."""
    proc = run(["get", resource, *scope, "-o", "json"])
    if proc.returncode != 0:
        raise KubectlError(proc.stderr.strip() or f"kubectl exited {proc.returncode}")
    items: list[dict[str, Any]] = json.loads(proc.stdout).get("items", [])
    return items
