"""Checkpoints at their edges, as a review of them found them (2026-12-05): an epoch-based run that wrote no
last.ckpt at its epochs' ends, a sharded FSDP checkpoint's pickles handed to Lightning's loader, an edited meta.json
without its modality, and a save killed between its two renames."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import compose

from onn.errors import UserError


def test_an_epoch_based_run_writes_last_ckpt_at_each_epochs_end(tmp_path):
    """Lightning's save_last writes only when its callback saved a checkpoint at that step, and ONN's had
    save_top_k=0: with a step interval the epochs' batches never reached, a run killed after seven epochs held no
    last.ckpt, and `ckpt=last` resumed another run."""
    from onn.training.callbacks import epoch_checkpoints
    from onn.training.checkpoint_io import SafetensorsCheckpointIO
    from onn.training.classifier import Classifier

    seen: list[bool] = []

    class Look(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            seen.append((tmp_path / "checkpoints" / "last.ckpt" / "meta.json").is_file())

    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    data = torch.utils.data.DataLoader([(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)], batch_size=None)
    optim = compose("optim.name=sgd", "optim.lr=0.1", "optim.schedule=constant", "optim.warmup_steps=0").optim
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[SafetensorsCheckpointIO()],
        callbacks=[*epoch_checkpoints(tmp_path, "val/acc", "max", every_n_steps=1000), Look()],
    )
    module = Classifier(torch.nn.Linear(4, 3), ["a", "b", "c"], optim, {})
    trainer.fit(module, train_dataloaders=data, val_dataloaders=data)
    assert seen == [False, True, True]  # after the first epoch's end, and the second's


def test_a_sharded_fsdp_checkpoints_pickles_are_never_loaded(tmp_path):
    """An ONN checkpoint folder that also held meta.pt went to Lightning's sharded loader, which unpickled it."""
    from onn.training.distributed import ShardedFSDP

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "meta.json").write_text("{}")
    torch.save({"x": 1}, folder / "meta.pt")  # what Lightning's sharded format holds: a pickle
    strategy = ShardedFSDP()
    with pytest.raises(UserError, match=r"is not an ONN checkpoint folder \(safetensors\): ONN loads no pickle"):
        strategy.load_checkpoint(folder)


def test_an_edited_meta_json_without_its_modality_is_one_sentence(tmp_path):
    """task=eval of a checkpoint whose meta.json lost `modality` (or model, strategy, data) ended in a KeyError."""
    from onn.training.checkpoints import saved_config

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"onn": {"config": {"model": {}, "strategy": {}, "data": {}}}}))
    for modality in (None, "image"):
        with pytest.raises(UserError, match=r"holds a damaged ONN run config; use a checkpoint folder ONN wrote"):
            saved_config(folder, modality)


def test_a_save_killed_between_its_renames_still_resolves_to_the_previous_checkpoint(tmp_path):
    """A SIGKILL between `last.ckpt -> last.ckpt.old` and the new one's rename left only last.ckpt.old, which
    resolve never looked at: the run could not be resumed."""
    from onn.training.checkpoints import resolve

    old = tmp_path / "run" / "checkpoints" / "last.ckpt.old"
    old.mkdir(parents=True)
    (old / "meta.json").write_text("{}")
    assert resolve(str(tmp_path / "run"), tmp_path) == old
    shutil.copytree(old, old.with_name("last.ckpt"))
    assert resolve(str(tmp_path / "run"), tmp_path) == old.with_name("last.ckpt")  # a whole one comes first


def tiny_lm(max_steps: int = 8):
    """A two-layer Llama in ONN's CausalLM, trained with SGD at a constant rate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from onn.modalities.text.module import CausalLM

    torch.manual_seed(0)
    shape = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    config = LlamaConfig(**shape, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    optim = compose("optim.name=sgd", "optim.lr=0.1", "optim.schedule=constant", "optim.warmup_steps=0").optim
    return CausalLM(LlamaForCausalLM(config), optim, max_steps=max_steps, onn_config={}, micro_batch=4)


def token_batch(seed: int = 1, rows: int = 4, width: int = 12) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (rows, width), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@pytest.mark.parametrize(("per_epoch", "validates"), [(4, False), (8, True)])
def test_a_step_checkpoint_waits_for_its_validation_and_its_epochs_end(tmp_path, per_epoch, validates):
    """A text run's step checkpoint that fell on an epoch's last batch was never written (its save was left to
    an epoch-end saver only classifiers have), and one taken at a step Lightning validates after was written before
    that validation: the resumed run never validated that step, and ended with one validation loss fewer."""
    from onn.training.callbacks import StepCheckpoint
    from onn.training.checkpoint_io import SafetensorsCheckpointIO

    copy = tmp_path / "at_step_4.ckpt"

    class Copy(L.Callback):  # last.ckpt as the run left it after step 4, before step 5 starts
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 4 and not copy.exists():
                shutil.copytree(tmp_path / trainer.default_root_dir / "last.ckpt", copy)

    def fit(name: str, ckpt: Path | None = None):
        module = tiny_lm()
        trainer = L.Trainer(
            max_steps=8,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(tmp_path / name),
            plugins=[SafetensorsCheckpointIO()],
            callbacks=[StepCheckpoint(tmp_path / name, every_n_steps=4), Copy()],
            val_check_interval=4,
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
        )
        batches = torch.utils.data.DataLoader([token_batch()] * per_epoch, batch_size=None)  # the same every step
        held_out = torch.utils.data.DataLoader([token_batch(seed=2)], batch_size=None) if validates else None
        trainer.fit(module, train_dataloaders=batches, val_dataloaders=held_out, ckpt_path=ckpt)
        return module, trainer

    whole, whole_trainer = fit("whole")
    assert copy.is_dir(), "no checkpoint was written at step 4"
    resumed, resumed_trainer = fit("resumed", ckpt=copy)
    assert resumed_trainer.global_step == 8 and resumed_trainer.current_epoch == whole_trainer.current_epoch
    assert resumed.train_losses == pytest.approx(whole.train_losses, abs=1e-6)
    assert len(whole.val_losses) == (2 if validates else 0)
    assert resumed.val_losses == pytest.approx(whole.val_losses, abs=1e-6)


def test_a_step_interval_below_one_is_one_sentence():
    """checkpoint.every_n_steps=0 or -5 checkpointed every step."""
    from onn.training.callbacks import StepCheckpoint

    for steps in (0, -5):
        with pytest.raises(UserError, match=rf"checkpoint.every_n_steps={steps}: give a whole number .* 1 or more"):
            StepCheckpoint("checkpoints", steps)
