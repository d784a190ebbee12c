"""Karpenter's KWOK provider against the local control plane, for autoscaled node groups.

A spec group with `count: 0` and `autoscaled: {max: N}` (docs/contract.md §5) starts with no
nodes; Karpenter (`sigs.k8s.io/karpenter/kwok`, built by hack/karpenter/build.sh) makes them.
This module turns the groups into what Karpenter reads:

- one instance type per group (`instance_types`: the JSON file the KWOK provider takes in
  INSTANCE_TYPES_FILE_PATH) whose capacity is the group's cpu/memory/pods plus what its
  GPUs will advertise by the node agent's `nodeagent.report.capacity` rule: the
  `instaslice.io/mig-*` upper bound (each profile's max count times GPUs, for GPUs in MIG
  mode or whose agent turns it on without a reset: Hopper and newer) and `instaslice.io/gpu`
  (the GPUs that can be whole: MIG off, or turned off without a reset; an Ampere GPU in MIG
  mode only with a reset, which the agent does not count), so Karpenter's bin packing of
  placeholder pods sees what a new node offers;
- one NodePool per group (`karpenter_objects`), restricted to that instance type, labelling
  its nodes with the group (`GROUP_LABEL`), GPU model, count and MIG mode, capped at
  `max` nodes (`limits.nodes` and `limits.cpu`), consolidating empty nodes after
  `consolidate_after`;
- a KWOKNodeClass `default`.

The provider creates a Node object per NodeClaim (annotated for KWOK, which then runs it);
`hack.cluster.autonodes` serves each such node with an emulated node agent.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from common.catalog import Catalog, GpuModel
from common.constants import GPU_COUNT_LABEL, GPU_MODEL_LABEL, INSTASLICE_GPU
from common.profiles import ProfileNameError, instaslice_resource
from hack.cluster.nodes import MIG_MODE_LABEL, NodeGroup, SpecError

REPO: Final = Path(__file__).resolve().parents[2]
BUILD: Final = REPO / "hack" / "karpenter" / "build.sh"
GROUP_LABEL: Final = "instaslice.io/node-group"
NODE_CLASS: Final = "default"
ZONE: Final = "test-zone-a"
CRD_NAMES: Final = (
    "nodepools.karpenter.sh",
    "nodeclaims.karpenter.sh",
    "nodeoverlays.karpenter.sh",
    "kwoknodeclasses.karpenter.kwok.sh",
)


def karpenter_dir() -> Path:
    """The built Karpenter (bin/karpenter-kwok, crds/); raises when not built."""
    out = subprocess.run([str(BUILD), "--print-dir"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"Karpenter is not built: {out.stderr.strip()} (make kube-bins)")
    return Path(out.stdout.strip())


def instance_type_name(group: NodeGroup) -> str:
    return f"{group.prefix}-{group.gpus}x-{group.model.lower()}"


def mig_capacity(group: NodeGroup, catalog: Catalog) -> dict[str, str]:
    """`instaslice.io/mig-<profile>` → what a node of `group` will advertise."""
    model = _model(group, catalog)
    if group.mig_mode != "enabled" and model.resets_for_mig_mode:
        return {}  # MIG off on Ampere: only a reset turns it on, which the agent never does
    total: dict[str, int] = {}
    for p in model.profiles:
        try:
            res = instaslice_resource(p.name)
        except ProfileNameError:
            continue
        total[res] = total.get(res, 0) + p.max_count * group.gpus
    return {k: str(v) for k, v in sorted(total.items())}


def whole_capacity(group: NodeGroup, catalog: Catalog) -> dict[str, str]:
    """`instaslice.io/gpu` → what a node of `group` will advertise (none when no GPU of it
    can be whole: MIG on, on Ampere)."""
    if group.mig_mode == "enabled" and _model(group, catalog).resets_for_mig_mode:
        return {}
    return {INSTASLICE_GPU: str(group.gpus)}


def _model(group: NodeGroup, catalog: Catalog) -> GpuModel:
    model = catalog.model(group.model)
    if model is None:
        raise SpecError(f"group {group.prefix}: {group.model!r} is not a catalog model")
    return model


def instance_types(groups: Sequence[NodeGroup], catalog: Catalog) -> list[dict[str, Any]]:
    """The KWOK provider's instance-types file for `groups` (one type each)."""
    out = []
    for g in groups:
        resources = {"cpu": g.cpu, "memory": g.memory, "pods": str(g.pods)}
        resources |= mig_capacity(g, catalog) | whole_capacity(g, catalog)
        out.append(
            {
                "name": instance_type_name(g),
                "architecture": "amd64",
                "operatingSystems": ["linux"],
                "resources": resources,
                "offerings": [
                    {
                        "Price": 1.0,
                        "Available": True,
                        "Requirements": [
                            {
                                "key": "karpenter.sh/capacity-type",
                                "operator": "In",
                                "values": ["on-demand"],
                            },
                            {
                                "key": "topology.kubernetes.io/zone",
                                "operator": "In",
                                "values": [ZONE],
                            },
                        ],
                    }
                ],
            }
        )
    return out


