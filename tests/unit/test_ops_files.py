"""Offline checks of the operations files nothing here can build or run.

Covers: skaffold.yaml's paths and pins (artifacts' Containerfiles, kustomize paths, the schema
version hack/fetch-crds.sh fetches, image names the overlays set), the Containerfiles and their
ignore files, every kustomization's resource paths, the Grafana dashboard (JSON shape, the
panels the issue asks for, every PromQL expression naming only metrics in docs/metrics.md),
and the krew Plugin manifest.
Leaves out: rendering and server-side validation of the manifests and skaffold's JSON schema
(tests/integration/test_manifests.py), building images (no container engine here).
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
OVERLAYS = ("kubernetes", "openshift")
IMAGES = ("instaslice-webhook", "instaslice-nodeagent")


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


# --- skaffold.yaml ---------------------------------------------------------------------------


def _skaffold() -> dict[str, Any]:
    cfg = _yaml(ROOT / "skaffold.yaml")
    assert isinstance(cfg, dict)
    return cfg


def _kustomize_paths(cfg: dict[str, Any]) -> Iterator[str]:
    yield from cfg.get("manifests", {}).get("kustomize", {}).get("paths", [])
    for profile in cfg.get("profiles", []):
        yield from profile.get("manifests", {}).get("kustomize", {}).get("paths", [])


def test_skaffold_api_version_is_the_schema_fetch_crds_pins() -> None:
    cfg = _skaffold()
    assert cfg["kind"] == "Config"
    assert re.fullmatch(r"skaffold/v4beta\d+", cfg["apiVersion"])
    pinned = re.search(r"^SKAFFOLD_SCHEMA=(\S+)", (ROOT / "hack/fetch-crds.sh").read_text(), re.M)
    assert pinned, "hack/fetch-crds.sh pins no SKAFFOLD_SCHEMA"
    assert cfg["apiVersion"] == f"skaffold/{pinned.group(1)}"


def test_skaffold_artifacts_build_both_images_from_existing_containerfiles() -> None:
    artifacts = _skaffold()["build"]["artifacts"]
    names = {a["image"].rsplit("/", 1)[-1] for a in artifacts}
    assert names == set(IMAGES)
    for a in artifacts:
        context = ROOT / a.get("context", ".")
        dockerfile = context / a["docker"]["dockerfile"]
        assert dockerfile.is_file(), f"{a['image']}: {dockerfile} missing"
        assert dockerfile.name == f"Containerfile.{a['image'].rsplit('-', 1)[-1]}"


def test_skaffold_kustomize_paths_are_the_overlays() -> None:
    paths = list(_kustomize_paths(_skaffold()))
    assert paths, "skaffold.yaml renders no kustomize paths"
    for p in paths:
        assert (ROOT / p / "kustomization.yaml").is_file(), p
    assert {Path(p).name for p in paths} == set(OVERLAYS)
    assert _skaffold()["manifests"]["kustomize"]["paths"] == ["manifests/overlays/kubernetes"]
    assert "kubectl" in _skaffold()["deploy"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_image_names_are_the_skaffold_artifacts(overlay: str) -> None:
    """skaffold swaps in its tags only where a rendered image name equals an artifact's."""
    artifacts = {a["image"] for a in _skaffold()["build"]["artifacts"]}
    kust = _yaml(MANIFESTS / "overlays" / overlay / "kustomization.yaml")
    new_names = {i["newName"] for i in kust["images"]}
    assert new_names == artifacts
    assert {i["name"] for i in kust["images"]} == set(IMAGES)


# --- Containerfiles ----------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["webhook", "nodeagent"])
def test_containerfile_is_ubi9_python311_and_copies_only_existing_paths(component: str) -> None:
    text = (ROOT / f"Containerfile.{component}").read_text()
    assert re.search(r"^ARG BASE_IMAGE=registry\.access\.redhat\.com/ubi9/python-311", text, re.M)
    assert re.search(rf'^ENTRYPOINT \["/opt/instaslice/bin/instaslice-{component}"\]', text, re.M)
    for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            assert (ROOT / src).exists(), f"Containerfile.{component} copies missing {src}"
    users = re.findall(r"^USER (\S+)", text, re.M)
    if component == "webhook":
        assert users[-1] not in ("0", "root"), "the webhook image must run as non-root"
    else:
        assert users[-1] == "0", "the node agent needs root for MIG management (see the file)"


