"""3D meshes: classification of shapes and point clouds (the modality in modality.py)."""

from onn.modalities.mesh.modality import MeshModality
from onn.modalities.registry import register

__all__ = ["MeshModality"]

register(MeshModality())
