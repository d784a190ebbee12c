"""CDI spec files for allocations (docs/contract.md §3 "CDI"; docs/mig-facts.md §4).

One JSON file per allocation, `instaslice.io-<namespace>_<claim>.json`, kind
`instaslice.io/mig`, one device per slice-asking container. A device's edits are exactly what
that container needs for its slices and nothing of another slice: the parent GPU's device
node, the GPU-instance and compute-instance capability nodes
(`/dev/nvidia-caps/nvidia-cap<N>`), and `NVIDIA_VISIBLE_DEVICES=<MIG UUIDs>`. The spec's
top-level edits (applied once per container that gets any device of the spec) are the common
edits of the node's NVIDIA CDI spec (control and UVM nodes, driver library mounts, hooks), so
the container also gets the user-space driver.

A file is named by (namespace, claim), but an allocation is one UID: a pod re-placed after
its slices were released gets a new allocation with the same name. The spec therefore carries
its allocation's UID (annotation `instaslice.io/uid`), and `remove_spec` given a UID unlinks
only a file of that UID, so releasing or collecting the older allocation never deletes the
newer one's file. A file without the annotation (written before it existed) is anyone's.

Building is pure (`build_spec`); the only I/O is the atomic write/remove and reading the two
host files it depends on: the NVIDIA base spec and `/proc/driver/nvidia-caps/mig-minors`. In
emulation a generated base spec and the minors formula of docs/mig-facts.md §2.12 stand in for them.
Device nodes carry type/major/minor when known, so a consumer need not stat host paths that
do not exist (emulation); on real nodes the runtime fills them from the host when absent.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.constants import (
    CDI_FILE_PREFIX,
    CDI_KIND,
    CLAIM_ANNOTATION,
    VISIBLE_DEVICES_ENV,
    cdi_device_name,
)

CDI_VERSION = "0.6.0"
NVIDIA_MAJOR = 195  # /dev/nvidia<N> and /dev/nvidiactl (fixed by the driver)
NVIDIACTL_MINOR = 255
# Dynamic majors: read from /proc/devices on a real node; these stand in under emulation.
EMULATED_UVM_MAJOR = 510
EMULATED_CAPS_MAJOR = 511
DEFAULT_MIG_MINORS = Path("/proc/driver/nvidia-caps/mig-minors")
DEFAULT_PROC_DEVICES = Path("/proc/devices")
UID_ANNOTATION = "instaslice.io/uid"  # the allocation a spec file belongs to

Obj = dict[str, Any]


class CdiError(Exception):
    """A host file the CDI spec depends on is missing or malformed."""


@dataclass(frozen=True, slots=True)
class DevNode:
    path: str
    major: int | None = None
    minor: int | None = None
    host_path: str | None = None  # None: the same as `path` (a real node's /dev)

    def to_json(self) -> Obj:
        out: Obj = {"path": self.path}
        if self.host_path is not None:
            out["hostPath"] = self.host_path
        if self.major is not None and self.minor is not None:
            out.update(type="c", major=self.major, minor=self.minor)
        return out


@dataclass(frozen=True, slots=True)
class SliceNodes:
    """The device nodes and UUID of one created slice (one MIG device), or of one whole GPU
    (its GPU UUID and device node, no capability nodes)."""

    mig_uuid: str
    parent: DevNode
    gi_access: DevNode | None
    ci_access: DevNode | None


# --- /dev/nvidia-caps minors ----------------------------------------------------------------

_MINOR_LINE = re.compile(r"^(?P<name>\S+)\s+(?P<minor>\d+)\s*$")


def parse_mig_minors(text: str) -> dict[str, int]:
    """`/proc/driver/nvidia-caps/mig-minors` → {"gpu0/gi1/access": 12, ...}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _MINOR_LINE.match(line.strip())
        if m:
            out[m["name"]] = int(m["minor"])
    return out


def formula_minor(gpu_minor: int, gi_id: int, ci_id: int | None = None) -> int:
    """docs/mig-facts.md §2.12: gpu{g}/gi{i}/access = 3+135g+9i; .../ci{c}/access = 4+135g+9i+c."""
    base = 135 * gpu_minor + 9 * gi_id
    return 3 + base if ci_id is None else 4 + base + ci_id


