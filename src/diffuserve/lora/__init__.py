"""Per-request LoRA: adapters read through diffusers' own loaders (`files.py`), stacked into per-layer slots that
compute each row's own adapters inside one batched call (`layers.py`), and random test adapters (`tiny.py`)."""
