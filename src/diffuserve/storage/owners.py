"""Which server process owns a live result, and whether that process still exists.

Several processes may share one results folder. A job that was queued or running in a process that
died (kill -9, OOM, power loss) must come back `failed` with code `interrupted`, but a job that is
running in a *live* neighbour must be left alone. Each process therefore writes its identity into
the rows it owns: host name, pid and the kernel's start time of that pid (so a recycled pid is not
mistaken for the old process), and refreshes a heartbeat. On the same host, liveness is read from
/proc; for an owner on another host only a stale heartbeat counts as dead.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path


def _start_ticks(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); None without /proc or pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


@dataclass(frozen=True)
class Owner:
    """The identity of one server process, as stored in the `owner` column."""

    host: str
    pid: int
    start: str
    """/proc start ticks of the pid ("" where /proc does not exist)."""

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(host=socket.gethostname(), pid=pid, start=_start_ticks(pid) or "")

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        host, _, rest = text.rpartition("@")
        pid, _, start = rest.partition(":")
        if not host or not pid.isdigit():
            return None
        return cls(host=host, pid=int(pid), start=start)

    def __str__(self) -> str:
        return f"{self.host}@{self.pid}:{self.start}"

    def known_dead(self) -> bool:
        """True only when this owner is on this host and its process is certainly gone."""
        if self.host != socket.gethostname():
            return False
        if self.start:
            ticks = _start_ticks(self.pid)
            return ticks is None or ticks != self.start
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
