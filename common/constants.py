"""Names of the public contract (docs/contract.md), defined once.

Every annotation key, label, gate, resource prefix and API coordinate that more than one
module uses lives here, so a misspelling is a NameError rather than a silent mismatch.
"""

import enum
from typing import Final

GROUP: Final = "instaslice.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"

# Namespace opt-in (annotation set by users, mirrored into a label for namespaceSelector).
ENABLED_KEY: Final = "instaslice.io/enabled"

# Pod rewriting.
GATE_NAME: Final = "instaslice.io/allocation"
CLAIM_ANNOTATION: Final = "instaslice.io/claim"
NVIDIA_MIG_PREFIX: Final = "nvidia.com/mig-"
INSTASLICE_MIG_PREFIX: Final = "instaslice.io/mig-"
# Whole GPUs (docs/contract.md §1): asked as NVIDIA's name in namespaces that also carry
# WHOLE_GPU_KEY, rewritten to InstaSlice's resource; a whole GPU's "profile" in objects.
NVIDIA_GPU: Final = "nvidia.com/gpu"
INSTASLICE_GPU: Final = "instaslice.io/gpu"
WHOLE_GPU_KEY: Final = "instaslice.io/whole-gpu"
WHOLE_GPU_PROFILE: Final = "gpu"
KIND_MIG: Final = "mig"
KIND_GPU: Final = "gpu"
CDI_KIND: Final = "instaslice.io/mig"
VISIBLE_DEVICES_ENV: Final = "NVIDIA_VISIBLE_DEVICES"
# Cross-profile quota (docs/kueue.md): the memory slots a pod's slices take, added to its
# containers by the webhook with --slot-accounting and advertised by node agents. Outside the
# `instaslice.io/mig-` prefix on purpose: that prefix names profiles only.
MEMORY_SLOTS_RESOURCE: Final = "instaslice.io/memory-slots"
# Size-based requests (docs/contract.md §1): `instaslice.io/mig-size.<container>` annotations.
SIZE_ANNOTATION_PREFIX: Final = "instaslice.io/mig-size."


class BindingMode(enum.StrEnum):
    """How a container reaches its CDI device (docs/contract.md §4); the webhook and the node
    agents must run with the same one (`--binding-mode`)."""

    ENV = "env"  # the webhook sets NVIDIA_VISIBLE_DEVICES to the qualified CDI device name
    DEVICE_PLUGIN = "device-plugin"  # the node agent's device plugin answers Allocate


class AllocationMode(enum.StrEnum):
    """How pods get slices, for the whole cluster (docs/dra.md); one value in the ConfigMap
    instaslice-config (`allocation-mode`) that every component reads (`--allocation-mode`)."""

    GATES = "gates"  # SliceAllocations and scheduling gates (docs/contract.md §1-§4)
    DRA = "dra"  # resource.k8s.io/v1 objects are the record: ResourceSlices, ResourceClaims


# DRA mode (docs/dra.md): the driver, its DeviceClasses and the device model's names.
DRA_DRIVER: Final = "instaslice.io"
DRA_API_VERSION: Final = "resource.k8s.io/v1"
DEVICE_CLASS_MIG: Final = "mig.instaslice.io"
DEVICE_CLASS_GPU: Final = "gpu.instaslice.io"
# DRA mode's rewritten pod (docs/contract.md §8): its asks, kept for the allocator (the
# extended resource is gone), and the name of its spec.resourceClaims entry.
ASKS_ANNOTATION: Final = "instaslice.io/asks"
POD_CLAIM_ENTRY: Final = "instaslice"


# Objects.
SLICE_ALLOCATION_KIND: Final = "SliceAllocation"
SLICE_ALLOCATION_PLURAL: Final = "sliceallocations"
MIG_NODE_KIND: Final = "MigNode"
MIG_NODE_PLURAL: Final = "mignodes"
# Bounds of a MigNode's GPU entries (manifests/base/crds/mignodes.yaml; docs/security.md): the
# CRD refuses more, and the allocator plans nothing on a GPU beyond them (common.objects
# `gpu_out_of_bounds`). Real GPUs have at most 12 memory slots (RTX PRO 6000; 8 from A100 to
# B200) and NVML at most 18 GPU-instance profiles (driver 580). A GPU model's placement tables
# double with every slot (docs/placement.md), so slots are bounded at what the SliceAllocation
# CRD already allows a placement (start <= 15, size <= 16), 2^16 occupancy masks at most;
# counts, which cost linearly, leave more room.
MIG_MAX_MEMORY_SLOTS: Final = 16  # start + size of any placement or instance
MIG_MAX_PROFILES: Final = 32  # profiles of one GPU (NVML: 18)
# What a table's build iterates per occupancy mask: the placements of a GPU's profiles, each
# shape (size and starts) counted once, however many variants (+me, -me, +gfx) list it; real
# GPUs have at most 18 (H100: 7 + 4 + 3 + 2 + 1 + 1). Only the allocator checks it (the CRD
# cannot count shapes): 2^16 masks x 64 keeps the costliest table under about a second.
MIG_MAX_TABLE_PLACEMENTS: Final = 64
# Distinct tables that differ from the catalog's on one node (real: one model and one driver a
# node, so 1): each is built once, and a node changing them on every write costs at most this.
MIG_MAX_NODE_TABLES: Final = 4
MIG_MAX_GPUS: Final = 64  # GPUs of one node (real: 8), so index <= 63
MIG_MAX_INSTANCES: Final = 64  # listed instances of one GPU (at most one per slot exist)
MIG_MAX_MODEL_NAME: Final = 256  # a catalog name or NVML's product name (96 bytes in nvml.h)
# MigNodes are listed 100 at a time (not the informers' 500): one decodes to ~83 KB (8 GPUs'
# profile tables), and a page is decoded whole before its objects are parsed and let go
MIG_NODE_PAGE_SIZE: Final = 100
# On a SliceAllocation: the node it is bound to. On a Node: the node's own name, written by its
# agent, which a Karpenter placeholder's `NotIn` keeps it off by (docs/autoscaling.md).
NODE_LABEL: Final = "instaslice.io/node"
# On an autoscaler placeholder pod or ProvisioningRequest: the uid of the gated pod it stands for.
SCALE_UP_LABEL: Final = "instaslice.io/scale-up-for"
RELEASE_FINALIZER: Final = "instaslice.io/release"
CDI_FILE_PREFIX: Final = "instaslice.io-"
# The node agent's heartbeat: a Lease named after the node in InstaSlice's namespace, held
# by "<NODEAGENT_COMPONENT>/<node>" (the allocator leaves nodes out whose Lease goes stale).
NODEAGENT_COMPONENT: Final = "instaslice-nodeagent"
AGENT_LEASE_DURATION_S: Final = 40  # its default `leaseDurationSeconds`, renewed every quarter
# Leases (leader election, agent heartbeats) are coordination.k8s.io/v1 objects.
LEASE_API_VERSION: Final = "coordination.k8s.io/v1"

