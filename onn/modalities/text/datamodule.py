"""Prompt/answer records -> token batches for Lightning, with loss on the answer tokens only.

Resident data: training order is an endless shuffled stream that is a pure function of (seed, position),
and the loader starts at position `global_step x batch_size`: a run resumed from a checkpoint sees exactly
the batches the uninterrupted run would have seen. Streamed data (data.streaming, a file larger than
memory; onn/modalities/text/streaming.py): epochs of a buffer-shuffled stream whose position travels in
the checkpoint, with the same guarantee.

With several processes (DDP), data.batch_size stays the global batch: each process takes its own
contiguous slice of every global batch from the same stream (RankSlice), so the processes together
see exactly what one process would, and the held-out set is split between them.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from onn.config.data import TextData
from onn.data.files import same_path
from onn.data.resident import epoch_generator
from onn.errors import UserError
from onn.modalities.text.formats import Records, read_records
from onn.modalities.text.prompts import Prompter, Split, answered, has_answer, no_answer, say_left_out
from onn.modalities.text.sources import held_out, load_splits, record_share
from onn.modalities.text.stream_loader import ShuffledStream, batches_per_epoch, own_generator, stream_loader
from onn.modalities.text.streaming import VAL_MAX, HeldOutDraws, open_reader, streaming_choice

log = logging.getLogger("onn")
IGNORE = -100
HOST_ROWS = "onn_host_rows"  # batch key: each row's length and target tokens, counted on the host
LAYOUT_SAMPLE = 200  # streamed data: the layout (data.fields: auto) is recognised on this many first records


def encode(
    tokenizer,
    prompt: str,
    answer: str,
    max_length: int,
    special_tokens: bool = True,
    answer_end: Sequence[int] = (),
    bos: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids and labels (prompt positions ignored), truncated from the prompt's left so the answer survives.
    `special_tokens`: add the tokenizer's own (BOS); off for a chat-templated prompt, which carries its own.
    `answer_end`: the tokens that end the answer (Prompter.answer_end: what a chat template writes after an
    assistant's turn); empty: the tokenizer's EOS. `bos`: BOS before the prompt (Prompter.starts_with_bos)."""
    return encode_counted(tokenizer, prompt, answer, max_length, special_tokens, answer_end, bos)[:2]


def encode_counted(
    tokenizer,
    prompt: str,
    answer: str,
    max_length: int,
    special_tokens: bool = True,
    answer_end: Sequence[int] = (),
    bos: bool = False,
) -> tuple[list[int], list[int], int]:
    """`encode`'s ids and labels, and how many tokens the example had before it was cut to max_length. A prompt is
    encoded as generation encodes it (prompt_ids): a plain-text model's held-out question gets BOS, as infer gives."""
    prompt_tokens = example_prompt_ids(tokenizer, prompt, special_tokens, bos)
    end = list(answer_end) or [end_of_text(tokenizer)]
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + end
    whole = len(prompt_tokens) + len(answer_ids)
    answer_ids = answer_ids[: max_length - 1]
    prompt_tokens = prompt_tokens[max(0, len(prompt_tokens) + len(answer_ids) - max_length) :]
    return prompt_tokens + answer_ids, [IGNORE] * len(prompt_tokens) + answer_ids, whole


def prompt_ids(tokenizer, text: str, add_special_tokens: bool = True, bos: bool = False) -> list[int]:
    """A prompt's token ids as training encoded its kind: with `bos` (a model that learned plain text), BOS and the
    text's own tokens, as encode began every text; else with the tokenizer's special tokens or none. Training,
    eval and generation (generate.prompt_ids) all encode prompts here."""
    if bos:
        return bos_ids(tokenizer) + tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def example_prompt_ids(tokenizer, prompt: str, special_tokens: bool, bos: bool) -> list[int]:
    """An example's prompt tokens as training lays them before its answer: `prompt_ids`, or BOS alone for plain
    text (no prompt). What a benchmark's held-out prompts (bench/giant.py) are built by, so they match training."""
    return prompt_ids(tokenizer, prompt, special_tokens, bos) if prompt else bos_ids(tokenizer)


