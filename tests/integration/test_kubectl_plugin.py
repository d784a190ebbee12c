"""`kubectl instaslice` against the real control plane, as an admin and as a tenant.

Covers: `pods -o json|yaml` and `nodes -o json` rows from real MigNode and SliceAllocation
objects; `--context` picks a context other than the kubeconfig's current one (which points
nowhere); `KUBECONFIG` with two files merged as kubectl merges them (the current context set
only in the second), the context's namespace as the default and `-A` for all, `-o wide`,
`--no-headers`; `--as` impersonation and `--request-timeout` reaching the API server;
`version` with the node agents' versions from their MigNodes; kubectl's own completion of
the plugin's arguments through `completion kubectl`'s script; a real
user (client certificate, no admin groups) bound to the default `view` or `edit` role in one
namespace reads that namespace's allocations through the aggregated `instaslice-view`
ClusterRole, is told to use `-n` when asking for all namespaces, and may not change or delete
an allocation; `gather -n NS` writes an archive with InstaSlice's objects and events, the GPU
Operator's ClusterPolicy, and records what it could not read — here the node agent's
`--discover-only` and CDI listing, since its pod cannot run on this control plane.
Leaves out: pod logs and a successful `kubectl exec` into a node agent (no kubelet runs here;
tests/unit/test_kubectl_plugin.py checks the exec commands and where their output goes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.kubectl_plugin import main
from hack.cluster import ControlPlane

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
NS = "plugin-team"
NODE = "plugin-gpu-0"


def _k(cp: ControlPlane, *args: str, stdin: str | None = None) -> str:
    proc = cp.kubectl(*args, check=False, stdin=stdin)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def objects(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    cp = control_plane
    crds = ROOT / "manifests" / "base" / "crds"
    for f in ("sliceallocations.yaml", "mignodes.yaml"):
        _k(cp, "apply", "--server-side", "--force-conflicts", "-f", str(crds / f))
    _k(cp, "wait", "--for=condition=Established", "--timeout=60s",
       "crd/sliceallocations.instaslice.io", "crd/mignodes.instaslice.io")  # fmt: skip
    role = ROOT / "manifests" / "base" / "common" / "rbac-aggregate.yaml"
    _k(cp, "apply", "-f", str(role))
    _k(cp, "create", "namespace", NS)
    alloc = {
        "apiVersion": "instaslice.io/v1alpha1",
        "kind": "SliceAllocation",
        "metadata": {"name": "claim-p1", "namespace": NS},
        "spec": {"podName": "trainer", "podUID": "u1", "nodeName": NODE,
                 "slices": [{"container": "main", "profile": "1g.18gb", "gpuUUID": "GPU-p0",
                             "start": 2, "size": 1}]},
    }  # fmt: skip
    _k(cp, "create", "-f", "-", stdin=json.dumps(alloc))
    mignode = {"apiVersion": "instaslice.io/v1alpha1", "kind": "MigNode",
               "metadata": {"name": NODE}}  # fmt: skip
    _k(cp, "create", "-f", "-", stdin=json.dumps(mignode))
    gpu = {"index": 0, "uuid": "GPU-p0", "model": "H200-141GB", "healthy": True,
           "migMode": {"current": "enabled", "pending": "enabled"},
           "profiles": [{"name": "1g.18gb", "id": 19, "placements": [{"start": 2, "size": 1}]}],
           "slices": [{"profile": "1g.18gb", "start": 2, "size": 1,
                       "claim": "claim-p1"}]}  # fmt: skip
    _k(cp, "patch", "mignode", NODE, "--subresource=status", "--type=merge",
       "-p", json.dumps({"status": {"gpuCount": 1, "gpus": [gpu]}}))  # fmt: skip
    yield cp
    _k(cp, "delete", "namespace", NS, "--wait=false")
    _k(cp, "delete", "mignode", NODE, "--ignore-not-found")
    _k(cp, "delete", "-f", str(role), "--ignore-not-found")


@pytest.fixture(autouse=True)
def _kubectl(control_plane: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin reads through kubectl: this control plane's, as `KUBECTL` names it."""
    monkeypatch.setenv("KUBECTL", str(control_plane.kubectl_path))
    monkeypatch.setenv("KUBECACHEDIR", str(control_plane.kubectl_cache_dir))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _two_contexts(cp: ControlPlane, tmp: Path) -> Path:
    """The admin kubeconfig with its context renamed `real`, and a current context that
    points at nothing listening."""
    cfg = yaml.safe_load(cp.kubeconfig.read_text())
    ctx = cfg["contexts"][0]
    cluster = cfg["clusters"][0]
    cfg["contexts"] = [
        {"name": "real", "context": ctx["context"]},
        {"name": "nowhere", "context": {**ctx["context"], "cluster": "nowhere"}},
    ]
    cfg["clusters"].append(
        {"name": "nowhere", "cluster": {**cluster["cluster"], "server": "https://127.0.0.1:1"}}
    )
    cfg["current-context"] = "nowhere"
    path = tmp / "two-contexts.kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_pods_and_nodes_as_data_with_a_chosen_context(
    objects: ControlPlane, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kc = str(_two_contexts(objects, tmp_path))
    rc, _, err = _run(capsys, "pods", "-n", NS, "--kubeconfig", kc)
    assert rc == 1 and "error" in err  # the current context reaches nothing
    rc, out, err = _run(capsys, "pods", "-n", NS, "--kubeconfig", kc, "--context", "real",
                        "-o", "json")  # fmt: skip
    assert rc == 0, err
    (row,) = json.loads(out)
    assert row == {"namespace": NS, "pod": "trainer", "container": "main", "node": NODE,
                   "gpu": "GPU-p0", "profile": "1g.18gb", "placement": "2:1", "migUUID": "-",
                   "phase": "Pending", "claim": "claim-p1"}  # fmt: skip
    rc, out, _ = _run(capsys, "pods", "-A", "--kubeconfig", kc, "--context", "real", "-o", "yaml")
    assert (
        rc == 0
        and {"pod": "trainer"}.items()
        <= next(r for r in yaml.safe_load(out) if r["namespace"] == NS).items()
    )
    rc, out, _ = _run(capsys, "nodes", "--kubeconfig", kc, "--context", "real", "-o", "json")
    gpu = next(r for r in json.loads(out) if r["node"] == NODE)
    assert gpu["slices"] == [{"pod": f"{NS}/trainer", "profile": "1g.18gb", "start": 2,
                              "size": 1, "phase": "Pending"}]  # fmt: skip
    assert gpu["unclaimed"] == []


