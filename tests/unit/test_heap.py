"""common.heap: the allocator's process settles its garbage collector once it has listed."""

from __future__ import annotations

import json
import subprocess
import sys

from common.heap import YOUNG_THRESHOLD

PROBE = """
import gc, json
from common.heap import settle_collector
cache = [{"node": i} for i in range(1000)]  # what an informer holds
before = gc.get_freeze_count()
settle_collector()
print(json.dumps([before, gc.get_freeze_count(), gc.get_threshold()]))
"""


def test_settling_freezes_what_is_held_and_collects_the_young_less_often() -> None:
    # A fresh interpreter: freezing the test process would keep its garbage for good.
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    before, after, thresholds = json.loads(out.stdout)
    assert before == 0
    assert after >= 1000  # the cache's dicts at least
    assert thresholds == [YOUNG_THRESHOLD, 20, 20]
