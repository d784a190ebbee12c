"""`instaslice-nodeagent`: the node daemon's entry point (docs/contract.md §6).

    instaslice-nodeagent [--kubeconfig PATH] (--node NAME | --nodes a,b,c)
        [--emulate --emu-state DIR] [--cdi-dir DIR | --cdi-root DIR] [--state-dir DIR]
        [--namespace NS] [--binding-mode env|device-plugin] [--discover-only [--output text|json]]
        [--gc-grace-s S] ...

Wiring only: parse settings, pick the NVML module (real `pynvml`, or one `EmulatedNvml` per
node), read the host facts the CDI specs need, connect to the API server, and run one
`NodeAgent` per node plus one SliceAllocation informer in a TaskGroup. SIGTERM/SIGINT cancel
it; every resource closes in its `finally` (an NVML call in flight finishes first).
`serve(settings)` is the Python entry point (tests and `make dev-up` call it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from common import buildinfo
from common.catalog import load_catalog
from common.clock import stoppable
from common.constants import AGENT_LEASE_DURATION_S, NODE_LABEL, AllocationMode, BindingMode
from common.kubeapi import (
    EventType,
    Informer,
    Kube,
    Obj,
    connected,
    core_path,
    instaslice_path,
    lean,
)
from common.logsetup import LEVELS, LogLevel, configure_logging
from common.metricsauth import MetricsAuth, add_flags, limits_from
from common.objects import node_label_value
from nodeagent import cdi
from nodeagent.agent import NodeAgent
from nodeagent.binding import Binding, EnvBinding
from nodeagent.device import HealthHub, NodeGpus
from nodeagent.discover import discover, render, report
from nodeagent.dra.informers import dra_claims, dra_slices
from nodeagent.dra.plugin import Sockets, serving
from nodeagent.maintenance import Reset, ResetRefused, command_reset
from nodeagent.metrics import AgentMetrics, health_server
from nodeagent.nvml import NvmlModule, real_nvml
from nodeagent.report import base_spec_condition, capacity, slice_info
from nodeagent.settings import Settings

log = structlog.get_logger("nodeagent")
MAX_IN_SELECTOR = 100
# Threads for the NVML calls of a process serving many emulated nodes: enough that emulated
# create/destroy latencies (sleeps) on different nodes overlap, few enough not to thrash the GIL.
SHARED_NVML_THREADS = 32
# (node, driver version, GPU minors) -> device numbering, base NVIDIA CDI spec, its condition
CdiFacts = Callable[[str, str, Sequence[int]], tuple[cdi.DeviceNumbers, Obj | None, Obj]]


def build_parser() -> argparse.ArgumentParser:
    """The command line; docs/configuration.md documents every flag (tests/unit/test_docs.py)."""
    p = argparse.ArgumentParser(
        prog="instaslice-nodeagent",
        description="InstaSlice node agent: creates and destroys MIG slices for the "
        "SliceAllocations bound to its node(s).",
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--node", help="the node this agent serves (default: $NODE_NAME)")
    who.add_argument("--nodes", help="comma-separated nodes (with --emulate: many in one process)")
    p.add_argument("--emulate", action="store_true", help="use the NVML emulator")
    p.add_argument("--emu-state", type=Path, help="emulator state dir (one <node>.json per node)")
    cdi_dest = p.add_mutually_exclusive_group()
    cdi_dest.add_argument("--cdi-dir", type=Path, default=Path("/var/run/cdi"))
    cdi_dest.add_argument("--cdi-root", type=Path, help="CDI dir of node N is ROOT/N/cdi")
    p.add_argument(
        "--state-dir",
        type=Path,
        help="checkpoint dir (default /var/lib/instaslice; the emulator state dir under --emulate)",
    )
    p.add_argument("--namespace", default="instaslice-system", help="namespace of the Leases")
    p.add_argument(
        "--binding-mode",
        "--binding",  # the older spelling; --binding-mode is the webhook's too
        dest="binding",
        choices=[m.value for m in BindingMode],
        default=BindingMode.ENV.value,
        help="how a container gets its slice (docs/binding.md); must match the webhook's "
        "--binding-mode (the manifests set both from the ConfigMap instaslice-config)",
    )
    p.add_argument(
        "--allocation-mode",
        choices=[m.value for m in AllocationMode],
        default=AllocationMode.GATES.value,
        help="gates, or dra: publish this node's ResourceSlices and serve the kubelet's DRA "
        "plugin API (docs/dra.md); the manifests set it, for every component, from the "
        "ConfigMap instaslice-config",
    )
    p.add_argument(
        "--kubelet-registry-dir",
        type=Path,
        default=Path("/var/lib/kubelet/plugins_registry"),
        help="DRA mode, one node: where the kubelet's plugin watcher finds the agent's "
        "registration socket",
    )
    p.add_argument(
        "--kubelet-plugins-dir",
        type=Path,
        default=Path("/var/lib/kubelet/plugins"),
        help="DRA mode, one node: the DRA plugin socket goes in DIR/instaslice.io/",
    )
    p.add_argument("--kubelet-dir", type=Path, default=Path("/var/lib/kubelet/device-plugins"))
    p.add_argument(
        "--pod-resources-socket",
        type=Path,
        default=Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
    )
    p.add_argument(
        "--discover-only",
        action="store_true",
        help="print what NVML shows; change nothing, contact no API server",
    )
    p.add_argument(
        "--output", choices=("text", "json"), default="text", help="--discover-only output format"
    )
    p.add_argument(
        "--gc-grace-s",
        type=float,
        default=60.0,
        help="seconds before an unclaimed InstaSlice instance is destroyed",
    )
    p.add_argument("--gc-period-s", type=float, default=30.0)
    p.add_argument(
        "--creating-after-s",
        type=float,
        default=1.0,
        help="a create that has taken this long writes status Creating; a faster one goes "
        "straight to Ready (docs/protocol.md)",
    )
    p.add_argument(
        "--maintenance-wait-s",
        type=float,
        default=300.0,
        help="Ampere maintenance: how long a GPU reset may be refused (paused GPU Operator "
        "clients still holding the GPU) before the change counts as failed",
    )
    p.add_argument(
        "--maintenance-drain-timeout-s",
        type=float,
        default=1800.0,
        help="Ampere maintenance: how long a drain may wait for the work on an asked GPU "
        "that needs a reset (a reset-less GPU's ask waits as long as the work runs) before "
        "the ask is given up (MigNode modeChange.phase Failed, reason DrainTimedOut; nothing "
        "is evicted); 0: wait as long as the work runs",
    )
    p.add_argument(
        "--idle-mig-mode-after-s",
        type=float,
        default=600.0,
        help="seconds a Hopper+ GPU must be idle before it is brought to the MIG mode its "
        "Node's instaslice.io/idle-mig-mode label names (enabled|disabled; any: left alone)",
    )
    p.add_argument(
        "--warm-slices",
        choices=("on", "off"),
        default="off",
        help="on: keep a few slices of the profiles most asked for here made ahead of demand, "
        "handed to a pod without an NVML call (docs/warm-slices.md; gate mode only)",
    )
    p.add_argument("--warm-per-gpu", type=int, default=1, help="warm slices per GPU, at most")
    p.add_argument("--warm-per-node", type=int, default=2, help="warm slices per node, at most")
    p.add_argument("--lease-duration-s", type=int, default=AGENT_LEASE_DURATION_S)
    p.add_argument(
        "--nvidia-cdi-spec",
        type=Path,
        help="the node's NVIDIA CDI spec (default: the first that exists of "
        "/var/run/cdi/nvidia.yaml, /etc/cdi/nvidia.yaml, "
        "/var/run/cdi/management.nvidia.com-gpu.yaml; generated under --emulate)",
    )
    p.add_argument("--mig-minors", type=Path, default=Path("/proc/driver/nvidia-caps/mig-minors"))
    p.add_argument(
        "--dev-root",
        type=Path,
        help="with --emulate: real device files standing in for /dev (CDI hostPaths point "
        "there), for an emulated node under a real kubelet and container runtime",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve /metrics, /healthz and /readyz on this port (0: off)",
    )
    add_flags(p)
    p.add_argument("--log-level", default="info", choices=LEVELS)
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, str]:
    p = build_parser()
    a = p.parse_args(argv)
    if a.nodes:
        nodes = tuple(n.strip() for n in a.nodes.split(",") if n.strip())
    else:
        node = a.node or os.environ.get("NODE_NAME", "")
        nodes = (node,) if node else ()
    if not nodes:
        p.error("no node: pass --node NAME (or set NODE_NAME), or --nodes a,b,c")
    if len(nodes) > 1 and not a.emulate:
        p.error("--nodes with more than one node needs --emulate (one real node per process)")
    if a.binding == "device-plugin" and len(nodes) > 1:
        p.error("--binding-mode device-plugin serves one node's kubelet: pass one --node")
    if a.emulate and a.emu_state is None:
        p.error("--emulate needs --emu-state DIR")
    if a.dev_root is not None and not a.emulate:
        p.error("--dev-root needs --emulate (a real node's device files are in /dev)")
    if len(nodes) > 1 and a.cdi_root is None and not a.discover_only:
        p.error("several nodes need --cdi-root (each node gets ROOT/<node>/cdi)")
    if not a.maintenance_drain_timeout_s >= 0:  # NaN too
        p.error("--maintenance-drain-timeout-s must be 0 (no timeout) or more seconds")
    settings = Settings(
        nodes=nodes,
        kubeconfig=a.kubeconfig,
        emulate=a.emulate,
        emu_state=a.emu_state,
        cdi_dir=a.cdi_dir,
        cdi_root=a.cdi_root,
        state_dir=a.state_dir,
        namespace=a.namespace,
        binding=BindingMode(a.binding),
        allocation=AllocationMode(a.allocation_mode),
        # one node's kubelet: emulated KWOK nodes have none (an emulated node under a real
        # kubelet has its --dev-root)
        dra_registry_dir=(
            a.kubelet_registry_dir
            if len(nodes) == 1 and (not a.emulate or a.dev_root is not None)
            else None
        ),
        dra_plugins_dir=a.kubelet_plugins_dir,
        discover_only=a.discover_only,
        gc_grace_s=a.gc_grace_s,
        gc_period_s=a.gc_period_s,
        creating_after_s=a.creating_after_s,
        warm_slices=a.warm_slices == "on",
        warm_per_gpu=max(0, a.warm_per_gpu),
        warm_per_node=max(0, a.warm_per_node),
        idle_mig_mode_after_s=a.idle_mig_mode_after_s,
        maintenance_wait_s=a.maintenance_wait_s,
        maintenance_drain_timeout_s=a.maintenance_drain_timeout_s,
        lease_duration_s=a.lease_duration_s,
        nvidia_cdi_spec=a.nvidia_cdi_spec,
        mig_minors=a.mig_minors,
        dev_root=a.dev_root,
        metrics_port=a.metrics_port,
        metrics_auth=a.metrics_auth,
        metrics_auth_limits=limits_from(a),
        kubelet_dir=a.kubelet_dir,
        pod_resources_socket=a.pod_resources_socket,
    )
    return settings, f"{a.output}:{a.log_level}"


# --- dependencies ---------------------------------------------------------------------------


def nvml_factory(settings: Settings) -> Callable[[str], NvmlModule]:
    if settings.emulate:
        from nodeagent.emulator import EmulatedNvml

        assert settings.emu_state is not None
        state = settings.emu_state
        return lambda node: EmulatedNvml(state, node)
    return lambda node: real_nvml()


def reset_factory(settings: Settings) -> Callable[[str], Reset]:
    """How node N resets a GPU: the emulator's `reset_gpu`, or the reset command."""
    if settings.emulate:
        from nodeagent.emulator import EmulatorControl, EmulatorError

        assert settings.emu_state is not None
        state = settings.emu_state

        def emulated(node: str) -> Reset:
            def reset(index: int) -> None:
                try:
                    EmulatorControl(state, node).reset_gpu(index)
                except EmulatorError as exc:
                    raise ResetRefused(str(exc), final="not supported" in str(exc)) from None

            return reset

        return emulated
    return lambda node: command_reset(settings.gpu_reset_command)


