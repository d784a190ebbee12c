"""`instaslice-uninstall`: the checked uninstall of docs/upgrade.md, as the Helm chart's hooks.

`helm uninstall` runs it twice, as Jobs in the release's namespace (charts/instaslice,
templates/hooks-*.yaml), with the webhook's image and a ServiceAccount of its own:

- `--phase=pre-delete`, before Helm deletes anything: (1) take every namespace out
  (annotation and label `instaslice.io/enabled` removed); (2) refuse — exit 1, naming them —
  while pods still wait behind the `instaslice.io/allocation` gate or hold slices, which makes
  Helm refuse the uninstall (deleting workloads is the administrator's decision, never ours);
  (3) wait until every SliceAllocation is gone (the node agents, still running, destroy the
  slices and drop the finalizers); (4) delete the release's admission hooks (the
  MutatingWebhookConfiguration and the ValidatingAdmissionPolicies and bindings) before Helm
  deletes the webhook behind them.
- `--phase=post-delete`, after Helm deleted the release's objects: wait until no node agent
  or webhook pod is left (an agent still terminating could advertise again, a webhook could
  write its certificate's Secret again), then (5) remove `instaslice.io/*` extended resources
  from every Node's status and delete the Secrets named by `--secret` (the webhook's serving
  certificate, which the webhook made itself or cert-manager did: Helm never owned them).

The same steps as `make uninstall` (hack/uninstall.py, which uses the pure parts below), but
through the API rather than kubectl (the image has no kubectl), and without deleting the
objects: Helm does, and keeps the CRDs (`helm.sh/resource-policy: keep`); the certificate
Secrets are the exception, made at run time where Helm does not see them. Waits are watches
bounded by `--timeout`. Every step is idempotent: after fixing what stopped it, run
`helm uninstall` again.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from common.kubeapi import ApiError, Kube, connected, core_path, group_path, instaslice_path

__all__ = [
    "Stop",
    "blockers",
    "capacity_patch",
    "delete_secrets",
    "main",
    "post_delete",
    "pre_delete",
]

GATE = "instaslice.io/allocation"
OPT_IN = "instaslice.io/enabled"
PART_OF = "app.kubernetes.io/part-of=instaslice"
# the pods that must be gone before the post-delete phase acts (the node agents, the webhook)
RUNNING_PODS = "app.kubernetes.io/name in (instaslice-nodeagent,instaslice-webhook)"
HOOKS = (
    group_path("admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations"),
    group_path("admissionregistration.k8s.io/v1", "validatingadmissionpolicybindings"),
    group_path("admissionregistration.k8s.io/v1", "validatingadmissionpolicies"),
)
Obj = dict[str, Any]


class Stop(Exception):
    """A check failed: nothing after it was done."""


def say(step: str, text: str) -> None:
    print(f"[{step}] {text}", flush=True)


# --- pure: what blocks, what to patch --------------------------------------------------------


def blockers(pods: list[Obj], allocations: list[Obj]) -> list[str]:
    """One line per pod gated by InstaSlice and per SliceAllocation not being deleted."""
    gated = [
        f"  gated: {p['metadata']['namespace']}/{p['metadata']['name']}"
        for p in pods
        if any(g.get("name") == GATE for g in p["spec"].get("schedulingGates") or [])
    ]
    holders = [
        f"  holds slices: {a['metadata']['namespace']}/{a['spec'].get('podName', '?')}"
        f" ({a.get('status', {}).get('phase', 'Pending')} on {a['spec'].get('nodeName', '?')})"
        for a in allocations
        if not a["metadata"].get("deletionTimestamp")
    ]
    return gated + holders


def capacity_patch(status: Obj) -> Obj | None:
    """A merge patch removing `instaslice.io/*` from a Node's capacity and allocatable."""
    drop: dict[str, None] = {
        r: None
        for key in ("capacity", "allocatable")
        for r in status.get(key) or {}
        if r.startswith("instaslice.io/")
    }
    return {"status": {"capacity": drop, "allocatable": drop}} if drop else None


# --- the steps ---------------------------------------------------------------------------------


async def _items(kube: Kube, path: str, **query: Any) -> tuple[list[Obj], str]:
    out = await kube.list(path, **query)
    return list(out.get("items") or []), str(out.get("metadata", {}).get("resourceVersion", ""))


async def _served(kube: Kube, path: str) -> bool:
    try:
        await kube.list(path, limit=1)
    except ApiError as exc:
        if exc.not_found:
            return False
        raise
    return True


async def wait_empty(
    kube: Kube, path: str, timeout_s: float, name: Callable[[Obj], str], **query: Any
) -> list[str]:
    """Watch `path` until nothing is listed there or `timeout_s` passed; what is left."""
    deadline = time.monotonic() + timeout_s
    items, rv = await _items(kube, path, **query)
    left = {o["metadata"]["uid"]: name(o) for o in items}
    while left and (remaining := deadline - time.monotonic()) > 0:
        try:
            async with asyncio.timeout(remaining):
                async for etype, obj in kube.watch(
                    path, rv, timeout_s=max(1, int(remaining)), **query
                ):
                    rv = obj.get("metadata", {}).get("resourceVersion", rv)
                    uid = obj.get("metadata", {}).get("uid")
                    if etype == "DELETED":
                        left.pop(uid, None)
                    elif etype in ("ADDED", "MODIFIED"):
                        left[uid] = name(obj)
                    if not left:
                        break
        except TimeoutError:
            break
        except ApiError as exc:
            if not (exc.gone or exc.retryable):
                raise
            items, rv = await _items(kube, path, **query)
            left = {o["metadata"]["uid"]: name(o) for o in items}
    return sorted(left.values())


