"""Keys a bad-input review (2026-12-07) found used without a check: task=plan said ok for a run that then failed
with a raw traceback (model.dtype, strategy.lora.dropout, task.label_smoothing, data.builtin.*, data.num_workers,
strategy.min_micro_batch) or read a text data.source that does not exist without a word; and a value Hydra's
grammar cannot read got its lexer's message. Each is one sentence naming the key now, from task=plan too."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import compose

from onn.errors import UserError

PLAN = ("task=plan", "hardware=cpu_16gb", "tracking=none")


def _plan(tmp_path: Path, *overrides: str) -> None:
    """task=plan of `overrides`, in this process, as run.py runs it."""
    from onn.app import execute

    config = compose(*overrides, *PLAN, f"paths.outputs={tmp_path}")
    execute(config, tmp_path / "run", set())


@pytest.mark.parametrize(
    "overrides, sentence",
    [
        (["model.dtype=float33"], r"^model\.dtype='float33': give auto or one of float32, bfloat16, float16\.$"),
        (["strategy=lora", "strategy.lora.dropout=1.5"], r"^strategy\.lora\.dropout=1\.5: give the share"),
        (["strategy=lora", "strategy.lora.dropout=-0.1"], r"^strategy\.lora\.dropout=-0\.1: give the share"),
        (["data.builtin.max_operand=-1"], r"^data\.builtin\.max_operand=-1: give the largest operand"),
        (["data.builtin.operations=[]"], r"^data\.builtin\.operations is empty: give one or more of add, sub, mul\.$"),
        (["data.builtin.operations=[div]"], r"^data\.builtin\.operations: \['div'\] unknown"),
        (["data.num_workers=-1"], r"^data\.num_workers=-1: give a whole number of loader workers"),
        (["strategy=full", "strategy.min_micro_batch=0"], r"^strategy\.min_micro_batch=0: give the smallest"),
    ],
)
def test_a_text_plan_refuses_the_key(tmp_path, overrides, sentence):
    with pytest.raises(UserError, match=sentence):
        _plan(tmp_path, *overrides)


def test_a_text_plan_refuses_a_data_source_that_does_not_exist(tmp_path):
    """It said `plan ok` (the file was read once training started); an existing file still plans."""
    missing = tmp_path / "x.jsonl"
    with pytest.raises(UserError, match=rf"^data\.source {re.escape(str(missing))} does not exist"):
        _plan(tmp_path, "data=text", f"data.source={missing}")
    missing.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n' * 4)
    _plan(tmp_path, "data=text", f"data.source={missing}")


@pytest.mark.parametrize(
    "overrides, sentence",
    [
        (["task.label_smoothing=1.5"], r"^task\.label_smoothing=1\.5: give a share from 0 \(off\) to 1"),
        (["task.label_smoothing=-0.5"], r"^task\.label_smoothing=-0\.5: give a share from 0 \(off\) to 1"),
        (["task.mixup=-1"], r"^task\.mixup=-1"),  # refused when the model was built; by the plan now too
    ],
)
def test_a_classifier_plan_refuses_the_task_key(tmp_path, overrides, sentence):
    with pytest.raises(UserError, match=sentence):
        _plan(tmp_path, "recipe=mesh_primitives", *overrides)


@pytest.mark.parametrize("value", ["What's the capital of France?", "What is (17 + 25)?"])
def test_a_value_hydra_cannot_read_says_how_to_quote_it(value):
    """Hydra's lexer error named no fix; the sentence names the override, and its example, passed through bash,
    is one Hydra reads back as the value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from onn.config.registry import value_problem

    problem = value_problem(["task=infer", f"prompt={value}"])
    assert problem is not None and problem.startswith(f"prompt={value}: Hydra cannot read this value")
    example = re.search(r"e\.g\. (.+)\.$", problem)[1]
    typed = subprocess.run(["bash", "-c", f"printf %s {example}"], capture_output=True, text=True, check=True).stdout
    assert OverridesParser.create().parse_override(typed).value() == value