def _cpu_millis(q: str) -> int:
    return int(q[:-1]) if q.endswith("m") else int(float(q) * 1000)


def karpenter_objects(
    groups: Sequence[NodeGroup], consolidate_after: str = "5s"
) -> list[dict[str, Any]]:
    """KWOKNodeClass `default` and one NodePool per autoscaled group."""
    objs: list[dict[str, Any]] = [
        {
            "apiVersion": "karpenter.kwok.sh/v1alpha1",
            "kind": "KWOKNodeClass",
            "metadata": {"name": NODE_CLASS},
            "spec": {},
        }
    ]
    for g in groups:
        assert g.autoscaled_max is not None
        labels = {
            **g.labels,
            GROUP_LABEL: g.prefix,
            GPU_MODEL_LABEL: g.model,
            GPU_COUNT_LABEL: str(g.gpus),
            MIG_MODE_LABEL: g.mig_mode,
        }
        template_spec: dict[str, Any] = {
            "nodeClassRef": {
                "group": "karpenter.kwok.sh",
                "kind": "KWOKNodeClass",
                "name": NODE_CLASS,
            },
            "requirements": [
                {
                    "key": "node.kubernetes.io/instance-type",
                    "operator": "In",
                    "values": [instance_type_name(g)],
                }
            ],
            "expireAfter": "Never",
        }
        if g.taints:
            template_spec["taints"] = [
                {"key": t.key, "value": t.value, "effect": t.effect} for t in g.taints
            ]
        objs.append(
            {
                "apiVersion": "karpenter.sh/v1",
                "kind": "NodePool",
                "metadata": {"name": g.prefix},
                "spec": {
                    "template": {"metadata": {"labels": labels}, "spec": template_spec},
                    # Both, measured: `nodes` alone let one batch launch past it; `cpu` alone
                    # let later batches past it (a KWOK node's capacity is the requests it
                    # was made for, so the pool's cpu usage undercounts)
                    "limits": {
                        "nodes": str(g.autoscaled_max),
                        "cpu": f"{_cpu_millis(g.cpu) * g.autoscaled_max}m",
                    },
                    "disruption": {
                        "consolidationPolicy": "WhenEmptyOrUnderutilized",
                        "consolidateAfter": consolidate_after,
                        "budgets": [{"nodes": "100%"}],
                    },
                },
            }
        )
    return objs


def karpenter_env(
    kubeconfig: Path, instance_types_file: Path, metrics_port: int, health_port: int
) -> dict[str, str]:
    """The environment the provider runs with (it reads its settings from env)."""
    return dict(
        os.environ,
        KUBECONFIG=str(kubeconfig),
        INSTANCE_TYPES_FILE_PATH=str(instance_types_file),
        SYSTEM_NAMESPACE="kube-system",
        DISABLE_LEADER_ELECTION="true",
        METRICS_PORT=str(metrics_port),
        HEALTH_PROBE_PORT=str(health_port),
        KUBERNETES_MIN_VERSION="1.19.0-0",
        BATCH_IDLE_DURATION="1s",
        BATCH_MAX_DURATION="5s",
        LOG_LEVEL="info",
    )
