"""`kubectl instaslice gather`: one archive with what a bug report needs (must-gather style).

Runs `kubectl` (the one that invoked the plugin, or `--kubectl`), so it sees exactly what
the user's context and credentials see, and collects into `instaslice-gather-<time>.tar.gz`:
InstaSlice's objects (MigNodes, SliceAllocations, CRDs, admission hooks and policies,
everything in its namespace except Secrets), the GPU nodes, pods waiting behind InstaSlice's
gate, InstaSlice's events, the logs (current and previous) of the webhook and node-agent
pods, the GPU Operator's ClusterPolicy when there is one, and from each node agent's pod
(`kubectl exec`) what the node itself shows: `instaslice-nodeagent --discover-only` (the GPUs,
MIG modes and instances NVML reports) and the listing of the CDI directories. InstaSlice's
namespace is a parameter (`gather -n`, default instaslice-system). A command the user may
not run (RBAC) is noted in `errors.txt` and the rest goes on:
a partial archive is still a useful one. Secrets are never collected; logs and objects may
still name pods and namespaces, so look before sharing.
"""

from __future__ import annotations

import datetime as dt
import json
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from common.constants import GATE_NAME, EventReason
from common.kubectl import Run

NAMESPACE = "instaslice-system"
AGENT_SELECTOR = "app.kubernetes.io/name=instaslice-nodeagent"
AGENT_CONTAINER = "nodeagent"
# the node agent's --cdi-dir and the read-only place nvidia-ctk also writes (its DaemonSet)
CDI_DIRS = ("/var/run/cdi", "/etc/cdi")
CLUSTER_POLICY = "clusterpolicies.nvidia.com"
PART_OF = "app.kubernetes.io/part-of=instaslice"
# Event reasons InstaSlice emits: derived from the one list (common.constants.EventReason),
# so a reason added there is gathered without a second edit here
EVENT_REASONS = frozenset(str(r) for r in EventReason)


@dataclass
class Gather:
    """Collects files under `root`; each `kubectl` failure is recorded, never raised."""

    run: Run
    root: Path
    errors: list[str] = field(default_factory=list)

    def kubectl(self, path: str, *args: str) -> str | None:
        proc = self.run(args)
        if proc.returncode != 0:
            self.errors.append(f"{path}: kubectl {' '.join(args)}: {proc.stderr.strip()}")
            return None
        self.write(path, proc.stdout)
        return proc.stdout

    def write(self, path: str, text: str) -> None:
        dest = self.root / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)


def instaslice_events(events_json: str, namespace: str = NAMESPACE) -> list[dict[str, object]]:
    """The events InstaSlice emitted or that concern its objects, oldest first."""
    items = json.loads(events_json).get("items", [])
    ours = [
        e
        for e in items
        if e.get("reason") in EVENT_REASONS
        or str((e.get("source") or {}).get("component", "")).startswith("instaslice")
        or str(e.get("reportingComponent", "")).startswith("instaslice")
        or (e.get("involvedObject") or {}).get("namespace") == namespace
    ]
    return sorted(ours, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))


def gated_pods(pods_json: str, gate: str = GATE_NAME) -> list[str]:
    items = json.loads(pods_json).get("items", [])
    return [
        f"{p['metadata']['namespace']}/{p['metadata']['name']}"
        for p in items
        if any(g.get("name") == gate for g in p["spec"].get("schedulingGates") or [])
    ]


def collect_node_side(g: Gather, namespace: str) -> None:
    """What only the nodes know, through each node agent's pod: its discovery report and the
    CDI directories. A pod that cannot be exec'd into (not running, RBAC) is an error line."""
    pods = g.run(["-n", namespace, "get", "pods", "-l", AGENT_SELECTOR, "-o", "json"])
    if pods.returncode != 0:
        g.errors.append(f"nodes/: node agent pods: {pods.stderr.strip()}")
        return
    for pod in json.loads(pods.stdout).get("items", []):
        name = pod["metadata"]["name"]
        node = pod.get("spec", {}).get("nodeName") or f"unscheduled-{name}"
        exec_ = ["-n", namespace, "exec", name, "-c", AGENT_CONTAINER, "--"]
        g.kubectl(f"nodes/{node}/discover.txt", *exec_, "instaslice-nodeagent", "--discover-only")
        g.kubectl(f"nodes/{node}/cdi.txt", *exec_, "ls", "-la", *CDI_DIRS)


