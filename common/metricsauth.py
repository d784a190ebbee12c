"""Who may read `/metrics`: what kube-rbac-proxy does for OpenShift's own components.

A request must carry a bearer token that the API server authenticates (a TokenReview), and
the token's user must be allowed `get` on the non-resource URL (a SubjectAccessReview), as
granted by a ClusterRole such as `instaslice-metrics-reader`. No token: 401; a token the API
server rejects or a user without the grant: 403. Decisions are cached per token (by its
SHA-256) and path for `ttl_s`, so a Prometheus scraping every 30 s costs two small API calls
a minute, not two per scrape. `/healthz` and `/readyz` stay open (the kubelet's probes carry
no token).

Whoever can connect can make us ask the API server, so nothing here grows or calls without
a bound (docs/security.md, "metrics auth amplifies"); the check runs on the event loop that
admission and the allocator share:
- a token that is not JWT-shaped (three base64url segments, at most `MAX_TOKEN_CHARS`) is
  refused (401) without a review: ServiceAccount tokens, what scrapers send, are JWTs;
- the cache is an LRU of at most `cache_size` decisions: every lookup and insert touches
  O(1) entries, an expired entry is dropped when met, the oldest when the cache is full;
- reviews (a TokenReview and its SubjectAccessReview) start at most `reviews_per_s` a
  second on average, `review_burst` at once (a token bucket); a cache miss past that is
  answered 429 without a review;
- at most `max_in_flight` reviews are awaited at once; the next waits its turn (it already
  holds a bucket token, so no more than `review_burst` wait).

Off by default (`--metrics-auth` turns it on): in plain Kubernetes the NetworkPolicies limit
who can connect (to the monitoring namespace); OpenShift's monitoring stack expects
authenticated endpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from common.kubeapi import ApiError, Kube, Obj, group_path
from common.lru import Lru

TOKEN_REVIEW = group_path("authentication.k8s.io/v1", "tokenreviews")
ACCESS_REVIEW = group_path("authorization.k8s.io/v1", "subjectaccessreviews")
OK, UNAUTHENTICATED, FORBIDDEN, TOO_MANY = 200, 401, 403, 429
MAX_TOKEN_CHARS = 4096  # a ServiceAccount token is 1-2 KB
_JWT = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+")

Key = tuple[str, str]  # (SHA-256 of the token, path)
N = TypeVar("N", int, float)


@dataclass(frozen=True)
class MetricsAuthLimits:
    """The bounds of module docstring; the flags of `add_flags` (docs/configuration.md)."""

    ttl_s: float = 60.0
    cache_size: int = 1024
    reviews_per_s: float = 1.0
    review_burst: int = 10
    max_in_flight: int = 4


def add_flags(p: argparse.ArgumentParser) -> None:
    """`--metrics-auth` and the limits' flags, the same for both daemons."""
    p.add_argument(
        "--metrics-auth",
        action="store_true",
        help="/metrics only for a bearer token whose user may get the URL (TokenReview + "
        "SubjectAccessReview, as kube-rbac-proxy; the OpenShift overlay sets it)",
    )
    d = MetricsAuthLimits()
    p.add_argument(
        "--metrics-auth-cache", type=_positive_int, default=d.cache_size, metavar="N",
        help="--metrics-auth: decisions kept (per token and path, least recently used out)",
    )  # fmt: skip
    p.add_argument(
        "--metrics-auth-reviews-per-s", type=_positive_float, default=d.reviews_per_s,
        metavar="R", help="--metrics-auth: token reviews started per second, on average",
    )  # fmt: skip
    p.add_argument(
        "--metrics-auth-review-burst", type=_positive_int, default=d.review_burst, metavar="N",
        help="--metrics-auth: token reviews that may start at once (then 429)",
    )  # fmt: skip
    p.add_argument(
        "--metrics-auth-max-in-flight", type=_positive_int, default=d.max_in_flight,
        metavar="N", help="--metrics-auth: token reviews awaited at once",
    )  # fmt: skip


