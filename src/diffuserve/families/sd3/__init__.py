"""Stable Diffusion 3 / 3.5: `adapter.py` (the native pipeline on the shared recipe; imported lazily by the loader),
`tiny.py` (its `make-tiny` builders). Its static facts are its spec, `family_spec/sd3.py` (torch-free)."""
