"""`instaslice-webhook`: the cluster-side service — admission server, namespace label mirror
and the (leader-elected) allocator, in one process.

This module only parses flags into settings and runs the three parts under one TaskGroup;
each part owns its resources. SIGTERM/SIGINT cancel the group: the allocator hands its Lease
back, the server drains. One Prometheus registry serves both parts' metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from common import buildinfo
from common.clock import SystemClock
from common.constants import AllocationMode, BindingMode
from common.heap import settle_collector
from common.kubeapi import Kube
from common.logsetup import LEVELS, configure_logging
from common.metricsauth import MetricsAuth, MetricsAuthLimits, add_flags, limits_from
from common.placement import Policy
from webhook.allocator import AllocatorMetrics, AllocatorSettings, default_identity, run_allocator
from webhook.allocator.autoscale import (
    DEFAULT_PROVREQ_CLASS,
    PLACEHOLDER_IMAGE,
    ScaleUpSettings,
    SignalMode,
)
from webhook.allocator.preemption import parse_selector
from webhook.metrics import WebhookMetrics
from webhook.nsmirror import run_namespace_mirror
from webhook.offered import OfferedProfiles, watch_mig_nodes
from webhook.selfcert import SelfCertSettings, ensure, run_cert_rotation
from webhook.server import serve
from webhook.settings import AdmissionSettings, ServerSettings

log = structlog.get_logger("main")


@dataclass(frozen=True)
class Settings:
    kubeconfig: str | None
    server: ServerSettings | None  # None: no admission server
    allocator: AllocatorSettings | None  # None: no allocator
    mirror_namespaces: bool
    log_level: str = "info"
    metrics_auth: bool = False
    metrics_auth_limits: MetricsAuthLimits = field(default_factory=MetricsAuthLimits)
    # gates or dra (docs/dra.md), as the node agents': what the allocator is to run in
    allocation_mode: AllocationMode = AllocationMode.GATES
    self_cert: SelfCertSettings | None = None  # None: the cert files come from elsewhere


def build_parser() -> argparse.ArgumentParser:
    """The command line; docs/configuration.md documents every flag (tests/unit/test_docs.py)."""
    p = argparse.ArgumentParser(prog="instaslice-webhook", description=__doc__)
    p.add_argument("--kubeconfig", default=None, help="default: in-cluster service account")
    p.add_argument("--host", default="0.0.0.0", help="address both servers listen on")
    p.add_argument("--port", type=int, default=8443, help="HTTPS admission port (0: any)")
    p.add_argument("--metrics-port", type=int, default=8080, help="/metrics, /healthz, /readyz")
    p.add_argument("--cert-file", type=Path, default=Path("/etc/instaslice/tls/tls.crt"))
    p.add_argument("--key-file", type=Path, default=Path("/etc/instaslice/tls/tls.key"))
    p.add_argument(
        "--cert-mode",
        choices=["files", "self"],
        default="files",
        help="files: --cert-file/--key-file come from elsewhere (cert-manager, the OpenShift "
        "service CA); self: the webhook issues, stores (--cert-secret), rotates and writes them "
        "and patches --webhook-configuration's caBundle (webhook/selfcert.py)",
    )
    p.add_argument("--cert-secret", default="instaslice-webhook-tls", help="--cert-mode=self")
    p.add_argument(
        "--webhook-configuration", default="instaslice", help="--cert-mode=self: its caBundle"
    )
    p.add_argument(
        "--service", default="instaslice-webhook", help="--cert-mode=self: the DNS names"
    )
    p.add_argument(
        "--binding-mode",
        choices=[m.value for m in BindingMode],
        default=BindingMode.ENV.value,
        help="must match the node agents' (the manifests set both from one ConfigMap)",
    )
    p.add_argument(
        "--allocation-mode",
        choices=[m.value for m in AllocationMode],
        default=AllocationMode.GATES.value,
        help="gates or dra (docs/dra.md); must match the node agents' (the manifests set "
        "both from one ConfigMap)",
    )
    p.add_argument("--namespace", default="instaslice-system", help="for the leader Lease")
    p.add_argument("--identity", default=None, help="leader-election identity")
    p.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.INSTASLICE.value)
    p.add_argument("--pinned-unschedulable-timeout", type=float, default=60.0, metavar="S")
    p.add_argument("--node-selector", default=None, help="only place on matching nodes")
    p.add_argument(
        "--node-gone-grace",
        type=float,
        default=300.0,
        metavar="S",
        help="delete a gone node's MigNode and agent Lease after this long",
    )
    p.add_argument(
        "--autoscaler-signal",
        choices=[m.value for m in SignalMode],
        default=SignalMode.OFF.value,
        help="how pods no node can serve ask for a new node (docs/autoscaling.md)",
    )
    p.add_argument("--scale-up-delay", type=float, default=30.0, metavar="S")
    p.add_argument(
        "--provisioning-class",
        default=DEFAULT_PROVREQ_CLASS,
        help="ProvisioningRequest class (--autoscaler-signal=provisioning-request)",
    )
    p.add_argument("--placeholder-image", default=PLACEHOLDER_IMAGE)
    p.add_argument(
        "--karpenter-do-not-disrupt",
        action="store_true",
        help="annotate rewritten pods karpenter.sh/do-not-disrupt=true (docs/autoscaling.md)",
    )
    p.add_argument(
        "--preemption",
        choices=["gpu", "off"],
        default="gpu",
        help="gpu: evict lower-priority pods holding MIG slots for a pod that does not fit",
    )
    p.add_argument(
        "--preempt-kueue-pods",
        action="store_true",
        help="Kueue-managed pods may be preemption victims (default: never)",
    )
    p.add_argument(
        "--kueue-namespace-selector",
        type=_selector,
        default=None,
        metavar="SELECTOR",
        help="namespaces (a label selector, as kubectl -l) whose pods Kueue manages: they "
        "are never preemption victims unless --preempt-kueue-pods (docs/kueue.md); "
        "default: none",
    )
    p.add_argument("--preemption-wait-timeout", type=float, default=180.0, metavar="S")
    p.add_argument(
        "--preemption-round-cpu",
        type=float,
        default=0.5,
        metavar="S",
        help="CPU seconds of preemption planning per placement round; the pods still to plan "
        "for wait for the next round, namespaces in turn",
    )
    p.add_argument(
        "--preemption-backoff",
        type=float,
        default=AllocatorSettings.preemption_backoff_s,
        metavar="S",
        help="after a controller's pod is deleted as pinned but unschedulable, its pods "
        "preempt nobody on that node for this long",
    )
    p.add_argument(
        "--ampere-mode-changes",
        choices=["off", "drain"],
        default="off",
        help="drain: ask the node agent for the MIG mode change (GPU drain and reset) a pod "
        "needs on Ampere GPUs; off: such pods wait with NeedsMigModeChange",
    )
    p.add_argument(
        "--ampere-mode-change-interval",
        type=float,
        default=AllocatorSettings.ampere_mode_change_interval_s,
        metavar="S",
        help="--ampere-mode-changes=drain: seconds between a GPU's last MIG mode change and "
        "an ask for the opposite one (0: none)",
    )
    p.add_argument(
        "--avoid-creates-in-flight",
        type=_count,
        default=AllocatorSettings.avoid_creates_in_flight,
        metavar="N",
        help="place a pod away from a GPU with N or more slices still being made while "
        "another GPU can take it (docs/allocator.md); 0: off",
    )
    p.add_argument("--no-admission", action="store_true", help="run without the server")
    p.add_argument(
        "--slot-accounting",
        action="store_true",
        help="add instaslice.io/memory-slots to slice-asking containers, for cross-profile "
        "quotas (docs/kueue.md); node agents advertise it",
    )
    p.add_argument("--no-allocator", action="store_true", help="run without the allocator")
    p.add_argument("--no-namespace-mirror", action="store_true")
    p.add_argument("--log-level", default="info", choices=LEVELS)
    add_flags(p)
    return p


def _count(text: str) -> int:
    """A whole number >= 0 (argparse names the flag when this raises)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; 0 turns it off")
    return value


