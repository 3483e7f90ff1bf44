"""FLUX.1 (dev, schnell) and FLUX.1 Kontext: `adapter.py` (the native pipeline on the shared recipe; imported lazily by
the loader). Its static facts are its spec, `family_spec/flux.py` (torch-free)."""
