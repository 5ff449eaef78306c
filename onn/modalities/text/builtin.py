"""`builtin:math`: arithmetic word problems with exact answers, generated from a seed.

The same seed gives the same problems on every machine, so the default run needs no files and
its numbers are comparable between runs.
"""

from __future__ import annotations

import random
from typing import Any

from onn.errors import UserError

NAMES = [
    "Ava",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Gus",
    "Hana",
    "Ivan",
    "Jade",
    "Kofi",
    "Lena",
    "Mateo",
    "Nia",
    "Omar",
    "Priya",
]
ITEMS = ["apples", "marbles", "books", "stickers", "coins", "pencils", "cards", "shells", "stamps", "cookies"]

TEMPLATES = {
    "add": [
        "{n} has {a} {item} and gets {b} more. How many {item} does {n} have now?",
        "What is {a} + {b}?",
    ],
    "sub": [
        "{n} has {a} {item} and gives away {b}. How many {item} are left?",
        "What is {a} - {b}?",
    ],
    "mul": [
        "{n} buys {a} boxes with {b} {item} in each box. How many {item} does {n} buy?",
        "What is {a} * {b}?",
    ],
}


def check_options(max_operand: int, operations: list[str] | tuple[str, ...]) -> None:
    """data.builtin's generator settings, before any problem is drawn: a negative max_operand left random an empty
    range to draw from and no operations an empty list, each a traceback in the middle of loading the data."""
    if isinstance(max_operand, bool) or not isinstance(max_operand, int) or max_operand < 0:
        raise UserError(f"data.builtin.max_operand={max_operand}: give the largest operand, a whole number 0 or more.")
    if not operations:
        raise UserError(f"data.builtin.operations is empty: give one or more of {', '.join(TEMPLATES)}.")
    unknown = set(operations) - set(TEMPLATES)
    if unknown:
        raise UserError(f"data.builtin.operations: {sorted(unknown)} unknown; choose from {sorted(TEMPLATES)}.")


def generate(
    size: int,
    seed: int,
    max_operand: int = 50,
    operations: list[str] | tuple[str, ...] = ("add", "sub", "mul"),
) -> list[dict[str, Any]]:
    """`size` problems as {"input": question, "output": answer} records."""
    check_options(max_operand, operations)
    rng = random.Random(seed)
    records = []
    for _ in range(size):
        op = rng.choice(list(operations))
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "sub" and b > a:
            a, b = b, a
        if op == "mul":
            a, b = rng.randint(1, 12), rng.randint(1, max(2, max_operand // 4))
        answer = {"add": a + b, "sub": a - b, "mul": a * b}[op]
        question = rng.choice(TEMPLATES[op]).format(n=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
        records.append({"input": question, "output": str(answer)})
    return records
