"""bench.latency_fleet's pod create under a loaded API server: a retry that finds the pod already
there (its first attempt landed, the answer was lost to a timeout) is success; a name that
was taken before the first attempt is still an error. A fake client, nothing else."""

from __future__ import annotations

from typing import Any

import pytest

from bench.latency_fleet import create_pod
from common.kubeapi import ApiError


class FakeKube:
    def __init__(self, *outcomes: ApiError | None) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    async def create(self, path: str, body: Any) -> None:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome


TIMEOUT = ApiError(0, "SocketTimeoutError", "Timeout on reading data from socket")
EXISTS = ApiError(409, "AlreadyExists", 'pods "p00705" already exists')


async def _no_sleep(_s: float) -> None:
    return None


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("bench.latency_fleet.asyncio.sleep", _no_sleep)


async def test_a_retry_finding_the_pod_created_by_a_lost_attempt_is_success() -> None:
    kube = FakeKube(TIMEOUT, EXISTS)
    await create_pod(kube, "/api/v1/namespaces/bench/pods", {})  # type: ignore[arg-type]
    assert kube.calls == 2


async def test_a_name_taken_before_the_first_attempt_is_an_error() -> None:
    kube = FakeKube(EXISTS)
    with pytest.raises(ApiError) as err:
        await create_pod(kube, "/api/v1/namespaces/bench/pods", {})  # type: ignore[arg-type]
    assert err.value.status == 409 and kube.calls == 1


async def test_retries_end_with_the_last_error() -> None:
    kube = FakeKube(TIMEOUT, TIMEOUT, TIMEOUT)
    with pytest.raises(ApiError) as err:
        await create_pod(kube, "/p", {}, attempts=3)  # type: ignore[arg-type]
    assert err.value.status == 0 and kube.calls == 3
