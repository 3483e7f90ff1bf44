"""What the route handlers share: the args, the engine, metrics, and the store behind image URLs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from diffuserve.config.server_args import ServerArgs
from diffuserve.engine.metrics import EngineMetrics
from diffuserve.server.engine_client import EngineClient
from diffuserve.server.job_drain import JobDrivers
from diffuserve.server.mesh_jobs import MeshJobStore
from diffuserve.server.video_jobs import VideoJobStore
from diffuserve.storage import ResultStore


@dataclass
class StoredImage:
    data: bytes
    media_type: str


_EXTENSIONS = {"image/png": "png", "image/jpeg": "jpeg", "image/webp": "webp"}


class ImageStore:
    """The images of `response_format=url` results, kept in the results store (files under
    --output-dir), so links survive a restart and resolve on every replica sharing the folder.

    Bounded by `max_images` images (oldest results dropped first) besides the store's retention.
    Requests never choose where anything is written: URLs name server-generated ids only.
    """

    def __init__(self, results: ResultStore, max_images: int):
        self.results = results
        self.max_images = max_images

    def put(self, image_id: str, images: list[StoredImage]) -> None:
        """Write the files and their row (blocking: call it from a worker thread)."""
        files = {f"{i}.{_EXTENSIONS.get(img.media_type, 'bin')}": img.data for i, img in enumerate(images)}
        self.results.put_completed(image_id, "image", {"media_types": [img.media_type for img in images]}, files)
        self.results.evict("image", self.max_images, by_files=True)

    def presign(self, image_id: str, index: int, expires_s: int) -> str | None:
        """A presigned URL of image `index` in the media store (None: unknown, or the store cannot sign)."""
        record = self.results.get(image_id)
        if record is None or record.kind != "image":
            return None
        types = record.meta.get("media_types", [])
        if index >= len(types):
            return None
        return self.results.presign(record, f"{index}.{_EXTENSIONS.get(types[index], 'bin')}", expires_s)

    def get(self, image_id: str) -> list[StoredImage] | None:
        record = self.results.get(image_id)
        if record is None or record.kind != "image":
            return None
        out = []
        for i, media_type in enumerate(record.meta.get("media_types", [])):
            data = self.results.read_file(record, f"{i}.{_EXTENSIONS.get(media_type, 'bin')}")
            if data is None:
                return None
            out.append(StoredImage(data, media_type))
        return out


@dataclass
class ServerContext:
    args: ServerArgs
    engine: EngineClient
    """The `AsyncEngine` (--api-process same) or the client of the engine process (`RemoteEngineClient`)."""
    metrics: EngineMetrics
    images: ImageStore
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    results: ResultStore | None = None
    """The results store under --output-dir that `images` and `videos` keep their rows and files in."""
    videos: VideoJobStore | None = None
    """Async video jobs; `create_app` makes one sized by --max-video-jobs when none is given."""
    meshes: MeshJobStore | None = None
    """Async mesh jobs; `create_app` makes one sized by --max-mesh-jobs when none is given."""
    result_cache: Any = None
    """The exact-result cache (`server/result_cache.py`) with --result-cache-mib > 0; `create_app` builds it."""
    jobs: JobDrivers = field(default_factory=JobDrivers)
    """The tasks driving this process's video and mesh jobs, which a graceful drain waits for (server/job_drain.py)."""
    plan: dict[str, Any] | None = None
    """The resolved deployment plan (`DeploymentPlan.to_dict()`) that /server_info shows; None when not served
    from a plan (tests that build a context by hand)."""
