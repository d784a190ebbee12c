"""webhook.nsmirror: the label that namespaceSelector matches follows the opt-in annotation.

Covers: the pure patch computation (opt in, opt out, hand-set label taken back, no write when
in step) and the worker's handling of a failed write (retried with backoff, other namespaces
not held up, a vanished namespace dropped), against a fake client.
Leaves out: the real watch (tests/integration/test_webhook.py, opt-in/opt-out timing).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.constants import ENABLED_KEY, WHOLE_GPU_KEY
from common.kubeapi import ApiError
from webhook.nsmirror import _Mirror, label_patch, wanted_label


def ns(name: str = "a", annotation: str | None = None, label: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if annotation is not None:
        meta["annotations"] = {ENABLED_KEY: annotation}
    if label is not None:
        meta["labels"] = {ENABLED_KEY: label}
    return {"metadata": meta}


@pytest.mark.parametrize(
    ("obj", "patch"),
    [
        (ns(annotation="true"), {"metadata": {"labels": {ENABLED_KEY: "true"}}}),
        (ns(annotation="true", label="true"), None),
        (ns(label="true"), {"metadata": {"labels": {ENABLED_KEY: None}}}),
        (ns(annotation="false", label="true"), {"metadata": {"labels": {ENABLED_KEY: None}}}),
        (ns(annotation="True", label="false"), {"metadata": {"labels": {ENABLED_KEY: None}}}),
        (ns(annotation="true", label="false"), {"metadata": {"labels": {ENABLED_KEY: "true"}}}),
        (ns(), None),
        ({"metadata": {"labels": None, "annotations": None}}, None),
    ],
)
def test_label_patch(obj: dict[str, Any], patch: dict[str, Any] | None) -> None:
    assert label_patch(obj) == patch
    annotations = obj["metadata"].get("annotations") or {}
    assert wanted_label(obj) == ("true" if annotations.get(ENABLED_KEY) == "true" else None)


def test_whole_gpu_opt_in_is_mirrored_too() -> None:
    both = {"metadata": {"annotations": {ENABLED_KEY: "true", WHOLE_GPU_KEY: "true"}}}
    assert label_patch(both) == {
        "metadata": {"labels": {ENABLED_KEY: "true", WHOLE_GPU_KEY: "true"}}
    }
    both["metadata"]["labels"] = {ENABLED_KEY: "true", WHOLE_GPU_KEY: "true"}
    assert label_patch(both) is None
    dropped = {
        "metadata": {"annotations": {ENABLED_KEY: "true"}, "labels": both["metadata"]["labels"]}
    }
    assert label_patch(dropped) == {"metadata": {"labels": {WHOLE_GPU_KEY: None}}}


class FakeKube:
    def __init__(self, failures: dict[str, list[int]]) -> None:
        self.failures = failures
        self.patched: list[tuple[str, Any]] = []

    async def patch(self, path: str, body: Any) -> dict[str, Any]:
        name = path.rsplit("/", 1)[1]
        if self.failures.get(name):
            raise ApiError(self.failures[name].pop(0), "x", "injected")
        self.patched.append((name, body))
        return {}


async def test_failed_write_is_retried_without_holding_up_others() -> None:
    kube = FakeKube({"flaky": [500, 429], "gone": [404]})
    m = _Mirror(kube, retry_base_s=0.01, retry_max_s=0.02)  # type: ignore[arg-type]
    for name in ("flaky", "gone", "ok"):
        m.informer.cache[name] = ns(name, annotation="true")
    async with asyncio.TaskGroup() as tg:
        m.queue.start(tg)
        for name in ("flaky", "gone", "ok"):
            await m.on_event("ADDED", m.informer.cache[name])
        async with asyncio.timeout(5):
            while len(kube.patched) < 2 or m.queue.active:  # noqa: ASYNC110 - no event to wait on
                await asyncio.sleep(0.005)
    assert [n for n, _ in kube.patched] == ["ok", "flaky"]
    assert m.backoff == {}  # the retried write succeeded: nothing left to retry


async def test_no_write_when_in_step_or_deleted() -> None:
    kube = FakeKube({})
    m = _Mirror(kube, 0.01, 0.02)  # type: ignore[arg-type]
    await m.on_event("ADDED", ns("a", annotation="true", label="true"))
    await m.on_event("DELETED", ns("b", annotation="true"))
    assert m.queue.active == 0 and m.queue.pending == []
    assert await m.sync("never-seen")
    assert kube.patched == []
