"""The allocator's pod cache against real pod sizes: RSS with 30 000 ordinary pods.

The allocator watches every active pod of the cluster (it charges their cpu / memory to
their nodes). Real pods are 10-15 KB of JSON — managedFields, env, volumes, probes, status
— and the webhook/allocator container has a memory limit. This benchmark runs the
allocator's own pod informer (`common.kubeapi.Informer`, its transform and page size) and
its `ClusterState.upsert_pod` handler in a fresh process, against a stand-in for the API
server that serves `--pods` realistic non-GPU pods plus `--gpu-pods` InstaSlice pods
(gated, with our claim) as the API server would: JSON bytes, page by page (`limit` /
`continue`), decoded with `json.loads` as `Kube.request` decodes them. It records the
process's RSS before the list (imports done), after it (cache full, after a GC) and its
peak (`VmHWM`), and the list's CPU seconds, for:

- `before`: the code before issue 25 — one unpaginated list, pods kept whole less their
  managedFields (`lean`);
- `after`: what the allocator runs now — pages of 500, ordinary pods slimmed to what
  placement reads (`pods.slim`), ours kept whole.

What it leaves out: the allocator's other informers (Nodes, MigNodes, allocations: their
cost per node and GPU is measured by `bench.latency`'s scale scenario), the TLS and HTTP
buffers of a real connection, and watch events after the list. Writes the `memory` entry
of `.dev/bench/latency.json` (merged into the file when it exists).

    python -m bench.pod_cache                       # 30 000 + 1 000 pods, both modes
    python -m bench.pod_cache --pods 3000 --quick   # seconds
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

Obj = dict[str, Any]
OUT = Path(".dev/bench/latency.json")
PAGE_SIZE = 500  # the Informer's default


def _managed_fields(name: str) -> list[Obj]:
    """server-side apply's bookkeeping as kubelet and a controller leave it: a large share
    of a real pod's JSON."""
    spec_fields: Obj = {
        f"f:{k}": {}
        for k in (
            "dnsPolicy",
            "enableServiceLinks",
            "restartPolicy",
            "schedulerName",
            "securityContext",
            "terminationGracePeriodSeconds",
            "serviceAccountName",
        )
    }
    containers = {
        f'k:{{"name":"{c}"}}': {
            ".": {},
            "f:env": {
                f'k:{{"name":"ENV_{i}"}}': {".": {}, "f:name": {}, "f:value": {}} for i in range(12)
            },
            "f:image": {},
            "f:imagePullPolicy": {},
            "f:livenessProbe": {".": {}, "f:httpGet": {".": {}, "f:path": {}, "f:port": {}}},
            "f:name": {},
            "f:ports": {'k:{"containerPort":8080,"protocol":"TCP"}': {".": {}}},
            "f:resources": {".": {}, "f:limits": {}, "f:requests": {}},
            "f:volumeMounts": {f'k:{{"mountPath":"/v{i}"}}': {".": {}} for i in range(4)},
        }
        for c in ("app", "sidecar")
    }
    return [
        {
            "manager": "kube-controller-manager",
            "operation": "Update",
            "apiVersion": "v1",
            "time": "2026-12-01T10:00:00Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": {
                "f:metadata": {
                    "f:generateName": {},
                    "f:labels": {".": {}, "f:app": {}, "f:pod-template-hash": {}},
                    "f:ownerReferences": {".": {}, f'k:{{"uid":"{name}"}}': {}},
                },
                "f:spec": {"f:containers": containers, **spec_fields},
            },
        },
        {
            "manager": "kubelet",
            "operation": "Update",
            "apiVersion": "v1",
            "time": "2026-12-01T10:00:05Z",
            "fieldsType": "FieldsV1",
            "subresource": "status",
            "fieldsV1": {
                "f:status": {
                    "f:conditions": {
                        f'k:{{"type":"{t}"}}': {
                            ".": {},
                            "f:lastProbeTime": {},
                            "f:lastTransitionTime": {},
                            "f:status": {},
                            "f:type": {},
                        }
                        for t in ("ContainersReady", "Initialized", "PodScheduled", "Ready")
                    },
                    "f:containerStatuses": {},
                    "f:hostIP": {},
                    "f:phase": {},
                    "f:podIP": {},
                    "f:startTime": {},
                }
            },
        },
    ]


