"""`python -m hack.dev up|down|status` (`make dev-up` / `make dev-down`): the command line of
hack/dev.py's DevSystem, apart so that module stays about the system itself."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hack.cluster.controlplane import ControlPlane
from hack.cluster.nodes import load_spec
from hack.dev import REPO, DevSystem

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hack.dev", description=__doc__)
    ap.add_argument("command", choices=["up", "down", "status"])
    ap.add_argument("--dir", type=Path, default=Path(".dev"))
    ap.add_argument("--spec", type=Path, default=REPO / "hack" / "specs" / "dev.yaml")
    args = ap.parse_args(argv)
    if args.command == "down":
        system = DevSystem.attach(args.dir)
        if system is None:
            cp = ControlPlane.attach(args.dir.absolute() / "cluster", require_alive=False)
            if cp is not None:
                cp.stop()
            print("nothing running" if cp is None else "stopped the control plane")
            return 0
        system.down()
        print("stopped InstaSlice and the control plane")
        return 0
    if args.command == "status":
        system = DevSystem.attach(args.dir)
        if system is None:
            print("not running")
            return 1
        node_procs = list(system.real.processes.items()) if system.real is not None else []
        for name, rec in [*system.processes.items(), *node_procs]:
            print(
                f"  {name:<10} pid {rec.pid:<8} {'running' if rec.alive() else 'DEAD'}  {rec.log}"
            )
        return 0
    t0 = time.monotonic()
    spec = load_spec(args.spec)
    system = DevSystem.up(args.dir, spec)
    real = "" if system.real is None else f" + real node {system.real.name} (kubelet+containerd)"
    auto = "".join(
        f" + autoscaled {g.prefix} (0..{g.autoscaled_max} nodes, Karpenter)"
        for g in spec.autoscaled_groups
    )
    print(
        f"InstaSlice is up in {time.monotonic() - t0:.1f}s on "
        f"{len(system.kwok_nodes)} KWOK GPU nodes{real}{auto}"
    )
    print(f"  kubeconfig: {system.kubeconfig}")
    print(
        f"  kubectl:    {args.dir / 'bin' / 'kubectl'} --kubeconfig {system.kubeconfig} get pods -A"
    )
    print(f"  slice map:  .venv/bin/kubectl-instaslice --kubeconfig {system.kubeconfig} nodes")
    print(
        f"  logs:       {system.logs}/   GPUs: {system.gpu_state}/   CDI: {system.dir / 'nodes'}/"
    )
    print("  opt a namespace in: kubectl annotate ns NS instaslice.io/enabled=true")
    if system.kueue_port:
        config = system.dir / "kueue-config.yaml"
        print(f"  Kueue:      {system.logs}/kueue.log, configuration {config} (docs/kueue.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
