"""A text checkpoint keeps its run's seed, and streaming refuses a MoE's router loss in one sentence.

The seed picks the records held out of training (sources.load_splits) and the training order; a text checkpoint saved
none, so task=eval ckpt=RUN (and a resumed run) without seed= held out another split, scoring records the model had
trained on. Streaming a Mixtral with output_router_logits=true failed mid-step with an IndexError in transformers'
load_balancing_loss_func: the suffix's forward runs the blocks as stubs, so no router logits are recorded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import execute_run

from onn.errors import UserError
from onn.training.checkpoints import saved_config

COMMON = (
    "data=text",
    "data.val_split=0.25",
    "data.max_length=48",
    "data.batch_size=4",
    "task.validate_before=false",
    "task.exact_match_samples=0",
)


def corpus(path: Path) -> Path:
    """Twenty plain-text records, each unlike the others (lengths and words), so two held-out splits score apart."""
    words = ["river", "mill", "stone", "lantern", "harbour", "orchard", "quarry", "meadow", "ferry", "bell"]
    lines = [
        {"text": f"Record {i}: the {words[i % 10]} " + "and the " * (i % 5) + words[(3 * i) % 10]} for i in range(20)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.slow  # two runs: ~30 s on a shared CPU
def test_eval_of_a_checkpoint_scores_the_split_its_run_held_out(tmp_path: Path):
    """Trained with seed=3, evaluated with ckpt=RUN and no seed=: the val loss is the run's last one (the same model
    on the same held-out records); before, eval held out seed 0's split, records the run had trained on."""
    cache, source = tmp_path / "cache", corpus(tmp_path / "corpus.jsonl")
    trained = execute_run(tmp_path, cache, *COMMON, f"data.source={source}", "trainer.max_steps=1", "seed=3")
    assert saved_config(tmp_path / "run" / "checkpoints" / "last.ckpt")["seed"] == 3
    scored = execute_run(tmp_path, cache, "task=eval", f"ckpt={tmp_path / 'run'}", name="eval")
    assert scored["data/val_records"] == trained["data/val_records"] == 3  # seed 3 draws 3 of 20
    assert scored["val/loss"] == pytest.approx(trained["val/loss_final"], rel=1e-6, abs=0)


def test_streaming_a_moe_with_its_router_loss_on_is_one_sentence(tmp_path: Path):
    """A tiny Mixtral (LoRA on its blocks, frozen weights in a disk store) with output_router_logits=true: refused
    naming the key, where a training step raised IndexError; with it off, the same model streams a step."""
    import transformers as tf

    from onn.config.strategy import LoraConfig, StrategyConfig
    from onn.models.layers import discover
    from onn.streaming.engine import StreamingEngine
    from onn.streaming.store import LayerStore
    from onn.training.lora import apply

    torch.manual_seed(0)
    config = tf.MixtralConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.5,
    )
    model = tf.MixtralForCausalLM(config).float().train()
    lora = StrategyConfig(name="sparse_lora", lora=LoraConfig(r=2, alpha=4, dropout=0.0, target_modules="all-linear"))
    model = apply(model, "sparse_lora", lora, discover(model), [1], task_type=None)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def step() -> float:
        engine = StreamingEngine(model, discover(model), LayerStore("disk", "float32", folder=tmp_path), 1)
        try:
            engine.offload()
            return float(engine.train_step([batch]))
        finally:
            engine.close()

    with pytest.raises(UserError, match=r"output_router_logits=true.*output_router_logits=false"):
        step()
    config.output_router_logits = False  # the refusal is of the router loss alone: the same MoE streams without it
    assert math.isfinite(step())
