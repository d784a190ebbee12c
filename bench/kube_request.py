"""CPU per API request in our client (`common.kubeapi.Kube`), without an API server.

A local HTTP/1.1 server in another process answers every request with its own body (an API
server answers a write with the object, about the size of what was sent), keep-alive, no
TLS; this process sends `--requests` of each kind one after another and reports the CPU
seconds it spent per request (`time.process_time`: the client only). The kinds are the
node agent's and the allocator's per-pod writes in a burst, with bodies of their real size:

- `pod PUT` (the pin: a whole pod, ~1.9 KB), `SliceAllocation status PATCH` (`Creating`
  and `Ready`, ~0.2 KB), `event POST` (~0.6 KB), `MigNode status PATCH` (8 GPUs with
  placements, ~18 KB, the size of a real one in the burst: 17-23 KB).

`--root DIR` imports `common.kubeapi` from another checkout (e.g. `git archive` of main),
so one command compares two versions of the client on the same machine, back to back:

    python -m bench.kube_request                       # this checkout
    python -m bench.kube_request --root /tmp/main-src  # another one
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_SERVER = r"""
import asyncio, sys
async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await reader.readexactly(length) if length else b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def _gpu(i: int) -> dict[str, Any]:
    placements = [
        {"profile": p, "start": s, "size": z}
        for p, s, z in [("1g.10gb", k, 1) for k in range(7)]
        + [("2g.20gb", k, 2) for k in (0, 2, 4)]
        + [("3g.40gb", k, 4) for k in (0, 4)]
        + [("7g.80gb", 0, 8)]
    ]
    return {
        "index": i,
        "uuid": f"GPU-{i:08d}-1111-2222-3333-444455556666",
        "model": "NVIDIA H100 80GB HBM3",
        "migMode": "enabled",
        "healthy": True,
        "memoryMiB": 81559,
        "profiles": [
            {"name": p["profile"], "id": 19 + k, "free": 7 - k % 7, "placements": [placements[k]]}
            for k, p in enumerate(placements)
        ],
        "instances": [
            {
                "profile": "1g.10gb",
                "start": k,
                "size": 1,
                "giID": 9 + k,
                "ciID": 0,
                "uuid": f"MIG-{i:04d}{k:04d}-aaaa-bbbb-cccc-ddddeeeeffff",
                "claim": f"bench/claim-{i}-{k}",
            }
            for k in range(6)
        ],
    }


