"""The operator docs' commands, run as written against the live e2e system.

Every ```sh block of docs/troubleshooting.md and docs/upgrade.md is extracted and run with
bash (`set -o pipefail`; an ERR trap records each failing command) with `kubectl` (the
cluster's), `kubectl-instaslice` (the plugin) and `python3` on PATH and KUBECONFIG set, in
the situation the block is meant for: a Running pod holding a slice, a pod stuck with
AllocationPending, allocations that will not release because the node agent is down (then
each documented way out: restart the agent, force-remove the finalizer, delete the node), a
node drained for a driver upgrade, an upgrade, and the uninstall in order. Placeholder
assignments in the docs (`NS=team-a`, `POD=my-pod`, `NODE=gpu-node-1`) are replaced by the
real names; every other line runs verbatim. Each block must exit 0 with no failed command
and print what it promises (the claim, the node, the gate, the events, the Lease holder, ...).

To give the docs' label selectors something real to find, the fixture `ops_install` applies
the Kubernetes overlay (`kubectl kustomize manifests/overlays/kubernetes`, with cert-manager's
CRDs from hack/fetch-crds.sh) except its MutatingWebhookConfiguration: its Deployment,
DaemonSet and Service then exist as KWOK pods, while the dev processes keep doing the work.
The dev install's own webhook configuration gets the overlay's `app.kubernetes.io/part-of`
label, which `hack.dev` leaves out because it applies the manifests file by file.

Leaves out (not runnable here): `kubectl logs` of the component pods — KWOK runs no kubelet,
so the API server answers "no preferred addresses found", the one failure allowed, and only
for those commands; the commands run on a GPU node (`nvidia-smi`, `ls /var/run/cdi`, `rm -rf
/var/lib/instaslice`), whose effect is checked on the emulated GPUs and CDI directories
instead; the OpenShift overlay; a Failed allocation and PinnedUnschedulable as live states
(their blocks run against a Ready allocation and must still succeed).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from common.constants import CLAIM_ANNOTATION, ENABLED_KEY, GPU_MODEL_LABEL, NODE_LABEL
from common.kubeapi import Kube, Obj, core_path, group_path
from hack.dev import REPO, DevSystem
from nodeagent.emulator import EmulatorControl
from testkit.builders import user_pod
from tests.e2e.helpers import (
    allocs_path,
    assert_holds_slices,
    assert_released,
    cdi_files,
    deployments_path,
    held_slices,
    kubectl,
    make_deployment,
    pods_path,
    wait_gone,
    wait_opted_in,
    wait_pod_running,
    wait_pods_running,
)
from tests.support import wait_for

DOCS = REPO / "docs"
OVERLAY = "manifests/overlays/kubernetes"
NO_KUBELET = "no preferred addresses found"  # kubectl logs of a KWOK pod
_PLACEHOLDER = re.compile(r"^(\s*)(NS|POD|NODE)=([A-Za-z0-9._-]+)(\s+#.*)?$", re.M)


# --- the docs' blocks ---------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    doc: str
    index: int
    text: str


def sh_blocks(doc: str) -> list[Block]:
    """The ```sh blocks of docs/<doc>, dedented (they may sit inside list items)."""
    out: list[Block] = []
    lines = (DOCS / doc).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```sh\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, body = len(m.group(1)), []
        i += 1
        while not re.match(r"^\s*```\s*$", lines[i]):
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        out.append(Block(doc, len(out), "\n".join(body) + "\n"))
        i += 1
    return out


def block(doc: str, key: str) -> Block:
    found = [b for b in sh_blocks(doc) if key in b.text]
    assert len(found) == 1, f"expected one sh block of {doc} containing {key!r}, found {found}"
    return found[0]


