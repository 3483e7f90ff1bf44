"""The family plug-ins, one folder each: `families/<family>/adapter.py` (its native adapter on the recipe of
`pipelines/`, with its helpers: ControlNet rows, inpaint starts, maths) and `tiny.py` (its `make-tiny` builders, on the
shared helpers of `models/tiny.py`). The loader and `make-tiny` import them by the name a spec gives
(`native_adapter`, `tiny_builds`).

What a family *is* (its spec, a checkpoint's facts, the registry) is the leaf package `diffuserve.family_spec`, which
imports nothing from here. Nothing is imported here either: importing one family's adapter loads only its own folder.
"""