def formula_mig_minors(gpu_minors: Iterable[int]) -> dict[str, int]:
    """What `/proc/driver/nvidia-caps/mig-minors` lists for these GPUs (docs/mig-facts.md
    §2.12): the `config` and `monitor` caps, then every possible GPU instance (ids 0-14) and compute
    instance (ids 0-7) of each GPU. Emulated nodes with real device files are made from it."""
    out = {"config": 1, "monitor": 2}
    for g in gpu_minors:
        for gi in range(15):
            out[gi_cap_name(g, gi)] = formula_minor(g, gi)
            for ci in range(8):
                out[ci_cap_name(g, gi, ci)] = formula_minor(g, gi, ci)
    return out


def gi_cap_name(gpu_minor: int, gi_id: int) -> str:
    return f"gpu{gpu_minor}/gi{gi_id}/access"


def ci_cap_name(gpu_minor: int, gi_id: int, ci_id: int) -> str:
    return f"gpu{gpu_minor}/gi{gi_id}/ci{ci_id}/access"


def parse_proc_devices(text: str) -> dict[str, int]:
    """`/proc/devices` character section → {"nvidia-caps": 511, "nvidia-uvm": 510, ...}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            out.setdefault(parts[1], int(parts[0]))
        if line.startswith("Block devices"):
            break
    return out


@dataclass(frozen=True, slots=True)
class DeviceNumbers:
    """How to name a slice's device nodes on this node (host facts, read once)."""

    minors: Mapping[str, int] | None  # None: use the formula (emulation)
    caps_major: int | None
    uvm_major: int | None
    with_numbers: bool  # write type/major/minor into the spec
    # host directory standing in for /dev (an emulated GPU node with real device files, e.g.
    # the real node of `make dev-up`): device nodes get hostPath = dev_root + path minus /dev
    dev_root: str | None = None

    @classmethod
    def emulated(cls, dev_root: Path | None = None) -> DeviceNumbers:
        root = None if dev_root is None else str(dev_root)
        return cls(None, EMULATED_CAPS_MAJOR, EMULATED_UVM_MAJOR, True, root)

    def node(self, path: str, major: int | None, minor: int) -> DevNode:
        """The device node `path` (under /dev) as this host names it."""
        host = None
        if self.dev_root is not None:
            host = self.dev_root + path.removeprefix("/dev")
        return DevNode(path, major if self.with_numbers else None, minor, host)

    @classmethod
    def from_host(
        cls, mig_minors: Path = DEFAULT_MIG_MINORS, proc_devices: Path = DEFAULT_PROC_DEVICES
    ) -> DeviceNumbers:
        try:
            minors = parse_mig_minors(mig_minors.read_text())
        except OSError as exc:
            raise CdiError(f"cannot read {mig_minors}: {exc}") from exc
        try:
            majors = parse_proc_devices(proc_devices.read_text())
        except OSError:
            majors = {}
        caps, uvm = majors.get("nvidia-caps"), majors.get("nvidia-uvm")
        return cls(minors, caps, uvm, caps is not None)

    def cap_minor(self, name: str, fallback: int) -> int:
        if self.minors is None:
            return fallback
        try:
            return self.minors[name]
        except KeyError as exc:
            raise CdiError(f"mig-minors has no entry {name!r}") from exc

    def slice_nodes(self, mig_uuid: str, gpu_minor: int, gi_id: int, ci_id: int) -> SliceNodes:
        gi_minor = self.cap_minor(gi_cap_name(gpu_minor, gi_id), formula_minor(gpu_minor, gi_id))
        ci_minor = self.cap_minor(
            ci_cap_name(gpu_minor, gi_id, ci_id), formula_minor(gpu_minor, gi_id, ci_id)
        )
        caps = self.caps_major
        return SliceNodes(
            mig_uuid=mig_uuid,
            parent=self.node(f"/dev/nvidia{gpu_minor}", NVIDIA_MAJOR, gpu_minor),
            gi_access=self.node(f"/dev/nvidia-caps/nvidia-cap{gi_minor}", caps, gi_minor),
            ci_access=self.node(f"/dev/nvidia-caps/nvidia-cap{ci_minor}", caps, ci_minor),
        )

    def gpu_nodes(self, gpu_uuid: str, gpu_minor: int) -> SliceNodes:
        """A whole GPU (MIG off): its device node and `NVIDIA_VISIBLE_DEVICES=GPU-<uuid>`."""
        parent = self.node(f"/dev/nvidia{gpu_minor}", NVIDIA_MAJOR, gpu_minor)
        return SliceNodes(mig_uuid=gpu_uuid, parent=parent, gi_access=None, ci_access=None)


