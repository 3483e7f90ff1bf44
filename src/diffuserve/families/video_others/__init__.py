"""Video families served by the diffusers backend (HunyuanVideo, LTX, Helios): `tiny.py` (its `make-tiny` builders). Its
static facts are its spec, `family_spec/video_others.py` (torch-free)."""
