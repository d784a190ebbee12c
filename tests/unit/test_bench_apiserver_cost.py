"""`bench.apiserver_cost`'s request bodies and CRD variants (pure parts; the benchmark itself
needs a control plane and prints numbers, nothing here times anything): each variant is the
shipped SliceAllocation CRD in its own API group with only its named change, and the bodies
are the ones InstaSlice's code builds."""

from __future__ import annotations

import json

from bench import apiserver_cost as ac
from bench import apiserver_pprof as ap


def _spec_schema(crd: ac.Obj) -> ac.Obj:
    schema: ac.Obj = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec: ac.Obj = schema["properties"]["spec"]
    return spec


def test_shipped_is_the_manifest_and_variants_live_in_their_own_groups() -> None:
    shipped = ac.variant_crd("shipped")
    assert shipped == ac.shipped_crd()
    assert shipped["spec"]["group"] == "instaslice.io"
    assert _spec_schema(shipped)["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    for name in ac.VARIANTS:
        if name == "shipped":
            continue
        crd = ac.variant_crd(name)
        assert crd["spec"]["group"] == f"{name}.{ac.COST_GROUP}"
        assert crd["metadata"]["name"] == f"sliceallocations.{name}.{ac.COST_GROUP}"
        assert crd["spec"]["names"] == shipped["spec"]["names"]
        assert ac.alloc_api(name) == f"{name}.{ac.COST_GROUP}/v1alpha1"


def test_rule_variants_change_only_the_rule() -> None:
    shipped = _spec_schema(ac.variant_crd("shipped"))
    norule = _spec_schema(ac.variant_crd("norule"))
    assert "x-kubernetes-validations" not in norule
    assert {**norule, "x-kubernetes-validations": shipped["x-kubernetes-validations"]} == shipped
    fields = _spec_schema(ac.variant_crd("fields"))
    assert "x-kubernetes-validations" not in fields
    for name, prop in fields["properties"].items():
        assert prop["x-kubernetes-validations"][0]["rule"] == "self == oldSelf", name
    schema = ac.variant_crd("schemaless")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def test_bodies_are_instaslices_own() -> None:
    pod = ac.gated_pod("p", "c1")
    pod["metadata"].update(uid="u1", namespace=ac.NS)
    alloc = ac.allocation("norule", pod, "c1")
    assert alloc["apiVersion"] == ac.alloc_api("norule")
    assert alloc["metadata"]["labels"] == {"instaslice.io/node": ac.NODE}
    assert alloc["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert ac.creating() == {"status": {"phase": "Creating", "message": ""}}
    ready = ac.ready(3)["status"]
    assert ready["phase"] == "Ready" and ready["slices"][0]["migUUID"] == "MIG-3"
    empty, full = ac.mig_node_statuses()
    assert empty["gpuCount"] == 8 and empty != full
    assert len(json.dumps(full)) > 20_000  # the size of a real node's status
    assert {g["name"] for g in pod["spec"]["schedulingGates"]} == {
        "instaslice.io/allocation",
        ac.HOLD_GATE,
    }
    assert "schedulingGates" in ac.plain_pod("q")["spec"]
    assert "annotations" not in ac.plain_pod("q")["metadata"]


TRACES = """File: kube-apiserver
Duration: 40s, Total samples = 5.09s (12.72%)
-----------+-------------------------------------------------------
      30ms   github.com/google/cel-go/interpreter.(*evalOr).Exec
             k8s.io/apiserver/pkg/admission/plugin/policy/validating.(*validator).Validate
             k8s.io/apiserver/pkg/endpoints/handlers.CreateResource.createHandler.func1.2
-----------+-------------------------------------------------------
     1.2s   runtime.mallocgc
             k8s.io/apiserver/pkg/endpoints/handlers.CreateResource.createHandler.func1.2
-----------+-------------------------------------------------------
      10ms   k8s.io/apiserver/pkg/admission/plugin/policy/validating.(*validator).Validate
             k8s.io/apiserver/pkg/endpoints/handlers.(*patcher).patchResource.func2
-----------+-------------------------------------------------------
     500us   runtime.step
             net/http.(*conn).serve
"""


def test_pprof_share_counts_the_policies_inside_the_kinds_handler_only() -> None:
    stacks = ap.traces(TRACES)
    assert [round(v, 4) for v, _ in stacks] == [0.03, 1.2, 0.01, 0.0005]
    assert stacks[1][1] == [
        "runtime.mallocgc",
        "k8s.io/apiserver/pkg/endpoints/handlers.CreateResource.createHandler.func1.2",
    ]
    create = ap.share(TRACES, "create")
    assert (create.path_s, create.policies_s) == (1.23, 0.03)
    assert round(create.fraction, 4) == round(0.03 / 1.23, 4)
    patch = ap.share(TRACES, "patch")
    assert (patch.path_s, patch.policies_s, patch.fraction) == (0.01, 0.01, 1.0)
    assert ap.share(TRACES, "update") == ap.Share(0.0, 0.0)
    assert ap.Share(0.0, 0.0).fraction == 0.0


def test_every_pod_kind_has_a_handler_path() -> None:
    assert set(ac.POD_CASES) <= set(ac.KIND_PATH)
    assert set(ac.KIND_PATH.values()) <= set(ap.HANDLER)
    plain = ac.plain_pod("q")
    assert all(not k.startswith("instaslice.io/") for k in plain["spec"]["containers"][0]
               ["resources"]["limits"])  # fmt: skip
