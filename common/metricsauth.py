"""Who may read `/metrics`: what kube-rbac-proxy does for OpenShift's own components.

A request must carry a bearer token that the API server authenticates (a TokenReview), and
the token's user must be allowed `get` on the non-resource URL (a SubjectAccessReview), as
granted by a ClusterRole such as `instaslice-metrics-reader`. No token: 401; a token the API
server rejects or a user without the grant: 403. Decisions are cached per token (by its
SHA-256) for `ttl_s`, so a Prometheus scraping every 30 s costs two small API calls a minute,
not two per scrape. `/healthz` and `/readyz` stay open (the kubelet's probes carry no token).

Off by default (`--metrics-auth` turns it on): in plain Kubernetes the NetworkPolicies limit
who can connect; OpenShift's monitoring stack expects authenticated endpoints.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.kubeapi import ApiError, Kube, Obj, group_path

TOKEN_REVIEW = group_path("authentication.k8s.io/v1", "tokenreviews")
ACCESS_REVIEW = group_path("authorization.k8s.io/v1", "subjectaccessreviews")
OK, UNAUTHENTICATED, FORBIDDEN = 200, 401, 403


@dataclass(eq=False)
class MetricsAuth:
    kube: Kube
    ttl_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _cache: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)

    async def check(self, authorization: str | None, path: str) -> int:
        """200, 401 or 403 for a request with this Authorization header to `path`."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return UNAUTHENTICATED
        key = (hashlib.sha256(token.strip().encode()).hexdigest(), path)
        now = self.clock()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        verdict = await self._decide(token.strip(), path)
        if len(self._cache) > 1000:  # many distinct tokens: forget the expired ones
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        self._cache[key] = (now + self.ttl_s, verdict)
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
