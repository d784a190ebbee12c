"""kubectl-instaslice rendering: slot maps and pod listing from MigNode/SliceAllocation JSON.

Covers the pure renderers, the `-o json|yaml` rows, the flags and gather's filters; fetching
from a live cluster, --context, a tenant's view and gather's archive are in
tests/integration/test_kubectl_plugin.py.
"""

import json
from typing import Any

import pytest
import yaml

from common.gather import gated_pods, instaslice_events
from common.kubectl_plugin import build_parser, dump, gpu_rows, pod_rows, render_nodes, render_pods


def _mignode(name: str, slices: list[dict[str, object]], healthy: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "status": {
            "gpus": [
                {
                    "index": 0,
                    "uuid": f"GPU-{name}-0",
                    "model": "H100-80GB",
                    "migMode": {"current": "enabled", "pending": "enabled"},
                    "healthy": healthy,
                    "profiles": [
                        {"name": "7g.80gb", "id": 0, "placements": [{"start": 0, "size": 8}]}
                    ],
                    "slices": slices,
                }
            ]
        },
    }


def _alloc(
    ns: str, pod: str, gpu: str, start: int, size: int, phase: str = "Ready"
) -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": f"claim-{pod}"},
        "spec": {
            "podName": pod,
            "nodeName": "n0",
            "slices": [
                {
                    "container": "c",
                    "profile": "3g.40gb",
                    "gpuUUID": gpu,
                    "gpuIndex": 0,
                    "start": start,
                    "size": size,
                }
            ],
        },
        "status": {"phase": phase, "slices": [{"container": "c", "migUUID": "MIG-abc"}]},
    }


def test_nodes_draw_holders_foreign_and_free_slots() -> None:
    node = _mignode("n0", [{"profile": "1g.10gb", "start": 6, "size": 1, "migUUID": "MIG-x"}])
    out = render_nodes([node], [_alloc("team", "train", "GPU-n0-0", 0, 4)])
    line = next(ln for ln in out.splitlines() if ln.startswith("n0"))
    assert line.endswith("|AAAA..#.|")
    assert "A = team/train 3g.40gb [0:4] Ready" in out


def test_nodes_draw_orphaned_instance_as_occupied() -> None:
    # the claim's allocation is gone (finalizer force-removed) but the instance still exists
    node = _mignode("n0", [{"profile": "1g.10gb", "start": 2, "size": 1, "claim": "gone"}])
    line = next(ln for ln in render_nodes([node], []).splitlines() if ln.startswith("n0"))
    assert line.endswith("|..#.....|")


def test_nodes_show_a_gpu_beyond_the_bounds_as_refused_without_drawing_it() -> None:
    """Finding 3 (docs/security.md): a placement at start 10^18 was drawn as a list of
    10^18 cells. Such a GPU is shown REFUSED, with the reason, as the allocator treats it."""
    node = _mignode("n0", [])
    node["status"]["gpus"][0]["profiles"][0]["placements"].append({"start": 10**18, "size": 1})
    out = render_nodes([node], [])
    line = next(ln for ln in out.splitlines() if ln.startswith("n0"))
    assert "REFUSED" in line and line.endswith("|?|")
    assert "n0 GPU 0: beyond InstaSlice's bounds" in out and "16 memory slots" in out
    (row,) = gpu_rows([node], [])
    assert "16 memory slots" in row["refused"]
    assert gpu_rows([_mignode("n0", [])], [])[0]["refused"] is None


def test_nodes_flag_unhealthy_gpu() -> None:
    out = render_nodes([_mignode("n1", [], healthy=False)], [])
    assert "UNHEALTHY" in out
    assert "|........|" in out


def test_pods_list_has_every_column() -> None:
    out = render_pods([_alloc("team", "train", "GPU-n0-0", 4, 4, phase="Creating")])
    header, row = out.splitlines()
    assert header.split() == [
        "NAMESPACE",
        "POD",
        "NODE",
        "GPU",
        "PROFILE",
        "PLACEMENT",
        "MIG",
        "UUID",
        "PHASE",
    ]
    assert row.split() == ["team", "train/c", "n0", "0", "3g.40gb", "4:4", "MIG-abc", "Creating"]


