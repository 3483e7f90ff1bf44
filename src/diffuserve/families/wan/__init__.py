"""Wan2.1 / Wan2.2 text-to-video and Wan image-to-video: `adapter.py` (the native pipeline on the shared recipe;
imported lazily by the loader), `tiny.py` (its `make-tiny` builders). Its static facts are its spec,
`family_spec/wan.py` (torch-free)."""
