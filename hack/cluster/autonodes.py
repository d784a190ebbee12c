"""Serve the nodes of autoscaled groups as they come and go (`make dev-up`, the e2e tests).

In a cluster the node agent is a DaemonSet: a node the autoscaler adds gets an agent pod, and
the pod goes with the node. Here the agents are local processes, so this process plays the
DaemonSet for the autoscaled groups: it watches Nodes labelled `instaslice.io/node-group`
(hack.cluster.karpenter) and, for each node of a group it serves,

- when it appears: gives it emulated GPUs of the group's model and MIG mode
  (`nodeagent.emulator.provision`, state under `--emu-state`) and starts an emulated node
  agent for it (`instaslice-nodeagent --emulate --node N`), which creates its MigNode and
  advertises its `instaslice.io/mig-*` capacity;
- when it is deleted: stops that agent (in a cluster the DaemonSet pod goes with the node),
  deletes the node's MigNode and the agent's heartbeat Lease, and removes the emulated GPUs'
  state and CDI directory, so nothing of InstaSlice is left of the node. In a cluster nothing
  deletes those two objects yet (docs/autoscaling.md, "Scale-down").

    python -m hack.cluster.autonodes --kubeconfig K --emu-state DIR --cdi-root DIR \\
        --logs DIR --namespace NS --group PREFIX=MODEL:GPUS:MIGMODE [--group ...] [-- AGENT ARGS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog

from common.kubeapi import Informer, Kube, Obj, connected, core_path, group_path, instaslice_path
from hack.cluster.karpenter import GROUP_LABEL
from hack.cluster.procs import ProcessRecord, spawn, stop_process
from nodeagent.emulator import provision

log = structlog.get_logger("autonodes")


@dataclass(frozen=True)
class Group:
    prefix: str
    model: str
    gpus: int
    mig_mode: Literal["enabled", "disabled"]

    @classmethod
    def parse(cls, text: str) -> Group:
        """`PREFIX=MODEL:GPUS:MIGMODE`."""
        try:
            prefix, rest = text.split("=", 1)
            model, gpus, mode = rest.split(":")
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--group {text!r}: expected PREFIX=MODEL:GPUS:MIGMODE"
            ) from None
        if mode not in ("enabled", "disabled"):
            raise argparse.ArgumentTypeError(f"--group {text!r}: MIGMODE is enabled or disabled")
        return cls(prefix, model, int(gpus), "enabled" if mode == "enabled" else "disabled")


@dataclass
class Served:
    record: ProcessRecord
    popen: subprocess.Popen[bytes]


class AutoNodes:
    def __init__(self, kube: Kube, args: argparse.Namespace) -> None:
        self.kube = kube
        self.args = args
        self.groups: dict[str, Group] = {g.prefix: g for g in args.group}
        self.served: dict[str, Served] = {}

    async def on_node(self, etype: str, obj: Obj) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        group = self.groups.get((meta.get("labels") or {}).get(GROUP_LABEL, ""))
        if group is None or not name:
            return
        if etype == "DELETED":
            await self.forget(name)
        elif name not in self.served and not meta.get("deletionTimestamp"):
            await asyncio.to_thread(self.serve, name, group)

    def serve(self, node: str, group: Group) -> None:
        provision(Path(self.args.emu_state), node, [group.model] * group.gpus, group.mig_mode)
        cdi = Path(self.args.cdi_root) / node / "cdi"
        cdi.mkdir(parents=True, exist_ok=True)
        argv = [
            str(Path(sys.executable).parent / "instaslice-nodeagent"),
            f"--kubeconfig={self.args.kubeconfig}",
            "--emulate",
            f"--emu-state={self.args.emu_state}",
            f"--node={node}",
            f"--cdi-dir={cdi}",
            f"--namespace={self.args.namespace}",
            "--metrics-port=0",
            *self.args.agent_args,
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        popen, rec = spawn(
            f"nodeagent-{node}", argv, Path(self.args.logs) / f"nodeagent-{node}.log", env=env
        )
        self.served[node] = Served(rec, popen)
        log.info("serving a new node", node=node, group=group.prefix, pid=rec.pid)

    async def forget(self, node: str) -> None:
        served = self.served.pop(node, None)
        if served is not None:
            await asyncio.to_thread(stop_process, served.record, served.popen)
        lease = group_path("coordination.k8s.io/v1", "leases", self.args.namespace, node)
        await self.kube.delete_ignore_missing(instaslice_path("mignodes", name=node))
        await self.kube.delete_ignore_missing(lease)
        await asyncio.to_thread(self._remove_files, node)
        log.info("node gone: its agent, MigNode, Lease and emulated GPUs removed", node=node)

    def _remove_files(self, node: str) -> None:
        for f in Path(self.args.emu_state).glob(f"{node}.*"):  # GPUs, agent checkpoint, CDI base
            f.unlink(missing_ok=True)
        shutil.rmtree(Path(self.args.cdi_root) / node, ignore_errors=True)

    async def run(self) -> None:
        informer = Informer(
            self.kube, core_path("nodes"), self.on_node, label_selector=GROUP_LABEL, name="nodes"
        )
        try:
            await informer.run()
        finally:
            for node in list(self.served):
                served = self.served.pop(node)
                stop_process(served.record, served.popen)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hack.cluster.autonodes", description=__doc__)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--emu-state", required=True)
    p.add_argument("--cdi-root", required=True)
    p.add_argument("--logs", required=True)
    p.add_argument("--namespace", default="instaslice-system")
    p.add_argument("--group", type=Group.parse, action="append", required=True)
    p.add_argument("agent_args", nargs="*", help="passed to every node agent (after --)")
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    async with connected(args.kubeconfig) as kube:
        with contextlib.suppress(asyncio.CancelledError):
            await AutoNodes(kube, args).run()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