def end_of_text(tokenizer) -> int:
    """The tokenizer's EOS, which ends an answer that no chat template ends."""
    if tokenizer.eos_token_id is None:  # [..., None] was torch.tensor's TypeError in collate
        raise UserError(
            f"the tokenizer ({type(tokenizer).__name__}) has no end-of-sequence token, which ends every answer: give "
            "it an eos_token (its tokenizer_config.json), or set model.tokenizer to another (`byte` or a folder)."
        )
    return tokenizer.eos_token_id


def encode_all(
    tokenizer,
    examples: list[tuple[str, str]],
    where: list[str],
    max_length: int,
    special_tokens: bool,
    key: str,
    answer_end: Sequence[int] = (),
    bos: bool = False,
) -> list[tuple[list[int], list[int]]]:
    """Every example encoded; those longer than max_length (cut as `encode` cuts them) are said in one warning,
    with the longest and where it is."""
    encoded, cut, longest = [], 0, (0, "")
    for (prompt, answer), place in zip(examples, where):
        ids, labels, whole = encode_counted(tokenizer, prompt, answer, max_length, special_tokens, answer_end, bos)
        encoded.append((ids, labels))
        cut += whole > max_length
        longest = max(longest, (whole, place))
    if cut:
        log.warning(
            "data: %d of %d records of %s are longer than data.max_length=%d tokens (the longest, %s, has %d): "
            "each is cut to max_length, its prompt from the left, then its answer's end. Raise data.max_length to "
            "keep them whole (with a recurrent model, task.tbptt_steps keeps the memory of a long sequence a "
            "chunk's).",
            cut,
            len(examples),
            key,
            max_length,
            longest[1],
            longest[0],
        )
    return encoded


def bos_ids(tokenizer) -> list[int]:
    """BOS, which begins every plain-text sample (and a typed prompt for a model that learned plain text)."""
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []


# A number as GSM8K-style answers write it: a sign, "$", a mixed number (7 1/2), a fraction (3/4), or digits with
# commas only as thousands separators (1,000; so "1.000" is 1 and "3,4,5" three numbers) and a decimal part, or a
# decimal part alone (.5; not after a letter or a dot: "No.4" is 4), then "%". Not after a digit or "/" ("5-10" is
# a range ending at 10, not -10; "12.5/0" holds no second number).
NUMBER = re.compile(
    r"(?<![\d/])(?P<sign>[-+])?\$?"
    r"(?:(?:(?P<whole>\d+) +)?(?P<num>\d+)/(?P<den>0*[1-9]\d*)"
    r"|(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)?(?P<dec>(?(int)(?:\.\d+)?|(?<![\w.])\.\d+)))%?"  # .5: a decimal part alone
)
DECIMALS = 6  # numbers compare as their value rounded to this many decimals: 1/3 matches 0.333333


def extract_answer(text: str, pattern: str | None, last_number: bool = False) -> str:
    """The part of an answer that exact match compares (see `extract`)."""
    return extract(text, pattern, last_number)[0]


def extract(text: str, pattern: str | None, last_number: bool = False) -> tuple[str, str]:
    """(answer, how it was found). With a pattern, its group 1 ("pattern") at the first match where group 1 took
    part (an optional group, or one side of `a|b`, may not: its None was an AttributeError after the whole
    evaluation); where the pattern is not found and `last_number`, the last NUMBER in the text ("last number",
    lm-evaluation-harness' flexible extract); without a pattern, the first line ("first line"). An answer that is
    one NUMBER is its value written one way (`number_text`), so answers compare as values, not as strings:
    18.50 = 18.5, $1,234.00 = 1234, 50% = 50, 7 1/2 = 7.5."""
    how = "first line"
    if pattern:
        match = next((m for m in re.finditer(pattern, text) if m.group(1) is not None), None)
        if match:
            text, how = match.group(1), "pattern"
        elif last_number and (numbers := [m.group() for m in NUMBER.finditer(text)]):
            text, how = numbers[-1], "last number"
        else:
            text, how = "", "not found"
    text = text.strip().split("\n")[0].strip().rstrip(".")
    number = NUMBER.fullmatch(text.rstrip(","))
    return (number_text(number) if number else text), how


