"""One container's asks, validated and turned into patch ops (the decision: webhook/admission.py).

`ContainerChecks` holds what a review collects (problems, ops, asks) and checks one container
at a time: its MIG and whole-GPU resources (profile known, counts, requests equal to limits;
an init container that is not a sidecar may not ask) and its env (nothing may name an
InstaSlice device; NVIDIA_VISIBLE_DEVICES is set here in the env binding mode). The pod-wide
checks, the claim, the gate and the annotations stay with the decision. Pure, like it.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from typing import Any, Final

from common.constants import (
    CDI_KIND,
    INSTASLICE_GPU,
    INSTASLICE_MIG_PREFIX,
    NVIDIA_GPU,
    NVIDIA_MIG_PREFIX,
    VISIBLE_DEVICES_ENV,
    WHOLE_GPU_PROFILE,
    AllocationMode,
)
from common.podspec import SliceAsk, parse_count
from common.profiles import ProfileNameError, profile_from_suffix
from webhook.reviews import CauseReason, Obj, PatchOp, StatusCause
from webhook.settings import AdmissionSettings

DEVICE_MARK: Final = CDI_KIND + "="
_MAX_LISTED = 40


def is_mig_key(key: object) -> bool:
    return isinstance(key, str) and key.startswith((NVIDIA_MIG_PREFIX, INSTASLICE_MIG_PREFIX))


def is_gpu_key(key: object) -> bool:
    return key in (NVIDIA_GPU, INSTASLICE_GPU)


def _unknown(profile: str, settings: AdmissionSettings, *, listing: bool) -> str:
    """Why `profile` is refused, the closest offered names, and (`listing`: once per review,
    so many typos do not repeat it) every profile that may be asked for."""
    cluster = settings.cluster_profiles
    offered = sorted(cluster or settings.known_profiles)
    close = difflib.get_close_matches(profile, offered, n=3, cutoff=0.6)
    text = (
        f"unknown MIG profile {profile}: no GPU model in the catalog offers it and no node "
        "published it" + (f" (did you mean {' or '.join(close)}?)" if close else "")
    )
    if not listing:
        return text
    listed = ", ".join(offered[:_MAX_LISTED]) + (", …" if len(offered) > _MAX_LISTED else "")
    if cluster:
        return f"{text}. The cluster's GPUs offer: {listed}"
    return f"{text}. No node has published its GPUs yet, the catalog offers: {listed}"


def show(value: object, limit: int = 64) -> str:
    """A value for a message: JSON, truncated (hostile input must not bloat the answer)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _uncharged(where: str, name: str, *, why: bool) -> str:
    """Why an init container that is not a sidecar may not ask (`why`: the reason and the
    remedy, once per review, so several asks do not repeat it)."""
    text = f"{where}: init container {show(name)} is not a sidecar, so it may not ask for slices"
    if not why:
        return text
    return (
        f"{text}. InstaSlice gives every container its own slices for the pod's whole life, "
        "but ResourceQuota, the scheduler and Kueue charge a pod only its largest init "
        "container's ask (init containers run one after another), so these slices would be "
        "held uncharged. Move the ask to an app container (spec.containers), or make this "
        "init container a sidecar (restartPolicy: Always), which Kubernetes counts with the "
        "app containers"
    )


def esc(token: str) -> str:
    """One JSON Pointer reference token (RFC 6901): `~` → `~0`, `/` → `~1`."""
    return token.replace("~", "~0").replace("/", "~1")


