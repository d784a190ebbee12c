"""Per-GPU geometry: which profiles a GPU offers and where they may go, as the engine sees it.

A GPU's geometry is a `GpuModel` (common/catalog): its memory slots, and for every profile
the size, legal starts, count limit, engines and compute slices. For a catalog model the
engine finds it by name; a GPU whose node published another table (a model in no catalog,
or one whose driver reports other profiles or placements: NVML wins) carries its geometry
itself (`Gpu.geometry`), and is known to the engine's keys by a *token*: the model name
plus a digest of the table's content. The token stands for the table everywhere a model
name does (node keys, the per-model tables cache), so two tables never share a cached
answer, and identical tables published by a thousand nodes share one.

`token()` interns each table it names in a process-wide map, token -> table, which the
engine reads back (`lookup`). Tokens are content digests, so the map only ever grows by
distinct tables (a handful per cluster) and never gives two answers for one token; it is
an intern table, like `sys.intern`, not state between decisions, and it is never cleared
(a live `Gpu` may hold any token).
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache

from common.catalog import GpuModel, model_to_json

_BY_TOKEN: dict[str, GpuModel] = {}
_UNSAFE = re.compile(r"[\x00-\x1f@]")  # key separators (model.py) and the token's own '@'


@lru_cache(maxsize=1024)
def token(model: GpuModel) -> str:
    """`<name>@<digest>`: the engine's name for the table `model` (content-addressed)."""
    doc = model_to_json(model)
    digest = hashlib.blake2b(json.dumps(doc, sort_keys=True).encode(), digest_size=8)
    name = f"{_UNSAFE.sub('_', model.name)}@{digest.hexdigest()}"
    _BY_TOKEN.setdefault(name, model)
    return name


def lookup(name: str) -> GpuModel | None:
    """The table a token names (None for a catalog model name or an unknown token)."""
    return _BY_TOKEN.get(name)
