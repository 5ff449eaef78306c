"""The ONN zoo's small text encoder: byte tokens -> a tiny transformer -> one feature vector per text.

Made for the text side of a dual encoder (captions, descriptions, file names' words): ONN's byte
tokenizer (onn/models/tokenizer.py: ids 0-255 are bytes, then <bos> <eos> <pad>) needs no download,
and a few pre-norm transformer layers over the bytes, mean-pooled over the real (non-pad) tokens,
learn words from their letters. The blocks are an nn.ModuleList of identical layers, so LayerMap
discovery finds them.

Its positions are learned, max_length of them, so longer ids have no position to take. Texts are cut where they
are tokenized, with one warning (the pairs text side cuts each caption at data.sides.text.max_length, the
max_length it builds this encoder with); ids that reach the encoder longer than that are refused in one sentence,
not cut again here without a word.
"""

from __future__ import annotations

import torch
from torch import nn

from onn.errors import UserError

BYTE_VOCAB = 259  # 256 bytes + <bos> <eos> <pad>
PAD_ID = 258


class TextEncoder(nn.Module):
    """token ids [B, L] (PAD_ID after the text) -> features [B, out_features]."""

    def __init__(
        self,
        out_features: int = 128,
        max_length: int = 64,
        width: int = 64,
        layers: int = 2,
        heads: int = 4,
        dropout: float = 0.1,
        vocab_size: int = BYTE_VOCAB,
        pad_id: int = PAD_ID,
    ):
        super().__init__()
        if heads < 1 or width % heads:  # (nn.MultiheadAttention's own check is a bare assertion)
            raise ValueError(f"width={width} must split evenly into heads={heads}: give heads that divide width")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length={max_length!r}: give the most tokens a text has, 1 or more")
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, width, padding_idx=pad_id)
        self.position = nn.Parameter(torch.randn(max_length, width) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out_features)
        self.num_features = width

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        max_length = self.position.shape[0]
        if ids.shape[1] > max_length:  # the position table's own error said only "size of tensor a must match b"
            raise UserError(
                f"TextEncoder: ids of {ids.shape[1]} tokens are longer than its max_length={max_length}; cut them to "
                f"{max_length} where they are tokenized (the pairs text side cuts at data.sides.text.max_length) or "
                f"build it with max_length={ids.shape[1]} or more."
            )
        keep = ids != self.pad_id  # [B, L]; a text has at least one token (empty texts are skipped when read)
        x = self.embed(ids) + self.position[: ids.shape[1]]
        # padding as an additive float mask on the keys: attention broadcasts it as [B * heads, 1, L] (a
        # [B * heads, L, L] copy would take 1 GB at batch 256 and 512 tokens), and a float mask keeps the
        # same arithmetic in training, evaluation and the exported graph
        padding = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(~keep, float("-inf"))
        for block in self.blocks:
            x = block(x, src_key_padding_mask=padding)
        weights = keep.unsqueeze(-1).to(x.dtype)
        pooled = (self.norm(x) * weights).sum(1) / weights.sum(1).clamp_min(1)
        return self.head(pooled)
