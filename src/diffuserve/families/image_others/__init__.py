"""Image families served by the diffusers backend (GLM-Image, ERNIE-Image, Qwen-Image-Layered): `tiny.py` (its
`make-tiny` builders). Its static facts are its spec, `family_spec/image_others.py` (torch-free)."""