def collect_gpu_operator(g: Gather) -> None:
    """The GPU Operator's ClusterPolicy (its MIG manager and device plugin settings decide
    what InstaSlice may do); its absence is a fact, not an error."""
    proc = g.run(["get", CLUSTER_POLICY, "-o", "yaml"])
    if proc.returncode == 0:
        g.write("gpu-operator/clusterpolicy.yaml", proc.stdout)
    elif "doesn't have a resource type" in proc.stderr:
        g.write("gpu-operator/clusterpolicy.yaml", "# no ClusterPolicy CRD: no GPU Operator\n")
    else:
        g.errors.append(f"gpu-operator/clusterpolicy.yaml: {proc.stderr.strip()}")


def collect(g: Gather, tail: int, namespace: str = NAMESPACE) -> None:
    g.kubectl("cluster/version.yaml", "version", "-o", "yaml")
    g.kubectl("cluster/nodes.txt", "get", "nodes", "-o", "wide")
    g.kubectl("cluster/gpu-nodes.yaml", "get", "nodes", "-l", "nvidia.com/mig.capable=true",
              "-o", "yaml")  # fmt: skip
    g.kubectl("instaslice/mignodes.yaml", "get", "mignodes.instaslice.io", "-o", "yaml")
    g.kubectl("instaslice/sliceallocations.yaml", "get", "sliceallocations.instaslice.io", "-A",
              "-o", "yaml")  # fmt: skip
    g.kubectl("instaslice/crds.yaml", "get", "crd", "sliceallocations.instaslice.io",
              "mignodes.instaslice.io", "-o", "yaml")  # fmt: skip
    g.kubectl("instaslice/admission.yaml", "get",
              "mutatingwebhookconfigurations,validatingadmissionpolicies,"
              "validatingadmissionpolicybindings", "-l", PART_OF, "-o", "yaml")  # fmt: skip
    g.kubectl(f"namespace/{namespace}.yaml", "-n", namespace, "get",
              "deployments,daemonsets,pods,services,configmaps,leases,endpoints,"
              "poddisruptionbudgets,networkpolicies", "-o", "yaml")  # fmt: skip
    pods = g.kubectl("cluster/pods.json", "get", "pods", "-A", "-o", "json")
    if pods is not None:
        g.write("instaslice/gated-pods.txt", "\n".join(gated_pods(pods)) + "\n")
        (g.root / "cluster/pods.json").unlink()  # every pod of the cluster: too much to share
    events = g.kubectl("events.json", "get", "events", "-A", "-o", "json")
    if events is not None:
        g.write(
            "instaslice/events.json", json.dumps(instaslice_events(events, namespace), indent=1)
        )
        (g.root / "events.json").unlink()
    names = g.kubectl("logs/pods.txt", "-n", namespace, "get", "pods", "-o", "name")
    for name in (names or "").split():
        pod = name.removeprefix("pod/")
        g.kubectl(f"logs/{pod}.log", "-n", namespace, "logs", name, "--all-containers",
                  f"--tail={tail}", "--timestamps")  # fmt: skip
        previous = g.run(["-n", namespace, "logs", name, "--all-containers", "--previous",
                          f"--tail={tail}", "--timestamps"])  # fmt: skip
        if previous.returncode == 0 and previous.stdout:
            g.write(f"logs/{pod}.previous.log", previous.stdout)
    collect_gpu_operator(g)
    collect_node_side(g, namespace)


def gather(
    run: Run,
    dest: Path | None,
    tail: int = 2000,
    now: dt.datetime | None = None,
    namespace: str = NAMESPACE,
) -> Path:
    """Collect and pack; returns the archive's path."""
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    name = f"instaslice-gather-{stamp}"
    archive = dest or Path(f"{name}.tar.gz")
    with tempfile.TemporaryDirectory() as tmp:
        g = Gather(run, Path(tmp) / name)
        g.root.mkdir()
        collect(g, tail, namespace)
        g.write("errors.txt", "\n".join(g.errors) + ("\n" if g.errors else ""))
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(g.root, arcname=name)
    return archive
