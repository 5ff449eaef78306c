"""The README's command lines as a new user runs them: what they compose to."""

from __future__ import annotations

from conftest import compose

from onn.modalities.text.datamodule import TextDataModule, encode_counted
from onn.models.tokenizer import byte_tokenizer


def test_phi4_math_recipe_keeps_every_builtin_problem_whole():
    """`python run.py recipe=phi4_math_sparse_lora` set data.max_length=96, which cut 532 of its 4,000 built-in
    problems from the left (their question's start lost) and warned so on the README's own recipe line."""
    cfg = compose("recipe=phi4_math_sparse_lora")
    data = TextDataModule(cfg.data, byte_tokenizer(), cfg.data.batch_size, seed=cfg.seed)
    data.setup()
    special = data.prompter.add_special_tokens
    examples = data.train_examples + data.val_examples
    longest = max(encode_counted(data.tokenizer, prompt, answer, 10**6, special)[2] for prompt, answer in examples)
    assert longest <= cfg.data.max_length, f"the longest problem has {longest} tokens"
