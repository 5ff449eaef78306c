"""Route data.source to the reader that understands it: `builtin:NAME` generators or text files."""

from __future__ import annotations

from typing import Any

from onn.errors import UserError
from onn.modalities.text import builtin as math_data
from onn.modalities.text.formats import read_records

BUILTINS = {"math": math_data.generate}


def load_splits(data_cfg: dict[str, Any], seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, validation records) for the data config."""
    source = str(data_cfg["source"])
    if source.startswith("builtin:"):
        name = source.split(":", 1)[1]
        if name not in BUILTINS:
            raise UserError(
                f"data.source {source}: no built-in dataset '{name}'; built-ins: {', '.join(BUILTINS)}."
            )
        opts = dict(data_cfg.get("builtin") or {})
        train_size, val_size = int(opts.pop("train_size", 4000)), int(opts.pop("val_size", 200))
        # Different seeds for the two splits keep validation problems out of training.
        return BUILTINS[name](train_size, seed=seed, **opts), BUILTINS[name](
            val_size, seed=seed + 1_000_003, **opts
        )

    fmt = data_cfg["format"]
    records = read_records(source, fmt)
    if data_cfg.get("val_source"):
        return records, read_records(data_cfg["val_source"], fmt, key="data.val_source")
    fraction = float(data_cfg["val_split"])
    if not 0 < fraction < 1:
        raise UserError(
            f"data.val_split must be between 0 and 1 (got {fraction}) when data.val_source is not set."
        )
    import random

    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(records) * fraction))
    if n_val >= len(records):
        raise UserError(
            f"data.source {source} has {len(records)} records: too few to hold out a validation split."
        )
    val = [records[i] for i in order[:n_val]]
    train = [records[i] for i in order[n_val:]]
    return train, val