# Each key names the block(s) it covers; the first test checks none is forgotten.
TROUBLESHOOTING_KEYS = {
    "POD=my-pod": "variables (every test)",
    "kubectl instaslice nodes                  # each GPU": "overview",
    "get lease instaslice-allocator": "logs",
    "{.spec.schedulingGates}": "gates",
    'get slicealloc "$CLAIM"\n': "is there an allocation",
    ".spec.renewTime": "agent heartbeat",
    'describe pod "$POD"': "events",
    "metadata.labels.instaslice": "never rewritten",
    "caBundle bytes": "creation refused",
    "{range .status.conditions": "Failed allocation",
    "{.metadata.deletionTimestamp}": "will not release",
    'kubectl delete node "$NODE"': "node gone for good",
    '"op":"test"': "force-remove the finalizer",
    "reason=PinnedUnschedulable": "pinned but unschedulable",
    "describe daemonset instaslice-nodeagent": "agent not starting",
}
TROUBLESHOOTING_NOT_RUN = {
    "nvidia-smi  ": "runs on the GPU node (NVML), not against the API",
    # a GPU beyond the MigNode bounds: the API server refuses such a MigNode (the CRD), so no
    # e2e cluster has one; the event, the gauge and the REFUSED row are tested in
    # tests/unit/test_mignode_bounds.py and tests/unit/test_kubectl_plugin.py
    "reason=GpuOutOfBounds": "needs a MigNode the CRD refuses; tested in unit tests",
}
UPGRADE_KEYS = {
    'kubectl diff -k "$OVERLAY"': "upgrade",
    'kubectl drain "$NODE"': "driver upgrade",
    'kubectl annotate "$ns"': "uninstall 1",
    "custom-columns=NAMESPACE": "uninstall 2",
    "wait --for=delete slicealloc --all": "uninstall 3",
    "delete mutatingwebhookconfigurations": "uninstall 4",
    "--subresource=status": "uninstall 5",
}
UPGRADE_NOT_RUN = {
    "nvidia-smi mig -lgi": "node-side checks; done on the emulated GPUs instead",
    # a read-only preview of pods the NVIDIA_VISIBLE_DEVICES rule would refuse when
    # recreated; it needs jq, which the project does not install. The rule itself is tested
    # in tests/integration/test_admission_policy.py
    '.name == "NVIDIA_VISIBLE_DEV': "a jq preview; the rule is tested directly",
    # the same for pods whose init containers would now be refused (pod policy rule 8,
    # tested in tests/integration/test_admission_policy.py and tests/unit/test_admission_init.py)
    "select((.spec.initContainers": "a jq preview; the rule is tested directly",
    # the Helm path needs the chart installed, which this module's KWOK install is not:
    # hack/cluster/chartinstall.py runs it on tests/e2e/test_installed.py's install: chart
    # cluster (its helm upgrade test); the hooks' logic is tests/integration/test_helm_hooks.py
    "helm upgrade instaslice": "run by tests/e2e/test_installed.py's helm upgrade",
}


# --- running them -------------------------------------------------------------------------


@dataclass(frozen=True)
class Allowed:
    """A command that may fail, and how: regexes on the command and on stderr."""

    command: str
    stderr: str


@dataclass
class Run:
    block: Block
    rc: int
    out: str
    err: str
    failed: list[tuple[int, str]] = field(default_factory=list)
    vars: dict[str, str] = field(default_factory=dict)

    def show(self) -> str:
        return (
            f"{self.block.doc} sh block #{self.block.index}:\n{self.block.text}"
            f"--- rc {self.rc}; failed commands: {self.failed}\n--- stdout:\n{self.out}"
            f"--- stderr:\n{self.err}"
        )


def shell_env(system: DevSystem, **values: str) -> dict[str, str]:
    path = os.pathsep.join([str(system.dir / "bin"), str(Path(sys.executable).parent)])
    env = dict(os.environ, KUBECONFIG=str(system.kubeconfig), OVERLAY=OVERLAY)
    env["PATH"] = path + os.pathsep + env.get("PATH", "")
    env.update(values)
    return env