# --- the node's NVIDIA CDI spec (common edits) ------------------------------------------------


def control_nodes(numbers: DeviceNumbers) -> list[DevNode]:
    """/dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools: every CUDA process opens them."""
    uvm = numbers.uvm_major
    return [
        numbers.node("/dev/nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR),
        numbers.node("/dev/nvidia-uvm", uvm, 0),
        numbers.node("/dev/nvidia-uvm-tools", uvm, 1),
    ]


def common_edits(base_spec: Obj | None, numbers: DeviceNumbers) -> Obj:
    """The top-level edits of our specs: the base spec's common edits, plus the control/UVM
    nodes if the base lacks them. `NVIDIA_VISIBLE_DEVICES` from the base is dropped (each
    device sets its own)."""
    base = (base_spec or {}).get("containerEdits") or {}
    nodes: list[Obj] = [dict(n) for n in base.get("deviceNodes") or []]
    have = {n.get("path") for n in nodes}
    nodes += [n.to_json() for n in control_nodes(numbers) if n.path not in have]
    edits: Obj = {"deviceNodes": nodes}
    env = [e for e in base.get("env") or [] if not e.startswith(VISIBLE_DEVICES_ENV + "=")]
    if env:
        edits["env"] = env
    for key in ("mounts", "hooks"):
        if base.get(key):
            edits[key] = [dict(x) for x in base[key]]
    return edits


def load_base_spec(path: Path) -> Obj:
    """Read the node's NVIDIA CDI spec (`nvidia-ctk cdi generate` output; YAML or JSON)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise CdiError(f"cannot read the NVIDIA CDI spec {path}: {exc}") from exc
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise CdiError(f"{path} is not a CDI spec: {exc}") from exc
    if not isinstance(doc, dict) or "kind" not in doc:
        raise CdiError(f"{path} is not a CDI spec (no kind)")
    return doc


def fake_nvidia_spec(
    driver_version: str = "580.159.04",
    gpu_minors: Sequence[int] = (0,),
    dev_root: Path | None = None,
) -> Obj:
    """A small stand-in for `nvidia-ctk cdi generate` output, for emulated nodes: a device
    per GPU plus `all`, and the common edits (control/UVM nodes, driver libraries, hooks).

    With `dev_root` (an emulated node whose containers really start) the device nodes point
    there, and the driver mounts and hooks are left out: this host has no NVIDIA driver, and a
    runtime refuses a mount or hook whose host file is missing."""
    lib = "/usr/lib/x86_64-linux-gnu"
    numbers = DeviceNumbers.emulated(dev_root)
    gpu_nodes = {m: numbers.node(f"/dev/nvidia{m}", NVIDIA_MAJOR, m).to_json() for m in gpu_minors}
    devices: list[Obj] = [
        {"name": str(m), "containerEdits": {"deviceNodes": [node]}} for m, node in gpu_nodes.items()
    ]
    devices.append({"name": "all", "containerEdits": {"deviceNodes": list(gpu_nodes.values())}})
    spec: Obj = {
        "cdiVersion": CDI_VERSION,
        "kind": "nvidia.com/gpu",
        "devices": devices,
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "deviceNodes": [n.to_json() for n in control_nodes(numbers)],
        },
    }
    if dev_root is None:
        spec["containerEdits"] |= {
            "mounts": [
                {
                    "hostPath": f"{lib}/{so}.{driver_version}",
                    "containerPath": f"{lib}/{so}.{driver_version}",
                    "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
                }
                for so in ("libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so")
            ]
            + [
                {
                    "hostPath": "/usr/bin/nvidia-smi",
                    "containerPath": "/usr/bin/nvidia-smi",
                    "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
                }
            ],
            "hooks": [
                {
                    "hookName": "createContainer",
                    "path": "/usr/bin/nvidia-cdi-hook",
                    "args": [
                        "nvidia-cdi-hook",
                        "create-symlinks",
                        "--link",
                        f"libcuda.so.{driver_version}::{lib}/libcuda.so.1",
                    ],
                },
                {
                    "hookName": "createContainer",
                    "path": "/usr/bin/nvidia-cdi-hook",
                    "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", lib],
                },
            ],
        }
    return spec


# --- our spec files ---------------------------------------------------------------------------


def spec_file_name(namespace: str, claim: str) -> str:
    return f"{CDI_FILE_PREFIX}{namespace}_{claim}.json"


def claim_of_file(name: str) -> tuple[str, str] | None:
    """`instaslice.io-ns_claim.json` → (ns, claim); None for files that are not ours."""
    if not (name.startswith(CDI_FILE_PREFIX) and name.endswith(".json")):
        return None
    ns, sep, claim = name[len(CDI_FILE_PREFIX) : -len(".json")].partition("_")
    return (ns, claim) if sep and ns and claim else None


def build_spec(
    namespace: str,
    claim: str,
    containers: Mapping[str, Sequence[SliceNodes]],
    common: Obj,
    uid: str = "",
) -> Obj:
    """The CDI spec of one allocation: a device per container, in container order. `uid`,
    the allocation's, goes into the annotations (see the module docstring)."""
    devices = []
    for container, slices in containers.items():
        nodes: list[Obj] = []
        seen: set[str] = set()
        for s in slices:
            for node in (s.parent, s.gi_access, s.ci_access):
                if (
                    node is not None and node.path not in seen
                ):  # two slices on one GPU share the parent node
                    seen.add(node.path)
                    nodes.append(node.to_json())
        uuids = ",".join(s.mig_uuid for s in slices)
        devices.append(
            {
                "name": cdi_device_name(namespace, claim, container),
                "containerEdits": {
                    "env": [f"{VISIBLE_DEVICES_ENV}={uuids}"],
                    "deviceNodes": nodes,
                },
            }
        )
    annotations = {CLAIM_ANNOTATION: f"{namespace}/{claim}"}
    if uid:
        annotations[UID_ANNOTATION] = uid
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "annotations": annotations,
        "devices": devices,
        "containerEdits": common,
    }


