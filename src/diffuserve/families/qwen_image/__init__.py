"""Qwen-Image, Qwen-Image 2512 and Qwen-Image 2.1: `adapter.py` (the native pipeline on the shared recipe; imported
lazily by the loader), `tiny.py` (its `make-tiny` builders). Its static facts are its spec, `family_spec/qwen_image.py`
(torch-free)."""
