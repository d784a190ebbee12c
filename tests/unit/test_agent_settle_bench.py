"""bench.agent_settle's log reading: the agent's JSON log lines counted by message, a line
still being written left for the next read."""

from __future__ import annotations

from pathlib import Path

from bench.agent_settle import LogTail


def test_lines_are_counted_by_message_and_a_half_written_line_waits(tmp_path: Path) -> None:
    log = tmp_path / "nodeagent.log"
    log.write_bytes(
        b'{"event": "node discovered", "node": "a"}\n'
        b'{"event": "node discovered", "node": "b"}\n'
        b"Traceback (most recent call last):\n"
        b'{"event": "publish fai'
    )
    tail = LogTail(log)
    assert tail.read() == {"node discovered": 2, "(not JSON)": 1}
    with log.open("ab") as f:
        f.write(b'led", "node": "a"}\n')
    assert tail.read() == {"publish failed": 1}
    assert tail.read() == {}
