"""`instaslice-emu`: the emulator's own CLI, speaking like `nvidia-smi mig` (docs/contract.md §6).

    instaslice-emu lgip  --model H200-141GB          # nvidia-smi mig -lgip of GPU 0
    instaslice-emu lgipp --model H200-141GB          # nvidia-smi mig -lgipp
    instaslice-emu lgi   --state DIR --node NODE     # "<gpu> <profile> <id> <gi> <start>:<size>"
    instaslice-emu provision --state DIR --node NODE --model M --gpus N [--mig-mode disabled]
    instaslice-emu reboot|reset-gpu|gpu-lost|xid|fail-next|latency|vm|add-process|remove-process

`lgip`/`lgipp` also take `--state/--node` instead of `--model` to list every GPU of an
emulated node, with the free counts it has now. Exit status: 0 ok, 2 usage, 1 refused.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from common.catalog import CatalogError, GpuModel, load_catalog, load_model_file
from nodeagent.emulator import rules, smi
from nodeagent.emulator.control import EmulatorControl, EmulatorError, provision
from nodeagent.emulator.state import MIG_ENABLE, OPS, EmulatorState, Op


def _model(name: str | None, model_file: Path | None = None) -> GpuModel:
    """The catalog's `name`, or the model a table file defines (`--model-file`)."""
    if model_file is not None:
        try:
            table = load_model_file(model_file)
        except CatalogError as exc:
            raise EmulatorError(str(exc)) from None
        if name and name != table.name:
            raise EmulatorError(f"--model {name} but {model_file} defines {table.name}")
        return table
    if not name:
        raise EmulatorError("give --model or --model-file")
    model = load_catalog().model(name)
    if model is None:
        known = ", ".join(m.name for m in load_catalog().models)
        raise EmulatorError(f"unknown model {name!r}; known: {known}")
    return model


def _node_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--state", type=Path, required=required, help="emulator state directory")
    p.add_argument("--node", required=required, help="emulated node name")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="instaslice-emu", description="NVML emulator CLI (like nvidia-smi mig)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("lgip", "GPU instance profiles"), ("lgipp", "their placements")):
        p = sub.add_parser(name, help=f"like nvidia-smi mig -{name}: {text}")
        p.add_argument("--model", help="catalog model name, e.g. H200-141GB")
        p.add_argument("--model-file", type=Path, help="a model table file (no catalog)")
        _node_args(p, required=False)
    _node_args(sub.add_parser("lgi", help="list the GPU instances of an emulated node"))
    p = sub.add_parser(
        "provision", help="give an emulated node these GPUs (kept if it has exactly them)"
    )
    _node_args(p)
    p.add_argument("--model", help="catalog model name")
    p.add_argument("--model-file", type=Path, help="a model table file (no catalog)")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--mig-mode", choices=("enabled", "disabled"), default="enabled")
    p = sub.add_parser("reboot", help="reboot the node: instances go, boot id changes")
    _node_args(p)
    keep = p.add_mutually_exclusive_group()
    keep.add_argument("--clear-mig-mode", action="store_true", help="MIG mode does not survive")
    keep.add_argument(
        "--keep-mig-mode", action="store_true", help="MIG mode survives (default: per model)"
    )
    p = sub.add_parser("reset-gpu", help="nvidia-smi -r: pending MIG mode applies")
    _node_args(p)
    p.add_argument("--gpu", type=int, required=True)
    p.add_argument("--force", action="store_true", help="even with processes attached")
    p = sub.add_parser("gpu-lost", help="the GPU falls off the bus (XID 79)")
    _node_args(p)
    p.add_argument("--gpu", type=int, required=True)
    p = sub.add_parser("xid", help="emit an XID critical-error event")
    _node_args(p)
    p.add_argument("--gpu", type=int, required=True)
    p.add_argument("--xid", type=int, required=True)
    p = sub.add_parser("fail-next", help="fail upcoming create/destroy calls")
    _node_args(p)
    p.add_argument("--op", choices=OPS, required=True)
    p.add_argument("--code", type=int, required=True, help="NVML error code, e.g. 23")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--skip", type=int, default=0, help="let this many calls pass first")
    p = sub.add_parser("latency", help="per-call latency of creates and destroys")
    _node_args(p)
    p.add_argument("--create-ms", type=int)
    p.add_argument("--destroy-ms", type=int)
    p.add_argument("--mode-ms", type=int, help="latency of a MIG mode change")
    p = sub.add_parser("vm", help="make the node a pass-through VM guest (or not)")
    _node_args(p)
    p.add_argument("--on", choices=("true", "false"), required=True)
    for name in ("add-process", "remove-process"):
        p = sub.add_parser(name, help=f"{name.split('-')[0]} an emulated process")
        _node_args(p)
        p.add_argument("--uuid", required=True, help="MIG-... or GPU-...")
        if name == "add-process":
            continue
        p.add_argument("--pid", type=int, help="default: all processes of the device")
    return parser