def boot_id_factory(settings: Settings) -> Callable[[str], str]:
    if settings.emulate:
        from nodeagent.emulator import EmulatorControl

        assert settings.emu_state is not None
        state = settings.emu_state
        return lambda node: EmulatorControl(state, node).boot_id()
    return lambda node: settings.boot_id_path.read_text().strip()


def host_cdi_facts(
    settings: Settings, node: str, driver: str, gpu_minors: Sequence[int]
) -> tuple[cdi.DeviceNumbers, Obj | None, Obj]:
    """Device numbering, the base NVIDIA CDI spec for one node, and the MigNode condition
    saying where it came from (or that none was found). Under --emulate the base spec is
    generated once into the state dir (`<node>.nvidia-cdi.json`) and read back like a real one."""
    if settings.emulate:
        path = settings.nvidia_cdi_spec or settings.checkpoint_path(node).with_name(
            f"{node}.nvidia-cdi.json"
        )
        if not path.exists():
            spec = cdi.fake_nvidia_spec(driver or "580.159.04", gpu_minors, settings.dev_root)
            cdi.write_json_atomic(path, spec)
        numbers = cdi.DeviceNumbers.emulated(settings.dev_root)
        return numbers, cdi.load_base_spec(path), base_spec_condition(path, [])
    numbers = cdi.DeviceNumbers.from_host(settings.mig_minors, settings.proc_devices)
    candidates = (settings.nvidia_cdi_spec,) if settings.nvidia_cdi_spec else settings.cdi_specs
    return (numbers, *find_base_spec(candidates))


