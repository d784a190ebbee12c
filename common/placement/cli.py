"""`instaslice-place --policy P TRACE.json`: replay a placement trace, one JSON line per event.

Reads the trace (a path, or `-` for stdin; format in replay.py), replays it through the
engine under the chosen policy and prints, per event,
`{"op": "add", "pod": …, "placed": true, "node": …, "slices": [{container, profile, gpu,
start, size}]}`, `{"op": "add", "pod": …, "placed": false, "reason": <sentence>, "code":
<PendingReason>}` or `{"op": "remove", "pod": …, "removed": true|false}`. Exit status 0 on a
replayed trace, 2 on an unreadable or malformed one (message on stderr), 1 when the reader
of stdout goes away.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from common.placement.model import Policy
from common.placement.replay import AddEvent, Cluster, TraceError, parse_trace, result_line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="instaslice-place",
        description="Replay a placement trace through the InstaSlice placement engine.",
    )
    parser.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=Policy.INSTASLICE.value,
        help="placement policy (default: instaslice)",
    )
    parser.add_argument("trace", help="trace JSON file, or - for stdin")
    args = parser.parse_args(argv)
    try:
        if args.trace == "-":
            doc = json.load(sys.stdin)
        else:
            with open(args.trace, encoding="utf-8") as f:
                doc = json.load(f)
        trace = parse_trace(doc)
        cluster = Cluster(trace.nodes, Policy(args.policy))
        for ev in trace.events:
            result = cluster.add(ev.request) if isinstance(ev, AddEvent) else cluster.remove(ev.pod)
            print(json.dumps(result_line(ev, result), separators=(", ", ": ")), flush=False)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as the docs of `signal` advise.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (OSError, json.JSONDecodeError, TraceError) as e:
        print(f"instaslice-place: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