def limits_from(a: argparse.Namespace) -> MetricsAuthLimits:
    return MetricsAuthLimits(
        cache_size=a.metrics_auth_cache,
        reviews_per_s=a.metrics_auth_reviews_per_s,
        review_burst=a.metrics_auth_review_burst,
        max_in_flight=a.metrics_auth_max_in_flight,
    )


def _positive(cast: Callable[[str], N]) -> Callable[[str], N]:
    """An argparse type: `cast` of the text, more than 0 (NaN refused too)."""

    def parse(text: str) -> N:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
        return value

    return parse


_positive_int, _positive_float = _positive(int), _positive(float)


def jwt_shaped(token: str) -> bool:
    return len(token) <= MAX_TOKEN_CHARS and _JWT.fullmatch(token) is not None


@dataclass(eq=False)
class DecisionCache:
    """An LRU (common/lru.py) of (expiry, verdict) per key, at most `size` entries. `store`
    is injectable so a test can count what each call touches."""

    size: int
    store: OrderedDict[Key, tuple[float, int]] = field(default_factory=OrderedDict)
    _lru: Lru[Key, tuple[float, int]] = field(init=False)

    def __post_init__(self) -> None:
        self._lru = Lru(self.size, self.store)

    def get(self, key: Key, now: float) -> int | None:
        hit = self._lru.get(key)
        if hit is None:
            return None
        if hit[0] <= now:
            self._lru.pop(key)  # met expired: gone, whatever else is stale waits its turn
            return None
        return hit[1]

    def put(self, key: Key, verdict: int, expires: float) -> None:
        self._lru.put(key, (expires, verdict))  # one out per one in

    def __len__(self) -> int:
        return len(self._lru)


@dataclass(eq=False)
class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; `take` spends one or says no."""

    rate: float
    burst: int
    clock: Callable[[], float]
    _tokens: float = -1.0  # full at the first take
    _at: float = 0.0

    def take(self) -> bool:
        now = self.clock()
        if self._tokens < 0:
            self._tokens = float(self.burst)
        else:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


@dataclass(eq=False)
class MetricsAuth:
    kube: Kube
    limits: MetricsAuthLimits = field(default_factory=MetricsAuthLimits)
    clock: Callable[[], float] = time.monotonic
    cache: DecisionCache = field(init=False)
    bucket: TokenBucket = field(init=False)
    _in_flight: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self.cache = DecisionCache(self.limits.cache_size)
        self.bucket = TokenBucket(self.limits.reviews_per_s, self.limits.review_burst, self.clock)
        self._in_flight = asyncio.Semaphore(self.limits.max_in_flight)

    async def check(self, authorization: str | None, path: str) -> int:
        """200, 401, 403 or 429 for a request with this Authorization header to `path`."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not jwt_shaped(token):
            return UNAUTHENTICATED
        key = (hashlib.sha256(token.encode()).hexdigest(), path)
        hit = self.cache.get(key, self.clock())
        if hit is not None:
            return hit
        if not self.bucket.take():
            return TOO_MANY
        async with self._in_flight:
            verdict = await self._decide(token, path)
        self.cache.put(key, verdict, self.clock() + self.limits.ttl_s)
        return verdict

    async def _decide(self, token: str, path: str) -> int:
        try:
            review = await self.kube.create(TOKEN_REVIEW, _token_review(token))
        except ApiError:
            return FORBIDDEN  # fail closed: an API error grants nothing
        status = review.get("status") or {}
        user = status.get("user") or {}
        if not status.get("authenticated") or not user.get("username"):
            return FORBIDDEN
        try:
            access = await self.kube.create(ACCESS_REVIEW, _access_review(user, path))
        except ApiError:
            return FORBIDDEN
        return OK if (access.get("status") or {}).get("allowed") else FORBIDDEN


def refusal(code: int) -> str:
    """The body of a refused /metrics request."""
    if code == TOO_MANY:
        return "too many token reviews; try again later\n"
    return "metrics need an authorized bearer token\n"


def _token_review(token: str) -> Obj:
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token},
    }


def _access_review(user: Obj, path: str) -> Obj:
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user.get("username"),
            "uid": user.get("uid"),
            "groups": user.get("groups") or [],
            "extra": user.get("extra") or {},
            "nonResourceAttributes": {"path": path, "verb": "get"},
        },
    }
