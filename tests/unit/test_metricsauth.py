"""common.metricsauth: who may read /metrics (TokenReview, then SubjectAccessReview).

A fake API answers the two reviews; the cases: no or malformed Authorization (401), a token
the API server rejects, a user without the grant, an API error (403, fail closed), a granted
user (200), and the cache (one pair of reviews per token and path within the TTL). The same
against the real API server: tests/integration/test_metricsauth.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from common.kubeapi import ApiError
from common.metricsauth import ACCESS_REVIEW, TOKEN_REVIEW, MetricsAuth

pytestmark = pytest.mark.timeout(10)


class FakeApi:
    def __init__(self, users: dict[str, str], allowed: set[str], fail: bool = False) -> None:
        self.users, self.allowed, self.fail = users, allowed, fail
        self.calls: list[str] = []

    async def create(self, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.calls.append(path)
        if self.fail:
            raise ApiError(500, "InternalError", "etcd timeout")
        if path == TOKEN_REVIEW:
            user = self.users.get(body["spec"]["token"])
            status = {"authenticated": True, "user": {"username": user}} if user else {}
            return {"status": status}
        assert path == ACCESS_REVIEW
        spec = body["spec"]
        ok = spec["user"] in self.allowed and spec["nonResourceAttributes"]["path"] == "/metrics"
        return {"status": {"allowed": ok}}


def auth(api: FakeApi, clock: list[float] | None = None) -> MetricsAuth:
    t = clock if clock is not None else [0.0]
    return MetricsAuth(api, ttl_s=60.0, clock=lambda: t[0])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("header", "want"),
    [
        (None, 401),
        ("", 401),
        ("Basic abc", 401),
        ("Bearer ", 401),
        ("Bearer nobody", 403),  # the API server does not know the token
        ("Bearer viewer", 403),  # known, but not granted /metrics
        ("Bearer prom", 200),
        ("bearer prom", 200),  # the scheme is case-insensitive
    ],
)
async def test_check(header: str | None, want: int) -> None:
    api = FakeApi({"viewer": "alice", "prom": "system:serviceaccount:mon:prometheus"},
                  {"system:serviceaccount:mon:prometheus"})  # fmt: skip
    assert await auth(api).check(header, "/metrics") == want


async def test_other_paths_are_not_granted_by_the_metrics_role() -> None:
    api = FakeApi({"prom": "p"}, {"p"})
    assert await auth(api).check("Bearer prom", "/debug") == 403


async def test_an_api_error_grants_nothing() -> None:
    assert (
        await auth(FakeApi({"prom": "p"}, {"p"}, fail=True)).check("Bearer prom", "/metrics") == 403
    )


async def test_decisions_are_cached_per_token_for_the_ttl() -> None:
    api, clock = FakeApi({"prom": "p"}, {"p"}), [0.0]
    a = auth(api, clock)
    for _ in range(3):
        assert await a.check("Bearer prom", "/metrics") == 200
    assert api.calls == [TOKEN_REVIEW, ACCESS_REVIEW]  # one pair for three scrapes
    api.allowed.clear()  # the grant is revoked
    clock[0] = 59.0
    assert await a.check("Bearer prom", "/metrics") == 200  # still cached
    clock[0] = 61.0
    assert await a.check("Bearer prom", "/metrics") == 403  # re-asked after the TTL
    assert len(api.calls) == 4
