"""What the route handlers share: the args, the engine, metrics, and the store behind image URLs."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from diffuserve.config.server_args import ServerArgs
from diffuserve.engine.engine import AsyncEngine
from diffuserve.engine.metrics import EngineMetrics
from diffuserve.server.video_jobs import VideoJobStore


@dataclass
class StoredImage:
    data: bytes
    media_type: str


class ImageStore:
    """Bounded in-memory store for `response_format=url` results (oldest dropped first).

    Requests never choose where anything is written: URLs name server-generated ids only.
    """

    def __init__(self, max_images: int):
        self.max_images = max_images
        self._items: OrderedDict[str, list[StoredImage]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()

    def put(self, image_id: str, images: list[StoredImage]) -> None:
        with self._lock:
            self._items[image_id] = images
            self._count += len(images)
            while self._count > self.max_images and len(self._items) > 1:
                _, dropped = self._items.popitem(last=False)
                self._count -= len(dropped)

    def get(self, image_id: str) -> list[StoredImage] | None:
        with self._lock:
            return self._items.get(image_id)


@dataclass
class ServerContext:
    args: ServerArgs
    engine: AsyncEngine
    metrics: EngineMetrics
    images: ImageStore
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    videos: VideoJobStore | None = None
    """Async video jobs; `create_app` makes one sized by --max-video-jobs when none is given."""
