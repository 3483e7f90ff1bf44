"""Image families served by the diffusers backend (GLM-Image, ERNIE-Image, Qwen-Image-Layered): `spec.py` (every static
fact, torch-free: `diffuserve plan` and `--help` import it), `tiny.py` (its `make-tiny` builders).

Nothing is imported here, so reading the spec never imports torch."""
