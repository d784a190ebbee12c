"""Fixtures for tests against the real local control plane (hack/cluster).

- `control_plane` (session): one etcd + kube-apiserver + scheduler + KCM + KWOK per pytest
  run, in a pytest tmp dir (kept afterwards, logs included). With INSTASLICE_KUBECONFIG set
  (e.g. `.dev/kubeconfig` after `make cluster-up`) the running one is reused and left running.
- `kube_api` (session): a kubernetes_asyncio ApiClient authenticated as cluster admin.
- `namespace` (function): a fresh namespace whose `default` ServiceAccount exists (pods can be
  created at once); deleted after the test.
- `agent_kube` (session): a `common.kubeapi.Kube` with InstaSlice's CRDs, namespace, agent
  RBAC and policies installed; `alloc_ns` (function): `namespace`, whose leftover
  SliceAllocations lose their finalizer afterwards so it can go.
- `kube` and `ns`: the tier's defaults, `agent_kube` and `alloc_ns`; a module that needs
  another client or namespace defines its own fixture of that name.
KWOK GPU nodes: `await hack.cluster.nodes.create_nodes(kube_api, load_spec(path))`.

Every async test under tests/integration runs in the session event loop, the loop the
session-scoped `kube_api` lives in (aiohttp sessions cannot cross loops). On a failing test
the tail of every control-plane log is attached to the report, of the session's control plane
and of any private one the test's fixtures started. The allocator the tests start
(allocator_fixtures.AllocatorEnv) runs with `--avoid-creates-in-flight N` when
INSTASLICE_TEST_AVOID_CREATES_IN_FLIGHT=N is set (tests/support.py).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from common.kubeapi import Kube, harden, instaslice_path
from hack.cluster import BinariesMissing, ControlPlane
from tests.support import log_tails, on_the_session_loop

_HERE = Path(__file__).parent
_CP_KEY = pytest.StashKey[ControlPlane]()
_LOG_TAIL_LINES = 25


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    on_the_session_loop(items, _HERE)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if not report.failed or _HERE not in Path(str(item.path)).parents:
        return report
    shared = item.config.stash.get(_CP_KEY, None)
    # the session's control plane, and any private one the test started (a fixture value)
    cps = [] if shared is None else [shared]
    for v in getattr(item, "funcargs", {}).values():
        if isinstance(v, ControlPlane) and all(v is not c for c in cps):
            cps.append(v)
    for cp in cps:
        # which component exited (a dead controller manager deletes no namespace) is the
        # first thing to know; its log's tail then says why
        states = ", ".join(f"{p.name} {'up' if p.alive() else 'EXITED'}" for p in cp.processes)
        parts = [
            f"logs dir: {cp.logs_dir}",
            f"processes: {states}",
            *log_tails(cp.logs_dir.glob("*.log"), _LOG_TAIL_LINES),
        ]
        title = (
            "control plane logs"
            if cp is shared
            else f"private control plane logs ({cp.workdir.name})"
        )
        report.sections.append((title, "\n".join(parts)))
    return report


@pytest.fixture(scope="session")
def control_plane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    reuse = os.environ.get("INSTASLICE_KUBECONFIG")
    if reuse:
        cp = ControlPlane.from_kubeconfig(Path(reuse))
        request.config.stash[_CP_KEY] = cp
        yield cp
        return
    try:
        started = ControlPlane.start(tmp_path_factory.mktemp("control-plane"))
    except BinariesMissing as e:
        pytest.fail(str(e), pytrace=False)
    with started as cp:
        request.config.stash[_CP_KEY] = cp
        yield cp


@pytest.fixture(scope="session")
async def kube_api(control_plane: ControlPlane) -> AsyncIterator[client.ApiClient]:
    api = harden(await config.new_client_from_config(config_file=str(control_plane.kubeconfig)))
    async with api:
        yield api


async def _wait_default_service_account(core: client.CoreV1Api, namespace: str) -> None:
    only_default = "metadata.name=default"
    sas = await core.list_namespaced_service_account(namespace, field_selector=only_default)
    if sas.items:
        return
    async with watch.Watch() as w:
        async for _ in w.stream(
            core.list_namespaced_service_account,
            namespace,
            field_selector=only_default,
            resource_version=sas.metadata.resource_version,
            timeout_seconds=30,
        ):
            return
    raise TimeoutError(f"kube-controller-manager made no default ServiceAccount in {namespace}")


@pytest.fixture
async def namespace(kube_api: client.ApiClient) -> AsyncIterator[str]:
    core = client.CoreV1Api(kube_api)
    ns = await core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(generate_name="it-"))
    )
    name: str = ns.metadata.name
    try:
        await _wait_default_service_account(core, name)
        yield name
    finally:
        try:
            await core.delete_namespace(name)
        except ApiException as e:
            if e.status not in (404, 409):  # gone, or already terminating
                raise


@pytest.fixture(scope="session")
async def agent_kube(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    from tests.integration.agent_fixtures import install_instaslice

    async with await Kube.connect(str(control_plane.kubeconfig)) as k:
        await install_instaslice(k)
        yield k


@pytest.fixture
async def alloc_ns(agent_kube: Kube, namespace: str) -> AsyncIterator[str]:
    yield namespace
    path = instaslice_path("sliceallocations", namespace)
    for a in (await agent_kube.list(path)).get("items", []):
        if a["metadata"].get("finalizers"):
            patch = {"metadata": {"finalizers": None}}
            await agent_kube.patch(f"{path}/{a['metadata']['name']}", patch)


@pytest.fixture(scope="session")
def kube(agent_kube: Kube) -> Kube:
    return agent_kube


@pytest.fixture
def ns(alloc_ns: str) -> str:
    return alloc_ns
