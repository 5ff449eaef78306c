"""Training and model loading at their edges: the one-cycle schedule of a short or resumed run, a schedule under
trainer.limit_train_batches, QLoRA's cached base of a source that brings its own tokenizer, and a tokenizer with
nothing to pad with."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import compose, execute_run, tiny_llama
from test_vision_train import make_images

from onn.errors import UserError
from onn.modalities.text.module import CausalLM
from onn.training.checkpoint_io import SafetensorsCheckpointIO


def one_cycle_module(max_steps: int) -> CausalLM:
    """A tiny causal LM whose schedule is optim.schedule=onecycle (pct_start 0.25) over `max_steps` steps."""
    optim = compose("optim.schedule=onecycle", "optim.pct_start=0.25", "optim.lr=0.01").optim
    return CausalLM(tiny_llama(vocab_size=64), optim, max_steps, onn_config={}, micro_batch=4)


def token_batches(steps: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 10), generator=g)
        data.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    return torch.utils.data.DataLoader(data, batch_size=None)


class StepRates(L.Callback):
    """The learning rate each optimizer step used."""

    def __init__(self):
        self.rates: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.rates.append(optimizer.param_groups[0]["lr"])


def quiet_trainer(max_steps: int, rates: StepRates) -> L.Trainer:
    """A CPU Trainer that saves through ONN's safetensors CheckpointIO, as ONN's own Trainer does."""
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[rates],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[SafetensorsCheckpointIO()],
    )


def test_one_cycle_whose_warm_up_is_one_step_trains():
    """4 steps at pct_start=0.25 give OneCycleLR a warm-up of one step, over which it divided by zero when built."""
    rates = StepRates()
    quiet_trainer(4, rates).fit(one_cycle_module(max_steps=4), train_dataloaders=token_batches(4))
    assert len(rates.rates) == 4 and rates.rates[0] == pytest.approx(0.01)  # warmed up in its one step
    assert rates.rates == sorted(rates.rates, reverse=True) and rates.rates[-1] < 1e-6  # annealed to its floor


def test_one_cycle_resumed_with_more_steps_spans_the_longer_run(tmp_path):
    """A onecycle run resumed with a larger max_steps: the schedule's saved state held the first run's length, and
    the resumed run failed at its first step past it ("Tried to step 7 times")."""
    trainer = quiet_trainer(6, StepRates())
    trainer.fit(one_cycle_module(max_steps=6), train_dataloaders=token_batches(6))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    rates, resumed = StepRates(), one_cycle_module(max_steps=10)
    quiet_trainer(10, rates).fit(resumed, train_dataloaders=token_batches(10), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.global_step == 10 and len(rates.rates) == 4
    assert rates.rates == sorted(rates.rates, reverse=True) and rates.rates[-1] < 1e-6  # its floor at step 10


def final_learning_rate(run_dir: Path) -> float:
    """The learning rate the run's last checkpoint's schedule last set (its meta.json)."""
    meta = json.loads((run_dir / "checkpoints" / "last.ckpt" / "meta.json").read_text())
    schedulers = dict(meta["__dict__"])["lr_schedulers"]
    return dict(schedulers[0]["__dict__"])["_last_lr"][0]


def image_run(tmp_path: Path, *overrides: str) -> tuple[dict, Path]:
    from onn.app import execute

    images = tmp_path / "images"
    if not images.exists():
        make_images(images, train=16, test=4)
    cfg = compose(
        "model=v28_cnn",
        "data=image",
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
        f"data.source={images}",
        "data.batch_size=4",
        "data.val_split=0.25",
        "trainer.max_steps=-1",
        "trainer.max_epochs=2",
        "optim.schedule=cosine",
        "optim.warmup_steps=0",
        *overrides,
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return execute(cfg, run_dir), run_dir


def test_a_schedule_ends_where_limit_train_batches_ends_the_run(tmp_path):
    """trainer.limit_train_batches=2 of the 9 batches an epoch has, 2 epochs: 4 steps. The cosine schedule was sized
    for the whole epochs (18 steps), and the run ended at 0.88 of its learning rate instead of 0."""
    metrics, run_dir = image_run(tmp_path, "trainer.limit_train_batches=2")
    assert metrics["steps"] == 4
    assert final_learning_rate(run_dir) == pytest.approx(0.0, abs=1e-9)


def test_a_validation_interval_is_capped_by_the_limited_epoch(tmp_path):
    """A validation every 5 steps within each epoch (check_val_every_n_epoch=1) of 2 batches (limit_train_batches):
    capped by the whole epoch's 9 batches, it was Lightning's ValueError once the data and model were built."""
    metrics, _ = image_run(
        tmp_path, "trainer.limit_train_batches=2", "trainer.val_check_interval=5", "trainer.check_val_every_n_epoch=1"
    )
    assert metrics["steps"] == 4 and len(metrics["val/history"]) == 2  # each epoch's end


def test_a_limit_train_batches_fraction_below_one_batch_is_one_sentence(tmp_path):
    """0.05 of 9 batches is none: Lightning's MisconfigurationException and its traceback when fit began."""
    with pytest.raises(UserError, match=r"^trainer.limit_train_batches=0.05 of the 9 training batches an epoch has"):
        image_run(tmp_path, "trainer.limit_train_batches=0.05")


