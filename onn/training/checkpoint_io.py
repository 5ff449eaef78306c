"""Lightning's CheckpointIO over ONN's safetensors checkpoints (onn/training/checkpoints.py): no pickle, ever."""

from __future__ import annotations

import shutil
from typing import Any

from lightning.pytorch.plugins.io import CheckpointIO

from onn.training.checkpoints import load, save


class SafetensorsCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO interface over `save` / `load` above."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        save(checkpoint, path)

    def load_checkpoint(
        self, path, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load(path, map_location)

    def remove_checkpoint(self, path) -> None:
        shutil.rmtree(path, ignore_errors=True)
