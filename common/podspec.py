"""Reading slice requests out of Pod JSON, the same way everywhere.

The webhook validates and rewrites what users write (`nvidia.com/mig-*`); everything after
admission (allocator, node agent, kubectl plugin) reads the rewritten pod, whose slice asks
are the `instaslice.io/mig-*` limits of its containers and sidecars (and
`instaslice.io/gpu`, whole GPUs, read as the profile "gpu"), or in DRA mode, where the pod
names a ResourceClaim instead, its `instaslice.io/asks` annotation. Ephemeral
containers never get slices (docs/contract.md §1) and are never read here.

Init containers that are not sidecars (`restartPolicy: Always`) never get slices either: every
container keeps its slices for the pod's whole life, but ResourceQuota, the scheduler and Kueue
charge a pod only its largest such init container's ask (they run one after another), so
their slices would be held uncharged (docs/contract.md §1, docs/security.md). The webhook and
the pod policy refuse such asks; `slice_requests` refuses them too.

Counts are Kubernetes quantities; only plain positive integers ("1", "2") are slice counts.
The webhook refuses anything else at admission, so after admission `slice_requests` raising
`SliceRequestError` means the pod did not come through the webhook (the cluster-wide policy
refuses such pods too): callers treat it as a permanent error for that pod.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from common.constants import (
    ASKS_ANNOTATION,
    CLAIM_ANNOTATION,
    INSTASLICE_GPU,
    INSTASLICE_MIG_PREFIX,
    WHOLE_GPU_PROFILE,
)
from common.profiles import ProfileNameError, profile_from_suffix

ContainerField = Literal["containers", "initContainers"]
CONTAINER_FIELDS: tuple[ContainerField, ...] = ("containers", "initContainers")

_COUNT = re.compile(r"^[1-9][0-9]{0,17}$")  # below 10^18: int() of it is always safe


class SliceRequestError(ValueError):
    """A pod's `instaslice.io/mig-*` request that is not a valid slice ask."""


@dataclass(frozen=True, slots=True)
class SliceAsk:
    """`count` slices of `profile` (NVIDIA spelling) for one container."""

    container: str
    profile: str
    count: int


def parse_count(value: object) -> int | None:
    """A slice count: a positive integer (JSON int or a plain decimal string), else None.

    Quantities such as "1k", "0.5", "1e3", "-1" or "0" are not slice counts.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 < value < 10**18 else None
    if isinstance(value, str) and _COUNT.match(value):
        return int(value)
    return None


def iter_containers(pod: Mapping[str, Any]) -> Iterator[tuple[ContainerField, int, Any]]:
    """(field, index, container) of every container then every initContainer.

    Tolerates malformed JSON (yields whatever the list holds; non-lists yield nothing).
    """
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return
    for fld in CONTAINER_FIELDS:
        items = spec.get(fld)
        if isinstance(items, list):
            for i, c in enumerate(items):
                yield fld, i, c


def is_sidecar(container: Mapping[str, Any]) -> bool:
    """An init container with `restartPolicy: Always`: it runs beside the app containers, and
    Kubernetes (quota, scheduler, Kueue) sums its requests with theirs."""
    return container.get("restartPolicy") == "Always"


def holds_uncharged(fld: str, container: Mapping[str, Any]) -> bool:
    """Whether slices asked by this container would be held uncharged: an init container
    that is not a sidecar (see the module docstring). Such a container may not ask."""
    return fld == "initContainers" and not is_sidecar(container)


def pod_claim(pod: Mapping[str, Any]) -> str | None:
    """The pod's `instaslice.io/claim` annotation, if it has one."""
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    claim = annotations.get(CLAIM_ANNOTATION) if isinstance(annotations, Mapping) else None
    return claim if isinstance(claim, str) else None


def slice_requests(pod: Mapping[str, Any]) -> list[SliceAsk]:
    """Every slice ask of a rewritten pod, in container order (containers, then sidecars);
    in DRA mode, those of its `instaslice.io/asks` annotation (`decode_asks`).

    Raises SliceRequestError for an `instaslice.io/mig-*` limit that names no profile, whose
    count is not a positive integer, or that an init container other than a sidecar asks.
    """
    meta = pod.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if isinstance(annotations, Mapping) and ASKS_ANNOTATION in annotations:
        return decode_asks(pod, annotations[ASKS_ANNOTATION])
    asks: list[SliceAsk] = []
    for fld, _, c in iter_containers(pod):
        if not isinstance(c, Mapping):
            continue
        resources = c.get("resources")
        limits = resources.get("limits") if isinstance(resources, Mapping) else None
        if not isinstance(limits, Mapping):
            continue
        for key, value in limits.items():
            whole = key == INSTASLICE_GPU
            if not (isinstance(key, str) and (whole or key.startswith(INSTASLICE_MIG_PREFIX))):
                continue
            name = c.get("name")
            if holds_uncharged(fld, c):
                raise SliceRequestError(
                    f"init container {name!r}: {key} in an init container that is not a "
                    "sidecar (restartPolicy: Always); no quota would count its slices"
                )
            try:
                profile = (
                    WHOLE_GPU_PROFILE
                    if whole
                    else profile_from_suffix(key[len(INSTASLICE_MIG_PREFIX) :])
                )
            except ProfileNameError as exc:
                raise SliceRequestError(f"container {name!r}: {exc}") from exc
            count = parse_count(value)
            if count is None:
                raise SliceRequestError(
                    f"container {name!r}: {key}={value!r} is not a positive integer count"
                )
            asks.append(SliceAsk(str(name), profile, count))
    return asks


def encode_asks(asks: Sequence[SliceAsk]) -> str:
    """DRA mode's `instaslice.io/asks` (docs/contract.md §8): `[[container, profile, n], ...]`."""
    return json.dumps([[a.container, a.profile, a.count] for a in asks], separators=(",", ":"))


def decode_asks(pod: Mapping[str, Any], text: object) -> list[SliceAsk]:
    """The asks of `instaslice.io/asks`; SliceRequestError when it is not what admission
    writes: a list of [container, profile, count] naming the pod's containers or sidecars."""
    try:
        rows = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        rows = None
    if not isinstance(rows, list):
        raise SliceRequestError(f"{ASKS_ANNOTATION} is not a JSON list")
    asking = {
        c.get("name")
        for fld, _, c in iter_containers(pod)
        if isinstance(c, Mapping) and not holds_uncharged(fld, c)
    }
    asks: list[SliceAsk] = []
    for row in rows:
        ok = isinstance(row, list) and len(row) == 3 and row[0] in asking
        count = parse_count(row[2]) if ok else None
        if not ok or not isinstance(row[1], str) or count is None:
            raise SliceRequestError(
                f"{ASKS_ANNOTATION}: {row!r} is not [container or sidecar, profile, count]"
            )
        asks.append(SliceAsk(row[0], row[1], count))
    return asks
