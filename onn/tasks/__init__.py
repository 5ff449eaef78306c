"""The tasks app runs, by name (registry.py), and task=serve (serve/)."""

from onn.tasks.registry import TASKS, Task

__all__ = ["TASKS", "Task"]
