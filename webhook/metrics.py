"""Prometheus metrics of the admission server, on a registry passed in.

No global registry: the entry point creates one `CollectorRegistry`, hands it to
`WebhookMetrics` here and to the allocator's metrics, and the server's `/metrics` serves it.
Tests create their own, so counts never leak between tests.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram

# Admission reviews take microseconds to a few milliseconds; the apiserver's timeout is 5 s.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class Outcome(enum.StrEnum):
    """The label values of `instaslice_webhook_reviews_total`."""

    PATCHED = "patched"  # gated, claimed, rewritten
    ALLOWED = "allowed"  # admitted unchanged (no MIG request, not a CREATE, ...)
    DENIED = "denied"  # refused for a reason in the pod
    MALFORMED = "malformed"  # not an AdmissionReview we can answer (denied, or HTTP 400)
    ERROR = "error"  # a bug in the decision (answered with a denial, code 500)


@dataclass
class WebhookMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.reviews = Counter(
            "instaslice_webhook_reviews",
            "Admission reviews answered, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "instaslice_webhook_review_seconds",
            "Time from receiving an AdmissionReview to having its answer encoded.",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.cert_reloads = Counter(
            "instaslice_webhook_cert_reloads",
            "Serving certificate loads after start, by result.",
            ["result"],
            registry=self.registry,
        )
        for outcome in Outcome:  # export zeros, so rate() and absence checks work at once
            self.reviews.labels(outcome.value)
            self.latency.labels(outcome.value)
        for result in ("ok", "error"):
            self.cert_reloads.labels(result)

    def observe(self, outcome: Outcome, seconds: float) -> None:
        self.reviews.labels(outcome.value).inc()
        self.latency.labels(outcome.value).observe(seconds)

    def reviews_total(self, outcome: Outcome | None = None) -> float:
        """Reviews answered so far (all outcomes when None): what tests assert on."""
        outcomes = [outcome] if outcome else list(Outcome)
        total = 0.0
        for o in outcomes:
            value = self.registry.get_sample_value(
                "instaslice_webhook_reviews_total", {"outcome": o.value}
            )
            total += value or 0.0
        return total
