"""hack/uninstall.py against a fake kubectl: what must go away is polled with bounded GETs,
never waited for on a watch. In CI (stop 30) `kubectl delete -k --wait` hung 190 s in step 4
although the private API server's and controller manager's logs show the namespace and the
CRDs gone within 10 s; the fake's watch-based waits never return (they raise here), so the
uninstall must finish without them. tests/integration/test_uninstall.py runs it for real."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hack import uninstall as u


class Hung(Exception):
    """kubectl would wait on a watch here (`wait`, or `delete` without --wait=false)."""


class FakeKubectl(u.Kubectl):
    """A cluster where the namespace and a CRD stay `terminating_polls` polls, then go."""

    def __init__(
        self, terminating_polls: int, allocation_polls: int = 0, failing_polls: int = 0
    ) -> None:
        super().__init__()
        self.left = {"ns": terminating_polls, "alloc": allocation_polls, "fail": failing_polls}
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, *args: str, check: bool = True) -> str:
        self.calls.append(args)
        if args[:2] == ("get", "namespaces,customresourcedefinitions") and self.left["fail"]:
            self.left["fail"] -= 1
            raise u.Stop("kubectl get failed:\nUnable to connect to the server: timeout")
        verb, what = args[0], args[1] if len(args) > 1 else ""
        if verb == "wait" or (verb == "delete" and "--wait=false" not in args):
            raise Hung(" ".join(args))
        if verb == "api-resources":
            return "sliceallocations.instaslice.io\n"
        if verb != "get":
            return ""
        if what == "sliceallocations.instaslice.io":
            return self._items(self._alloc())
        if what == "namespaces,customresourcedefinitions":
            return self._terminating("-o" in args and args[args.index("-o") + 1] == "json")
        return "" if "name" in args else self._items([])

    def _alloc(self) -> list[dict[str, Any]]:
        if self.left["alloc"] <= 0:
            return []
        self.left["alloc"] -= 1
        meta = {
            "namespace": "team-a",
            "name": "claim-1",
            "deletionTimestamp": "2026-12-02T00:00:00Z",
        }
        return [{"metadata": meta, "spec": {}}]  # being released: step 2 lets it be

    def _terminating(self, as_json: bool) -> str:
        if as_json:  # still_terminating's view, with the namespace's conditions
            remaining = {"type": "NamespaceContentRemaining", "status": "True",
                         "message": "Some resources are remaining: pods has 1"}  # fmt: skip
            ns = {"kind": "Namespace", "metadata": {"name": "instaslice-system"},
                  "status": {"phase": "Terminating", "conditions": [remaining]}}  # fmt: skip
            return self._items([ns])
        if self.left["ns"] <= 0:
            return ""
        self.left["ns"] -= 1
        return "namespace/instaslice-system\ncustomresourcedefinition.apiextensions.k8s.io/x\n"

    @staticmethod
    def _items(items: list[dict[str, Any]]) -> str:
        return json.dumps({"items": items})


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(u, "POLL_S", 0.0, raising=False)


def test_steps_3_and_4_poll_until_gone_and_never_wait_on_a_watch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    k = FakeKubectl(terminating_polls=3, allocation_polls=2)
    u.uninstall(k, "overlay", "60s")
    out = capsys.readouterr().out
    assert "[3/5] no SliceAllocation left" in out
    assert "[4/5] admission hooks, then everything of overlay, deleted" in out
    assert "[done]" in out
    polls = [
        i for i, c in enumerate(k.calls) if c[:2] == ("get", "namespaces,customresourcedefinitions")
    ]
    assert len(polls) == 4  # three while terminating, one empty
    assert k.calls[polls[-1] + 1][:3] == ("get", "-k", "overlay")  # then, once, all it names


def test_step_4_stops_at_the_timeout_naming_what_is_left_and_why() -> None:
    k = FakeKubectl(terminating_polls=10**6)
    with pytest.raises(u.Stop) as stop:
        u.delete_everything(k, "overlay", "0.3s")
    msg = str(stop.value)
    assert msg.startswith("still there after 0.3s: namespace/instaslice-system")
    assert "Namespace instaslice-system: NamespaceContentRemaining: Some resources" in msg


def test_step_3_stops_at_the_timeout_naming_the_allocations() -> None:
    k = FakeKubectl(terminating_polls=0, allocation_polls=10**6)
    with pytest.raises(u.Stop, match=r"within 0.2s .*: team-a/claim-1$"):
        u.wait_allocations_gone(k, "0.2s")


@pytest.mark.parametrize(
    ("text", "secs"), [("90s", 90), ("10m", 600), ("1h30m", 5400), ("0.5s", 0.5), ("2m5s", 125)]
)
def test_timeout_durations(text: str, secs: float) -> None:
    assert u.seconds(text) == secs


@pytest.mark.parametrize("text", ["", "10", "5x", "m", "10m junk"])
def test_a_bad_timeout_is_refused_naming_the_flag(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        u.main(["--overlay", "o", "--timeout", text])
    assert "--timeout" in capsys.readouterr().err


def test_every_kubectl_request_is_bounded() -> None:
    k = u.Kubectl("echo", kubeconfig="kc", context="ctx")
    assert k("get", "nodes").split() == [
        "--request-timeout=30s", "--kubeconfig", "kc", "--context", "ctx", "get", "nodes"
    ]  # fmt: skip


def test_a_poll_whose_request_fails_is_asked_again(capsys: pytest.CaptureFixture[str]) -> None:
    k = FakeKubectl(terminating_polls=1, failing_polls=2)
    u.delete_everything(k, "overlay", "60s")
    assert "[4/5]" in capsys.readouterr().out


def test_a_poll_failing_past_the_timeout_stops_with_its_error() -> None:
    k = FakeKubectl(terminating_polls=0, failing_polls=10**6)
    with pytest.raises(u.Stop, match="Unable to connect"):
        u.delete_everything(k, "overlay", "0.2s")
