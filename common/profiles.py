"""MIG profile names in NVIDIA's grammar, and their Kubernetes resource spellings.

Grammar (go-nvlib `mig_profile.go`): `[<C>c.]<G>g.<M>gb[+me|+me.all|+gfx|-me]`.
Resource names cannot hold `+`, so in `nvidia.com/mig-*` / `instaslice.io/mig-*` the `+`
becomes a dot: `1g.18gb+me` ⇄ `nvidia.com/mig-1g.18gb.me` (docs/contract.md §1). `-me` is legal
in resource names and kept as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.constants import INSTASLICE_MIG_PREFIX, NVIDIA_MIG_PREFIX

_NAME = re.compile(
    r"^(?:(?P<c>[1-9][0-9]*)c\.)?(?P<g>[1-9][0-9]*)g\.(?P<gb>[1-9][0-9]*)gb"
    r"(?P<attr>\+me\.all|\+me|\+gfx|-me)?$"
)
_RESOURCE_SUFFIX = re.compile(
    r"^(?P<base>[1-9][0-9]*g\.[1-9][0-9]*gb)(?P<attr>\.me\.all|\.me|\.gfx|-me)?$"
)


class ProfileNameError(ValueError):
    """A string that is not a MIG profile name."""


@dataclass(frozen=True, slots=True)
class ProfileName:
    gi_slices: int
    memory_gb: int
    ci_slices: int | None = None
    attribute: str = ""  # "", "+me", "+me.all", "+gfx" or "-me"

    def __str__(self) -> str:
        ci = f"{self.ci_slices}c." if self.ci_slices is not None else ""
        return f"{ci}{self.gi_slices}g.{self.memory_gb}gb{self.attribute}"

    @property
    def gi_profile(self) -> str:
        """The GPU-instance profile this names (drops a `<C>c.` compute-instance prefix)."""
        return f"{self.gi_slices}g.{self.memory_gb}gb{self.attribute}"


def parse_profile(name: str) -> ProfileName:
    m = _NAME.match(name)
    if m is None:
        raise ProfileNameError(f"{name!r} is not a MIG profile name (e.g. 1g.18gb, 3g.71gb+me)")
    ci = int(m["c"]) if m["c"] else None
    g = int(m["g"])
    if ci is not None and ci > g:
        raise ProfileNameError(f"{name!r}: compute slices {ci} exceed GPU-instance slices {g}")
    return ProfileName(gi_slices=g, memory_gb=int(m["gb"]), ci_slices=ci, attribute=m["attr"] or "")


def resource_suffix(profile: str) -> str:
    """`1g.18gb+me` → `1g.18gb.me` (the part after `nvidia.com/mig-`)."""
    parsed = parse_profile(profile)
    if parsed.ci_slices is not None:
        raise ProfileNameError(f"{profile!r}: resource names take GPU-instance profiles only")
    return profile.replace("+", ".")


def nvidia_resource(profile: str) -> str:
    return NVIDIA_MIG_PREFIX + resource_suffix(profile)


def instaslice_resource(profile: str) -> str:
    return INSTASLICE_MIG_PREFIX + resource_suffix(profile)


def profile_from_suffix(suffix: str) -> str:
    """`1g.18gb.me` → `1g.18gb+me`; raises ProfileNameError when it is not a profile."""
    m = _RESOURCE_SUFFIX.match(suffix)
    if m is None:
        raise ProfileNameError(f"{suffix!r} is not a MIG profile resource suffix")
    attr = m["attr"] or ""
    if attr.startswith("."):
        attr = "+" + attr[1:]
    return m["base"] + attr


def profile_from_resource(resource: str) -> str | None:
    """The profile a `nvidia.com/mig-*` or `instaslice.io/mig-*` resource names, else None.

    Raises ProfileNameError for a MIG-prefixed resource whose suffix is malformed.
    """
    for prefix in (NVIDIA_MIG_PREFIX, INSTASLICE_MIG_PREFIX):
        if resource.startswith(prefix):
            return profile_from_suffix(resource[len(prefix) :])
    return None
