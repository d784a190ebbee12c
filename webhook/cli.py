"""Console script `instaslice-webhook`: the entry point, loaded so that a missing `server`
extra reads as what to install, not as a traceback (common/extras.py)."""

from __future__ import annotations

from common.extras import server_extra


def main() -> int:
    with server_extra("instaslice-webhook"):
        from webhook.main import main as run
    return run()
