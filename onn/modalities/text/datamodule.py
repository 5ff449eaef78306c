"""Prompt/answer records -> token batches for Lightning, with loss on the answer tokens only.

Training order is an endless shuffled stream that is a pure function of (seed, position), and
the loader starts at position `global_step x batch_size`: a run resumed from a
checkpoint sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from onn.errors import UserError
from onn.modalities.text.sources import load_splits

IGNORE = -100


def to_examples(records: list[dict[str, Any]], data_cfg: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """(prompt, answer) pairs from records, by the field mapping and template of the data config."""
    fields = data_cfg.get("fields") or {"input": "input", "output": "output"}
    template = data_cfg.get("template") or "{input}"
    in_key, out_key = fields["input"], fields["output"]
    examples = []
    for i, record in enumerate(records, 1):
        if in_key not in record and set(record) == {"text"}:
            examples.append(("", str(record["text"])))  # plain text: learn every token
            continue
        for key, role in ((in_key, "input"), (out_key, "output")):
            if key not in record:
                raise UserError(
                    f"{where} row {i} has no field '{key}' (data.fields.{role}); its fields are {sorted(record)}. "
                    f"Map yours with data.fields.{role}=NAME."
                )
        try:
            prompt = template.format_map({**record, "input": record[in_key]})
        except KeyError as e:
            raise UserError(f"data.template names the field {e} that {where} row {i} does not have.") from e
        examples.append((prompt, str(record[out_key])))
    return examples


def encode(tokenizer, prompt: str, answer: str, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids and labels (prompt positions ignored), truncated from the prompt's left so the answer survives."""
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else _bos(tokenizer)
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    answer_ids = answer_ids[: max_length - 1]
    prompt_ids = prompt_ids[max(0, len(prompt_ids) + len(answer_ids) - max_length) :]
    return prompt_ids + answer_ids, [IGNORE] * len(prompt_ids) + answer_ids


def _bos(tokenizer) -> list[int]:
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


def extract_answer(text: str, pattern: str | None) -> str:
    """The part of an answer that exact match compares: the pattern's group 1, numbers normalised."""
    if pattern:
        match = re.search(pattern, text)
        text = match.group(1) if match else ""
    text = text.strip().split("\n")[0].strip().rstrip(".")
    number = text.replace(",", "")
    try:
        value = float(number)
        return str(int(value)) if value == int(value) else str(value)
    except ValueError:
        return text


class Collator:
    """Pad a list of (ids, labels) to the longest in the batch."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, lab) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(lab)] = torch.tensor(lab)
            mask[row, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


class ResumableShuffle(Sampler[int]):
    """An endless stream of seeded permutations of range(n), starting at sample `start()`."""

    def __init__(self, n: int, seed: int, start: Callable[[], int]):
        self.n, self.seed, self.start = n, seed, start

    def __iter__(self) -> Iterator[int]:
        position = self.start()
        epoch, offset = divmod(position, self.n)
        while True:
            order = torch.randperm(
                self.n, generator=torch.Generator().manual_seed(self.seed + epoch)
            ).tolist()
            yield from order[offset:]
            epoch, offset = epoch + 1, 0


class TextDataModule(L.LightningDataModule):
    def __init__(self, data_cfg: dict[str, Any], tokenizer, batch_size: int, seed: int = 0):
        super().__init__()
        self.cfg, self.tokenizer, self.batch_size, self.seed = data_cfg, tokenizer, batch_size, seed
        self.train_examples: list[tuple[str, str]] = []
        self.val_examples: list[tuple[str, str]] = []

    def setup(self, stage: str | None = None) -> None:
        if self.train_examples:
            return
        train, val = load_splits(self.cfg, self.seed)
        self.train_examples = to_examples(train, self.cfg, str(self.cfg["source"]))
        self.val_examples = to_examples(val, self.cfg, str(self.cfg.get("val_source") or self.cfg["source"]))
        max_length = int(self.cfg["max_length"])
        self.train_set = [encode(self.tokenizer, p, a, max_length) for p, a in self.train_examples]
        self.val_set = [encode(self.tokenizer, p, a, max_length) for p, a in self.val_examples]

    def _start_sample(self) -> int:
        trainer = self.trainer
        return trainer.global_step * self.batch_size if trainer else 0

    def train_dataloader(self) -> DataLoader:
        sampler = ResumableShuffle(len(self.train_set), self.seed, self._start_sample)
        return DataLoader(
            self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=Collator(self.tokenizer.pad_token_id),
            num_workers=int(self.cfg["num_workers"]),
        )  # fmt: skip

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=Collator(self.tokenizer.pad_token_id),
        )

    @property
    def max_answer_tokens(self) -> int:
        return max(sum(1 for t in labels if t != IGNORE) for _, labels in self.val_set)
