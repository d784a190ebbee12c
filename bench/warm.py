"""Warm slices in the latency benchmark (docs/warm-slices.md): the agent's hit and miss
counts around a scenario, from its `/metrics` (`instaslice_nodeagent_warm_slices_total`).

Hit rate = hits / (hits + misses): the share of a scenario's slices that were handed over
made, with no NVML call on the pod's path. Pure parsing here; the scrape is one GET.
"""

from __future__ import annotations

import re
import urllib.request
from typing import Any

_SERIES = re.compile(r"^instaslice_nodeagent_warm_slices_total\{([^}]*)\}\s+([0-9.eE+-]+)$", re.M)
_EVENT = re.compile(r'event="([^"]*)"')


def agent_scrape(port: int) -> str:
    """The agent's /metrics text; "" when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def warm_counts(text: str) -> dict[str, float]:
    """Per event (hit, miss, made, destroyed): the sum over every node the agent serves."""
    out: dict[str, float] = {}
    for labels, value in _SERIES.findall(text):
        ev = _EVENT.search(labels)
        if ev is not None:
            out[ev.group(1)] = out.get(ev.group(1), 0.0) + float(value)
    return out


def warm_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """What happened between the two scrapes; None when the agent counted nothing warm."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if not any(delta.values()):
        return None
    hits, misses = delta.get("hit", 0.0), delta.get("miss", 0.0)
    asked = hits + misses
    return {
        "hits": int(hits),
        "misses": int(misses),
        "made": int(delta.get("made", 0.0)),
        "destroyed": int(delta.get("destroyed", 0.0)),
        "hit_rate": round(hits / asked, 3) if asked else None,
    }
