"""Route data.source to the reader that understands it: `builtin:NAME` generators or text files.

A file without data.val_source holds out each record whose draw (`record_share`: a hash of the seed and the
record's content) falls under data.val_split, as image, audio, video and mesh data hold out files by name: one seed
holds out the same records however many are appended or removed, so a resumed run or task=eval never validates on
records it trained on (a seeded shuffle of positions re-drew the whole split when a record was added)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from onn.config.data import TextData
from onn.data.labelled import same_text
from onn.data.resident import held_out_share
from onn.errors import UserError
from onn.modalities.text import builtin as math_data
from onn.modalities.text.formats import Records, read_records

BUILTINS = {"math": math_data.generate}


def load_splits(data_cfg: TextData, seed: int) -> tuple[Records, Records]:
    """(train records, validation records) for the data config; each record knows its file and line."""
    source = str(data_cfg.source)
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name not in BUILTINS:
            raise UserError(f"data.source {source}: no built-in dataset '{name}'; built-ins: {', '.join(BUILTINS)}.")
        opts = data_cfg.builtin
        if opts is None:
            raise UserError(
                f"data.source {source}: data.builtin is null, and it holds the generator's sizes; "
                f"data={name} has them (python run.py data={name})."
            )
        make = BUILTINS[name]
        # Different seeds for the two splits keep validation problems out of training.
        train = make(opts.train_size, seed=seed, max_operand=opts.max_operand, operations=opts.operations)
        records = Records(train, [f"{source} train item {i}" for i in range(len(train))])
        if data_cfg.val_source:  # a held-out file given (task=eval ckpt=RUN data.val_source=...) is what is scored
            return records, read_records(data_cfg.val_source, data_cfg.format, key="data.val_source")
        val = make(opts.val_size, seed=seed + 1_000_003, max_operand=opts.max_operand, operations=opts.operations)
        return records, Records(val, [f"{source} val item {i}" for i in range(len(val))])

    fmt = data_cfg.format
    records = read_records(source, fmt)
    if data_cfg.val_source:
        return records, read_records(data_cfg.val_source, fmt, key="data.val_source")
    fraction = data_cfg.val_split
    if not 0 < fraction < 1:
        raise UserError(f"data.val_split must be between 0 and 1 (got {fraction}) when data.val_source is not set.")
    if max(1, round(len(records) * fraction)) >= len(records):
        raise UserError(f"data.source {source} has {len(records)} records: too few to hold out a validation split.")
    train, val = held_out([record_share(seed, record) for record in records], fraction)
    return records.pick(train), records.pick(val)


def record_share(seed: int, record: dict[str, Any]) -> float:
    """A record's draw in [0, 1): held_out_share of its content (every field, keys sorted, in NFC), so its place
    in the file never matters and identical records share a draw (a duplicate is never in both splits). Hashed to
    hex first: held_out_share keeps a name's last two `/` parts, and a record's text holds slashes."""
    content = same_text(json.dumps(record, sort_keys=True, ensure_ascii=False, default=str))
    return held_out_share(seed, hashlib.blake2b(content.encode(), digest_size=16).hexdigest())


def held_out(shares: list[float], fraction: float) -> tuple[list[int], list[int]]:
    """(train, val) indices, each in draw order (a seeded order that appending records does not reshuffle): the
    records drawn under `fraction` are held out; at least one of at least two is held out (the lowest-drawn) and at
    least one trains (the highest-drawn), so a small file never gets an empty split. Records of one draw (copies
    of one record) go together: a cut moved onto them moves past them, so a copy is never in both splits."""
    order = sorted(range(len(shares)), key=shares.__getitem__)
    n_val = _between_draws([shares[i] for i in order], min(max(1, sum(s < fraction for s in shares)), len(shares) - 1))
    return order[n_val:], order[:n_val]


def _between_draws(drawn: list[float], cut: int) -> int:
    """`cut`, or the nearest place after it (else before it) where the sorted draws change."""
    places = [i for i in range(1, len(drawn)) if drawn[i - 1] != drawn[i]]
    if not places:
        raise UserError(
            f"data.source: its {len(drawn)} records are all one record, so none can be held out that does not "
            "also train; add other records, or give a held-out file as data.val_source."
        )
    return min((p for p in places if p >= cut), default=max(places))
