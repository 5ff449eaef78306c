"""Benchmarks as tasks app runs: their registry (registry.py) and one module per benchmark. Nothing is imported
here: a sweep's job process loads the grid callback (grid.py) without torch."""
