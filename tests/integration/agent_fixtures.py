"""Helpers and fixtures for the node agent's integration tests (tests/integration/test_nodeagent*).

- `install_instaslice(kube)`: InstaSlice's CRDs (Established) and the node agent's RBAC and
  ValidatingAdmissionPolicies from manifests/, created or replaced, so any test may call it.
- `GpuNode`: one emulated node: its emulator state, a KWOK Node object, its CDI dir.
- `running_agent(...)`: the agent in this process (`nodeagent.main.serve`), cancelled on exit;
  `AgentProcess`: the agent as a subprocess, for crash tests (SIGKILL, no cleanup at all).
- `slice_allocation(...)`: a SliceAllocation as the allocator writes it.
- `cdi_inject(...)`: the CDI reference library (hack/cdi-check) injecting a device into a
  sample OCI spec.
- `had_its_chance(agent, ...)`: until the agent's next garbage collection passes (and
  maintenance steps) have ended, before a test asserts that nothing happened.
- `eventually(...)`: poll a condition with a deadline (tests may poll; the agent never does;
  tests/support.py, shared with the e2e tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml

from common.allocation import build_allocation
from common.constants import NODE_LABEL
from common.kubeapi import ApiError, Kube, core_path, group_path, instaslice_path
from common.objects import SliceSpec
from hack.cluster.nodes import NodeGroup, node_manifest
from nodeagent.agent import NodeAgent
from nodeagent.emulator import EmulatorControl, provision
from nodeagent.main import serve
from nodeagent.settings import Settings
from tests.support import eventually as eventually  # re-exported: the suite's poll
from tests.support import passes

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "instaslice-system"
Obj = dict[str, Any]

# kind → (group/version path builder, plural, namespaced)
_KINDS: dict[str, tuple[str, str, bool]] = {
    "CustomResourceDefinition": ("apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    "Namespace": ("v1", "namespaces", False),
    "ServiceAccount": ("v1", "serviceaccounts", True),
    "ClusterRole": ("rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ValidatingAdmissionPolicy": (
        "admissionregistration.k8s.io/v1",
        "validatingadmissionpolicies",
        False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}


def _path(doc: Obj, name: bool = True) -> str:
    gv, plural, namespaced = _KINDS[doc["kind"]]
    ns = doc["metadata"].get("namespace", NAMESPACE) if namespaced else None
    n = doc["metadata"]["name"] if name else None
    return core_path(plural, ns, n) if gv == "v1" else group_path(gv, plural, ns, n)


async def apply(kube: Kube, doc: Obj) -> Obj:
    """Create, or replace what is there (idempotent; other tests may apply the same)."""
    try:
        return await kube.create(_path(doc, name=False), doc)
    except ApiError as exc:
        if exc.status != 409:
            raise
    for _ in range(5):
        current = await kube.get(_path(doc))
        body = json.loads(json.dumps(doc))
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        try:
            return await kube.replace(_path(doc), body)
        except ApiError as exc:
            if exc.status != 409:
                raise
    raise RuntimeError(f"could not replace {doc['kind']} {doc['metadata']['name']}")


def manifest_docs(directory: Path) -> list[Obj]:
    docs: list[Obj] = []
    for f in sorted(directory.glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


async def install_instaslice(kube: Kube) -> None:
    """CRDs (waited for Established), the namespace, and the agent's RBAC and policies."""
    crds = manifest_docs(ROOT / "manifests" / "base" / "crds")
    for doc in crds:
        await apply(kube, doc)
    for doc in crds:

        async def established(d: Obj = doc) -> bool:
            got = await kube.get(_path(d))
            conds = got.get("status", {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

        await eventually(established, within=30, what=f"CRD {doc['metadata']['name']}")
    await apply(kube, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    for doc in manifest_docs(ROOT / "manifests" / "base" / "nodeagent"):
        if doc["kind"] != "DaemonSet":
            await apply(kube, doc)


# --- emulated GPU nodes ----------------------------------------------------------------------


@dataclass
class GpuNode:
    name: str
    root: Path  # emulator state dir, checkpoints; CDI dirs under root/cdi/<node>/cdi
    models: Sequence[str]

    @property
    def emu(self) -> EmulatorControl:
        return EmulatorControl(self.root / "gpus", self.name)

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi" / self.name / "cdi"

    @property
    def checkpoint(self) -> Path:
        return self.root / "gpus" / f"{self.name}.agent.json"

    def gpu_uuid(self, index: int) -> str:
        return self.emu.state().gpus[index].uuid

    def instances(self) -> list[tuple[int, str, int, int, int | None]]:
        """(gpu, profile, start, size, ci id) of every instance, sorted."""
        return sorted(
            (r.gpu_index, r.profile_name, r.start, r.size, r.ci_id) for r in self.emu.instances()
        )

    def cdi_files(self) -> list[str]:
        return sorted(p.name for p in self.cdi_dir.glob("*.json")) if self.cdi_dir.exists() else []


async def gpu_node(
    kube: Kube,
    tmp: Path,
    models: Sequence[str],
    prefix: str = "na",
    mig_mode: Literal["enabled", "disabled"] = "enabled",
) -> GpuNode:
    """Provision an emulated node and create its (KWOK) Node object."""
    name = f"{prefix}{secrets.token_hex(3)}"
    node = GpuNode(name=name, root=tmp, models=models)
    provision(tmp / "gpus", name, list(models), mig_mode)
    group = NodeGroup(prefix=name, count=1, gpus=len(models), model=models[0])
    manifest = node_manifest(group, 0)
    manifest["metadata"]["name"] = name
    manifest["metadata"]["labels"]["kubernetes.io/hostname"] = name
    await kube.create(core_path("nodes"), manifest)
    return node


def agent_settings(nodes: Sequence[GpuNode], kubeconfig: Path, **overrides: Any) -> Settings:
    root = nodes[0].root
    base = Settings(
        nodes=tuple(n.name for n in nodes),
        kubeconfig=str(kubeconfig),
        emulate=True,
        emu_state=root / "gpus",
        cdi_root=root / "cdi",
        namespace=NAMESPACE,
        gc_grace_s=60.0,
        gc_period_s=0.5,
        lease_duration_s=8,
        release_backoff_s=0.1,
        release_backoff_max_s=0.4,
        health_timeout_ms=100,
    )
    return replace(base, **overrides)


@contextlib.asynccontextmanager
async def running_agent(settings: Settings, **serve_kw: Any) -> AsyncIterator[dict[str, NodeAgent]]:
    """The agent serving `settings.nodes` in this event loop, up and started (`serve_kw`:
    `nodeagent.main.serve`'s injected host facts)."""
    agents: dict[str, NodeAgent] = {}
    up = asyncio.Event()

    def started(a: dict[str, NodeAgent]) -> None:
        agents.update(a)
        up.set()

    task = asyncio.create_task(
        serve(settings, started=started, **serve_kw), name="nodeagent-under-test"
    )
    try:
        waiter = asyncio.create_task(up.wait())
        done, _ = await asyncio.wait({task, waiter}, timeout=30, return_when="FIRST_COMPLETED")
        if task in done:
            waiter.cancel()
            task.result()  # raises what serve() raised
            raise AssertionError("serve() returned early")
        if waiter not in done:
            waiter.cancel()
            raise AssertionError("node agent did not start in 30 s")
        for a in agents.values():
            async with asyncio.timeout(30):
                await a.started.wait()
        yield agents
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def had_its_chance(
    agent: NodeAgent,
    more: int = 2,
    *,
    maintenance: bool = False,
    not_before: float = 0.0,
    within: float = 30.0,
) -> None:
    """Until `more` garbage collection passes (and, with `maintenance`, as many maintenance
    steps, which each pass kicks while a mode change is asked) have ended: what the agent
    would do by then it has done, so a test may assert that nothing happened.
    `not_before`: as `tests.support.passes` (serve() takes no clock)."""
    counts = [lambda: agent.gc_passes]
    if maintenance:
        counts.append(lambda: agent.maint.steps)
    await passes(*counts, more=more, not_before=not_before, within=within, what="agent passes")


@dataclass
class AgentProcess:
    """`instaslice-nodeagent` as a child process (crash tests kill it with SIGKILL)."""

    args: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> AgentProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nodeagent.main", *self.args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        out.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM and wait: the graceful path."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def process_args(settings: Settings) -> list[str]:
    assert settings.emu_state is not None and settings.cdi_root is not None
    return [
        "--kubeconfig", str(settings.kubeconfig),
        "--nodes", ",".join(settings.nodes),
        "--emulate", "--emu-state", str(settings.emu_state),
        "--cdi-root", str(settings.cdi_root),
        "--namespace", settings.namespace,
        "--gc-grace-s", str(settings.gc_grace_s),
        "--gc-period-s", str(settings.gc_period_s),
        "--lease-duration-s", str(settings.lease_duration_s),
        "--log-level", "debug",
    ]  # fmt: skip


# --- allocations ---------------------------------------------------------------------------


def slice_allocation(
    namespace: str,
    node: GpuNode,
    slices: Sequence[tuple[str, str, int, int, int]],
    claim: str | None = None,
) -> Obj:
    """`slices`: (container, profile, gpu index, start, size), as the allocator places them."""
    claim = claim or f"c{secrets.token_hex(6)}"
    pod = {"metadata": {"name": f"pod-{claim}", "uid": f"uid-{claim}"}}
    specs: list[SliceSpec] = [
        {
            "container": c,
            "profile": p,
            "gpuUUID": node.gpu_uuid(g),
            "gpuIndex": g,
            "start": s,
            "size": z,
        }
        for c, p, g, s, z in slices
    ]
    obj = build_allocation(namespace=namespace, claim=claim, pod=pod, node=node.name, slices=specs)
    obj["metadata"]["ownerReferences"] = []  # no real pod behind it; nothing to GC it
    return obj


async def create_allocation(kube: Kube, obj: Obj) -> Obj:
    """Create it, as the allocator does: no status (the agent reads that as Pending). A
    separate `Pending` status patch, as this helper once sent, could land after the agent's
    `Ready` and leave the record Pending with its slices made (seen once the agent got
    faster: tests/integration/test_nodeagent.py::test_one_process_serves_many_nodes)."""
    meta = obj["metadata"]
    return await kube.create(instaslice_path("sliceallocations", meta["namespace"]), obj)


async def get_allocation(kube: Kube, namespace: str, name: str) -> Obj | None:
    try:
        return await kube.get(instaslice_path("sliceallocations", namespace, name))
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


async def wait_phase(kube: Kube, obj: Obj, phase: str, within: float = 20) -> Obj:
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]

    async def check() -> Obj | None:
        got = await get_allocation(kube, ns, name)
        if got and (got.get("status") or {}).get("phase") == phase:
            return got
        return None

    return await eventually(check, within=within, what=f"{ns}/{name} {phase}")


async def delete_allocation(kube: Kube, obj: Obj, wait: bool = False) -> None:
    """Delete it (the agent's finalizer keeps it until its slices are released); `wait`:
    until it is gone."""
    meta = obj["metadata"]
    await kube.delete(instaslice_path("sliceallocations", meta["namespace"], meta["name"]))
    if wait:
        await wait_gone(kube, obj)


async def wait_gone(kube: Kube, obj: Obj, within: float = 20) -> None:
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]

    async def check() -> bool:
        return await get_allocation(kube, ns, name) is None

    await eventually(check, within=within, what=f"{ns}/{name} deleted")


async def pod_events(kube: Kube, namespace: str, pod: str) -> list[Obj]:
    got = await kube.list(
        core_path("events", namespace), fieldSelector=f"involvedObject.name={pod}"
    )
    return list(got.get("items", []))


async def mig_node(kube: Kube, node: str) -> Obj | None:
    try:
        return await kube.get(instaslice_path("mignodes", name=node))
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


async def mig_node_warning(kube: Kube, node: str, reason: str) -> Obj:
    """The first Warning event `reason` on MigNode `node` (the agent's are best effort,
    written in the background: waited for)."""

    async def event() -> Obj | None:
        got = await kube.list(
            core_path("events", "default"), fieldSelector=f"involvedObject.name={node}"
        )
        return next((e for e in got["items"] if e["reason"] == reason), None)

    found: Obj = await eventually(event, what=f"{reason} event")
    assert found["type"] == "Warning" and found["involvedObject"]["kind"] == "MigNode", found
    return found


def node_label_selector(node: str) -> str:
    return f"{NODE_LABEL}={node}"


# --- the CDI reference library ---------------------------------------------------------------


@cache
def cdi_check_binary() -> Path:
    proc = subprocess.run(
        [str(ROOT / "hack" / "cdi-check" / "build.sh")], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"hack/cdi-check/build.sh failed:\n{proc.stderr}")
    return Path(proc.stdout.strip().splitlines()[-1])


def cdi_inject(spec_dirs: Sequence[Path], devices: Sequence[str]) -> Obj:
    """Run the CDI library: inject `devices` into a sample OCI spec. Returns
    {"spec": ..., "errors": {file: [...]}, "unresolved": [...], "rc": N}."""
    args = [str(cdi_check_binary())]
    for d in spec_dirs:
        args += ["--spec-dir", str(d)]
    for dev in devices:
        args += ["--device", dev]
    proc = subprocess.run(args, capture_output=True, text=True, check=False, timeout=60)
    if not proc.stdout.strip():
        raise RuntimeError(f"cdi-check printed nothing (rc {proc.returncode}): {proc.stderr}")
    out: Obj = json.loads(proc.stdout)
    out["rc"] = proc.returncode
    return out


def injected_env(result: Obj) -> dict[str, str]:
    env = result["spec"]["process"]["env"]
    return dict(e.split("=", 1) for e in env)


def injected_devices(result: Obj) -> list[str]:
    return sorted(d["path"] for d in (result["spec"].get("linux") or {}).get("devices") or [])


async def agent_pod_token(kube: Kube, node: str) -> tuple[Obj, str]:
    """A pod of the agent's ServiceAccount placed on `node` (as the DaemonSet's would be) and
    a token bound to it: the production identity, whose user info carries the node's name."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"agent-{secrets.token_hex(3)}", "namespace": NAMESPACE},
        "spec": {
            "serviceAccountName": "instaslice-nodeagent",
            "nodeName": node,
            "containers": [{"name": "agent", "image": "registry.k8s.io/pause:3.10"}],
        },
    }
    created = await kube.create(core_path("pods", NAMESPACE), pod)
    ref = {"apiVersion": "v1", "kind": "Pod", "name": created["metadata"]["name"],
           "uid": created["metadata"]["uid"]}  # fmt: skip
    sa = core_path("serviceaccounts", NAMESPACE, "instaslice-nodeagent") + "/token"
    bound = await kube.create(
        sa,
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
         "spec": {"expirationSeconds": 600, "boundObjectRef": ref}},
    )  # fmt: skip
    return created, str(bound["status"]["token"])
