"""ServerArgs: every flag of `serve` and `generate`, composed from the sub-configs that own them.

Each flag is declared once, on the sub-config that owns it (its default, `--help` text and group, the
commands that take it, its validation):

    ModelArgs       config/model_args.py     --model-path, --backend, --device, --dtype, ...
    HttpArgs        config/http_args.py      --host, --port, --log-level, request caps, results store
    StoreArgs       config/store_args.py     --results-db, --media-store, --s3-endpoint-url, --owner-timeout-s
    BatchingConfig  config/batching.py       --batching-mode/-max-size/-delay-ms/-config, --enable-batching-metrics
    EngineConfig    config/engine.py         --max-queue-size, --request-timeout-s, --enable-warmup, --warmup-steps
    StepCacheArgs   config/step_cache_args.py --step-cache, --step-cache-config, --step-cache-calibration
    LimitsArgs      config/limits.py         --max-request-bytes, --api-key, prompt and upload caps
    LoraArgs        config/lora.py           --lora-modules, --max-loras, --max-lora-rank
    ControlNetArgs  config/controlnet.py     --controlnet, and generate's --control-image, --control-mode, ...
    DistArgs        config/distributed.py    --nnodes, --node-rank, --dist-*
    QuantArgs       config/quant_args.py     --quantization, --quantization-ignored-layers
    DeploymentArgs  config/deployment_args.py --performance-mode, residency, offload, parallelism

`ServerArgs` holds one instance of each (`args.batching`, `args.engine`, ...); code reads a flag on its section
(`args.batching.max_size`, `args.http.max_image_side`). The flat name (`batching_max_size`, the flag's dest) is
the CLI's and the `--config` file's spelling and a keyword of `ServerArgs(...)`. The CLI (cli.py) builds each
subcommand's flags from the same sub-configs.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffuserve.config.argparse_dataclass import flag_dest, flag_fields, flag_values
from diffuserve.config.batching import BATCHING_GROUP, BatchingConfig
from diffuserve.config.controlnet import CONTROLNET_GROUP, ControlNetArgs
from diffuserve.config.deployment_args import DeploymentArgs
from diffuserve.config.distributed import DIST_GROUP, DistArgs
from diffuserve.config.engine import EngineConfig
from diffuserve.config.http_args import SERVER_GROUP, HttpArgs
from diffuserve.config.limits import LIMITS_GROUP, LimitsArgs
from diffuserve.config.lora import LORA_GROUP, LoraArgs
from diffuserve.config.model_args import MODEL_GROUP, ModelArgs
from diffuserve.config.quant_args import QUANT_GROUP, QuantArgs
from diffuserve.config.step_cache_args import StepCacheArgs
from diffuserve.config.store_args import STORE_GROUP, StoreArgs
from diffuserve.errors import ConfigError

SECTIONS: dict[str, type] = {
    "model": ModelArgs,
    "http": HttpArgs,
    "batching": BatchingConfig,
    "engine": EngineConfig,
    "step_cache": StepCacheArgs,
    "limits": LimitsArgs,
    "dist": DistArgs,
    "store": StoreArgs,
    "lora": LoraArgs,
    "control": ControlNetArgs,
    "quant": QuantArgs,
}
"""ServerArgs attribute -> the sub-config it holds, in `--help` order within a group."""
GROUP_ORDER = (
    MODEL_GROUP,
    SERVER_GROUP,
    STORE_GROUP,
    BATCHING_GROUP,
    LIMITS_GROUP,
    LORA_GROUP,
    CONTROLNET_GROUP,
    QUANT_GROUP,
    DIST_GROUP,
)
"""The `--help` sections of ServerArgs' flags, in order (the deployment sections follow)."""

_OWNER: dict[str, tuple[str, str]] = {
    flag_dest(f): (section, f.name) for section, cls in SECTIONS.items() for f in flag_fields(cls)
}
"""Flat flag name -> (section attribute, field name)."""


