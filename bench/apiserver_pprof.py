"""Where a request kind's API server CPU goes: its handler path, and the admission policies' share.

`bench.apiserver_cost --pprof DIR` takes a Go CPU profile of the kube-apiserver
(`/debug/pprof/profile`, the API server started with `--profiling=true`) while one request
kind is sent without pause, once per pod policy variant and round, and reads it here:
of the samples whose stack passes through the kind's handler (a create, a patch, a PUT), the
share that also passes through the ValidatingAdmissionPolicy plugin (every policy that matches
the request: for pods, `instaslice-pods` and `instaslice-controller-pods`). Read with
`go tool pprof -traces`, so the numbers are what `go tool pprof -focus` would show.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# the frame a kind's samples pass through, where the object is stored and admission's
# validating phase runs (the frames of docs/benchmarks.md's earlier attribution; the setup's
# own writes, e.g. the pods a status patch needs, go through other handlers: not counted)
HANDLER = {
    "create": "handlers.CreateResource.createHandler.func1.2",
    "patch": "handlers.(*patcher).patchResource.func2",
    "update": "cacher.(*CacheDelegator).GuaranteedUpdate",
}
VAP = "admission/plugin/policy/validating."
_SEP = re.compile(r"^-+\+-+$")
_VALUE = re.compile(r"^\s*([0-9.]+)(ns|us|µs|ms|s)\s+(\S.*)$")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Share:
    """CPU seconds in the handler path, and in the policies inside it."""

    path_s: float
    policies_s: float

    @property
    def fraction(self) -> float:
        return self.policies_s / self.path_s if self.path_s else 0.0


def traces(text: str) -> list[tuple[float, list[str]]]:
    """(seconds, frames) of each stack in `go tool pprof -traces` output."""
    out: list[tuple[float, list[str]]] = []
    current: list[str] | None = None
    value = 0.0
    for line in text.splitlines():
        if _SEP.match(line.strip()):
            if current:
                out.append((value, current))
            current = []
            continue
        if current is None:
            continue  # the header before the first stack
        m = _VALUE.match(line)
        if m and not current:
            value = float(m.group(1)) * _UNIT[m.group(2)]
            current.append(m.group(3).strip())
        elif line.strip():
            current.append(line.strip())
    if current:
        out.append((value, current))
    return out


def share(text: str, handler: str) -> Share:
    """The policies' share of the samples under `handler` (a key of HANDLER)."""
    needle = HANDLER[handler]
    path = policies = 0.0
    for value, frames in traces(text):
        if not any(needle in f for f in frames):
            continue
        path += value
        if any(VAP in f for f in frames):
            policies += value
    return Share(round(path, 3), round(policies, 3))


def go_traces(profile: Path) -> str:
    """`go tool pprof -traces PROFILE` (the Go toolchain `make kube-bins` uses)."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    done = subprocess.run([go, "tool", "pprof", "-traces", str(profile)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout
