"""common.kubeapi.Informer across a watch gap, on the real control plane.

Covers: a re-list after a gap reports an object replaced meanwhile by a same-name object
with another UID (a StatefulSet pod recreated while the watch was down) as DELETED(old UID)
then ADDED(new UID) — never as MODIFIED, which would leave every consumer keyed by UID (the
allocator's node occupancy, the agent's records) holding what the old object held; an object
merely changed during the gap is still MODIFIED, one removed is DELETED.
With `keep` (the cache holds identities only), the same gap is reported from them, and a
re-list hands each page on before reading the next.
Leaves out: how the consumers use the events (their own tests); the 410 Gone path (the same
re-list code runs there).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from common.kubeapi import Informer, Kube, Obj, core_path, identity
from hack.cluster import ControlPlane

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture(scope="session")
async def kube(control_plane: ControlPlane) -> AsyncIterator[Kube]:
    async with await Kube.connect(str(control_plane.kubeconfig)) as k:
        yield k


def _cm(name: str, value: str) -> Obj:
    meta = {"name": name, "labels": {"test": "informer"}}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"v": value}}


async def _next(events: asyncio.Queue[tuple[str, str, str]]) -> tuple[str, str, str]:
    return await asyncio.wait_for(events.get(), timeout=10)


async def test_a_same_name_object_with_a_new_uid_is_deleted_then_added(
    kube: Kube, namespace: str
) -> None:
    events: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()

    async def handler(etype: str, obj: Obj) -> None:
        meta = obj["metadata"]
        await events.put((etype, meta["name"], meta["uid"]))

    path = core_path("configmaps", namespace)
    replaced = await kube.create(path, _cm("replaced", "1"))
    changed = await kube.create(path, _cm("changed", "1"))
    removed = await kube.create(path, _cm("removed", "1"))
    informer = Informer(kube, path, handler, label_selector="test=informer", name="test")
    seen: dict[str, tuple[str, str]] = {}

    # First run: the list delivers all three.
    run = asyncio.create_task(informer.run())
    await asyncio.wait_for(informer.synced.wait(), timeout=10)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    while not events.empty():
        etype, name, uid = events.get_nowait()
        seen[name] = (etype, uid)
    assert seen["replaced"] == ("ADDED", replaced["metadata"]["uid"])

    # The gap: replaced (new UID), changed (same UID), removed (gone).
    await kube.delete(core_path("configmaps", namespace, "replaced"))
    again = await kube.create(path, _cm("replaced", "2"))
    assert again["metadata"]["uid"] != replaced["metadata"]["uid"]
    await kube.patch(core_path("configmaps", namespace, "changed"), {"data": {"v": "2"}})
    await kube.delete(core_path("configmaps", namespace, "removed"))

    # Reconnect with the cache kept: the re-list reports the gap; a sentinel created after
    # the reconnect arrives by watch, after everything the re-list reported.
    run = asyncio.create_task(informer.run())
    got: list[tuple[str, str, str]] = []
    try:
        await asyncio.sleep(0)
        await kube.create(path, _cm("sentinel", "1"))
        while not got or got[-1][1] != "sentinel":
            got.append(await _next(events))
        got.pop()
    finally:
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    by_name: dict[str, list[tuple[str, str]]] = {}
    for etype, name, uid in got:
        by_name.setdefault(name, []).append((etype, uid))
    assert by_name["replaced"] == [
        ("DELETED", replaced["metadata"]["uid"]),
        ("ADDED", again["metadata"]["uid"]),
    ]
    assert by_name["changed"] == [("MODIFIED", changed["metadata"]["uid"])]
    assert by_name["removed"] == [("DELETED", removed["metadata"]["uid"])]
    assert informer.cache[f"{namespace}/replaced"]["metadata"]["uid"] == again["metadata"]["uid"]
    assert events.empty()


async def test_a_list_is_read_in_pages_each_object_transformed_once(
    kube: Kube, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seven objects listed two at a time: every one delivered (the `continue` token is
    followed to the end), each transformed once before it is cached or handed on."""
    path = core_path("configmaps", namespace)
    names = {f"paged-{i}" for i in range(7)}
    for name in sorted(names):
        await kube.create(path, _cm(name, "1"))
    transformed: list[str] = []
    delivered: list[tuple[str, str, bool]] = []

    def transform(obj: Obj) -> Obj:
        transformed.append(obj["metadata"]["name"])
        return {**obj, "data": {}, "slim": True}

    async def handler(etype: str, obj: Obj) -> None:
        delivered.append((etype, obj["metadata"]["name"], bool(obj.get("slim"))))

    pages: list[int] = []
    list_pages = kube.list_pages

    async def spy(path: str, limit: int, **query: object) -> AsyncIterator[Obj]:
        async for page in list_pages(path, limit, **query):
            pages.append(len(page["items"]))
            yield page

    monkeypatch.setattr(kube, "list_pages", spy)
    informer = Informer(
        kube,
        path,
        handler,
        label_selector="test=informer",
        name="paged",
        transform=transform,
        page_size=2,
    )
    run = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), timeout=10)
    finally:
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    assert pages == [2, 2, 2, 1]
    assert sorted(transformed) == sorted(names)  # once each, however many pages
    assert sorted(delivered) == sorted(("ADDED", n, True) for n in names)
    assert all(o["slim"] and o["data"] == {} for o in informer.cache.values())


