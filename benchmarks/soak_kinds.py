"""The request kinds of the soak (benchmarks/soak.py): each sends one request the way a user of the official `openai`
SDK does (meshes through httpx: the SDK has no mesh API), waits for its answer (jobs: polls until they finish and
downloads the result), decodes what came back (Pillow / PyAV / trimesh) and says how it ended.

Outcomes: `ok`; `cancelled` (a cancel the workload sent, and the job reads cancelled); `disconnected` (the client
went away on purpose); `rejected` (429: admission said no, with Retry-After); `error_4xx` (any other 4xx: the
workload only sends valid requests, so one is a finding); `error_5xx`; `job_failed` (a job that ended `failed`: the
server's error, counted with the 5xx); `lost` (no answer: a connection error or client timeout nobody asked for, a
job that never finished, or a completed result that does not download or decode).
"""

from __future__ import annotations

import base64
import io
import time
from dataclasses import dataclass, field

import httpx
import openai

OUTCOMES = ("ok", "cancelled", "disconnected", "rejected", "error_4xx", "error_5xx", "job_failed", "lost")
TERMINAL = ("completed", "failed", "cancelled")
IMAGE_STEPS = 4
SIZES = {"image_small": 32, "image_medium": 64, "image_large": 128}
SCHEDULE = (
    "image_small",
    "lora",
    "image_medium",
    "video",
    "edit",
    "image_small",
    "stream",
    "mesh",
    "step_cache",
    "image_large",
    "lora",
    "cancel",
    "image_medium",
    "disconnect",
)
"""One round of the workload; worker i starts at position i and walks it round and round."""
KINDS = tuple(dict.fromkeys(SCHEDULE))


@dataclass
class Record:
    """One request of the soak and how it ended (times in seconds since the run started)."""

    kind: str
    outcome: str
    started: float
    ended: float
    status: int | None = None
    detail: str = ""


@dataclass
class Clients:
    """The clients of the three servers (the SDK with retries off: a retry would hide a failure and send twice)."""

    images: openai.OpenAI
    videos: openai.OpenAI
    meshes: httpx.Client
    plain: httpx.Client
    """For url images: the answer's URL is fetched as any HTTP client would."""
    edit_png: bytes
    object_png: bytes
    job_timeout_s: float
    poll_s: float = 0.1
    notes: list[str] = field(default_factory=list)


class Undecodable(Exception):
    """A result that was answered but does not download or decode (counted as lost)."""


class JobFailed(Exception):
    def __init__(self, job: dict):
        error = job.get("error") or {}
        super().__init__(f"{job.get('id')}: {error.get('code')}: {error.get('message')}")


class JobStuck(Exception):
    """A job that did not finish within the soak's job timeout (counted as lost)."""


def decode_image(data: bytes, side: int) -> None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            size = image.size
    except Exception as exc:
        raise Undecodable(f"image does not decode: {exc}") from exc
    if size != (side, side):
        raise Undecodable(f"image is {size}, asked {side}x{side}")


def decode_video(data: bytes) -> int:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            frames = sum(1 for _ in container.decode(video=0))
    except Exception as exc:
        raise Undecodable(f"MP4 does not decode: {exc}") from exc
    if frames < 1:
        raise Undecodable("MP4 has no frames")
    return frames


def decode_mesh(data: bytes) -> int:
    import trimesh

    try:
        mesh = trimesh.load(io.BytesIO(data), file_type="glb", force="mesh")
    except Exception as exc:
        raise Undecodable(f"GLB does not load: {exc}") from exc
    if len(mesh.vertices) == 0:
        raise Undecodable("GLB has no vertices")
    return len(mesh.vertices)


