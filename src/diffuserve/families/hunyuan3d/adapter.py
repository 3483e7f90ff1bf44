"""Hunyuan3D-2 shape generation as a diffuserve pipeline: one image per request -> one mesh.

The recipe (numbered in `run`): preprocess each request's image, encode it with DINOv2 (and the zero
unconditional embedding), draw each row's noise from its own seed, run the flow-matching DiT with CFG (or the
turbo/fast guidance embedding), decode the latents to an occupancy volume on the octree grid in chunks, and
extract each row's surface with marching cubes. Rows never mix, so a batched request equals its solo run.
Encoding the mesh (GLB/OBJ) happens after the split, like PNG encoding for images (`media/meshes.py`).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from diffuserve.activation import ActivationFacts
from diffuserve.errors import CheckpointError, RequestCancelledError
from diffuserve.families.hunyuan3d import conditioning
from diffuserve.families.hunyuan3d.dit import Hunyuan3DDiT
from diffuserve.families.hunyuan3d.flashvdm import flashvdm_decode
from diffuserve.families.hunyuan3d.vae import ShapeVAE, decode_volume
from diffuserve.family_spec.base import SamplingDefaults
from diffuserve.family_spec.hunyuan3d import LICENSE_NOTE
from diffuserve.family_spec.hunyuan3d_layout import find_subfolder, read_config, target_name
from diffuserve.pipelines.base import BatchResult, Pipeline, RequestOutput
from diffuserve.pipelines.recipe import batch_noise, check_batch

if TYPE_CHECKING:
    from diffuserve.pipelines.base import PreviewCallback, StepCallback, StopCheck
    from diffuserve.sampling import SamplingParams


@dataclass
class Mesh:
    """One generated surface: vertices in the [-box, box] cube, triangles wound as the reference exports them."""

    vertices: np.ndarray
    """(V, 3) float32."""
    faces: np.ndarray
    """(F, 3) int64 vertex indices."""
    error: str | None = None
    """Why the row has no surface (the volume never crosses the mc level); the job fails with it."""


@dataclass(frozen=True)
class MeshSettings:
    """Server-wide surface settings (SGLang's defaults)."""

    box: float = 1.01
    """Half side of the cube the volume is sampled in."""
    mc_level: float = 0.0
    """Occupancy logit level marching cubes extracts."""
    chunk_size: int = 32000
    """Grid points queried per geometry-decoder call (bounds the decode's memory, not its result)."""
    default_octree_resolution: int = 384
    """Grid cells per side when a request leaves octree_resolution unset."""
    max_octree_resolution: int = 512
    """Largest octree_resolution a request may ask for."""
    volume_decoder: str = "auto"
    """dense (every grid point, the reference's default) | flashvdm (the hierarchical decode,
    families/hunyuan3d/flashvdm.py) | auto: flashvdm for turbo variants (the consistency scheduler), as
    Tencent runs them, else dense."""
    flashvdm_min_resolution: int = 63
    """FlashVDM adds a finer level while the resolution halves to at least this (the reference's
    `min_resolution`; tests lower it to reach two levels on a small grid)."""


logger = logging.getLogger(__name__)

VOLUME_DECODERS = ("auto", "dense", "flashvdm")
"""`MeshSettings.volume_decoder` values (a config.yaml's `diffuserve: {volume_decoder: ...}` picks one)."""
SCHEDULERS = ("FlowMatchEulerDiscreteScheduler", "ConsistencyFlowMatchEulerDiscreteScheduler")


def _suggested_settings(folder: Path, suggested: dict[str, Any]) -> MeshSettings:
    """MeshSettings from a config.yaml's own `diffuserve:` section (tiny defaults, the volume decoder)."""
    decoder = str(suggested.get("volume_decoder", "auto"))
    if decoder not in VOLUME_DECODERS:
        raise CheckpointError(
            f"{folder}/config.yaml: diffuserve.volume_decoder {decoder!r} is not one of {list(VOLUME_DECODERS)}.",
            param="model_path",
        )
    return MeshSettings(default_octree_resolution=int(suggested.get("octree_resolution", 384)), volume_decoder=decoder)


def extract_surface(volume: np.ndarray, *, level: float, box: float, resolution: int) -> Mesh:
    """Marching cubes (scikit-image, Lewiner) on one volume; vertices mapped into the box as the reference does
    (index / (res + 1) * 2 box - box, `res` the requested octree resolution even where FlashVDM's grid is a
    little coarser) and faces reversed. NaN (points FlashVDM never queried) counts as outside."""
    from skimage import measure

    with warnings.catch_warnings():  # an all-NaN volume (nothing queried) gives NaN bounds: no surface, below
        warnings.simplefilter("ignore", RuntimeWarning)
        low, high = np.nanmin(volume), np.nanmax(volume)  # reductions: no grid-sized temporary
    if not low <= level <= high:
        return Mesh(
            np.zeros((0, 3), np.float32),
            np.zeros((0, 3), np.int64),
            error=f"the decoded volume never crosses the surface level {level} (values "
            f"{low:.3g}..{high:.3g}): no mesh; try another seed or image",
        )
    vertices, faces, _, _ = measure.marching_cubes(volume, level, method="lewiner")
    vertices = vertices / (resolution + 1) * (2 * box) - box
    placed = np.isfinite(vertices).all(axis=1)
    if not placed.all():
        # Edges to points FlashVDM never queried (NaN) give NaN vertices (the reference exports them as they
        # are): drop those triangles, and those vertices, so the file holds only placed geometry.
        faces = faces[placed[faces].all(axis=1)]
        vertices, faces = vertices[placed], (np.cumsum(placed) - 1)[faces]
    return Mesh(vertices.astype(np.float32), np.ascontiguousarray(faces[:, ::-1]).astype(np.int64))


class Hunyuan3DPipeline(Pipeline):
    """Tencent's Hunyuan3D-2 shape models (2.0, 2mini, fast, turbo) from their own folder layout."""

    family = "hunyuan3d"
    output_kind = "mesh"  # type: ignore[assignment]
    max_image_inputs = 1
    min_image_inputs = 1

    def __init__(
        self,
        model: Hunyuan3DDiT,
        vae: ShapeVAE,
        conditioner: conditioning.DinoConditioner,
        *,
        scheduler: dict[str, Any],
        image_size: int = 512,
        border_ratio: float = 0.15,
        variant: str = "",
        settings: MeshSettings | None = None,
    ):
        super().__init__()
        self.model, self.vae, self.conditioner = model, vae, conditioner
        self.components = {"model": model, "vae": vae, "conditioner": conditioner}
        self.scheduler = scheduler
        self.image_size, self.border_ratio = image_size, border_ratio
        self.variant = variant
        self.settings = settings or MeshSettings()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.defaults = SamplingDefaults(
            width=64,
            height=64,
            num_inference_steps=50,
            guidance_scale=5.0,
            octree_resolution=self.settings.default_octree_resolution,
        )
        self.timings: dict[str, float] = {}

    # -- loading ----------------------------------------------------------------------------------------

    @classmethod
    def from_folder(
        cls,
        model_path: str | Path,
        *,
        model_id: str | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Hunyuan3DPipeline:
        """Load `<root>/<subfolder>/config.yaml` + `model.fp16.safetensors` (or the subfolder itself)."""
        from safetensors.torch import load_file

        folder = find_subfolder(Path(model_path), model_id)
        config = read_config(folder)
        logger.info("%s: %s", folder.name, LICENSE_NOTE)
        weights = folder / "model.fp16.safetensors"
        if not weights.is_file():
            raise CheckpointError(
                f"{folder} has no model.fp16.safetensors (Tencent's layout keeps the DiT, VAE "
                "and conditioner weights there).",
                param="model_path",
            )
        parts: dict[str, dict[str, torch.Tensor]] = {"model": {}, "vae": {}, "conditioner": {}}
        for key, value in load_file(str(weights)).items():
            prefix, _, rest = key.partition(".")
            if prefix in parts:
                parts[prefix][rest] = value
        builders = {
            "model": (Hunyuan3DDiT, "Hunyuan3DDiT"),
            "vae": (ShapeVAE, "ShapeVAE"),
            "conditioner": (conditioning.DinoConditioner, "SingleImageEncoder"),
        }
        modules: dict[str, torch.nn.Module] = {}
        for name, (builder, expected) in builders.items():
            section = config.get(name) or {}
            if target_name(section) != expected:
                raise CheckpointError(
                    f"{folder}/config.yaml: {name}.target {section.get('target')!r} is not "
                    f"supported (expected a {expected}); multi-view and texture models are not "
                    "served.",
                    param="model_path",
                )
            try:
                module = builder(**(section.get("params") or {}))
                module.load_state_dict(parts[name], strict=True)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise CheckpointError(
                    f"{folder}: the {name} weights do not match config.yaml ({exc}).", param="model_path"
                ) from exc
            modules[name] = module.to(device=device, dtype=dtype).eval()
        scheduler = config.get("scheduler") or {}
        if target_name(scheduler) not in SCHEDULERS:
            raise CheckpointError(
                f"{folder}/config.yaml: scheduler {scheduler.get('target')!r} is not one of {list(SCHEDULERS)}.",
                param="model_path",
            )
        processor = (config.get("image_processor") or {}).get("params") or {}
        # A tiny checkpoint's own `diffuserve:` section suggests small defaults (the reference ignores it).
        suggested = config.get("diffuserve") or {}
        settings = _suggested_settings(folder, suggested)
        pipeline = cls(
            modules["model"],
            modules["vae"],
            modules["conditioner"],  # type: ignore[arg-type]
            scheduler={"kind": target_name(scheduler), **(scheduler.get("params") or {})},
            image_size=int(processor.get("size", 512)),
            border_ratio=float(processor.get("border_ratio") or 0.15),
            variant=folder.name,
            settings=settings,
        )
        pipeline.defaults = SamplingDefaults(
            width=64,
            height=64,
            num_inference_steps=int(suggested.get("num_inference_steps", 50)),
            guidance_scale=float(suggested.get("guidance_scale", 5.0)),
            octree_resolution=settings.default_octree_resolution,
        )
        return pipeline

    # -- requests ---------------------------------------------------------------------------------------

    @property
    def guidance_distilled(self) -> bool:
        """fast / turbo: guidance enters the DiT as an embedding, so no CFG branch runs."""
        return bool(self.model.guidance_embed)

    def octree_resolution(self, params: SamplingParams) -> int:
        return params.octree_resolution or self.settings.default_octree_resolution

    def request_facts(self) -> dict[str, Any]:
        """A mesh request is checked by `hunyuan3d/spec.check_hunyuan3d` alone, against the octree settings."""
        return {
            "replaces_common_checks": True,
            "default_octree_resolution": self.settings.default_octree_resolution,
            "max_octree_resolution": self.settings.max_octree_resolution,
        }

    def activation_facts(self) -> ActivationFacts:
        """A mesh's activation memory is the octree grid and one decoder chunk (`diffuserve/activation.py`)."""
        return ActivationFacts(
            kind="mesh",
            dtype_bytes=self.dtype.itemsize,
            chunk_size=self.settings.chunk_size,
            decoder_width=self.vae.geo_decoder.query_proj.out_features,
            default_octree_resolution=self.settings.default_octree_resolution,
            max_octree_resolution=self.settings.max_octree_resolution,
        )

    def sigmas(self, num_steps: int) -> torch.Tensor:
        if self.scheduler["kind"] == "ConsistencyFlowMatchEulerDiscreteScheduler":
            return conditioning.consistency_sigmas(
                num_steps,
                int(self.scheduler.get("num_train_timesteps", 1000)),
                int(self.scheduler.get("pcm_timesteps", 50)),
            )
        return conditioning.flow_sigmas(num_steps, float(self.scheduler.get("shift", 1.0)))

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "variant": self.variant,
            "scheduler": self.scheduler["kind"],
            "guidance_distilled": self.guidance_distilled,
            "mesh_settings": self.settings.__dict__,
            "volume_decoder": self.volume_decoder,
        }

    @property
    def volume_decoder(self) -> str:
        """The decode `settings.volume_decoder` resolves to: dense | flashvdm."""
        if self.settings.volume_decoder == "auto":
            consistency = self.scheduler["kind"] == "ConsistencyFlowMatchEulerDiscreteScheduler"
            return "flashvdm" if consistency else "dense"
        return self.settings.volume_decoder

    def run(
        self,
        batch: list[SamplingParams],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
        on_preview: PreviewCallback | None = None,
    ) -> BatchResult:
        """One DiT batch for every row of `batch`; previews are not made (a mesh has no cheap preview)."""
        stages: dict[str, float] = {}
        volume = self.volumes(batch, stages, on_step=on_step, should_stop=should_stop)
        # 5. Surface per row.
        started = time.perf_counter()
        resolution = self.octree_resolution(batch[0])
        meshes = [
            extract_surface(v, level=self.settings.mc_level, box=self.settings.box, resolution=resolution)
            for v in volume.cpu().numpy()
        ]
        stages["marching_cubes"] = time.perf_counter() - started
        outputs, row = [], 0
        for params in batch:
            outputs.append(RequestOutput(meshes=meshes[row : row + params.n]))
            row += params.n
        return BatchResult(outputs=outputs, stage_seconds=stages)

    def volumes(
        self,
        batch: list[SamplingParams],
        stages: dict[str, float],
        *,
        on_step: StepCallback | None = None,
        should_stop: StopCheck | None = None,
    ) -> torch.Tensor:
        """Steps 1-4 of the recipe: the occupancy volume of every output row, (rows, res+1, res+1, res+1)
        (FlashVDM: a side of its finest level + 1, NaN where it queried nothing)."""
        head = check_batch(batch)

        def timed(name: str, started: float) -> None:
            stages[name] = stages.get(name, 0.0) + time.perf_counter() - started

        def check_stop() -> None:
            if should_stop is not None and should_stop():
                raise RequestCancelledError("the request was cancelled")

        # 1. Condition: each request's image, once per output row.
        started = time.perf_counter()
        images = torch.cat(
            [
                conditioning.preprocess(p.image_inputs[0], self.image_size, self.border_ratio)
                for p in batch
                for _ in range(p.n)
            ]
        )
        with torch.inference_mode(), self.residency.use("conditioner"):
            cond = self.conditioner(images).to(self.dtype)
            use_cfg = not self.guidance_distilled
            if use_cfg:
                cond = torch.cat([cond, self.conditioner.unconditional(cond.shape[0]).to(self.dtype)])
        timed("encode", started)
        # 2. Noise: row j of a request from its own generator (seed + j).
        latents = batch_noise(batch, self.vae.latent_shape, device=self.device, dtype=self.dtype)
        # 3. Denoise.
        started = time.perf_counter()
        latents = self._denoise(latents, cond, head, use_cfg, on_step, check_stop)
        timed("denoise", started)
        # 4. Volume decode on the octree grid, in chunks.
        started = time.perf_counter()
        resolution = self.octree_resolution(head)
        with torch.inference_mode(), self.residency.use("vae"):
            decoded = self.vae(latents / self.vae.scale_factor)
            decode = flashvdm_decode if self.volume_decoder == "flashvdm" else decode_volume
            extra: dict[str, Any] = {}
            if decode is flashvdm_decode:
                extra = {"level": self.settings.mc_level, "min_resolution": self.settings.flashvdm_min_resolution}
            volume = decode(
                decoded,
                self.vae.geo_decoder,
                bounds=self.settings.box,
                resolution=resolution,
                chunk_size=self.settings.chunk_size,
                on_chunk=check_stop,
                **extra,
            )
        timed("volume_decode", started)
        return volume

    def _denoise(
        self,
        latents: torch.Tensor,
        cond: torch.Tensor,
        head: SamplingParams,
        use_cfg: bool,
        on_step: StepCallback | None,
        check_stop: Any,
    ) -> torch.Tensor:
        """The reference's flow-matching loop: sigma runs 0 -> 1, x += (sigma_next - sigma) * v."""
        steps = head.num_inference_steps
        sigmas = self.sigmas(steps)
        timesteps = sigmas[:-1] * 1000
        rows = latents.shape[0]
        guidance = None if use_cfg else torch.full((rows,), head.guidance_scale, device=self.device, dtype=self.dtype)
        with torch.inference_mode(), self.residency.use("model"):
            for i in range(steps):
                check_stop()
                model_in = torch.cat([latents, latents]) if use_cfg else latents
                t = timesteps[i].expand(model_in.shape[0]).to(self.device, dtype=latents.dtype) / 1000
                pred = self.model(model_in, t, cond, guidance=guidance)
                if use_cfg:
                    cond_pred, uncond_pred = pred.chunk(2)
                    pred = uncond_pred + head.guidance_scale * (cond_pred - uncond_pred)
                latents = (latents.float() + (sigmas[i + 1] - sigmas[i]) * pred).to(pred.dtype)
                if on_step is not None:
                    on_step(i, steps)  # the step index, as every pipeline (StepCallback)
        return latents
