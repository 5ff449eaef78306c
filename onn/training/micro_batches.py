"""Micro-batching and out-of-memory back-off: a macro-batch (one optimizer step) split into micro-batches
whose gradients accumulate, so a step that runs out of memory can retry with smaller pieces and
still make the same update."""

from __future__ import annotations

import torch

from onn.errors import UserError


class OutOfMemoryFloor(UserError):
    """Out of memory even at the smallest micro-batch allowed."""


def split(
    batch: dict[str, torch.Tensor], size: int, host_rows: tuple[list[int], list[int]] | None = None
) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    """A right-padded macro-batch as micro-batches of `size` rows, each cut to its own longest row, and each
    micro-batch's target tokens. `host_rows`: every row's length and target tokens as the host counted them
    before the batch went to the device (else they are read from the batch, which waits for the device)."""
    if host_rows is None or len(host_rows[0]) != batch["input_ids"].shape[0]:
        lengths = batch["attention_mask"].sum(1).tolist() if "attention_mask" in batch else None
        targets = (batch["labels"][:, 1:] != -100).sum(1).tolist()
    else:
        lengths, targets = host_rows
    pieces, counts = [], []
    for start in range(0, batch["input_ids"].shape[0], size):
        piece = {k: v[start : start + size] for k, v in batch.items()}
        width = int(max(lengths[start : start + size])) if lengths is not None else None
        pieces.append({k: v[:, :width] for k, v in piece.items()} if width else piece)
        counts.append(int(sum(targets[start : start + size])))
    return pieces, counts
