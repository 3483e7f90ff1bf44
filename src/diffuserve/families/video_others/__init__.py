"""Video families served by the diffusers backend (HunyuanVideo, LTX, Helios): `spec.py` (every static fact, torch-free:
`diffuserve plan` and `--help` import it), `tiny.py` (its `make-tiny` builders).

Nothing is imported here, so reading the spec never imports torch."""