def find_base_spec(candidates: Sequence[Path]) -> tuple[Obj | None, Obj]:
    """The first of `candidates` that exists, read, and the MigNode condition telling which
    (or that none did: then an error is logged too, and the agent raises an event)."""
    for path in candidates:
        if path.exists():
            return cdi.load_base_spec(path), base_spec_condition(path, candidates)
    log.error(
        "no NVIDIA CDI spec found: slices get device nodes but no driver mounts/hooks; "
        "run `nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml` (docs/install.md)",
        tried=[str(c) for c in candidates],
    )
    return None, base_spec_condition(None, candidates)


def _slice_info(agent: NodeAgent) -> list[tuple[str, ...]]:
    return slice_info(agent.node, agent.st.allocs.values())


def selector(nodes: Sequence[str]) -> str:
    values = [node_label_value(n) for n in nodes]  # a long name's label is cut and hashed
    if len(values) == 1:
        return f"{NODE_LABEL}={values[0]}"
    if len(values) <= MAX_IN_SELECTOR:
        return f"{NODE_LABEL} in ({','.join(values)})"
    return NODE_LABEL  # many nodes: every bound allocation, filtered here


# --- serving --------------------------------------------------------------------------------


def by_node_name(
    kube: Kube,
    path: str,
    name: str,
    nodes: Sequence[str],
    agents: dict[str, NodeAgent],
    deliver: Callable[[NodeAgent, EventType, Obj], None],
) -> Informer:
    """An informer of objects named after our nodes (Node, MigNode): one name with one node,
    else all of them; each event goes to the agent of its name."""

    async def on_event(etype: EventType, obj: Obj) -> None:
        agent = agents.get(obj.get("metadata", {}).get("name", ""))
        if agent is not None:
            deliver(agent, etype, obj)

    return Informer(
        kube,
        path,
        on_event,
        field_selector=f"metadata.name={nodes[0]}" if len(nodes) == 1 else None,
        name=name,
        transform=lean,
    )


