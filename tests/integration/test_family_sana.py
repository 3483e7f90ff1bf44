"""SANA facts beyond the conformance suite (test_family_conformance.py: diffusers parity, merged rows,
continuous joins, residency, size limits, usage and the server)."""

from __future__ import annotations


def test_a_request_is_generated_at_its_resolution_bin(tiny_checkpoint, family_pipeline) -> None:
    native = family_pipeline(tiny_checkpoint("sana"))
    # sample_size 16 -> the 512 px bin table; a 64x64 request is generated at 512x512.
    assert native.adapter.generation_size(64, 64) == (512, 512)
