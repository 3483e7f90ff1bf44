"""The transport of the multi-rank protocol: pickled values and counters under keys of the process group's TCP store.

It knows no key names and no message types: executor/protocol.py owns both, and every role talks through its
links; this is the only module that touches the store itself.

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
    """Pickled values, counters and waits over a `torch.distributed.Store` shared by every rank (keys under
    `diffuserve/`)."""

    def __init__(self, store: Any):
        import torch.distributed as dist

        self._store = dist.PrefixStore("diffuserve/", store)

    def post(self, key: str, message: Any) -> None:
        self._store.set(key, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def poll(self, key: str) -> Any | None:
        """The message under `key` (removed), or None when there is none yet."""
        if not self._store.check([key]):
            return None
        value = self._store.get(key)
        self._store.delete_key(key)
        return pickle.loads(value)

    def receive(
        self, key: str, *, keep_waiting: Callable[[], bool] = lambda: True, timeout_s: float | None = None
    ) -> Any:
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

    def peek(self, key: str) -> Any | None:
        """The value under `key`, kept for the next reader, or None when there is none."""
        if not self._store.check([key]):
            return None
        return pickle.loads(self._store.get(key))

    def exists(self, key: str) -> bool:
        return self._store.check([key])

    def count(self, key: str, amount: int = 1) -> int:
        """Add `amount` to the counter under `key` (atomic across ranks) and return it; count(key, 0) reads it."""
        return self._store.add(key, amount)

    def delete(self, *keys: str) -> None:
        for key in keys:
            self._store.delete_key(key)
