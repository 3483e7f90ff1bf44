"""Run in its OWN process with the reference package `hy3dgen` 2.0.2 (installed --no-deps into a temp folder) and
the torchvision stand-in on sys.path: the reference shape pipeline on the tiny checkpoint, for one image and seed.

argv: checkpoint subfolder, PNG path, preprocessed-image .npy (ours, fed to both so the models are compared on the
same input), seed, steps, guidance, octree resolution, output .npz, the stand-ins' folder, and optionally `flashvdm`
and its `min_resolution` (the volume decoded by the reference's FlashVDM decoder, its `mean` top-k mode, and plain
marching cubes).
"""

import sys

import numpy as np
import torch
from PIL import Image

folder, png, ours_npy, seed, steps, guidance, octree, out, stubs = sys.argv[1:10]
flashvdm = sys.argv[10:11] == ["flashvdm"]
extra = {"min_resolution": int(sys.argv[11])} if flashvdm else {}

# transformers decides once whether torchvision exists: load the classes the reference needs before the
# stand-in goes on the path, so transformers never tries the stand-in for its own image utilities.
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection, Dinov2Config, Dinov2Model  # noqa: E402, F401

sys.path.insert(0, stubs)
from hy3dgen.shapegen import Hunyuan3DDiTFlowMatchingPipeline  # noqa: E402

pipe = Hunyuan3DDiTFlowMatchingPipeline.from_single_file(
    f"{folder}/model.fp16.safetensors", f"{folder}/config.yaml", device="cpu", dtype=torch.float32, use_safetensors=True
)
own = pipe.image_processor(Image.open(png))["image"].numpy()
ours = torch.from_numpy(np.load(ours_npy))
pipe.image_processor = lambda image, **_: {"image": ours, "mask": torch.zeros_like(ours[:, :1])}
latents = pipe(
    image=Image.open(png),
    num_inference_steps=int(steps),
    guidance_scale=float(guidance),
    generator=torch.Generator().manual_seed(int(seed)),
    octree_resolution=int(octree),
    output_type="latent",
    enable_pbar=False,
)
if flashvdm:
    # What `pipe.enable_flashvdm(replace_vae=False)` sets (that method also swaps in a turbo VAE from the Hub).
    pipe.vae.enable_flashvdm_decoder(enabled=True, adaptive_kv_selection=True, topk_mode="mean", mc_algo="mc")
decoded = pipe.vae(latents / pipe.vae.scale_factor)
volume = pipe.vae.volume_decoder(
    decoded,
    pipe.vae.geo_decoder,
    bounds=1.01,
    num_chunks=8000,
    mc_level=0.0,
    octree_resolution=int(octree),
    enable_pbar=False,
    **extra,
)
mesh = pipe.vae.surface_extractor(volume, mc_level=0.0, bounds=1.01, octree_resolution=int(octree))[0]
np.savez(
    out,
    own_image=own,
    latents=latents.numpy(),
    volume=volume.numpy(),
    vertices=mesh.mesh_v,
    faces=mesh.mesh_f[:, ::-1].copy(),
)
