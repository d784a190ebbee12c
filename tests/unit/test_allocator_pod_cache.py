"""What the allocator keeps of each cached pod (`pods.slim`, the pods informer's transform).

Covers: a realistic 10 KB pod that InstaSlice does not serve is cut to a few hundred bytes,
and every reader the allocator applies to cached pods answers the same on it (identity,
phase, deletion, binding, pin, PodScheduled, cpu / memory with init containers, sidecars and
overhead); the cut is idempotent; our own pods (claim or gate) are kept whole; the node
charges of a ClusterState fed slim pods equal those of one fed whole pods.
Leaves out: the memory it saves (`python -m bench.pod_cache`) and the informer's paging
(tests/integration/test_informer.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.pod_cache import gpu_pod, realistic_pod
from common.constants import GATE_NAME, SCALE_UP_LABEL
from common.placeholders import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PLACEHOLDER_PRIORITY_CLASS,
    is_placeholder,
    signal_name,
)
from testkit.builders import make_pod
from webhook.allocator import handlers
from webhook.allocator import pods as podlib
from webhook.allocator.state import ClusterState

Obj = dict[str, Any]

READERS = (
    podlib.uid,
    podlib.key,
    podlib.claim,
    podlib.gates,
    podlib.priority,
    podlib.created,
    podlib.is_terminal,
    podlib.is_deleting,
    podlib.bound_node,
    podlib.pinned_node,
    podlib.is_unschedulable,
    podlib.pod_resources,
    podlib.uses_name_field,
    is_placeholder,
)


def _variants() -> list[Obj]:
    plain = realistic_pod(7, "node-3")
    pending = realistic_pod(8, "")
    del pending["spec"]["nodeName"]
    pending["status"] = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"},
            {"type": "Ready", "status": "False"},
        ],
    }
    pending["spec"]["schedulingGates"] = [{"name": "kueue.x-k8s.io/admission"}]
    pinned = realistic_pod(9, "")
    pinned["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}
                ]
            }
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }
    pinned["metadata"]["deletionTimestamp"] = "2026-12-01T11:00:00Z"
    pinned["spec"]["priority"] = 1000
    pinned["spec"]["overhead"] = {"cpu": "50m", "memory": "20Mi"}
    pinned["spec"]["initContainers"] = [
        {**pinned["spec"]["containers"][0], "name": "setup"},
        {**pinned["spec"]["containers"][1], "name": "proxy", "restartPolicy": "Always"},
    ]
    done = realistic_pod(10, "node-1")
    done["status"]["phase"] = "Succeeded"
    bare = {"metadata": {"name": "bare", "namespace": "x", "uid": "u"}, "spec": {}}
    placeholder = realistic_pod(12, "node-2")  # an autoscaler placeholder of ours, bound
    meta = placeholder["metadata"]
    meta["name"] = signal_name("u-gated")
    meta["labels"].update({SCALE_UP_LABEL: "u-gated", MANAGED_BY_LABEL: MANAGED_BY})
    meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Pod", "name": "g", "uid": "u-gated"}]
    placeholder["spec"]["priorityClassName"] = PLACEHOLDER_PRIORITY_CLASS
    labelled = realistic_pod(13, "node-2")  # a tenant's pod carrying the label: no placeholder
    labelled["metadata"]["labels"][SCALE_UP_LABEL] = "u-gated"
    return [plain, pending, pinned, done, bare, placeholder, labelled]


@pytest.mark.parametrize(
    "pod",
    _variants(),
    ids=["running", "gated", "pinned", "done", "bare", "placeholder", "labelled"],
)
def test_a_pod_we_do_not_serve_is_cut_to_what_every_reader_reads(pod: Obj) -> None:
    cut = podlib.slim(pod)
    for read in READERS:
        assert read(cut) == read(pod), read.__name__
    assert podlib.slim(cut) == cut  # idempotent: the informer may apply it again
    assert "managedFields" not in cut["metadata"]
    labels = {SCALE_UP_LABEL: "u-gated", MANAGED_BY_LABEL: MANAGED_BY}
    assert cut["metadata"].get("labels") == (labels if is_placeholder(pod) else None)
    assert len(json.dumps(cut)) < 1500 < len(json.dumps(pod)) or pod["metadata"]["name"] == "bare"


def test_a_realistic_pod_shrinks_tenfold() -> None:
    pod = realistic_pod(1, "node-0")
    assert 10_000 <= len(json.dumps(pod)) <= 15_000  # the real pod size
    assert len(json.dumps(handlers._cached_pod(pod))) * 10 < len(json.dumps(pod))


@pytest.mark.parametrize(
    "pod",
    [
        gpu_pod(1),
        make_pod("claimed", gates=()),  # ungated already: still ours (its claim)
        make_pod("gated", claim=None, gates=(GATE_NAME,)),
    ],
    ids=["gpu", "claim", "gate"],
)
def test_our_pods_are_kept_whole_less_managed_fields(pod: Obj) -> None:
    assert podlib.slim(pod) is pod
    kept = handlers._cached_pod(pod)
    assert "managedFields" not in kept["metadata"]
    assert kept["spec"] == pod["spec"]


def test_node_charges_are_the_same_with_slim_pods() -> None:
    whole, cut = ClusterState(), ClusterState()
    for i, pod in enumerate([*_variants()[:4], _variants()[6], realistic_pod(11, "node-3")]):
        pod["metadata"]["uid"] = f"u{i}"
        whole.upsert_pod(pod)
        cut.upsert_pod(podlib.slim(pod))
    for node in ("node-1", "node-2", "node-3", "n2"):
        assert cut.usage(node) == whole.usage(node)
    assert cut.usage("node-3").cpu_millis > 0
    assert cut.usage("node-2").cpu_millis > 0  # the labelled tenant pod is charged
