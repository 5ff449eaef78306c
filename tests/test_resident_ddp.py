"""Data held in memory (ResidentBatches) under DDP, and AdaBN's statistics (task.adapt_norm).

ResidentBatches is no DataLoader, so Lightning gave it no DistributedSampler: every rank trained on and scored the
whole split (a test image counted once per rank in the confusion matrix, and no speed-up). AdaBN set each norm's
running variance to the mean of its batches' variances, which leaves out the spread of the batches' means: on
class-sorted test data (one class per batch) far too small."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compose
from test_distributed_review import two_ranks
from test_vision_train import make_images

from onn.data.resident import ResidentBatches, Split, epoch_generator

OPTIM = compose("optim.name=sgd", "optim.lr=0.05", "optim.schedule=constant", "optim.warmup_steps=0").optim


def numbered_split(n: int) -> Split:
    return Split(torch.arange(n).unsqueeze(1), torch.arange(n), [f"s{i}" for i in range(n)])


def test_ranks_train_equal_shares_of_the_epoch_and_score_each_sample_once():
    """Two ranks' training batches are disjoint shares of the epoch's order (padded by its first samples to equal
    shares: every step is a collective), in batches of data.batch_size as a DataLoader's DistributedSampler gives
    them; an evaluation split is scored once over the ranks, one split smaller than the ranks padded."""
    n, batch = 21, 4
    ranks = [ResidentBatches(numbered_split(n), batch, shuffle=True, seed=3, drop_last=True, rank=r, world=2)
             for r in (0, 1)]  # fmt: skip
    trained = [[b.tolist() for _, b in loader] for loader in ranks]
    assert [len(loader) for loader in ranks] == [len(t) for t in trained] == [11 // batch] * 2
    assert all(len(b) == batch for t in trained for b in t)
    order = torch.randperm(n, generator=epoch_generator(3, 0)).tolist() + [-1]  # padded to 22
    shares = [order[0:8:2], order[1:8:2], order[8:16:2], order[9:16:2]]
    assert trained == [[shares[0], shares[2]], [shares[1], shares[3]]]

    scored = [y.tolist() for r in (0, 1) for _, y in ResidentBatches(numbered_split(n), batch, False, rank=r, world=2)]
    assert sorted(sum(scored, [])) == list(range(n))
    tiny = [[y.tolist() for _, y in ResidentBatches(numbered_split(1), batch, False, rank=r, world=2)] for r in (0, 1)]
    assert tiny == [[[0]], [[0]]]


def test_a_resumed_rank_goes_on_from_its_own_next_batch():
    """The place Lightning saves (rank 0's: every rank has run as many batches) resumes each rank's own share."""
    whole = [
        y.tolist() for _, y in ResidentBatches(numbered_split(40), 4, True, seed=1, drop_last=True, rank=1, world=2)
    ]
    first = ResidentBatches(numbered_split(40), 4, True, seed=1, drop_last=True, rank=1, world=2)
    batches = iter(first)
    next(batches), next(batches)
    resumed = ResidentBatches(numbered_split(40), 4, True, seed=1, drop_last=True, rank=1, world=2)
    resumed.load_state_dict(first.state_dict())
    assert [y.tolist() for _, y in resumed] == whole[2:]


def norm_first_cnn(classes: int) -> torch.nn.Module:
    """A tiny CNN whose one norm normalises the input pixels: AdaBN's statistics are the test images' own."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.BatchNorm2d(3),
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, classes),
    )


def test_adabn_measures_the_whole_test_sets_statistics_on_class_sorted_batches():
    """Three classes of shifted inputs in class order, batches of 4 (each one class): the norm's running variance
    was the mean of the batches' variances (about 1), while the test set's is about 25; it is the test set's own
    now, mean and unbiased variance, as the samples measured all at once give them."""
    from onn.training.classifier import Classifier

    torch.manual_seed(1)
    x = torch.cat([torch.randn(8, 3, 6, 6) + 6.0 * c for c in range(3)])
    labels = torch.arange(3).repeat_interleave(8)
    network = norm_first_cnn(3).eval()
    module = Classifier(network, ["a", "b", "c"], OPTIM, {})
    assert module.adapt_batch_norm([(x[i : i + 4], labels[i : i + 4]) for i in range(0, 24, 4)]) == 24
    norm = network[0]
    torch.testing.assert_close(norm.running_mean, x.mean((0, 2, 3)))
    torch.testing.assert_close(norm.running_var, x.var((0, 2, 3)))  # unbiased, as torch keeps it
    assert bool((x.var((0, 2, 3)) > 10).all())  # what the mean of the batches' variances (about 1) missed
    assert not norm.training and norm.momentum == 0.1 and int(norm.num_batches_tracked) == 6


