"""How a container gets the CDI device of its slices (docs/contract.md §4 "Binding modes").

`env`: the webhook already set the container's `NVIDIA_VISIBLE_DEVICES` to its
fully-qualified CDI device name at admission, and the NVIDIA Container Toolkit (CDI mode)
resolves it from the spec file the agent writes; nothing else happens on the node.

`device-plugin` (nodeagent/deviceplugin/, docs/binding.md) serves the kubelet device-plugin
API for `instaslice.io/mig-<profile>` and answers `Allocate` with the CDI device of a prepared
slice; main.py builds it (it needs the node's kubelet paths and the agent). The seam is this
protocol: the lifecycle tells the binding when an allocation's devices are ready and when
they are gone; a binding that needs a server runs it in `run()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol


class Binding(Protocol):
    async def run(self) -> None:
        """Serve whatever the mode needs until cancelled."""

    async def slices_ready(self, namespace: str, claim: str, devices: Mapping[str, str]) -> None:
        """`devices`: container → fully-qualified CDI device name, now in the spec dir."""

    async def slices_released(self, namespace: str, claim: str, uid: str) -> None:
        """The allocation `uid` of that name was released (a newer one may hold the name)."""


class EnvBinding:
    """The `env` mode: the CDI file is the whole contract; nothing to serve."""

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def slices_ready(self, namespace: str, claim: str, devices: Mapping[str, str]) -> None:
        return None

    async def slices_released(self, namespace: str, claim: str, uid: str) -> None:
        return None
