"""Kubeconfig files for the local control plane.

Every kubeconfig embeds its certificates (no paths), so a file can be copied or handed to a
subprocess on its own. The admin kubeconfig also records, as a cluster extension that kubectl
and client libraries ignore, the work dir of the control plane that wrote it: that is how a
later process given only the kubeconfig (`INSTASLICE_KUBECONFIG`) finds the CA key and state.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import yaml

from hack.cluster.pki import IssuedCert

__all__ = ["STATE_EXTENSION", "read_state_dir", "write_kubeconfig"]

STATE_EXTENSION = "instaslice.io/control-plane-state"
_CLUSTER = "instaslice-local"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def write_kubeconfig(
    path: Path,
    *,
    server: str,
    ca_cert_pem: bytes,
    client: IssuedCert,
    user: str,
    state_dir: Path | None = None,
) -> Path:
    """Write a kubeconfig for `server` authenticating with `client`; returns `path`."""
    cluster: dict[str, Any] = {
        "server": server,
        "certificate-authority-data": _b64(ca_cert_pem),
    }
    if state_dir is not None:
        cluster["extensions"] = [
            {
                "name": STATE_EXTENSION,
                # kubectl keeps unknown extensions as opaque data (minikube does the same)
                "extension": {"stateDir": str(state_dir.resolve())},
            }
        ]
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": _CLUSTER, "cluster": cluster}],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(client.cert_pem),
                    "client-key-data": _b64(client.key_pem),
                },
            }
        ],
        "contexts": [{"name": user, "context": {"cluster": _CLUSTER, "user": user}}],
        "current-context": user,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
    tmp.chmod(0o600)
    os.replace(tmp, path)
    return path


def read_state_dir(path: Path) -> Path | None:
    """The control-plane work dir recorded in a kubeconfig written here, else None."""
    doc = yaml.safe_load(path.read_text())
    for entry in doc.get("clusters") or []:
        for ext in (entry.get("cluster") or {}).get("extensions") or []:
            if ext.get("name") == STATE_EXTENSION:
                state_dir = (ext.get("extension") or {}).get("stateDir")
                if state_dir:
                    return Path(state_dir)
    return None
