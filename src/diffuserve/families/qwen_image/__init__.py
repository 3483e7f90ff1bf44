"""Qwen-Image, Qwen-Image 2512 and Qwen-Image 2.1: `spec.py` (every static fact, torch-free: `diffuserve plan` and
`--help` import it), `adapter.py` (the native pipeline on the shared recipe; imported lazily by the loader), `tiny.py`
(its `make-tiny` builders).

Nothing is imported here, so reading the spec never imports torch."""
