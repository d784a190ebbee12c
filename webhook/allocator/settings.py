"""What the allocator runs with: one dataclass, passed in (docs/style.md §8), one default each.

Nothing here is read at import; `webhook.main` builds it from the command line.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from common.catalog import Catalog
from common.clock import Clock, SystemClock
from common.constants import AllocationMode
from common.placement import Policy
from webhook.allocator.autoscale import ScaleUpSettings
from webhook.allocator.leader import LEASE_NAME, LeaseSettings
from webhook.allocator.preemption import BACKOFF_S


def default_instance() -> str:
    """This replica's pod (the Downward API's POD_NAME), else the host's name."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def default_identity() -> str:
    """`<hostname>_<random>`: unique per process, readable in `kubectl get lease`."""
    return f"{default_instance()}_{secrets.token_hex(4)}"


@dataclass(frozen=True)
class AllocatorSettings:
    """What the allocator runs with (docs/style.md §8: passed in, nothing read at import).

    namespace: where the leader-election Lease lives (InstaSlice's namespace).
    identity: this replica's name in the Lease; unique per process.
    instance: the pod this replica runs in, its events' `reportingInstance`.
    pinned_unschedulable_timeout_s: how long a pinned pod may stay unschedulable before its
      slices are released (docs/contract.md §4 step 4).
    lease_*: leader election (client-go's defaults: 15 s lease, renew every 5 s, give up
      after 10 s without a renewal); release_on_exit hands the Lease back on shutdown.
    node_selector: a label selector; when set, only matching nodes are offered to placement
      (a cluster partition, or a test's own nodes). Pods are watched cluster-wide regardless.
    agent_sweep_s: how often the leader checks the node agents' Leases (in `namespace`); a
      node whose agent has not renewed for the Lease's duration is left out of placement.
    node_gone_grace_s: a MigNode whose Node has been gone this long is deleted, with its
      agent's Lease (a node removed for good, e.g. by an autoscaler, leaves nothing of ours).
    scale_up: the autoscaler signal for pods no node can serve (docs/autoscaling.md).
    preemption: evict lower-priority pods holding MIG slots for a pod that does not fit
      (docs/allocator.md "Preemption"); off by default.
    preempt_kueue_pods: Kueue-managed pods may be preemption victims (off: Kueue preempts
      its own workloads).
    kueue_namespace_selector: a label selector (`kubectl -l` syntax) on namespaces: the pods
      of matching namespaces are Kueue-managed (docs/kueue.md "Preemption"); "": none is.
    preemption_backoff_s: after a pod owned by a controller is deleted as pinned but
      unschedulable, that controller's pods plan no preemption on that node for this long.
    preemption_wait_s: how long a preemptor waits for its victims' slices to be released
      before it gives up and plans again without them.
    preemption_round_cpu_s: CPU seconds of preemption planning per placement round; once
      spent, the pods still to plan for wait for the next round, which serves namespaces in
      turn (docs/allocator.md "Planning cost"). Checked before each plan, so a round makes
      at least one.
    avoid_creates_in_flight: N > 0 places a pod away from a GPU that has N or more slices
      placed but not made yet (allocations assumed, `Pending` or `Creating`) while another
      GPU can take it (docs/allocator.md "Creates in flight"); 0: off.
    ampere_mode_changes: `drain` asks node agents for the MIG mode change (a GPU reset) a
      pod needs on Ampere GPUs (docs/allocator.md "Ampere maintenance"); `off`: it waits.
    ampere_mode_change_interval_s: under `drain`, the least time between a GPU's last mode
      change (the agent's `lastModeChange`) and an ask for the opposite one; 0: none.
    allocation_mode: `dra`: the record of a pod's slices is a ResourceClaim, not a
      SliceAllocation, and the pod is ungated without a pin (docs/dra.md).
    clock: injectable for tests.
    """

    namespace: str
    identity: str = field(default_factory=default_identity)
    instance: str = field(default_factory=default_instance)
    pinned_unschedulable_timeout_s: float = 60.0
    policy: Policy = Policy.INSTASLICE
    catalog: Catalog | None = None
    lease_name: str = LEASE_NAME
    lease_duration_s: float = 15.0
    renew_interval_s: float = 5.0
    renew_deadline_s: float = 10.0
    retry_interval_s: float = 2.0
    release_on_exit: bool = True
    max_backoff_s: float = 30.0
    node_selector: str | None = None
    agent_sweep_s: float = 5.0
    node_gone_grace_s: float = 300.0
    scale_up: ScaleUpSettings = field(default_factory=ScaleUpSettings)
    preemption: bool = False
    preempt_kueue_pods: bool = False
    kueue_namespace_selector: str = ""
    preemption_backoff_s: float = BACKOFF_S
    preemption_wait_s: float = 180.0
    preemption_round_cpu_s: float = 0.5
    ampere_mode_changes: str = "off"  # off | drain (webhook/allocator/maintenance.py)
    ampere_mode_change_interval_s: float = 600.0
    avoid_creates_in_flight: int = 0
    allocation_mode: AllocationMode = AllocationMode.GATES
    clock: Clock = field(default_factory=SystemClock, compare=False)

    def lease(self) -> LeaseSettings:
        return LeaseSettings(
            namespace=self.namespace,
            identity=self.identity,
            name=self.lease_name,
            lease_duration_s=self.lease_duration_s,
            renew_interval_s=self.renew_interval_s,
            renew_deadline_s=self.renew_deadline_s,
            retry_interval_s=self.retry_interval_s,
            release_on_exit=self.release_on_exit,
        )
