"""The cluster spec's node groups (docs/contract.md §5), in particular `runtime: containerd`:
bad input is refused with an error naming the entry and field; a real group makes no KWOK
Node object (its kubelet registers it). Leaves out starting anything (tests/e2e)."""

from __future__ import annotations

from typing import Any

import pytest

from hack.cluster.nodes import SpecError, node_labels, node_manifests, parse_spec

H100: dict[str, Any] = {"count": 1, "gpus": 1, "model": "H100-80GB"}


def test_runtime_defaults_to_kwok_and_containerd_marks_the_real_group() -> None:
    spec = parse_spec(
        {"nodes": [{"prefix": "k", **H100}, {"prefix": "real", "runtime": "containerd", **H100}]}
    )
    assert [g.runtime for g in spec.groups] == ["kwok", "containerd"]
    assert spec.real_group is spec.groups[1]
    assert spec.node_names() == ["k-0", "real-0"]
    assert [m["metadata"]["name"] for m in node_manifests(spec)] == ["k-0"]
    labels = node_labels(spec.groups[1], "real-0")
    assert labels["kubernetes.io/hostname"] == "real-0" and "type" not in labels


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ([{"prefix": "r", "runtime": "docker", **H100}], "nodes[0].runtime: 'docker' is not one"),
        ([{"prefix": "r", "runtime": "containerd", **H100, "count": 2}], "nodes[0].count:"),
        (
            [
                {"prefix": "a", "runtime": "containerd", **H100},
                {"prefix": "b", "runtime": "containerd", **H100},
            ],
            "nodes[1].runtime: only one group",
        ),
    ],
)
def test_bad_runtime_input_names_the_field(nodes: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"nodes": nodes})
    assert str(err.value).startswith(message), err.value


def test_kueue_is_a_top_level_boolean() -> None:
    group = {"prefix": "h", "count": 1, "gpus": 1, "model": "H100-80GB"}
    assert parse_spec({"nodes": [group]}).kueue is False
    assert parse_spec({"kueue": True, "nodes": [group]}).kueue is True
    with pytest.raises(SpecError, match="kueue: 'yes' is not true or false"):
        parse_spec({"kueue": "yes", "nodes": [group]})


def test_dra_is_a_top_level_boolean_off_by_default() -> None:
    group = {"prefix": "n", "count": 1, "gpus": 1, "model": "H100-80GB"}
    assert parse_spec({"nodes": [group]}).dra is False
    assert parse_spec({"dra": True, "nodes": [group]}).dra is True
    with pytest.raises(SpecError, match="dra: 'yes' is not true or false"):
        parse_spec({"dra": "yes", "nodes": [group]})
    real = {**group, "runtime": "containerd"}  # the chart's agent in DRA mode (docs/dra.md)
    spec = parse_spec({"dra": True, "install": "chart", "nodes": [real]})
    assert (spec.dra, spec.install) == (True, "chart")


def test_slot_accounting_is_a_top_level_boolean_off_by_default() -> None:
    group = {"prefix": "h", "count": 1, "gpus": 1, "model": "H100-80GB"}
    assert parse_spec({"kueue": True, "nodes": [group]}).slot_accounting is False
    assert parse_spec({"slotAccounting": True, "nodes": [group]}).slot_accounting is True
    with pytest.raises(SpecError, match="slotAccounting: 1 is not true or false"):
        parse_spec({"slotAccounting": 1, "nodes": [group]})


def test_every_shipped_spec_parses() -> None:
    from pathlib import Path

    from hack.cluster.nodes import load_spec

    specs = sorted((Path(__file__).parents[2] / "hack" / "specs").glob("*.yaml"))
    assert specs
    parsed = {p.name: load_spec(p) for p in specs}
    assert parsed["kueue.yaml"].kueue and not parsed["dev.yaml"].kueue
