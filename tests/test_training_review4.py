"""The training area's fourth review: evaluation and AdaBN (task.adapt_norm) under DDP. Lightning's DistributedSampler
pads a validation or test split to a multiple of the ranks by repeating samples, so DDP's figures were not one
process's on the same checkpoint and data; AdaBN measured the repeats too, and a model's SyncBatchNorm made its
measuring a collective per batch (refused on a CPU, waited on for ever on a GPU when ranks ran different counts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compose, read_metrics, run_cli
from test_distributed_review import two_ranks
from test_vision_train import make_images
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from onn.training.distributed import evaluated_once


def rank_indices(loader: DataLoader) -> list[int]:
    return list(iter(loader.sampler))


def test_evaluation_shares_a_split_over_the_ranks_without_repeats():
    """Lightning's padding sampler over 5 samples on 2 ranks gives rank 1 sample 0 again; evaluated_once gives each
    sample to one rank only. A split with fewer samples than ranks keeps the padding: every rank needs a batch for
    DDP's first evaluation forward, which syncs buffers."""
    from lightning.pytorch.trainer.states import RunningStage

    data = TensorDataset(torch.arange(5))
    shares = []
    for rank in range(2):
        padded = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, rank, shuffle=False))
        shares.append(rank_indices(evaluated_once(padded, RunningStage.TESTING)))
    assert shares == [[0, 2, 4], [1, 3]]
    one = TensorDataset(torch.arange(1))
    tiny = DataLoader(one, sampler=DistributedSampler(one, 2, 1, shuffle=False))
    assert rank_indices(evaluated_once(tiny, RunningStage.TESTING)) == [0]


@pytest.mark.slow  # a short training, then task=eval by one process and by two (Lightning's launcher): ~90 s
def test_task_eval_under_ddp_gives_one_processs_figures(tmp_path: Path):
    """task=eval trainer.devices=2 on streamed data (a DataLoader, which Lightning gives its DistributedSampler)
    scored 22 test samples of 21, the first one twice: test/loss 0.01489 against one process's 0.0156 on the same
    checkpoint. Each sample is scored once now, and the figures are one process's."""
    from onn.app import execute

    images = make_images(tmp_path / "images", train=12, test=7)  # 21 test images: odd over 2 ranks
    common = (
        "model=v28_cnn",
        "data=image",
        f"data.source={images}",
        "hardware=cpu_16gb",
        "tracking=none",
        "trainer.enable_progress_bar=false",
        f"paths.outputs={tmp_path / 'outputs'}",
        f"paths.cache={tmp_path / 'cache'}",
        "data.eval_batch_size=4",
        "data.val_split=0.25",
    )
    trained = tmp_path / "trained"
    trained.mkdir()
    training = ("optim.name=sgd", "optim.lr=0.1", "optim.warmup_steps=0", "trainer.max_steps=-1")
    execute(compose(*common, *training, "data.batch_size=8", "trainer.max_epochs=8"), trained)
    figures = []
    for devices in (1, 2):
        run_dir = tmp_path / f"eval{devices}"
        evaluated = run_cli(
            *common, "task=eval", f"ckpt={trained}", "data.resident=false", f"trainer.devices={devices}",
            f"hydra.run.dir={run_dir}", timeout=300,
        )  # fmt: skip
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        figures.append(read_metrics(run_dir))
    one, two = figures
    for key in ("val/acc", "val/acc_top5", "test/acc", "test/acc_top5"):
        assert two[key] == one[key], key
    for key in ("val/loss", "test/loss"):
        assert two[key] == pytest.approx(one[key], rel=1e-4), key


