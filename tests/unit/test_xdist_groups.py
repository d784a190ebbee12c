"""How `make test` groups the suite for its pytest-xdist workers (tests/workers.py).

Covers: a module that starts the real node (a `runtime: containerd` spec, whatever the
global is named) lands in the one real-node group, e2e modules on the session's shared
system in one group in their collection order, every other module in a group of its own;
what a worker writes is what the controller's scheduler reads, by node id. Leaves out
running xdist itself (make test does).
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from tests import workers

REAL = {"nodes": [{"prefix": "real", "count": 1, "runtime": "containerd"}]}
KWOK = {"nodes": [{"prefix": "kwok", "count": 1}]}


def item(path: str, name: str, module: Any, fixtures: tuple[str, ...] = ()) -> Any:
    return types.SimpleNamespace(
        path=Path("/repo") / path,
        nodeid=f"{path}::{name}",
        module=module,
        fixturenames=fixtures,
    )


def module(**globals_: Any) -> types.ModuleType:
    m = types.ModuleType("m")
    vars(m).update(globals_)
    return m


def test_a_containerd_group_in_any_spec_global_runs_the_real_node() -> None:
    assert workers.runs_real_node(module(SPEC=REAL))
    assert workers.runs_real_node(module(OWN_SPEC=KWOK, OTHER=REAL))
    assert not workers.runs_real_node(module(SPEC=KWOK, nodes=["x"], TEXT="runtime"))


def test_real_node_modules_share_one_group_and_shared_system_modules_another() -> None:
    real_a, real_b = module(SPEC=REAL), module(OWN=REAL)
    shared_a, shared_b, own = module(), module(), module(OWN_SPEC=KWOK)
    items = [
        item("tests/e2e/test_a.py", "t1", shared_a, ("system", "kube")),
        item("tests/e2e/test_b.py", "t1", own, ("own_system",)),
        item("tests/e2e/test_installed.py", "t1", real_a, ("installed",)),
        item("tests/e2e/test_c.py", "pure", shared_b),  # its other test uses the system
        item("tests/e2e/test_c.py", "t2", shared_b, ("system",)),
        item("tests/e2e/test_realnode.py", "t1", real_b, ("real",)),
        item("tests/integration/test_d.py", "t1", module(), ("system",)),  # not e2e's
        item("tests/unit/test_e.py", "t1", module()),
        item("tests/unit/test_f.py", "t1", module(SPEC=REAL)),  # a unit test's data
    ]
    groups = workers.module_groups(items)
    by_name = {p.name: g for p, g in groups.items()}
    assert by_name == {
        "test_a.py": workers.SHARED_SYSTEM_GROUP,
        "test_b.py": "tests/e2e/test_b.py",
        "test_installed.py": workers.REALNODE_GROUP,
        "test_c.py": workers.SHARED_SYSTEM_GROUP,
        "test_realnode.py": workers.REALNODE_GROUP,
        "test_d.py": "tests/integration/test_d.py",
        "test_e.py": "tests/unit/test_e.py",
        "test_f.py": "tests/unit/test_f.py",
    }


def test_the_scheduler_reads_the_groups_a_worker_wrote(tmp_path: Path) -> None:
    items = [
        item("tests/e2e/test_installed.py", "t1", module(SPEC=REAL)),
        item("tests/e2e/test_realnode.py", "t[env]", module(SPEC=REAL)),
        item("tests/unit/test_e.py", "t1", module()),
    ]
    config = types.SimpleNamespace(workerinput={"workerid": "gw1", workers.GROUPS_KEY: tmp_path})
    workers.write_groups(config, items, workers.module_groups(items))  # type: ignore[arg-type]
    sched = workers.GroupScheduling.__new__(workers.GroupScheduling)  # no xdist session here
    sched._groups_dir, sched._groups = tmp_path, None
    assert [sched._split_scope(i.nodeid) for i in items] == [
        workers.REALNODE_GROUP,
        workers.REALNODE_GROUP,
        "tests/unit/test_e.py",
    ]


def test_no_file_from_any_worker_is_an_error_not_a_silent_split(tmp_path: Path) -> None:
    sched = workers.GroupScheduling.__new__(workers.GroupScheduling)
    sched._groups_dir, sched._groups = tmp_path, None
    with pytest.raises(RuntimeError, match="no worker wrote"):
        sched._split_scope("tests/unit/test_e.py::t1")


def test_a_workers_basetemp_is_short_enough_for_the_suites_unix_sockets() -> None:
    config = types.SimpleNamespace(
        workerinput={"workerid": "gw1"},
        option=types.SimpleNamespace(basetemp="/tmp/pytest-of-root/pytest-654/popen-gw1"),
    )
    workers.shorten_basetemp(config)  # type: ignore[arg-type]
    assert config.option.basetemp == "/tmp/pytest-of-root/pytest-654/1"
    alone = types.SimpleNamespace(option=types.SimpleNamespace(basetemp=None))
    workers.shorten_basetemp(alone)  # type: ignore[arg-type]
    assert alone.option.basetemp is None  # not a worker: pytest's own
