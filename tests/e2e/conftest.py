"""Fixtures for the end-to-end tests: the whole InstaSlice system on the local control plane.

- `system` (session): `hack.dev.DevSystem` — etcd, kube-apiserver (RBAC), scheduler, KCM and
  KWOK; InstaSlice's CRDs, RBAC and admission policies; the webhook/allocator process and one
  emulated node-agent process for every KWOK GPU node of `SPEC`; in a pytest tmp dir (kept
  afterwards, logs in `<dir>/logs/`), torn down at the end of the session.
- `kube` (session): a `common.kubeapi.Kube` client as cluster admin.
- `namespace` (function): a fresh namespace opted in to InstaSlice, returned once the opt-in
  label is mirrored; deleted after the test, which then waits until every SliceAllocation
  of it is gone, so the next test starts with the GPUs free.
- `plain_namespace` (function): a namespace that never opted in.
- `own_system`, `own_kube` (module), `own_ns` (function): the same three for a module whose
  tests need nodes or settings the shared system has not (MIG off, Kueue, an autoscaled
  group): a system of its own, `DevSystem.up` of the module's `OWN_SPEC`, up for the module's
  tests only and torn down after them. A module may define its own `own_system` (e.g.
  parametrized) and still use the other two.

`SPEC` is small and heterogeneous on purpose (2 x H100-80GB and 1 x H200-141GB with 2 GPUs,
1 x A100-40GB with 1 GPU, 3 x A30-24GB with 1 GPU for the tests that delete a node, and
1 x X10-120GB with 1 GPU: a synthetic 10-slot model in no catalog, emulated from its table
file `hack/specs/models/x10-120gb.yaml`, whose 3g.36gb, 4g.60gb and 8g.120gb no catalog model
offers), so
tests reach exhaustion, pick a GPU model by profile, and can lose a node without starving the
others. The node agent destroys instances whose allocation vanished (records prove they are
its own) after 5 s instead of 60 s, so the documented force-removal case ends within a test,
and its Lease lasts 10 s instead of 40 s, so a stopped agent's nodes are left out within one.
Nodes carry `nvidia.com/mig.capable=true`, the label InstaSlice's DaemonSet selects. On a
failing test the tail of every log is attached to the report. The allocator runs with
`--avoid-creates-in-flight N` when INSTASLICE_TEST_AVOID_CREATES_IN_FLIGHT=N is set
(tests/support.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from common.constants import ENABLED_KEY, WHOLE_GPU_KEY
from common.kubeapi import ApiError, Kube, core_path
from hack.cluster import BinariesMissing
from hack.cluster.nodes import parse_spec
from hack.cluster.realnode import RealNodeError
from hack.dev import DevSystem
from tests.e2e.helpers import RELEASE_TIMEOUT_S, allocs_path, wait_opted_in
from tests.support import avoid_creates_in_flight, log_tails, on_the_session_loop, wait_for

_HERE = Path(__file__).parent
X10_TABLE = _HERE.parents[1] / "hack" / "specs" / "models" / "x10-120gb.yaml"
_SYSTEMS_KEY = pytest.StashKey[list[DevSystem]]()
_LOG_TAIL_LINES = 30
_MIG_CAPABLE = {"nvidia.com/mig.capable": "true"}
_NODE = {"cpu": "8", "memory": "32Gi", "pods": 110, "labels": _MIG_CAPABLE}
AGENT_LEASE_S = 10  # so a stopped agent's nodes are left out within a test (default 40)
AGENT_ARGS = ("--gc-grace-s=5", "--gc-period-s=3", f"--lease-duration-s={AGENT_LEASE_S}")
SPEC: dict[str, Any] = {
    "nodes": [
        {"prefix": "h100", "count": 2, "gpus": 2, "model": "H100-80GB", **_NODE},
        {"prefix": "h200", "count": 1, "gpus": 2, "model": "H200-141GB", **_NODE},
        {"prefix": "a100", "count": 1, "gpus": 1, "model": "A100-40GB", **_NODE},
        {"prefix": "a30", "count": 3, "gpus": 1, "model": "A30-24GB", **_NODE},
        {"prefix": "x10", "count": 1, "gpus": 1, "modelFile": str(X10_TABLE), **_NODE},
    ]
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    on_the_session_loop(items, _HERE)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    systems = item.config.stash.get(_SYSTEMS_KEY, [])
    if report.failed and _HERE in Path(str(item.path)).parents:
        for system in systems:
            dirs = [system.logs] + ([system.real.logs] if system.real is not None else [])
            logs = (log for d in dirs for log in d.glob("*.log"))
            parts = [f"logs dirs: {', '.join(map(str, dirs))}", *log_tails(logs, _LOG_TAIL_LINES)]
            report.sections.append((f"InstaSlice e2e logs ({system.dir.name})", "\n".join(parts)))
    return report


def attach_logs(config: pytest.Config, system: DevSystem) -> None:
    """A failing e2e test's report carries the tail of every log of `system`."""
    config.stash.setdefault(_SYSTEMS_KEY, []).append(system)


def detach_logs(config: pytest.Config, system: DevSystem) -> None:
    systems = config.stash.get(_SYSTEMS_KEY, [])
    if system in systems:
        systems.remove(system)


@pytest.fixture(scope="session")
def system(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevSystem]:
    with running_system(request.config, tmp_path_factory.mktemp("e2e"), SPEC) as started:
        yield started


