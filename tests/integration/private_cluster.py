"""A control plane of a module's own, for the modules whose objects would disturb the others'
(the chart's webhook configuration and policies, uninstall's deletes of shared CRDs).

- `private_control_plane(tmp_path_factory, name)`: started under the session's temp dir,
  stopped on exit; missing binaries fail the test with the message (never a skip).
- `kubectl_ok(cp, *args, stdin=None)`: kubectl's stdout, asserting it succeeded (the failure
  names the command and kubectl's stderr).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from hack.cluster import BinariesMissing, ControlPlane

__all__ = ["kubectl_ok", "private_control_plane"]


@contextlib.contextmanager
def private_control_plane(
    tmp_path_factory: pytest.TempPathFactory, name: str
) -> Iterator[ControlPlane]:
    try:
        started = ControlPlane.start(tmp_path_factory.mktemp(name))
    except BinariesMissing as e:
        pytest.fail(str(e), pytrace=False)
    with started as cp:
        yield cp


def kubectl_ok(cp: ControlPlane, *args: str, stdin: str | None = None) -> str:
    proc = cp.kubectl(*args, check=False, stdin=stdin)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
    return proc.stdout