async def serve(
    settings: Settings,
    *,
    nvml_for: Callable[[str], NvmlModule] | None = None,
    boot_id_for: Callable[[str], str] | None = None,
    cdi_facts_for: CdiFacts | None = None,
    started: Callable[[dict[str, NodeAgent]], None] | None = None,
) -> None:
    """Run the agents of `settings.nodes` until cancelled. `nvml_for`, `boot_id_for` and
    `cdi_facts_for` (node, driver version, GPU minors → `host_cdi_facts`' answer) replace
    the host's for tests."""
    cdi_facts_for = cdi_facts_for or functools.partial(host_cdi_facts, settings)
    catalog = load_catalog()
    nvml_for = nvml_for or nvml_factory(settings)
    boot_id_for = boot_id_for or boot_id_factory(settings)
    reset_for = reset_factory(settings)
    agents: dict[str, NodeAgent] = {}
    metrics = AgentMetrics(registry=buildinfo.registry("nodeagent"))
    dra = settings.allocation is AllocationMode.DRA

    by_label = {node_label_value(n): n for n in settings.nodes}  # a long name's is cut

    async def on_alloc(etype: EventType, obj: Obj) -> None:
        label = (obj.get("metadata", {}).get("labels") or {}).get(NODE_LABEL, "")
        agent = agents.get(by_label.get(label, ""))
        if agent is not None:
            agent.on_event(etype, obj)

    hub = HealthHub(timeout_ms=settings.health_timeout_ms)
    # many emulated nodes share a bounded pool (NodeGpus); a real node keeps its own thread
    shared = (
        ThreadPoolExecutor(max_workers=SHARED_NVML_THREADS, thread_name_prefix="nvml")
        if len(settings.nodes) > 1
        else None
    )
    try:
        async with connected(settings.kubeconfig) as kube, contextlib.AsyncExitStack() as stack:
            informer = Informer(
                kube,
                instaslice_path("sliceallocations"),
                on_alloc,
                label_selector=selector(settings.nodes),
                name="sliceallocations",
            )
            binding: Binding = EnvBinding()
            if settings.binding == "device-plugin":
                from nodeagent.deviceplugin.plugin import DevicePluginBinding

                plugin = DevicePluginBinding(
                    kube=kube,
                    cdi_dir=settings.node_cdi_dir(settings.nodes[0]),
                    kubelet_dir=settings.kubelet_dir,
                    pod_resources_socket=settings.pod_resources_socket,
                    refresh_s=settings.plugin_refresh_s,
                )
                binding = plugin
            for node in settings.nodes:
                gpus = await stack.enter_async_context(
                    NodeGpus(nvml_for(node), catalog, node, pool=shared)
                )
                driver = await gpus.call(gpus.s.call, "nvmlSystemGetDriverVersion")
                count = await gpus.call(gpus.s.call, "nvmlDeviceGetCount")
                numbers, base, base_condition = await asyncio.to_thread(
                    cdi_facts_for, node, str(driver), range(int(count))
                )
                agents[node] = NodeAgent(
                    node=node,
                    kube=kube,
                    gpus=gpus,
                    settings=settings,
                    catalog=catalog,
                    boot_id=await asyncio.to_thread(boot_id_for, node),
                    numbers=numbers,
                    base_spec=base,
                    node_conditions=[base_condition],
                    reset=reset_for(node),
                    binding=binding,
                    health_hub=hub,
                    synced=informer.synced,
                    metrics=metrics,
                )

            # the agent writes its Node's capacity (and labels) itself: watch the Node, so one
            # deleted and registered again (or reset by another writer) gets them back at once
            nodes_informer = by_node_name(
                kube, core_path("nodes"), "nodes", settings.nodes, agents, NodeAgent.on_node
            )
            # our MigNode's spec asks for Ampere maintenance (nodeagent/maintenance.py)
            mig_nodes_informer = by_node_name(
                kube,
                instaslice_path("mignodes"),
                "mignodes",
                settings.nodes,
                agents,
                NodeAgent.on_mig_node,
            )
            claims_informer = dra_claims(kube, agents) if dra else None
            slices_informer = dra_slices(kube, settings.nodes, agents) if dra else None
            for agent in agents.values():  # read when scraped: the agent's live view
                metrics.slice_info.sources.append(functools.partial(_slice_info, agent))
            if settings.binding == "device-plugin":
                a = agents[settings.nodes[0]]
                plugin.attach(
                    lambda: capacity(
                        a.st.inv, a.st.health, a.life.modes.can_enable, a.life.modes.can_be_whole
                    ),
                    lambda: a.st.allocs.values(),
                )

            def ready() -> bool:
                started = all(a.started.is_set() for a in agents.values())
                return started and informer.synced.is_set()

            if dra and settings.dra_registry_dir is not None:
                (agent,) = agents.values()
                assert agent.claims is not None
                sockets = Sockets(settings.dra_registry_dir, settings.dra_plugins_dir)
                await stack.enter_async_context(serving(agent.claims, sockets))
            if settings.metrics_port:
                await stack.enter_async_context(
                    health_server(
                        settings.metrics_port,
                        metrics,
                        ready,
                        auth=(
                            MetricsAuth(kube, settings.metrics_auth_limits)
                            if settings.metrics_auth
                            else None
                        ),
                    )
                )
            async with asyncio.TaskGroup() as tg:
                for agent in agents.values():
                    tg.create_task(agent.run(), name=f"agent-{agent.node}")
                tg.create_task(stoppable(informer.run(), "informer"), name="informer-guard")
                tg.create_task(binding.run(), name="binding")
                if claims_informer is not None and slices_informer is not None:
                    tg.create_task(
                        stoppable(claims_informer.run(), "resourceclaims"), name="claims-guard"
                    )
                    tg.create_task(
                        stoppable(slices_informer.run(), "resourceslices"), name="slices-guard"
                    )
                tg.create_task(stoppable(nodes_informer.run(), "nodes"), name="nodes-guard")
                tg.create_task(
                    stoppable(mig_nodes_informer.run(), "mignodes"), name="mignodes-guard"
                )
                if started is not None:
                    started(agents)
    finally:
        await hub.stop()
        if shared is not None:
            await asyncio.to_thread(shared.shutdown, wait=True)


async def _serve_until_signal(settings: Settings, levels: LogLevel) -> None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    levels.install_signals(loop)  # SIGUSR1/SIGUSR2: docs/configuration.md "Logging"
    log.info(
        "starting", nodes=len(settings.nodes), emulate=settings.emulate, binding=settings.binding
    )
    with contextlib.suppress(asyncio.CancelledError):
        await serve(settings)
    log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    settings, extra = parse_args(argv)
    output, level = extra.split(":", 1)
    if settings.discover_only:
        catalog = load_catalog()
        nv_for = nvml_factory(settings)
        for node in settings.nodes:
            print(render(report(node, discover(nv_for(node), catalog), catalog), output))
        return 0
    asyncio.run(_serve_until_signal(settings, configure_logging(level)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