def _container(name: str, i: int) -> Obj:
    return {
        "name": name,
        "image": f"registry.example.com/team-{i % 40}/{name}:v1.{i % 17}.3",
        "imagePullPolicy": "IfNotPresent",
        "env": [{"name": f"ENV_{k}", "value": f"value-{i}-{k}-" + "x" * 24} for k in range(16)],
        "ports": [{"containerPort": 8080, "protocol": "TCP"}],
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": 8080, "scheme": "HTTP"},
            "periodSeconds": 10,
            "timeoutSeconds": 1,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
        "resources": {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "volumeMounts": [{"name": f"vol-{k}", "mountPath": f"/v{k}"} for k in range(4)],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
    }


def realistic_pod(i: int, node: str, *, namespace: str = "apps") -> Obj:
    """An ordinary running pod of a Deployment, about 12 KB of JSON."""
    name = f"web-{i // 100}-7d9f8c6b5-{i:05d}"
    uid = f"00000000-0000-4000-8000-{i:012d}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "generateName": f"web-{i // 100}-7d9f8c6b5-",
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": str(1000 + i),
            "creationTimestamp": "2026-12-01T10:00:00Z",
            "labels": {"app": f"web-{i // 100}", "pod-template-hash": "7d9f8c6b5"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2026-12-01T09:59:00Z"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": f"web-{i // 100}-7d9f8c6b5",
                    "uid": f"11111111-0000-4000-8000-{i // 100:012d}",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
            "managedFields": _managed_fields(uid),
        },
        "spec": {
            "containers": [_container("app", i), _container("sidecar", i)],
            "volumes": [
                {"name": f"vol-{k}", "configMap": {"name": f"cfg-{k}", "defaultMode": 420}}
                for k in range(4)
            ],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "nodeName": node,
            "securityContext": {},
            "schedulerName": "default-scheduler",
            "tolerations": [
                {
                    "key": f"node.kubernetes.io/{t}",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                }
                for t in ("not-ready", "unreachable")
            ],
            "priority": 0,
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
        },
        "status": {
            "phase": "Running",
            "conditions": [
                {
                    "type": t,
                    "status": "True",
                    "lastProbeTime": None,
                    "lastTransitionTime": "2026-12-01T10:00:05Z",
                }
                for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
            ],
            "hostIP": "10.0.0.1",
            "podIP": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}",
            "podIPs": [{"ip": f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}"}],
            "startTime": "2026-12-01T10:00:01Z",
            "qosClass": "Burstable",
            "containerStatuses": [
                {
                    "name": c,
                    "ready": True,
                    "restartCount": 0,
                    "started": True,
                    "image": f"registry.example.com/team-{i % 40}/{c}:v1.{i % 17}.3",
                    "imageID": "registry.example.com/x@sha256:" + "a" * 64,
                    "containerID": "containerd://" + f"{i:064d}",
                    "state": {"running": {"startedAt": "2026-12-01T10:00:03Z"}},
                    "lastState": {},
                }
                for c in ("app", "sidecar")
            ],
        },
    }


def gpu_pod(i: int, *, namespace: str = "gpu") -> Obj:
    """An InstaSlice pod as the webhook leaves it: our gate, our claim, our resource."""
    from common.constants import CLAIM_ANNOTATION, GATE_NAME

    pod = realistic_pod(i, "", namespace=namespace)
    pod["metadata"]["name"] = f"train-{i:05d}"
    pod["metadata"]["uid"] = f"22222222-0000-4000-8000-{i:012d}"
    pod["metadata"]["annotations"][CLAIM_ANNOTATION] = f"c{i:08x}"
    spec = pod["spec"]
    del spec["nodeName"]
    spec["schedulingGates"] = [{"name": GATE_NAME}]
    spec["containers"][0]["resources"]["limits"]["instaslice.io/mig-1g.10gb"] = "1"
    spec["containers"][0]["resources"]["requests"]["instaslice.io/mig-1g.10gb"] = "1"
    pod["status"] = {"phase": "Pending", "qosClass": "Burstable"}
    return pod


class _FakeKube:
    """Serves one pod list the way the API server does: JSON bytes per page."""

    def __init__(self, pods: int, gpu_pods: int, nodes: int) -> None:
        self.pods, self.gpu_pods, self.nodes = pods, gpu_pods, nodes

    def _pod(self, k: int) -> Obj:
        if k < self.pods:
            return realistic_pod(k, f"node-{k % self.nodes}")
        return gpu_pod(k - self.pods)

    async def list_pages(self, path: str, limit: int, **query: Any) -> AsyncIterator[Obj]:
        total = self.pods + self.gpu_pods
        for start in range(0, total, limit):
            items = [self._pod(k) for k in range(start, min(total, start + limit))]
            more = start + limit < total
            meta = {"resourceVersion": "99", **({"continue": str(start + limit)} if more else {})}
            raw = json.dumps(
                {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items}
            )
            del items
            yield json.loads(raw.encode())  # as Kube.request decodes a response
            del raw

    async def watch(self, *args: Any, **kwargs: Any) -> AsyncIterator[tuple[str, Obj]]:
        await asyncio.Event().wait()  # no events after the list
        yield ("BOOKMARK", {})


def status_kib(field: str) -> int:
    """A field of this process's /proc status, in KiB (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


async def _child(mode: str, pods: int, gpu_pods: int, nodes: int) -> Obj:
    import webhook.allocator.controller  # noqa: F401  # the allocator's imports, as its process has
    from common.kubeapi import Informer, lean
    from webhook.allocator import handlers
    from webhook.allocator.state import ClusterState

    state = ClusterState()

    async def handler(etype: str, obj: Obj) -> None:
        if etype == "DELETED":
            state.remove_pod(obj)
        else:
            state.upsert_pod(obj)

    before = mode == "before"
    informer = Informer(
        _FakeKube(pods, gpu_pods, nodes),  # type: ignore[arg-type]
        "/api/v1/pods",
        handler,
        name="pods",
        transform=lean if before else handlers._cached_pod,
        page_size=pods + gpu_pods if before else PAGE_SIZE,
    )
    gc.collect()
    base = status_kib("VmRSS")
    cpu0, wall0 = time.process_time(), time.perf_counter()
    run = asyncio.create_task(informer.run())
    await informer.synced.wait()
    cpu1, wall1 = time.process_time(), time.perf_counter()
    run.cancel()
    gc.collect()
    after = status_kib("VmRSS")
    peak = status_kib("VmHWM")
    assert len(state.pods) == pods + gpu_pods
    usage = sum(state.usage(f"node-{n}").cpu_millis for n in range(nodes))
    cached = [state.pods[u].obj for u in list(state.pods)[: min(200, pods)]]
    return {
        "mode": mode,
        "pods": pods,
        "gpu_pods": gpu_pods,
        "page_size": informer.page_size,
        "rss_before_list_mib": round(base / 1024, 1),
        "rss_after_list_mib": round(after / 1024, 1),
        "peak_rss_mib": round(peak / 1024, 1),
        "cache_mib": round((after - base) / 1024, 1),
        "bytes_per_pod": round((after - base) * 1024 / (pods + gpu_pods)),
        "list_cpu_s": round(cpu1 - cpu0, 2),
        "list_wall_s": round(wall1 - wall0, 2),
        "charged_cpu_millis": usage,
        "cached_json_bytes_per_pod": round(
            sum(len(json.dumps(o)) for o in cached) / max(1, len(cached))
        ),
        "max_rss_kib_rusage": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def measure(mode: str, pods: int, gpu_pods: int, nodes: int) -> Obj:
    """One mode in a fresh interpreter (RSS is a process's, and never shrinks back)."""
    cmd = [sys.executable, "-m", "bench.pod_cache", "--child", mode]
    cmd += ["--pods", str(pods), "--gpu-pods", str(gpu_pods), "--nodes", str(nodes)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ.copy())
    result: Obj = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pod_cache", description=__doc__)
    parser.add_argument("--pods", type=int, default=30_000, help="ordinary (non-GPU) pods")
    parser.add_argument("--gpu-pods", type=int, default=1000, help="InstaSlice pods")
    parser.add_argument("--nodes", type=int, default=1000, help="nodes the pods run on")
    parser.add_argument("--modes", default="before,after", help="before, after or both")
    parser.add_argument("--out", type=Path, default=OUT, help="JSON to merge `memory` into")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.pods < 1 or args.gpu_pods < 0 or args.nodes < 1:
        parser.error("--pods and --nodes must be at least 1, --gpu-pods at least 0")
    if args.child:
        print(json.dumps(asyncio.run(_child(args.child, args.pods, args.gpu_pods, args.nodes))))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("before", "after") for m in modes):
        parser.error(f"--modes: expected before and/or after, got {args.modes!r}")
    load = os.getloadavg()
    entry: Obj = {
        "method": "bench.pod_cache: the allocator's pod Informer + ClusterState in a fresh "
        "process, pods served as JSON pages by a stand-in API server",
        "load_start": round(load[0], 2),
    }
    for mode in modes:
        entry[mode] = measure(mode, args.pods, args.gpu_pods, args.nodes)
        print(json.dumps(entry[mode]))
    entry["load_end"] = round(os.getloadavg()[0], 2)
    write_entry(args.out, "memory", entry)
    return 0


def write_entry(out: Path, key: str, entry: Obj) -> None:
    """Merge `entry` into the JSON file `out` as `key` (the file made if missing)."""
    doc: Obj = json.loads(out.read_text()) if out.exists() else {}
    doc[key] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote the {key} entry of {out}")


if __name__ == "__main__":
    raise SystemExit(main())
