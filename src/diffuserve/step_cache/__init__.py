"""Step caches that decide per row, beside `lora/`: `hooks.py` (the named hooks on a denoiser's blocks that narrow
a call to the rows that compute), `rows.py` (each row's history and the per-row policies), `packed.py` (packed
mixed-size calls). Settings in `config/step_cache.py`; each DiT's rules in its family spec (`step_cache_rules`)."""