@dataclass(init=False)
class ServerArgs:
    """Everything `diffuserve serve` is configured with: one instance of each sub-config.

    `ServerArgs(port=8000, batching_max_size=4)` takes flat flag names (as do `dataclasses.replace` and
    the CLI); `ServerArgs(batching=BatchingConfig(...))` takes whole sub-configs. Flat keywords win.
    """

    model: ModelArgs = field(default_factory=ModelArgs)
    """The checkpoint, its public name, backend, device and dtype."""
    http: HttpArgs = field(default_factory=HttpArgs)
    """Bind address, request caps, logging, drain and the results store."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """The `--batching-*` flags; the schedulers' config (after `with_rules()`)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Admission and warm-up; the engine's config (plus the plan's warm-up resolutions)."""
    step_cache: StepCacheArgs = field(default_factory=StepCacheArgs)
    """The default step cache of requests that set none."""
    limits: LimitsArgs = field(default_factory=LimitsArgs)
    """Body and prompt caps, API key, security switches."""
    dist: DistArgs = field(default_factory=DistArgs)
    """Multi-host launch and rank fault detection."""
    store: StoreArgs = field(default_factory=StoreArgs)
    """The shared results database and media store (PostgreSQL, S3) and the owner lease."""
    lora: LoraArgs = field(default_factory=LoraArgs)
    """The LoRA adapters loaded at start-up and their slots."""
    control: ControlNetArgs = field(default_factory=ControlNetArgs)
    """The ControlNets loaded beside the base model (and `generate`'s control inputs)."""
    quant: QuantArgs = field(default_factory=QuantArgs)
    """Online weight quantization per component (`quant/`)."""
    deployment: DeploymentArgs | None = None
    """DeploymentArgs (config/deployment_args.py); filled by the CLI (None: every deployment flag unset)."""
    config: str | None = None
    """Path of the --config file (handled by the CLI before the other flags)."""

    def __init__(
        self,
        model: ModelArgs | None = None,
        http: HttpArgs | None = None,
        batching: BatchingConfig | None = None,
        engine: EngineConfig | None = None,
        step_cache: StepCacheArgs | str | None = None,
        limits: LimitsArgs | None = None,
        dist: DistArgs | None = None,
        store: StoreArgs | None = None,
        lora: LoraArgs | None = None,
        control: ControlNetArgs | None = None,
        quant: QuantArgs | None = None,
        deployment: DeploymentArgs | None = None,
        config: str | None = None,
        **flags: Any,
    ) -> None:
        given = {
            "model": model,
            "http": http,
            "batching": batching,
            "engine": engine,
            "step_cache": step_cache,
            "limits": limits,
            "dist": dist,
            "store": store,
            "lora": lora,
            "control": control,
            "quant": quant,
        }
        if isinstance(step_cache, str):  # the flat `step_cache="fbcache"` (--step-cache), not a section
            flags["step_cache"], given["step_cache"] = step_cache, None
        unknown = sorted(set(flags) - set(_OWNER))
        if unknown:
            raise TypeError(f"ServerArgs got unexpected keyword arguments {unknown}")
        for section, cls in SECTIONS.items():
            own = {name: flags[dest] for dest, (owner, name) in _OWNER.items() if owner == section and dest in flags}
            # Always a copy: `dataclasses.replace(args, port=1)` must not change `args`' sub-configs.
            value = dataclasses.replace(given[section], **own) if given[section] is not None else cls(**own)
            object.__setattr__(self, section, value)
        self.deployment = deployment
        self.config = config

    @classmethod
    def from_flags(cls, values: dict[str, Any], config: str | None = None) -> ServerArgs:
        """ServerArgs from parsed flag values (flat names; keys of other commands are ignored)."""
        sections = {section: sub(**flag_values(sub, values)) for section, sub in SECTIONS.items()}
        return cls(**sections, deployment=DeploymentArgs(**flag_values(DeploymentArgs, values)), config=config)

    # -- derived -----------------------------------------------------------------------------
    @property
    def public_model_name(self) -> str:
        """--served-model-name, then --model-id, then the --model-path folder's base name (never a server path
        in ids and listings; `/ckpt/flux/` -> `flux`), then the embedded model's name."""
        folder = Path(self.model.model_path).name if self.model.model_path else None  # Path drops a trailing slash
        return self.model.served_model_name or self.model.model_id or folder or EMBEDDED_MODEL_NAME

    @property
    def model_names(self) -> list[str]:
        """Every name a request's `model` field may use (and batching rules match against)."""
        names = [self.public_model_name, self.model.model_id, self.model.model_path]
        if self.model.model_path:
            names.append(Path(self.model.model_path).name)
        seen: list[str] = []
        for name in names:
            if name and name not in seen:
                seen.append(name)
        return seen

    def resolved_output_dir(self) -> Path:
        """--output-dir, or `outputs/<served model name>` under the cache folder ($DIFFUSERVE_CACHE, else
        ~/.cache/diffuserve): keyed by the model, so servers of different models never list or serve each
        other's jobs, and replicas of one model (same name) share theirs."""
        if self.http.output_dir:
            return Path(self.http.output_dir).expanduser()
        from diffuserve.paths import default_output_dir

        return default_output_dir() / re.sub(r"[^A-Za-z0-9._-]", "_", self.public_model_name).lstrip(".")

    def resolved_api_key(self) -> str | None:
        return self.limits.api_key or os.environ.get("DIFFUSERVE_API_KEY") or None

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix: every sub-config's value checks, then the
        checks that read the file system."""
        sections = [getattr(self, name) for name in SECTIONS]
        for section in sections:
            section.validate()
        # A replica renews its lease at every sweep: a timeout within two sweeps would fail live jobs of replicas
        # that are only between two renewals.
        if self.store.owner_timeout_s <= 2 * self.http.result_sweep_interval_s:
            raise ConfigError(
                f"--owner-timeout-s: {self.store.owner_timeout_s} must exceed twice "
                f"--result-sweep-interval-s ({self.http.result_sweep_interval_s}), the lease renewal period."
            )
        # The adapter registry lives in each process: a runtime load through the front end would not reach the
        # engine process's slots.
        if self.http.api_process == "separate" and self.lora.enable_lora_updates:
            raise ConfigError(
                "--enable-lora-updates: runtime adapter loads need the engine in the HTTP process; drop "
                "--api-process separate, or load the adapters at start-up with --lora-modules."
            )
        for section in sections:
            if hasattr(section, "check_files"):
                section.check_files()


EMBEDDED_MODEL_NAME = "diffuserve-tiny-flux"
"""Public name of the embedded default model when no --model-path is given."""


def load_config_file(
    path: str, known_keys: set[str], *, elsewhere: dict[str, str] | None = None, command: str = "serve"
) -> dict[str, Any]:
    """Read a --config file (JSON, or YAML by suffix) whose keys are flag names (`--` optional, - or _).

    `elsewhere` maps keys that belong to other subcommands to the command's name, so such a key fails
    naming that command instead of a vague "unknown key".
    """
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path!r}: {exc.strerror or exc}.") from exc
    if file.suffix.lower() == ".toml":
        raise ConfigError(f"--config: {path!r}: TOML is not read; use JSON or YAML (.yaml / .yml) with the same keys.")
    try:
        if file.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # json/yaml raise their own types; the message is what matters
        kind = (
            "YAML"
            if file.suffix.lower() in (".yaml", ".yml")
            else "JSON (files not named .yaml / .yml are read as JSON)"
        )
        raise ConfigError(f"--config: {path!r} is not valid {kind}: {exc}.") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path!r} must hold a mapping of flag names to values.")
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        if key not in known_keys and elsewhere and key in elsewhere:
            raise ConfigError(
                f"--config: key {raw_key!r} in {path!r} is a flag of `diffuserve {elsewhere[key]}`, "
                f"not of `diffuserve {command}`; remove it from this file."
            )
        if key not in known_keys:
            close = difflib.get_close_matches(key, sorted(known_keys), n=1)
            hint = f" Did you mean '{close[0].replace('_', '-')}'?" if close else ""
            raise ConfigError(f"--config: unknown key {raw_key!r} in {path!r}.{hint}")
        values[key] = value
    return values
