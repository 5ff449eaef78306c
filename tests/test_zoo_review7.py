"""Review of the zoo's small models: the text encoder's padding mask is the keys' [B, L] row, which attention
broadcasts, not a [B * heads, L, L] copy (1 GB at batch 256 and 512 tokens)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onn.models.zoo.text_encoder import PAD_ID, TextEncoder


class LargestTensor(TorchDispatchMode):
    """The most bytes any one tensor an op made held (storage bytes: an expanded view costs what it points at)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                self.most = max(self.most, value.untyped_storage().nbytes())
        return out


def padded_ids(batch: int, length: int) -> torch.Tensor:
    ids = torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(0))
    ids[:, length * 3 // 4 :] = PAD_ID
    ids[0, 3:] = PAD_ID
    return ids


def test_text_encoder_holds_no_square_mask_per_head():
    torch.manual_seed(0)
    batch, length, heads = 8, 128, 4
    encoder = TextEncoder(out_features=8, max_length=length, width=32, layers=2, heads=heads).eval()
    largest = LargestTensor()
    with torch.no_grad(), largest:
        encoder(padded_ids(batch, length))
    square_per_head = batch * heads * length * length * 4
    assert largest.most < square_per_head / 2, (largest.most, square_per_head)


def test_text_encoder_padding_is_ignored():
    """Pad tokens change nothing: a text padded to 128 gives the features it gives padded to 16, in training's
    arithmetic (dropout off) and in evaluation's."""
    torch.manual_seed(0)
    encoder = TextEncoder(out_features=8, max_length=128, width=32, layers=2, heads=4, dropout=0.0)
    ids = padded_ids(4, 128)[:, :16]
    ids[:, 12:] = PAD_ID
    longer = torch.full((4, 128), PAD_ID)
    longer[:, :16] = ids
    for training in (True, False):
        encoder.train(training)
        with torch.no_grad():
            torch.testing.assert_close(encoder(longer), encoder(ids), rtol=1e-5, atol=1e-5)