def _free_counts(state: EmulatorState) -> list[tuple[int, GpuModel, list[int]]]:
    out = []
    for gpu in state.gpus:
        model = gpu.spec
        free = [
            rules.remaining_capacity(gpu, model, p)
            if gpu.mig_current == MIG_ENABLE
            else p.max_count
            for p in model.profiles
        ]
        out.append((gpu.index, model, free))
    return out


def _listing(args: argparse.Namespace) -> str:
    if args.model or args.model_file:
        model = _model(args.model, args.model_file)
        return smi.lgip([(0, model, None)]) if args.command == "lgip" else smi.lgipp([(0, model)])
    if not (args.state and args.node):
        raise EmulatorError("give --model, or --state and --node")
    gpus = _free_counts(EmulatorControl(args.state, args.node).state())
    if args.command == "lgip":
        return smi.lgip(gpus)
    return smi.lgipp([(i, m) for i, m, _ in gpus])


def run(argv: Sequence[str] | None = None) -> str:
    """Carry out one command; returns what to print (raises EmulatorError if refused)."""
    args = _parser().parse_args(argv)
    cmd = args.command
    if cmd in ("lgip", "lgipp"):
        return _listing(args)
    if cmd == "provision":
        model = _model(args.model, args.model_file)
        tables = (model,) if args.model_file else ()
        provision(args.state, args.node, [model.name] * args.gpus, args.mig_mode, tables)
        return ""
    control = EmulatorControl(args.state, args.node)
    if cmd == "lgi":
        rows = {(r.gpu_index, r.gi_id): r for r in control.instances()}
        return "".join(
            f"{r.gpu_index} {r.profile_name} {r.profile_id} {r.gi_id} {r.start}:{r.size}\n"
            for r in rows.values()
        )
    if cmd == "reboot":
        keep = False if args.clear_mig_mode else (True if args.keep_mig_mode else None)
        return control.reboot(keep_mig_mode=keep) + "\n"
    if cmd == "reset-gpu":
        control.reset_gpu(args.gpu, force=args.force)
    elif cmd == "gpu-lost":
        control.gpu_lost(args.gpu)
    elif cmd == "xid":
        control.emit_xid(args.gpu, args.xid)
    elif cmd == "fail-next":
        control.fail_next(cast(Op, args.op), args.code, args.count, skip=args.skip)
    elif cmd == "latency":
        control.set_latency(
            create_ms=args.create_ms, destroy_ms=args.destroy_ms, mode_ms=args.mode_ms
        )
    elif cmd == "vm":
        control.set_vm(args.on == "true")
    elif cmd == "add-process":
        return f"{control.add_process(args.uuid)}\n"
    elif cmd == "remove-process":
        control.remove_process(args.uuid, args.pid)
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    try:
        out = run(argv)
    except EmulatorError as exc:
        print(f"instaslice-emu: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
