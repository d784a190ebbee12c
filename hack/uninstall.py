"""`make uninstall OVERLAY=dir`: the checked uninstall of docs/upgrade.md, step by step.

Runs kubectl (on PATH, or `--kubectl`) against the current context (or `--kubeconfig`,
`--context`), in the documented order, and stops — changing nothing further — at the first
check that fails, saying what is in the way:

1. take every namespace out (annotation and label `instaslice.io/enabled` removed);
2. refuse to go on while pods still wait behind the `instaslice.io/allocation` gate or hold
   slices (listing them: deleting workloads is the administrator's decision, never ours);
3. wait until every SliceAllocation is gone (the node agents destroy the slices);
4. delete the admission hooks first, then everything the overlay installs (saying what is
   still terminating when that does not finish in time);
5. remove `instaslice.io/*` extended resources from every Node's status.

Steps 3 and 4 wait by polling with plain GETs, each at most `--timeout`, never on a watch
(kubectl's `--wait` hung in CI with everything already gone on the server); every request
has a timeout. Node-side leftovers (the agent's records in /var/lib/instaslice) are listed,
not touched: they are on the hosts. Every step is idempotent, so after fixing what stopped
it, run it again.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from webhook.uninstall import blockers, capacity_patch

OPT_IN = "instaslice.io/enabled"
PART_OF = "app.kubernetes.io/part-of=instaslice"
# every request is bounded; what must go away is polled with plain GETs, never waited for on
# a watch: kubectl's --wait (and `kubectl wait`) once hung 190 s in CI after the namespace and
# CRDs were gone on the server (the API server's and controller manager's logs say so)
REQUEST_TIMEOUT = "--request-timeout=30s"
POLL_S = 1.0


class Stop(Exception):
    """A check failed: nothing after it was done."""


@dataclass
class Kubectl:
    binary: str = "kubectl"
    kubeconfig: str | None = None
    context: str | None = None

    def __call__(self, *args: str, check: bool = True) -> str:
        cmd = [self.binary, REQUEST_TIMEOUT]
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

    def names(self, *args: str) -> list[str]:
        """`kind/name` of each object `get args` finds (none: an empty list)."""
        return self("get", *args, "-o", "name", "--ignore-not-found").split()

    def has_resource(self, name: str) -> bool:
        return bool(self("api-resources", "-o", "name", check=False).count(f"{name}\n"))


def say(step: str, text: str) -> None:
    print(f"[{step}] {text}", flush=True)


def seconds(duration: str) -> float:
    """A kubectl-style duration (`90s`, `10m`, `1h30m`) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"--timeout: {duration!r} is not a duration like 90s, 10m or 1h")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def poll_gone(left: Callable[[], list[str]], timeout: str) -> list[str]:
    """Call `left` (what is still there) every POLL_S until it is empty or `timeout` has
    passed; what was left at the last call. A call that fails (a request timed out or was
    refused) is asked again, until the deadline."""
    deadline = time.monotonic() + seconds(timeout)
    while True:
        try:
            names = left()
        except Stop:
            if time.monotonic() >= deadline:
                raise
        else:
            if not names or time.monotonic() >= deadline:
                return names
        time.sleep(POLL_S)


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
    allocs = (
        k.items("sliceallocations.instaslice.io", "-A")
        if k.has_resource("sliceallocations.instaslice.io")
        else []
    )
    lines = blockers(k.items("pods", "-A"), allocs)
    if lines:
        raise Stop(
            "pods still wait for or hold slices; delete them (or their Jobs/Deployments) and "
            "run again (docs/upgrade.md, Uninstall step 2):\n" + "\n".join(lines)
        )
    say("2/5", "no pod waits for or holds a slice")


def wait_allocations_gone(k: Kubectl, timeout: str) -> None:
    if k.has_resource("sliceallocations.instaslice.io"):
        left = poll_gone(
            lambda: [
                f"{a['metadata']['namespace']}/{a['metadata']['name']}"
                for a in k.items("sliceallocations.instaslice.io", "-A")
            ],
            timeout,
        )
        if left:
            raise Stop(
                f"SliceAllocations did not go away within {timeout} (a slice that will not "
                "release, docs/troubleshooting.md): " + ", ".join(left)
            )
    say("3/5", "no SliceAllocation left")


def delete_everything(k: Kubectl, overlay: str, timeout: str) -> None:
    hooks = (
        "mutatingwebhookconfigurations,"
        "validatingadmissionpolicybindings,validatingadmissionpolicies"
    )
    k("delete", hooks, "-l", PART_OF, "--ignore-not-found", "--wait=false")
    left = poll_gone(lambda: k.names(hooks, "-l", PART_OF), timeout)
    if left:
        raise Stop(f"the admission hooks are still there after {timeout}: " + ", ".join(left))
    k("delete", "-k", overlay, "--ignore-not-found", "--wait=false")
    # what can stay a while: the namespace (its content goes first) and the CRDs (their
    # objects first); then, once, everything the overlay names (one GET each)
    left = poll_gone(
        lambda: (
            k.names("namespaces,customresourcedefinitions", "-l", PART_OF) or k.names("-k", overlay)
        ),
        timeout,
    )
    if left:
        raise Stop(f"still there after {timeout}: {', '.join(left)}\n{still_terminating(k)}")
    say("4/5", f"admission hooks, then everything of {overlay}, deleted")


def still_terminating(k: Kubectl) -> str:
    """What holds step 4: InstaSlice's namespaces and CRDs still there, each with the
    conditions that say why (a namespace's content or finalizers left, a failed discovery)."""
    lines = []
    for obj in k.items("namespaces,customresourcedefinitions", "-l", PART_OF):
        all_conditions = obj.get("status", {}).get("conditions") or []
        conditions = [
            f"{c.get('type')}: {c.get('message', '')}"
            for c in all_conditions
            if c.get("status") == "True" and c.get("type") not in ("Established", "NamesAccepted")
        ]
        if not conditions and obj["kind"] == "Namespace" and not all_conditions:
            # the namespace controller sets its conditions on its first pass over the namespace
            conditions = [
                "no condition at all: the namespace controller has not acted on it "
                "(is kube-controller-manager running?)"
            ]
        lines.append(
            f"  {obj['kind']} {obj['metadata']['name']}: "
            + ("; ".join(conditions) or "no condition")
        )
    return "still there:\n" + "\n".join(lines) if lines else "nothing of InstaSlice's is left"


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
    delete_everything(k, overlay, timeout)
    clean_node_capacity(k)
    say("done", "on each GPU node, remove /var/lib/instaslice (docs/upgrade.md step 6)")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make uninstall", description=__doc__.split("\n\n")[0])
    p.add_argument("--overlay", required=True, help="the kustomize directory you installed")
    p.add_argument("--kubectl", default="kubectl")
    p.add_argument("--kubeconfig", default=None)
    p.add_argument("--context", default=None)
    p.add_argument(
        "--timeout",
        default="10m",
        help="how long step 3, and each of step 4's two waits, wait at most",
    )
    a = p.parse_args(argv)
    try:
        seconds(a.timeout)
    except ValueError as exc:
        p.error(str(exc))
    try:
        uninstall(Kubectl(a.kubectl, a.kubeconfig, a.context), a.overlay, a.timeout)
    except Stop as exc:
        print(f"uninstall stopped: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