def number_text(number: re.Match) -> str:
    """A NUMBER's value (exact, as a Fraction, so no float rounding) rounded to DECIMALS and written without
    trailing zeros: equal values give equal text, which is what exact match compares."""
    if number["den"]:
        value = int(number["whole"] or 0) + Fraction(int(number["num"]), int(number["den"]))
    else:
        value = Fraction((number["int"] or "0").replace(",", "") + number["dec"])
    scaled = round(value * 10**DECIMALS) * (-1 if number["sign"] == "-" else 1)
    whole, part = divmod(abs(scaled), 10**DECIMALS)
    decimals = f".{part:0{DECIMALS}d}".rstrip("0") if part else ""
    return f"{'-' if scaled < 0 else ''}{whole}{decimals}"


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


Examples = tuple[list[tuple[str, str]], list[str]]  # (prompt, answer) pairs and where each came from


def answered_splits(prompter: Prompter, cfg: TextData, seed: int) -> tuple[Examples, Examples]:
    """Resident (training, held-out) examples with every record whose answer is empty left out (prompts.answered).
    A split held out of data.source is drawn over its answered records by load_splits' rule (sources.held_out: a
    record is held out when its content's draw is under data.val_split), so an unanswered record drawn into the
    held-out share no longer leaves it empty and refuses a file that trains. bench_giant prompts by it, so it asks
    what training scores."""
    train, val = load_splits(cfg, seed)
    val_key = "data.val_source" if cfg.val_source else "data.source"
    if cfg.val_source or str(cfg.source).startswith("builtin:"):  # a held-out set of its own
        train_examples, val_examples = prompter.examples(train, "data.source"), prompter.examples(val, val_key)
        kept = answered(
            [
                Split(train_examples, train.where, "data.source", cfg.source, "training"),
                Split(val_examples, val.where, val_key, cfg.val_source or cfg.source, "validation"),
            ]
        )
        return kept[0], kept[1]
    # One file: its empty prompts are counted over all its records, not per split (the seed chose the verdict).
    records = Records(val + train, val.where + train.where)
    whole = prompter.examples(records, "data.source")
    [(examples, where)] = answered([Split(whole, records.where, "data.source", cfg.source, "training")])
    shares = [record_share(seed, r) for r, (_, answer) in zip(records, whole) if has_answer(answer)]
    if max(1, round(len(examples) * cfg.val_split)) >= len(examples):
        raise UserError(
            f"data.source {cfg.source} has {len(examples)} records with an answer: too few to hold out a validation "
            "split; add answered records, or give a held-out file as data.val_source."
        )
    kept, held = held_out(shares, cfg.val_split)
    return ([examples[i] for i in kept], [where[i] for i in kept]), (
        [examples[i] for i in held],
        [where[i] for i in held],
    )


class ResumableShuffle(Sampler[int]):
    """An endless stream of seeded permutations of range(n), starting at sample `start()`."""

    def __init__(self, n: int, seed: int, start: Callable[[], int]):
        self.n, self.seed, self.start = n, seed, start

    def __iter__(self) -> Iterator[int]:
        position = self.start()
        epoch, offset = divmod(position, self.n)
        while True:
            order = torch.randperm(self.n, generator=epoch_generator(self.seed, epoch)).tolist()
            yield from order[offset:]
            epoch, offset = epoch + 1, 0


class RankSlice(Sampler[int]):
    """This process's contiguous share of every global batch of `order` (the trainer's
    use_distributed_sampler is off: Lightning's DistributedSampler would reshuffle the order)."""

    def __init__(self, order: Sampler[int], global_batch: int, rank: int, world: int):
        self.order, self.global_batch, self.rank, self.world = order, global_batch, rank, world

    def __iter__(self) -> Iterator[int]:
        share = self.global_batch // self.world
        stream = iter(self.order)
        while True:
            batch = [next(stream) for _ in range(self.global_batch)]
            yield from batch[self.rank * share : (self.rank + 1) * share]


