"""hack.cluster.procs.free_ports: the ports of one control plane (etcd client, etcd peer,
apiserver) or one dev system are distinct. Asked for one by one, each socket closed before the
next bind, the kernel gave the same port twice in 2 of 20,000 triples on this machine; a
control plane whose etcd and apiserver got one port fails to start ("bind: address already in
use")."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from hack.cluster import procs


class _RecyclingSocket:
    """A socket whose kernel hands out `ports` in order: what port 0 may give when a port
    just released is picked again."""

    ports: list[int] = []
    open_now: set[int] = set()

    def __init__(self, *_: Any) -> None:
        self.port = 0

    def bind(self, addr: tuple[str, int]) -> None:
        assert addr == ("127.0.0.1", 0)
        # a port still bound by an open socket is never handed out again (what the kernel
        # guarantees); a released one may be
        while (port := self.ports.pop(0)) in self.open_now:
            pass
        self.port = port
        self.open_now.add(port)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def close(self) -> None:
        self.open_now.discard(self.port)

    def __enter__(self) -> _RecyclingSocket:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def test_free_ports_are_distinct_when_the_kernel_recycles_a_released_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_RecyclingSocket, "ports", [41000, 41000, 41000, 41001, 41002])
    monkeypatch.setattr(_RecyclingSocket, "open_now", set())
    monkeypatch.setattr(socket, "socket", _RecyclingSocket)
    assert procs.free_ports(3) == [41000, 41001, 41002]
    assert _RecyclingSocket.open_now == set()  # every socket released afterwards


def test_free_ports_on_the_real_kernel_are_distinct_and_bindable() -> None:
    for _ in range(200):
        ports = procs.free_ports(3)
        assert len(set(ports)) == 3, ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", procs.free_port()))  # released: a component can bind it
