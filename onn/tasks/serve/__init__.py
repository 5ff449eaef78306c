"""task=serve: an OpenAI-compatible HTTP API and a web page for a trained model (task.py: the parts)."""

from onn.tasks.serve.task import api_key, build_app, check, free_address, model_name, run

__all__ = ["api_key", "build_app", "check", "free_address", "model_name", "run"]
