"""`make uninstall OVERLAY=dir`: the checked uninstall of docs/upgrade.md, step by step.

Runs kubectl (on PATH, or `--kubectl`) against the current context (or `--kubeconfig`,
`--context`), in the documented order, and stops — changing nothing further — at the first
check that fails, saying what is in the way:

1. take every namespace out (annotation and label `instaslice.io/enabled` removed);
2. refuse to go on while pods still wait behind the `instaslice.io/allocation` gate or hold
   slices (listing them: deleting workloads is the administrator's decision, never ours);
3. wait until every SliceAllocation is gone (the node agents destroy the slices);
4. delete the admission hooks first, then everything the overlay installs;
5. remove `instaslice.io/*` extended resources from every Node's status.

Node-side leftovers (the agent's records in /var/lib/instaslice) are listed, not touched: they
are on the hosts. Every step is idempotent, so after fixing what stopped it, run it again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

GATE = "instaslice.io/allocation"
OPT_IN = "instaslice.io/enabled"
PART_OF = "app.kubernetes.io/part-of=instaslice"


class Stop(Exception):
    """A check failed: nothing after it was done."""


@dataclass
class Kubectl:
    binary: str = "kubectl"
    kubeconfig: str | None = None
    context: str | None = None

    def __call__(self, *args: str, check: bool = True) -> str:
        cmd = [self.binary]
        if self.kubeconfig:
            cmd += ["--kubeconfig", self.kubeconfig]
        if self.context:
            cmd += ["--context", self.context]
        proc = subprocess.run([*cmd, *args], capture_output=True, text=True, check=False)
        if check and proc.returncode != 0:
            raise Stop(f"kubectl {' '.join(args)} failed:\n{proc.stderr.strip()}")
        return proc.stdout

    def items(self, *args: str) -> list[dict[str, Any]]:
        out = self("get", *args, "-o", "json", "--ignore-not-found")
        return list(json.loads(out).get("items", [])) if out.strip() else []

    def has_resource(self, name: str) -> bool:
        return bool(self("api-resources", "-o", "name", check=False).count(f"{name}\n"))


def say(step: str, text: str) -> None:
    print(f"[{step}] {text}", flush=True)


def opt_out_namespaces(k: Kubectl) -> None:
    names = {
        ns["metadata"]["name"]
        for ns in k.items("namespaces")
        if OPT_IN in (ns["metadata"].get("annotations") or {})
        or OPT_IN in (ns["metadata"].get("labels") or {})
    }
    for name in sorted(names):
        k("annotate", "namespace", name, f"{OPT_IN}-")
        k("label", "namespace", name, f"{OPT_IN}-")
    say("1/5", f"namespaces taken out: {len(names)}")


def check_no_waiting_pods(k: Kubectl) -> None:
    gated = [
        f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        for p in k.items("pods", "-A")
        if any(g.get("name") == GATE for g in p["spec"].get("schedulingGates") or [])
    ]
    allocs = (
        k.items("sliceallocations.instaslice.io", "-A")
        if k.has_resource("sliceallocations.instaslice.io")
        else []
    )
    holders = [
        f"{a['metadata']['namespace']}/{a['spec'].get('podName', '?')}"
        f" ({a.get('status', {}).get('phase', 'Pending')} on {a['spec'].get('nodeName', '?')})"
        for a in allocs
        if not a["metadata"].get("deletionTimestamp")
    ]
    if gated or holders:
        lines = [f"  gated: {p}" for p in gated] + [f"  holds slices: {h}" for h in holders]
        raise Stop(
            "pods still wait for or hold slices; delete them (or their Jobs/Deployments) and "
            "run again (docs/upgrade.md, Uninstall step 2):\n" + "\n".join(lines)
        )
    say("2/5", "no pod waits for or holds a slice")


def wait_allocations_gone(k: Kubectl, timeout: str) -> None:
    if k.has_resource("sliceallocations.instaslice.io"):
        k("wait", "--for=delete", "sliceallocations.instaslice.io", "--all", "-A",
          f"--timeout={timeout}")  # fmt: skip
        left = k.items("sliceallocations.instaslice.io", "-A")
        if left:
            names = [f"{a['metadata']['namespace']}/{a['metadata']['name']}" for a in left]
            raise Stop(
                "SliceAllocations did not go away (a slice that will not release, "
                "docs/troubleshooting.md): " + ", ".join(names)
            )
    say("3/5", "no SliceAllocation left")


def delete_everything(k: Kubectl, overlay: str) -> None:
    k("delete", "mutatingwebhookconfigurations", "-l", PART_OF, "--ignore-not-found")
    k("delete", "validatingadmissionpolicybindings,validatingadmissionpolicies", "-l", PART_OF,
      "--ignore-not-found")  # fmt: skip
    k("delete", "-k", overlay, "--ignore-not-found", "--wait=true")
    say("4/5", f"admission hooks, then everything of {overlay}, deleted")


def capacity_patch(status: dict[str, Any]) -> dict[str, Any] | None:
    """A merge patch removing `instaslice.io/*` from a Node's capacity and allocatable."""
    drop: dict[str, None] = {
        r: None
        for key in ("capacity", "allocatable")
        for r in status.get(key) or {}
        if r.startswith("instaslice.io/")
    }
    return {"status": {"capacity": drop, "allocatable": drop}} if drop else None


def clean_node_capacity(k: Kubectl) -> None:
    cleaned = 0
    for node in k.items("nodes"):
        patch = capacity_patch(node.get("status", {}))
        if patch is not None:
            k("patch", "node", node["metadata"]["name"], "--subresource=status",
              "--type=merge", "-p", json.dumps(patch))  # fmt: skip
            cleaned += 1
    say("5/5", f"instaslice.io/* capacity removed from {cleaned} node(s)")


def uninstall(k: Kubectl, overlay: str, timeout: str) -> None:
    opt_out_namespaces(k)
    check_no_waiting_pods(k)
    wait_allocations_gone(k, timeout)
    delete_everything(k, overlay)
    clean_node_capacity(k)
    say("done", "on each GPU node, remove /var/lib/instaslice (docs/upgrade.md step 6)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make uninstall", description=__doc__.split("\n\n")[0])
    p.add_argument("--overlay", required=True, help="the kustomize directory you installed")
    p.add_argument("--kubectl", default="kubectl")
    p.add_argument("--kubeconfig", default=None)
    p.add_argument("--context", default=None)
    p.add_argument("--timeout", default="10m", help="how long step 3 waits")
    a = p.parse_args(argv)
    try:
        uninstall(Kubectl(a.kubectl, a.kubeconfig, a.context), a.overlay, a.timeout)
    except Stop as exc:
        print(f"uninstall stopped: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
