"""ServerArgs: every flag of `serve` and `generate` (except deployment ones), with defaults and checks.

The deployment flags (`--performance-mode`, residency, offload, parallelism) live in
`config/deployment.py:DeploymentArgs`; `ServerArgs.deployment` carries them.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffuserve.errors import ConfigError

_MODEL = "Model"
_SERVER = "Server"
_BATCHING = "Dynamic batching"
_LIMITS = "Admission, limits and security"
_DIST = "Distributed launch (several ranks, several hosts)"


def _f(default: Any, help: str, group: str, **meta: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, "group": group, **meta})
    return field(default=default, metadata={"help": help, "group": group, **meta})


@dataclass
class ServerArgs:
    """Everything `diffuserve serve` is configured with. Field docs are the `--help` texts."""

    # -- model -------------------------------------------------------------------------------
    model_path: str | None = _f(None, "Diffusers-format checkpoint folder. Omit to use the embedded tiny default model.", _MODEL)
    """Checkpoint folder; None builds/uses the embedded default model from the cache."""
    model_id: str | None = _f(None, "Model family/registry hint (e.g. FLUX.1-dev) when model_index.json is ambiguous.", _MODEL)
    """Registry hint; also the public name when --served-model-name is unset."""
    served_model_name: str | None = _f(None, "Public model name in /v1/models and responses (default: --model-id, then --model-path).", _MODEL)
    """Stable public name across replicas and mount paths."""
    backend: str = _f("auto", "Pipeline backend: native adapter, the diffusers pipeline, or auto (native when there is one).", _MODEL, choices=["auto", "native", "diffusers"])
    """auto | native | diffusers."""
    device: str = _f("auto", "Device: auto (cuda when present, else cpu), cpu, cuda, cuda:N.", _MODEL)
    """Torch device the pipeline runs on."""
    dtype: str = _f("auto", "Weights dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.", _MODEL, choices=["auto", "float32", "bfloat16", "float16"])
    """Torch dtype of the weights."""
    num_threads: int | None = _f(None, "CPU threads for torch ops. Default: $OMP_NUM_THREADS if set; else, on a CPU device, all cores but one (the HTTP loop and encoding need one); on CUDA, torch's default.", _MODEL)
    """Intra-op threads (torch.set_num_threads)."""
    config: str | None = _f(None, "JSON or YAML file whose keys are flag names; command-line flags win.", _MODEL, cli=False)
    """Path of the --config file (handled by the CLI before the other flags)."""

    # -- server ------------------------------------------------------------------------------
    host: str = _f("127.0.0.1", "Address to bind.", _SERVER)
    """Bind address."""
    port: int = _f(30010, "Port to bind.", _SERVER)
    """Bind port."""
    enable_warmup: bool = _f(True, "Run one real generation before /health turns 200.", _SERVER)
    """Warm-up generation at start-up (readiness waits for it)."""
    warmup_steps: int = _f(2, "Denoising steps of the warm-up generation.", _SERVER)
    """Steps of the warm-up run (cheap but real)."""
    log_level: str = _f("info", "Log level.", _SERVER, choices=["debug", "info", "warning", "error"])
    """Python logging level."""
    shutdown_timeout_s: float = _f(60.0, "On SIGTERM/SIGINT, seconds to finish accepted requests before answering the rest with an error and exiting.", _SERVER)
    """Graceful drain budget."""
    max_inference_steps: int = _f(200, "Largest num_inference_steps a request may ask for.", _SERVER)
    """Cap on per-request steps."""
    max_image_side: int = _f(4096, "Largest width/height a request may ask for.", _SERVER)
    """Cap on output width and height."""
    url_store_max_images: int = _f(1024, "Images kept for response_format=url links (oldest dropped first).", _SERVER)
    """Capacity of the in-memory store behind /v1/images/{id}/content."""
    max_video_jobs: int = _f(128, "Video jobs kept for GET /v1/videos (with their MP4); past it the oldest finished jobs are dropped.", _SERVER)
    """Capacity of the video job store (queued and running jobs are never dropped)."""
    output_dir: str | None = _f(None, "Folder of the results store (SQLite metadata + media files of video jobs and url images); survives restarts and may be shared by several processes on one host. Default: $DIFFUSERVE_CACHE/outputs.", _SERVER)
    """Results store root; None = `<cache>/outputs`."""
    result_ttl_s: float = _f(86400.0, "Seconds a finished video job or url image is kept (its expires_at); 0 = until removed.", _SERVER)
    """Retention by age, enforced by the background sweep."""
    max_output_bytes: int = _f(0, "Media bytes the results store may hold; past it the oldest finished results are removed first. 0 = no cap.", _SERVER)
    """Retention by size, enforced by the background sweep."""
    result_sweep_interval_s: float = _f(2.0, "Seconds between sweeps of the results store: expiry, size cap, jobs of dead processes, progress and cancels shared with other processes.", _SERVER)
    """Period of the results store's background sweep."""
    max_video_frames: int = _f(257, "Largest num_frames a video job may ask for.", _SERVER)
    """Cap on per-job frames (each frame costs memory in the VAE decode and the MP4)."""

    # -- dynamic batching --------------------------------------------------------------------
    batching_mode: str = _f("singleton", "singleton (one request per pipeline call), dynamic (merge compatible queued requests) or continuous (requests join and leave the running denoise group at step boundaries).", _BATCHING, choices=["singleton", "dynamic", "continuous"])
    """Batching mode."""
    batching_max_size: int = _f(1, "Dynamic mode: most rows (outputs, n) in one pipeline call. Compatible requests merge under it; a request with a larger n runs as several calls (same images). 1 turns merging off.", _BATCHING)
    """User cap on a batch, and a hard cap on the rows of every pipeline call in dynamic mode."""
    batching_delay_ms: float = _f(0.0, "How long the head of the queue may wait for compatible requests.", _BATCHING)
    """Batching window."""
    batching_config: str | None = _f(None, "JSON/YAML rules giving lower caps per model/resolution.", _BATCHING)
    """Path of the rules file."""
    enable_batching_metrics: bool = _f(False, "Log one line per dispatch and a stats line every 5 dispatches.", _BATCHING)
    """Batching log lines (Prometheus metrics are always on)."""

    # -- admission, limits, security ---------------------------------------------------------
    max_queue_size: int = _f(256, "Queued requests beyond which new ones get HTTP 429 with Retry-After; 0 = unlimited.", _LIMITS)
    """Admission control."""
    request_timeout_s: float = _f(600.0, "Deadline per request (queued -> 504; running -> cancelled at the next step, 504). 0 = none.", _LIMITS)
    """Server-wide deadline; a request's own `timeout` may only shorten it."""
    max_request_bytes: int = _f(4 * 1024 * 1024, "Largest request body; bigger ones get HTTP 413 before being read whole.", _LIMITS)
    """Body size cap."""
    max_upload_bytes: int = _f(16 * 1024 * 1024, "Largest multipart body of POST /v1/images/edits (image upload included); bigger ones get HTTP 413.", _LIMITS)
    """Upload cap for edits."""
    max_prompt_chars: int = _f(10000, "Longest prompt / negative prompt in characters.", _LIMITS)
    """String length cap."""
    api_key: str | None = _f(None, "Require `Authorization: Bearer KEY` on every endpoint except /liveness, /health, /metrics (also DIFFUSERVE_API_KEY).", _LIMITS)
    """API key; never logged."""
    reject_truncated_prompts: bool = _f(False, "Answer 400 (param prompt) when a prompt is longer than a text encoder takes, instead of running it cut off with a warning in the response.", _LIMITS)
    """Strict prompt-length mode (the default warns: response `warnings` and one log line per request)."""
    allow_remote_urls: bool = _f(False, "Allow request fields that make the server fetch remote URLs (off: such fields are rejected).", _LIMITS)
    """Remote fetch switch."""

    # -- distributed launch ---------------------------------------------------------------------
    nnodes: int = _f(1, "Hosts the --num-gpus ranks are spread over (each host runs --num-gpus / --nnodes ranks; start the same command on every host with its own --node-rank).", _DIST)
    """Number of hosts."""
    node_rank: int = _f(0, "This host's index, 0 to --nnodes - 1. Only node 0 serves HTTP (its first rank hosts the engine).", _DIST)
    """This host's index."""
    dist_init_addr: str | None = _f(None, "HOST:PORT of node 0 where every rank meets (a TCP store); required with --nnodes > 1. Default on one host: 127.0.0.1 and a free port.", _DIST, metavar="HOST:PORT")
    """Rendezvous address."""
    dist_heartbeat_timeout_s: float = _f(30.0, "A rank that sends no heartbeat for this long is declared hung: every in-flight request gets an error naming it, /health turns 503 and the server exits non-zero.", _DIST)
    """Hung-rank detection bound."""
    dist_timeout_s: float = _f(600.0, "Timeout of the ranks' process groups and of a rank's answer to a finished pipeline call (a rank stuck that long in a collective is a fault).", _DIST)
    """Collective / straggler timeout."""

    deployment: Any = field(default=None, metadata={"cli": False})
    """DeploymentArgs (config/deployment.py); filled by the CLI."""

    # -- derived -----------------------------------------------------------------------------
    @property
    def public_model_name(self) -> str:
        """--served-model-name, then --model-id, then --model-path, then the embedded model's name."""
        return self.served_model_name or self.model_id or self.model_path or EMBEDDED_MODEL_NAME

    @property
    def model_names(self) -> list[str]:
        """Every name a request's `model` field may use (and batching rules match against)."""
        names = [self.public_model_name, self.model_id, self.model_path]
        if self.model_path:
            names.append(Path(self.model_path).name)
        seen: list[str] = []
        for name in names:
            if name and name not in seen:
                seen.append(name)
        return seen

    def resolved_output_dir(self) -> Path:
        """--output-dir, or `outputs` under the cache folder ($DIFFUSERVE_CACHE, else ~/.cache/diffuserve)."""
        if self.output_dir:
            return Path(self.output_dir).expanduser()
        from diffuserve.paths import default_output_dir

        return default_output_dir()

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("DIFFUSERVE_API_KEY") or None

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix."""
        checks = [
            (self.port < 0 or self.port > 65535, "--port", f"{self.port} is not a TCP port (0-65535)"),
            (self.batching_max_size < 1, "--batching-max-size", f"{self.batching_max_size} must be >= 1 (1 turns merging off)"),
            (self.batching_delay_ms < 0, "--batching-delay-ms", f"{self.batching_delay_ms} must be >= 0"),
            (self.max_queue_size < 0, "--max-queue-size", f"{self.max_queue_size} must be >= 0 (0 = unlimited)"),
            (self.request_timeout_s < 0, "--request-timeout-s", f"{self.request_timeout_s} must be >= 0 (0 = none)"),
            (self.shutdown_timeout_s < 0, "--shutdown-timeout-s", f"{self.shutdown_timeout_s} must be >= 0"),
            (self.max_request_bytes < 1024, "--max-request-bytes", f"{self.max_request_bytes} is too small (>= 1024)"),
            (self.max_upload_bytes < 1024, "--max-upload-bytes", f"{self.max_upload_bytes} is too small (>= 1024)"),
            (self.max_inference_steps < 1, "--max-inference-steps", f"{self.max_inference_steps} must be >= 1"),
            (self.num_threads is not None and self.num_threads < 1, "--num-threads", f"{self.num_threads} must be >= 1"),
            (self.warmup_steps < 1, "--warmup-steps", f"{self.warmup_steps} must be >= 1"),
            (self.max_prompt_chars < 1, "--max-prompt-chars", f"{self.max_prompt_chars} must be >= 1"),
            (self.max_video_jobs < 1, "--max-video-jobs", f"{self.max_video_jobs} must be >= 1"),
            (self.result_ttl_s < 0, "--result-ttl-s", f"{self.result_ttl_s} must be >= 0 (0 = keep until removed)"),
            (self.max_output_bytes < 0, "--max-output-bytes", f"{self.max_output_bytes} must be >= 0 (0 = no cap)"),
            (self.result_sweep_interval_s <= 0, "--result-sweep-interval-s", f"{self.result_sweep_interval_s} must be > 0"),
            (self.max_video_frames < 1, "--max-video-frames", f"{self.max_video_frames} must be >= 1"),
            (self.nnodes < 1, "--nnodes", f"{self.nnodes} must be >= 1"),
            (not 0 <= self.node_rank < self.nnodes, "--node-rank", f"{self.node_rank} must be between 0 and --nnodes - 1 ({self.nnodes - 1})"),
            (self.nnodes > 1 and not self.dist_init_addr, "--dist-init-addr", "is required with --nnodes > 1: give HOST:PORT of node 0, the same on every host"),
            (self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr), "--dist-init-addr", f"{self.dist_init_addr!r} is not HOST:PORT"),
            (self.dist_heartbeat_timeout_s <= 0, "--dist-heartbeat-timeout-s", f"{self.dist_heartbeat_timeout_s} must be > 0"),
            (self.dist_timeout_s <= 0, "--dist-timeout-s", f"{self.dist_timeout_s} must be > 0"),
        ]
        for failed, flag, message in checks:
            if failed:
                raise ConfigError(f"{flag}: {message}.")
        if self.model_path is not None and not Path(self.model_path).is_dir():
            raise ConfigError(f"--model-path: {self.model_path!r} is not a folder. Give a diffusers-format checkpoint folder (with model_index.json), or omit the flag to use the embedded default model.")
        if self.batching_config is not None and not Path(self.batching_config).is_file():
            raise ConfigError(f"--batching-config: cannot read {self.batching_config!r} (no such file).")


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


EMBEDDED_MODEL_NAME = "diffuserve-tiny-flux"
"""Public name of the embedded default model when no --model-path is given."""


def load_config_file(path: str, known_keys: set[str], *, elsewhere: dict[str, str] | None = None,
                     command: str = "serve") -> dict[str, Any]:
    """Read a --config file (JSON, or YAML by suffix) whose keys are flag names (`--` optional, - or _).

    `elsewhere` maps keys that belong to other subcommands to the command's name, so such a key fails
    naming that command instead of a vague "unknown key".
    """
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path!r}: {exc.strerror or exc}.") from exc
    try:
        if file.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # json/yaml raise their own types; the message is what matters
        raise ConfigError(f"--config: {path!r} is not valid {file.suffix.lstrip('.') or 'JSON'}: {exc}.") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path!r} must hold a mapping of flag names to values.")
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        if key not in known_keys and elsewhere and key in elsewhere:
            raise ConfigError(f"--config: key {raw_key!r} in {path!r} is a flag of `diffuserve {elsewhere[key]}`, "
                              f"not of `diffuserve {command}`; remove it from this file.")
        if key not in known_keys:
            close = difflib.get_close_matches(key, sorted(known_keys), n=1)
            hint = f" Did you mean '{close[0].replace('_', '-')}'?" if close else ""
            raise ConfigError(f"--config: unknown key {raw_key!r} in {path!r}.{hint}")
        values[key] = value
    return values


def public_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(ServerArgs) if f.metadata.get("cli") is not False]
