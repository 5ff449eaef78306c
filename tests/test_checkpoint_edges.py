"""Checkpoints at their edges, as a review of them found them (2026-12-05): an epoch-based run that wrote no
last.ckpt at its epochs' ends, a sharded FSDP checkpoint's pickles handed to Lightning's loader, an edited meta.json
without its modality, and a save killed between its two renames."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import compose

from onn.errors import UserError
from onn.training.checkpoints import load, save


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


def test_ckpt_last_and_a_requeue_find_a_last_ckpt_old_that_is_alone(tmp_path):
    """`ckpt=last` looked for checkpoints/last.ckpt alone: a run whose save was killed between its two renames (only
    last.ckpt.old left) was not found, and an older run's checkpoint was taken instead; a requeued SLURM job's
    newest_checkpoint missed it too. An .old beside a whole last.ckpt is the older of the two, and not taken."""
    from onn.training.checkpoints import resolve
    from onn.training.trainer import keep_newest_as_last, newest_checkpoint

    older = tmp_path / "older" / "checkpoints" / "last.ckpt"
    save({"x": torch.zeros(1)}, older)
    os.utime(older / "meta.json", (time.time() - 60, time.time() - 60))
    killed = tmp_path / "killed" / "checkpoints" / "last.ckpt.old"
    save({"x": torch.ones(1)}, killed)
    assert resolve("last", tmp_path) == killed
    assert newest_checkpoint(tmp_path / "killed") == killed
    keep_newest_as_last(tmp_path / "killed")  # what a run that ends puts back: its newest checkpoint as last.ckpt
    assert newest_checkpoint(tmp_path / "killed") == killed.with_name("last.ckpt") and not killed.exists()
    beside = tmp_path / "older" / "checkpoints" / "last.ckpt.old"  # newer, but a whole last.ckpt stands beside it
    save({"x": torch.ones(1)}, beside)
    assert resolve("last", tmp_path) == killed.with_name("last.ckpt")
    assert newest_checkpoint(tmp_path / "older") == older


def test_the_best_checkpoint_of_a_run_resumed_into_its_own_folder_is_kept(tmp_path):
    """A classifier resumed into its own folder (a sweep's job, a requeued SLURM job) whose earlier best score beat
    this run's: run_best removed checkpoints/best.ckpt, then copied it onto itself (FileNotFoundError)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from onn.training.checkpoints import run_best

    run = tmp_path / "run"
    history = [{"epoch": 0, "val/acc": 0.5}, {"epoch": 1, "val/acc": 0.75}]
    save({"state_dict": {"w": torch.ones(1)}, "onn": {"history": history}}, run / "checkpoints" / "best.ckpt")
    save({"state_dict": {"w": torch.zeros(1)}, "onn": {"history": history}}, run / "checkpoints" / "last.ckpt")
    callback = ModelCheckpoint(dirpath=run / "checkpoints")  # this run saved no best of its own
    path, score = run_best(callback, run / "checkpoints" / "last.ckpt", run, "val/acc", "max")
    assert path == str(run / "checkpoints" / "best.ckpt") and score == 0.75
    assert load(path)["state_dict"]["w"].item() == 1.0


@pytest.mark.slow
def test_a_checkpoint_write_that_safetensors_refuses_is_one_sentence_without_a_mount(tmp_path):
    """safetensors' writer raises its own SafetensorError for a write the system refuses, which save() let through
    as a traceback (it caught OSError only), leaving last.ckpt.tmp/ behind. A file size limit (RLIMIT_FSIZE) refuses
    the write here with no file system to mount: the sentence names the path, the tmp folder is gone and the earlier
    checkpoint loads."""
    import subprocess
    import sys

    script = f"""
import resource, signal, torch
from onn.errors import UserError
from onn.training.checkpoints import save
save({{"x": torch.zeros(4)}}, {str(tmp_path / "last.ckpt")!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a signal
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    save({{"x": torch.zeros(1 << 20)}}, {str(tmp_path / "last.ckpt")!r})
except UserError as e:
    print("UserError:", e)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"UserError: cannot write {tmp_path / 'last.ckpt'}: File too large; write checkpoints" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert load(tmp_path / "last.ckpt")["x"].shape == (4,)


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    """`folder` on a tmpfs of `size` (a full disk to write to); the test is skipped where mounting is not allowed."""
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here ({mounted.stderr.decode().strip()[:80]})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_a_checkpoint_on_a_full_disk_is_one_sentence_and_the_earlier_one_stays(tmp_path):
    """A run folder on a disk that filled: the next checkpoint's safetensors write raised SafetensorError ("No space
    left on device (os error 28)"), a 60-line traceback, and an empty last.ckpt.tmp/ stayed."""
    with small_disk(tmp_path / "disk", "2m") as disk:
        save({"x": torch.zeros(128 * 1024)}, disk / "last.ckpt")  # 0.5 MB: it fits
        with pytest.raises(UserError, match=r"cannot write .*/last.ckpt: the disk is full \(4.0 MB are needed and "):
            save({"x": torch.zeros(1024 * 1024)}, disk / "last.ckpt")
        assert sorted(p.name for p in disk.iterdir()) == ["last.ckpt"]
        assert load(disk / "last.ckpt")["x"].shape == (128 * 1024,)


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