def _generate(c: Clients, kind: str, seed: int) -> str:
    side = SIZES.get(kind, 64)
    extra: dict = {"num_inference_steps": IMAGE_STEPS, "seed": seed}
    if kind == "lora":
        extra["lora"] = ("ink", "oil", [{"name": "ink", "scale": 0.5}, {"name": "oil", "scale": 0.5}])[seed % 3]
    if kind == "step_cache":
        extra.update(num_inference_steps=12, step_cache="fbcache")
    url = kind == "image_large"
    result = c.images.images.generate(
        prompt=f"soak {kind} {seed}",
        size=f"{side}x{side}",
        n=1 + seed % 2 if kind == "image_small" else 1,
        response_format="url" if url else "b64_json",
        extra_body=extra,
    )
    for item in result.data:
        if url:
            answer = c.plain.get(item.url)
            answer.raise_for_status()
            decode_image(answer.content, side)
        else:
            decode_image(base64.b64decode(item.b64_json), side)
    cache = (result.model_extra or {}).get("timings", {}).get("step_cache")
    if kind == "step_cache" and not cache:
        raise Undecodable("a step_cache request whose timings.step_cache is empty")
    return f"{len(result.data)} image(s)"


def _edit(c: Clients, seed: int) -> str:
    result = c.images.images.edit(
        image=("in.png", c.edit_png, "image/png"),
        prompt=f"soak edit {seed}",
        size="64x64",
        extra_body={"strength": 0.6, "seed": seed, "num_inference_steps": IMAGE_STEPS},
    )
    decode_image(base64.b64decode(result.data[0].b64_json), 64)
    return "1 image"


def _stream(c: Clients, seed: int) -> str:
    partial = completed = 0
    stream = c.images.images.generate(
        prompt=f"soak stream {seed}",
        size="64x64",
        stream=True,
        partial_images=2,
        extra_body={"num_inference_steps": 6, "seed": seed},
    )
    for event in stream:
        decode_image(base64.b64decode(event.b64_json), 64)
        if event.type.endswith("partial_image"):
            partial += 1
        elif event.type.endswith("completed"):
            completed += 1
    if completed != 1:
        raise Undecodable(f"stream ended with {completed} completed events")
    return f"{partial} partial + 1 completed"


def _disconnect(c: Clients, seed: int, turn: int) -> tuple[str, str]:
    """Half the time a client timeout mid-request (the SDK closes the connection), half a stream closed after its
    first event. A request that finished before the client left is just `ok`."""
    if turn % 2:
        impatient = c.images.with_options(timeout=0.1, max_retries=0)
        try:
            impatient.images.generate(
                prompt=f"soak leave {seed}", size="128x128", extra_body={"num_inference_steps": 40, "seed": seed}
            )
        except openai.APITimeoutError:
            return "disconnected", "client timeout 0.1 s"
        return "ok", "answered before the client timeout"
    stream = c.images.images.generate(
        prompt=f"soak leave stream {seed}",
        size="64x64",
        stream=True,
        partial_images=3,
        extra_body={"num_inference_steps": 40, "seed": seed},
    )
    for event in stream:
        stream.close()
        return ("disconnected", "stream closed after its first event") if "partial" in event.type else ("ok", "")
    return "ok", "stream ended before the first event"


def _wait_started(status, timeout_s: float) -> None:
    """Poll until a job left the queue (any state but `queued`)."""
    deadline = time.monotonic() + timeout_s
    while status() == "queued" and time.monotonic() < deadline:
        time.sleep(0.02)


def _wait_video(c: Clients, video_id: str) -> dict:
    deadline = time.monotonic() + c.job_timeout_s
    while (job := c.videos.videos.retrieve(video_id)).status not in TERMINAL:
        if time.monotonic() > deadline:
            raise JobStuck(f"{video_id} still {job.status} after {c.job_timeout_s:.0f} s")
        time.sleep(c.poll_s)
    return job.model_dump()


def _video_done(c: Clients, job: dict) -> str:
    if job["status"] == "failed":
        raise JobFailed(job)
    if job["status"] == "cancelled":
        return "cancelled"
    frames = decode_video(c.videos.videos.download_content(job["id"]).read())
    return f"{frames} frames"


def _video(c: Clients, seed: int, cancel: bool = False, wait: bool = False) -> tuple[str, str]:
    steps = 60 if cancel else 4
    job = c.videos.videos.create(
        prompt=f"soak video {seed}",
        size="32x32",
        extra_body={"num_frames": 5, "num_inference_steps": steps, "seed": seed},
    )
    if cancel:
        if wait:  # half the cancels find the job running, half still queued (or just admitted)
            _wait_started(lambda: c.videos.videos.retrieve(job.id).status, c.job_timeout_s)
        try:
            c.videos.post(f"/videos/{job.id}/cancel", cast_to=object)
        except openai.ConflictError:
            pass  # it finished first: then it must be a complete, downloadable job
    detail = _video_done(c, _wait_video(c, job.id))
    return ("cancelled" if detail == "cancelled" else "ok"), detail


