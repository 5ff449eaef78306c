"""Values as strict JSON holds them: Python writes a NaN or an infinity as the bare word NaN or Infinity, which
no strict reader (a browser's JSON.parse, jq, pandas' default engine) accepts. ONN's records, predictions and
completions write null in their place, at any depth."""

from __future__ import annotations

import math
from typing import Any


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float, in any list, tuple or dict within it, made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value
