"""common.metricsauth: who may read /metrics (TokenReview, then SubjectAccessReview).

A fake API answers the two reviews; the cases: no or malformed Authorization (401), a token
the API server rejects, a user without the grant, an API error (403, fail closed), a granted
user (200), and the cache (one pair of reviews per token and path within the TTL). Then the
bounds (docs/security.md, "metrics auth amplifies"): a token that is not JWT-shaped is
refused without a review; the cache never holds more than its size and each insert touches
O(1) entries (counted on its store); the (N+1)th distinct token within the bucket's window is
answered 429 without a review, and the bucket refills with time; reviews in flight never
exceed the cap (a fake API blocking on an event counts them); the flags reach the limits.
The same against the real API server: tests/integration/test_metricsauth.py.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest

from common.kubeapi import ApiError
from common.metricsauth import (
    ACCESS_REVIEW,
    MAX_TOKEN_CHARS,
    TOKEN_REVIEW,
    DecisionCache,
    MetricsAuth,
    MetricsAuthLimits,
    add_flags,
    limits_from,
)
from testkit.counting import CountingStore

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


def jwt(name: str) -> str:
    """A JWT-shaped token (header.payload.signature, base64url): what the check lets through
    to a review."""
    return f"eyJhbGciOiJSUzI1NiJ9.eyJ{name}.sig-{name}_x"


NOBODY, VIEWER, PROM = jwt("nobody"), jwt("viewer"), jwt("prom")


def auth(api: FakeApi, clock: list[float] | None = None, **limits: Any) -> MetricsAuth:
    t = clock if clock is not None else [0.0]
    return MetricsAuth(
        api,  # type: ignore[arg-type]
        MetricsAuthLimits(ttl_s=60.0, **limits),
        clock=lambda: t[0],
    )


@pytest.mark.parametrize(
    ("header", "want"),
    [
        (None, 401),
        ("", 401),
        ("Basic abc", 401),
        ("Bearer ", 401),
        (f"Bearer {NOBODY}", 403),  # the API server does not know the token
        (f"Bearer {VIEWER}", 403),  # known, but not granted /metrics
        (f"Bearer {PROM}", 200),
        (f"bearer {PROM}", 200),  # the scheme is case-insensitive
    ],
)
async def test_check(header: str | None, want: int) -> None:
    api = FakeApi({VIEWER: "alice", PROM: "system:serviceaccount:mon:prometheus"},
                  {"system:serviceaccount:mon:prometheus"})  # fmt: skip
    assert await auth(api).check(header, "/metrics") == want


async def test_other_paths_are_not_granted_by_the_metrics_role() -> None:
    api = FakeApi({PROM: "p"}, {"p"})
    assert await auth(api).check(f"Bearer {PROM}", "/debug") == 403


async def test_an_api_error_grants_nothing() -> None:
    api = FakeApi({PROM: "p"}, {"p"}, fail=True)
    assert await auth(api).check(f"Bearer {PROM}", "/metrics") == 403


async def test_decisions_are_cached_per_token_for_the_ttl() -> None:
    api, clock = FakeApi({PROM: "p"}, {"p"}), [0.0]
    a = auth(api, clock)
    for _ in range(3):
        assert await a.check(f"Bearer {PROM}", "/metrics") == 200
    assert api.calls == [TOKEN_REVIEW, ACCESS_REVIEW]  # one pair for three scrapes
    api.allowed.clear()  # the grant is revoked
    clock[0] = 59.0
    assert await a.check(f"Bearer {PROM}", "/metrics") == 200  # still cached
    clock[0] = 61.0
    assert await a.check(f"Bearer {PROM}", "/metrics") == 403  # re-asked after the TTL
    assert len(api.calls) == 4


# --- the bounds --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token",
    [
        "nobody",  # opaque
        "a.b",  # two segments (a bootstrap token's shape)
        "a.b.c.d",
        "a..c",  # an empty segment
        "a.b.c d",
        "a.b/c.d",  # not base64url
        "a+b.c.d",
        "sha256~abcdef",  # an OpenShift OAuth token
        "e." + "x" * MAX_TOKEN_CHARS + ".s",  # JWT-shaped, but too long
    ],
)
async def test_a_token_that_is_not_jwt_shaped_is_refused_without_a_review(token: str) -> None:
    api = FakeApi({token: "p"}, {"p"})  # the API server would even grant it
    a = auth(api)
    assert await a.check(f"Bearer {token}", "/metrics") == 401
    assert api.calls == []


async def test_the_longest_jwt_shaped_token_is_reviewed() -> None:
    token = "e." + "x" * (MAX_TOKEN_CHARS - 4) + ".s"
    api = FakeApi({token: "p"}, {"p"})
    assert await auth(api).check(f"Bearer {token}", "/metrics") == 200


async def test_the_cache_never_exceeds_its_size() -> None:
    api, clock = FakeApi({}, set()), [0.0]
    a = auth(api, clock, cache_size=50, review_burst=10_000)
    for i in range(400):  # none expires: the old prune dropped only expired entries
        assert await a.check(f"Bearer {jwt(f'n{i}')}", "/metrics") == 403
        assert len(a.cache) <= 50
    assert len(a.cache) == 50
    # least recently used out: the newest are still answered from the cache
    calls = len(api.calls)
    assert await a.check(f"Bearer {jwt('n399')}", "/metrics") == 403
    assert len(api.calls) == calls


def test_the_cache_touches_o1_entries_per_call() -> None:
    """Linear in the calls, whatever the size: no pass over the whole cache per insert."""
    store = CountingStore()
    cache = DecisionCache(100, store)
    inserts = 5_000
    for i in range(inserts):
        now = float(i)
        cache.get((f"t{i}", "/metrics"), now)  # a miss
        cache.put((f"t{i}", "/metrics"), 403, now + (0.5 if i % 2 else 1e6))
        cache.get((f"t{i - 1}", "/metrics"), now)  # half of them have expired: met, dropped
        assert len(store) <= 100
    assert store.touched <= 8 * inserts, store.touched


async def test_distinct_tokens_past_the_burst_are_refused_without_a_review() -> None:
    api, clock = FakeApi({}, set()), [0.0]
    a = auth(api, clock, review_burst=5, reviews_per_s=0.5)
    for i in range(5):
        assert await a.check(f"Bearer {jwt(f'n{i}')}", "/metrics") == 403
    assert api.calls.count(TOKEN_REVIEW) == 5
    assert await a.check(f"Bearer {jwt('n5')}", "/metrics") == 429  # the 6th: no review
    assert api.calls.count(TOKEN_REVIEW) == 5
    assert await a.check(f"Bearer {jwt('n0')}", "/metrics") == 403  # cached: unaffected
    clock[0] = 1.9  # 0.95 of a token back: still none
    assert await a.check(f"Bearer {jwt('n5')}", "/metrics") == 429
    clock[0] = 2.0  # one token back after 1 / 0.5 s
    assert await a.check(f"Bearer {jwt('n5')}", "/metrics") == 403
    assert api.calls.count(TOKEN_REVIEW) == 6


class BlockingApi(FakeApi):
    """Reviews wait for `go`; `in_flight` and its peak are counted."""

    def __init__(self) -> None:
        super().__init__({}, set())
        self.go = asyncio.Event()
        self.in_flight = self.peak = 0

    async def create(self, path: str, body: dict[str, Any], **_: Any) -> dict[str, Any]:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await self.go.wait()
            return await super().create(path, body)
        finally:
            self.in_flight -= 1


async def test_reviews_in_flight_never_exceed_the_cap() -> None:
    api = BlockingApi()
    a = auth(api, max_in_flight=3, review_burst=20)
    tokens = [jwt(f"n{i}") for i in range(12)]
    checks = [asyncio.create_task(a.check(f"Bearer {t}", "/metrics")) for t in tokens]
    for _ in range(50):  # every check, given every chance to run (no clock involved)
        await asyncio.sleep(0)
    assert not any(c.done() for c in checks)
    assert (api.in_flight, api.peak) == (3, 3)  # three reached the API, nine wait their turn
    api.go.set()
    assert await asyncio.gather(*checks) == [403] * 12
    assert api.peak == 3


def test_the_flags_set_the_limits() -> None:
    p = argparse.ArgumentParser()
    add_flags(p)
    assert limits_from(p.parse_args([])) == MetricsAuthLimits()
    # --metrics-auth itself comes with them: both daemons take it from here
    assert p.parse_args([]).metrics_auth is False
    assert p.parse_args(["--metrics-auth"]).metrics_auth is True
    got = limits_from(
        p.parse_args(
            [
                "--metrics-auth-cache=7",
                "--metrics-auth-reviews-per-s=0.25",
                "--metrics-auth-review-burst=3",
                "--metrics-auth-max-in-flight=2",
            ]
        )
    )
    assert got == MetricsAuthLimits(
        cache_size=7, reviews_per_s=0.25, review_burst=3, max_in_flight=2
    )
    for bad in ("--metrics-auth-cache=0", "--metrics-auth-reviews-per-s=nan",
                "--metrics-auth-max-in-flight=-1"):  # fmt: skip
        with pytest.raises(SystemExit):
            p.parse_args([bad])
