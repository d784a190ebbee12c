"""Console scripts `instaslice-nodeagent` and `instaslice-emu`: their entry points, loaded so
that a missing `server` extra reads as what to install, not as a traceback (common/extras.py)."""

from __future__ import annotations

from common.extras import server_extra


def main() -> int:
    with server_extra("instaslice-nodeagent"):
        from nodeagent.main import main as run
    return run()


def emu() -> int:
    """Console script `instaslice-emu` (the emulator stands in for pynvml, so it needs it)."""
    with server_extra("instaslice-emu"):
        from nodeagent.emulator.cli import main as run
    return run()
