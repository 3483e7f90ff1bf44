"""LTX-2 / LTX-2.3 joint audio-video (text-to-video and image-to-video): `adapter.py` (the native pipeline on the shared
recipe; imported lazily by the loader), `tiny.py` (its `make-tiny` builder). Its static facts are its spec,
`family_spec/ltx2.py` (torch-free)."""
