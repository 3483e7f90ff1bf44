"""SANA: `adapter.py` (the native pipeline on the shared recipe; imported lazily by the loader), `tiny.py` (its
`make-tiny` builders). Its static facts are its spec, `family_spec/sana.py` (torch-free)."""
