"""Graphs: graph and node classification through torch_geometric (the modality in modality.py)."""

from onn.modalities.graph.modality import GraphModality
from onn.modalities.registry import register

__all__ = ["GraphModality"]

register(GraphModality())