def _wait_mesh(c: Clients, mesh_id: str) -> dict:
    deadline = time.monotonic() + c.job_timeout_s
    while (job := _json(c.meshes.get(f"/v1/meshes/{mesh_id}")))["status"] not in TERMINAL:
        if time.monotonic() > deadline:
            raise JobStuck(f"{mesh_id} still {job['status']} after {c.job_timeout_s:.0f} s")
        time.sleep(c.poll_s)
    return job


def _json(response: httpx.Response) -> dict:
    response.raise_for_status()
    return response.json()


def _mesh(c: Clients, seed: int, cancel: bool = False, wait: bool = False) -> tuple[str, str]:
    fields = {"seed": str(seed), "octree_resolution": "32", "num_inference_steps": "40" if cancel else "4"}
    image = {"image": ("object.png", c.object_png, "image/png")}
    job = _json(c.meshes.post("/v1/meshes", files=image, data=fields))
    if cancel:
        if wait:
            _wait_started(lambda: _json(c.meshes.get(f"/v1/meshes/{job['id']}"))["status"], c.job_timeout_s)
        answer = c.meshes.post(f"/v1/meshes/{job['id']}/cancel")
        if answer.status_code != 409:  # 409: it finished first
            answer.raise_for_status()
    job = _wait_mesh(c, job["id"])
    if job["status"] == "failed":
        raise JobFailed(job)
    if job["status"] == "cancelled":
        return "cancelled", "cancelled"
    vertices = decode_mesh(_json_bytes(c.meshes.get(f"/v1/meshes/{job['id']}/content")))
    return "ok", f"{vertices} vertices"


def _json_bytes(response: httpx.Response) -> bytes:
    response.raise_for_status()
    return response.content


def send(c: Clients, kind: str, seed: int, turn: int = 0) -> tuple[str, str]:
    """Run one request of `kind` (`turn`: how many of its kind ran before, to alternate its variants); returns
    (outcome, detail) for the answers the workload expects, and raises for the rest (`classify` names those)."""
    if kind in SIZES or kind in ("lora", "step_cache"):
        return "ok", _generate(c, kind, seed)
    if kind == "edit":
        return "ok", _edit(c, seed)
    if kind == "stream":
        return "ok", _stream(c, seed)
    if kind == "disconnect":
        return _disconnect(c, seed, turn)
    if kind == "video":
        return _video(c, seed)
    if kind == "mesh":
        return _mesh(c, seed)
    if kind == "cancel":
        send_job = _video if turn % 2 else _mesh
        return send_job(c, seed, cancel=True, wait=turn % 4 >= 2)
    raise ValueError(f"unknown kind {kind}")


def classify(exc: BaseException) -> tuple[str, int | None, str]:
    """(outcome, HTTP status, detail) of a request that raised."""
    status = None
    if isinstance(exc, openai.APIStatusError):
        status = exc.status_code
    elif isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and isinstance(exc, openai.APIConnectionError):
        text += f" ({type(cause).__name__}: {cause})"  # the transport's own words: which side closed, and when
    text = text[:300]
    if status is not None:
        if status >= 500:
            return "error_5xx", status, text
        return ("rejected" if status == 429 else "error_4xx"), status, text
    if isinstance(exc, openai.APIError) and not isinstance(exc, openai.APIConnectionError):
        return "error_5xx", None, text  # an `error` event inside a stream: the server failed the request
    if isinstance(exc, JobFailed):
        return "job_failed", None, text
    return "lost", None, text


def run_one(c: Clients, kind: str, seed: int, t0: float, turn: int = 0) -> Record:
    started = time.monotonic() - t0
    try:
        outcome, detail = send(c, kind, seed, turn)
        status = 200
    except Exception as exc:  # noqa: BLE001 - every failure is a finding, sorted by classify
        outcome, status, detail = classify(exc)
    return Record(kind, outcome, started, time.monotonic() - t0, status, detail)
