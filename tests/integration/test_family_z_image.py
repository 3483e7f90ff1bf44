"""Z-Image facts beyond the conformance suite (test_family_conformance.py: diffusers parity, merged rows,
continuous joins, residency, the RoPE size limit, usage and the server)."""

from __future__ import annotations


def test_default_size_is_the_vae_sample_size(tiny_checkpoint, family_pipeline) -> None:
    native = family_pipeline(tiny_checkpoint("z-image"))
    assert native.defaults.width == native.defaults.height == 64  # the tiny VAE's sample_size