async def run_blocks(
    system: DevSystem,
    blocks: Sequence[Block],
    values: Mapping[str, str],
    *,
    allowed: Sequence[Allowed] = (),
    timeout_s: float = 90.0,
) -> Run:
    """Run `blocks` in one bash (later blocks see earlier variables); placeholder
    assignments are replaced by `values`; any failed command not `allowed` fails the test."""

    def keep(m: re.Match[str]) -> str:
        return f'{m.group(1)}: "{m.group(2)} is given by the test"'

    body = "".join(_PLACEHOLDER.sub(keep, b.text) for b in blocks)
    script = (
        "set -o pipefail\n"
        'trap \'printf "__FAILED__ %s %q\\n" "$?" "$BASH_COMMAND" >&2\' ERR\n'
        f"{body}"
        'printf "__VAR__ CLAIM=%s\\n__VAR__ NODE=%s\\n__VAR__ AGENT=%s\\n" '
        '"${CLAIM:-}" "${NODE:-}" "${AGENT:-}"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        script,
        cwd=REPO,
        env=shell_env(system, **values),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout_s):
            raw_out, raw_err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{blocks[-1].doc} blocks ran over {timeout_s}s:\n{body}") from None
    out, err = raw_out.decode(), raw_err.decode()
    run = Run(blocks[-1], proc.returncode or 0, "", "")
    out_lines = []
    for line in out.splitlines():
        if line.startswith("__VAR__ "):
            k, _, v = line[len("__VAR__ ") :].partition("=")
            run.vars[k] = v
        else:
            out_lines.append(line)
    err_lines = []
    for line in err.splitlines():
        if line.startswith("__FAILED__ "):
            rc, _, cmd = line[len("__FAILED__ ") :].partition(" ")
            run.failed.append((int(rc), cmd.replace("\\", "")))  # undo printf %q escapes
        else:
            err_lines.append(line)
    run.out, run.err = "\n".join(out_lines) + "\n", "\n".join(err_lines) + "\n"
    unexpected = [
        (rc, cmd)
        for rc, cmd in run.failed
        if not any(
            re.search(a.command, cmd) and re.search(a.stderr, run.err, re.M) for a in allowed
        )
    ]
    assert not unexpected, f"documented commands failed: {unexpected}\n{run.show()}"
    return run


def expect(run: Run, *parts: str) -> None:
    for part in parts:
        assert part in run.out, f"{part!r} missing from the output of\n{run.show()}"


# --- fixtures -----------------------------------------------------------------------------


