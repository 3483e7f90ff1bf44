"""HunyuanVideo 1.5 text-to-video and image-to-video: `spec.py` (every static fact, torch-free: `diffuserve plan` and
`--help` import it), `adapter.py` (the native pipeline on the shared recipe; imported lazily by the loader), `tiny.py`
(its `make-tiny` builders).

Nothing is imported here, so reading the spec never imports torch."""
