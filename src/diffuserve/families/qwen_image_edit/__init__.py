"""Qwen-Image-Edit and Qwen-Image-Edit 2509/2511: `adapter.py` (the native pipeline on the shared recipe; imported
lazily by the loader), `tiny.py` (its `make-tiny` builders). Its static facts are its spec,
`family_spec/qwen_image_edit.py` (torch-free)."""
