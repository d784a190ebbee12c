"""The DRA soak's judge (bench/chaos_dra.py): double bookings by the published devices' slots,
and complete pools. Pure tables; the soak itself runs with `make chaos-dra`."""

from __future__ import annotations

from typing import Any

from bench.chaos_dra import device_slots, double_bookings, incomplete_pools, ready_devices


def a_slice(pool: str, gen: int, count: int, *devices: tuple[str, int, int]) -> Any:
    def dev(name: str, start: int, size: int) -> Any:
        attrs = {"type": {"string": "mig"}, "start": {"int": start}, "size": {"int": size}}
        return {"name": name, "attributes": attrs}

    pool_ = {"name": pool, "generation": gen, "resourceSliceCount": count}
    return {"spec": {"pool": pool_, "devices": [dev(*d) for d in devices]}}


def a_claim(name: str, pool: str, device: str) -> Any:
    result = {"request": "slice", "driver": "instaslice.io", "pool": pool, "device": device}
    return {
        "metadata": {"namespace": "ns", "name": name},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


SLICES = [
    a_slice(
        "n1", 1, 1,
        ("gpu-0-mig-19-0", 0, 1), ("gpu-0-mig-14-0", 0, 2), ("gpu-0-mig-19-2", 2, 1),
        ("gpu-1-mig-19-0", 0, 1),
    )
]  # fmt: skip


def test_claims_on_overlapping_slots_of_one_gpu_are_double_booked() -> None:
    slots = device_slots(SLICES)
    clash = [a_claim("a", "n1", "gpu-0-mig-19-0"), a_claim("b", "n1", "gpu-0-mig-14-0")]
    (v,) = double_bookings(clash, slots)
    assert "ns/a" in v and "ns/b" in v
    same = [a_claim("a", "n1", "gpu-0-mig-19-0"), a_claim("b", "n1", "gpu-0-mig-19-0")]
    assert len(double_bookings(same, slots)) == 1


def test_disjoint_slots_other_gpus_and_other_pools_are_not() -> None:
    slots = device_slots([*SLICES, a_slice("n2", 1, 1, ("gpu-0-mig-19-0", 0, 1))])
    claims = [
        a_claim("a", "n1", "gpu-0-mig-19-0"),
        a_claim("b", "n1", "gpu-0-mig-19-2"),
        a_claim("c", "n1", "gpu-1-mig-19-0"),
        a_claim("d", "n2", "gpu-0-mig-19-0"),
    ]
    assert double_bookings(claims, slots) == []


def test_a_pool_is_complete_only_with_every_slice_of_its_newest_generation() -> None:
    assert incomplete_pools([a_slice("n1", 2, 2), a_slice("n1", 2, 2)]) == []
    (cut,) = incomplete_pools([a_slice("n1", 3, 2), a_slice("n1", 2, 2)])
    assert cut.startswith("n1: generation 3 has 1/2 slices, 1 older left"), cut


def test_ready_devices_are_the_agents_ready_entries() -> None:
    ready = {"type": "Ready", "status": "True"}
    claim = {"status": {"devices": [
        {"driver": "instaslice.io", "device": "d1", "conditions": [ready]},
        {"driver": "instaslice.io", "device": "d2", "conditions": [{**ready, "status": "False"}]},
        {"driver": "other", "device": "d3", "conditions": [ready]},
    ]}}  # fmt: skip
    assert ready_devices(claim) == ["d1"]