# --- -o json|yaml rows, flags, gather's pure parts ------------------------------------------


def test_pod_rows_are_the_text_columns_as_data() -> None:
    (row,) = pod_rows([_alloc("team", "train", "GPU-n0-0", 4, 4, phase="Creating")])
    assert row == {
        "namespace": "team",
        "pod": "train",
        "container": "c",
        "node": "n0",
        "gpu": "0",
        "profile": "3g.40gb",
        "placement": "4:4",
        "migUUID": "MIG-abc",
        "phase": "Creating",
        "claim": "claim-train",
    }
    assert json.loads(dump([row], "json")) == [row]
    assert yaml.safe_load(dump([row], "yaml")) == [row]


def test_gpu_rows_separate_held_and_unclaimed_instances() -> None:
    node = _mignode("n0", [{"profile": "1g.10gb", "start": 6, "size": 1, "migUUID": "MIG-x"}])
    (gpu,) = gpu_rows([node], [_alloc("team", "train", "GPU-n0-0", 0, 4)])
    assert gpu["node"] == "n0" and gpu["healthy"] is True
    assert gpu["slices"] == [
        {"pod": "team/train", "profile": "3g.40gb", "start": 0, "size": 4, "phase": "Ready"}
    ]
    assert gpu["unclaimed"] == [{"profile": "1g.10gb", "start": 6, "size": 1}]


def test_namespace_and_all_namespaces_exclude_each_other() -> None:
    p = build_parser()
    assert p.parse_args(["pods", "-A", "-o", "json"]).all_namespaces
    assert p.parse_args(["pods", "--context", "c", "-n", "x"]).namespace == "x"
    with pytest.raises(SystemExit):
        p.parse_args(["pods", "-A", "-n", "x"])


def test_gather_keeps_only_instaslice_events_and_gated_pods() -> None:
    events = {
        "items": [
            {"reason": "Scheduled", "involvedObject": {"namespace": "a"}},
            {"reason": "SliceReady", "lastTimestamp": "2026-01-01T00:00:02Z"},
            {"reason": "Pulled", "involvedObject": {"namespace": "instaslice-system"}},
            {"reason": "Other", "source": {"component": "instaslice-nodeagent"},
             "lastTimestamp": "2026-01-01T00:00:01Z"},
        ]
    }  # fmt: skip
    assert [e["reason"] for e in instaslice_events(json.dumps(events))] == [
        "Pulled",
        "Other",
        "SliceReady",
    ]
    pods = {
        "items": [
            {"metadata": {"namespace": "a", "name": "p"},
             "spec": {"schedulingGates": [{"name": "instaslice.io/allocation"}]}},
            {"metadata": {"namespace": "a", "name": "q"}, "spec": {}},
        ]
    }  # fmt: skip
    assert gated_pods(json.dumps(pods)) == ["a/p"]


@pytest.mark.parametrize("slots", [False, True])
def test_kueue_config_prints_the_generated_transformations_and_flavors(
    slots: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    from common.catalog import load_catalog
    from common.kubectl_plugin import main
    from common.quota import kueue_resources

    assert main(["kueue-config", *(["--slot-accounting"] if slots else [])]) == 0
    config, *flavors = yaml.safe_load_all(capsys.readouterr().out)
    catalog = load_catalog()
    assert config == {"resources": kueue_resources(catalog, slot_accounting=slots)}
    assert {f["spec"]["nodeLabels"]["instaslice.io/gpu-model"] for f in flavors} == {
        m.name for m in catalog.models
    }
    assert all(f["kind"] == "ResourceFlavor" for f in flavors)


def test_nodes_show_mode_and_mode_changes() -> None:
    on = _mignode("n0", [])
    off = _mignode("n1", [])
    off["status"]["gpus"][0].update(
        migMode={"current": "disabled", "pending": "disabled"}, modeToggle="resetless"
    )
    failed = _mignode("n2", [])
    failed["status"]["gpus"][0].update(
        migMode={"current": "disabled", "pending": "disabled"},
        modeToggle="resetless",
        modeChange={"phase": "Failed", "message": "1 compute process(es) run on it"},
    )
    draining = _mignode("n3", [])
    draining["status"]["gpus"][0].update(modeToggle="reset", modeChange={"phase": "Draining"})
    out = render_nodes([on, off, failed, draining], [])
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith("n")}
    assert rows["n3"][3:5] == ["enabled", "draining"]  # Ampere maintenance under way
    assert rows["n0"][3:5] == ["enabled", "-"]  # an older agent: no modeToggle
    assert rows["n1"][3:5] == ["disabled", "resetless"]
    assert rows["n2"][3:5] == ["disabled", "FAILED"]
    assert "n2 GPU 0: MIG mode change failed, avoided for a back-off: 1 compute process" in out


