"""Micro-batching and out-of-memory back-off: a macro-batch (one optimizer step) split into micro-batches
whose gradients accumulate, so a step that runs out of memory can retry with smaller pieces and
still make the same update."""

from __future__ import annotations

import torch

from onn.errors import UserError


class OutOfMemoryFloor(UserError):
    """Out of memory even at the smallest micro-batch allowed."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's failure (a RuntimeError)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def split(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """A right-padded macro-batch as micro-batches of `size` rows, each cut to its own longest row."""
    pieces = []
    for start in range(0, batch["input_ids"].shape[0], size):
        piece = {k: v[start : start + size] for k, v in batch.items()}
        width = int(piece["attention_mask"].sum(1).max()) if "attention_mask" in piece else None
        pieces.append({k: v[:, :width] for k, v in piece.items()} if width else piece)
    return pieces
