"""Benchmarks: measured speed and memory, with the planner's predictions beside them."""
