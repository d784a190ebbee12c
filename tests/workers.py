"""How `make test` spreads the suite over pytest-xdist workers (tests/conftest.py wires it in).

`pytest -n N --dist loadgroup`: every test gets a group, a group runs on one worker, in
collection order, and a worker takes the next group as it runs out of work. A test module is
a group of its own, so its module-scoped system starts once. Two groups span modules:

- `REALNODE_GROUP`: every module that runs the machine's one real node (a cluster spec of
  the module with a `runtime: containerd` group; not tests/unit, where such a dict is a unit
  test's data, as in its test_xdist_groups.py): hack/cluster/realnode.py holds host-wide
  things (the kubelet's device-plugin dir, /run/instaslice-realnode.json, the shim socket dir,
  the pod bridge), so two of them must never run at once.
- `SHARED_SYSTEM_GROUP`: the e2e modules on the session's shared system (tests/e2e/conftest.py
  `system`): it starts once, and the modules keep their order on it (test_troubleshooting_docs,
  last, uninstalls InstaSlice from it).

Everything else a worker starts is its own: control planes on kernel-picked ports
(hack/cluster/procs.py), dirs under the worker's own pytest basetemp, kubectl caches per
cluster; the caches under ~/.cache/instaslice are built before the run (make kube-bins,
make images) or under a lock (hack/fetch-crds.sh, hack/cdi-check/build.sh).

xdist's own grouping (an `xdist_group` mark, which pytest-xdist 3.8 turns into a suffix of the
test's node id) does nothing under pytest 9, whose nodes no longer read the attribute xdist
writes: every test was scheduled alone. So the groups travel another way: each worker writes
the group of every test it collected into a file the controller named (`workerinput`), and
the controller's `GroupScheduling` takes its scopes from there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

REALNODE_GROUP = "realnode"
SHARED_SYSTEM_GROUP = "e2e-shared-system"
GROUPS_KEY = "instaslice_groups_dir"  # workerinput: where the workers write their groups


def runs_real_node(module: object) -> bool:
    """A cluster spec of `module` (a dict global with `nodes`) has a `runtime: containerd`
    group: the module starts the real node."""
    return any(
        isinstance(spec, dict)
        and isinstance(spec.get("nodes"), list)
        and any(isinstance(g, dict) and g.get("runtime") == "containerd" for g in spec["nodes"])
        for spec in vars(module).values()
    )


def module_groups(items: list[pytest.Item]) -> dict[Path, str]:
    """The group of each test module (module docstring); a module's tests share it."""
    groups: dict[Path, str] = {}
    for item in items:
        module = getattr(item, "module", None)
        unit = "unit" in item.path.parts[:-1]  # starts nothing, whatever dicts it holds
        if module is not None and not unit and runs_real_node(module):
            groups[item.path] = REALNODE_GROUP
        elif "e2e" in item.path.parts[:-1] and "system" in getattr(item, "fixturenames", ()):
            groups[item.path] = SHARED_SYSTEM_GROUP
        else:
            groups.setdefault(item.path, item.nodeid.split("::", 1)[0])
    return groups


def write_groups(config: pytest.Config, items: list[pytest.Item], groups: dict[Path, str]) -> None:
    """On an xdist worker: every collected test's group, for the controller's scheduler."""
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    where = workerinput.get(GROUPS_KEY)
    if where is None:
        return
    out = Path(where) / f"{workerinput['workerid']}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({item.nodeid: groups[item.path] for item in items}))
    os.replace(tmp, out)


def shorten_basetemp(config: pytest.Config) -> None:
    """On an xdist worker: its basetemp `<run's>/N` (worker gwN), not xdist's
    `<run's>/popen-gwN`. gRPC binds a unix socket path of at most 105 bytes, and tests put
    sockets under their tmp_path (the DRA plugin's registration socket: 102 bytes alone);
    xdist's 10 more broke four tests, `gwN/` still two."""
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    given = config.option.basetemp
    if "workerid" in workerinput and given and Path(given).name.startswith("popen-"):
        number = str(workerinput["workerid"]).removeprefix("gw")
        config.option.basetemp = str(Path(given).with_name(number))


class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
    """xdist's scheduling by scope, the scope of a test being its group as the workers wrote
    it (every worker collects the same tests, so any worker's file will do)."""

    def __init__(self, config: pytest.Config, log: Any, groups_dir: Path) -> None:
        super().__init__(config, log)
        self._groups_dir = groups_dir
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            files = sorted(self._groups_dir.glob("*.json"))
            if not files:
                raise RuntimeError(f"no worker wrote its test groups into {self._groups_dir}")
            self._groups = json.loads(files[0].read_text())
        return self._groups.get(nodeid, nodeid)
