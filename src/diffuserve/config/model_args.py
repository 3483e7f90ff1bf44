"""ModelArgs: which checkpoint is served, how it is named, and where it runs (the `Model` flags)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from diffuserve.config.argparse_dataclass import flag
from diffuserve.errors import ConfigError
from diffuserve.family_spec import BACKENDS  # one list: the family registry owns the backends

MODEL_GROUP = "Model"
_ALL = ("serve", "generate", "plan")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ModelArgs:
    """The checkpoint, its public name, the backend, device, dtype and CPU threads."""

    COMMANDS: ClassVar[tuple[str, ...]] = ("serve", "generate")

    model_path: str | None = flag(
        None,
        "Diffusers-format checkpoint folder. Omit to use the embedded tiny default model.",
        MODEL_GROUP,
        commands=_ALL,
        per_command={"plan": {"help": "Checkpoint folder (default: the embedded model).", "group": None}},
    )
    """Checkpoint folder; None builds/uses the embedded default model from the cache."""
    model_id: str | None = flag(
        None,
        "Model family/registry hint (e.g. FLUX.1-dev) when model_index.json is ambiguous.",
        MODEL_GROUP,
        commands=_ALL,
        per_command={
            "plan": {"help": "Family hint (e.g. FLUX.1-dev) when model_index.json is ambiguous.", "group": None}
        },
    )
    """Registry hint; also the public name when --served-model-name is unset."""
    transformer_path: str | None = flag(
        None,
        "Load the denoiser from this single file over --model-path's folder (its config, encoders and VAE): a GGUF "
        "file (Q8_0, Q6_K, Q5_K, Q4_K, Q4_0, ...), Black Forest Labs' fp8r / NVFP4 safetensors, or a plain "
        "safetensors file. Quantized weights stay quantized in memory.",
        MODEL_GROUP,
        commands=_ALL,
        per_command={"plan": {"help": "A pre-quantized transformer file, counted at its bytes.", "group": None}},
    )
    """A pre-quantized transformer file (`models/single_file.py` reads its header; `models/quantized_files.py`
    loads it with diffusers' GGUF / BFL quantizers). None: the folder's own transformer."""
    served_model_name: str | None = flag(
        None,
        "Public model name in /v1/models and responses (default: --model-id, then the --model-path folder's name).",
        MODEL_GROUP,
        commands=("serve",),
    )
    """Stable public name across replicas and mount paths."""
    backend: str = flag(
        "auto",
        "Pipeline backend: native adapter, the diffusers pipeline, or auto (native when there is one).",
        MODEL_GROUP,
        choices=BACKENDS,
        commands=_ALL,
        per_command={
            "plan": {
                "help": "The backend `serve` would use (default: auto = native when the family has an "
                "adapter); the plan refuses the parallel modes that backend cannot run, as "
                "start-up does.",
                "group": None,
            }
        },
    )
    """auto | native | diffusers."""
    device: str = flag("auto", "Device: auto (cuda when present, else cpu), cpu, cuda, cuda:N.", MODEL_GROUP)
    """Torch device the pipeline runs on."""
    dtype: str = flag(
        "auto",
        "Weights dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16.",
        MODEL_GROUP,
        choices=DTYPES,
        commands=_ALL,
        per_command={
            "plan": {"help": "Weights dtype used to size components (default: auto = bfloat16 on GPUs).", "group": None}
        },
    )
    """Torch dtype of the weights."""
    num_threads: int | None = flag(
        None,
        "CPU threads for torch ops. Default: $OMP_NUM_THREADS if set; else, on a CPU device, all cores but one (the "
        "HTTP loop and encoding need one); on CUDA, torch's default.",
        MODEL_GROUP,
    )
    """Intra-op threads (torch.set_num_threads)."""

    mesh_texture: bool = flag(
        False,
        "Mesh models (Hunyuan3D-2): texture the mesh. Not available (refused at start-up): "
        "texturing needs Tencent's compiled CUDA rasterizer.",
        MODEL_GROUP,
    )
    """Refused: only untextured shapes are served."""

    def validate(self) -> None:
        """Fail at start-up, naming the flag and the fix."""
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--num-threads: {self.num_threads} must be >= 1.")
        if self.mesh_texture:
            raise ConfigError(
                "--mesh-texture: texturing Hunyuan3D-2 meshes needs Tencent's compiled CUDA rasterizer "
                "(hy3dgen's texgen), which diffuserve does not run; drop the flag to serve untextured "
                "shapes (GLB/OBJ).",
                param="mesh_texture",
            )

    def check_files(self) -> None:
        """The checks that read the file system (after every value check)."""
        if self.model_path is not None and not Path(self.model_path).is_dir():
            raise ConfigError(
                f"--model-path: {self.model_path!r} is not a folder. Give a diffusers-format checkpoint folder (with "
                "model_index.json), or omit the flag to use the embedded default model."
            )
        if self.transformer_path is not None:
            if self.model_path is None:
                raise ConfigError(
                    "--transformer-path needs --model-path: the base diffusers folder gives the transformer's "
                    "config, the text encoders and the VAE.",
                    param="transformer_path",
                )
            path = Path(self.transformer_path).expanduser()
            try:
                with path.open("rb") as f:
                    f.read(4)  # its format is read at plan time (models/single_file.py)
            except OSError as exc:
                raise ConfigError(
                    f"--transformer-path: {self.transformer_path!r} cannot be read ({exc.strerror or exc}); give a "
                    ".gguf or .safetensors transformer file.",
                    param="transformer_path",
                ) from exc
