"""Child processes of the local control plane: spawn, identify, stop.

Every process runs in its own session (so its own process group, pgid == pid); stopping one
signals the whole group, so nothing a component forks can outlive it. A process is identified
by pid *and* its start time from /proc, so a recycled pid is never mistaken for ours (that
matters for `down` run long after `up`, from another Python process). When the launching
thread is the main thread and the caller asks for it, children also get PR_SET_PDEATHSIG, so a
test run killed with SIGKILL does not leave a control plane behind; `make cluster-up` does not
ask for it, because there the launcher exits and the cluster must stay.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcessRecord", "free_port", "free_ports", "spawn", "stop_process"]

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the kernel picks it; small race accepted).
    For several ports at once use `free_ports`: this one may return the same port twice."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1, free right now. Each socket stays bound until all
    are picked: ports asked for one by one, each released before the next, can come back the
    same (1 in 10^4 triples here: a control plane whose etcd and apiserver got one port)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            if port not in ports:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def _start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks); None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces; it ends at the last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


@dataclass(frozen=True)
class ProcessRecord:
    """What the state file remembers about one child process."""

    name: str
    pid: int
    start_time: int
    log: str

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start_time

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "pid": self.pid, "start_time": self.start_time, "log": self.log}

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> ProcessRecord:
        return cls(
            name=str(d["name"]),
            pid=int(str(d["pid"])),
            start_time=int(str(d["start_time"])),
            log=str(d["log"]),
        )


def _preexec(pdeathsig: bool) -> Callable[[], None] | None:
    if not pdeathsig:
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def tie_to_parent() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return tie_to_parent


def spawn(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Start `argv` in a new session with stdout+stderr appended to `log_path`.

    `die_with_parent` only takes effect on the main thread: PR_SET_PDEATHSIG fires when the
    *thread* that forked exits, which would kill the cluster with a worker thread.
    """
    pdeathsig = die_with_parent and threading.current_thread() is threading.main_thread()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"==> {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=_preexec(pdeathsig),
            close_fds=True,
        )
    start = _start_time(proc.pid)
    if start is None:  # exited already; keep a record that is never alive
        start = -1
    return proc, ProcessRecord(name, proc.pid, start, str(log_path))


def _group_gone(pgid: int) -> bool:
    """No live (non-zombie) process left in group `pgid`. Zombies are ignored: their parent
    may be a slow-reaping init, and a zombie holds no port, file or CPU."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return False
    return True


def stop_process(
    record: ProcessRecord,
    popen: subprocess.Popen[bytes] | None = None,
    *,
    grace_s: float = 5.0,
) -> None:
    """SIGTERM the process group, SIGKILL it after `grace_s`, and wait until it is gone.

    With `popen` (we launched it in this Python process) the child is reaped via Popen, so no
    zombie and no ResourceWarning; otherwise init reaps it and we poll /proc.
    """
    pgid = record.pid  # start_new_session: the leader's pid is the group id
    if popen is None and not record.alive():
        # leader gone; members of its group (if any) are still ours to clean up
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=0.05)
                leader_gone = popen.returncode is not None
            else:
                leader_gone = not record.alive()
                if not leader_gone:
                    time.sleep(0.05)
            if leader_gone and _group_gone(pgid):
                return
            if leader_gone:
                time.sleep(0.05)
    raise RuntimeError(f"{record.name} (pid {record.pid}) survived SIGKILL")
