"""task=infer's prompts file read as the model learned its records: an Alpaca-trained model's row holds its
instruction and its input, and both are the prompt (the row's first prompt field, the instruction, dropped the
input the model was trained to read after it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import execute_run
from test_prompts import AUTO, alpaca

from onn.errors import UserError
from onn.modalities.text.prompts import Prompter
from onn.models.tokenizer import byte_tokenizer


def test_an_alpaca_or_dolly_models_row_prompt_is_its_instruction_with_its_input():
    row = {"instruction": "Add 2 and 3.", "input": "Show the sum.", "id": 7}
    assert Prompter(AUTO, byte_tokenizer(), trained_layout="alpaca").row_prompt(row, "line 1") == (
        "Add 2 and 3.\n\nShow the sum."
    )
    assert Prompter(AUTO, byte_tokenizer(), trained_layout="alpaca").row_prompt({"instruction": "Hi"}, "l") == "Hi"
    dolly = {"instruction": "Sum", "context": "1 and 2"}
    assert Prompter(AUTO, byte_tokenizer(), trained_layout="dolly").row_prompt(dolly, "l") == "Sum\n\n1 and 2"
    assert Prompter(AUTO, byte_tokenizer(), trained_layout="pairs").row_prompt(row, "l") is None


@pytest.mark.slow
def test_infer_of_an_alpaca_model_sends_each_rows_input_with_its_instruction(tmp_path: Path):
    """Seen through the context check: a row whose input is longer than llama_tiny's 512 positions is refused by
    its line, where the instruction alone (what was sent before) fitted and was generated from."""
    cache = tmp_path / "cache"
    common = ("hardware=auto", "task.validate_before=false", "task.exact_match_samples=0")
    source = alpaca(tmp_path / "alpaca_data.json")
    trained = execute_run(tmp_path, cache, *common, "data=text", f"data.source={source}", "trainer.max_steps=1")
    assert trained["data/layout"] == "alpaca"
    rows = tmp_path / "prompts.jsonl"
    rows.write_text(
        json.dumps({"instruction": "Add 1 and 2.", "input": ""})
        + "\n"
        + json.dumps({"instruction": "Add 3 and 4.", "input": "4 " * 300})
        + "\n"
    )
    infer = ("task=infer", f"ckpt={tmp_path / 'run'}", f"task.input={rows}", "task.max_new_tokens=4")
    with pytest.raises(UserError, match=r"prompts.jsonl line 2: the prompt's \d+ tokens .* context of 512 tokens"):
        execute_run(tmp_path, cache, "hardware=auto", *infer, name="infer")