def write_json_atomic(path: Path, doc: Obj, mode: int = 0o644) -> Path:
    """tmp + rename: a reader never sees half a file. The temporary name starts with a dot
    and ends in .tmp, so CDI caches (which load *.json, *.yaml) never read it. No fsync:
    /var/run/cdi is a tmpfs, gone on reboot anyway, and the agent rewrites a missing spec."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, json.dumps(doc, indent=1).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def write_spec(cdi_dir: Path, namespace: str, claim: str, spec: Obj) -> Path:
    """Atomically write the allocation's spec file."""
    return write_json_atomic(cdi_dir / spec_file_name(namespace, claim), spec)


def spec_uid(cdi_dir: Path, namespace: str, claim: str) -> str | None:
    """The allocation UID in the spec file's annotations: "" when the file has none (or is
    not a readable spec), None when there is no file."""
    try:
        doc = json.loads((cdi_dir / spec_file_name(namespace, claim)).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return ""
    annotations = doc.get("annotations") if isinstance(doc, dict) else None
    uid = annotations.get(UID_ANNOTATION) if isinstance(annotations, dict) else None
    return uid if isinstance(uid, str) else ""


def remove_spec(cdi_dir: Path, namespace: str, claim: str, uid: str | None = None) -> bool:
    """Remove the allocation's spec file; False if it was not there or, given `uid`, belongs
    to another allocation of the same name (its annotation names another UID). Read,
    compare and unlink are not one atomic step: a rewrite landing in the microseconds between
    them would still be lost (it is no longer the whole release or GC pass, as it was)."""
    if uid is not None and spec_uid(cdi_dir, namespace, claim) not in ("", uid):
        return False
    try:
        (cdi_dir / spec_file_name(namespace, claim)).unlink()
    except FileNotFoundError:
        return False
    return True


def our_spec_files(cdi_dir: Path) -> Iterable[tuple[str, str]]:
    """(namespace, claim) of every InstaSlice spec file in `cdi_dir`."""
    try:
        names = sorted(p.name for p in cdi_dir.iterdir())
    except FileNotFoundError:
        return []
    return [c for c in (claim_of_file(n) for n in names) if c is not None]