def _split_kubeconfig(cp: ControlPlane, tmp: Path) -> str:
    """KUBECONFIG of two files: the first names only a context that reaches nothing and sets no
    current context; the second holds the real one (namespace NS) and makes it current. Only
    kubectl's merge of every path finds it."""
    cfg = yaml.safe_load(cp.kubeconfig.read_text())
    ctx, cluster, user = cfg["contexts"][0], cfg["clusters"][0], cfg["users"][0]
    first = {"apiVersion": "v1", "kind": "Config",
             "clusters": [{"name": "nowhere",
                           "cluster": {**cluster["cluster"], "server": "https://127.0.0.1:1"}}],
             "users": [user],
             "contexts": [{"name": "nowhere",
                           "context": {"cluster": "nowhere", "user": user["name"]}}]}  # fmt: skip
    second = {"apiVersion": "v1", "kind": "Config", "clusters": [cluster], "users": [user],
              "contexts": [{"name": "real", "context": {**ctx["context"], "namespace": NS}}],
              "current-context": "real"}  # fmt: skip
    (tmp / "first").write_text(yaml.safe_dump(first))
    (tmp / "second").write_text(yaml.safe_dump(second))
    return f"{tmp / 'first'}:{tmp / 'second'}"


def test_every_kubeconfig_path_and_the_contexts_namespace(
    objects: ControlPlane,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cp = objects
    other = "plugin-other"
    _k(cp, "create", "namespace", other)
    alloc = {"apiVersion": "instaslice.io/v1alpha1", "kind": "SliceAllocation",
             "metadata": {"name": "claim-p2", "namespace": other},
             "spec": {"podName": "other", "podUID": "u2", "nodeName": NODE,
                      "slices": [{"container": "c", "profile": "1g.18gb", "gpuUUID": "GPU-p0",
                                  "start": 3, "size": 1}]}}  # fmt: skip
    _k(cp, "create", "-f", "-", stdin=json.dumps(alloc))
    try:
        monkeypatch.setenv("KUBECONFIG", _split_kubeconfig(cp, tmp_path))
        rc, out, err = _run(capsys, "pods", "-o", "json")  # the context's namespace: NS
        assert rc == 0, err
        assert [r["claim"] for r in json.loads(out)] == ["claim-p1"]
        rc, out, err = _run(capsys, "pods")
        header, row = out.splitlines()
        assert header.split()[:2] == ["POD", "NODE"] and row.startswith("trainer/main")
        rc, out, err = _run(capsys, "pods", "-A", "-o", "wide", "--no-headers")
        assert rc == 0, err
        rows = [line.split() for line in out.splitlines() if line.split()[0] == NS]
        assert rows == [[NS, "trainer/main", NODE, "GPU-p0", "1g.18gb", "2:1", "-", "Pending",
                         "claim-p1"]]  # fmt: skip
    finally:
        _k(cp, "delete", "namespace", other, "--wait=false")


def test_impersonation_and_request_timeout_reach_the_api_server(
    objects: ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    cp, kc = objects, str(objects.kubeconfig)
    user = "tenant-as"
    _k(cp, "-n", NS, "create", "rolebinding", user, "--clusterrole=view", f"--user={user}")
    deadline = time.monotonic() + 20  # the authorizer catches up with the binding
    while time.monotonic() < deadline:
        rc, out, err = _run(capsys, "pods", "-n", NS, "--kubeconfig", kc, "--as", user)
        if rc == 0:
            break
    assert rc == 0 and "trainer/main" in out, err
    rc, _, err = _run(capsys, "pods", "-A", "--kubeconfig", kc, "--as", user)
    assert rc == 1 and f'User "{user}" cannot list' in err
    rc, _, err = _run(capsys, "--as", user, "--as-group", "system:masters", "pods", "-A",
                      "--kubeconfig", kc)  # fmt: skip
    assert rc == 0, err  # before the command, and repeatable groups
    rc, _, err = _run(capsys, "nodes", "--kubeconfig", kc, "--request-timeout", "1ns")
    assert rc == 1 and ("deadline" in err or "Timeout" in err), err
    rc, _, err = _run(capsys, "nodes", "--kubeconfig", kc, "--request-timeout", "30s")
    assert rc == 0, err


def test_version_reports_the_plugin_and_the_node_agents(
    objects: ControlPlane, capsys: pytest.CaptureFixture[str]
) -> None:
    from common.version import VERSION

    cp, kc = objects, str(objects.kubeconfig)
    _k(cp, "patch", "mignode", NODE, "--subresource=status", "--type=merge",
       "-p", json.dumps({"status": {"agent": {"version": VERSION, "bootID": "b"}}}))  # fmt: skip
    rc, out, err = _run(capsys, "version", "--kubeconfig", kc, "-o", "json")
    assert rc == 0, err
    info = json.loads(out)
    assert info["pluginVersion"] == f"v{VERSION}"
    # the control plane is shared: earlier modules' MigNodes are counted too, so the count
    # is checked against the MigNodes read here, apart from the plugin's own reading
    lines = _k(cp, "get", "mignodes", "-o",
               "jsonpath={range .items[*]}{.status.agent.version}{'\\n'}{end}")  # fmt: skip
    have = Counter(v or "unknown" for v in lines.split("\n")[:-1])
    assert have[VERSION] >= 1  # ours, patched above
    assert info["nodeAgentVersions"] == dict(have)
    rc, out, err = _run(capsys, "version", "--kubeconfig", kc, "--request-timeout", "1ns")
    assert rc == 1 and out.startswith(f"Plugin Version: v{VERSION}") and "error:" in err


@pytest.mark.parametrize("role", ["view", "edit"])
def test_a_tenant_reads_only_their_own_allocations(
    objects: ControlPlane, tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str
) -> None:
    cp = objects
    user = f"tenant-{role}"
    _k(cp, "-n", NS, "create", "rolebinding", user, f"--clusterrole={role}", f"--user={user}")
    kc = str(cp.user_kubeconfig(user))

    def can(verb: str) -> bool:
        proc = cp.kubectl("auth", "can-i", verb, "sliceallocations.instaslice.io", "-n", NS,
                          "--as", user, check=False)  # fmt: skip
        return proc.stdout.strip() == "yes"

    deadline = time.monotonic() + 20  # the aggregation controller and the authorizer catch up
    while not can("list") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert can("list") and can("watch") and can("get")
    assert not can("delete") and not can("patch") and not can("create") and not can("update")

    rc, out, err = _run(capsys, "pods", "-n", NS, "--kubeconfig", kc, "-o", "json")
    assert rc == 0, err
    assert [r["pod"] for r in json.loads(out)] == ["trainer"]
    rc, _, err = _run(capsys, "pods", "-A", "--kubeconfig", kc)
    assert rc == 1 and "forbidden" in err.lower() and "-n <namespace>" in err
    proc = subprocess.run(
        [str(cp.kubectl_path), "--kubeconfig", kc, f"--cache-dir={cp.kubectl_cache_dir}",
         "-n", NS, "get", "slicealloc"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "claim-p1" in proc.stdout, proc.stderr


CLUSTER_POLICY_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterpolicies.nvidia.com"},
    "spec": {"group": "nvidia.com", "scope": "Cluster",
             "names": {"plural": "clusterpolicies", "singular": "clusterpolicy",
                       "kind": "ClusterPolicy", "listKind": "ClusterPolicyList"},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "schema": {"openAPIV3Schema": {
                               "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
}  # fmt: skip


def test_gather_packs_objects_events_and_node_side_data(
    objects: ControlPlane, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cp = objects
    ops = "plugin-ops"  # InstaSlice installed in a namespace of the admin's choosing
    event = {"apiVersion": "v1", "kind": "Event",
             "metadata": {"name": "trainer.gather", "namespace": NS},
             "involvedObject": {"kind": "Pod", "name": "trainer", "namespace": NS},
             "reason": "AllocationPending", "message": "no node offers 1g.18gb",
             "type": "Normal", "source": {"component": "instaslice-allocator"}}  # fmt: skip
    _k(cp, "create", "-f", "-", stdin=json.dumps(event))
    _k(cp, "create", "namespace", ops)
    agent = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "agent-0", "namespace": ops,
                          "labels": {"app.kubernetes.io/name": "instaslice-nodeagent"}},
             "spec": {"nodeName": NODE,
                      "containers": [{"name": "nodeagent", "image": "agent:test"}]}}  # fmt: skip
    _k(cp, "create", "-f", "-", stdin=json.dumps(agent))
    _k(cp, "create", "-f", "-", stdin=json.dumps(CLUSTER_POLICY_CRD))
    _k(cp, "wait", "--for=condition=Established", "--timeout=60s",
       "crd/clusterpolicies.nvidia.com")  # fmt: skip
    policy = {"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
              "metadata": {"name": "cluster-policy"},
              "spec": {"migManager": {"enabled": False}}}  # fmt: skip
    _k(cp, "create", "-f", "-", stdin=json.dumps(policy))
    dest = tmp_path / "bug.tar.gz"
    try:
        rc, out, err = _run(capsys, "gather", "-n", ops, "--dest", str(dest),
                            "--kubeconfig", str(cp.kubeconfig))  # fmt: skip
    finally:
        _k(cp, "delete", "crd", "clusterpolicies.nvidia.com", "--wait=false")
        _k(cp, "delete", "namespace", ops, "--wait=false")
    assert rc == 0, err
    assert out.strip() == str(dest)
    with tarfile.open(dest) as tar:
        files = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}

        def text(name: str) -> str:
            f = tar.extractfile(files[name])
            assert f is not None
            return f.read().decode()

        assert NODE in text("instaslice/mignodes.yaml")
        assert "claim-p1" in text("instaslice/sliceallocations.yaml")
        reasons = {e["reason"] for e in json.loads(text("instaslice/events.json"))}
        assert "AllocationPending" in reasons
        assert "cluster/pods.json" not in files  # every pod of the cluster is not shared
        assert "agent-0" in text(f"namespace/{ops}.yaml")
        assert "migManager" in text("gpu-operator/clusterpolicy.yaml")
        errors = text("errors.txt")
        # no kubelet runs here: both execs into the agent's pod fail, and are recorded
        assert (
            f"nodes/{NODE}/discover.txt: kubectl -n {ops} exec agent-0 -c nodeagent -- "
            "instaslice-nodeagent --discover-only" in errors
        )
        assert f"nodes/{NODE}/cdi.txt:" in errors
        assert not any("secret" in name for name in files)


def test_the_krew_archive_reads_the_cluster_with_nothing_installed(
    objects: ControlPlane, tmp_path: Path
) -> None:
    """The krew archive, unpacked, under a python3 with only its standard library: what a
    krew user runs on first use, with no PyPI to reach."""
    from hack.krew_archive import build

    path, _ = build(tmp_path / "dist")
    with tarfile.open(path) as tar:
        tar.extractall(tmp_path / "krew", filter="data")
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    proc = subprocess.run(
        [str(bare / "bin" / "python"), str(tmp_path / "krew" / "kubectl-instaslice"), "pods",
         "-n", NS, "-o", "yaml", "--kubeconfig", str(objects.kubeconfig),
         "--kubectl", str(objects.kubectl_path)],
        capture_output=True, text=True, check=False,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
             "KUBECACHEDIR": str(objects.kubectl_cache_dir)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [r["claim"] for r in yaml.safe_load(proc.stdout)] == ["claim-p1"]


def test_kubectl_completes_the_plugins_arguments(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    """kubectl's own plugin completion (`kubectl instaslice <TAB>`): kubectl runs
    kubectl_complete-instaslice, which `completion kubectl` prints, and reads its answer."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").symlink_to(control_plane.kubectl_path)
    (bin_dir / "kubectl-instaslice").symlink_to(Path(sys.executable).parent / "kubectl-instaslice")
    script = bin_dir / "kubectl_complete-instaslice"
    printed = subprocess.run([str(bin_dir / "kubectl-instaslice"), "completion", "kubectl"],
                             capture_output=True, text=True, check=True)  # fmt: skip
    script.write_text(printed.stdout)
    script.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}

    def complete(*words: str) -> list[str]:
        proc = subprocess.run([str(bin_dir / "kubectl"), "__complete", "instaslice", *words],
                              capture_output=True, text=True, check=False, env=env)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert complete("po") == ["pods", ":4"]
    assert complete("pods", "-o", "") == ["json", "wide", "yaml", ":4"]
    assert complete("gather", "--t") == ["--tail", ":4"]