async def test_an_informer_keeping_identities_hands_each_page_on_and_reports_gaps(
    kube: Kube, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`keep=identity` (the allocator's Nodes and MigNodes): the cache holds only each
    object's identity, handlers get whole objects, a re-list hands each page on before it
    reads the next (a list is never held whole), and a gap is still reported: changed as
    MODIFIED (whole), removed as DELETED (its identity), replaced as DELETED then ADDED."""
    path = core_path("configmaps", namespace)
    made = {}
    for name in ("kept-0", "kept-1", "kept-2", "kept-3", "kept-4"):
        made[name] = await kube.create(path, _cm(name, "1"))
    delivered: list[tuple[str, str, str, str | None]] = []  # etype, name, uid, data.v

    async def handler(etype: str, obj: Obj) -> None:
        meta = obj["metadata"]
        delivered.append((etype, meta["name"], meta["uid"], (obj.get("data") or {}).get("v")))

    handed_on_before_page: list[int] = []
    list_pages = kube.list_pages

    async def spy(path: str, limit: int, **query: object) -> AsyncIterator[Obj]:
        async for page in list_pages(path, limit, **query):
            handed_on_before_page.append(len(delivered))
            yield page

    monkeypatch.setattr(kube, "list_pages", spy)
    informer = Informer(
        kube, path, handler, label_selector="test=informer", name="kept", keep=identity,
        page_size=2,
    )  # fmt: skip
    await informer._relist()
    assert handed_on_before_page == [0, 2, 4]  # pages of 2, 2, 1: each handed on first
    assert sorted(delivered) == sorted(
        ("ADDED", n, o["metadata"]["uid"], "1") for n, o in made.items()
    )
    for name, obj in made.items():
        assert informer.cache[f"{namespace}/{name}"] == {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": obj["metadata"]["uid"],
                "resourceVersion": obj["metadata"]["resourceVersion"],
            },
        }

    # The gap, then a re-list from the identities alone.
    await kube.delete(core_path("configmaps", namespace, "kept-0"))
    again = await kube.create(path, _cm("kept-0", "2"))
    await kube.patch(core_path("configmaps", namespace, "kept-1"), {"data": {"v": "2"}})
    await kube.delete(core_path("configmaps", namespace, "kept-2"))
    delivered.clear()
    await informer._relist()
    uid = {n: o["metadata"]["uid"] for n, o in made.items()}
    assert sorted(delivered) == sorted([
        ("DELETED", "kept-0", uid["kept-0"], None),  # only its identity was kept
        ("ADDED", "kept-0", again["metadata"]["uid"], "2"),
        ("MODIFIED", "kept-1", uid["kept-1"], "2"),
        ("DELETED", "kept-2", uid["kept-2"], None),
    ])  # fmt: skip
    # the replaced one's DELETED comes before its ADDED; kept-3 and kept-4 did not change
    assert [e[0] for e in delivered if e[1] == "kept-0"] == ["DELETED", "ADDED"]
    assert set(informer.cache) == {f"{namespace}/kept-{i}" for i in (0, 1, 3, 4)}
    assert all("data" not in o for o in informer.cache.values())