# --- gather's node-side data and the GPU Operator (through a recorded kubectl) -------------------


def _fake_kubectl(answers: dict[str, tuple[int, str]]) -> tuple[Any, list[list[str]]]:
    """A runner answering by the first key found in the joined arguments; rc 1 otherwise."""
    import subprocess

    calls: list[list[str]] = []

    def run(args: Any) -> subprocess.CompletedProcess[str]:
        calls.append(list(args))
        line = " ".join(args)
        for key, (rc, out) in answers.items():
            if key in line:
                return subprocess.CompletedProcess(list(args), rc, out if rc == 0 else "", out)
        return subprocess.CompletedProcess(list(args), 1, "", "forbidden")

    return run, calls


def test_gather_execs_discovery_and_cdi_listing_in_each_agent_pod(tmp_path: Any) -> None:
    import tarfile

    from common.gather import gather

    agents = {"items": [{"metadata": {"name": "agent-x"}, "spec": {"nodeName": "n0"}}]}
    run, calls = _fake_kubectl(
        {
            "-l app.kubernetes.io/name=instaslice-nodeagent": (0, json.dumps(agents)),
            "--discover-only": (0, "GPU 0 H100-80GB mig enabled\n"),
            "ls -la /var/run/cdi /etc/cdi": (0, "instaslice.io-claim.json\n"),
            "get clusterpolicies.nvidia.com": (0, "kind: ClusterPolicy\n"),
        }
    )
    dest = gather(run, tmp_path / "g.tar.gz", namespace="gpu-ops")
    with tarfile.open(dest) as tar:
        files = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if m.isfile()}

        def text(name: str) -> str:
            f = tar.extractfile(files[name])
            assert f is not None
            return f.read().decode()

        assert text("nodes/n0/discover.txt") == "GPU 0 H100-80GB mig enabled\n"
        assert text("nodes/n0/cdi.txt") == "instaslice.io-claim.json\n"
        assert text("gpu-operator/clusterpolicy.yaml") == "kind: ClusterPolicy\n"
    exec_ = ["-n", "gpu-ops", "exec", "agent-x", "-c", "nodeagent", "--"]
    assert [*exec_, "instaslice-nodeagent", "--discover-only"] in calls
    # InstaSlice's namespace is the flag's, everywhere
    assert not any("instaslice-system" in a for c in calls for a in c)


def test_gather_notes_a_cluster_without_the_gpu_operator(tmp_path: Any) -> None:
    import tarfile

    from common.gather import gather

    missing = 'error: the server doesn\'t have a resource type "clusterpolicies"'
    run, _ = _fake_kubectl({"clusterpolicies": (1, missing)})
    with tarfile.open(gather(run, tmp_path / "g.tar.gz")) as tar:
        names = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if m.isfile()}
        f = tar.extractfile(names["gpu-operator/clusterpolicy.yaml"])
        assert f is not None and b"no GPU Operator" in f.read()
        errors = tar.extractfile(names["errors.txt"])
        assert errors is not None
        lines = errors.read().decode()
        assert "clusterpolicy" not in lines and "nodes/: node agent pods: forbidden" in lines


# --- printing flags, connection flags, help, version, completion ---------------------------------


