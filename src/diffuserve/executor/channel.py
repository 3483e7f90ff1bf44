"""Messages, heartbeats and fault reports between ranks, through the process group's TCP store.

Why the store and not a collective: a rank waiting for its next batch must not sit inside a collective (a gloo or
NCCL collective blocked longer than the group timeout breaks the group for good: STACK.md's idle trap), and rank
0 must notice a peer that died or hung instead of blocking with it. Store reads are polled with a short backoff
(1 ms growing to 20 ms), so a waiting rank picks a message up within ~20 ms at worst and costs nothing while idle.
Every key is removed by its reader, so the store does not grow with the number of batches served.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

_POLL_START_S = 0.001
_POLL_MAX_S = 0.02


class ChannelClosed(RuntimeError):
    """The store is gone (rank 0 exited) or the wait was given up."""


class StoreChannel:
    """Typed helpers over a `torch.distributed.Store` shared by every rank (keys under `diffuserve/`)."""

    def __init__(self, store: Any):
        import torch.distributed as dist

        self.store = dist.PrefixStore("diffuserve/", store)

    # -- messages ----------------------------------------------------------------------------------------
    def post(self, key: str, message: Any) -> None:
        self.store.set(key, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def poll(self, key: str) -> Any | None:
        """The message under `key` (removed), or None when there is none yet."""
        if not self.store.check([key]):
            return None
        value = self.store.get(key)
        self.store.delete_key(key)
        return pickle.loads(value)

    def receive(self, key: str, *, keep_waiting: Callable[[], bool] = lambda: True,
                timeout_s: float | None = None) -> Any:
        """Wait for the message under `key` (removed once read). `keep_waiting()` is asked at every poll; when it
        says no, or past `timeout_s`, ChannelClosed is raised."""
        delay, deadline = _POLL_START_S, None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                message = self.poll(key)
            except Exception as exc:  # the TCP store died with rank 0
                raise ChannelClosed(f"the rank-0 store is unreachable ({type(exc).__name__}: {exc})") from exc
            if message is not None:
                return message
            if not keep_waiting() or (deadline is not None and time.monotonic() > deadline):
                raise ChannelClosed(f"gave up waiting for {key}")
            time.sleep(delay)
            delay = min(_POLL_MAX_S, delay * 2)

    def publish_rank(self, rank: int, info: dict[str, Any]) -> None:
        """What /server_info shows of a rank (its pid, host, device); kept, not consumed."""
        self.store.set(f"rank/{rank}", pickle.dumps(info))

    def rank_info(self, rank: int) -> dict[str, Any] | None:
        if not self.store.check([f"rank/{rank}"]):
            return None
        return pickle.loads(self.store.get(f"rank/{rank}"))

    # -- liveness ----------------------------------------------------------------------------------------
    def beat(self, rank: int) -> None:
        """One heartbeat of `rank` (raises when the store is gone)."""
        self.store.add(f"heartbeat/{rank}", 1)

    def heartbeats(self, rank: int) -> int:
        """How many heartbeats `rank` has sent."""
        return self.store.add(f"heartbeat/{rank}", 0)

    def report_fault(self, rank: int, message: str) -> None:
        self.store.set(f"fault/{rank}", message.encode())

    def fault(self, rank: int) -> str | None:
        if not self.store.check([f"fault/{rank}"]):
            return None
        return self.store.get(f"fault/{rank}").decode()
