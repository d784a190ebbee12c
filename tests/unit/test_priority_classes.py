"""hack.cluster.priority: a `never` name that is not among the classes is refused, naming it,
before anything is created (the classes themselves are created against the real apiserver in
tests/integration/test_allocator_preemption.py and tests/e2e/test_preemption.py)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from common.kubeapi import Kube
from hack.cluster.priority import ensure_priority_classes


def test_never_names_a_class_not_among_those_to_create() -> None:
    nobody = cast(Kube, None)  # never reached: the arguments are checked first
    with pytest.raises(ValueError, match=r"never: hi-never not among the classes"):
        asyncio.run(ensure_priority_classes(nobody, {"lo": 100, "hi": 1000}, never={"hi-never"}))
