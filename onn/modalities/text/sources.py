"""Route data.source to the reader that understands it: `builtin:NAME` generators or text files."""

from __future__ import annotations

import random

from onn.config.data import TextData
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
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(records) * fraction))
    if n_val >= len(records):
        raise UserError(f"data.source {source} has {len(records)} records: too few to hold out a validation split.")
    return records.pick(order[n_val:]), records.pick(order[:n_val])
