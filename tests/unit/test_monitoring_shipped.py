"""Monitoring as shipped: what every /metrics carries, and alerts that say where to look.

- `instaslice_build_info` (version, component, Python) and the process/platform collectors
  are on the registry each entry point starts from (common/buildinfo.py), and both entry
  points start from it;
- every alert of manifests/components/monitoring has a `runbook_url` into the project's
  docs/troubleshooting.md (the krew manifest's homepage) whose anchor is a heading there.

The dashboard's ConfigMap and the PodMonitor's credentials are rendered and checked in
tests/integration/test_helm_values.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from prometheus_client import generate_latest

from common import buildinfo

ROOT = Path(__file__).resolve().parents[2]


def test_build_info_and_process_collectors() -> None:
    text = generate_latest(buildinfo.registry("nodeagent")).decode()
    m = re.search(r"^instaslice_build_info\{(.*)\} 1\.0$", text, re.M)
    assert m, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    assert labels["component"] == "nodeagent"
    assert labels["version"] == buildinfo.version() != "unknown"
    assert labels["python_version"]
    for series in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"):
        assert re.search(rf"^{series}[{{ ]", text, re.M), series


def test_both_entry_points_start_from_that_registry() -> None:
    for module, component in (("webhook/main.py", "webhook"), ("nodeagent/main.py", "nodeagent")):
        assert f'buildinfo.registry("{component}")' in (ROOT / module).read_text(), module


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def test_every_alert_has_a_runbook_url_to_an_existing_heading() -> None:
    krew = yaml.safe_load((ROOT / "plugins" / "krew" / "instaslice.yaml").read_text())
    base = f"{krew['spec']['homepage']}/blob/main/docs/troubleshooting.md#"
    doc = (ROOT / "docs" / "troubleshooting.md").read_text()
    anchors = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", doc, re.M)}
    rule = yaml.safe_load(
        (ROOT / "manifests" / "components" / "monitoring" / "prometheusrule.yaml").read_text()
    )
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    for r in alerts:
        url = r["annotations"].get("runbook_url", "")
        assert url.startswith(base), f"{r['alert']}: {url!r}"
        assert url.removeprefix(base) in anchors, f"{r['alert']}: no heading for {url}"
