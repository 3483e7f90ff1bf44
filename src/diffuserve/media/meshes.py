"""Encode a generated mesh (vertices, faces) as GLB (binary glTF) or Wavefront OBJ with trimesh."""

from __future__ import annotations

from typing import Any

MESH_FORMATS = {"glb": "model/gltf-binary", "obj": "text/plain"}
"""output_format -> the media type `GET /v1/meshes/{id}/content` answers with."""


def encode_mesh(vertices: Any, faces: Any, output_format: str) -> bytes:
    """The mesh as `glb` or `obj` bytes (trimesh merges duplicate vertices, as the reference's export does)."""
    import trimesh

    if output_format not in MESH_FORMATS:
        raise ValueError(f"output_format {output_format!r} is not one of {sorted(MESH_FORMATS)}")
    mesh = trimesh.Trimesh(vertices=vertices, faces=faces)
    data = mesh.export(file_type=output_format)
    return data.encode() if isinstance(data, str) else bytes(data)
