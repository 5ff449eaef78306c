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
    before the batch went to the device (else they are read from the batch, which waits for the device).

    A micro-batch whose rows all fill it goes without its attention mask, to the same result: given one,
    transformers reads it back from the device at each call (create_causal_mask; on a GPU a wait for every kernel
    queued) to find no row padded before it attends causally, as it does unasked with no mask. That saves the
    read where the model keeps a cache in training (use_cache, no gradient checkpointing); without one,
    transformers reads the positions instead, to look for packed sequences."""
    if host_rows is None or len(host_rows[0]) != batch["input_ids"].shape[0]:
        lengths = batch["attention_mask"].sum(1).tolist() if "attention_mask" in batch else None
        targets = (batch["labels"][:, 1:] != -100).sum(1).tolist()
    else:
        lengths, targets = host_rows
    pieces, counts = [], []
    for start in range(0, batch["input_ids"].shape[0], size):
        piece = {k: v[start : start + size] for k, v in batch.items()}
        rows = lengths[start : start + size] if lengths is not None else None
        width = int(max(rows)) if rows else None
        if width:
            piece = {k: v[:, :width] for k, v in piece.items() if k != "attention_mask" or min(rows) < width}
        pieces.append(piece)
        counts.append(int(sum(targets[start : start + size])))
    return pieces, counts
