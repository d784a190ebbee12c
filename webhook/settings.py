"""Settings of the admission webhook, as frozen dataclasses passed in (docs/style.md §8).

Nothing here reads the environment or the catalog at import time: the entry point builds the
settings (from flags, env, the catalog) and hands them down. `AdmissionSettings` is all the
pure decision needs; `ServerSettings` adds what the HTTPS shell needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.catalog import Catalog, load_catalog
from common.constants import AllocationMode, BindingMode


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """What `webhook.admission.review` decides with.

    `known_profiles`: the MIG profile names (NVIDIA spelling) some GPU model offers — a
    catalog model, or a GPU whose node published them (webhook/offered.py); anything else is
    refused as an unknown profile, with the list of `cluster_profiles` (what the nodes
    published; the catalog's when none did). `max_count`: the largest count accepted for one
    resource of one container — far above any real node (8 GPUs x 7 slices), it only keeps
    absurd numbers out of the allocator. `do_not_disrupt`: also annotate every rewritten pod
    `karpenter.sh/do-not-disrupt: "true"`: a pod holding a slice cannot move with it, so
    Karpenter must not consolidate its node while it runs (docs/autoscaling.md).
    """

    known_profiles: frozenset[str]
    binding_mode: BindingMode = BindingMode.ENV
    max_count: int = 1024
    cluster_profiles: frozenset[str] = frozenset()
    do_not_disrupt: bool = False
    # --slot-accounting: add instaslice.io/memory-slots to slice-asking containers (docs/kueue.md)
    slot_accounting: bool = False
    # what size-based asks and slot charges are resolved against
    catalog: Catalog = field(default_factory=load_catalog)
    # dra: asks become a ResourceClaim reference, not an extended resource (docs/dra.md)
    allocation_mode: AllocationMode = AllocationMode.GATES

    @classmethod
    def from_catalog(
        cls,
        binding_mode: BindingMode = BindingMode.ENV,
        *,
        do_not_disrupt: bool = False,
        slot_accounting: bool = False,
        allocation_mode: AllocationMode = AllocationMode.GATES,
    ) -> AdmissionSettings:
        catalog = load_catalog()
        return cls(
            known_profiles=catalog.profile_names(),
            binding_mode=binding_mode,
            do_not_disrupt=do_not_disrupt,
            slot_accounting=slot_accounting,
            catalog=catalog,
            allocation_mode=allocation_mode,
        )


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The HTTPS admission server.

    The serving certificate and key are PEM files, re-read when they change (cert-manager
    and kubelet's Secret volumes replace them in place); `cert_check_interval_s` is how often
    their stat() is compared. `max_body_bytes` bounds one AdmissionReview (a Pod is at most
    ~1.5 MiB in etcd; an UPDATE review carries two of them).
    """

    cert_file: Path | None  # None: plain HTTP, for unit tests of the app only
    key_file: Path | None
    admission: AdmissionSettings = field(default_factory=AdmissionSettings.from_catalog)
    host: str = "0.0.0.0"
    port: int = 8443  # 0: any free port
    metrics_port: int | None = None  # plain HTTP /metrics, /healthz, /readyz; None: none
    cert_check_interval_s: float = 2.0
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_timeout_s: float = 5.0