def test_ignore_files_agree_and_keep_the_packages() -> None:
    ignore = (ROOT / ".containerignore").read_text()
    for component in ("webhook", "nodeagent"):
        assert (ROOT / f"Containerfile.{component}.dockerignore").read_text() == ignore
    patterns = [line for line in ignore.splitlines() if line and not line.startswith("#")]
    assert patterns[0] == "*"
    for keep in ("pyproject.toml", "README.md", "common/", "webhook/", "nodeagent/"):
        assert f"!{keep}" in patterns


# --- kustomizations ----------------------------------------------------------------------------


def _kustomizations() -> list[Path]:
    return sorted(MANIFESTS.rglob("kustomization.yaml"))


@pytest.mark.parametrize(
    "kustomization", _kustomizations(), ids=lambda p: str(p.relative_to(MANIFESTS))
)
def test_kustomization_resources_exist(kustomization: Path) -> None:
    kust = _yaml(kustomization)
    for res in kust.get("resources", []):
        target = kustomization.parent / res
        if target.is_dir():
            assert (target / "kustomization.yaml").is_file(), f"{res}: no kustomization.yaml"
        else:
            assert target.is_file(), f"{kustomization}: resource {res} missing"


def test_base_composes_every_component_directory() -> None:
    kust = _yaml(MANIFESTS / "base" / "kustomization.yaml")
    assert "namespace" not in kust, "would namespace ValidatingAdmissionPolicies (see the file)"
    assert set(kust["resources"]) == {
        "crds",
        "common",
        "webhook",
        "allocator",
        "policy",
        "nodeagent",
    }


# --- metrics doc and dashboard ------------------------------------------------------------------

