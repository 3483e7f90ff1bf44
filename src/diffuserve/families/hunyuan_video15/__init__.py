"""HunyuanVideo 1.5 text-to-video and image-to-video: `adapter.py` (the native pipeline on the shared recipe; imported
lazily by the loader), `tiny.py` (its `make-tiny` builders). Its static facts are its spec,
`family_spec/hunyuan_video15.py` (torch-free)."""
