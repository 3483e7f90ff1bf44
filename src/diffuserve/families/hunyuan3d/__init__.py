"""Hunyuan3D-2 image-to-3D shape generation (Tencent's own layout, not a diffusers pipeline).

Its facts are in `family_spec/hunyuan3d.py` (no torch) and reading its release folder in
`family_spec/hunyuan3d_layout.py`; here `dit.py` / `vae.py` / `conditioning.py` / `flashvdm.py` are the models,
`adapter.py` the serving adapter (on the recipe layer's `pipelines.base`, as every family's adapter) and `tiny.py` the
tiny checkpoint builder.
"""