_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def documented_metrics() -> dict[str, str]:
    """`name -> type` from the table in docs/metrics.md."""
    out: dict[str, str] = {}
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"\|\s*`(instaslice_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def promql_metrics(expr: str) -> set[str]:
    """Metric names in a PromQL expression (a tokenizer, not a parser: good enough for ours)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range selectors
    s = re.sub(r"(?<![\w:])\d[\w.]*", " ", s)  # numbers and durations (0.99, 5m)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        word = m.group(0)
        if s[m.end() :].lstrip().startswith("(") or word.lower() in _PROMQL_WORDS:
            continue  # a function call or a keyword
        names.add(word)
    return names


def _base_metric(series: str, documented: dict[str, str]) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        base = series.removesuffix(suffix)
        if base != series and documented.get(base) == "histogram":
            return base
    return series


def _dashboard_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _dashboard_panels(p.get("panels", []))


def _dashboard() -> dict[str, Any]:
    dash = json.loads((ROOT / "dashboards" / "instaslice-grafana.json").read_text())
    assert isinstance(dash, dict)
    return dash


def _dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _dashboard_panels(dash["panels"]) for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        if var.get("type") == "query":
            text = q["query"] if isinstance(q, dict) else q
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", text)
            assert m, f"variable {var['name']}: unexpected query {text!r}"
            exprs.append(m.group(1))
    return exprs


def test_promql_tokenizer() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{x="y z"}[$__rate_interval])))'
        " / on(node) group_left(model) b_total offset 5m"
    )
    assert promql_metrics(expr) == {"a_seconds_bucket", "b_total"}


def test_metrics_table_lists_known_series_with_types() -> None:
    documented = documented_metrics()
    assert len(documented) >= 10
    assert set(documented.values()) <= {"counter", "gauge", "histogram"}
    for name, kind in documented.items():
        assert name.endswith("_total") == (kind == "counter"), name


def test_every_dashboard_query_names_a_documented_metric() -> None:
    documented = documented_metrics()
    dash = _dashboard()
    exprs = _dashboard_exprs(dash)
    assert exprs
    for expr in exprs:
        names = promql_metrics(expr)
        assert names, f"no metric in {expr!r}"
        unknown = {n for n in names if _base_metric(n, documented) not in documented}
        assert not unknown, f"{expr!r} names metrics missing from docs/metrics.md: {unknown}"


def test_dashboard_has_the_panels_operators_need() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    panels = [p for p in _dashboard_panels(dash["panels"]) if p["type"] != "row"]
    ids = [p["id"] for p in _dashboard_panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    by_metric: dict[str, list[str]] = {}
    for p in panels:
        for t in p["targets"]:
            for name in promql_metrics(t["expr"]):
                by_metric.setdefault(name, []).append(p["title"])
    for series in (
        "instaslice_allocator_time_to_ungate_seconds_bucket",  # time to slice
        "instaslice_slices",  # by profile and model
        "instaslice_gpu_slots_used",  # memory-slot utilisation per GPU
        "instaslice_pending_pods",  # pending by reason
        "instaslice_nodeagent_nvml_errors_total",  # NVML errors
    ):
        assert series in by_metric, f"no panel shows {series}"
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    assert "histogram_quantile(0.50" in exprs and "histogram_quantile(0.99" in exprs
    assert "by (profile, model)" in exprs and "by (reason)" in exprs


# --- krew ----------------------------------------------------------------------------------------


def test_krew_manifest_describes_the_console_script() -> None:
    from common.version import VERSION

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["kubectl-instaslice"] == "common.kubectl_plugin:main"
    plugin = _yaml(ROOT / "plugins" / "krew" / "instaslice.yaml")
    assert plugin["apiVersion"] == "krew.googlecontainertools.github.com/v1alpha2"
    assert plugin["kind"] == "Plugin"
    assert plugin["metadata"]["name"] == "instaslice"
    spec = plugin["spec"]
    version = f"v{VERSION}"
    assert spec["version"] == version
    assert spec["shortDescription"] and len(spec["shortDescription"]) <= 80
    assert spec["platforms"]
    for platform in spec["platforms"]:
        assert platform["bin"] == "kubectl-instaslice"
        assert re.fullmatch(r"[0-9a-f]{64}", platform["sha256"])
        assert platform["uri"].startswith("https://") and version in platform["uri"]
        assert {f["from"] for f in platform["files"]} == {"kubectl-instaslice", "LICENSE", "lib",
                                                          "licenses"}  # fmt: skip
        oses = {
            v
            for e in platform["selector"]["matchExpressions"]
            if e["key"] == "os"
            for v in e["values"]
        }
        assert oses <= {"linux", "darwin", "windows"} and oses
    assert (ROOT / "plugins" / "krew" / "kubectl-instaslice").stat().st_mode & 0o111


def test_every_version_is_the_one_in_common_version() -> None:
    """docs/release.md: common/version.py is the one place; everything else says the same."""
    from common.version import VERSION

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in pyproject["project"]["dynamic"] and "version" not in pyproject["project"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "common.version.VERSION"
    }
    for overlay in OVERLAYS:
        images = _yaml(MANIFESTS / "overlays" / overlay / "kustomization.yaml")["images"]
        assert {i["newTag"] for i in images} == {f"v{VERSION}"}, overlay
    chart = _yaml(ROOT / "charts" / "instaslice" / "Chart.yaml")
    assert (chart["version"], chart["appVersion"]) == (VERSION, f"v{VERSION}")
    for component in IMAGES:
        text = (ROOT / f"Containerfile.{component.removeprefix('instaslice-')}").read_text()
        assert re.findall(r"^ARG VERSION=(.*)$", text, re.M) == [VERSION], component
    makefile = (ROOT / "Makefile").read_text()
    assert "VERSION := $(shell sed -n" in makefile and "common/version.py" in makefile
    from nodeagent.settings import Settings

    assert Settings.version == VERSION  # what the agent publishes in MigNode status.agent


# --- monitoring component ----------------------------------------------------------------------

MONITORING = MANIFESTS / "components" / "monitoring"
PROMETHEUS_BUILTINS = {"up"}


def _rules() -> list[dict[str, Any]]:
    rule = _yaml(MONITORING / "prometheusrule.yaml")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def test_every_alert_names_documented_metrics_and_says_what_to_do() -> None:
    documented = documented_metrics()
    rules = _rules()
    assert {r["alert"] for r in rules} >= {
        "InstaSliceNodeAgentDown",
        "InstaSliceAllocationStuck",
        "InstaSliceForeignInstances",  # leaked or foreign instances, a partitioner in conflict
        "InstaSliceNoAllocatorLeader",
    }
    for r in rules:
        names = promql_metrics(r["expr"])
        assert names, r["alert"]
        unknown = {
            n for n in names if _base_metric(n, documented) not in documented
        } - PROMETHEUS_BUILTINS
        assert not unknown, f"{r['alert']}: {unknown} not in docs/metrics.md"
        assert r["labels"]["severity"] in {"info", "warning", "critical"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]
    assert len({r["alert"] for r in rules}) == len(rules)


def test_pod_monitor_selects_both_components_on_their_metrics_port() -> None:
    mon = _yaml(MONITORING / "podmonitor.yaml")
    (expr,) = mon["spec"]["selector"]["matchExpressions"]
    (endpoint,) = mon["spec"]["podMetricsEndpoints"]
    for path in ("webhook/deployment.yaml", "nodeagent/daemonset.yaml"):
        tmpl = _yaml(MANIFESTS / "base" / path)["spec"]["template"]
        assert tmpl["metadata"]["labels"][expr["key"]] in expr["values"], path
        ports = {p["name"] for c in tmpl["spec"]["containers"] for p in c.get("ports", [])}
        assert endpoint["port"] in ports, path
