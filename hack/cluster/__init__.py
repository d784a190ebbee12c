"""Local Kubernetes control plane for tests, benchmarks and the demo (see docs/control-plane.md).

`ControlPlane.start(workdir)` runs etcd, kube-apiserver, kube-scheduler,
kube-controller-manager and KWOK on loopback from the binaries `make kube-bins` caches;
`hack.cluster.nodes` creates KWOK GPU nodes from a cluster spec; `python -m hack.cluster`
is the CLI behind `make cluster-up` / `make cluster-down`.
"""

from hack.cluster.bins import BinariesMissing, find_bin_dir
from hack.cluster.controlplane import ClusterSettings, ControlPlane, ControlPlaneError
from hack.cluster.pki import CertificateAuthority, IssuedCert

__all__ = [
    "BinariesMissing",
    "CertificateAuthority",
    "ClusterSettings",
    "ControlPlane",
    "ControlPlaneError",
    "IssuedCert",
    "find_bin_dir",
]
