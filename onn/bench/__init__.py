"""Benchmarks as tasks app runs: their registry (registry.py) and one module per benchmark."""

from onn.bench.registry import TASKS

__all__ = ["TASKS"]
