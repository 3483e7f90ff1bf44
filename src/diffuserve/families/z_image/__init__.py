"""Z-Image and Z-Image-Turbo: `adapter.py` (the native pipeline on the shared recipe; imported lazily by the loader),
`tiny.py` (its `make-tiny` builders). Its static facts are its spec, `family_spec/z_image.py` (torch-free)."""