@contextlib.contextmanager
def running_system(
    config: pytest.Config, where: Path, spec: dict[str, Any], **up: Any
) -> Iterator[DevSystem]:
    """`DevSystem.up` of `spec` with the e2e agents' settings (`up`: more of its keywords;
    the allocator gets `--avoid-creates-in-flight` from INSTASLICE_TEST_AVOID_CREATES_IN_FLIGHT,
    tests/support.py, unless `webhook_args` has its own; `agent_args` are added to the
    agents'); its logs go into a failing test's report; always torn down."""
    webhook_args = list(up.pop("webhook_args", ()))
    agent_args = [*AGENT_ARGS, *up.pop("agent_args", ())]
    avoid = avoid_creates_in_flight()
    if avoid and not any(a.startswith("--avoid-creates-in-flight") for a in webhook_args):
        webhook_args.append(f"--avoid-creates-in-flight={avoid}")
    up["webhook_args"] = webhook_args
    try:
        started = DevSystem.up(
            where, parse_spec(spec), die_with_parent=True, agent_args=agent_args, **up
        )
    except (BinariesMissing, RealNodeError) as e:
        pytest.fail(str(e), pytrace=False)
    attach_logs(config, started)
    try:
        yield started
    finally:
        detach_logs(config, started)
        started.down()


@pytest.fixture(scope="session")
async def kube(system: DevSystem) -> AsyncIterator[Kube]:
    async with await Kube.connect(str(system.kubeconfig)) as k:
        yield k


@pytest.fixture(scope="module")
def own_system(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DevSystem]:
    """The test module's own system: its `OWN_SPEC` (a cluster spec dict), in a tmp dir named
    after the module; its agents get the module's `OWN_AGENT_ARGS` too, if it has any."""
    spec: dict[str, Any] = request.module.OWN_SPEC
    extra = tuple(getattr(request.module, "OWN_AGENT_ARGS", ()))
    where = tmp_path_factory.mktemp(
        request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    )
    with running_system(request.config, where, spec, agent_args=extra) as started:
        yield started


@pytest.fixture(scope="module")
async def own_kube(own_system: DevSystem) -> AsyncIterator[Kube]:
    async with await Kube.connect(str(own_system.kubeconfig)) as k:
        yield k


@pytest.fixture
async def own_ns(own_kube: Kube) -> AsyncIterator[str]:
    """`namespace`, on the module's own system."""
    async with opted_in_namespace(own_kube) as name:
        yield name


async def _new_namespace(kube: Kube, prefix: str, annotations: dict[str, str]) -> str:
    ns = await kube.create(
        core_path("namespaces"),
        {"metadata": {"generateName": prefix, "annotations": annotations}},
    )
    name: str = ns["metadata"]["name"]
    # Pods need the namespace's default ServiceAccount (made by KCM) to be admitted.
    await wait_for(
        kube,
        core_path("serviceaccounts", name),
        lambda sas: "default" in sas,
        what=f"ServiceAccount {name}/default",
        within=30,
    )
    return name


async def _delete_namespace(kube: Kube, name: str, *, wait_released: bool) -> None:
    try:
        await kube.delete(core_path("namespaces", name=name))
    except ApiError as e:
        if not (e.not_found or e.conflict):
            raise
    if wait_released:
        await wait_for(
            kube,
            allocs_path(name),
            lambda allocs: not allocs,
            what=f"every SliceAllocation of deleted namespace {name} gone",
            within=RELEASE_TIMEOUT_S,
        )


@contextlib.asynccontextmanager
async def opted_in_namespace(kube: Kube, prefix: str = "e2e-") -> AsyncIterator[str]:
    """A fresh namespace (named `prefix`...) opted in to InstaSlice, once the opt-in is
    mirrored; deleted at the end, which then waits until every SliceAllocation of it is gone."""
    name = await _new_namespace(kube, prefix, {ENABLED_KEY: "true"})
    await wait_opted_in(kube, name)
    try:
        yield name
    finally:
        await _delete_namespace(kube, name, wait_released=True)


@contextlib.asynccontextmanager
async def whole_gpu_namespace(kube: Kube, prefix: str) -> AsyncIterator[str]:
    """`opted_in_namespace`, also opted in to whole GPUs (`nvidia.com/gpu` is rewritten), once
    both annotations are mirrored into labels."""
    name = await _new_namespace(kube, prefix, {ENABLED_KEY: "true", WHOLE_GPU_KEY: "true"})
    try:
        await wait_opted_in(kube, name)
        await wait_for(
            kube,
            core_path("namespaces"),
            lambda nss: (
                (nss.get(name, {}).get("metadata", {}).get("labels") or {}).get(WHOLE_GPU_KEY)
                == "true"
            ),
            what="whole-gpu label mirrored",
            within=30,
            fieldSelector=f"metadata.name={name}",
        )
        yield name
    finally:
        await _delete_namespace(kube, name, wait_released=True)


@pytest.fixture
async def namespace(kube: Kube) -> AsyncIterator[str]:
    async with opted_in_namespace(kube) as name:
        yield name


@pytest.fixture
async def plain_namespace(kube: Kube) -> AsyncIterator[str]:
    name = await _new_namespace(kube, "e2e-plain-", {})
    try:
        yield name
    finally:
        await _delete_namespace(kube, name, wait_released=False)