def test_pods_wide_no_headers_and_the_namespace_column() -> None:
    alloc = _alloc("team", "train", "GPU-n0-0", 4, 4)
    (row,) = render_pods([alloc], namespace_column=False, headers=False).splitlines()
    assert row.split() == ["train/c", "n0", "0", "3g.40gb", "4:4", "MIG-abc", "Ready"]
    header, row = render_pods([alloc], wide=True).splitlines()
    assert header.split()[-1] == "CLAIM" and row.split()[-1] == "claim-train"
    assert render_pods([], headers=False) == ""


def test_nodes_wide_shows_the_gpu_uuid_and_no_headers_drops_the_header() -> None:
    node = _mignode("n0", [])
    wide = render_nodes([node], [], wide=True).splitlines()
    assert wide[0].split()[:3] == ["NODE", "GPU", "UUID"]
    assert wide[1].split()[:3] == ["n0", "0", "GPU-n0-0"]
    plain = render_nodes([node], [], headers=False).splitlines()
    assert plain[0].startswith("n0") and "GPU-n0-0" not in plain[0]


def test_connection_flags_pass_on_to_kubectl_and_may_come_before_the_command() -> None:
    from common.kubectl import Connection
    from common.kubectl_plugin import connection

    args = build_parser().parse_args(
        ["--as", "alice", "pods", "--as-group", "g1", "--as-group", "g2",
         "--request-timeout", "5s", "--context", "prod", "--kubeconfig", "/k"]
    )  # fmt: skip
    conn = connection(args)
    assert conn == Connection(kubeconfig="/k", context="prod", as_user="alice",
                              as_groups=("g1", "g2"), request_timeout="5s")  # fmt: skip
    assert conn.flags() == ["--kubeconfig=/k", "--context=prod", "--as=alice",
                            "--request-timeout=5s", "--as-group=g1", "--as-group=g2"]  # fmt: skip


def test_help_names_no_source_file_and_each_command_has_its_own_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import re

    from common.kubectl_plugin import main

    texts = []
    for argv in ([], ["pods"], ["nodes"], ["gather"], ["kueue-config"], ["completion"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--help"])
        assert exc.value.code == 0
        texts.append(capsys.readouterr().out)
    assert not any(re.search(r"\w+/\w+\.py", t) for t in texts)
    top, pods, nodes, gather, kueue, _ = texts
    assert "--slot-accounting" in kueue and "--slot-accounting" not in pods
    assert "--dest" in gather and "--dest" not in pods and "--all-namespaces" not in nodes
    assert "--no-headers" in pods and "--request-timeout" in pods and "examples:" in top


def test_version_comes_from_the_one_version(capsys: pytest.CaptureFixture[str]) -> None:
    from common.kubectl_plugin import main
    from common.version import VERSION

    assert main(["version", "--client", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["pluginVersion"] == f"v{VERSION}"


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        ([""], ["completion", "gather", "kueue-config", "nodes", "pods", "version", ":4"]),
        (["po"], ["pods", ":4"]),
        (["pods", "-o", ""], ["json", "wide", "yaml", ":4"]),
        (["pods", "--no"], ["--no-headers", ":4"]),
        (["kueue-config", "--s"], ["--slot-accounting", ":4"]),
        (["pods", "--context", ""], ["dev", "prod", ":4"]),
        (["pods", "-n", "t"], ["team-a", ":4"]),
        (["gather", "--dest", ""], [":0"]),  # a file name: the shell's own completion
        (["completion", ""], ["bash", "kubectl", "zsh", ":4"]),
        (["--context", "dev", "no"], ["nodes", ":4"]),
    ],
)
def test_completion_offers_commands_flags_choices_and_cluster_names(
    words: list[str], expected: list[str]
) -> None:
    from common.plugin_complete import candidates

    lists = {"--context": ["dev", "prod"], "--namespace": ["namespace/team-a", "namespace/x"]}
    assert candidates(build_parser(), words, lambda flag: lists[flag]) == expected


def test_completion_scripts_call_back_into_the_plugin() -> None:
    from common.plugin_complete import completion_script

    assert 'exec kubectl instaslice __complete "$@"' in completion_script("kubectl")
    assert "complete -F _kubectl_instaslice kubectl-instaslice" in completion_script("bash")
    assert completion_script("zsh").startswith("autoload -U +X bashcompinit")
