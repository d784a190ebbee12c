"""The Helm chart's `metricsAuth.enabled`: the component manifests/components/metrics-auth.

That component appends `--metrics-auth` to both workloads, switches their probes to HTTPS
(the metrics ports then speak TLS only), adds its RBAC and the scraper's credentials, and
gives the PodMonitor https, insecureSkipVerify and the scraper's bearer token. `check`
refuses a rendering where it changes anything else (extend this module then); `parameterise`
makes each of those changes conditional on the value. tests/integration/test_helm_chart.py
compares the chart with the component's renderings, alone and after `monitoring`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

__all__ = ["FLAG", "VARIANTS", "check", "parameterise"]

FLAG = "--metrics-auth"
VALUE = ".Values.metricsAuth.enabled"
WORKLOADS = {("Deployment", "instaslice-webhook"), ("DaemonSet", "instaslice-nodeagent")}
PROBES = ("livenessProbe", "readinessProbe")
# variant name -> the components rendered on top of the overlay, in order
VARIANTS = {"metrics-auth": ("metrics-auth",), "monitoring-auth": ("monitoring", "metrics-auth")}

Obj = dict[str, Any]
Mark = Callable[[str, str], str]


def _key(o: Obj) -> tuple[str, str]:
    return (o["kind"], o["metadata"]["name"])


def _apply(o: Obj) -> Obj:
    """What the component does to one of the overlay's objects."""
    o = copy.deepcopy(o)
    if _key(o) in WORKLOADS:
        (c,) = o["spec"]["template"]["spec"]["containers"]
        c["args"] = [*c["args"], FLAG]
        for probe in PROBES:
            if probe in c:
                c[probe]["httpGet"]["scheme"] = "HTTPS"
    return o


def check(default: list[Obj], auth: list[Obj]) -> list[Obj]:
    """The objects the component adds; SystemExit naming what else it changed."""
    base = {_key(o): o for o in default}
    got = {_key(o): o for o in auth}
    changed = sorted(k for k in base if got.get(k) != _apply(base[k]))
    if changed:
        raise SystemExit(f"metrics-auth changes more than {FLAG} and probes: {changed}")
    return [o for k, o in got.items() if k not in base]


def parameterise(o: Obj, mark: Mark) -> None:
    if _key(o) in WORKLOADS:
        (c,) = o["spec"]["template"]["spec"]["containers"]
        c["args"].append(mark("item", f"{{{{- if {VALUE} }}}}\n{{pad}}- {FLAG}\n{{{{- end }}}}"))
        for probe in PROBES:
            if probe in c:
                line = f"{{{{- if {VALUE} }}}}\n{{pad}}scheme: HTTPS\n{{{{- end }}}}"
                c[probe]["httpGet"][mark("line", line)] = ""
    elif _key(o) == ("PodMonitor", "instaslice"):
        endpoint = o["spec"]["podMetricsEndpoints"][0]
        endpoint[mark("line", _ENDPOINT)] = ""


# what the component's PodMonitor patch adds (the comparison with kustomize checks it)
_ENDPOINT = f"""\
{{{{- if {VALUE} }}}}
{{pad}}scheme: https
{{pad}}tlsConfig:
{{pad}}  insecureSkipVerify: true
{{pad}}authorization:
{{pad}}  type: Bearer
{{pad}}  credentials:
{{pad}}    name: instaslice-metrics-scraper-token
{{pad}}    key: token
{{{{- end }}}}"""