@dataclass(kw_only=True)
class ContainerChecks:
    """The problems, ops and asks of one review, and the checks of one container."""

    settings: AdmissionSettings
    whole_gpu: bool = False
    causes: list[StatusCause] = field(default_factory=list)  # one per problem found
    ops: list[PatchOp] = field(default_factory=list)
    asks: list[SliceAsk] = field(default_factory=list)

    def _problem(self, path: str, message: str, reason: CauseReason = "FieldValueInvalid") -> None:
        """Report one problem: `message` for the denial's text, `path` (the API field path)
        and `reason` for its cause."""
        self.causes.append({"reason": reason, "message": message, "field": path})

    def _refuse_uncharged(self, path: str, name: str, also: str = "") -> None:
        """Refuse a non-sidecar init container's ask at `path` (`also`: more of where)."""
        why = not any("held uncharged" in c["message"] for c in self.causes)
        self._problem(path, _uncharged(path + also, name, why=why), "FieldValueForbidden")

    def _resources(self, c: Obj, fld: str, i: int, name: str, held: bool) -> bool:
        """Validate one container's MIG resources and queue their renames; True if it asks.
        `held`: a non-sidecar init container, whose every ask is refused (`_uncharged`)."""
        resources = c.get("resources")
        if resources is None:
            return False
        where = f"container {show(name)}"
        at = f"spec.{fld}[{i}].resources"  # the API field path
        if not isinstance(resources, dict):
            self._problem(at, f"{where}: resources is not an object")
            return False
        sections: dict[str, dict[str, Any]] = {}
        for section in ("limits", "requests"):
            entries = resources.get(section)
            if entries is None:
                entries = {}
            if not isinstance(entries, dict):
                self._problem(f"{at}.{section}", f"{where}: resources.{section} is not an object")
                return False
            sections[section] = entries
        limits, requests = sections["limits"], sections["requests"]
        if held:  # instaslice.io/gpu with or without the opt-in: the pod policy refuses it too
            keys = [
                (section, key)
                for section, entries in sections.items()
                for key in entries
                if is_mig_key(key)
                or key == INSTASLICE_GPU
                or (self.whole_gpu and key == NVIDIA_GPU)
            ]
            for section, key in keys:
                if section == "limits" or key not in limits:
                    where = f"spec.{fld}[{i}].resources.{section}[{key}]"
                    self._refuse_uncharged(where, name)
            return bool(keys)
        base = f"/spec/{fld}/{i}/resources"
        seen: dict[str, str] = {}
        asked = False
        for key, value in limits.items():
            if not is_mig_key(key):
                continue
            asked = True
            field_ = f"resources.limits[{key}]"
            nvidia = key.startswith(NVIDIA_MIG_PREFIX)
            prefix = NVIDIA_MIG_PREFIX if nvidia else INSTASLICE_MIG_PREFIX
            suffix = key[len(prefix) :]
            try:
                profile = profile_from_suffix(suffix)
            except ProfileNameError:
                self._problem(
                    f"{at}.limits[{key}]",
                    f"{where}: {field_}: {show(suffix)} is not a MIG profile "
                    "(e.g. nvidia.com/mig-1g.18gb, nvidia.com/mig-1g.18gb.me for 1g.18gb+me)",
                )
                continue
            if profile not in self.settings.known_profiles:
                listing = not any("unknown MIG profile" in c["message"] for c in self.causes)
                text = _unknown(profile, self.settings, listing=listing)
                self._problem(f"{at}.limits[{key}]", f"{where}: {field_}: {text}")
                continue
            if profile in seen:
                self._problem(
                    f"{at}.limits[{key}]",
                    f"{where}: {field_}: profile {profile} is also asked as {seen[profile]}",
                    "FieldValueDuplicate",
                )
                continue
            seen[profile] = key
            count = self._count(where, field_, value, at)
            if key in requests and requests[key] != value:
                self._problem(
                    f"{at}.requests[{key}]",
                    f"{where}: resources.requests[{key}]: {show(requests[key])} differs from "
                    f"the limit {show(value)} (requests, if given, must equal limits)",
                )
                continue
            if count is None:
                continue
            self.asks.append(SliceAsk(name, profile, count))
            self._rename(base, key, INSTASLICE_MIG_PREFIX + suffix, (limits, requests))
        if self.whole_gpu:
            asked = self._whole(where, name, (at, base), limits, requests) or asked
        for key in requests:
            if is_mig_key(key) and key not in limits:
                asked = True
                self._problem(
                    f"{at}.requests[{key}]",
                    f"{where}: resources.requests[{key}]: a MIG resource in requests must "
                    "also be in limits, with the same count",
                )
        return asked

    def _whole(
        self, where: str, name: str, paths: tuple[str, str], limits: Obj, requests: Obj
    ) -> bool:
        """Whole-GPU asks (`nvidia.com/gpu`, or `instaslice.io/gpu` already): validate, queue
        the rename; True if the container asks. `paths`: the resources' API field path and
        JSON Pointer."""
        at, base = paths
        keys = [k for k in (NVIDIA_GPU, INSTASLICE_GPU) if k in limits or k in requests]
        if not keys:
            return False
        if len(keys) > 1:
            self._problem(f"{at}.limits", f"{where}: asks for whole GPUs as both {NVIDIA_GPU} "
                          f"and {INSTASLICE_GPU}", "FieldValueDuplicate")  # fmt: skip
            return True
        key = keys[0]
        if key not in limits:
            self._problem(
                f"{at}.requests[{key}]",
                f"{where}: resources.requests[{key}]: a GPU request must also be in limits, "
                "with the same count",
            )
            return True
        value = limits[key]
        count = self._count(where, f"resources.limits[{key}]", value, at)
        if key in requests and requests[key] != value:
            self._problem(
                f"{at}.requests[{key}]",
                f"{where}: resources.requests[{key}]: {show(requests[key])} differs from the "
                f"limit {show(value)} (requests, if given, must equal limits)",
            )
            return True
        if count is None:
            return True
        self.asks.append(SliceAsk(name, WHOLE_GPU_PROFILE, count))
        self._rename(base, key, INSTASLICE_GPU, (limits, requests))
        return True

    def _rename(self, base: str, key: str, new_key: str, sections: tuple[Obj, Obj]) -> None:
        """Queue `key` renamed to InstaSlice's `new_key` in limits and requests; in DRA mode
        removed instead: the container names the pod's ResourceClaim (docs/contract.md §8)."""
        dra = self.settings.allocation_mode is AllocationMode.DRA
        if key == new_key and not dra:
            return
        for section, entries in zip(("limits", "requests"), sections, strict=True):
            if key in entries:
                self.ops.append({"op": "remove", "path": f"{base}/{section}/{esc(key)}"})
                if not dra:
                    path = f"{base}/{section}/{esc(new_key)}"
                    self.ops.append({"op": "add", "path": path, "value": entries[key]})

    def _count(self, where: str, field_: str, value: object, at: str) -> int | None:
        """The count of one ask (`field_` of `where`, under the API field path `at`)."""
        path = f"{at}{field_.removeprefix('resources')}"
        count = parse_count(value)
        if count is None:
            self._problem(path, f"{where}: {field_}: count {show(value)} is not a positive integer")
        elif count > self.settings.max_count:
            self._problem(
                path,
                f"{where}: {field_}: count {count} exceeds the limit of "
                f"{self.settings.max_count} slices of one profile per container",
            )
            return None
        return count

    def _env(
        self, c: Obj, fld: str, i: int, name: str, own: str | None, device: str | None
    ) -> bool:
        """Check one container's env and queue the NVIDIA_VISIBLE_DEVICES op.

        `own`: the device this container had under the pod's old claim (a replay); entries
        naming exactly it are InstaSlice's own and are dropped. `device`: the value to set
        (env mode, slice-asking container), else None. True if the op was queued.
        """
        env = c.get("env")
        where = f"container {show(name)}"
        at = f"spec.{fld}[{i}].env"  # the API field path
        if env is not None and not isinstance(env, list):
            self._problem(at, f"{where}: env is not a list")
            return False
        kept: list[Any] = []
        dropped = False
        ok = True
        for j, e in enumerate(env or []):
            if not isinstance(e, dict):
                self._problem(f"{at}[{j}]", f"{where}: env[{j}] is not an object")
                ok = False
                continue
            var, value = e.get("name"), e.get("value")
            if own is not None and var == VISIBLE_DEVICES_ENV and value == own:
                dropped = True  # InstaSlice's own entry of a replayed pod
                continue
            kept.append(e)
            if var == VISIBLE_DEVICES_ENV:
                how = "valueFrom" if "valueFrom" in e else "value"
                self._problem(
                    f"{at}[{j}]",
                    f"{where}: env[{j}] {VISIBLE_DEVICES_ENV} ({how}): containers may not set "
                    "it in a pod asking for MIG slices, InstaSlice assigns each container its "
                    f"slice devices; remove this env entry (InstaSlice sets {VISIBLE_DEVICES_ENV} "
                    "itself)",
                    "FieldValueForbidden",
                )
                ok = False
            elif isinstance(value, str) and DEVICE_MARK in value:
                self._problem(
                    f"{at}[{j}]",
                    f"{where}: env[{j}] {show(var)}: names an {CDI_KIND} CDI device itself, but "
                    "only InstaSlice assigns those",
                    "FieldValueForbidden",
                )
                ok = False
        if not ok:
            return False
        path = f"/spec/{fld}/{i}/env"
        entry = {"name": VISIBLE_DEVICES_ENV, "value": device}
        if dropped:
            value = [*kept, entry] if device else kept
            self.ops.append({"op": "replace", "path": path, "value": value})
        elif device is None:
            return False
        elif env is None:
            self.ops.append({"op": "add", "path": path, "value": [entry]})
        else:
            self.ops.append({"op": "add", "path": f"{path}/-", "value": entry})
        return device is not None
