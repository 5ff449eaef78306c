"""The training area's second review: AdaBN (task.adapt_norm) measured without waiting for the device and without
failing on a last batch of one sample, the dual encoder's logged temperature read after its step, and
task=infer's embeddings copied to a GPU from pinned memory."""

from __future__ import annotations

import csv
import logging
import math
from pathlib import Path

import pytest
import torch
from conftest import compose
from test_training import watched_trainer

from onn.hardware.waits import DeviceOps

OPTIM = compose("optim.name=sgd", "optim.lr=0.1", "optim.schedule=constant", "optim.warmup_steps=0").optim


def pooled_cnn() -> torch.nn.Module:
    """A tiny CNN whose second norm sees one value per channel and sample: its features pooled to 1x1."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.BatchNorm1d(4),
        torch.nn.Linear(4, 2),
    )


def image_batches(sizes: list[int], shift: float = 3.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(n, 3, 8, 8) + shift, torch.randint(0, 2, (n,))) for n in sizes]


def test_adabn_measures_the_mean_of_the_batches_without_reading_anything_back():
    """AdaBN set torch's cumulative average (momentum None), whose forward reads the norm's batch count back to
    the host (float(num_batches_tracked)): on a GPU a wait per norm and batch. The k-th batch goes in at momentum
    1/k instead: the same mean of the batches' statistics, and nothing read."""
    from onn.training.classifier import Classifier

    network = pooled_cnn().eval()
    module = Classifier(network, ["a", "b"], OPTIM, {})
    batches = image_batches([4, 4, 4])
    with DeviceOps(torch.device("cpu")) as ops:
        assert module.adapt_batch_norm(batches) == 12
    assert ops.waits == 0 and ops.ops > 0
    first = network[1]  # the first norm sees the inputs' convolution: its mean is the batches' means' mean
    with torch.no_grad():
        means = [network[0](x).mean((0, 2, 3)) for x, _ in batches]
    torch.testing.assert_close(first.running_mean, torch.stack(means).mean(0))
    assert not first.training and first.momentum == 0.1  # as it was


def test_adabn_leaves_out_a_last_batch_of_one_sample_and_says_so(caplog):
    """A test set of 5 in batches of 2: the last batch is one sample, whose pooled 1x1 features BatchNorm1d
    refused in training mode ("Expected more than 1 value per channel when training"), and task=eval with
    task.adapt_norm=true ended in that traceback. The batch is left out of the statistics (said once) and the test
    scores every sample; with no batch of two the trained statistics stay."""
    from onn.training.classifier import Classifier

    network = pooled_cnn()
    module = Classifier(network, ["a", "b"], OPTIM, {}, adapt_norm=True)
    batches = image_batches([2, 2, 1])
    with caplog.at_level(logging.WARNING, logger="onn"):
        tested = watched_trainer().test(module, dataloaders=torch.utils.data.DataLoader(batches, None), verbose=False)
    assert 0 <= tested[0]["test/acc"] <= 1 and math.isfinite(tested[0]["test/loss"])
    assert "1 sample(s) in batches of one left out of AdaBN's statistics" in caplog.text

    trained = {k: v.clone() for k, v in network.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="onn"):
        assert module.adapt_batch_norm(image_batches([1, 1])) == 0
    assert "no batch was measured, so the trained statistics are kept (set data.eval_batch_size to 2" in caplog.text
    for key, value in network.state_dict().items():
        assert torch.equal(value, trained[key]), key


def test_adabn_measures_batches_of_one_that_its_norms_take():
    """data.eval_batch_size=1 (large images on a small GPU): a BatchNorm2d over an 8x8 map takes a batch of one in
    training mode, so each is measured; only a norm with one value per channel refuses one (the first test)."""
    from onn.training.classifier import Classifier

    torch.manual_seed(0)
    network = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(256, 2)
    ).eval()
    module = Classifier(network, ["a", "b"], OPTIM, {})
    batches = image_batches([1, 1, 1])
    assert module.adapt_batch_norm(batches) == 3
    conv = network[0]
    means = torch.stack([conv(x).mean(dim=(0, 2, 3)) for x, _ in batches]).mean(0)
    assert torch.allclose(network[1].running_mean, means, atol=1e-5)


def test_a_dual_encoders_logging_step_reads_only_its_loss(tmp_path):
    """On a logging step the dual encoder read its temperature to the host (float(1 / scale)) inside the step, a
    second wait for the GPU beside the loss's, and Lightning copied that number back to the device, blocking.
    It logs the tensor: the loggers read it after the step, and the value written is the same."""
    from lightning.pytorch.loggers import CSVLogger

    from onn.modalities.pairs.module import DualEncoder

    cfg = compose("data=pairs", "model=dual_encoder", "model.temperature=0.05", "optim.warmup_steps=0")
    torch.manual_seed(0)
    towers = {"image": torch.nn.Linear(32, 16), "text": torch.nn.Linear(32, 16)}
    module = DualEncoder(towers, 16, cfg.model, cfg.optim, {})
    shared = torch.randn(3, 8, 32)
    batches = [(s, s + 0.2 * torch.randn_like(s)) for s in shared]
    counter, step = DeviceOps(torch.device("cpu")), module.training_step

    def counted(batch, batch_idx):
        with counter:
            return step(batch, batch_idx)

    module.training_step = counted
    trainer = watched_trainer(3, logger=CSVLogger(tmp_path, name="log"), log_every_n_steps=1)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, None))
    assert counter.waits == 3  # each step's loss, read to be logged (record.log_train_loss); nothing more
    rows = list(csv.DictReader(next(Path(tmp_path).rglob("metrics.csv")).open()))
    temperatures = [float(r["train/temperature"]) for r in rows if r.get("train/temperature")]
    assert len(temperatures) == 3 and all(t == pytest.approx(0.05, rel=0.2) for t in temperatures)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-to-GPU copies wait only on a GPU")
def test_adabn_and_infer_embeddings_copy_host_batches_to_the_gpu_without_waiting(tmp_path):
    """AdaBN's batches and task=infer's embedding batches went to the GPU by blocking copies from pageable memory:
    each waited for every kernel queued. From pinned memory, without waiting: under CUDA's sync debug mode
    "error" any wait raises (the embedding runs once first: a transform makes its constants on first use)."""
    from onn.modalities.pairs.demo import write_shapes
    from onn.modalities.pairs.sides import build_side, side_config
    from onn.modalities.pairs.tasks import build, embed_all
    from onn.training.classifier import Classifier

    module = Classifier(pooled_cnn(), ["a", "b"], OPTIM, {}).cuda()
    batches = image_batches([4, 4, 4])
    cfg = compose(
        "data=pairs",
        "model=dual_encoder",
        "data.sides.image.image_size=[16,16]",
        "data.sides.text.max_length=32",
        "model.feature_dim=16",
        "model.embed_dim=8",
    )
    sides = {n: build_side(n, side_config(n, cfg)) for n in ("image", "text")}
    encoder = build(cfg, sides).cuda().eval()
    folder = write_shapes(tmp_path / "shapes", 6, seed=0, size=16)
    items = {"image": sorted(folder.glob("*.png")), "text": sorted(folder.glob("*.txt"))}
    for name in items:
        embed_all(encoder, name, sides[name], items[name], torch.device("cuda"), 2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert module.adapt_batch_norm(batches) == 12
        embedded = {n: embed_all(encoder, n, sides[n], items[n], torch.device("cuda"), 2)[0] for n in items}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(e.shape == (6, 8) and e.is_cuda for e in embedded.values())
