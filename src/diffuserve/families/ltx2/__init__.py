"""LTX-2 / LTX-2.3 joint audio-video (text-to-video and image-to-video): `spec.py` (every static fact, torch-free:
`diffuserve plan` and `--help` import it), `adapter.py` (the native pipeline on the shared recipe; imported lazily by
the loader), `tiny.py` (its `make-tiny` builder).

Nothing is imported here, so reading the spec never imports torch."""
