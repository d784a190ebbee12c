"""`bench.latency --profile DIR`: py-spy samples of the agent and allocator per scenario.

`Profiler.start(label, pids)` attaches `py-spy record --format raw` (collapsed stacks, one
line per distinct stack with its sample count) to each process; `stop()` ends them with
SIGINT so they write their files. `top(path)` sums the samples into the functions that
hold the most of them, inclusive (on the stack) and exclusive (on top), which is what the
report's before/after tables quote. py-spy is optional: without it, profiling is skipped
with a note. Sampling is `--nonblocking` so the measured processes are not paused.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


def py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


@dataclass
class Profiler:
    out: Path
    rate: int = 50
    running: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def start(self, label: str, pids: dict[str, int]) -> None:
        exe = py_spy()
        if exe is None:
            print("profile: py-spy not found (pip install py-spy); skipping", flush=True)
            return
        self.out.mkdir(parents=True, exist_ok=True)
        for name, pid in pids.items():
            path = self.out / f"{label}.{name}.txt"
            argv = [exe, "record", "-p", str(pid), "-f", "raw", "-r", str(self.rate),
                    "--nonblocking", "-o", str(path)]  # fmt: skip
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.running.append((proc, path))

    def stop(self) -> list[Path]:
        done = []
        for proc, path in self.running:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if path.exists():
                done.append(path)
                top_file = path.with_name(path.name.removesuffix(".txt") + ".top.txt")
                top_file.write_text(summary(path))
        self.running = []
        return done


def top(path: Path, n: int = 15, by: str = "incl") -> tuple[int, list[tuple[str, int, int]]]:
    """(total samples, [(function, inclusive, exclusive)]) by inclusive (or self) samples.
    Frames of the interpreter's own machinery (event loop, thread pool) are left out of
    the inclusive ranking: they hold every sample and say nothing."""
    incl: Counter[str] = Counter()
    excl: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        total += k
        frames = [_short(f) for f in stack.split(";")]
        for f in set(frames):
            incl[f] += k
        excl[frames[-1]] += k
    if by == "self":
        rows = [(f, incl[f], excl[f]) for f, _ in excl.most_common(n)]
    else:
        ranked = [f for f, _ in incl.most_common() if not f.endswith(_PLUMBING)]
        rows = [(f, incl[f], excl[f]) for f in ranked[:n]]
    return total, rows


_PLUMBING = (
    "(threading.py)", "(asyncio/runners.py)", "(asyncio/base_events.py)",
    "(asyncio/events.py)", "(futures/thread.py)", "(instaslice-webhook)",
    "(instaslice-nodeagent)", "(nodeagent/main.py)", "(webhook/main.py)",
)  # fmt: skip


def _short(frame: str) -> str:
    """`fn (path/module.py:123)` → `fn (module.py)`: lines differ, functions aggregate."""
    fn, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    parts = file.replace("\\", "/").split("/")
    return f"{fn} ({'/'.join(parts[-2:])})"


def summary(path: Path, n: int = 20) -> str:
    """The top functions by inclusive and by self samples, as text."""
    lines = []
    for by in ("incl", "self"):
        total, rows = top(path, n, by)
        lines.append(f"== {path.name}: {total} samples, by {by}")
        for f, i, e in rows:
            pi, pe = 100 * i / max(1, total), 100 * e / max(1, total)
            lines.append(f"  {pi:5.1f}% incl {pe:5.1f}% self  {f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.latency_profile FILE...`: print the top functions of each file."""
    for name in argv if argv is not None else sys.argv[1:]:
        print(summary(Path(name)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