# Node labels written by KWOK specs / GPU discovery.
GPU_MODEL_LABEL: Final = "instaslice.io/gpu-model"
GPU_COUNT_LABEL: Final = "instaslice.io/gpu-count"
# Set by an operator on a node: the MIG mode its idle Hopper+ GPUs rest in (enabled, disabled,
# or any = left as the last allocation needed; docs/nodeagent.md "Resting mode").
IDLE_MIG_MODE_LABEL: Final = "instaslice.io/idle-mig-mode"
# MigNode status.gpus[].modeChange.reason of a maintenance ask the node agent gave up (its drain
# ran past --maintenance-drain-timeout-s): the only Failed that frees the GPU while it is asked
DRAIN_TIMED_OUT: Final = "DrainTimedOut"


class EventReason(enum.StrEnum):
    """Every reason of an event InstaSlice emits (docs/contract.md §4), the one list: the event
    writers (common.events) take only these, and `kubectl instaslice gather` keeps the
    events that carry them, so a new reason cannot be left out of a bug report."""

    # on pods
    SLICE_ALLOCATED = "SliceAllocated"
    SLICE_READY = "SliceReady"
    SLICE_RELEASED = "SliceReleased"
    ALLOCATION_PENDING = "AllocationPending"
    PINNED_UNSCHEDULABLE = "PinnedUnschedulable"
    PREEMPTING = "Preempting"  # on a preemptor: the victims it evicts
    PREEMPTED = "Preempted"  # on each victim: the preemptor it made room for
    SLICE_CREATE_FAILED = "SliceCreateFailed"
    SLICE_LOST = "SliceLost"
    SLICE_IN_USE = "SliceInUse"
    GPU_UNHEALTHY = "GPUUnhealthy"
    SCALE_UP_REQUESTED = "ScaleUpRequested"  # a signal was raised for this pod
    SCALE_UP_FAILED = "ScaleUpFailed"  # the autoscaler said it cannot
    SCALE_UP_PROVISIONED = "ScaleUpProvisioned"  # a ProvisioningRequest is Provisioned
    # on MigNodes
    GPU_OUT_OF_BOUNDS = "GpuOutOfBounds"  # GPUs beyond the bounds above, left unused
    MIG_MODE_DRAIN_TIMED_OUT = "MigModeDrainTimedOut"  # a maintenance ask given up
    BASE_CDI_SPEC_NOT_FOUND = "BaseCdiSpecNotFound"  # the reasons of a False node condition
    DEVICE_PLUGIN_ACTIVE = "DevicePluginActive"
    MIG_MANAGER_ACTIVE = "MigManagerActive"
    FOREIGN_INSTANCES = "ForeignInstances"


REASON_ALLOCATED: Final = EventReason.SLICE_ALLOCATED
REASON_READY: Final = EventReason.SLICE_READY
REASON_RELEASED: Final = EventReason.SLICE_RELEASED
REASON_PENDING: Final = EventReason.ALLOCATION_PENDING
REASON_PINNED_UNSCHEDULABLE: Final = EventReason.PINNED_UNSCHEDULABLE
REASON_PREEMPTING: Final = EventReason.PREEMPTING
REASON_PREEMPTED: Final = EventReason.PREEMPTED
REASON_GPU_OUT_OF_BOUNDS: Final = EventReason.GPU_OUT_OF_BOUNDS


def cdi_device_name(namespace: str, claim: str, container: str) -> str:
    """The unqualified CDI device name of one container's slices."""
    return f"{namespace}_{claim}_{container}"


def qualified_cdi_device(namespace: str, claim: str, container: str) -> str:
    """`instaslice.io/mig=<ns>_<claim>_<container>`, what NVIDIA_VISIBLE_DEVICES carries."""
    return f"{CDI_KIND}={cdi_device_name(namespace, claim, container)}"