@pytest.mark.slow  # a short training, then task=eval by two processes twice (Lightning's launcher): ~80 s
def test_a_fraction_of_the_test_batches_under_ddp_ends_on_every_rank(tmp_path: Path):
    """21 test images in batches of 5 over 2 ranks: shares of 11 and 10, 3 batches and 2. With
    trainer.limit_test_batches=0.4 Lightning keeps int(3 x 0.4) = 1 and int(2 x 0.4) = 0, refused on rank 1 while
    rank 0 waited in DDP's collectives; such an evaluation keeps shares of equal length, streamed or resident."""
    from onn.app import execute

    images = make_images(tmp_path / "images", train=6, test=7)
    common = (
        *("model=v28_cnn", "data=image", f"data.source={images}", "hardware=cpu_16gb", "tracking=none"),
        *("trainer.enable_progress_bar=false", f"paths.outputs={tmp_path / 'outputs'}"),
        *(f"paths.cache={tmp_path / 'cache'}", "data.eval_batch_size=5", "data.val_split=0.25"),
    )
    trained = tmp_path / "trained"
    trained.mkdir()
    execute(compose(*common, "data.batch_size=8", "trainer.max_epochs=1"), trained)
    for resident in ("false", "true"):
        run_dir = tmp_path / f"eval_{resident}"
        evaluated = run_cli(
            *common, "task=eval", f"ckpt={trained}", f"data.resident={resident}", "trainer.devices=2",
            "trainer.limit_test_batches=0.4", "strategy.timeout_s=60", f"hydra.run.dir={run_dir}", timeout=300,
        )  # fmt: skip
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        assert read_metrics(run_dir)["status"] == "ok"


_ADABN_TEST_RANK = """
import json, sys
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
sys.path.insert(0, "tests")
from conftest import compose
from test_training_review4 import batchnorm_cnn, shifted_images
from test_training_review2 import OPTIM
from onn.training.classifier import Classifier
from onn.training.trainer import data_parallel


class Measured(L.Callback):
    def on_test_start(self, trainer, module):
        self.seen = module.adapt_batch_norm(trainer.test_dataloaders)  # what task.adapt_norm runs on them

    def on_test_epoch_end(self, trainer, module):
        self.mean = module.model[1].running_mean.tolist()  # before the trained statistics come back


measured = Measured()
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy=data_parallel("ddp", compose("strategy=ddp", "trainer.devices=2"), "cpu"),
    callbacks=[measured], logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False,
)
network = torch.nn.SyncBatchNorm.convert_sync_batchnorm(batchnorm_cnn())
module = Classifier(network, ["a", "b"], OPTIM, {}, adapt_norm=True)
trainer.test(module, dataloaders=DataLoader(TensorDataset(*shifted_images()), batch_size=2), verbose=False)
tested = int(module.confusion["test"].sum())
print(json.dumps({"seen": measured.seen, "tested": tested, "mean": measured.mean}))
"""


def batchnorm_cnn() -> torch.nn.Module:
    """A tiny CNN whose one norm normalises an 8x8 map: a batch of one sample is measured too."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 2),
    )


def shifted_images() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(5, 3, 8, 8) + 3.0, torch.randint(0, 2, (5,))


@pytest.mark.slow  # two fresh interpreters import torch and Lightning and set up a process group: ~20 s
def test_adabn_under_ddp_measures_each_test_sample_once_and_syncbatchnorm_locally():
    """A model with SyncBatchNorm (a user's model.source) tested with task.adapt_norm under DDP on 5 samples in
    batches of 2: AdaBN's forwards in training mode were SyncBatchNorm collectives, which a CPU refuses ("expected
    input tensor to be on GPU") and which on a GPU wait for ever once rank 0 runs two batches and rank 1 one. Each
    rank measures its own batches now and the ranks combine once; no sample is scored or measured twice (Lightning's
    padding gave rank 1 sample 0 again: 6 of 5), and the norm's mean is one process's over batches of 2."""
    from test_training_review2 import OPTIM

    from onn.training.classifier import Classifier

    outs = two_ranks(_ADABN_TEST_RANK)
    network = batchnorm_cnn()
    x, y = shifted_images()
    batches = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 5, 2)]
    assert Classifier(network, ["a", "b"], OPTIM, {}).adapt_batch_norm(batches) == 5
    want = network[1].running_mean
    for out in outs:
        assert out["seen"] == 5 and out["tested"] == 5, out
        torch.testing.assert_close(torch.tensor(out["mean"]), want)
