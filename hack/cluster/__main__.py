"""CLI: `python -m hack.cluster up|down|status|nodes` (behind `make cluster-up/-down`).

Layout under --dir (default `.dev`): `kubeconfig` (admin), `cluster/` (state, PKI),
`logs/<process>.log`, and `bin` -> the cached binaries, so `.dev/bin/kubectl` works.
`up` reuses a control plane that is still alive; a half-dead one is stopped and replaced.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from kubernetes_asyncio import config

from common.kubeapi import harden
from hack.cluster.controlplane import ControlPlane, ControlPlaneError
from hack.cluster.nodes import create_nodes, load_spec, wait_nodes_ready


def _link_bin(dev: Path, cp: ControlPlane) -> None:
    link = dev / "bin"
    if link.is_symlink() or link.exists():
        if link.is_symlink() and link.resolve() == cp.bin_dir.resolve():
            return
        link.unlink()
    link.symlink_to(cp.bin_dir)


async def _create_nodes(kubeconfig: Path, spec_path: Path) -> list[str]:
    spec = load_spec(spec_path)
    if spec.real_group is not None:
        print(
            f"note: group {spec.real_group.prefix!r} is runtime: containerd, a real node; "
            "`make dev-up` starts it, this command creates only the KWOK nodes"
        )
    async with harden(await config.new_client_from_config(config_file=str(kubeconfig))) as api:
        names = await create_nodes(api, spec)
        await wait_nodes_ready(api, names, timeout_s=120)
    return names


def cmd_up(dev: Path, spec: Path | None) -> int:
    t0 = time.monotonic()
    cp = ControlPlane.attach(dev / "cluster")
    if cp is not None:
        how = "reused the running one"
    else:
        cp = ControlPlane.start(
            dev / "cluster",
            kubeconfig=dev / "kubeconfig",
            logs_dir=dev / "logs",
            die_with_parent=False,
        )
        how = f"started in {time.monotonic() - t0:.1f}s"
    _link_bin(dev, cp)
    print(f"control plane ready at {cp.server} ({how})")
    if spec is not None:
        names = asyncio.run(_create_nodes(cp.kubeconfig, spec))
        print(f"{len(names)} KWOK nodes from {spec} are Ready")
    print(f"  kubeconfig: {dev / 'kubeconfig'}")
    print(f"  kubectl:    {dev / 'bin' / 'kubectl'} --kubeconfig {dev / 'kubeconfig'} get nodes")
    print(f"  logs:       {cp.logs_dir}/")
    return 0


def cmd_down(dev: Path) -> int:
    cp = ControlPlane.attach(dev / "cluster", require_alive=False)
    if cp is None:
        print("no local control plane recorded; nothing to stop")
        return 0
    n = len(cp.processes)
    cp.stop()
    print(f"stopped the control plane at {cp.server} ({n} process groups)")
    return 0


def cmd_status(dev: Path) -> int:
    cp = ControlPlane.attach(dev / "cluster", require_alive=False)
    if cp is None:
        print("no local control plane recorded")
        return 1
    for p in cp.processes:
        print(f"  {p.name:<24} pid {p.pid:<8} {'running' if p.alive() else 'DEAD'}")
    ok = cp.alive()
    print(f"{cp.server}: {'ready' if ok else 'NOT ready'}; kubeconfig {cp.kubeconfig}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack.cluster", description=__doc__)
    ap.add_argument("command", choices=["up", "down", "status", "nodes"])
    ap.add_argument("--dir", type=Path, default=Path(".dev"), help="state dir (default .dev)")
    ap.add_argument("--spec", type=Path, help="cluster spec YAML: create its KWOK GPU nodes")
    args = ap.parse_args(argv)
    dev: Path = args.dir.absolute()
    dev.mkdir(parents=True, exist_ok=True)
    try:
        if args.command == "up":
            return cmd_up(dev, args.spec)
        if args.command == "down":
            return cmd_down(dev)
        if args.command == "status":
            return cmd_status(dev)
        if args.spec is None:
            ap.error("nodes needs --spec FILE")
        names = asyncio.run(_create_nodes(dev / "kubeconfig", args.spec))
        print(f"{len(names)} KWOK nodes from {args.spec} are Ready")
        return 0
    except ControlPlaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