class TextDataModule(L.LightningDataModule):
    def __init__(
        self, data_cfg: TextData, tokenizer, batch_size: int, seed: int = 0, trained_layout: str | None = None
    ):
        """`trained_layout`: a checkpoint's prompt_layout (task=eval), so held-out prompts are built as the model
        learned them, not by the held-out file's own layout."""
        super().__init__()
        self.cfg, self.tokenizer, self.batch_size, self.seed = data_cfg, tokenizer, batch_size, seed
        self.prompter = Prompter(data_cfg, tokenizer, trained_layout)
        self.train_examples: list[tuple[str, str]] = []  # resident data only
        self.val_examples: list[tuple[str, str]] = []
        self.val_where: list[str] = []  # where each held-out example came from (file and line)
        self.train_where: list[str] = []
        self.train_set: list[tuple[list[int], list[int]]] | None = None  # encoded by setup, or when a loader asks
        self.train_records = 0
        self.stream: ShuffledStream | None = None  # streamed data (data.streaming)
        self.held_below = 0.0  # streamed data: a record drawn under this is held out (0: none, data.val_source)
        self.held_count = 0  # streamed data: the records held out (VAL_MAX of them kept for validation)
        self.cut_said = False  # whether a streamed record cut to data.max_length has been said
        self.val_is_train_said = False  # whether data.val_source naming data.source has been said (train_dataloader)

    def setup(self, stage: str | None = None) -> None:
        if self.train_examples or self.stream is not None:
            return
        streamed, reason = streaming_choice(self.cfg)
        log.info("%s", reason)
        if streamed:
            self._setup_streamed()
            return
        (self.train_examples, self.train_where), (self.val_examples, self.val_where) = answered_splits(
            self.prompter, self.cfg, self.seed
        )
        val_key = "data.val_source" if self.cfg.val_source else "data.source"
        self.train_records = len(self.train_examples)
        self.val_set = self._encode_all(self.val_examples, self.val_where, val_key)
        if stage != "validate":  # training reads them: their long records are said now, before the run starts
            self._encoded_train()

    def _encoded_train(self) -> list[tuple[list[int], list[int]]]:
        """The training examples encoded; setup("validate") (task=eval) leaves them for a loader that asks. An eval
        of data.source=FILE, which is also its held-out file, encoded FILE twice and warned of its long records
        twice."""
        if self.train_set is None:
            self.train_set = self._encode_all(self.train_examples, self.train_where, "data.source")
        return self.train_set

    def _encode_all(
        self, examples: list[tuple[str, str]], where: list[str], key: str
    ) -> list[tuple[list[int], list[int]]]:
        """`encode_all` with this datamodule's tokenizer, data.max_length and the prompter's layout of special
        tokens: one call for the training and held-out sets, resident or streamed, so they cannot drift apart."""
        prompter = self.prompter
        return encode_all(
            self.tokenizer,
            examples,
            where,
            self.cfg.max_length,
            prompter.add_special_tokens,
            key,
            prompter.answer_end,
            prompter.starts_with_bos,
        )

    def _setup_streamed(self) -> None:
        """The file read in order, training on its answered records but those held out: unless data.val_source is
        given, a record is held out by its content's draw, as a resident file's is (streaming.HeldOutDraws: at most
        VAL_MAX kept in memory for validation, and no held-out record trains). Records with an empty answer are
        counted in one pass here (so the epoch's length is exact) and skipped, as held-out ones are, by the
        stream's keep (`_trains`)."""
        cfg = self.cfg
        reader = open_reader(cfg.source, cfg.format)
        total = reader.count(reader.start)
        if not total:
            raise UserError(f"data.source {cfg.source} holds no records.")
        if not cfg.val_source:
            fraction = cfg.val_split
            if not 0 < fraction < 1:
                raise UserError(
                    f"data.val_split must be between 0 and 1 (got {fraction}) when data.val_source is not set."
                )
            if max(1, round(total * fraction)) >= total:
                raise UserError(
                    f"data.source {cfg.source} has {total} records: too few to hold out a validation split."
                )
        sample = list(itertools.islice(reader.records(reader.start), LAYOUT_SAMPLE))
        self.prompter.examples(Records([r for _, _, r, _ in sample], [w for _, _, _, w in sample]), "data.source")
        held, rows = self._scan(reader, total)
        val_key = "data.val_source" if cfg.val_source else "data.source"
        if cfg.val_source:
            val = read_records(cfg.val_source, cfg.format, key="data.val_source")
            examples = self.prompter.examples(val, val_key)
            [(self.val_examples, self.val_where)] = answered(
                [Split(examples, val.where, val_key, cfg.val_source, "validation")]
            )
        else:  # `_scan` held out answered records only
            self.val_examples, self.val_where = self.prompter.examples(held, val_key, check=False), held.where
        self.val_set = self._encode_all(self.val_examples, self.val_where, val_key)
        self.train_records = rows
        self.stream = ShuffledStream(
            reader, reader.start, rows, cfg.shuffle_buffer, self.seed, self._encode, self._trains, not cfg.val_source
        )
        held = (
            f"validating on data.val_source's {len(self.val_set)}"
            if cfg.val_source
            else f"{self.held_count} held out, {len(self.val_set)} of them validated on: at most {VAL_MAX} are kept"
        )
        log.info(
            "data: streaming %d training records from %s (%s), shuffle buffer %d",
            rows,
            cfg.source,
            held,
            self.stream.buffer,
        )

    def _scan(self, reader, total: int) -> tuple[Records, int]:
        """One pass over data.source: (the held-out records kept for validation, none with data.val_source; the
        answered records that train, which the stream keeps). Sets `held_below`, the draw under which a record is
        held out. The records whose answer is empty are said in one warning; a file left with no training record
        is refused."""
        cfg = self.cfg
        draws = None if cfg.val_source else HeldOutDraws(cfg.val_split, VAL_MAX)
        rows, places, blank = 0, [], 0
        for _, _, record, where in reader.records(reader.start):
            if not self._answered(record, where):
                blank += 1
                places += [where][: 3 - len(places)]
            elif draws is None:
                rows += 1
            else:
                draws.add(record_share(self.seed, record), record, where)
        held = Records()
        if draws is not None:
            self.held_below, rows = draws.cut()
            held = Records(*draws.kept(self.held_below))
            self.held_count = draws.seen - rows
        # too few answered records to hold some out (as a resident read counts them), or a few identical ones
        if not rows or (draws is not None and (not held or max(1, round(draws.seen * cfg.val_split)) >= draws.seen)):
            if blank == total:
                raise no_answer("data.source", str(cfg.source), total, "training")
            raise UserError(
                f"data.source {cfg.source} has {total - blank} records with an answer: too few to hold out a "
                "validation split and train on the rest; add answered records, or give data.val_source."
            )
        say_left_out("data.source", str(cfg.source), places, blank, total)
        return held, rows

    def _trains(self, record: dict[str, Any], where: str) -> bool:
        """ShuffledStream's keep: a streamed record with an answer whose draw is not held out (`_scan`)."""
        return self._answered(record, where) and (
            not self.held_below or record_share(self.seed, record) >= self.held_below
        )

    def _answered(self, record: dict[str, Any], where: str) -> bool:
        """Whether a streamed record has an answer to train on (`_trains`, and `_scan`'s count)."""
        return has_answer(self.prompter.answer(record, where))

    def _encode(self, record: dict[str, Any], where: str) -> tuple[list[int], list[int]]:
        """A streamed record's tokens, cut to data.max_length as a held record is; the first one cut is said once
        (in each loader worker): a streamed file has no pass that counts them, and was cut without a word."""
        prompter, max_length = self.prompter, self.cfg.max_length
        prompt, answer = prompter.example(record, where)
        special, end = prompter.add_special_tokens, prompter.answer_end
        ids, labels, whole = encode_counted(
            self.tokenizer, prompt, answer, max_length, special, end, prompter.starts_with_bos
        )
        if whole > max_length and not self.cut_said:
            self.cut_said = True
            log.warning(
                "data: %s has %d tokens, more than data.max_length=%d: it and every streamed record this long is "
                "cut, its prompt from the left, then its answer's end (said once). Raise data.max_length to keep "
                "them whole.",
                where,
                whole,
                max_length,
            )
        return ids, labels

    @property
    def steps_per_epoch(self) -> int | None:
        """Batches in one pass over streamed data; None for resident data (one endless shuffled stream)."""
        if self.stream is None:
            return None
        return batches_per_epoch(self.stream.rows, self.batch_size, self.cfg.num_workers)

    def _start_sample(self) -> int:
        trainer = self.trainer
        return trainer.global_step * self.batch_size if trainer else 0

    def _ranks(self) -> tuple[int, int]:
        """(this process's rank, processes): (0, 1) outside a multi-process run."""
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer else (0, 1)

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        """Each row's length and target tokens, counted on the host before the batch goes to the device (under
        HOST_ROWS, which the transfer leaves alone): the module cuts micro-batches by them without reading
        the device, which would make the host wait for the GPU every step."""
        if isinstance(batch, dict) and "attention_mask" in batch and "labels" in batch:
            targets = (batch["labels"][:, 1:] != IGNORE).sum(1).tolist()
            batch[HOST_ROWS] = (batch["attention_mask"].sum(1).tolist(), targets)
        return batch

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        """A layer-streamed model's held-out batches stay on the host: its validation_step only keeps them, and
        the engine moves them when it evaluates the whole set (a copy to the device and back would wait for the
        GPU at every batch). Here, not in CausalLM: Lightning warns when a module's batch hooks meet a datamodule."""
        trainer = self.trainer
        if trainer is not None and trainer.validating and trainer.lightning_module.engine is not None:
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _pins(self) -> bool:
        """Batches in pinned memory on a GPU run: Lightning copies them without waiting, where a copy from
        pageable memory can make the host wait for the GPU to reach it (the driver stages it)."""
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"

    def train_dataloader(self):
        rank, world = self._ranks()
        if self.cfg.val_source and same_path(self.cfg.val_source, self.cfg.source) and not self.val_is_train_said:
            self.val_is_train_said = True  # (task=eval sets data.val_source to data.source on purpose: trains nothing)
            log.warning(
                "data.val_source is data.source itself (%s): the model is scored on the records it trains on, so "
                "val/ figures measure memorising, not held-out quality; unset it to hold out data.val_split",
                self.cfg.source,
            )
        if self.batch_size % world:
            raise UserError(
                f"data.batch_size={self.batch_size} does not split evenly over {world} processes: "
                f"give a multiple of {world}."
            )
        collate = Collator(self.tokenizer.pad_token_id)
        if self.stream is not None:
            if world > 1:
                raise UserError(
                    "data.streaming runs in one process for now: set data.streaming=false, or trainer.devices=1."
                )
            return stream_loader(self.stream, self.batch_size, collate, self.cfg.num_workers, self._pins())
        train_set = self._encoded_train()
        sampler = ResumableShuffle(len(train_set), self.seed, self._start_sample)
        if world > 1:
            sampler = RankSlice(sampler, self.batch_size, rank, world)
        return DataLoader(
            train_set,
            batch_size=self.batch_size // world,
            sampler=sampler,
            collate_fn=collate,
            num_workers=self.cfg.num_workers,
            pin_memory=self._pins(),
            generator=own_generator(self.seed),
        )

    def val_dataloader(self) -> DataLoader:
        rank, world = self._ranks()
        return DataLoader(
            self.val_set[rank::world],  # each process scores its share; the loss is reduced over them
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=Collator(self.tokenizer.pad_token_id),
            # a layer-streamed model's held-out batches stay on the host (transfer_batch_to_device)
            pin_memory=self._pins() and self.trainer.lightning_module.engine is None,
            generator=own_generator(self.seed),
        )

    @property
    def max_answer_tokens(self) -> int:
        return max(sum(1 for t in labels if t != IGNORE) for _, labels in self.val_set)


class SampleTrace(L.Callback):
    """data.trace: every training step appends {"step", "samples": [each sample's text]} to a JSON-lines file,
    decoded from the batch the model trains on: what shows that a resumed run trains on the same samples."""

    def __init__(self, path: str, tokenizer):
        self.path, self.tokenizer = path, tokenizer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        texts = [
            self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"])
        ]
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": trainer.global_step, "samples": texts}) + "\n")
