"""`bench.fleet_memory` feeds the whole fleet it claims to (a small one, in this process).

Covers: in both orders (agents publishing by watch event; a restart listing a published
fleet) every node reaches the allocator's state with its GPUs, admission's offered profiles
see the model's profiles, and the leader's first decisions place. Leaves out the memory
numbers themselves: the benchmark prints them (`python -m bench.fleet_memory`).
"""

from __future__ import annotations

import pytest

from bench import fleet_memory
from common.catalog import load_catalog


@pytest.mark.parametrize("order", fleet_memory.ORDERS)
async def test_every_node_of_the_fleet_reaches_the_allocator(order: str) -> None:
    result = await fleet_memory._child(order, 12, trace=False)
    model = load_catalog().model(fleet_memory.MODEL)
    assert model is not None
    assert result["node_states"] == 12 and result["gpus"] == 12 * fleet_memory.GPUS
    assert result["profiles_offered"] == len(model.profiles)
    assert result["decisions_placed"] == len(model.profiles) + 2


def test_bad_sizes_and_orders_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--nodes", "0"], ["--nodes", "x"], ["--orders", "reboot"]):
        with pytest.raises(SystemExit):
            fleet_memory.main(argv)
        assert argv[0] in capsys.readouterr().err