def test_adabn_passes_over_an_empty_batch():
    """A BatchNorm in training mode takes a batch of no sample, whose moments are NaN: merged, they made every
    norm's statistics NaN. An empty batch measures nothing."""
    from onn.training.classifier import Classifier

    torch.manual_seed(2)
    x = torch.randn(8, 3, 6, 6) * 3 + 1
    labels = torch.zeros(8, dtype=torch.long)
    network = norm_first_cnn(3).eval()
    module = Classifier(network, ["a", "b", "c"], OPTIM, {})
    batches = [(x[:4], labels[:4]), (x[:0], labels[:0]), (x[4:], labels[4:])]
    assert module.adapt_batch_norm(batches) == 8
    torch.testing.assert_close(network[0].running_mean, x.mean((0, 2, 3)))
    torch.testing.assert_close(network[0].running_var, x.var((0, 2, 3)))


_RESIDENT_RANK = """
import json, sys
import lightning as L
import torch
sys.path.insert(0, "tests")
from conftest import compose
from test_resident_ddp import OPTIM, norm_first_cnn
from onn.modalities import get
from onn.training.classifier import Classifier
from onn.training.trainer import data_parallel

rank, source, cache, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]


class Seen(L.Callback):
    def __init__(self):
        self.first = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.first is None:
            self.first = batch[0].float().flatten(1).sum(1).tolist()  # the first batch's samples, told apart

    def on_test_epoch_end(self, trainer, module):
        norm = module.model[0]  # AdaBN's statistics, before the trained ones come back
        self.norm = [norm.running_mean.tolist(), norm.running_var.tolist()]


def data(*overrides):
    config = compose("model=v28_cnn", "data=image", f"data.source={source}", f"paths.cache={cache}",
                     "data.val_split=0.25", "data.num_workers=0", *overrides)
    dm = get("image").datamodule(config, "cpu")
    dm.setup()
    return dm


def trained(dm, seen=None):
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=1, callbacks=[seen] if seen else [], logger=False,
        strategy=data_parallel("ddp", compose("strategy=ddp", "trainer.devices=2"), "cpu"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    module = Classifier(norm_first_cnn(len(dm.classes)), dm.classes, OPTIM, {}, adapt_norm=True)
    trainer.fit(module, datamodule=dm)
    return trainer, module


seen = Seen()
trainer, module = trained(data("data.batch_size=4", "data.eval_batch_size=4", "data.resident=true"), seen)
tested = trainer.test(module, datamodule=trainer.datamodule, verbose=False)[0]
if rank == 0:
    torch.save(module.model.state_dict(), folder + "/weights.pt")
streamed, _ = trained(data("data.batch_size=16", "data.resident=false"))
print(json.dumps({"steps": trainer.global_step, "first": seen.first, "tested": tested, "norm": seen.norm,
                  "scored": int(module.confusion["test"].sum()), "streamed_steps": streamed.global_step}))
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow  # two fresh interpreters set up a gloo group and train an epoch twice: ~30 s
def test_resident_data_is_shared_over_ddp_ranks_as_a_dataloaders_is(tmp_path: Path):
    """A 2-process run on resident images: each rank trained every step on the whole split (the steps of one
    process, the same first batch on both ranks) and scored all 21 test images, so the confusion matrix counted 42.
    Each rank now trains its own share in batches of data.batch_size (half the steps, as a DataLoader's
    DistributedSampler gives a streamed run), and the test scores each image once: the figures, and AdaBN's
    statistics, are one process's on the same weights. A streamed split whose share per rank is under a batch
    trained no step (drop_last on the share); it trains one."""
    import lightning as L

    from onn.modalities import get
    from onn.training.classifier import Classifier

    images = make_images(tmp_path / "images", train=12, test=7)
    outs = two_ranks(_RESIDENT_RANK, str(images), str(tmp_path / "cache"), str(tmp_path))
    config = compose(
        "model=v28_cnn", "data=image", f"data.source={images}", f"paths.cache={tmp_path / 'cache'}",
        "data.val_split=0.25", "data.batch_size=4", "data.eval_batch_size=4", "data.resident=true",
    )  # fmt: skip
    dm = get("image").datamodule(config, "cpu")
    dm.setup()
    assert len(dm.splits["test"]) == 21
    share = -(-len(dm.splits["train"]) // 2)  # each rank's padded share, as DistributedSampler's (held-out: a draw)
    assert 4 <= share < 16  # a resident share of several batches; a streamed share under data.batch_size=16
    assert [out["steps"] for out in outs] == [share // 4] * 2  # one process: len(train) // 4
    assert outs[0]["first"] != outs[1]["first"]
    assert [out["streamed_steps"] for out in outs] == [1, 1]

    network = norm_first_cnn(len(dm.classes))
    network.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    module = Classifier(network, dm.classes, OPTIM, {}, adapt_norm=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    one = trainer.test(module, datamodule=dm, verbose=False)[0]
    pixels = dm.splits["test"].inputs.float()
    for out in outs:
        assert out["scored"] == 21
        assert out["tested"]["test/acc"] == one["test/acc"]
        assert out["tested"]["test/loss"] == pytest.approx(one["test/loss"], rel=1e-5)
        torch.testing.assert_close(torch.tensor(out["norm"][0]), pixels.mean((0, 2, 3)))
        torch.testing.assert_close(torch.tensor(out["norm"][1]), pixels.var((0, 2, 3)))
