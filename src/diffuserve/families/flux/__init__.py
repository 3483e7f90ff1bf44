"""FLUX.1 (dev, schnell) and FLUX.1 Kontext: `spec.py` (every static fact, torch-free: `diffuserve plan` and `--help`
import it), `adapter.py` (the native pipeline on the shared recipe; imported lazily by the loader).

Nothing is imported here, so reading the spec never imports torch."""
