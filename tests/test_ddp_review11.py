"""Paired data and diffusion under DDP: the logged train/loss is the ranks' mean, a run resumed mid-epoch finishes
that epoch rather than starting it over, a diffusion model's val/loss is every held-out image's, and each rank draws
its own diffusion noise."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from conftest import compose
from test_ddp_shares import PAIRS
from test_diffusion import TINY_UNET, write_images
from test_distributed_review import two_ranks

from onn.modalities.diffusion.tasks import build, datamodule
from onn.modalities.pairs.demo import write_shapes

_RESUMED_RANK = """
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
import torch.distributed as dist
from conftest import compose
from onn.app import execute
from onn.modalities.diffusion import tasks as diffusion
from onn.modalities.pairs import tasks as pairs
from onn.training.checkpoints import load

rank, folder, overrides = int(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
counted = []  # (the trainer, the schedule's length the task gave its module)


def recorded(real):
    def called(trainer, *args, **kwargs):
        counted.append((trainer, real(trainer, *args, **kwargs)))
        return counted[-1][1]
    return called


pairs.optimizer_steps = recorded(pairs.optimizer_steps)
diffusion.optimizer_steps = recorded(diffusion.optimizer_steps)
common = (
    "hardware=cpu_16gb", "tracking=csv", "trainer.enable_progress_bar=false", "strategy.precision=32-true",
    "trainer.devices=2", "strategy.timeout_s=120", "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=50", "optim.warmup_steps=0", f"paths.outputs={folder / 'outputs'}",
    f"paths.cache={folder / 'cache'}", *overrides,
)
first = execute(compose(*common, "trainer.max_steps=1", "trainer.max_epochs=1"), folder / "first")
saved = load(folder / "first" / "checkpoints" / "last.ckpt")["onn"]["train_losses"]
given = {"trainer.max_steps", "trainer.max_epochs"}
resumed = execute(
    compose(*common, f"ckpt={folder / 'first'}", "trainer.max_steps=-1", "trainer.max_epochs=1"), folder / "resumed",
    given,
)
if dist.is_initialized():
    dist.destroy_process_group()
print(json.dumps({"first_steps": first["steps"], "saved": saved, "steps": resumed["steps"],
                  "val_loss": resumed.get("val/loss_final"), "schedule": [n for _, n in counted],
                  "lightning": [trainer.estimated_stepping_batches for trainer, _ in counted]}))
"""


def logged_losses(run_dir: Path) -> list[float]:
    """train/loss as the run's CSV logger (rank 0's) wrote it, one per logged step."""
    with open(run_dir / "csv" / "metrics.csv") as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


def resumed_runs(folder: Path, *overrides: str) -> list[dict]:
    import json

    return two_ranks(_RESUMED_RANK, str(folder), json.dumps(list(overrides)))


@pytest.mark.slow  # two fresh interpreters train, resume and validate a dual encoder twice: ~2 min on 2 busy cores
def test_paired_data_under_ddp_logs_the_ranks_mean_and_counts_the_schedule_per_rank(tmp_path: Path):
    """9 training pairs on 2 ranks in batches of 2: 2 steps an epoch each. The logged train/loss was rank 0's own
    batch's (each rank's contrastive loss ranks only its own pairs), not the ranks' mean the checkpoint keeps. And the
    task gave no schedule length under DDP, so configure_optimizers asked Lightning's estimated_stepping_batches,
    which sets the data up before a resumed run's loop state is restored; a run stopped after step 1 and resumed
    trains the epoch's second step only."""
    shapes = write_shapes(tmp_path / "shapes", 12, seed=0, size=16)
    outs = resumed_runs(tmp_path, *PAIRS, f"data.source={shapes}")
    for out in outs:
        assert out["first_steps"] == 1
        assert out["steps"] == 2  # the epoch's second step only
        assert out["schedule"] == out["lightning"] == [1, 2]
    assert outs[0]["saved"] == pytest.approx(outs[1]["saved"])  # the ranks' mean, on each
    assert logged_losses(tmp_path / "first") == pytest.approx(outs[0]["saved"], abs=1e-5)


@pytest.mark.slow  # two fresh interpreters train, resume, validate and sample a tiny UNet twice: ~3 min on 2 busy cores
def test_diffusion_under_ddp_logs_the_ranks_mean_validates_every_image_and_counts_per_rank(tmp_path: Path):
    """18 training images on 2 ranks in batches of 4: 2 steps an epoch each. The logged train/loss was rank 0's
    share's; val/loss (the history, best.ckpt's choice) each rank's own share of the held-out images; the batches
    were counted as one process's (4 an epoch), so trainer.val_check_interval=50 was capped at 4 steps and a one-epoch
    run never validated, and the task gave no schedule length (Lightning's estimated_stepping_batches was asked)."""
    images = write_images(tmp_path / "pictures", per_class=12, size=8)
    diffusion = ("data=diffusion", *TINY_UNET, f"data.source={images}", "data.batch_size=4", "data.val_split=0.25")
    outs = resumed_runs(tmp_path, *diffusion, "task.samples=2", "task.sample_steps=2", "data.eval_batch_size=2")
    for out in outs:
        assert out["first_steps"] == 1
        assert out["steps"] == 2
        assert out["schedule"] == out["lightning"] == [1, 2]
    assert outs[0]["val_loss"] is not None  # trainer.val_check_interval=50 capped at one rank's epoch, not 4 steps
    assert outs[0]["val_loss"] == pytest.approx(outs[1]["val_loss"], rel=1e-6)  # every held-out image's, on each
    assert logged_losses(tmp_path / "first") == pytest.approx(outs[0]["saved"], abs=1e-5)


_NOISE_RANK = """
import json, sys
import lightning as L
import torch
sys.path.insert(0, "tests")
from conftest import compose
from test_ddp_review11 import diffusion_module
from onn.training.trainer import data_parallel

rank, source, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dm, module = diffusion_module(source, cache)


class Drawn(L.Callback):
    def __init__(self):
        self.timesteps = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.timesteps += module.noisy(batch[0])["timestep"].tolist()  # what this rank's step draws next


drawn = Drawn()
trainer = L.Trainer(
    accelerator="cpu", devices=2, max_steps=1, callbacks=[drawn], logger=False, limit_val_batches=0,
    strategy=data_parallel("ddp", compose("strategy=ddp", "trainer.devices=2"), "cpu"),
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(module, datamodule=dm)
print(json.dumps({"timesteps": drawn.timesteps}))
torch.distributed.destroy_process_group()
"""


def diffusion_module(source: str, cache: str):
    """The image data and a tiny UNet's DiffusionModule, as diffusion's train builds them (seeded alike)."""
    config = compose("data=diffusion", *TINY_UNET, f"data.source={source}", f"paths.cache={cache}", "data.batch_size=8")
    dm = datamodule(config, "cpu")
    inputs = {"input_shape": list(dm.input_shape), "classes": dm.classes, "seed": int(config.seed)}
    return dm, build(config, inputs)


@pytest.mark.slow  # two fresh interpreters form a gloo group and take one step: ~20 s
def test_each_diffusion_rank_draws_its_own_timesteps(tmp_path: Path):
    """build seeds every rank alike, so each drew the same timesteps and noise for its own images: a global batch
    of 2 x 8 images held 8 timesteps, each twice."""
    images = write_images(tmp_path / "pictures", per_class=12, size=8)
    outs = two_ranks(_NOISE_RANK, str(images), str(tmp_path / "cache"))
    assert len(outs[0]["timesteps"]) == len(outs[1]["timesteps"]) == 8
    assert outs[0]["timesteps"] != outs[1]["timesteps"]
