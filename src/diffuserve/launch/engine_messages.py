"""The typed messages between the HTTP front end and the engine-core process (`serve --api-process separate`).

They travel pickled over one local socket pair (`multiprocessing.connection.Connection`), in order, each way: the
front end sends `Start`, `Submit`, `Abort`, `BeginDrain`, `Drain`, `MetricsQuery` and `Stop`; the engine process
answers with `Hello` (once, before the model loads), `ModelInfo` (once, when the model is loaded), `Status` (its
`EngineStatus` and the live requests' progress, when they changed), `Admitted` / `Answer` per request,
`PreviewImages` for streaming requests, `Reply` to a `Drain` or `MetricsQuery`, and `Fatal` when the engine gives
up. Data only: no callables, nothing bound to one process (the model's request rules are data; the front end
checks requests against them).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from diffuserve.engine.status import EngineStatus
from diffuserve.errors import DiffuserveError
from diffuserve.sampling import ModelDescription, SamplingParams

# ------------------------------------------------------------------------------------------ front end -> engine


@dataclass(frozen=True)
class Start:
    """The front end serves HTTP: load the model and warm up now."""


@dataclass(frozen=True)
class Submit:
    """Admit one request (the engine answers `Admitted` or an `Answer` with the admission error, then its
    `Answer`)."""

    request_id: str
    """Server-generated id; the key of every later message about the request."""
    params: SamplingParams
    """Its sampling parameters (built and checked by the front end against the model's request rules)."""
    endpoint: str
    """The API it came through (the label of the request metrics)."""
    timeout_s: float | None
    """The request's own deadline (capped by --request-timeout-s in the engine)."""
    priority: int
    """Queue priority."""
    ineligible_reason: str | None
    """Why it may not merge with others (None: it may)."""
    partial_images: int = 0
    """Previews the streaming request wants (0: none)."""


@dataclass(frozen=True)
class Abort:
    """The client went away (or the job was deleted): drop the request, or cancel it at the next step."""

    request_id: str
    """The request to abort."""
    error: DiffuserveError | None = None
    """The answer it gets (None: the engine's "client disconnected")."""


@dataclass(frozen=True)
class BeginDrain:
    """Stop admitting (the front end got its first SIGTERM / SIGINT)."""


@dataclass(frozen=True)
class Drain:
    """Drain: wait up to `timeout_s` for every accepted request, then answer the rest with 503; `Reply` with how
    many had to be failed."""

    call_id: int
    """Matches the `Reply`."""
    timeout_s: float
    """The drain budget."""


@dataclass(frozen=True)
class MetricsQuery:
    """Send the engine process's Prometheus metric families (`Reply` with a list of `Metric`)."""

    call_id: int
    """Matches the `Reply`."""


@dataclass(frozen=True)
class Stop:
    """The front end is done: stop the engine and exit."""


# ------------------------------------------------------------------------------------------ engine -> front end


@dataclass(frozen=True)
class Hello:
    """The engine process is set up (plan resolved, ranks started); the model has not loaded yet."""

    plan: dict[str, Any] | None
    """The resolved deployment plan that /server_info shows."""
    error: DiffuserveError | None = None
    """Set when the set-up failed (a ConfigError is a start-up error, exit 2): the process exits after it."""


@dataclass(frozen=True)
class ModelInfo:
    """The model is loaded: what the routes need to know about it."""

    model: ModelDescription
    """Its description: plain data (its request rules included; the front end checks requests against them)."""


@dataclass(frozen=True)
class Status:
    """The engine's `EngineStatus` and its live requests' progress; pushed when either changed."""

    status: EngineStatus
    """`AsyncEngine.status()`: the one snapshot /health and /server_info read."""
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    """(steps done, total steps) of each running request."""


@dataclass(frozen=True)
class Admitted:
    """The request is queued (the answer follows as an `Answer`)."""

    request_id: str
    """The request."""


@dataclass(frozen=True)
class Answer:
    """The request's one answer: its result, or its error (an admission error when `admitted` is False)."""

    request_id: str
    """The request."""
    result: Any = None
    """Its `GenerationResult` (PIL images travel pickled; the front end encodes them)."""
    error: DiffuserveError | None = None
    """Its error, None on success."""
    admitted: bool = True
    """False: refused at admission (429, 503, the model's own 400), never queued."""


@dataclass(frozen=True)
class PreviewImages:
    """A streaming request's partial images after a denoising step."""

    request_id: str
    """The request."""
    index: int
    """Which of its partial images (0-based)."""
    images: list[Any]
    """One PIL image per output row."""


@dataclass(frozen=True)
class Reply:
    """The answer to a `Drain` or a `MetricsQuery`."""

    call_id: int
    """The call it answers."""
    value: Any
    """Drain: requests failed; metrics: a list of prometheus_client `Metric`."""


@dataclass(frozen=True)
class Fatal:
    """The engine gave up (the model failed to load, a rank failed): the front end exits non-zero."""

    message: str
    """What happened."""


def send(conn: Connection, message: Any) -> None:
    """Pickle `message` (on the calling thread) and send it."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    """The next message (EOFError once the other process closed its end)."""
    return pickle.loads(conn.recv_bytes())