def bodies() -> dict[str, tuple[str, str, Any, str]]:
    """kind → (method, path, body, patch kind or "")."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "burst-000123",
            "namespace": "bench",
            "uid": "0d6f" * 9,
            "resourceVersion": "123456",
            "creationTimestamp": "2026-12-02T03:00:00Z",
            "labels": {"app": "burst"},
            "annotations": {"instaslice.io/claim": "c-5b2f0e9a"},
        },
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {
                        "limits": {"instaslice.io/mig-1g.10gb": "1"},
                        "requests": {
                            "cpu": "10m",
                            "memory": "16Mi",
                            "instaslice.io/mig-1g.10gb": "1",
                        },
                    },
                    "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
                    "volumeMounts": [
                        {
                            "name": "kube-api-access-x1",
                            "readOnly": True,
                            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                        }
                    ],
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File",
                    "imagePullPolicy": "IfNotPresent",
                }
            ],
            "schedulingGates": [{"name": "instaslice.io/allocation"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {
                                        "key": "metadata.name",
                                        "operator": "In",
                                        "values": ["kwok-node-17"],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "tolerations": [
                {"key": k, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
                for k in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
            ],
            "volumes": [
                {
                    "name": "kube-api-access-x1",
                    "projected": {
                        "defaultMode": 420,
                        "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {
                                "configMap": {
                                    "name": "kube-root-ca.crt",
                                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                }
                            },
                        ],
                    },
                }
            ],
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "schedulerName": "default-scheduler",
            "priority": 0,
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
        },
        "status": {
            "phase": "Pending",
            "qosClass": "Burstable",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "SchedulingGated",
                    "message": "Scheduling is blocked due to non-empty scheduling gates",
                }
            ],
        },
    }
    status = {
        "status": {
            "phase": "Ready",
            "message": "",
            "slices": [
                {
                    "container": "main",
                    "migUUID": "MIG-5b2f0e9a-aaaa-bbbb-cccc-ddddeeeeffff",
                    "gpuUUID": "GPU-00000003-1111-2222-3333-444455556666",
                }
            ],
        }
    }
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": "burst-000123.18b2f0e9a1c2d3e4", "namespace": "bench"},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "burst-000123",
            "namespace": "bench",
            "uid": "0d6f" * 9,
        },
        "reason": "SliceReady",
        "message": "main: MIG-5b2f0e9a-aaaa-bbbb-cccc-ddddeeeeffff",
        "type": "Normal",
        "source": {"component": "instaslice-nodeagent"},
        "reportingComponent": "instaslice-nodeagent",
        "reportingInstance": "kwok-node-17",
        "firstTimestamp": "2026-12-02T03:00:01Z",
        "lastTimestamp": "2026-12-02T03:00:01Z",
        "count": 1,
    }
    mig_node = {
        "status": {
            "agent": {"version": "0.1.0", "heartbeat": "2026-12-02T03:00:01Z"},
            "gpuCount": 8,
            "gpus": [_gpu(i) for i in range(8)],
            "conditions": [{"type": "Ready", "status": "True", "reason": "Published"}],
        }
    }
    return {
        "pod PUT": ("PUT", "/api/v1/namespaces/bench/pods/burst-000123", pod, ""),
        "SliceAllocation status PATCH": (
            "PATCH",
            "/apis/instaslice.io/v1alpha1/namespaces/bench/sliceallocations/c/status",
            status,
            "merge",
        ),
        "event POST": ("POST", "/api/v1/namespaces/bench/events", event, ""),
        "MigNode status PATCH": (
            "PATCH",
            "/apis/instaslice.io/v1alpha1/mignodes/kwok-node-17/status",
            mig_node,
            "merge",
        ),
    }


async def measure(port: int, requests: int, kubeconfig: Path) -> dict[str, Any]:
    from common.kubeapi import Kube

    out: dict[str, Any] = {}
    async with await Kube.connect(str(kubeconfig)) as kube:
        for kind, (method, path, body, patch) in bodies().items():
            for _ in range(20):  # warm: connection, caches
                await _send(kube, method, path, body, patch)
            t0, w0 = time.process_time(), time.perf_counter()
            for _ in range(requests):
                await _send(kube, method, path, body, patch)
            cpu, wall = time.process_time() - t0, time.perf_counter() - w0
            out[kind] = {
                "body_bytes": len(json.dumps(body, separators=(",", ":"))),
                "cpu_us_per_request": round(cpu / requests * 1e6, 1),
                "wall_us_per_request": round(wall / requests * 1e6, 1),
            }
    return out


async def _send(kube: Any, method: str, path: str, body: Any, patch: str) -> None:
    if method == "PATCH":
        await kube.patch(path, body, kind=patch)
    elif method == "PUT":
        await kube.replace(path, body)
    else:
        await kube.create(path, body)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kube_request", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--requests", type=int, default=2000, help="of each kind")
    ap.add_argument("--root", type=Path, default=None, help="import common.kubeapi from DIR")
    ap.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON")
    args = ap.parse_args(argv)
    if args.root is not None:
        sys.path.insert(0, str(args.root.resolve()))
        for name in [m for m in sys.modules if m == "common" or m.startswith("common.")]:
            del sys.modules[name]
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            cfg = Path(tmp) / "kubeconfig"
            cfg.write_text(
                "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
                f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
                "users: [{name: u, user: {token: t}}]\n"
                "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
            )
            doc = asyncio.run(measure(port, args.requests, cfg))
    finally:
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()
    import common.kubeapi

    print(f"client: {common.kubeapi.__file__}")
    for kind, row in doc.items():
        print(
            f"{kind:30} {row['body_bytes']:>6} B  CPU {row['cpu_us_per_request']:>7.1f} us/request"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
