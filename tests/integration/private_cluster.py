"""A control plane of a module's own, for the modules whose objects would disturb the others'
(the chart's webhook configuration and policies, uninstall's deletes of shared CRDs).

- `private_control_plane(tmp_path_factory, name)`: started under the session's temp dir,
  stopped on exit; missing binaries fail the test with the message (never a skip).
- `kubectl_ok(cp, *args, stdin=None)`: kubectl's stdout, asserting it succeeded (the failure
  names the command and kubectl's stderr).
- `hold_a_slice(cp, node)`: what the uninstall tests refuse to remove: namespace `team-a`,
  opted in (the annotation and its mirrored label), and SliceAllocation `team-a/claim-1` of
  pod `trainer` holding one 1g.18gb slice on `node`, with the release finalizer (as a node
  agent leaves it until the slice is destroyed).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest

from hack.cluster import BinariesMissing, ControlPlane

__all__ = ["hold_a_slice", "kubectl_ok", "private_control_plane"]


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


def hold_a_slice(cp: ControlPlane, node: str) -> None:
    kubectl_ok(cp, "create", "namespace", "team-a")
    kubectl_ok(cp, "annotate", "namespace", "team-a", "instaslice.io/enabled=true")
    kubectl_ok(cp, "label", "namespace", "team-a", "instaslice.io/enabled=true")
    alloc = {
        "apiVersion": "instaslice.io/v1alpha1",
        "kind": "SliceAllocation",
        "metadata": {"name": "claim-1", "namespace": "team-a",
                     "finalizers": ["instaslice.io/release"]},
        "spec": {"podName": "trainer", "podUID": "u1", "nodeName": node,
                 "slices": [{"container": "c", "profile": "1g.18gb", "gpuUUID": "GPU-1",
                             "start": 0, "size": 1}]},
    }  # fmt: skip
    kubectl_ok(cp, "create", "-f", "-", stdin=json.dumps(alloc))
