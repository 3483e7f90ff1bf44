"""`Capabilities`: what a loaded pipeline can do, declared once (`Pipeline.capabilities`, from its class facts)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a loaded pipeline can do, declared once: the engine, the executor and the parallel strategies read
    these fields instead of probing the pipeline for attributes."""

    batching: bool = False
    """Requests may share a pipeline call (dynamic batching); False runs each alone."""
    continuous: bool = False
    """`--batching-mode continuous` may step its requests in a shared denoise group (`pipelines/step_batch.py`)."""
    packs_mixed_sizes: bool = False
    """Rows of different sizes may share one call (`FamilySpec.packs_mixed_sizes`): the size leaves the signatures."""
    strength_per_row: bool = False
    """Edits of different `strength` may share one call (`FamilySpec.strength_per_row`)."""
    continuous_key_fields: tuple[str, ...] = ()
    """`SamplingParams` fields the family adds to the continuous group key (`FamilySpec.continuous_key_fields`)."""
    defers_decode: bool = False
    """`run` is `run_to_latents` + `decode_batch`, so the decode may run in the decode lane beside the next batch."""
    text_prefetch: bool = False
    """Texts of queued requests may be encoded in the encode lane beside the running batch (`text_prefetch.py`)."""
    split_over_ranks: bool = False
    """A native denoising loop: tensor / sequence / FSDP parallel and CFG parallel can split it over ranks."""
    cfg_parallel: bool = False
    """The two CFG branches may run on two ranks (a native loop whose CFG is not one doubled batch)."""