async def _fetched_crds() -> Path:
    proc = await asyncio.create_subprocess_exec(
        str(REPO / "hack" / "fetch-crds.sh"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, f"hack/fetch-crds.sh failed:\n{err.decode()}"
    return Path(out.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
async def ops_install(kube: Kube, system: DevSystem) -> AsyncIterator[None]:
    """The overlay's Deployment, DaemonSet, Service, PDB, certificates, ... (not its webhook
    configuration), and the part-of label on the dev webhook configuration; see the module
    docstring. Removed afterwards unless the uninstall test already did."""
    crds = await _fetched_crds()
    cm = [
        str(crds / "cert-manager" / f"cert-manager.io_{k}.yaml")
        for k in ("certificates", "issuers")
    ]
    r = await kubectl(system, "apply", "--server-side", *(x for f in cm for x in ("-f", f)))
    assert r.rc == 0, r.err

    def established(crds: dict[str, Obj]) -> bool:
        names = {"certificates.cert-manager.io", "issuers.cert-manager.io"}
        return all(
            any(c["type"] == "Established" and c["status"] == "True"
                for c in crds.get(n, {}).get("status", {}).get("conditions") or [])
            for n in names
        )  # fmt: skip

    # (not `kubectl wait`: it errors out while a new CRD has no status.conditions yet)
    await wait_for(
        kube, group_path("apiextensions.k8s.io/v1", "customresourcedefinitions"), established,
        what="cert-manager's CRDs Established", within=60,
    )  # fmt: skip
    rendered = await kubectl(system, "kustomize", str(REPO / OVERLAY))
    assert rendered.rc == 0, rendered.err
    docs = [d for d in yaml.safe_load_all(rendered.out) if d]
    kept = [d for d in docs if d["kind"] != "MutatingWebhookConfiguration"]
    assert len(kept) == len(docs) - 1, "the overlay has one MutatingWebhookConfiguration"
    r = await kubectl(
        system, "apply", "--server-side", "--force-conflicts", "-f", "-",
        stdin=yaml.safe_dump_all(kept),
    )  # fmt: skip
    assert r.rc == 0, r.err
    r = await kubectl(
        system, "label", "--overwrite", "mutatingwebhookconfiguration", "instaslice-dev",
        "app.kubernetes.io/part-of=instaslice",
    )  # fmt: skip
    assert r.rc == 0, r.err
    for what in ("deployment/instaslice-webhook", "daemonset/instaslice-nodeagent"):
        r = await kubectl(
            system, "-n", "instaslice-system", "rollout", "status", what, "--timeout=90s"
        )
        assert r.rc == 0, f"{what}: {r.err}"
    yield
    for what in (
        "deployment/instaslice-webhook",
        "daemonset/instaslice-nodeagent",
        "service/instaslice-webhook",
        "poddisruptionbudget/instaslice-webhook",
    ):
        await kubectl(
            system, "-n", "instaslice-system", "delete", what, "--ignore-not-found", "--wait=false"
        )


async def _a30_node(kube: Kube) -> str:
    """An A30 node still there (the tests that delete nodes use A30s only)."""
    nodes = await kube.list(core_path("nodes"), labelSelector=f"{GPU_MODEL_LABEL}=A30-24GB")
    names: list[str] = sorted(n["metadata"]["name"] for n in nodes["items"])
    assert names, "no A30 node left"
    return names[-1]


async def _delete_stuck(kube: Kube, ns: str, pod: str, claim: str) -> None:
    """Delete the pod; with no agent to release it, its allocation stays, being deleted."""
    await kube.delete(pods_path(ns, pod))
    await wait_gone(kube, pods_path(ns), pod)

    def deleting(objs: dict[str, Obj]) -> bool:
        return "deletionTimestamp" in objs.get(claim, {}).get("metadata", {})

    await wait_for(
        kube, allocs_path(ns), deleting, what=f"{ns}/{claim} deleted, held by its finalizer",
        fieldSelector=f"metadata.name={claim}",
    )  # fmt: skip


def _claim(pod: Obj) -> str:
    claim: str = pod["metadata"]["annotations"][CLAIM_ANNOTATION]
    return claim


# --- tests --------------------------------------------------------------------------------


def test_every_block_is_exercised_or_explained() -> None:
    for doc, keys, not_run in (
        ("troubleshooting.md", TROUBLESHOOTING_KEYS, TROUBLESHOOTING_NOT_RUN),
        ("upgrade.md", UPGRADE_KEYS, UPGRADE_NOT_RUN),
    ):
        blocks = sh_blocks(doc)
        assert blocks, f"no sh blocks found in docs/{doc}"
        for b in blocks:
            assert any(k in b.text for k in [*keys, *not_run]), (
                f"docs/{doc} sh block #{b.index} is neither run by this module nor "
                f"explained as not runnable:\n{b.text}"
            )
        for k in keys:
            block(doc, k)  # each key names exactly one block


async def test_slice_that_will_not_release(kube: Kube, system: DevSystem, namespace: str) -> None:
    """Node agent down: a deleted pod's allocation stays. Each documented way out."""
    doc, ns = "troubleshooting.md", namespace
    node = await _a30_node(kube)
    names = ("s-agent", "s-force", "s-nodegone")
    for name in names:
        pod = user_pod(
            name=name, slices={"c": {"1g.6gb": 1}}, node_selector={"kubernetes.io/hostname": node}
        )
        await kube.create(pods_path(ns), pod)
    allocs: dict[str, Obj] = {}
    for name in names:
        await wait_pod_running(kube, ns, name)
        allocs[name] = await assert_holds_slices(kube, system, ns, name)
    stuck_status = block(doc, "{.metadata.deletionTimestamp}")
    problems: list[str] = []

    try:
        await _stuck_cases(kube, system, ns, node, allocs, stuck_status, problems)
    finally:
        if "nodeagent" not in system.processes:  # the teardown needs an agent to release
            system.start_agent(die_with_parent=True)
    assert not problems, "\n".join(problems)


async def _stuck_cases(
    kube: Kube,
    system: DevSystem,
    ns: str,
    node: str,
    allocs: dict[str, Obj],
    stuck_status: Block,
    problems: list[str],
) -> None:
    doc = "troubleshooting.md"
    system.stop("nodeagent")
    for name in ("s-agent", "s-force"):
        await _delete_stuck(kube, ns, name, allocs[name]["metadata"]["name"])

    # What the docs show for a stuck release (the pod is gone; its claim found by name).
    run = await run_blocks(system, [stuck_status], {"NS": ns, "POD": "s-agent"})
    claim = allocs["s-agent"]["metadata"]["name"]
    assert run.vars["CLAIM"] == claim and run.vars["NODE"] == node, run.show()
    expect(run, '["instaslice.io/release"]')
    assert re.search(r" \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", run.out), run.show()

    # Way 4, force-removing the finalizer: the allocation goes, the instance stays on the GPU.
    forced = allocs["s-force"]
    (forced_slice,) = held_slices(system, forced)
    run = await run_blocks(
        system, [stuck_status, block(doc, '"op":"test"')], {"NS": ns, "POD": "s-force"}
    )
    expect(run, '"gpuUUID"', f'"start":{forced_slice.start}', "patched")
    await wait_gone(kube, allocs_path(ns), forced["metadata"]["name"])
    still = [
        i
        for i in EmulatorControl(system.gpu_state, node).instances()
        if i.mig_uuid == forced_slice.mig_uuid
    ]
    assert still, "the GPU instance outlives the force-removed allocation (agent down)"
    # "nothing is double-booked ... (`#` in `kubectl instaslice nodes`)": the slot must not be
    # drawn free while the GPU holds the instance.
    plugin = await asyncio.create_subprocess_exec(
        "kubectl", "instaslice", "nodes", env=shell_env(system),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    slots, plugin_err = await plugin.communicate()
    assert plugin.returncode == 0, plugin_err.decode()
    row = next((ln for ln in slots.decode().splitlines() if ln.startswith(f"{node} ")), "")
    cells = row.rsplit("|", 2)[-2] if row.count("|") >= 2 else ""
    if len(cells) <= forced_slice.start or cells[forced_slice.start] == ".":
        problems.append(
            f"kubectl instaslice nodes draws {node} slot {forced_slice.start}, held by the "
            f"orphaned instance {forced_slice.mig_uuid}, as free: {row!r}"
        )

    # Way 2, the agent back: it finishes the release, and destroys the orphan (its records
    # prove it made it) after its grace period.
    system.start_agent(die_with_parent=True)
    await wait_gone(kube, allocs_path(ns), claim)
    assert_released(
        system, node, ns, claim, [h.mig_uuid for h in held_slices(system, allocs["s-agent"])]
    )
    deadline = time.monotonic() + 30
    while any(
        i.mig_uuid == forced_slice.mig_uuid
        for i in EmulatorControl(system.gpu_state, node).instances()
    ):
        assert time.monotonic() < deadline, (
            f"the orphan {forced_slice.mig_uuid} was never destroyed"
        )
        await asyncio.sleep(0.5)  # polls the emulated GPU (a file), bounded above
    assert_released(system, node, ns, forced["metadata"]["name"], [forced_slice.mig_uuid])

    # Way 3, the node is gone for good: deleting the Node lets the allocator drop the finalizer.
    system.stop("nodeagent")
    gone = allocs["s-nodegone"]["metadata"]["name"]
    await _delete_stuck(kube, ns, "s-nodegone", gone)
    run = await run_blocks(
        system,
        [stuck_status, block(doc, 'kubectl delete node "$NODE"')],
        {"NS": ns, "POD": "s-nodegone"},
    )
    expect(run, f'node "{node}" deleted')
    await wait_gone(kube, allocs_path(ns), gone)


async def test_troubleshooting_read_only_blocks(
    kube: Kube, system: DevSystem, namespace: str, ops_install: None
) -> None:
    doc = "troubleshooting.md"
    ns = namespace
    await kube.create(pods_path(ns), user_pod(name="served", slices={"main": {"1g.18gb": 1}}))
    # Pending for good: every node has 8 CPUs.
    await kube.create(
        pods_path(ns), user_pod(name="waiting", slices={"main": {"1g.10gb": 1}}, cpu="100")
    )
    served = await wait_pod_running(kube, ns, "served")
    alloc = await assert_holds_slices(kube, system, ns, "served")
    (held,) = held_slices(system, alloc)
    node = served["spec"]["nodeName"]
    waiting = await kube.get(pods_path(ns, "waiting"))
    await wait_for(
        kube, core_path("events", ns), lambda evs: bool(evs),
        what="AllocationPending on pod waiting",
        fieldSelector="involvedObject.name=waiting,reason=AllocationPending",
    )  # fmt: skip
    vars_block = block(doc, "POD=my-pod")

    # The variables resolve: claim and node of a placed pod; no node yet for a pending one.
    # Later blocks get the values this block computed (instead of running it again).
    run = await run_blocks(system, [vars_block], {"NS": ns, "POD": "served"})
    assert run.vars == {"CLAIM": _claim(served), "NODE": node, "AGENT": ""}, run.show()
    on_served = {"NS": ns, "POD": "served", "CLAIM": run.vars["CLAIM"], "NODE": node}
    run = await run_blocks(system, [vars_block], {"NS": ns, "POD": "waiting"})
    assert run.vars["CLAIM"] == _claim(waiting) and run.vars["NODE"] == "", run.show()
    on_waiting = {"NS": ns, "POD": "waiting", "CLAIM": run.vars["CLAIM"], "NODE": ""}

    run = await run_blocks(
        system, [block(doc, "kubectl instaslice nodes                  # each GPU")], on_served
    )
    expect(run, _claim(served), "Ready", f"{ns}/served 1g.18gb", "served/main", held.mig_uuid)
    expect(run, "AllocationPending", "pod/waiting", "cpu")

    lease = await kube.get(
        group_path("coordination.k8s.io/v1", "leases", "instaslice-system", "instaslice-allocator")
    )
    agents = await kube.list(
        core_path("pods", "instaslice-system"),
        labelSelector="app.kubernetes.io/name=instaslice-nodeagent",
        fieldSelector=f"spec.nodeName={node}",
    )
    (agent,) = agents["items"]
    run = await run_blocks(
        system,
        [block(doc, "get lease instaslice-allocator")],
        on_served,
        allowed=[Allowed(r"\blogs\b", NO_KUBELET)],
    )
    expect(run, lease["spec"]["holderIdentity"])
    assert run.vars["AGENT"] == f"pod/{agent['metadata']['name']}", run.show()
    assert len(run.failed) == 2, f"only the two `kubectl logs` fail (no kubelet):\n{run.show()}"

    gates = block(doc, "{.spec.schedulingGates}")
    run = await run_blocks(system, [gates], on_waiting)
    assert run.out.strip() == '[{"name":"instaslice.io/allocation"}]', run.show()
    run = await run_blocks(system, [gates], on_served)
    assert run.out.strip() == "", run.show()

    is_there = block(doc, 'get slicealloc "$CLAIM"\n')
    run = await run_blocks(system, [is_there], on_served)
    expect(run, _claim(served), node, "Ready", "1g.18gb")
    run = await run_blocks(
        system, [is_there], on_waiting,
        allowed=[Allowed(r"get slicealloc", r"NotFound|not found")],
    )  # fmt: skip
    assert len(run.failed) == 1, "NotFound: the allocator has not placed it (as documented)"

    run = await run_blocks(system, [block(doc, ".spec.renewTime")], on_served)
    expect(run, agent["metadata"]["name"], "Running")
    assert re.search(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", run.out, re.M), run.show()

    events = block(doc, 'describe pod "$POD"')
    run = await run_blocks(system, [events], on_served)
    expect(run, "SliceAllocated", "SliceReady", held.mig_uuid)
    run = await run_blocks(system, [events], on_waiting)
    expect(run, "AllocationPending", "node cpu short", "instaslice.io/claim")

    run = await run_blocks(system, [block(doc, "metadata.labels.instaslice")], on_waiting)
    lines = run.out.splitlines()
    assert lines[0] == "true", run.show()
    expect(run, CLAIM_ANNOTATION, _claim(waiting), "instaslice-dev")

    run = await run_blocks(system, [block(doc, "caBundle bytes")], on_served)
    expect(run, "instaslice-webhook-", "8443", "pods.instaslice.io caBundle bytes: LS0t")
    expect(run, "certificate.cert-manager.io/instaslice-webhook", "instaslice-webhook-tls")

    run = await run_blocks(system, [block(doc, "{range .status.conditions")], on_served)
    expect(run, "Ready=True SlicesCreated", held.mig_uuid)

    run = await run_blocks(system, [block(doc, "reason=PinnedUnschedulable")], on_served)
    assert "No resources found" in run.err, run.show()

    run = await run_blocks(system, [block(doc, "describe daemonset instaslice-nodeagent")], {})
    expect(run, "Desired Number of Nodes Scheduled", "Running", node)


async def test_driver_upgrade_drain(
    kube: Kube, system: DevSystem, namespace: str, ops_install: None
) -> None:
    ns = namespace
    await kube.create(
        deployments_path(ns),
        make_deployment("drained", replicas=1, slices={"c": {"2g.20gb": 1}}),
    )
    (pod,) = await wait_pods_running(kube, ns, 1, selector="app=drained")
    before = await assert_holds_slices(kube, system, ns, pod["metadata"]["name"])
    node = pod["spec"]["nodeName"]
    run = await run_blocks(system, [block("upgrade.md", 'kubectl drain "$NODE"')], {"NODE": node})
    expect(run, f"node/{node} cordoned", f"node/{node} drained", f"node/{node} uncordoned")
    assert not (await kube.list(allocs_path(None), labelSelector=f"{NODE_LABEL}={node}"))["items"]
    assert_released(
        system,
        node,
        ns,
        before["metadata"]["name"],
        [h.mig_uuid for h in held_slices(system, before)],
    )
    (moved,) = await wait_pods_running(kube, ns, 1, selector="app=drained")
    assert moved["spec"]["nodeName"] != node, "re-placed while the node was cordoned"
    await assert_holds_slices(kube, system, ns, moved["metadata"]["name"])
    assert not (await kube.get(core_path("nodes", name=node)))["spec"].get("unschedulable")


async def test_upgrade_then_uninstall(
    kube: Kube, system: DevSystem, namespace: str, ops_install: None
) -> None:
    """The upgrade, then the uninstall in its documented order; then InstaSlice is installed
    again (as `hack.dev` does) so the session's system stays whole."""
    doc, ns = "upgrade.md", namespace
    await kube.create(pods_path(ns), user_pod(name="holder", slices={"c": {"1g.10gb": 1}}))
    await kube.create(
        pods_path(ns), user_pod(name="gated", slices={"c": {"1g.10gb": 1}}, cpu="100")
    )
    holder = await wait_pod_running(kube, ns, "holder")
    alloc = await assert_holds_slices(kube, system, ns, "holder")

    # Other tests' namespaces may still be terminating; step 1 must see only this one.
    await wait_for(
        kube, core_path("namespaces"), lambda nss: set(nss) == {ns},
        what="no other opted-in namespace left", labelSelector=f"{ENABLED_KEY}=true",
    )  # fmt: skip

    # `kubectl diff` exits 1 when it finds differences: the overlay's webhook configuration.
    run = await run_blocks(
        system, [block(doc, 'kubectl diff -k "$OVERLAY"')], {},
        allowed=[Allowed(r"^kubectl diff", r"")],
    )  # fmt: skip
    assert [rc for rc, _ in run.failed] in ([], [1]), run.show()
    expect(run, "MutatingWebhookConfiguration", "successfully rolled out")

    run = await run_blocks(system, [block(doc, 'kubectl annotate "$ns"')], {})
    expect(run, f"namespace/{ns} annotated")
    nso = await kube.get(core_path("namespaces", name=ns))
    assert ENABLED_KEY not in nso["metadata"].get("labels", {}), nso["metadata"]
    assert ENABLED_KEY not in nso["metadata"].get("annotations", {}), nso["metadata"]

    run = await run_blocks(system, [block(doc, "custom-columns=NAMESPACE")], {})
    expect(
        run,
        f"{ns}   holder",
        holder["spec"]["nodeName"],
        "Ready",
        f"{ns}/gated instaslice.io/allocation",
    )
    for name in ("holder", "gated"):  # the operator ends them, as step 2 says
        await kube.delete(pods_path(ns, name))

    run = await run_blocks(system, [block(doc, "wait --for=delete slicealloc --all")], {})
    assert "No resources found" in run.err, run.show()
    assert_released(system, alloc["spec"]["nodeName"], ns, alloc["metadata"]["name"],
                    [h.mig_uuid for h in held_slices(system, alloc)])  # fmt: skip

    # Step 4 deletes the Deployment and the DaemonSet, which stops the webhook and the agents;
    # here they are local processes, stopped by hand.
    system.stop("webhook")
    system.stop("nodeagent")
    try:
        await _uninstall_steps_4_to_6(kube, system)
    finally:  # installed again, as hack.dev does, whatever happened
        system.install()
        system.start_webhook(die_with_parent=True)
        system.start_agent(die_with_parent=True)
        await asyncio.to_thread(system.wait_ready)

    # A pod gets its slice as before.
    await kube.patch(
        core_path("namespaces", name=ns), {"metadata": {"annotations": {ENABLED_KEY: "true"}}}
    )
    await wait_opted_in(kube, ns)
    await kube.create(pods_path(ns), user_pod(name="again", slices={"c": {"1g.10gb": 1}}))
    await wait_pod_running(kube, ns, "again")
    await assert_holds_slices(kube, system, ns, "again")


async def _uninstall_steps_4_to_6(kube: Kube, system: DevSystem) -> None:
    doc = "upgrade.md"
    run = await run_blocks(
        system, [block(doc, "delete mutatingwebhookconfigurations")], {}, timeout_s=150
    )
    expect(run, "instaslice-dev", "deleted", 'namespace "instaslice-system" deleted')
    for args in (
        ("crd", "sliceallocations.instaslice.io", "mignodes.instaslice.io"),
        ("namespace", "instaslice-system"),
        ("mutatingwebhookconfigurations,validatingadmissionpolicies,"
         "validatingadmissionpolicybindings", "-l", "app.kubernetes.io/part-of=instaslice"),
    ):  # fmt: skip
        r = await kubectl(system, "get", *args, "--ignore-not-found", "-o", "name")
        assert r.rc == 0 and r.out.strip() == "", f"left after the uninstall: {r.out}{r.err}"

    await run_blocks(system, [block(doc, "--subresource=status")], {})
    nodes = (await kube.list(core_path("nodes")))["items"]
    for n in nodes:
        left = [
            r for k in ("capacity", "allocatable") for r in n["status"].get(k, {})
            if r.startswith("instaslice.io/")
        ]  # fmt: skip
        assert not left, f"{n['metadata']['name']} still advertises {left}"
        # Step 6, on the emulated node: no instance and no CDI file of InstaSlice's left.
        name = n["metadata"]["name"]
        assert not EmulatorControl(system.gpu_state, name).instances(), f"{name}: instances left"
        assert not cdi_files(system, name), f"{name}: CDI files left"
