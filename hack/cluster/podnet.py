"""Pod networking for the real node when InstaSlice itself runs there as pods (`install: chart`).

The real node's own test pods use `hostNetwork`; the chart's webhook Deployment and node-agent
DaemonSet do not. Here they get what a cluster's CNI and kube-proxy would give them, and no
more:

- a Linux bridge `islice0` with 10.244.0.0/24 (CNI `bridge` + `host-local`, Debian's
  containernetworking-plugins in /usr/lib/cni): each pod an IP the host routes to, so the API
  server reaches the webhook's endpoints directly (kube-apiserver
  `--enable-aggregator-routing=true` makes it dial a webhook Service's endpoints, there being
  no kube-proxy; hack/cluster/controlplane.py);
- the `kubernetes` Service for those pods: the in-cluster client dials 10.96.0.1:443 (the
  API server's certificate names it), and one DNAT rule on the bridge turns that into the API
  server on 127.0.0.1 (`route_localnet` on this bridge only, so loopback stays unreachable
  from any other interface).

What it does not do: Service IPs other than the API server's, DNS, NetworkPolicy enforcement,
masquerading to the outside. One real node per machine, so the bridge name is fixed; `down`
removes the rule and the bridge.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
from pathlib import Path
from typing import Any, Final

__all__ = [
    "API_SERVICE_IP",
    "BRIDGE",
    "CNI_PLUGINS",
    "GATEWAY",
    "SUBNET",
    "PodNetError",
    "conflist",
    "down",
    "up",
]

BRIDGE: Final = "islice0"
SUBNET: Final = "10.244.0.0/24"
GATEWAY: Final = "10.244.0.1"
API_SERVICE_IP: Final = "10.96.0.1"  # the first IP of --service-cluster-ip-range
CNI_PLUGINS: Final = ("bridge", "host-local")
DEBIAN_CNI_DIR: Final = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
_COMMENT: Final = "instaslice-realnode: kubernetes Service"


class PodNetError(RuntimeError):
    """Pod networking could not be set up; the message says what to install or why."""


def conflist(ipam_dir: Path) -> dict[str, Any]:
    """The node's CNI network: the bridge, IPs from host-local (state in `ipam_dir`)."""
    return {
        "cniVersion": "1.0.0",
        "name": "instaslice-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": SUBNET, "gateway": GATEWAY}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(ipam_dir),
                },
            }
        ],
    }


def plugin_paths() -> dict[str, Path]:
    missing = [p for p in CNI_PLUGINS if not (DEBIAN_CNI_DIR / p).exists()]
    if missing:
        raise PodNetError(
            f"CNI plugins {', '.join(missing)} missing in {DEBIAN_CNI_DIR}: run `make node-deps` "
            "(apt-get install containernetworking-plugins)"
        )
    return {p: DEBIAN_CNI_DIR / p for p in CNI_PLUGINS}


def _dnat_rule(apiserver_port: int) -> list[str]:
    return [
        "PREROUTING", "-i", BRIDGE, "-d", API_SERVICE_IP, "-p", "tcp", "--dport", "443",
        "-m", "comment", "--comment", _COMMENT,
        "-j", "DNAT", "--to-destination", f"127.0.0.1:{apiserver_port}",
    ]  # fmt: skip


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise PodNetError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def up(apiserver_port: int) -> None:
    """The bridge (made here, so `route_localnet` is set before the first pod) and the
    API server's DNAT rule; idempotent."""
    if _run("ip", "link", "show", BRIDGE, check=False).returncode != 0:
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    addrs = _run("ip", "-o", "-4", "addr", "show", "dev", BRIDGE).stdout
    if f"{GATEWAY}/" not in addrs:
        _run("ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    Path(f"/proc/sys/net/ipv4/conf/{BRIDGE}/route_localnet").write_text("1\n")
    _remove_rules()  # a previous API server's port
    _run("iptables", "-t", "nat", "-A", *_dnat_rule(apiserver_port))


def _remove_rules() -> None:
    rules = _run("iptables", "-t", "nat", "-S", "PREROUTING", check=False).stdout.splitlines()
    for rule in rules:
        if _COMMENT in rule and rule.startswith("-A "):  # as iptables prints it: -A CHAIN ...
            _run("iptables", "-t", "nat", "-D", *shlex.split(rule)[1:], check=False)


def down() -> None:
    """Remove the DNAT rule and the bridge (pods' veths go with their sandboxes)."""
    with contextlib.suppress(OSError):
        _remove_rules()
    _run("ip", "link", "del", BRIDGE, check=False)