def _selector(text: str) -> str:
    """A label selector `parse_selector` reads (argparse names the flag when this raises)."""
    try:
        parse_selector(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    """The settings the command line asks for; no side effects (main configures logging)."""
    a = build_parser().parse_args(argv)
    server = None
    if not a.no_admission:
        server = ServerSettings(
            cert_file=a.cert_file,
            key_file=a.key_file,
            admission=AdmissionSettings.from_catalog(
                BindingMode(a.binding_mode),
                do_not_disrupt=a.karpenter_do_not_disrupt,
                slot_accounting=a.slot_accounting,
                allocation_mode=AllocationMode(a.allocation_mode),
            ),
            host=a.host,
            port=a.port,
            metrics_port=a.metrics_port,
        )
    allocator = None
    if not a.no_allocator:
        allocator = AllocatorSettings(
            namespace=a.namespace,
            identity=a.identity or default_identity(),
            pinned_unschedulable_timeout_s=a.pinned_unschedulable_timeout,
            policy=Policy(a.policy),
            node_selector=a.node_selector,
            node_gone_grace_s=a.node_gone_grace,
            scale_up=ScaleUpSettings(
                mode=SignalMode(a.autoscaler_signal),
                delay_s=a.scale_up_delay,
                provisioning_class=a.provisioning_class,
                image=a.placeholder_image,
            ),
            preemption=a.preemption == "gpu",
            preempt_kueue_pods=a.preempt_kueue_pods,
            kueue_namespace_selector=a.kueue_namespace_selector or "",
            preemption_backoff_s=a.preemption_backoff,
            preemption_wait_s=a.preemption_wait_timeout,
            preemption_round_cpu_s=a.preemption_round_cpu,
            ampere_mode_changes=a.ampere_mode_changes,
            ampere_mode_change_interval_s=a.ampere_mode_change_interval,
            avoid_creates_in_flight=a.avoid_creates_in_flight,
            allocation_mode=AllocationMode(a.allocation_mode),
        )
    self_cert = None
    if server is not None and a.cert_mode == "self":
        self_cert = SelfCertSettings(
            namespace=a.namespace,
            cert_file=a.cert_file,
            key_file=a.key_file,
            secret=a.cert_secret,
            service=a.service,
            webhook_configuration=a.webhook_configuration,
        )
    return Settings(
        a.kubeconfig,
        server,
        allocator,
        not a.no_namespace_mirror,
        a.log_level,
        a.metrics_auth,
        limits_from(a),
        AllocationMode(a.allocation_mode),
        self_cert=self_cert,
    )


async def run(settings: Settings) -> None:
    registry = buildinfo.registry("webhook")
    webhook_metrics = WebhookMetrics(registry)
    allocator_metrics = AllocatorMetrics(registry)
    async with await Kube.connect(settings.kubeconfig) as kube, asyncio.TaskGroup() as tg:
        if settings.self_cert is not None:  # the files must exist before the server starts
            first = await ensure(kube, settings.self_cert, SystemClock().wall())
            tg.create_task(
                run_cert_rotation(kube, settings.self_cert, SystemClock(), first=first),
                name="cert-rotation",
            )
        if settings.server is not None:
            limits = settings.metrics_auth_limits
            auth = MetricsAuth(kube, limits) if settings.metrics_auth else None
            offered = OfferedProfiles(settings.server.admission.known_profiles)
            tg.create_task(watch_mig_nodes(kube, offered), name="offered-profiles")
            tg.create_task(
                serve(settings.server, metrics=webhook_metrics, metrics_auth=auth, offered=offered),
                name="admission",
            )
        if settings.mirror_namespaces:
            tg.create_task(run_namespace_mirror(kube), name="namespace-mirror")
        if settings.allocator is not None:
            tg.create_task(
                run_allocator(kube, settings.allocator, allocator_metrics, settle_collector),
                name="allocator",
            )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    levels = configure_logging(settings.log_level)

    async def _main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if task is not None:
                loop.add_signal_handler(sig, task.cancel)
        levels.install_signals(loop)  # SIGUSR1/SIGUSR2: docs/configuration.md "Logging"
        with contextlib.suppress(asyncio.CancelledError):
            await run(settings)
        log.info("stopped")

    asyncio.run(_main())
    return 0


if __name__ == "__main__":
    sys.exit(main())
