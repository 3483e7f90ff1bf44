"""Hunyuan3D-2 image-to-3D shape generation (Tencent's own layout, not a diffusers pipeline).

`spec.py` holds the family facts (no torch), `layout.py` reads the release folder, `dit.py` / `vae.py` /
`conditioning.py` / `flashvdm.py` are the models, `adapter.py` the serving adapter (on the recipe layer's
`pipelines.base`, as every family's adapter) and `tiny.py` the tiny checkpoint builder.
"""

from diffuserve.family_spec.hunyuan3d import SPEC

__all__ = ["SPEC"]
