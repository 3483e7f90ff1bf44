"""HttpArgs: the `Server` flags: where the HTTP server binds, its request caps, logging, drain and results store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from diffuserve.config.argparse_dataclass import check_flags, flag

SERVER_GROUP = "Server"
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class HttpArgs:
    """How `serve` listens, caps requests, drains on shutdown and keeps results."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve",)

    host: str = flag("127.0.0.1", "Address to bind.", SERVER_GROUP)
    """Bind address."""
    port: int = flag(30010, "Port to bind.", SERVER_GROUP)
    """Bind port."""
    log_level: str = flag("info", "Log level.", SERVER_GROUP, choices=LOG_LEVELS, commands=("serve", "generate"))
    """Python logging level."""
    shutdown_timeout_s: float = flag(
        60.0,
        "On SIGTERM/SIGINT, seconds to finish accepted requests and video/mesh jobs (files and rows included) "
        "before answering the rest with an error (unfinished jobs: failed, code shutdown) and exiting.",
        SERVER_GROUP,
    )
    """Graceful drain budget: generation, then the jobs' encoding, media writes and `completed` rows."""
    max_inference_steps: int = flag(200, "Largest num_inference_steps a request may ask for.", SERVER_GROUP)
    """Cap on per-request steps."""
    max_image_side: int = flag(
        4096,
        "Largest width/height a request (or an edit's input image) may have, on every device. The work of a step grows "
        "with width x height: on a CPU, a 4096x4096 image of a real model takes minutes per step, so lower it there.",
        SERVER_GROUP,
    )
    """Cap on output width and height."""
    max_octree_resolution: int = flag(
        512,
        "Mesh models (Hunyuan3D-2): largest octree_resolution a mesh job may ask "
        "for (the volume decode grows with its cube).",
        SERVER_GROUP,
    )
    """Cap on per-request mesh grid resolution."""
    url_store_max_images: int = flag(
        1024, "Images kept for response_format=url links (oldest dropped first).", SERVER_GROUP
    )
    """Capacity of the in-memory store behind /v1/images/{id}/content."""
    max_video_jobs: int = flag(
        128,
        "Video jobs kept for GET /v1/videos (with their MP4); past it the oldest finished jobs are dropped.",
        SERVER_GROUP,
    )
    """Capacity of the video job store (queued and running jobs are never dropped)."""
    max_mesh_jobs: int = flag(
        128,
        "Mesh jobs (POST /v1/meshes) kept with their GLB/OBJ; past it the oldest finished jobs are dropped. It also "
        "bounds the mesh jobs one server has queued or running: one more is refused with 429 (Retry-After).",
        SERVER_GROUP,
    )
    """Capacity of the mesh job store, and the cap on one process's unfinished mesh jobs."""
    output_dir: str | None = flag(
        None,
        "Folder of the results store (SQLite metadata + media files of video jobs and url images); survives restarts "
        "and may be shared by several processes on one host. Default: $DIFFUSERVE_CACHE/outputs/<served model name> "
        "(one folder per model, so different servers never mix their jobs).",
        SERVER_GROUP,
    )
    """Results store root; None = `<cache>/outputs`."""
    result_ttl_s: float = flag(
        86400.0, "Seconds a finished video job or url image is kept (its expires_at); 0 = until removed.", SERVER_GROUP
    )
    """Retention by age, enforced by the background sweep."""
    result_cache_mib: int = flag(
        0,
        "MiB of encoded outputs kept to answer a repeated request that gave a seed (same model, prompts, size, steps, "
        "guidance, step cache, input images, ...) without running the model; 0 = off (docs/step-caches.md).",
        SERVER_GROUP,
    )
    """Budget of the exact-result cache (server/result_cache.py); entries follow --result-ttl-s."""
    max_output_bytes: int = flag(
        0,
        "Media bytes the results store may hold; past it the oldest finished results are removed first. 0 = no cap.",
        SERVER_GROUP,
    )
    """Retention by size, enforced by the background sweep."""
    result_sweep_interval_s: float = flag(
        2.0,
        "Seconds between sweeps of the results store: expiry, size cap, jobs of dead processes, progress and cancels "
        "shared with other processes.",
        SERVER_GROUP,
    )
    """Period of the results store's background sweep."""
    max_video_frames: int = flag(257, "Largest num_frames a video job may ask for.", SERVER_GROUP)
    """Cap on per-job frames (each frame costs memory in the VAE decode and the MP4)."""
    api_process: str = flag(
        "same",
        "Where the HTTP front end runs: `same` (one process with the engine) or `separate` (the engine core -- "
        "scheduler, loops, pipeline -- in its own process, so HTTP, validation and PNG/base64 encoding never "
        "share its GIL; see docs/operations.md, Serving overhead).",
        SERVER_GROUP,
        choices=("same", "separate"),
    )
    """Process layout of `serve`: one process, or the front end and the engine core apart."""

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix."""
        check_flags(
            [
                (self.port < 0 or self.port > 65535, "--port", f"{self.port} is not a TCP port (0-65535)"),
                (self.shutdown_timeout_s < 0, "--shutdown-timeout-s", f"{self.shutdown_timeout_s} must be >= 0"),
                (self.max_inference_steps < 1, "--max-inference-steps", f"{self.max_inference_steps} must be >= 1"),
                (
                    self.max_octree_resolution < 16,
                    "--max-octree-resolution",
                    f"{self.max_octree_resolution} must be >= 16",
                ),
                (self.max_video_jobs < 1, "--max-video-jobs", f"{self.max_video_jobs} must be >= 1"),
                (self.max_mesh_jobs < 1, "--max-mesh-jobs", f"{self.max_mesh_jobs} must be >= 1"),
                (self.result_ttl_s < 0, "--result-ttl-s", f"{self.result_ttl_s} must be >= 0 (0 = keep until removed)"),
                (self.result_cache_mib < 0, "--result-cache-mib", f"{self.result_cache_mib} must be >= 0 (0 = off)"),
                (self.max_output_bytes < 0, "--max-output-bytes", f"{self.max_output_bytes} must be >= 0 (0 = no cap)"),
                (
                    self.result_sweep_interval_s <= 0,
                    "--result-sweep-interval-s",
                    f"{self.result_sweep_interval_s} must be > 0",
                ),
                (self.max_video_frames < 1, "--max-video-frames", f"{self.max_video_frames} must be >= 1"),
            ]
        )
