"""bench.latency_track: where a burst's pods wait over time (`occupancy`, `peaks`), the
machine's busy CPU seconds, and the API server's /metrics read per request kind. Pure: a
Tracker filled by hand, a /metrics text written here."""

from __future__ import annotations

import math

from bench.latency_track import (
    PodTimes,
    Tracker,
    api_writes,
    latency_delta,
    machine_busy_s,
    occupancy,
    peaks,
    request_seconds,
    writes_summary,
)


def _tracker(**pods: PodTimes) -> Tracker:
    tr = Tracker(clock=lambda: 0.0)
    tr.pods.update(pods)
    return tr


def test_each_pod_counts_in_the_step_it_has_not_finished() -> None:
    tr = _tracker(
        a=PodTimes(
            sent=0.0, admitted=0.5, allocated=1.5, ready=2.5, ungated=3.5, bound=3.7, running=4.5
        ),
        b=PodTimes(sent=1.2, admitted=1.6, allocated=2.2),  # still with the agent at the end
    )
    occ = occupancy(tr, ["a", "b"], t0=0.0, step_s=1.0)
    assert occ["t_s"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert occ["admit"] == [1, 0, 0, 0, 0, 0]
    assert occ["place"] == [0, 1, 1, 0, 0, 0]  # a at 1 s, b (sent at 1.2 s) at 2 s
    assert occ["agent"] == [0, 0, 1, 1, 1, 1]
    assert occ["pin"] == [0, 0, 0, 1, 0, 0]
    assert occ["bind"] == [0, 0, 0, 0, 0, 0]  # bound before the 4 s sample
    assert occ["start"] == [0, 0, 0, 0, 1, 0]
    assert occ["running"] == [0, 0, 0, 0, 0, 1]


def test_a_static_pod_goes_from_admit_to_bind() -> None:
    """No allocation, Ready or gate: the steps it never had are passed at once."""
    tr = _tracker(s=PodTimes(sent=0.0, admitted=0.4, bound=1.5, running=2.6))
    occ = occupancy(tr, ["s"], t0=0.0, step_s=1.0)
    assert occ["admit"] == [1, 0, 0, 0]
    assert occ["place"] == occ["agent"] == occ["pin"] == [0, 0, 0, 0]
    assert occ["bind"] == [0, 1, 0, 0]
    assert occ["start"] == [0, 0, 1, 0]
    assert occ["running"] == [0, 0, 0, 1]


def test_a_pod_not_yet_sent_is_nowhere_and_unknown_names_are_ignored() -> None:
    tr = _tracker(late=PodTimes(sent=2.5, admitted=2.7, running=3.1))
    occ = occupancy(tr, ["late", "never-created"], t0=0.0, step_s=1.0)
    assert [occ[k][:3] for k in ("admit", "bind", "running")] == [[0, 0, 0]] * 3
    assert occ["running"][-1] == 1


def test_peaks_name_the_deepest_queue_and_when() -> None:
    occ = {"t_s": [0.0, 1.0, 2.0], "admit": [5, 9, 1], "place": [0, 0, 0], "agent": [0, 3, 3],
           "pin": [0, 0, 0], "bind": [0, 0, 0], "start": [0, 2, 0]}  # fmt: skip
    assert peaks(occ) == "admit 9@1s, place 0, agent 3@1s, pin 0, bind 0, start 2@1s"


def test_machine_busy_seconds_grow() -> None:
    a = machine_busy_s()
    assert math.isfinite(a) and a > 0
    x = 0
    for i in range(2_000_000):  # burn a little CPU
        x += i
    assert machine_busy_s() > a


async def test_the_scheduler_binding_is_seen_once_from_the_pod_watch() -> None:
    now = [1.0]
    tr = Tracker(clock=lambda: now[0])
    tr.sent("p")
    pod = {"metadata": {"name": "p"}, "spec": {}, "status": {"phase": "Pending"}}
    await tr.on_pod("MODIFIED", pod)
    assert tr.pods["p"].bound is None
    now[0] = 2.0
    await tr.on_pod("MODIFIED", {**pod, "spec": {"nodeName": "gpu-0"}})
    now[0] = 3.0
    bound_running = {**pod, "spec": {"nodeName": "gpu-0"}, "status": {"phase": "Running"}}
    await tr.on_pod("MODIFIED", bound_running)
    seen = tr.pods["p"]
    assert (seen.bound, seen.running) == (2.0, 3.0)


_PUT = 'resource="pods",subresource="",verb="PUT"'
_MIG = 'resource="mignodes",subresource="status",verb="PATCH"'
_WATCH = 'resource="pods",subresource="",verb="WATCH"'
_NAME = "apiserver_request_duration_seconds"
METRICS = "\n".join(
    [
        f"# HELP {_NAME} x",
        f'{_NAME}_sum{{component="apiserver",{_PUT}}} 1.5',
        f'{_NAME}_count{{component="apiserver",{_PUT}}} 10',
        f'{_NAME}_sum{{component="apiserver",{_MIG}}} 4',
        f'{_NAME}_count{{component="apiserver",{_MIG}}} 20',
        f'{_NAME}_sum{{component="apiserver",{_WATCH}}} 900',
        f'{_NAME}_count{{component="apiserver",{_WATCH}}} 3',
        f'{_NAME}_bucket{{component="apiserver",le="0.1",{_PUT}}} 7',
    ]
)


def test_request_seconds_by_kind_without_watches() -> None:
    got = request_seconds(METRICS)
    assert got == {"PUT pods": (1.5, 10.0), "PATCH mignodes/status": (4.0, 20.0)}


def test_latency_delta_is_the_mean_of_the_requests_between_two_scrapes() -> None:
    before = {"PUT pods": (1.5, 10.0), "PATCH mignodes/status": (4.0, 20.0)}
    after = {"PUT pods": (2.0, 15.0), "PATCH mignodes/status": (4.0, 20.0), "POST pods": (0.3, 3.0)}
    assert latency_delta(before, after) == {
        "PUT pods": {"n": 5, "mean_ms": 100.0},
        "POST pods": {"n": 3, "mean_ms": 100.0},
    }


def _requests(**by_label: int) -> str:
    return "\n".join(
        f'apiserver_request_total{{code="201",{labels}}} {n}' for labels, n in by_label.items()
    )


def test_writes_per_pod_are_counted_by_kind_from_the_api_servers_counters() -> None:
    """Issue 37 §3: pod, SliceAllocation, its status, events, MigNode, Leases (and what no
    kind names), per pod; reads and watches are not writes."""
    rows = {
        'resource="pods",subresource="",verb="POST"': 2,
        'resource="pods",subresource="binding",verb="POST"': 2,
        'resource="pods",subresource="",verb="PUT"': 2,
        'resource="sliceallocations",subresource="",verb="POST"': 2,
        'resource="sliceallocations",subresource="status",verb="PATCH"': 4,
        'resource="events",subresource="",verb="POST"': 6,
        'resource="mignodes",subresource="status",verb="PATCH"': 1,
        'resource="leases",subresource="",verb="PUT"': 3,
        'resource="nodes",subresource="status",verb="PATCH"': 1,
        'resource="pods",subresource="",verb="GET"': 50,
    }
    before = api_writes(_requests(**dict.fromkeys(rows, 0)))
    after = api_writes(_requests(**rows))
    got = writes_summary(before, after, pods=2, wall=1.0)["per_pod_by_kind"]
    assert got == {
        "status": 2.0, "SliceAllocation": 1.0, "events": 3.0, "MigNode": 0.5, "Leases": 1.5,
        "pod": 3.0, "other": 0.5, "total": 11.5,
    }  # fmt: skip