async def opt_out_namespaces(kube: Kube) -> None:
    namespaces, _ = await _items(kube, core_path("namespaces"))
    names = sorted(
        ns["metadata"]["name"]
        for ns in namespaces
        if OPT_IN in (ns["metadata"].get("annotations") or {})
        or OPT_IN in (ns["metadata"].get("labels") or {})
    )
    for name in names:
        patch = {"metadata": {"annotations": {OPT_IN: None}, "labels": {OPT_IN: None}}}
        await kube.patch(core_path("namespaces", name=name), patch)
    say("1/5", f"namespaces taken out: {len(names)}")


async def check_no_waiting_pods(kube: Kube) -> None:
    pods, _ = await _items(kube, core_path("pods"))
    allocs_path = instaslice_path("sliceallocations")
    allocs = (await _items(kube, allocs_path))[0] if await _served(kube, allocs_path) else []
    lines = blockers(pods, allocs)
    if lines:
        raise Stop(
            "pods still wait for or hold slices; delete them (or their Jobs/Deployments) and "
            "run `helm uninstall` again (docs/upgrade.md, Uninstall):\n" + "\n".join(lines)
        )
    say("2/5", "no pod waits for or holds a slice")


async def wait_allocations_gone(kube: Kube, timeout_s: float) -> None:
    path = instaslice_path("sliceallocations")
    if await _served(kube, path):
        left = await wait_empty(
            kube, path, timeout_s, lambda o: f"{o['metadata']['namespace']}/{o['metadata']['name']}"
        )
        if left:
            raise Stop(
                f"SliceAllocations did not go away within {timeout_s:g} s (a slice that will "
                "not release, docs/troubleshooting.md): " + ", ".join(left)
            )
    say("3/5", "no SliceAllocation left")


async def delete_admission_hooks(kube: Kube, selector: str) -> None:
    for path in HOOKS:
        await kube.delete(path, labelSelector=selector)
    left = [o["metadata"]["name"] for path in HOOKS
            for o in (await _items(kube, path, labelSelector=selector))[0]]  # fmt: skip
    if left:
        raise Stop("the admission hooks are still there: " + ", ".join(left))
    say("4/5", f"admission hooks ({selector}) deleted; Helm deletes the rest, keeps the CRDs")


async def wait_pods_gone(kube: Kube, namespace: str, timeout_s: float) -> None:
    path = core_path("pods", namespace)
    left = await wait_empty(
        kube, path, timeout_s, lambda o: str(o["metadata"]["name"]), labelSelector=RUNNING_PODS
    )
    if left:
        raise Stop(
            f"node agent or webhook pods still there after {timeout_s:g} s: " + ", ".join(left)
        )


async def clean_node_capacity(kube: Kube) -> None:
    nodes, _ = await _items(kube, core_path("nodes"))
    cleaned = 0
    for node in nodes:
        patch = capacity_patch(node.get("status", {}))
        if patch is not None:
            path = core_path("nodes", name=node["metadata"]["name"]) + "/status"
            await kube.patch(path, patch)
            cleaned += 1
    say("5/5", f"instaslice.io/* capacity removed from {cleaned} node(s)")


async def delete_secrets(kube: Kube, namespace: str, names: Sequence[str]) -> None:
    """The webhook certificate's Secrets: made at run time, so `helm uninstall` would leave
    them (docs/upgrade.md). One already gone is fine."""
    deleted = []
    for name in names:
        try:
            await kube.delete(core_path("secrets", namespace, name))
        except ApiError as exc:
            if not exc.not_found:
                raise
        else:
            deleted.append(name)
    say("5/5", f"Secrets deleted: {', '.join(deleted) or 'none were left'}")


async def pre_delete(kube: Kube, selector: str, timeout_s: float) -> None:
    await opt_out_namespaces(kube)
    await check_no_waiting_pods(kube)
    await wait_allocations_gone(kube, timeout_s)
    await delete_admission_hooks(kube, selector)


async def post_delete(
    kube: Kube, namespace: str, timeout_s: float, secrets: Sequence[str] = ()
) -> None:
    await wait_pods_gone(kube, namespace, timeout_s)
    await clean_node_capacity(kube)
    await delete_secrets(kube, namespace, secrets)
    say("done", "on each GPU node, remove /var/lib/instaslice (docs/upgrade.md)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="instaslice-uninstall", description=__doc__.split("\n")[0])
    p.add_argument("--phase", choices=["pre-delete", "post-delete"], required=True)
    p.add_argument("--kubeconfig", default=None, help="default: in-cluster service account")
    p.add_argument("--namespace", default="instaslice-system", help="the release's")
    p.add_argument(
        "--selector",
        default=PART_OF,
        help="label selector of the admission hooks to delete (the chart adds its release)",
    )
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="each wait's bound")
    p.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help="post-delete: a Secret of the release's namespace to delete (repeatable; the chart "
        "names its certificate's)",
    )
    return p


async def _run(a: argparse.Namespace) -> None:
    async with connected(a.kubeconfig) as kube:
        if a.phase == "pre-delete":
            await pre_delete(kube, a.selector, a.timeout)
        else:
            await post_delete(kube, a.namespace, a.timeout, a.secret)


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        asyncio.run(_run(a))
    except Stop as exc:
        print(f"uninstall stopped: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
