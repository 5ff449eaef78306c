"""Checkpoints at their edges, as a review of them found them (2026-12-05): an epoch-based run that wrote no
last.ckpt at its epochs' ends, a sharded FSDP checkpoint's pickles handed to Lightning's loader, an edited meta.json
without its modality, and a save killed between its two renames."""

from __future__ import annotations

import json
import shutil

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