def test_a_validation_fraction_above_one_epoch_is_one_sentence(tmp_path):
    """trainer.val_check_interval=1.5 (a fraction of an epoch above one): Lightning's MisconfigurationException and
    its traceback once the data and model were built."""
    with pytest.raises(UserError, match=r"^trainer.val_check_interval=1.5: give a number of steps, or a fraction"):
        image_run(tmp_path, "trainer.val_check_interval=1.5")


BUILDER = """
def build():
    import transformers as tf
    from onn.models.tokenizer import byte_tokenizer

    config = tf.LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return tf.LlamaForCausalLM(config), byte_tokenizer()
"""


@pytest.mark.slow
def test_qlora_keeps_the_tokenizer_of_a_source_that_brings_its_own(tmp_path):
    """strategy=qlora on a source with its own tokenizer (a builder's, a GGUF's) and no model.tokenizer: the 4-bit
    base is written once into the cache, and the next run, reading it from there, had no tokenizer ("model has no
    tokenizer")."""
    from onn.hardware.profile import resolve
    from onn.modalities import get
    from onn.modalities.text.tasks import build

    (tmp_path / "builder.py").write_text(BUILDER)
    cfg = compose(
        "model=llama_tiny",
        "strategy=qlora",
        f"paths.cache={tmp_path / 'cache'}",
        f"model.source={tmp_path / 'builder.py'}:build",
        "model.tokenizer=null",
        "model.architecture=null",
    )
    plan, _ = get("text").plan(cfg, resolve(cfg.hardware, tmp_path / "cache", tmp_path))
    written = [build(cfg, plan)[1] for _ in range(2)]  # the second run reads the cached base
    assert [t("ab")["input_ids"] for t in written] == [[97, 98], [97, 98]]
    assert [t.pad_token_id for t in written] == [258, 258]  # the builder's <pad>


def test_a_tokenizer_with_neither_pad_nor_eos_token_is_one_sentence(tmp_path):
    """model.tokenizer a folder whose tokenizer has no special tokens at all: the batches were padded with None
    (torch.full's TypeError in the data loader's collate)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    bare = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    bare.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bare.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=bare).save_pretrained(tmp_path / "tokenizer")
    with pytest.raises(UserError, match=r"has neither a pad token nor an end-of-sequence token: give it an eos_token"):
        execute_run(tmp_path, tmp_path / "cache", "trainer.max_steps=2", f"model.tokenizer={tmp_path / 'tokenizer'}")


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_a_schedule_resumed_for_more_steps_sets_this_runs_rate_at_its_first_step(schedule):
    """A 2-step run resumed with max_steps=4: the schedule stretches to 4 steps (its state holds no length), but
    Lightning restores the optimizer first, with the 2-step run's rate (its warm-up over, the full rate), and the
    first resumed step trained at it where the 4-step schedule is half way up its warm-up."""
    from onn.training.optim import make_schedule

    optim = compose("optim.warmup_steps=100", f"optim.schedule={schedule}").optim

    def scheduled(total: int):
        weight = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.AdamW([weight], lr=0.004)
        return optimizer, make_schedule(optimizer, optim, total, "val/loss")["scheduler"]

    short, short_schedule = scheduled(2)
    for _ in range(2):
        short.step()
        short_schedule.step()
    longer, longer_schedule = scheduled(4)
    longer.load_state_dict(short.state_dict())  # Lightning's order: the optimizer, then its schedule
    longer_schedule.load_state_dict(short_schedule.state_dict())
    unbroken, unbroken_schedule = scheduled(4)
    for _ in range(2):
        unbroken.step()
        unbroken_schedule.step()
    # the third of the 4-step schedule's warm-up steps: 3/5 of the rate (make_schedule's warm-up)
    assert longer.param_groups[0]["lr"] == unbroken.param_groups[0]["lr"] == pytest.approx(0.0024)
    longer.step()
    longer_schedule.step()
    unbroken.step()
    unbroken_schedule.step()
    assert longer.param_groups[0]["lr"] == unbroken.param_groups[0]["lr"]


@pytest.mark.slow  # 14-28 s on 2 cores (ci133, ci135)
def test_a_resumed_run_draws_the_dropout_masks_of_the_unbroken_one(tmp_path):
    """Each iterator a DataLoader starts drew its base seed from torch's global generator, which LoRA's dropout draws
    from too: the resumed run starts a training iterator the unbroken run did not (and the shorter run validated
    where the unbroken one did not), so from the first resumed step the masks, and the losses, were others."""
    args = ("strategy=lora", "strategy.lora.dropout=0.1", "optim.schedule=constant", "optim.warmup_steps=0",
            "data=math", "data.max_length=32", "task.exact_match_samples=0", "task.validate_before=false")  # fmt: skip
    whole = execute_run(tmp_path, tmp_path / "cache", *args, "trainer.max_steps=3", name="whole")
    execute_run(tmp_path, tmp_path / "cache", *args, "trainer.max_steps=2", name="first")
    resumed = execute_run(
        tmp_path,
        tmp_path / "cache",
        *args,
        "trainer.max_steps=3",
        f"ckpt={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}",
        name="resumed",
        given={"trainer.max_steps", "ckpt"},
    )
    assert resumed["train/loss_curve"] == whole["train/loss_curve"]
